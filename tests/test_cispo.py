"""CISPO math against hand-derived values and properties (reference §7 and checklist items 1, 4, 5, 7, 8)."""

import math

import pytest
import torch
from conftest import load_algo
from loss_checks import assert_padding_changes_nothing


@pytest.fixture(scope="module")
def cispo():
    return load_algo("cispo")


def _one_token(cispo, adv, old_p, new_p, **hyper):
    """Loss, d loss / d logp and metrics for one token sampled at probability old_p, now at new_p."""
    old = torch.tensor([[math.log(old_p)]])
    lp = torch.tensor([[math.log(new_p)]], requires_grad=True)
    loss, metrics = cispo.policy_loss(lp, old, torch.tensor([adv]), torch.ones(1, 1), **hyper)
    loss.backward()
    return loss.item(), lp.grad.item(), metrics


def test_defaults(cispo):
    args = cispo.Args()
    assert args.eps_max == 5.0 and args.kl_coef == 0.0
    assert args.num_minibatches > 1  # otherwise every IS weight is exactly 1 and CISPO is REINFORCE


def test_advantages_hand_values(cispo):
    adv = cispo.compute_advantages(torch.tensor([1.0, 0, 0, 0, 1.0, 1.0, 1.0, 1.0]), group_size=4)
    assert torch.allclose(adv[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4))


def test_ratio_3_positive_advantage_gets_the_weighted_reinforce_gradient(cispo):
    # π_old = 0.1, π_θ = 0.3: r = 3 < ε_max = 5, A = +2. PPO-clip would give this token no gradient.
    loss, grad, metrics = _one_token(cispo, 2.0, 0.1, 0.3)
    assert grad == pytest.approx(-3.0 * 2.0, rel=1e-5)  # -min(r, cap)·A·∇logπ, token mean over 1 token
    assert loss == pytest.approx(-3.0 * 2.0 * math.log(0.3), rel=1e-5)
    assert metrics["clip_frac"] == 0.0 and metrics["is_weight"] == pytest.approx(3.0, rel=1e-5)
    # no gradient flows through the weight: with w = r not detached it would be -A·r·(1 + log π) = +1.22
    assert grad != pytest.approx(-2.0 * 3.0 * (1 + math.log(0.3)), rel=1e-3)


def test_ratio_7_is_capped_at_5_but_keeps_gradient(cispo):
    loss, grad, metrics = _one_token(cispo, 1.0, 0.1, 0.7)
    assert grad == pytest.approx(-5.0, rel=1e-5)
    assert metrics["clip_frac"] == 1.0 and metrics["is_weight"] == pytest.approx(5.0)
    _, grad, _ = _one_token(cispo, 1.0, 0.1, 0.3, eps_max=1.2)  # verl's 1 + 0.2 convention
    assert grad == pytest.approx(-1.2, rel=1e-5)


def test_no_lower_bound_on_the_weight(cispo):
    # A < 0 and r = 0.05: the weight follows r down (a PPO-style floor would give 0.8)
    _, grad, metrics = _one_token(cispo, -1.0, 0.4, 0.02)
    assert grad == pytest.approx(0.05, rel=1e-5) and metrics["clip_frac"] == 0.0


def test_gradient_matches_analytic_on_a_batch(cispo):
    torch.manual_seed(0)
    lp0 = torch.randn(3, 4) - 1
    old = lp0 + torch.tensor(
        [[0.0, 1.0, -2.0, 0.5], [3.0, -1.0, 0.0, 0.2], [0.1, 0.1, -0.1, 2.5]]
    )  # ratios from e^-3 to e^2
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    lp = lp0.clone().requires_grad_()
    cispo.policy_loss(lp, old, adv, mask, eps_max=2.0)[0].backward()
    weight = torch.exp(lp0 - old).clamp(max=2.0)
    expected = -weight * adv[:, None] * mask / mask.sum()
    assert torch.allclose(lp.grad, expected, atol=1e-6)


def _ppo_clip_token_mean(lp, old, adv, mask, eps=0.2):
    ratio = torch.exp(lp - old)
    a = adv[:, None]
    per_token = torch.max(-a * ratio, -a * ratio.clamp(1 - eps, 1 + eps))
    return (per_token * mask).sum() / mask.sum()


def test_on_policy_gradient_equals_ppo_and_reinforce(cispo):
    values = [[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]]
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    lp = torch.tensor(values, requires_grad=True)
    loss, metrics = cispo.policy_loss(lp, lp.detach(), adv, mask)
    loss.backward()
    ppo = torch.tensor(values, requires_grad=True)
    _ppo_clip_token_mean(ppo, ppo.detach(), adv, mask).backward()
    expected = -adv[:, None] * mask / 5  # -A·∇logπ over 5 tokens
    assert torch.allclose(lp.grad, expected) and torch.allclose(ppo.grad, expected)
    assert metrics["is_weight"] == 1.0


def test_aggregation_is_token_mean(cispo):
    # on-policy with log π = -1 the per-token loss is -A·(-1) = A: losses [a] and [b, b, b]
    a, b = 0.7, -0.4
    lp = torch.full((2, 4), -1.0, requires_grad=True)
    adv = torch.tensor([[a, 0, 0, 0], [b, b, b, 0]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    loss, _ = cispo.policy_loss(lp, lp.detach(), adv, mask)
    assert loss.item() == pytest.approx((a + 3 * b) / 4)


def test_padding_changes_nothing(cispo):
    torch.manual_seed(0)
    lp0 = torch.randn(3, 5)
    old, adv = lp0 + 0.5 * torch.randn(3, 5), torch.randn(3)
    assert_padding_changes_nothing(
        lambda lp, o, a, m, shift: cispo.policy_loss(lp, o, a, m),
        lp0,
        old,
        adv,
        torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]),
    )


def test_micro_batches_and_processes_accumulate_to_the_minibatch_gradient(cispo):
    g = torch.Generator().manual_seed(1)
    lp0, adv = torch.randn(6, 7, generator=g), torch.randn(6, generator=g)
    old = lp0 + torch.randn(6, 7, generator=g)
    mask = (torch.rand(6, 7, generator=g) > 0.4).long()
    mask[:, 0] = 1
    whole = lp0.clone().requires_grad_()
    cispo.policy_loss(whole, old, adv, mask)[0].backward()
    # gradient accumulation over unequal micro-batches, normalised by the mini-batch's token count
    parts = lp0.clone().requires_grad_()
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        cispo.policy_loss(parts[rows], old[rows], adv[rows], mask[rows], num_tokens=float(mask.sum()))[0].backward()
    assert torch.allclose(whole.grad, parts.grad, atol=1e-7)
    # two processes, each dividing by (global count / 2), then DDP's gradient mean (what main() does)
    averaged = torch.zeros_like(lp0)
    for rows in (slice(0, 2), slice(2, 6)):
        local = lp0[rows].clone().requires_grad_()
        cispo.policy_loss(local, old[rows], adv[rows], mask[rows], num_tokens=float(mask.sum()) / 2)[0].backward()
        averaged[rows] = local.grad / 2
    assert torch.allclose(whole.grad, averaged, atol=1e-7)


def test_correction_weights_of_one_change_nothing(cispo):
    torch.manual_seed(3)
    lp0, adv = torch.randn(3, 4), torch.randn(3)
    old, ref = lp0 - 3.0 * torch.rand(3, 4), lp0 + 0.5 * torch.randn(3, 4)  # ratios up to e^3: some capped at 5
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    out = []
    for weights in (None, torch.ones(3, 4)):
        lp = lp0.clone().requires_grad_()
        loss, metrics = cispo.policy_loss(lp, old, adv, mask, kl_coef=0.1, ref_logprobs=ref, is_weights=weights)
        loss.backward()
        out.append((loss, lp.grad, metrics))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1]) and out[0][2] == out[1][2]


def test_correction_weights_compose_with_the_capped_is_weight_not_the_kl(cispo):
    old = torch.tensor([[math.log(0.5 / 3), math.log(0.5)]])
    lp = torch.tensor([[math.log(0.5), math.log(0.5)]], requires_grad=True)  # r = [3, 1], under ε_max = 5
    weights, ref = torch.tensor([[2.0, 0.5]]), torch.zeros(1, 2)  # π_ref = 1: δ = log 2, k3 = 2 - log 2 - 1
    loss, metrics = cispo.policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2), is_weights=weights)
    loss.backward()
    # ℓ_t = -w_t·sg(min(r_t, 5))·Â·log π_t = [-2·3·log 0.5, -0.5·1·log 0.5] = [6 log 2, 0.5 log 2]; token mean:
    # L = 3.25 log 2; dL/dlogp_t = -w_t·r̂_t·Â / 2 = [-3, -0.25] (the two weights multiply: π_θ/π_old and π_old/μ)
    assert loss.item() == pytest.approx(3.25 * math.log(2))
    assert torch.allclose(lp.grad, torch.tensor([[-3.0, -0.25]]))
    assert metrics["is_weight"] == pytest.approx(2.0)  # CISPO's own weight, mean of [3, 1]: the correction's not in it
    kl_loss, _ = cispo.policy_loss(
        lp, old, torch.tensor([1.0]), torch.ones(1, 2), kl_coef=0.1, ref_logprobs=ref, is_weights=weights
    )
    # + β·Σ_t k3 / 2 = 0.1·2·(1 - log 2) / 2, unweighted (weighted it would be 0.1·2.5·(1 - log 2) / 2)
    assert kl_loss.item() == pytest.approx(3.25 * math.log(2) + 0.1 * (1 - math.log(2)))
