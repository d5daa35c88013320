"""LUFFY math against hand-derived values and properties (reference §4.5 checklist), plus teacher traces.

Notation: γ = shaping_gamma, p = π_θ of a teacher token, f(p) = p/(p+γ). With π_φ = 1 the teacher term is
-A·f(p), so d/dp = -A·γ/(p+γ)² and d/dlog p = -A·γp/(p+γ)² (chain rule: dp/dlog p = p).
"""

import math

import pytest
import torch
from conftest import load_algo
from loss_checks import assert_padding_changes_nothing
from transformers import AutoTokenizer

from common.data import TINY_MODEL_DIR, format_prompt, load_problems
from common.verifiers import compute_rewards


@pytest.fixture(scope="module")
def luffy():
    return load_algo("luffy")


# ---------------------------------------------------------------------------------------------- advantages
def test_advantages_over_the_union_hand_values(luffy):
    # 3 failed samples + a correct teacher: mean 0.25 includes the teacher's own reward
    adv = luffy.compute_advantages(torch.tensor([0.0, 0, 0, 1, 1, 1, 1, 1]), group_size=4)
    assert torch.allclose(adv[:4], torch.tensor([-0.25, -0.25, -0.25, 0.75]))
    assert torch.equal(adv[4:], torch.zeros(4))  # teacher and samples all correct: no signal
    # the reference example: 7 failures + teacher -> teacher 7/8, each failure -1/8
    adv8 = luffy.compute_advantages(torch.tensor([0.0] * 7 + [1.0]), group_size=8)
    assert adv8[-1].item() == pytest.approx(7 / 8) and torch.allclose(adv8[:7], torch.full((7,), -1 / 8))


def test_advantages_sum_to_zero_per_group_and_std_flag(luffy):
    torch.manual_seed(0)
    rewards = torch.rand(5 * 6)
    adv = luffy.compute_advantages(rewards, group_size=6)
    assert torch.allclose(adv.view(5, 6).sum(1), torch.zeros(5), atol=1e-6)
    assert torch.allclose(adv[6:12], luffy.compute_advantages(rewards[6:12], 6))  # groups are independent
    # --std-normalize: sample std of [0,0,0,1] is 0.5 -> [-0.5, -0.5, -0.5, 1.5]
    adv_std = luffy.compute_advantages(torch.tensor([0.0, 0, 0, 1]), 4, std_normalize=True)
    assert torch.allclose(adv_std, torch.tensor([-0.5, -0.5, -0.5, 1.5]), atol=1e-5)
    assert torch.equal(luffy.compute_advantages(torch.ones(4), 4, std_normalize=True), torch.zeros(4))
    with pytest.raises(ValueError, match="group_size"):
        luffy.compute_advantages(rewards, group_size=1)
    with pytest.raises(ValueError, match="groups of 4"):
        luffy.compute_advantages(rewards[:6], group_size=4)


# ---------------------------------------------------------------------------------------------- teacher term
def _teacher_grads(luffy, p: float, adv: float = 1.0, gamma: float = 0.1, old_shift: float = 0.0, **kw):
    """Gradients of the loss w.r.t. p and w.r.t. log p for one teacher token (B=1, T=1)."""
    prob = torch.tensor([[p]], dtype=torch.float64, requires_grad=True)
    logp = torch.log(prob)
    logp.retain_grad()
    old = logp.detach() + old_shift  # ignored on teacher rows
    loss, metrics = luffy.policy_loss(
        logp,
        old,
        torch.tensor([adv], dtype=torch.float64),
        torch.ones(1, 1),
        torch.tensor([True]),
        shaping_gamma=gamma,
        **kw,
    )
    loss.backward()
    return prob.grad.item(), logp.grad.item(), loss.item(), metrics


@pytest.mark.parametrize("p, per_prob", [(0.01, 0.1 / 0.11**2), (0.1, 2.5), (0.5, 0.1 / 0.36), (0.9, 0.1)])
def test_teacher_gradient_per_unit_probability_is_gamma_over_p_plus_gamma_squared(luffy, p, per_prob):
    g_prob, g_logp, loss, _ = _teacher_grads(luffy, p, adv=1.0)
    assert loss == pytest.approx(-p / (p + 0.1))  # -A·f(p), one token
    assert -g_prob == pytest.approx(per_prob, rel=1e-6)  # d(-loss)/dp = γ/(p+γ)²
    assert -g_logp == pytest.approx(0.1 * p / (p + 0.1) ** 2, rel=1e-6)  # d(-loss)/dlog p = γp/(p+γ)²


def test_teacher_gradient_shape_decreasing_in_p_and_peaked_in_log_p(luffy):
    grid = [0.001, 0.01, 0.03, 0.06, 0.1, 0.15, 0.3, 0.6, 0.99]
    per_prob, per_logp = zip(*[(-g[0], -g[1]) for g in (_teacher_grads(luffy, p) for p in grid)])
    assert all(a > b for a, b in zip(per_prob, per_prob[1:]))  # γ/(p+γ)² strictly decreasing in p
    assert grid[max(range(len(grid)), key=per_logp.__getitem__)] == 0.1  # γp/(p+γ)² peaks at p = γ
    assert max(per_logp) == pytest.approx(0.25)  # the peak value γ·γ/(2γ)² = 1/4
    assert per_logp[0] < 0.01 and per_logp[-1] < 0.1  # vanishes at both ends (SFT would give 1 everywhere)
    # another γ moves the peak: γ = 0.3 peaks at p = 0.3
    per_logp3 = [-_teacher_grads(luffy, p, gamma=0.3)[1] for p in (0.1, 0.2, 0.3, 0.45, 0.6)]
    assert max(range(5), key=per_logp3.__getitem__) == 2


def test_no_shaping_is_plain_importance_weight(luffy):
    # f(p) = p with π_φ = 1: the gradient on log p is A·p (ratio π_θ/1), the loss -A·p
    for p in (0.05, 0.5, 0.95):
        g_prob, g_logp, loss, m = _teacher_grads(luffy, p, adv=2.0, shaping=False)
        assert loss == pytest.approx(-2.0 * p) and g_prob == pytest.approx(-2.0) and g_logp == pytest.approx(-2.0 * p)
        assert m["teacher_grad_weight"] == pytest.approx(p)


@pytest.mark.parametrize("old_shift", [-5.0, -0.5, 0.0, 0.5, 5.0])  # ratio π_θ/π_old from e^5 to e^-5
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_teacher_tokens_are_never_clipped(luffy, old_shift, adv):
    p = 0.3
    _, g_logp, loss, metrics = _teacher_grads(luffy, p, adv=adv, old_shift=old_shift)
    assert g_logp == pytest.approx(-adv * 0.1 * p / (p + 0.1) ** 2, rel=1e-6)  # same whatever π_old says
    assert loss == pytest.approx(-adv * p / (p + 0.1))
    assert (
        "clip_frac" not in metrics and "ratio" not in metrics
    )  # a teacher-only micro-batch logs no policy-token statistics (not a spurious 0)
    assert metrics["teacher_f"] == pytest.approx(p / (p + 0.1)) and metrics["teacher_prob"] == pytest.approx(p)
    assert metrics["teacher_grad_weight"] == pytest.approx(0.1 * p / (p + 0.1) ** 2)


# ---------------------------------------------------------------------------------------------- on-policy term
@pytest.mark.parametrize(
    "adv, ratio, has_grad",
    [(1.0, 1.3, False), (1.0, 1.1, True), (1.0, 0.7, True), (-1.0, 0.7, False), (-1.0, 0.9, True), (-1.0, 1.3, True)],
)
def test_on_policy_tokens_still_clip(luffy, adv, ratio, has_grad):
    old = torch.tensor([[-1.0]])
    for clip in (True, False):
        lp = (old + math.log(ratio)).requires_grad_()
        loss, metrics = luffy.policy_loss(
            lp, old, torch.tensor([adv]), torch.ones(1, 1), torch.tensor([False]), on_policy_clip=clip
        )
        loss.backward()
        clipped = clip and not has_grad
        assert (lp.grad.abs().item() > 0) == (not clipped)
        assert metrics["clip_frac"] == (1.0 if clipped else 0.0)
        assert "teacher_f" not in metrics  # no teacher token in this batch
        if not clipped:  # d/dlogp of -A·r is -A·r
            assert lp.grad.item() == pytest.approx(-adv * ratio, rel=1e-5)


def test_same_token_clipped_on_policy_but_not_as_teacher(luffy):
    # two rows with identical numbers, ratio e^1 far above 1+ε, A > 0: only the teacher row gets gradient
    old = torch.tensor([[-2.0], [-2.0]])
    lp = (old + 1.0).requires_grad_()
    loss, metrics = luffy.policy_loss(lp, old, torch.tensor([1.0, 1.0]), torch.ones(2, 1), torch.tensor([False, True]))
    loss.backward()
    p = math.exp(-1.0)
    assert lp.grad[0].item() == 0.0
    assert lp.grad[1].item() == pytest.approx(-0.1 * p / (p + 0.1) ** 2 / 2, rel=1e-5)  # token mean over 2 tokens
    assert metrics["clip_frac"] == 1.0  # of on-policy tokens only


# ---------------------------------------------------------------------------------------------- aggregation
def test_aggregation_is_token_mean_over_the_batch(luffy):
    # on-policy rows: per-token loss -A; lengths 1 and 3 -> (a + 3b)/4, not the per-sequence mean (a+b)/2
    a, b = 0.7, -0.4
    lp = torch.tensor([[-1.0, 0, 0, 0], [-1.0, -1.0, -1.0, 0]], requires_grad=True)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    loss, _ = luffy.policy_loss(lp, lp.detach(), torch.tensor([-a, -b]), mask, torch.tensor([False, False]))
    assert loss.item() == pytest.approx((a + 3 * b) / 4)
    # a teacher row of 2 tokens with p = 0.1 and 0.4 beside one on-policy token: (-A_on - A_off(f(.1)+f(.4))) / 3
    lp2 = torch.log(torch.tensor([[0.5, 0.5], [0.1, 0.4]]))
    loss2, _ = luffy.policy_loss(
        lp2, lp2, torch.tensor([0.3, 0.6]), torch.tensor([[1, 0], [1, 1]]), torch.tensor([False, True])
    )
    assert loss2.item() == pytest.approx((-0.3 - 0.6 * (0.5 + 0.8)) / 3, rel=1e-6)


def _random_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    lp0 = -torch.rand(6, 7, generator=g) * 3
    old = lp0 + 0.3 * torch.randn(6, 7, generator=g)
    adv = torch.randn(6, generator=g)
    mask = (torch.rand(6, 7, generator=g) > 0.3).long()
    mask[:, 0] = 1
    off = torch.tensor([False, False, True, False, True, False])
    return lp0, old, adv, mask, off


def test_micro_batches_accumulate_to_the_minibatch_gradient(luffy):
    lp0, old, adv, mask, off = _random_batch(1)
    whole = lp0.clone().requires_grad_()
    loss_whole, _ = luffy.policy_loss(whole, old, adv, mask, off)
    loss_whole.backward()
    parts, total = lp0.clone().requires_grad_(), 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):  # uneven micro-batches, teacher rows in two of them
        loss, _ = luffy.policy_loss(parts[rows], old[rows], adv[rows], mask[rows], off[rows], num_tokens=mask.sum())
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(loss_whole.item(), abs=1e-6)
    assert torch.allclose(whole.grad, parts.grad, atol=1e-7)
    # without the mini-batch normaliser the micro-batch means do not add up (the test can fail)
    naive = sum(
        luffy.policy_loss(lp0[r], old[r], adv[r], mask[r], off[r])[0].item()
        for r in (slice(0, 1), slice(1, 4), slice(4, 6))
    )
    assert naive != pytest.approx(loss_whole.item(), abs=1e-3)


def test_padding_changes_nothing(luffy):
    lp0, old, adv, mask, off = _random_batch(2)
    # padded log-probs become > 0: nonsense on purpose
    assert_padding_changes_nothing(
        lambda lp, o, a, m, shift: luffy.policy_loss(lp, o, a, m, off), lp0, old, adv, mask, garbage=3.0
    )


# ---------------------------------------------------------------------------------------------- teacher traces
@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR)


def test_teacher_completion_is_solution_plus_eos_and_truncates(luffy, tok):
    problem = {"prompt": "4+7-2=?", "answer": "9", "solution": "4+7=11;11-2=9;\\boxed{9}"}
    rendered = format_prompt(problem["prompt"], "chat", tok)
    (full,) = luffy.teacher_completions([problem], [rendered], tok, max_new_tokens=40)
    ids = tok(problem["solution"], add_special_tokens=False)["input_ids"]
    assert full.token_ids == ids + [tok.eos_token_id] and full.finish_reason == "stop"
    assert full.logprobs == [0.0] * len(full.token_ids)  # log π_φ = 0: teacher probabilities taken as 1
    assert tok.decode(full.token_ids, skip_special_tokens=True) == problem["solution"]
    (exact,) = luffy.teacher_completions([problem], [rendered], tok, max_new_tokens=len(ids) + 1)
    assert exact.finish_reason == "stop" and exact.token_ids[-1] == tok.eos_token_id
    (cut,) = luffy.teacher_completions([problem], [rendered], tok, max_new_tokens=len(ids))
    assert cut.finish_reason == "length" and cut.token_ids == ids  # no EOS once truncated
    with pytest.raises(ValueError, match="solution"):
        luffy.teacher_completions([{**problem, "solution": ""}], [rendered], tok, 40)


def test_teacher_trace_drops_a_think_the_prompt_already_opened(luffy, tok):
    problem = {"prompt": "q", "answer": "1", "solution": "<think>\nx=1</think>\\boxed{1}"}
    (c,) = luffy.teacher_completions([problem], ["User: q. Assistant: <think>\n"], tok, 100)
    assert tok.decode(c.token_ids, skip_special_tokens=True) == "x=1</think>\\boxed{1}"
    (c2,) = luffy.teacher_completions([problem], ["<|im_start|>assistant\n"], tok, 100)
    assert tok.decode(c2.token_ids, skip_special_tokens=True) == problem["solution"]


@pytest.mark.parametrize("dataset", ["arith", "arith-hard"])
def test_offline_teachers_fit_the_default_budget_and_are_correct(luffy, tok, dataset):
    problems = load_problems(dataset, "train")[:300]
    rendered = [format_prompt(p["prompt"], "chat", tok) for p in problems]
    teachers = luffy.teacher_completions(problems, rendered, tok, max_new_tokens=40)  # Args.max_new_tokens
    assert all(t.finish_reason == "stop" for t in teachers)
    texts = tok.batch_decode([t.token_ids for t in teachers], skip_special_tokens=True)
    assert all(o.correct for o in compute_rewards("exact", texts, [p["answer"] for p in problems]))


# ---------------------------------------------------------------------------------------------- rollout correction
def test_correction_weights_of_one_change_nothing(luffy):
    lp0, old, adv, mask, off = _random_batch(3)
    a, b = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
    la, ma = luffy.policy_loss(a, old, adv, mask, off)
    lb, mb = luffy.policy_loss(b, old, adv, mask, off, is_weights=torch.ones_like(lp0))
    la.backward()
    lb.backward()
    assert la.item() == lb.item() and torch.equal(a.grad, b.grad) and ma == mb  # exactly, not approximately


def test_correction_weights_multiply_the_on_policy_surrogate_hand_values(luffy):
    # one on-policy sequence, two tokens, A = 1, ratios 1.1 (inside [0.8, 1.2]) and 1.5 (clipped to 1.2), w = [2, 0.5]
    # ℓ_1 = -w_1·1.1 = -2.2, ∂ℓ_1/∂log π = -2.2;  ℓ_2 = -w_2·1.2 = -0.6, ∂ℓ_2/∂log π = 0 (clipped)
    # token mean over 2 tokens: L = -1.4, grad = [-1.1, 0]
    old = torch.tensor([[-1.0, -2.0]])
    lp = (old + torch.log(torch.tensor([[1.1, 1.5]]))).requires_grad_()
    w = torch.tensor([[2.0, 0.5]])
    loss, _ = luffy.policy_loss(lp, old, torch.ones(1), torch.ones(1, 2), torch.tensor([False]), is_weights=w)
    loss.backward()
    assert loss.item() == pytest.approx(-1.4, rel=1e-6)
    assert lp.grad.tolist()[0] == pytest.approx([-1.1, 0.0], abs=1e-6)


def test_teacher_rows_have_weight_one_whatever_is_passed(luffy):
    # row 0 on-policy: π_θ = π_old = 0.5 (ρ = 1), A = 1, w = 2 -> ℓ = -2, ∂ℓ/∂log π = -2
    # row 1 teacher: p = 0.3, A = 1, a nonsense weight 7 -> ℓ = -f(0.3) = -0.75, ∂ℓ/∂log p = -γp/(p+γ)² = -0.1875
    # token mean over 2 tokens: L = (-2 - 0.75)/2 = -1.375, grad = [-1, -0.09375]
    lp = torch.log(torch.tensor([[0.5], [0.3]])).requires_grad_()
    w = torch.tensor([[2.0], [7.0]])
    loss, _ = luffy.policy_loss(
        lp, lp.detach(), torch.ones(2), torch.ones(2, 1), torch.tensor([False, True]), is_weights=w
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.375, rel=1e-6)
    assert lp.grad.flatten().tolist() == pytest.approx([-1.0, -0.09375], rel=1e-6)


def test_teacher_rows_stay_out_of_the_correction_as_main_builds_it(luffy):
    """main passes the on-policy mask to correction_weights: a teacher row's "rollout log-probs" are the 0 that
    teacher_completions reports (π_φ = 1), not a sampler's, so its ratio π_old/1 = p must neither weight it nor enter
    the mismatch metrics."""
    import ast
    import inspect

    from common.correction import CorrectionConfig, correction_weights

    # on row: π_old = [0.5, 0.4], μ = [0.25, 0.8] -> ρ = [2, 0.5], token_truncate C = 2 -> w = [2, 0.5];
    # k3 = mean(ρ - 1 - log ρ) = ((1 - ln 2) + (-0.5 + ln 2))/2 = 0.25, |log ρ| = ln 2 on both tokens.
    # teacher row: π_old = 0.3 against μ "= 1": ρ = 0.3 (|log ρ| = 1.204) would down-weight it and raise the metrics
    old = torch.log(torch.tensor([[0.5, 0.4], [0.3, 0.3]]))
    rollout = torch.tensor([[math.log(0.25), math.log(0.8)], [0.0, 0.0]])
    mask, off = torch.ones(2, 2), torch.tensor([False, True])
    on_mask = mask * (~off).float().unsqueeze(-1)  # as main
    w, stats = correction_weights(old, rollout, on_mask, CorrectionConfig(mode="token_truncate", cap=2.0))
    assert w[0].tolist() == pytest.approx([2.0, 0.5], rel=1e-6)
    assert stats["mismatch_kl_k3"] == pytest.approx(0.25, rel=1e-5)
    assert stats["log_ratio_abs_max"] == pytest.approx(math.log(2), rel=1e-5)
    lp_a, lp_b = old.clone().requires_grad_(), old.clone().requires_grad_()
    luffy.policy_loss(lp_a, old, torch.ones(2), mask, off, is_weights=w)[0].backward()
    luffy.policy_loss(lp_b, old, torch.ones(2), mask, off)[0].backward()
    assert torch.equal(lp_a.grad[1], lp_b.grad[1])  # the teacher row: weight 1
    assert lp_a.grad[0].tolist() == pytest.approx((lp_b.grad[0] * torch.tensor([2.0, 0.5])).tolist(), rel=1e-6)
    call = next(
        c
        for c in ast.walk(ast.parse(inspect.getsource(luffy.main)))
        if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "correction_weights"
    )
    assert ast.unparse(call.args[2]) == "on_mask"


def test_correction_weights_leave_the_kl_term_alone(luffy):
    # π_θ = π_old = 0.5 (ρ = 1), π_ref = 0.25, A = 1, β = 0.1, w = [2, 0.5]; k3 = 0.5 + ln 2 - 1 per token and
    # ∂k3/∂log π_θ = 1 - π_ref/π_θ = 0.5: L = (-2 - 0.5)/2 + 0.1·k3 = -1.2306853 (-1.2258571 were k3 weighted too),
    # grad = (-w + 0.1·0.5)/2 = [-0.975, -0.225]
    lp = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_()
    ref, w = torch.log(torch.tensor([[0.25, 0.25]])), torch.tensor([[2.0, 0.5]])
    loss, _ = luffy.policy_loss(
        lp,
        lp.detach(),
        torch.ones(1),
        torch.ones(1, 2),
        torch.tensor([False]),
        kl_coef=0.1,
        ref_logprobs=ref,
        is_weights=w,
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.25 + 0.1 * (0.5 + math.log(2) - 1), rel=1e-6)
    assert lp.grad.tolist()[0] == pytest.approx([-0.975, -0.225], rel=1e-6)
