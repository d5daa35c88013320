"""Dr. GRPO math against hand-derived values and properties (reference notes §4(g), checklist items 2, 4-6, 8, 9)."""

import math

import pytest
import torch
from conftest import load_algo

L_MAX = 4


@pytest.fixture(scope="module")
def dr():
    return load_algo("dr_grpo")


def test_advantages_hand_values(dr):
    adv = dr.compute_advantages(torch.tensor([1.0, 0, 0, 0, 2.0, 2.0, 2.0, 2.0]), group_size=4)
    assert torch.allclose(adv[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]), atol=1e-6)  # GRPO: [1.5, -0.5, ...]
    assert torch.equal(adv[4:], torch.zeros(4))


def test_advantages_are_not_scaled_by_the_std(dr):
    rewards = torch.tensor([0.3, 0.9, 0.1, 5.0, 7.0, 6.0])
    adv = dr.compute_advantages(rewards, group_size=3)
    assert torch.allclose(adv, torch.tensor([-0.133333, 0.466667, -0.333333, -1.0, 1.0, 0.0]), atol=1e-5)
    # scaling rewards scales advantages (a std-normalised advantage would not move)
    assert torch.allclose(dr.compute_advantages(10 * rewards, 3), 10 * adv, atol=1e-4)
    with pytest.raises(ValueError, match="group_size"):
        dr.compute_advantages(rewards, group_size=1)
    with pytest.raises(ValueError, match="groups of 4"):
        dr.compute_advantages(rewards, group_size=4)


def _on_policy(values):
    lp = torch.tensor(values, requires_grad=True)
    return lp, lp.detach().clone()


def test_aggregation_is_token_sum_over_sequences_times_max_tokens(dr):
    # per-token losses [a] and [b, b, b]: on-policy the per-token loss is -A, so A = -loss
    a, b = 0.7, -0.4
    lp, old = _on_policy([[-1.0, 0, 0, 0], [-1.0, -1.0, -1.0, 0]])
    adv = torch.tensor([[-a, 0, 0, 0], [-b, -b, -b, 0]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    loss, _ = dr.policy_loss(lp, old, adv, mask, max_new_tokens=L_MAX)
    assert loss.item() == pytest.approx((a + 3 * b) / (2 * 4))  # not (a+b)/2 (GRPO) nor (a+3b)/4 (token mean)


def test_every_token_weighs_the_same_whatever_the_length(dr):
    lp, old = _on_policy([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, _ = dr.policy_loss(lp, old, adv, mask, max_new_tokens=L_MAX)
    loss.backward()
    # -A_i / (B · L_max) on every valid token (GRPO would give -A_i / (|o_i| · B))
    expected = torch.tensor([[-2.0, -2.0, 0.0], [1.0, 1.0, 1.0]]) / (2 * L_MAX)
    assert torch.allclose(lp.grad, expected)


def test_appended_padding_columns_change_nothing(dr):
    torch.manual_seed(0)
    lp0 = torch.randn(3, 4) * 0.3 - 1
    old = lp0 + 0.1 * torch.randn(3, 4)
    adv = torch.tensor([0.5, -0.25, 0.75])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    lp_a = lp0.clone().requires_grad_()
    loss_a, _ = dr.policy_loss(lp_a, old, adv, mask, max_new_tokens=6)
    loss_a.backward()
    pad = 5  # the padded width grows past the real lengths (even past max_new_tokens); the normaliser must not
    lp_b = torch.cat([lp0, torch.randn(3, pad)], 1).requires_grad_()
    old_b = torch.cat([old, torch.randn(3, pad)], 1)
    mask_b = torch.cat([mask, torch.zeros(3, pad, dtype=torch.long)], 1)
    loss_b, _ = dr.policy_loss(lp_b, old_b, adv, mask_b, max_new_tokens=6)
    loss_b.backward()
    assert loss_b.item() == pytest.approx(loss_a.item(), abs=1e-7)
    assert torch.allclose(lp_b.grad[:, :4], lp_a.grad) and torch.all(lp_b.grad[:, 4:] == 0)


def test_garbage_in_padded_positions_changes_nothing(dr):
    torch.manual_seed(2)
    lp0 = torch.randn(2, 5)
    old = lp0 + 0.1 * torch.randn(2, 5)
    adv = torch.tensor([[0.3] * 5, [-0.6] * 5])
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    garbage = (1 - mask) * 50.0
    lp_a, lp_b = lp0.clone().requires_grad_(), (lp0 + garbage).requires_grad_()
    loss_a, _ = dr.policy_loss(lp_a, old, adv, mask, max_new_tokens=5, kl_coef=0.1, ref_logprobs=old - 0.05)
    loss_b, _ = dr.policy_loss(
        lp_b, old - garbage, adv + garbage, mask, max_new_tokens=5, kl_coef=0.1, ref_logprobs=old - 0.05 + garbage
    )
    loss_a.backward()
    loss_b.backward()
    assert loss_a.item() == pytest.approx(loss_b.item(), abs=1e-6)
    assert torch.allclose(lp_a.grad, lp_b.grad)


def test_one_more_real_token_adds_its_loss_over_b_times_lmax(dr):
    lp, old = _on_policy([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0]])
    adv = torch.tensor([0.5, -0.3])
    short = torch.tensor([[1, 1, 0], [1, 0, 0]])
    longer = torch.tensor([[1, 1, 1], [1, 0, 0]])  # sequence 0 gains a token whose on-policy loss is -0.5
    base, _ = dr.policy_loss(lp, old, adv, short, max_new_tokens=L_MAX)
    grown, _ = dr.policy_loss(lp, old, adv, longer, max_new_tokens=L_MAX)
    assert grown.item() - base.item() == pytest.approx(-0.5 / (2 * L_MAX))


@pytest.mark.parametrize(
    "adv, ratio, has_grad",
    [(1.0, 1.3, False), (1.0, 1.1, True), (1.0, 0.7, True), (-1.0, 0.7, False), (-1.0, 0.9, True), (-1.0, 1.3, True)],
)
def test_clipping_zeroes_gradient_only_where_ppo_says(dr, adv, ratio, has_grad):
    old = torch.tensor([[-1.0, -1.0]])
    lp = (old + math.log(ratio)).requires_grad_()
    mask = torch.tensor([[1, 0]])
    loss, metrics = dr.policy_loss(lp, old, torch.tensor([adv]), mask, clip_eps=0.2, max_new_tokens=L_MAX)
    loss.backward()
    assert (lp.grad[0, 0].abs().item() > 0) == has_grad
    assert metrics["clip_frac"] == (0.0 if has_grad else 1.0)
    if has_grad:  # d/dlogp of -A·r / (B·L_max)
        assert lp.grad[0, 0].item() == pytest.approx(-adv * ratio / L_MAX, rel=1e-5)


def test_gradient_matches_finite_differences(dr):
    torch.manual_seed(3)
    lp0 = (torch.randn(3, 4) * 0.2 - 1).double()
    old = lp0 + 0.05 * torch.randn(3, 4).double()  # ratios well inside the clip range: a smooth point
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    fn = lambda x: dr.policy_loss(x, old, adv, mask, max_new_tokens=7, kl_coef=0.3, ref_logprobs=old - 0.2)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (lp0.clone().requires_grad_(),))


def test_micro_batches_accumulate_to_the_minibatch_gradient(dr):
    torch.manual_seed(1)
    lp0, adv = torch.randn(4, 6), torch.randn(4)
    old = lp0 + 0.3 * torch.randn(4, 6)
    mask = (torch.arange(6) < torch.tensor([[2], [6], [3], [5]])).long()  # right-padded completions
    whole = lp0.clone().requires_grad_()
    dr.policy_loss(whole, old, adv, mask, max_new_tokens=8)[0].backward()
    parts = lp0.clone().requires_grad_()
    for rows in (slice(0, 1), slice(1, 4)):
        # each micro-batch is padded only to its own width: the constant normaliser does not care
        width = int(mask[rows].sum(-1).max()) if rows.start == 0 else 6
        dr.policy_loss(
            parts[rows, :width], old[rows, :width], adv[rows], mask[rows, :width], max_new_tokens=8, num_sequences=4
        )[0].backward()
    assert torch.allclose(whole.grad, parts.grad, atol=1e-7)


def test_normaliser_is_required_and_must_bound_the_lengths(dr):
    lp, old = _on_policy([[-1.0, -1.0, -1.0]])
    with pytest.raises(TypeError, match="max_new_tokens"):
        dr.policy_loss(lp, old, torch.ones(1), torch.ones(1, 3))
    with pytest.raises(ValueError, match="max_new_tokens=2"):
        dr.policy_loss(lp, old, torch.ones(1), torch.ones(1, 3), max_new_tokens=2)


def test_no_kl_and_no_reference_by_default(dr):
    args = dr.Args()
    assert args.kl_coef == 0.0 and args.clip_eps == 0.2
    lp, old = _on_policy([[-1.0, -2.0]])
    _, metrics = dr.policy_loss(lp, old, torch.ones(1), torch.ones(1, 2), max_new_tokens=L_MAX)
    assert "kl" not in metrics


def test_correction_weights_of_one_change_nothing(dr):
    torch.manual_seed(3)
    lp0, adv = torch.randn(3, 4), torch.randn(3)
    old, ref = lp0 + 0.3 * torch.randn(3, 4), lp0 + 0.5 * torch.randn(3, 4)  # ratios far from 1: some tokens clip
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    out = []
    for weights in (None, torch.ones(3, 4)):
        lp = lp0.clone().requires_grad_()
        loss, metrics = dr.policy_loss(
            lp, old, adv, mask, max_new_tokens=L_MAX, kl_coef=0.1, ref_logprobs=ref, is_weights=weights
        )
        loss.backward()
        out.append((loss, lp.grad, metrics))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1]) and out[0][2] == out[1][2]


def test_correction_weights_multiply_the_surrogate_not_the_kl(dr):
    lp, old = _on_policy([[math.log(0.5), math.log(0.5)]])  # r = 1 on both tokens
    weights, ref = torch.tensor([[2.0, 0.5]]), torch.zeros(1, 2)  # π_ref = 1: δ = log 2, k3 = 2 - log 2 - 1
    loss, _ = dr.policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2), max_new_tokens=L_MAX, is_weights=weights)
    loss.backward()
    # ℓ_t = -Â·r = -1; L = (2·(-1) + 0.5·(-1)) / (B·L_max = 4) = -0.625; dL/dlogp_t = -w_t·Â·r / 4
    assert loss.item() == pytest.approx(-0.625)
    assert torch.allclose(lp.grad, torch.tensor([[-0.5, -0.125]]))
    kl_loss, _ = dr.policy_loss(
        lp,
        old,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        max_new_tokens=L_MAX,
        kl_coef=0.1,
        ref_logprobs=ref,
        is_weights=weights,
    )
    # + β·Σ_t k3 / 4 = 0.1·2·(1 - log 2) / 4, unweighted (weighted it would be 0.1·2.5·(1 - log 2) / 4)
    assert kl_loss.item() == pytest.approx(-0.625 + 0.05 * (1 - math.log(2)))
