"""RLOO math against hand-derived values and properties (reference notes §6(g), checklist items 3, 5, 9)."""

import math

import pytest
import torch
from conftest import load_algo
from loss_checks import assert_micro_batches_accumulate, assert_padding_changes_nothing, random_batch


@pytest.fixture(scope="module")
def rloo():
    return load_algo("rloo")


def test_leave_one_out_hand_values(rloo):
    # [1,0,0,0]: A_0 = 1 - 0 = 1, A_j = 0 - 1/3 for the others; a constant group gives 0
    adv = rloo.compute_advantages(torch.tensor([1.0, 0, 0, 0, 3.0, 3.0, 3.0, 3.0]), group_size=4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]), atol=1e-6)
    assert torch.equal(adv[4:], torch.zeros(4))
    # G = 2: A = ±(R_1 - R_2)
    adv2 = rloo.compute_advantages(torch.tensor([0.2, 0.9, 1.0, 1.0]), group_size=2)
    assert torch.allclose(adv2, torch.tensor([-0.7, 0.7, 0.0, 0.0]), atol=1e-6)


def test_advantage_is_reward_minus_mean_of_the_others(rloo):
    torch.manual_seed(0)
    rewards = torch.randn(12)
    G = 4
    adv = rloo.compute_advantages(rewards, group_size=G)
    for i in range(12):
        g = i // G
        others = [rewards[j] for j in range(g * G, g * G + G) if j != i]
        assert adv[i].item() == pytest.approx((rewards[i] - sum(others) / (G - 1)).item(), abs=1e-5)
    grouped = rewards.view(-1, G)
    assert torch.allclose(adv.view(-1, G).sum(1), torch.zeros(3), atol=1e-5)  # every group sums to 0
    assert torch.allclose(adv.view(-1, G), G / (G - 1) * (grouped - grouped.mean(1, keepdim=True)), atol=1e-5)


def test_own_reward_is_not_in_its_baseline(rloo):
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0])
    bumped = rewards.clone()
    bumped[2] += 0.6
    delta = rloo.compute_advantages(bumped, 4) - rloo.compute_advantages(rewards, 4)
    # raising R_2 raises A_2 by the full amount and lowers each other A_j by 0.6/(G-1)
    assert torch.allclose(delta, torch.tensor([-0.2, -0.2, 0.6, -0.2]), atol=1e-6)


def test_advantage_input_checks(rloo):
    with pytest.raises(ValueError, match="group_size"):
        rloo.compute_advantages(torch.zeros(4), group_size=1)
    with pytest.raises(ValueError, match="groups of 4"):
        rloo.compute_advantages(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="one per sequence"):
        rloo.policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))


def _on_policy(values):
    lp = torch.tensor(values, requires_grad=True)
    return lp, lp.detach().clone()


def test_on_policy_gradient_is_reinforce_on_the_sequence_logprob(rloo):
    lp, old = _on_policy([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, metrics = rloo.policy_loss(lp, old, adv, mask)
    loss.backward()
    # L = -(1/B) Σ_i A_i Σ_t log π: every valid token gets -A_i / B, whatever the sequence's length
    assert torch.allclose(lp.grad, torch.tensor([[-1.0, -1.0, 0.0], [0.5, 0.5, 0.5]]))
    assert loss.item() == pytest.approx(-(2.0 - 1.0) / 2)  # ρ = 1: value -mean(A)
    assert metrics["ratio"] == pytest.approx(1.0) and metrics["clip_frac"] == 0.0


@pytest.mark.parametrize(
    "adv, token_ratios, has_grad",
    [
        (1.0, (1.15, 1.15), False),  # each token inside 1±0.2, the sequence ratio 1.3225 is not: clipped
        (1.0, (1.05, 1.05), True),  # ρ = 1.1025
        (1.0, (0.8, 0.8), True),  # ρ = 0.64, A > 0: the min keeps the unclipped term
        (-1.0, (0.85, 0.85), False),  # ρ = 0.7225 < 0.8 with A < 0: clipped
        (-1.0, (0.95, 1.0), True),
        (-1.0, (1.2, 1.2), True),  # ρ = 1.44, A < 0: pessimistic branch keeps the gradient
    ],
)
def test_ratio_and_clip_act_on_the_whole_sequence(rloo, adv, token_ratios, has_grad):
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    lp = (old + torch.tensor([[math.log(token_ratios[0]), math.log(token_ratios[1]), 5.0]])).requires_grad_()
    mask = torch.tensor([[1, 1, 0]])  # the third column is padding: its log-ratio of 5 must not count
    loss, metrics = rloo.policy_loss(lp, old, torch.tensor([adv]), mask, clip_eps=0.2)
    loss.backward()
    rho = token_ratios[0] * token_ratios[1]
    assert metrics["ratio"] == pytest.approx(rho, rel=1e-5)
    assert metrics["clip_frac"] == (0.0 if has_grad else 1.0)
    # d/dlogp_t of -A·exp(Σ_t logp_t - old_t) is -A·ρ for each valid token
    expected = torch.tensor([[-adv * rho, -adv * rho, 0.0]]) if has_grad else torch.zeros(1, 3)
    assert torch.allclose(lp.grad, expected, atol=1e-6)


def test_padding_changes_nothing(rloo):
    torch.manual_seed(0)
    lp0 = torch.randn(3, 5) * 0.3 - 1
    old = lp0 + 0.05 * torch.randn(3, 5)
    adv = torch.tensor([0.7, -0.4, 1.2])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert_padding_changes_nothing(
        lambda lp, o, a, m, shift: rloo.policy_loss(lp, o, a, m), lp0, old, adv, mask, garbage=7.0
    )
    # appended padding columns change nothing either
    lp_c = torch.cat([lp0, torch.zeros(3, 2)], 1).requires_grad_()
    loss_c, _ = rloo.policy_loss(
        lp_c, torch.cat([old, torch.ones(3, 2)], 1), adv, torch.cat([mask, torch.zeros(3, 2, dtype=torch.long)], 1)
    )
    assert loss_c.item() == pytest.approx(rloo.policy_loss(lp0, old, adv, mask)[0].item(), abs=1e-6)


def test_gradient_matches_finite_differences(rloo):
    torch.manual_seed(3)
    lp0 = (torch.randn(3, 4) * 0.2 - 1).double()
    old = lp0 + 0.04 * torch.randn(3, 4).double()  # ratios inside the clip range: a smooth point
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    assert torch.autograd.gradcheck(lambda x: rloo.policy_loss(x, old, adv, mask)[0], (lp0.clone().requires_grad_(),))


def test_micro_batches_accumulate_to_the_minibatch_gradient(rloo):
    lp0, _, adv, mask = random_batch()
    lp0 = lp0 * 0.2 - 1
    old = lp0 + 0.1 * torch.randn(4, 6)
    assert_micro_batches_accumulate(
        lambda lp: rloo.policy_loss(lp, old, adv, mask)[0],
        lambda lp, rows: rloo.policy_loss(lp[rows], old[rows], adv[rows], mask[rows], num_sequences=4)[0],
        lp0,
        (slice(0, 1), slice(1, 4)),
    )


def test_kl_enters_the_reward_before_the_baseline(rloo):
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    old = torch.tensor(
        [[-1.0, -2.0, -9.0], [-1.0, -1.0, -1.0], [-0.5, -0.5, -0.5], [-3.0, 0.0, 0.0]], requires_grad=True
    )
    ref = torch.tensor([[-1.5, -2.0, 0.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -0.5], [-3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]])  # row 0's last column is padding
    penalised, seq_kl = rloo.kl_penalised_rewards(rewards, old, ref, mask, kl_coef=0.1)
    assert torch.allclose(seq_kl, torch.tensor([0.5, 0.0, 1.0, 0.0]))  # Σ_t (log π_old - log π_ref) over valid tokens
    assert torch.allclose(penalised, torch.tensor([0.95, 0.0, -0.1, 0.0]))
    assert not penalised.requires_grad and not seq_kl.requires_grad  # no gradient through the penalty
    # leave-one-out on [0.95, 0, -0.1, 0] (sum 0.85): A_i = R_i - (0.85 - R_i)/3
    adv = rloo.compute_advantages(penalised, 4)
    assert torch.allclose(adv, torch.tensor([0.95 + 0.1 / 3, -0.85 / 3, -0.1 - 0.95 / 3, -0.85 / 3]), atol=1e-6)


def test_defaults_load_no_reference_model(rloo):
    args = rloo.Args()
    assert args.kl_coef == 0.0 and args.clip_eps == 0.2


def test_correction_weights_of_one_change_nothing(rloo):
    lp0, old, adv, mask = random_batch(seed=3, shape=(3, 4), old_noise=0.1)
    out = []
    for weights in (None, torch.ones(3, 4)):
        lp = lp0.clone().requires_grad_()
        loss, metrics = rloo.policy_loss(lp, old, adv, mask, is_weights=weights)
        loss.backward()
        out.append((loss, lp.grad, metrics))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1]) and out[0][2] == out[1][2]


@pytest.mark.parametrize("rho, has_grad", [(1.0, True), (1.1, True), (1.5, False)])
def test_correction_weights_multiply_each_tokens_log_prob_term(rloo, rho, has_grad):
    old = torch.tensor([[math.log(0.5), math.log(0.5), -3.0]])
    lp = (old + torch.tensor([[0.0, math.log(rho), 7.0]])).requires_grad_()  # ρ = rho, the padding's 7 not counted
    mask, weights = torch.tensor([[1, 1, 0]]), torch.tensor([[2.0, 0.5, 0.0]])
    loss, metrics = rloo.policy_loss(lp, old, torch.tensor([1.0]), mask, clip_eps=0.2, is_weights=weights)
    loss.backward()
    # the value -min(ρ·A, clip(ρ)·A) and the clip are untouched: -1, -1.1, -1.2 (clipped at 1 + ε)
    assert loss.item() == pytest.approx(-min(rho, 1.2)) and metrics["ratio"] == pytest.approx(rho)
    # the gradient -A·ρ·Σ_t w_t ∇log π_t: [-2ρ, -0.5ρ] (on-policy, ρ = 1: REINFORCE on Σ_t w_t log π_t); clipped: 0
    expected = torch.tensor([[-2.0 * rho, -0.5 * rho, 0.0]]) if has_grad else torch.zeros(1, 3)
    assert torch.allclose(lp.grad, expected, atol=1e-6)
    # a sequence mode's weight, constant over o_i, is a plain factor on the sequence's gradient: here 3
    seq = lp.detach().clone().requires_grad_()
    rloo.policy_loss(seq, old, torch.tensor([1.0]), mask, is_weights=torch.tensor([[3.0, 3.0, 0.0]]))[0].backward()
    assert torch.allclose(seq.grad, torch.tensor([[-3.0 * rho, -3.0 * rho, 0.0]]) if has_grad else torch.zeros(1, 3))
