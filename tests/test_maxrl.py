"""MaxRL math against hand-derived values and properties (reference notes §2.2-2.3 and the MaxRL test checklist)."""

import itertools
import math
import sys

import pytest
import torch
from conftest import load_algo
from loss_checks import assert_micro_batches_accumulate, assert_padding_changes_nothing, random_batch


@pytest.fixture(scope="module")
def maxrl():
    return load_algo("maxrl")


# --- advantages ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, k", [(4, 1), (8, 3), (16, 1), (16, 15), (5, 2)])
def test_k_successes_out_of_n(maxrl, n, k):
    rewards = torch.tensor([1.0] * k + [0.0] * (n - k))
    adv = maxrl.compute_advantages(rewards, group_size=n)
    # r̂ = K/N: successes (1 - K/N)/(K/N) = (N-K)/K, failures -(K/N)/(K/N) = -1, whatever the pass rate
    assert torch.allclose(adv[:k], torch.full((k,), (n - k) / k), rtol=1e-4)  # eps/r̂ <= 1.6e-5 here
    assert torch.allclose(adv[k:], torch.full((n - k,), -1.0), rtol=1e-4)
    assert adv.sum().abs().item() < 1e-4  # positive mass N-K = negative mass
    # Algorithm 1 / eq. 10 coefficient: Â_i / N = r_i/K - 1/N
    assert torch.allclose(adv / n, rewards / k - 1 / n, rtol=1e-4, atol=1e-6)


def test_all_fail_and_all_success_groups_give_exactly_zero(maxrl):
    adv = maxrl.compute_advantages(torch.tensor([0.0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0]), group_size=4)
    assert torch.equal(adv[:8], torch.zeros(8))  # 0/(0 + 1e-6) and 0/(1 + 1e-6), no NaN
    assert torch.allclose(adv[8:], torch.tensor([-1.0, 3.0, -1.0, -1.0]), rtol=1e-5)  # groups are independent


def test_mean_normaliser_differs_from_grpo_std(maxrl):
    # K = 1 of 16: GRPO (population std) would give √((1-p)/p) = √15 = 3.87 to the success; MaxRL 15
    adv = maxrl.compute_advantages(torch.tensor([1.0] + [0.0] * 15), group_size=16)
    assert adv[0].item() == pytest.approx(15.0, rel=1e-4)
    # the eps is 1e-6 and sits in the denominator only: (1 - 1/16) / (1/16 + 1e-6) = 14.99976
    assert adv[0].item() == pytest.approx(14.99976, abs=2e-5)


def test_input_checks(maxrl):
    with pytest.raises(ValueError, match="group_size"):
        maxrl.compute_advantages(torch.zeros(4), group_size=1)
    with pytest.raises(ValueError, match="groups of 3"):
        maxrl.compute_advantages(torch.zeros(4), group_size=3)
    with pytest.raises(ValueError, match=">= 0"):
        maxrl.compute_advantages(torch.tensor([-1.0, 1.0]), group_size=2)


# --- exact expectation of the estimator ----------------------------------------------------------------------


def expected_gradient(maxrl, p: float, n: int) -> float:
    """E over all 2^N outcomes of the update MaxRL makes for a 1-parameter Bernoulli policy p = σ(θ).

    Each outcome is a one-token "completion"; the ascent direction is -∇θ of the script's own loss
    (compute_advantages + policy_loss with the token mean over N tokens), i.e. (1/N) Σ Â_i ∇log π(z_i).
    """
    theta0 = math.log(p / (1 - p))
    total = 0.0
    for z in itertools.product([0.0, 1.0], repeat=n):
        theta = torch.tensor(theta0, dtype=torch.float64, requires_grad=True)
        rewards = torch.tensor(z, dtype=torch.float64)
        lp = torch.where(rewards > 0, torch.nn.functional.logsigmoid(theta), torch.nn.functional.logsigmoid(-theta))[
            :, None
        ]
        adv = maxrl.compute_advantages(rewards, n).double()
        loss, _ = maxrl.policy_loss(lp, lp.detach(), adv, torch.ones(n, 1))
        loss.backward()
        k = int(sum(z))
        total += p**k * (1 - p) ** (n - k) * -theta.grad.item()
    return total


def test_exact_enumeration_matches_truncated_ml_gradient_minus_the_k0_term(maxrl):
    # reference notes §2.3: p = 0.3, N = 4 gives 0.4599, while ∇J^(4) itself is 0.5319
    p, n = 0.3, 4
    dp = p * (1 - p)  # ∇θ p for p = σ(θ)
    grad_j = sum((1 - p) ** (k - 1) for k in range(1, n + 1)) * dp  # ∇J^(N) = Σ_{k<=N} (1-p)^(k-1) ∇p
    assert grad_j == pytest.approx(0.5319, abs=1e-4)
    assert expected_gradient(maxrl, p, n) == pytest.approx(0.4599, abs=1e-4)
    for p, n in ((0.3, 4), (0.1, 6), (0.7, 5), (0.05, 8)):
        dp = p * (1 - p)
        grad_j = (1 - (1 - p) ** n) / p * dp  # the closed form of the same sum: w_N(p) ∇p
        bias = (1 - p) ** (n - 1) * dp  # Algorithm 1 drops the K = 0 groups entirely
        assert expected_gradient(maxrl, p, n) == pytest.approx(grad_j - bias, rel=1e-5)
        # and it is not plain REINFORCE's ∇p (pass@1): the 1/p-type reweighting is there
        assert expected_gradient(maxrl, p, n) > dp * 1.05


# --- loss: gradient, aggregation, invariances ----------------------------------------------------------------


def test_gradient_is_minus_a_grad_logpi_over_the_token_count(maxrl):
    lp0 = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])
    lp = lp0.clone().requires_grad_()
    loss, metrics = maxrl.policy_loss(lp, lp0, torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 1, 1]]))
    loss.backward()
    # token mean over the 5 generated tokens (not per-sequence means: that would be -2/2 and 1/3, halved)
    assert torch.allclose(lp.grad, torch.tensor([[-2.0, -2.0, 0.0], [1.0, 1.0, 1.0]]) / 5)
    assert loss.item() == pytest.approx((-2.0 * 2 + 1.0 * 3) / 5)  # on-policy value: -Σ Â / tokens
    assert metrics["ratio"] == pytest.approx(1.0) and metrics["clip_frac"] == 0.0


def test_off_policy_ratio_is_not_clipped(maxrl):
    # the script never reuses a batch; if old_logprobs differ the loss is plain -Â·ρ (no PPO clip)
    old = torch.tensor([[-1.0]])
    lp = (old + math.log(3.0)).requires_grad_()
    loss, _ = maxrl.policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 1))
    loss.backward()
    assert lp.grad.item() == pytest.approx(-3.0, rel=1e-5)


def test_padding_changes_nothing(maxrl):
    torch.manual_seed(0)
    lp0, adv = torch.randn(3, 5), torch.randn(3)
    assert_padding_changes_nothing(
        lambda lp, o, a, m, shift: maxrl.policy_loss(lp, o, a, m),
        lp0,
        lp0,
        adv,
        torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]),
    )


def test_micro_batches_accumulate_to_the_minibatch_gradient(maxrl):
    lp0, _, adv, mask = random_batch()
    whole_grad = assert_micro_batches_accumulate(
        lambda lp: maxrl.policy_loss(lp, lp0, adv, mask)[0],
        lambda lp, rows: maxrl.policy_loss(lp[rows], lp0[rows], adv[rows], mask[rows], num_tokens=mask.sum())[0],
        lp0,
        (slice(0, 1), slice(1, 4)),
    )
    # without the mini-batch normaliser the micro-batches would weigh their tokens differently
    wrong = lp0.clone().requires_grad_()
    for rows in (slice(0, 1), slice(1, 4)):
        maxrl.policy_loss(wrong[rows], lp0[rows], adv[rows], mask[rows])[0].backward()
    assert not torch.allclose(whole_grad, wrong.grad, atol=1e-4)


def test_script_defaults_and_refuses_batch_reuse(maxrl, monkeypatch):
    args = maxrl.Args()
    assert args.group_size == 16 and args.num_minibatches == 1 and args.num_epochs == 1 and args.kl_coef == 0.0
    for flag in ("--num-minibatches", "--num-epochs"):
        monkeypatch.setattr(sys, "argv", ["maxrl.py", flag, "2"])
        with pytest.raises(SystemExit, match="one update per batch"):
            maxrl.main()


def test_correction_weights_of_one_change_nothing(maxrl):
    lp0, old, adv, mask = random_batch(seed=3, shape=(3, 4))
    ref = lp0 + 0.5 * torch.randn(3, 4)
    out = []
    for weights in (None, torch.ones(3, 4)):
        lp = lp0.clone().requires_grad_()
        loss, metrics = maxrl.policy_loss(lp, old, adv, mask, kl_coef=0.1, ref_logprobs=ref, is_weights=weights)
        loss.backward()
        out.append((loss, lp.grad, metrics))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1]) and out[0][2] == out[1][2]


def test_correction_weights_multiply_the_reinforce_term_not_the_kl(maxrl):
    lp = torch.tensor([[math.log(0.5), math.log(0.5)]], requires_grad=True)
    old = lp.detach().clone()  # on-policy: r = 1
    weights, ref = torch.tensor([[2.0, 0.5]]), torch.zeros(1, 2)  # π_ref = 1: δ = log 2, k3 = 2 - log 2 - 1
    loss, _ = maxrl.policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2), is_weights=weights)
    loss.backward()
    # ℓ_t = -w_t·Â·r = [-2, -0.5]; token mean L = -1.25; dL/dlogp_t = -w_t·Â / 2 = [-1, -0.25]
    assert loss.item() == pytest.approx(-1.25)
    assert torch.allclose(lp.grad, torch.tensor([[-1.0, -0.25]]))
    kl_loss, _ = maxrl.policy_loss(
        lp, old, torch.tensor([1.0]), torch.ones(1, 2), kl_coef=0.1, ref_logprobs=ref, is_weights=weights
    )
    # + β·Σ_t k3 / 2 = 0.1·2·(1 - log 2) / 2, unweighted (weighted it would be 0.1·2.5·(1 - log 2) / 2)
    assert kl_loss.item() == pytest.approx(-1.25 + 0.1 * (1 - math.log(2)))
