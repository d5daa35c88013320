"""DPPO math against hand-derived values and properties (reference notes §1.3-1.4 and the DPPO test checklist).

Conventions below: μ is the rollout policy's probability of the sampled token, π the current one. With
binary TV the mask blocks A > 0 tokens with π - μ > δ and A < 0 tokens with π - μ < -δ (δ = 0.15); with
binary KL it blocks KL(Bern(μ)‖Bern(π)) > δ (δ = 0.05) when π moved the advantage's way.
"""

import math

import pytest
import torch
from conftest import load_algo, resolved_correction
from loss_checks import assert_micro_batches_accumulate, assert_padding_changes_nothing


@pytest.fixture(scope="module")
def dppo():
    return load_algo("dppo")


def one_token(mu: float, pi: float):
    """A (1,1) batch whose rollout probability is mu and current probability is pi."""
    old = torch.tensor([[math.log(mu)]])
    lp = torch.tensor([[math.log(pi)]], requires_grad=True)
    return lp, old


def grad_of(dppo, lp, old, adv, mask=None, **kw):
    mask = torch.ones_like(old) if mask is None else mask
    loss, metrics = dppo.policy_loss(lp, old, adv, mask, **kw)
    loss.backward()
    return lp.grad, loss, metrics


# --- advantages ---------------------------------------------------------------------------------------------


def test_advantages_are_reward_minus_group_mean_without_std(dppo):
    adv = dppo.compute_advantages(torch.tensor([1.0, 0, 0, 0, 2.0, 2.0, 2.0, 2.0, 0.5, 1.5, 0.0, 2.0]), group_size=4)
    assert torch.allclose(adv[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))  # std-normalised would be 1.5, -0.5
    assert torch.equal(adv[4:8], torch.zeros(4))
    assert torch.allclose(adv[8:], torch.tensor([-0.5, 0.5, -1.0, 1.0]))
    # the optional GRPO std (sample std of [1,0,0,0] is 0.5)
    std = dppo.compute_advantages(torch.tensor([1.0, 0, 0, 0]), group_size=4, norm_by_std=True)
    assert torch.allclose(std, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)
    with pytest.raises(ValueError, match="group_size"):
        dppo.compute_advantages(torch.zeros(4), group_size=1)
    with pytest.raises(ValueError, match="groups of 3"):
        dppo.compute_advantages(torch.zeros(4), group_size=3)


# --- the mask: direction, rare and frequent tokens, binary KL ------------------------------------------------


@pytest.mark.parametrize(
    "adv, mu, pi, blocked",
    [
        (1.0, 0.5, 0.7, True),  # A > 0, moved up by 0.2 > δ: blocked
        (1.0, 0.5, 0.3, False),  # A > 0, moved DOWN by 0.2: the update pushes it back, keep
        (-1.0, 0.5, 0.3, True),  # A < 0, moved down by 0.2 > δ: blocked
        (-1.0, 0.5, 0.7, False),  # A < 0, moved UP by 0.2: keep
        (1.0, 0.5, 0.64, False),  # A > 0, moved up by 0.14 < δ: inside the trust region
        (-1.0, 0.5, 0.36, False),  # mirror
        (0.0, 0.5, 0.9, False),  # A = 0 is never counted as blocked
    ],
)
def test_binary_tv_blocks_only_moves_past_delta_in_the_advantage_direction(dppo, adv, mu, pi, blocked):
    lp, old = one_token(mu, pi)
    grad, _, metrics = grad_of(dppo, lp, old, torch.tensor([adv]), max_new_tokens=4)
    assert metrics["clip_frac"] == (1.0 if blocked else 0.0)
    assert metrics["masked_frac_pos"] == (1.0 if blocked and adv > 0 else 0.0)
    assert metrics["masked_frac_neg"] == (1.0 if blocked and adv < 0 else 0.0)
    # unblocked: d/dlogπ of -sg(ρ)·A·logπ / (B·L_max) = -ρ·A / 4, with ρ = π/μ
    expected = 0.0 if blocked else -(pi / mu) * adv / 4
    assert grad.item() == pytest.approx(expected, rel=1e-5, abs=1e-12)


def test_rare_token_is_not_masked_although_its_ratio_is_100(dppo):
    # μ = 1e-5 -> π = 1e-3: ρ = 100 (PPO with ε = 0.2 would clip it), TV = 0.00099, KL = 0.000944
    for divergence, delta in (("binary_tv", 0.15), ("binary_kl", 0.05)):
        lp, old = one_token(1e-5, 1e-3)
        grad, _, metrics = grad_of(
            dppo, lp, old, torch.tensor([1.0]), delta=delta, divergence=divergence, max_new_tokens=1
        )
        assert metrics["clip_frac"] == 0.0
        assert grad.item() == pytest.approx(-100.0, rel=1e-4)  # -min(ρ, C)·A with C = 10^4
    # a small cap C truncates the detached IS weight but does not block the token
    lp, old = one_token(1e-5, 1e-3)
    grad, _, _ = grad_of(dppo, lp, old, torch.tensor([1.0]), clip_ratio_c=10.0, max_new_tokens=1)
    assert grad.item() == pytest.approx(-10.0, rel=1e-6)


def test_frequent_token_is_masked_although_its_ratio_is_inside_ppo_clip(dppo):
    # μ = 0.99 -> π = 0.8: ρ = 0.808 (inside [0.8, 1.2]), TV = 0.19 > 0.15, KL = 0.181005 > 0.05
    for divergence, delta in (("binary_tv", 0.15), ("binary_kl", 0.05)):
        lp, old = one_token(0.99, 0.8)
        grad, _, metrics = grad_of(
            dppo, lp, old, torch.tensor([-1.0]), delta=delta, divergence=divergence, max_new_tokens=1
        )
        assert grad.item() == 0.0 and metrics["masked_frac_neg"] == 1.0
        # the same move with A > 0 is a move against the advantage: kept, weight ρ = 0.8/0.99
        lp, old = one_token(0.99, 0.8)
        grad, _, _ = grad_of(dppo, lp, old, torch.tensor([1.0]), delta=delta, divergence=divergence, max_new_tokens=1)
        assert grad.item() == pytest.approx(-0.8 / 0.99, rel=1e-5)


@pytest.mark.parametrize(
    "mu, pi, kl",
    [(0.5, 0.6, 0.020411), (0.5, 0.7, 0.087177), (0.5, 0.3, 0.087177), (0.02, 0.1, 0.051266), (0.99, 0.8, 0.181005)],
)
def test_binary_kl_threshold_sits_at_the_hand_computed_divergence(dppo, mu, pi, kl):
    # KL(Bern(μ)‖Bern(π)) = μ log(μ/π) + (1-μ) log((1-μ)/(1-π)), values by hand; the mask flips at δ = KL
    adv = torch.tensor([[1.0 if pi > mu else -1.0]])
    lp, old = one_token(mu, pi)
    below = dppo.trust_region_mask(lp, old, adv, delta=kl - 2e-6, divergence="binary_kl")
    above = dppo.trust_region_mask(lp, old, adv, delta=kl + 2e-6, divergence="binary_kl")
    assert below.item() and not above.item()
    # the direction test: the opposite advantage is never blocked, however large the divergence
    assert not dppo.trust_region_mask(lp, old, -adv, delta=1e-6, divergence="binary_kl").item()


def test_binary_kl_and_tv_disagree_where_they_should(dppo):
    # μ = 0.02 -> π = 0.1: TV 0.08 < 0.15 (kept) but KL 0.0513 > 0.05 (blocked): KL is stricter on small μ
    lp, old = one_token(0.02, 0.1)
    adv = torch.tensor([[1.0]])
    assert not dppo.trust_region_mask(lp, old, adv, 0.15, "binary_tv").item()
    assert dppo.trust_region_mask(lp, old, adv, 0.05, "binary_kl").item()
    # μ = 0.5 -> π = 0.6: TV 0.1 < 0.15 and KL 0.0204 < 0.05, kept by both
    lp, old = one_token(0.5, 0.6)
    assert not dppo.trust_region_mask(lp, old, adv, 0.15, "binary_tv").item()
    assert not dppo.trust_region_mask(lp, old, adv, 0.05, "binary_kl").item()
    with pytest.raises(ValueError, match="divergence"):
        dppo.trust_region_mask(lp, old, adv, 0.1, "topk_tv")


# --- gradient, aggregation, invariances ------------------------------------------------------------------------


def test_masked_tokens_get_zero_gradient_and_the_rest_minus_rho_a_over_normaliser(dppo):
    mu = torch.tensor([[0.5, 0.5, 0.9, 0.2], [0.5, 0.99, 0.3, 0.6]])
    pi = torch.tensor([[0.7, 0.4, 0.95, 0.25], [0.3, 0.8, 0.5, 0.6]])
    adv = torch.tensor([2.0, -0.5])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    lp = pi.log().requires_grad_()
    loss, metrics = dppo.policy_loss(lp, mu.log(), adv, mask, max_new_tokens=5)
    loss.backward()
    # by hand, δ = 0.15, normaliser B·L_max = 2·5 = 10:
    # row 0 (A = 2): +0.2 blocked | -0.1 kept ρ=0.8 | +0.05 kept ρ=0.95/0.9 | padding
    # row 1 (A = -0.5): -0.2 blocked | -0.19 blocked | +0.2 kept ρ=5/3 | 0 kept ρ=1
    expected = torch.tensor([[0.0, -0.8 * 2, -(0.95 / 0.9) * 2, 0.0], [0.0, 0.0, (0.5 / 0.3) * 0.5, 0.5]]) / 10
    assert torch.allclose(lp.grad, expected, atol=1e-6)
    assert metrics["clip_frac"] == pytest.approx(3 / 7)
    assert metrics["masked_frac_pos"] == pytest.approx(1 / 3)
    assert metrics["masked_frac_neg"] == pytest.approx(2 / 4)
    # the loss value is Σ -sg(min(ρ,C))·M·A·log π / (B·L_max)
    w = torch.tensor([[0, 0.8, 0.95 / 0.9, 0], [0, 0, 0.5 / 0.3, 1.0]])
    value = -(w * adv[:, None] * pi.log()).sum() / 10
    assert loss.item() == pytest.approx(value.item(), rel=1e-5)


def test_on_policy_first_minibatch_is_plain_reinforce(dppo):
    # π = μ: nothing is blocked and the gradient is -A/(B·L_max) on every generated token
    lp0 = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])
    lp = lp0.clone().requires_grad_()
    grad, _, metrics = grad_of(
        dppo, lp, lp0.clone(), torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 1, 1]]), max_new_tokens=8
    )
    assert torch.allclose(grad, torch.tensor([[-2.0, -2.0, 0.0], [1.0, 1.0, 1.0]]) / 16)
    assert metrics["clip_frac"] == 0.0 and metrics["ratio"] == pytest.approx(1.0)


def test_normaliser_is_constant_not_the_token_count(dppo):
    # Σ tokens / (B·L_max): a short and a long sequence with the same per-token loss weigh by their lengths
    lp0 = torch.full((2, 4), -1.0)
    adv = torch.tensor([1.0, 1.0])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
    loss, _ = dppo.policy_loss(lp0.clone().requires_grad_(), lp0, adv, mask, max_new_tokens=10)
    assert loss.item() == pytest.approx(5 * 1.0 / 20)  # -A·logπ = 1 per token, 5 tokens, B·L_max = 20
    # extra padded columns change nothing when L_max is fixed
    wide = torch.cat([lp0, torch.full((2, 3), -7.0)], 1)
    loss_wide, _ = dppo.policy_loss(
        wide.clone().requires_grad_(),
        wide,
        adv,
        torch.cat([mask, torch.zeros(2, 3, dtype=torch.long)], 1),
        max_new_tokens=10,
    )
    assert loss_wide.item() == pytest.approx(loss.item())


@pytest.mark.parametrize("divergence", ["binary_tv", "binary_kl"])
def test_padding_changes_nothing(dppo, divergence):
    torch.manual_seed(0)
    lp0 = -torch.rand(3, 5) * 2
    old = lp0 + 0.4 * torch.randn(3, 5)
    adv = torch.randn(3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    # π = e^50 > 1 at padded positions: log(1-π) is NaN there, and must not leak into the loss or the metrics
    loss = lambda lp, o, a, m, shift: dppo.policy_loss(lp, o, a, m, divergence=divergence, max_new_tokens=6)
    assert_padding_changes_nothing(loss, lp0, old, adv, mask)


@pytest.mark.parametrize("divergence", ["binary_tv", "binary_kl"])
def test_micro_batches_accumulate_to_the_minibatch_gradient(dppo, divergence):
    torch.manual_seed(1)
    pi, adv = torch.rand(4, 6) * 0.8 + 0.1, torch.randn(4)
    lp0, old = pi.log(), (pi + 0.3 * torch.randn(4, 6)).clamp(0.02, 0.98).log()  # off-policy: some tokens blocked
    mask = (torch.rand(4, 6) > 0.3).long()
    mask[:, 0] = 1
    metrics = dppo.policy_loss(lp0, old, adv, mask, divergence=divergence, max_new_tokens=6)[1]
    assert 0 < metrics["clip_frac"] < 1  # the test exercises both blocked and kept tokens
    assert_micro_batches_accumulate(
        lambda lp: dppo.policy_loss(lp, old, adv, mask, divergence=divergence, max_new_tokens=6)[0],
        lambda lp, rows: dppo.policy_loss(
            lp[rows], old[rows], adv[rows], mask[rows], divergence=divergence, max_new_tokens=6, num_sequences=4
        )[0],
        lp0,
        (slice(0, 1), slice(1, 4)),
    )


def test_optional_k3_kl_to_a_reference(dppo):
    lp0 = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    lp = lp0.clone().requires_grad_()
    loss, metrics = dppo.policy_loss(
        lp, lp0, torch.zeros(1), torch.ones(1, 2), kl_coef=0.5, ref_logprobs=ref, max_new_tokens=4
    )
    loss.backward()
    k3 = math.exp(-0.5) + 0.5 - 1  # π_ref/π - log(π_ref/π) - 1 on the first token, 0 on the second
    assert loss.item() == pytest.approx(0.5 * k3 / 4)
    assert metrics["kl"] == pytest.approx(k3 / 2)
    assert torch.allclose(lp.grad, 0.5 * (1 - torch.exp(ref - lp0)) / 4)
    with pytest.raises(ValueError, match="ref_logprobs"):
        dppo.policy_loss(lp, lp0, torch.zeros(1), torch.ones(1, 2), kl_coef=0.5, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens=1"):  # L_max must bound every completion
        dppo.policy_loss(lp, lp0, torch.zeros(1), torch.ones(1, 2), max_new_tokens=1)


def test_defaults_follow_the_authors(dppo):
    args = dppo.Args()
    assert args.divergence == "binary_tv" and args.delta is None and args.clip_ratio_c == 10000.0
    assert args.kl_coef == 0.0 and not args.norm_adv_by_std
    assert args.num_minibatches > 1  # otherwise π = μ at every update and the trust region never acts


# --- rollout correction -------------------------------------------------------------------------------------


def test_no_correction_on_top_of_a_ratio_anchored_to_the_sampler(dppo, monkeypatch):
    """DPPO's ρ = π_θ/μ already takes μ from the sampler (policy_loss gets rollout_logprobs as old_logprobs): with a
    perturbed sampler 'auto' resolves to none (grpo.py would pick token_truncate), and an explicit mode stops."""
    assert resolved_correction(dppo, monkeypatch, "--rollout.logit-noise", "1.0").mode == "none"
    assert resolved_correction(dppo, monkeypatch, "--correction.mode", "none").mode == "none"
    for mode in ("token_truncate", "sequence_mask"):
        with pytest.raises(SystemExit, match=f"--correction.mode {mode}: not for this script, its ratio"):
            resolved_correction(dppo, monkeypatch, "--correction.mode", mode)
