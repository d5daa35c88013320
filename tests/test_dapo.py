"""DAPO math against hand-derived values and properties (reference §5 and checklist items 1, 4-6, 12, 13)."""

import math

import pytest
import torch
from conftest import load_algo
from loss_checks import assert_padding_changes_nothing


@pytest.fixture(scope="module")
def dapo():
    return load_algo("dapo")


def _on_policy(values):
    lp = torch.tensor(values, requires_grad=True)
    return lp, lp.detach().clone()


def _token_grad(dapo, adv, ratio, **hyper):
    """d loss / d logp for one token with advantage ``adv`` at importance ratio ``ratio`` (token mean over 1 token)."""
    old = torch.tensor([[-1.0]])
    lp = (old + math.log(ratio)).requires_grad_()
    loss, metrics = dapo.policy_loss(lp, old, torch.tensor([adv]), torch.ones(1, 1), **hyper)
    loss.backward()
    return lp.grad.item(), metrics


def test_defaults_are_the_papers(dapo):
    args = dapo.Args()
    assert (args.clip_eps_low, args.clip_eps_high, args.overlong_cache_frac) == (0.2, 0.28, 0.2)
    assert args.kl_coef == 0.0 and args.overlong_filtering is False and args.max_sampling_rounds >= 1


def test_advantages_on_plus_minus_one_rewards(dapo):
    # [1,-1,-1,-1]: mean -0.5, deviations [1.5,-0.5,-0.5,-0.5], sample std sqrt(3/3) = 1
    adv = dapo.compute_advantages(torch.tensor([1.0, -1, -1, -1, -1, -1, -1, -1]), group_size=4)
    assert torch.allclose(adv[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4))


def test_clip_higher_keeps_gradient_at_1_25_for_positive_advantage(dapo):
    grad, metrics = _token_grad(dapo, 1.0, 1.25)  # inside 1 + 0.28
    assert grad == pytest.approx(-1.25, rel=1e-5)  # d(-A·r)/dlogp = -A·r
    assert metrics["clip_frac"] == 0.0
    grad, metrics = _token_grad(dapo, 1.0, 1.25, clip_eps_high=0.2)  # symmetric PPO clip: blocked
    assert grad == 0.0 and metrics["clip_frac_high"] == 1.0
    grad, _ = _token_grad(dapo, 1.0, 1.3)  # beyond 1.28: blocked
    assert grad == 0.0


@pytest.mark.parametrize(
    "adv, ratio, has_grad", [(-1.0, 0.79, False), (-1.0, 0.81, True), (-1.0, 1.35, True), (1.0, 0.5, True)]
)
def test_lower_clip_stays_at_0_2(dapo, adv, ratio, has_grad):
    grad, metrics = _token_grad(dapo, adv, ratio)
    assert (grad != 0.0) == has_grad
    assert metrics["clip_frac_low"] == (0.0 if has_grad else 1.0)
    if has_grad:
        assert grad == pytest.approx(-adv * ratio, rel=1e-5)


def test_overlong_penalty_paper_values(dapo):
    # L_max = 20480, L_cache = 4096: the ramp starts at 16384 (eq. 13)
    lengths = torch.tensor([100, 16384, 17408, 18432, 20480, 20481])
    pen = dapo.overlong_penalty(lengths, 20480, 4096)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))


def test_overlong_penalty_tiny_scale(dapo):
    # max_new_tokens 40, cache 20% = 8 tokens: 0 up to 32, then -1/8 per token
    pen = dapo.overlong_penalty(torch.tensor([5, 32, 33, 36, 40]), 40, round(0.2 * 40))
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.125, -0.5, -1.0]))
    assert torch.equal(dapo.overlong_penalty(torch.tensor([5, 40]), 40, 0), torch.zeros(2))  # cache 0: off


def test_penalty_is_added_before_normalisation(dapo):
    # two correct answers, one of them at the length limit: the group now has a gradient between them
    rewards = torch.tensor([1.0, 1.0, -1.0, -1.0]) + dapo.overlong_penalty(torch.tensor([10, 40, 10, 10]), 40, 8)
    adv = dapo.compute_advantages(rewards, 4)  # rewards [1, 0, -1, -1]: mean -0.25, sample std sqrt(2.75/3)
    std = math.sqrt(((1.25**2) + 0.25**2 + 2 * 0.75**2) / 3)
    assert torch.allclose(adv, torch.tensor([1.25, 0.25, -0.75, -0.75]) / (std + 1e-6), atol=1e-5)


def test_filter_keeps_only_mixed_correctness(dapo):
    correct = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1], dtype=torch.float32)
    assert dapo.filter_groups(correct, 4).tolist() == [False, False, True, True]
    assert dapo.filter_groups(correct.bool(), 4).tolist() == [False, False, True, True]
    with pytest.raises(ValueError, match="groups of 3"):
        dapo.filter_groups(correct, 3)


def test_filter_uses_correctness_not_the_shaped_reward(dapo):
    # all wrong but of different lengths: rewards differ (nonzero std), correctness does not -> dropped
    correct = torch.zeros(4)
    rewards = 2 * correct - 1 + dapo.overlong_penalty(torch.tensor([10, 34, 38, 40]), 40, 8)
    assert rewards.std() > 0 and dapo.compute_advantages(rewards, 4).abs().sum() > 0
    assert dapo.filter_groups(correct, 4).tolist() == [False]
    # all correct, one truncated: also dropped
    assert dapo.filter_groups(torch.ones(4), 4).tolist() == [False]


def test_aggregation_is_token_mean(dapo):
    # per-token losses [a] and [b, b, b]: on-policy the per-token loss is -A, so A = -loss
    a, b = 0.7, -0.4
    lp, old = _on_policy([[-1.0, 0, 0, 0], [-1.0, -1.0, -1.0, 0]])
    adv = torch.tensor([[-a, 0, 0, 0], [-b, -b, -b, 0]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    loss, _ = dapo.policy_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx((a + 3 * b) / 4)  # not the per-sequence mean (a+b)/2
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[a, 0, 0, 0], [b, b, b, 0]]) / 4)  # -A / (4 tokens)


def test_padding_changes_nothing(dapo):
    torch.manual_seed(0)
    lp0 = torch.randn(3, 5)
    old, adv = lp0 + 0.1 * torch.randn(3, 5), torch.randn(3)
    assert_padding_changes_nothing(
        lambda lp, o, a, m, shift: dapo.policy_loss(lp, o, a, m),
        lp0,
        old,
        adv,
        torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]),
    )


def _random_batch(seed=1, rows=5, width=7):
    g = torch.Generator().manual_seed(seed)
    lp0, adv = torch.randn(rows, width, generator=g), torch.randn(rows, generator=g)
    old = lp0 + 0.3 * torch.randn(rows, width, generator=g)
    mask = (torch.rand(rows, width, generator=g) > 0.4).long()
    mask[:, 0] = 1
    return lp0, old, adv, mask


def test_micro_batches_accumulate_to_the_minibatch_gradient(dapo):
    lp0, old, adv, mask = _random_batch()
    whole = lp0.clone().requires_grad_()
    dapo.policy_loss(whole, old, adv, mask)[0].backward()
    parts = lp0.clone().requires_grad_()
    for rows in (slice(0, 1), slice(1, 4), slice(4, 5)):  # unequal token counts per micro-batch
        dapo.policy_loss(parts[rows], old[rows], adv[rows], mask[rows], num_tokens=float(mask.sum()))[0].backward()
    assert torch.allclose(whole.grad, parts.grad, atol=1e-7)
    # the mean of micro-batch token means (verl's legacy path) would differ
    mean_of_means = lp0.clone().requires_grad_()
    for rows in (slice(0, 1), slice(1, 5)):
        (dapo.policy_loss(mean_of_means[rows], old[rows], adv[rows], mask[rows])[0] / 2).backward()
    assert not torch.allclose(whole.grad, mean_of_means.grad, atol=1e-4)


def test_process_normaliser_gives_the_global_token_mean_after_ddp_averaging(dapo):
    # what main() does: each of `world` processes divides by (global token count / world); DDP averages gradients
    lp0, old, adv, mask = _random_batch(seed=2, rows=6)
    world, shards = 2, (slice(0, 3), slice(3, 6))
    whole = lp0.clone().requires_grad_()
    dapo.policy_loss(whole, old, adv, mask)[0].backward()
    num_tokens = float(mask.sum()) / world
    averaged = torch.zeros_like(lp0)
    for rows in shards:
        local = lp0[rows].clone().requires_grad_()
        dapo.policy_loss(local, old[rows], adv[rows], mask[rows], num_tokens=num_tokens)[0].backward()
        averaged[rows] = local.grad / world  # all-reduce mean over processes
    assert torch.allclose(whole.grad, averaged, atol=1e-7)


def test_overlong_filtering_zeroes_truncated_samples(dapo):
    lp0, old, adv, mask = _random_batch(seed=3, rows=4)
    truncated = torch.tensor([False, True, False, True])
    filtered = dapo.overlong_filter(mask, truncated)
    assert torch.equal(filtered[1], torch.zeros_like(filtered[1])) and torch.equal(filtered[0], mask[0].float())
    lp = lp0.clone().requires_grad_()
    loss, _ = dapo.policy_loss(lp, old, adv, filtered)
    loss.backward()
    assert torch.all(lp.grad[truncated] == 0) and lp.grad[~truncated].abs().sum() > 0
    # the normaliser excludes the truncated tokens: same as training on the kept rows alone
    kept = lp0[~truncated].clone().requires_grad_()
    loss_kept, _ = dapo.policy_loss(kept, old[~truncated], adv[~truncated], mask[~truncated])
    loss_kept.backward()
    assert loss.item() == pytest.approx(loss_kept.item(), abs=1e-6)
    assert torch.allclose(lp.grad[~truncated], kept.grad, atol=1e-7)


def test_kl_is_optional_and_off(dapo):
    lp, old = _on_policy([[-1.0, -2.0]])
    loss, metrics = dapo.policy_loss(lp, old, torch.zeros(1), torch.ones(1, 2))
    assert loss.item() == 0.0 and "kl" not in metrics
    with pytest.raises(ValueError, match="ref_logprobs"):
        dapo.policy_loss(lp, old, torch.zeros(1), torch.ones(1, 2), kl_coef=0.1)


def test_correction_weights_of_one_change_nothing(dapo):
    torch.manual_seed(3)
    lp0, adv = torch.randn(3, 4), torch.randn(3)
    old, ref = lp0 + 0.3 * torch.randn(3, 4), lp0 + 0.5 * torch.randn(3, 4)  # ratios far from 1: some tokens clip
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    out = []
    for weights in (None, torch.ones(3, 4)):
        lp = lp0.clone().requires_grad_()
        loss, metrics = dapo.policy_loss(lp, old, adv, mask, kl_coef=0.1, ref_logprobs=ref, is_weights=weights)
        loss.backward()
        out.append((loss, lp.grad, metrics))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1]) and out[0][2] == out[1][2]


def test_correction_weights_multiply_the_clipped_surrogate_not_the_kl(dapo):
    old = torch.tensor([[math.log(0.4), math.log(0.5)]])
    lp = torch.tensor([[math.log(0.6), math.log(0.5)]], requires_grad=True)  # r = [1.5, 1]: the first above 1.28
    weights, ref = torch.tensor([[2.0, 0.5]]), torch.zeros(1, 2)  # π_ref = 1 on both tokens
    loss, metrics = dapo.policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2), is_weights=weights)
    loss.backward()
    # ℓ = [-min(1.5, 1.28), -1] = [-1.28, -1]; L = (2·(-1.28) + 0.5·(-1)) / 2 tokens = -1.53
    # dL/dlogp: the clipped token 0, the other -w·Â·r / 2 = -0.25
    assert loss.item() == pytest.approx(-1.53)
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -0.25]]))
    assert metrics["clip_frac_high"] == 0.5  # the clip statistics are of the ratio, not of the weights
    kl_loss, _ = dapo.policy_loss(
        lp, old, torch.tensor([1.0]), torch.ones(1, 2), kl_coef=0.1, ref_logprobs=ref, is_weights=weights
    )
    # k3(δ) = e^δ - δ - 1 with δ = log π_ref - log π_θ = [log(1/0.6), log 2]; + β·Σ_t k3 / 2, unweighted
    k3 = [1 / 0.6 - math.log(1 / 0.6) - 1, 2 - math.log(2) - 1]
    assert kl_loss.item() == pytest.approx(-1.53 + 0.1 * (k3[0] + k3[1]) / 2)
