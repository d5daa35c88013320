"""PRIME (implicit PRM, leave-one-out advantages, prompt filter) against hand-derived values (reference notes §3.8)."""

import math

import pytest
import torch
from conftest import load_algo
from loss_checks import on_two_fake_ranks
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.data import TINY_MODEL_DIR, format_prompt
from common.rollout import left_pad


@pytest.fixture(scope="module")
def prime():
    return load_algo("prime")


def _whiten_sample(values: list[float]) -> torch.Tensor:
    """Reference whitening of a flat list of valid-token values: mean, Bessel variance."""
    x = torch.tensor(values, dtype=torch.float64)
    return (x - x.mean()) / x.std(unbiased=True)


# ---------------------------------------------------------------- implicit process rewards
def test_process_rewards_are_beta_log_ratio_and_zero_at_init(prime):
    prm = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -9.0, -9.0]])
    ref = torch.tensor([[-1.5, -2.0, -0.1], [-0.3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    r = prime.implicit_process_rewards(prm, ref, mask, beta=0.05)
    assert torch.allclose(r, torch.tensor([[0.05 * 0.5, 0.0, 0.05 * -0.4], [0.0, 0.0, 0.0]]))
    assert torch.equal(prime.implicit_process_rewards(prm, prm, mask), torch.zeros(2, 3))  # PRM == reference


def test_zero_last_drops_only_each_responses_last_token_reward(prime):
    """--process-reward-zero-last: verl's recipe/prime/prime_dp_rm.py writes token_level_score[i, :L-1] = r[i, :L-1]
    (the last token's reward stays 0); off by default, as PRIME-RL/PRIME's dp_prime.py, which keeps it."""
    prm = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.0, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.1], [-0.5, -0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # row 1: last valid token at index 1, then padding
    # log-ratios: row 0: 0.5, -1.0, -0.4; row 1: 0.2, -0.8 (padding ignored); β = 0.1
    kept = prime.implicit_process_rewards(prm, ref, mask, beta=0.1)
    assert torch.allclose(kept, torch.tensor([[0.05, -0.1, -0.04], [0.02, -0.08, 0.0]]))
    zeroed = prime.implicit_process_rewards(prm, ref, mask, beta=0.1, zero_last=True)
    assert torch.allclose(zeroed, torch.tensor([[0.05, -0.1, 0.0], [0.02, 0.0, 0.0]]))
    assert prime.Args.process_reward_zero_last is False  # the default keeps today's behaviour


@pytest.fixture(scope="module")
def tiny_pair():
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    ref = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()
    prm = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in prm.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return tok, prm, ref


def _sequence_logprob(model, prompt: list[int], completion: list[int]) -> float:
    """log π(y | x) of the whole completion from one unpadded forward (no per-token helper involved)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return sum(logp[len(prompt) - 1 + t, y].item() for t, y in enumerate(completion))


def test_summed_process_rewards_equal_the_sequence_log_ratio(prime, tiny_pair):
    tok, prm, ref = tiny_pair
    prompts = [tok(format_prompt(q, "chat", tok))["input_ids"] for q in ("1+2=?", "9-8+7-6=?")]
    completions = [tok("1+2=3;\\boxed{3}")["input_ids"] + [tok.eos_token_id], tok("9-8=1;")["input_ids"]]
    width = max(map(len, completions))
    ids, am = left_pad(prompts, tok.pad_token_id, "cpu")
    comp = torch.full((2, width), tok.pad_token_id)
    mask = torch.zeros(2, width)
    for i, c in enumerate(completions):
        comp[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1
    ids, am = torch.cat([ids, comp], 1), torch.cat([am, mask.long()], 1)
    with torch.no_grad():
        lp_prm, _ = prime.token_logprobs(prm, ids, am, width, 1.0)
        lp_ref, _ = prime.token_logprobs(ref, ids, am, width, 1.0)
    beta = 0.05
    sums = prime.implicit_process_rewards(lp_prm, lp_ref, mask, beta).sum(-1)
    for i in range(2):
        expected = beta * (
            _sequence_logprob(prm, prompts[i], completions[i]) - _sequence_logprob(ref, prompts[i], completions[i])
        )
        assert abs(expected) > 1e-4  # the perturbed PRM really differs from the reference
        assert sums[i].item() == pytest.approx(expected, abs=1e-5)


# ---------------------------------------------------------------- PRM loss
def test_prm_loss_values_and_gradient_signs(prime):
    # one token each; log-ratios 10 and 10 with β = 0.05 -> sequence rewards 0.5, σ(0.5) = 0.62246
    lp = torch.tensor([[-1.0], [-1.0]], requires_grad=True)
    ref = torch.tensor([[-11.0], [-11.0]])
    correct = torch.tensor([1.0, 0.0])
    loss = prime.prm_loss(lp, ref, torch.ones(2, 1), correct, beta=0.05)
    s = 1 / (1 + math.exp(-0.5))
    assert loss.item() == pytest.approx((-math.log(s) - math.log(1 - s)) / 2, rel=1e-5)
    loss.backward()
    # dL/dlogπ_φ = β(σ - y)/B: negative for the correct sample (descent raises log π_φ(y)), positive for the other
    assert lp.grad[0, 0].item() == pytest.approx(0.05 * (s - 1) / 2, rel=1e-5) and lp.grad[0, 0] < 0
    assert lp.grad[1, 0].item() == pytest.approx(0.05 * s / 2, rel=1e-5) and lp.grad[1, 0] > 0
    # at initialisation (PRM == reference) the loss is log 2 whatever the labels
    assert prime.prm_loss(ref, ref, torch.ones(2, 1), correct).item() == pytest.approx(math.log(2))


def test_prm_step_raises_correct_and_lowers_incorrect_sequence_logprob(prime, tiny_pair):
    tok, _, ref = tiny_pair
    prompt = tok(format_prompt("2+3=?", "chat", tok))["input_ids"]
    completion = tok("2+3=5;\\boxed{5}")["input_ids"] + [tok.eos_token_id]
    ids, width = torch.tensor([prompt + completion]), len(completion)
    am, mask = torch.ones_like(ids), torch.ones(1, width)
    with torch.no_grad():
        ref_lp, _ = prime.token_logprobs(ref, ids, am, width, 1.0)
    for label, direction in ((1.0, +1), (0.0, -1)):
        prm = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
        before = _sequence_logprob(prm, prompt, completion)
        lp, _ = prime.token_logprobs(prm, ids, am, width, 1.0)
        prime.prm_loss(lp, ref_lp, mask, torch.tensor([label])).backward()
        norm = torch.sqrt(sum((p.grad**2).sum() for p in prm.parameters()))
        with torch.no_grad():
            for p in prm.parameters():
                p -= 0.01 / norm * p.grad  # one small plain gradient step (length 0.01)
        assert direction * (_sequence_logprob(prm, prompt, completion) - before) > 0


def test_prm_loss_micro_batches_accumulate(prime):
    torch.manual_seed(3)
    lp0, ref = torch.randn(4, 5), torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    correct = torch.tensor([1.0, 0.0, 0.0, 1.0])
    whole = lp0.clone().requires_grad_()
    prime.prm_loss(whole, ref, mask, correct).backward()
    parts = lp0.clone().requires_grad_()
    for rows in (slice(0, 3), slice(3, 4)):
        prime.prm_loss(parts[rows], ref[rows], mask[rows], correct[rows], num_sequences=4).backward()
    assert torch.allclose(whole.grad, parts.grad, atol=1e-7)


def test_prm_ranking_accuracy(prime):
    # group 1: both correct samples outrank both incorrect ones -> 4/4 pairs
    # group 2: correct {0, 3}, incorrect {1, 2}: (0,1) wrong, (0,2) tie = 1/2, (3,1) wrong, (3,2) wrong -> 0.5/4
    rewards = torch.tensor([0.3, 0.1, 0.2, 0.0, 0.1, 0.2, 0.1, 0.0])
    correct = torch.tensor([1, 0, 1, 0, 1, 0, 0, 1])
    assert prime.prm_ranking_accuracy(rewards[:4], correct[:4], 4) == pytest.approx(1.0)
    assert prime.prm_ranking_accuracy(rewards[4:], correct[4:], 4) == pytest.approx(0.125)
    assert prime.prm_ranking_accuracy(rewards, correct, 4) == pytest.approx(4.5 / 8)  # pooled over pairs
    assert prime.prm_ranking_accuracy(rewards[:4], torch.ones(4), 4) == 0.5  # no mixed group: uninformative


# ---------------------------------------------------------------- advantages
def test_advantages_at_init_reduce_to_whitened_rloo(prime):
    # PRM == reference -> zero process rewards; RLOO of [1,0,0,0] = [1, -1/3, -1/3, -1/3] on every token.
    # lengths 2,1,1,2 -> token values 1,1,-1/3,-1/3,-1/3,-1/3: mean 1/9, Σ(dev²) = 192/81, Bessel var = 192/405,
    # so the whitened values are (8/9)/sqrt(192/405) = sqrt(5/3) and (-4/9)/sqrt(192/405) = -sqrt(5/3)/2
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 1]])
    lp = torch.randn(4, 2)
    process = prime.implicit_process_rewards(lp, lp, mask)
    adv = prime.compute_advantages(torch.tensor([1.0, 0, 0, 0]), process, mask, group_size=4)
    a, b = math.sqrt(5 / 3), -math.sqrt(5 / 3) / 2
    assert torch.allclose(adv, torch.tensor([[a, a], [b, 0], [b, 0], [b, b]]), atol=1e-5)


def test_outcome_leave_one_out_sums_to_zero_per_group(prime):
    rewards = torch.tensor([1.0, 0, 0, 0, 0.5, 1.0, 0.0, 0.5])
    mask = torch.ones(8, 1)  # one token each: whitening is a common shift (0 here) and scale
    adv = prime.compute_advantages(rewards, torch.zeros(8, 1), mask, group_size=4)[:, 0]
    assert torch.allclose(adv.view(2, 4).sum(1), torch.zeros(2), atol=1e-5)
    rloo = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 2 / 3, -2 / 3, 0.0])  # r_i - mean_{j≠i} r_j
    assert torch.allclose(adv, _whiten_sample(rloo.tolist()).float(), atol=1e-5)
    with pytest.raises(ValueError, match="group_size"):
        prime.compute_advantages(rewards, torch.zeros(8, 1), mask, group_size=1)


def test_process_leave_one_out_returns_hand_values(prime):
    # K = 2, no outcome signal. Sample 0 token rewards [0.2, 0.4] (mean 0.3), sample 1 [0.1] (mean 0.1).
    # baselines: sample 0 -> 0.1, sample 1 -> 0.3; returns (γ = 1): sample 0 [0.1+0.3, 0.3] = [0.4, 0.3],
    # sample 1 [-0.2]
    process = torch.tensor([[0.2, 0.4], [0.1, 7.0]])  # 7.0 sits in padding and must be ignored
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = prime.compute_advantages(torch.zeros(2), process, mask, group_size=2)
    expected = _whiten_sample([0.4, 0.3, -0.2]).float()
    assert torch.allclose(adv[mask.bool()], expected, atol=1e-5)
    assert adv[1, 1] == 0


def test_advantages_sum_both_sources(prime):
    # outcome [1, 0] -> RLOO [1, -1] on every token; process as in the previous test -> raw [1.4, 1.3] and [-1.2]
    process = torch.tensor([[0.2, 0.4], [0.1, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = prime.compute_advantages(torch.tensor([1.0, 0.0]), process, mask, group_size=2)
    assert torch.allclose(adv[mask.bool()], _whiten_sample([1.4, 1.3, -1.2]).float(), atol=1e-5)


def test_whitening_statistics_span_processes(prime):
    torch.manual_seed(0)
    x, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).long()
    whole = prime.masked_whiten(x, mask)
    out = on_two_fake_ranks(prime.masked_whiten, x, mask)
    assert torch.allclose(out, whole, atol=1e-6)


# ---------------------------------------------------------------- prompt filter
@pytest.mark.parametrize(
    "group_size, n_correct, kept",
    [
        (4, 0, False),
        (4, 1, True),
        (4, 2, True),
        (4, 3, True),
        (4, 4, False),
        (8, 1, False),
        (8, 2, True),
        (8, 6, True),
        (8, 7, False),
        (5, 1, True),
        (5, 4, True),
    ],
)
def test_filter_keeps_accuracy_in_closed_interval(prime, group_size, n_correct, kept):
    correct = torch.tensor([1.0] * n_correct + [0.0] * (group_size - n_correct))
    assert prime.filter_groups(correct, group_size, 0.2, 0.8).tolist() == [kept]


def test_filter_is_per_group(prime):
    correct = torch.tensor([0, 0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 1.0])
    assert prime.filter_groups(correct, 4).tolist() == [False, True, False, True]


# ---------------------------------------------------------------- policy loss
def test_policy_loss_is_a_token_mean_and_accumulates(prime):
    a, b = 0.7, -0.4
    lp = torch.tensor([[-1.0, 0, 0, 0], [-1.0, -1.0, -1.0, 0]], requires_grad=True)
    adv = torch.tensor([[-a, 0, 0, 0], [-b, -b, -b, 0]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    loss, _ = prime.policy_loss(lp, lp.detach(), adv, mask)
    assert loss.item() == pytest.approx((a + 3 * b) / 4)  # token mean, not (a+b)/2
    torch.manual_seed(1)
    lp0, adv = torch.randn(4, 6), torch.randn(4, 6)
    old = lp0 + 0.3 * torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).long()
    mask[:, 0] = 1
    whole = lp0.clone().requires_grad_()
    prime.policy_loss(whole, old, adv, mask)[0].backward()
    parts = lp0.clone().requires_grad_()
    for rows in (slice(0, 1), slice(1, 4)):
        prime.policy_loss(parts[rows], old[rows], adv[rows], mask[rows], num_tokens=float(mask.sum()))[0].backward()
    assert torch.allclose(whole.grad, parts.grad, atol=1e-7)


@pytest.mark.parametrize(
    "adv, ratio, has_grad", [(1.0, 1.3, False), (1.0, 1.1, True), (-1.0, 0.7, False), (-1.0, 1.3, True)]
)
def test_policy_clipping(prime, adv, ratio, has_grad):
    old = torch.tensor([[-1.0]])
    lp = (old + math.log(ratio)).requires_grad_()
    loss, _ = prime.policy_loss(lp, old, torch.tensor([[adv]]), torch.ones(1, 1), clip_eps=0.2)
    loss.backward()
    assert (lp.grad.abs().item() > 0) == has_grad


def test_process_reward_normalisation_hand_values(prime):
    """PRIME's batch_norm: divide by the largest |reverse cumulative sum| over the batch (+1e-6).
    Row 0: r = [1, -2, 0.5] -> reverse sums [-0.5, -1.5, 0.5]; row 1: [0.25, 0, 0] -> [0.25, 0, 0]; max |.| = 1.5."""
    r = torch.tensor([[1.0, -2.0, 0.5], [0.25, 0.0, 0.0]])
    out = prime.normalize_process_rewards(r)
    assert torch.allclose(out, r / (1.5 + 1e-6))
    returns = out.flip(-1).cumsum(-1).flip(-1)
    assert returns.abs().max().item() == pytest.approx(1.0, abs=1e-5)  # the largest process return becomes 1
    assert torch.equal(prime.normalize_process_rewards(torch.zeros(2, 3)), torch.zeros(2, 3))  # no NaN at step 1


def test_process_reward_normalisation_uses_the_whole_batch_over_processes(prime):
    """Split over two processes, each half is scaled by the max of the whole batch (as one process would)."""
    r = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    whole = prime.normalize_process_rewards(r)
    halves = [r[:3], r[3:]]
    scales = [h.flip(-1).cumsum(-1).flip(-1).abs().max() for h in halves]
    shared_max = lambda t: torch.stack(scales).max()  # what gather(...).max() returns on every rank
    split = torch.cat([prime.normalize_process_rewards(h, shared_max) for h in halves])
    assert torch.allclose(split, whole)
    alone = torch.cat([prime.normalize_process_rewards(h) for h in halves])  # each rank's own max: differs
    assert not torch.allclose(alone, whole)


# ---------------------------------------------------------------- rollout correction (common/correction.py)
def test_correction_weights_of_one_change_nothing(prime):
    torch.manual_seed(3)
    lp0, adv, ref = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
    old, mask = lp0 + 0.3 * torch.randn(3, 5), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    a, b = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
    la, ma = prime.policy_loss(a, old, adv, mask, kl_coef=0.1, ref_logprobs=ref)
    lb, mb = prime.policy_loss(b, old, adv, mask, kl_coef=0.1, ref_logprobs=ref, is_weights=torch.ones(3, 5))
    la.backward()
    lb.backward()
    assert la.item() == lb.item() and torch.equal(a.grad, b.grad) and ma == mb  # exactly, not approximately


def test_correction_weights_multiply_the_clipped_surrogate_hand_values(prime):
    # one sequence, two tokens, A = 1, ratios 1.1 (inside [0.8, 1.2]) and 1.5 (clipped to 1.2), weights w = [2, 0.5]
    # ℓ_1 = -w_1·1.1 = -2.2, ∂ℓ_1/∂log π = -w_1·ρ_1 = -2.2;  ℓ_2 = -w_2·1.2 = -0.6, ∂ℓ_2/∂log π = 0 (clipped)
    # token mean over 2 tokens: L = (-2.2 - 0.6)/2 = -1.4, grad = [-1.1, 0]
    old = torch.tensor([[-1.0, -2.0]])
    lp = (old + torch.log(torch.tensor([[1.1, 1.5]]))).requires_grad_()
    loss, _ = prime.policy_loss(lp, old, torch.ones(1, 2), torch.ones(1, 2), is_weights=torch.tensor([[2.0, 0.5]]))
    loss.backward()
    assert loss.item() == pytest.approx(-1.4, rel=1e-6)
    assert lp.grad.tolist()[0] == pytest.approx([-1.1, 0.0], abs=1e-6)


def test_correction_weights_leave_the_kl_term_alone(prime):
    # π_θ = π_old = 0.5 (ρ = 1), π_ref = 0.25, A = 1, β = 0.1, w = [2, 0.5]. k3 = π_ref/π_θ - log(π_ref/π_θ) - 1
    # = 0.5 + ln 2 - 1 = 0.1931472 per token, ∂k3/∂log π_θ = 1 - π_ref/π_θ = 0.5.
    # L = (-2 + 0.1·k3 - 0.5 + 0.1·k3)/2 = -1.25 + 0.1·k3 = -1.2306853   (weighting k3 too would give -1.2258571)
    # grad = (-w·ρ·A + 0.1·0.5)/2 = [-0.975, -0.225]
    lp = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.25, 0.25]]))
    w = torch.tensor([[2.0, 0.5]])
    loss, m = prime.policy_loss(lp, lp.detach(), torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.1, ref, is_weights=w)
    loss.backward()
    k3 = 0.5 + math.log(2) - 1
    assert loss.item() == pytest.approx(-1.25 + 0.1 * k3, rel=1e-6) and m["kl"] == pytest.approx(k3, rel=1e-6)
    assert lp.grad.tolist()[0] == pytest.approx([-0.975, -0.225], rel=1e-6)


def test_only_the_policy_loss_takes_the_correction_weights(prime):
    """The PRM's BCE loss and the implicit rewards are fitted on the outcome, not a policy gradient: no weight."""
    import ast
    import inspect

    for fn in (prime.prm_loss, prime.implicit_process_rewards, prime.compute_advantages):
        assert "is_weights" not in inspect.signature(fn).parameters
    calls = [c for c in ast.walk(ast.parse(inspect.getsource(prime.main))) if isinstance(c, ast.Call)]
    takers = {
        c.func.id for c in calls if isinstance(c.func, ast.Name) and any(k.arg == "is_weights" for k in c.keywords)
    }
    assert takers == {"policy_loss"}
