"""PPO (critic, GAE, clipped value loss) against hand-derived values and properties (reference §2(g), §9 10-11)."""

import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, load_algo
from loss_checks import on_two_fake_ranks
from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

from common.data import TINY_MODEL_DIR, format_prompt
from common.rollout import left_pad
from common.tracking import latest_checkpoint, load_checkpoint


@pytest.fixture(scope="module")
def ppo():
    return load_algo("ppo")


# ---------------------------------------------------------------- token rewards and GAE
def test_reward_sits_on_the_last_valid_token(ppo):
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    r = ppo.token_rewards(torch.tensor([2.0, -1.0, 0.5]), mask)
    expected = torch.tensor([[0, 0, 2.0, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0.5]])
    assert torch.equal(r, expected)


def test_k1_kl_enters_every_token_reward(ppo):
    mask = torch.tensor([[1, 1, 0]])
    old, ref = torch.tensor([[-1.0, -2.0, -9.0]]), torch.tensor([[-1.5, -1.0, -3.0]])
    r = ppo.token_rewards(torch.tensor([1.0]), mask, kl_coef=0.1, old_logprobs=old, ref_logprobs=ref)
    # token 1: -0.1*(−1 − (−1.5)) = −0.05; token 2: 1 − 0.1*(−2 − (−1)) = 1.1; padding: 0
    assert torch.allclose(r, torch.tensor([[-0.05, 1.1, 0.0]]))
    with pytest.raises(ValueError, match="kl_coef"):
        ppo.token_rewards(torch.tensor([1.0]), mask, kl_coef=0.1)


def test_gae_with_lambda_gamma_one_is_reward_minus_value(ppo):
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    R = torch.tensor([1.0, 0.0, 1.0])
    values = torch.tensor([[0.3, 0.6, 0.9, 4.0, 4.0], [0.2, -0.1, 0.4, 0.5, 0.7], [0.8, 3.0, 3.0, 3.0, 3.0]])
    adv, ret = ppo.compute_gae(ppo.token_rewards(R, mask), values, mask)  # defaults: γ = λ = 1
    m = mask.bool()
    assert torch.allclose(ret[m], R[:, None].expand_as(values)[m], atol=1e-6)  # R̂_t = R at every valid token
    assert torch.allclose(adv[m], (R[:, None] - values)[m], atol=1e-6)  # Â_t = R - V(s_t)
    assert torch.all(adv[~m] == 0) and torch.all(ret[~m] == 0)


def test_gae_hand_computed_three_tokens(ppo):
    # r = [0.1, -0.2, 1.0], V = [0.5, 0.6, 0.7], γ = 0.95, λ = 0.9 (γλ = 0.855)
    # δ3 = 1 - 0.7 = 0.3;  δ2 = -0.2 + 0.95·0.7 - 0.6 = -0.135;  δ1 = 0.1 + 0.95·0.6 - 0.5 = 0.17
    # Â3 = 0.3;  Â2 = -0.135 + 0.855·0.3 = 0.1215;  Â1 = 0.17 + 0.855·0.1215 = 0.2738825
    rewards = torch.tensor([[0.1, -0.2, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = ppo.compute_gae(rewards, values, mask, gamma=0.95, lam=0.9)
    assert torch.allclose(adv, torch.tensor([[0.2738825, 0.1215, 0.3, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.7738825, 0.7215, 1.0, 0.0]]), atol=1e-6)


def test_gae_with_lambda_one_returns_are_discounted_reward_sums(ppo):
    rewards = torch.tensor([[0.5, 0.0, 2.0]])
    adv, ret = ppo.compute_gae(rewards, torch.tensor([[9.0, -3.0, 1.0]]), torch.ones(1, 3), gamma=0.5, lam=1.0)
    # λ = 1: R̂_t = Σ_k γ^k r_{t+k}, whatever V is
    assert torch.allclose(ret, torch.tensor([[0.5 + 0.25 * 2.0, 1.0, 2.0]]))


def test_gae_no_leakage_across_padding(ppo):
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.1, 0.0, 0.0, -1.0]])
    values = torch.tensor([[0.2, 0.4, 0.0, 0.0], [0.3, 0.1, 0.6, 0.2]])
    a1, r1 = ppo.compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    garbage = (1 - mask) * 100.0  # rewards and values written into the padded positions
    a2, r2 = ppo.compute_gae(rewards + garbage, values - garbage, mask, gamma=0.9, lam=0.8)
    assert torch.equal(a1, a2) and torch.equal(r1, r2)
    # rows are independent: the first row alone gives the same numbers
    a3, _ = ppo.compute_gae(rewards[:1, :2], values[:1, :2], mask[:1, :2], gamma=0.9, lam=0.8)
    assert torch.allclose(a1[0, :2], a3[0])


# ---------------------------------------------------------------- whitening
def test_whitening_uses_masked_statistics(ppo):
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -50.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # valid entries 1..5: mean 3, population variance 2
    expected = (torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0]]) - 3.0) / math.sqrt(2.0) * mask
    assert torch.allclose(ppo.masked_whiten(x, mask), expected, atol=1e-6)


def test_whitening_statistics_span_processes(ppo):
    """Two fake ranks exchanging sums through all_reduce whiten exactly like one process holding both halves."""
    torch.manual_seed(0)
    x, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).long()
    whole = ppo.masked_whiten(x, mask)
    out = on_two_fake_ranks(ppo.masked_whiten, x, mask)
    assert torch.allclose(out, whole, atol=1e-6)
    assert not torch.allclose(out[:3], ppo.masked_whiten(x[:3], mask[:3]), atol=1e-3)  # local stats would differ


# ---------------------------------------------------------------- value loss
def test_value_loss_reference_example(ppo):
    # V_old = 0, c = 0.2, V = 0.5, R = 1: unclipped 0.25, clipped (0.2 - 1)² = 0.64 -> ½·0.64 = 0.32
    v = torch.tensor([[0.5]], requires_grad=True)
    loss, metrics = ppo.value_loss(v, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip=0.2)
    assert loss.item() == pytest.approx(0.32)
    assert metrics["value_clip_frac"] == 1.0
    loss.backward()
    assert v.grad.item() == 0.0  # the clipped branch is a constant in V


@pytest.mark.parametrize(
    "v, expected_loss, expected_grad",
    [
        (0.1, 0.5 * 0.81, 0.1 - 1.0),  # inside the clip range: both branches equal, grad V - R
        (-0.5, 0.5 * 2.25, -0.5 - 1.0),  # moved away from R: unclipped error is larger and keeps its gradient
        (-0.1, 0.5 * 1.21, -0.1 - 1.0),
    ],
)
def test_value_loss_is_the_pessimistic_max(ppo, v, expected_loss, expected_grad):
    val = torch.tensor([[v]], requires_grad=True)
    loss, _ = ppo.value_loss(val, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss)
    assert val.grad.item() == pytest.approx(expected_grad)


def test_value_loss_token_mean_and_padding(ppo):
    v0 = torch.tensor([[0.1, 0.2, 0.0], [0.3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ret = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    loss, _ = ppo.value_loss(v0, v0, ret, mask, clip=10.0)
    assert loss.item() == pytest.approx(0.5 * (0.81 + 0.04 + 0.09) / 3)  # Σ over 3 tokens / 3, not per-sequence
    garbage = (1 - mask) * 30.0
    loss2, _ = ppo.value_loss(v0 + garbage, v0, ret - garbage, mask, clip=10.0)
    assert loss2.item() == pytest.approx(loss.item())


# ---------------------------------------------------------------- policy loss
def test_policy_loss_is_a_token_mean(ppo):
    a, b = 0.7, -0.4  # per-token losses [a] and [b, b, b]; on-policy the per-token loss is -A
    lp = torch.tensor([[-1.0, 0, 0, 0], [-1.0, -1.0, -1.0, 0]], requires_grad=True)
    adv = torch.tensor([[-a, 0, 0, 0], [-b, -b, -b, 0]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    loss, _ = ppo.policy_loss(lp, lp.detach(), adv, mask)
    assert loss.item() == pytest.approx((a + 3 * b) / 4)  # not the per-sequence mean (a+b)/2


@pytest.mark.parametrize(
    "adv, ratio, has_grad", [(1.0, 1.3, False), (1.0, 1.1, True), (-1.0, 0.7, False), (-1.0, 1.3, True)]
)
def test_policy_clipping(ppo, adv, ratio, has_grad):
    old = torch.tensor([[-1.0]])
    lp = (old + math.log(ratio)).requires_grad_()
    loss, metrics = ppo.policy_loss(lp, old, torch.tensor([[adv]]), torch.ones(1, 1), clip_eps=0.2)
    loss.backward()
    assert (lp.grad.abs().item() > 0) == has_grad
    assert metrics["clip_frac"] == (0.0 if has_grad else 1.0)


def test_policy_loss_padding_changes_nothing(ppo):
    torch.manual_seed(2)
    lp0, adv = torch.randn(3, 5), torch.randn(3, 5)
    old = lp0 + 0.1 * torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    garbage = (1 - mask) * 50.0
    lp_a, lp_b = lp0.clone().requires_grad_(), (lp0 + garbage).requires_grad_()
    la, _ = ppo.policy_loss(lp_a, old, adv, mask)
    lb, _ = ppo.policy_loss(lp_b, old - garbage, adv + garbage, mask)
    la.backward()
    lb.backward()
    assert la.item() == pytest.approx(lb.item(), abs=1e-6)
    assert torch.allclose(lp_a.grad, lp_b.grad) and torch.all(lp_a.grad[mask == 0] == 0)


def test_micro_batches_accumulate_to_the_minibatch_gradient(ppo):
    torch.manual_seed(1)
    lp0, adv, v0 = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 6)
    old, v_old, ret = lp0 + 0.3 * torch.randn(4, 6), v0 + 0.3 * torch.randn(4, 6), torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).long()
    mask[:, 0] = 1
    whole_lp, whole_v = lp0.clone().requires_grad_(), v0.clone().requires_grad_()
    ppo.policy_loss(whole_lp, old, adv, mask)[0].backward()
    ppo.value_loss(whole_v, v_old, ret, mask)[0].backward()
    parts_lp, parts_v = lp0.clone().requires_grad_(), v0.clone().requires_grad_()
    n = float(mask.sum())
    for rows in (slice(0, 1), slice(1, 4)):  # uneven micro-batches with different token counts
        ppo.policy_loss(parts_lp[rows], old[rows], adv[rows], mask[rows], num_tokens=n)[0].backward()
        ppo.value_loss(parts_v[rows], v_old[rows], ret[rows], mask[rows], num_tokens=n)[0].backward()
    assert torch.allclose(whole_lp.grad, parts_lp.grad, atol=1e-7)
    assert torch.allclose(whole_v.grad, parts_v.grad, atol=1e-7)


# ---------------------------------------------------------------- critic alignment
def test_values_are_read_at_the_position_before_each_token(ppo):
    # a stub critic whose output at position p is p: the value of completion token t is read at P + t - 1
    stub = lambda input_ids, attention_mask, position_ids, use_cache, **varlen_kwargs: SimpleNamespace(
        logits=torch.arange(input_ids.shape[1], dtype=torch.float)[None, :, None].expand(input_ids.shape[0], -1, 1)
    )  # noqa: E731
    ids = torch.zeros(2, 7, dtype=torch.long)  # prompt width 4, completion width 3
    values = ppo.critic_values(stub, ids, torch.ones_like(ids), completion_width=3)
    assert torch.equal(values, torch.tensor([[3.0, 4.0, 5.0]] * 2))
    # packed: one flat row of 14 tokens, the second sequence from position 7 on
    packed = ppo.critic_values(stub, ids, torch.ones_like(ids), completion_width=3, packed=True)
    assert torch.equal(packed, torch.tensor([[3.0, 4.0, 5.0], [10.0, 11.0, 12.0]]))


def test_critic_values_ignore_left_padding(ppo):
    config = AutoConfig.from_pretrained(TINY_MODEL_DIR, num_labels=1)
    config.classifier_dropout = 0.0
    critic = AutoModelForTokenClassification.from_pretrained(TINY_MODEL_DIR, config=config).eval()
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    short = tok(format_prompt("1+2=?", "chat", tok))["input_ids"] + tok("1+2=3;")["input_ids"]
    long = tok(format_prompt("9-8+7-6=?", "chat", tok))["input_ids"] + tok("9-8=1;")["input_ids"]
    ids, am = left_pad([short, long], tok.pad_token_id, "cpu")
    with torch.no_grad():
        batched = ppo.critic_values(critic, ids, am, 4)
        alone = ppo.critic_values(critic, torch.tensor([short]), torch.ones(1, len(short), dtype=torch.long), 4)
        manual = critic(torch.tensor([short])).logits[0, -5:-1, 0]
    assert torch.allclose(batched[0], alone[0], atol=1e-5)
    assert torch.allclose(alone[0], manual, atol=1e-5)


def test_critic_minibatches_need_not_divide_the_batch(tmp_path):
    """Open-Reasoner-Zero splits 8192 rows into 12 critic mini-batches; uneven splits run (here 16 rows into 3 pieces
    of 6, 5, 5): three critic optimiser steps per rollout step, every row used once."""
    cmd = [sys.executable, str(REPO / "algos" / "ppo.py"), "--output-dir", str(tmp_path), "--run-name", "r"]
    cmd += "--total-steps 1 --prompts-per-step 4 --group-size 4 --max-new-tokens 16 --critic-num-minibatches 3".split()
    cmd += "--eval-every 100 --eval.max-problems 2 --eval.n 1 --eval.k 1 --eval.no-greedy".split()
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    saved = load_checkpoint(latest_checkpoint(tmp_path / "r"))
    steps = {int(s["step"]) for s in saved["critic_optimizer"]["state"].values()}
    assert steps == {3}


# ---------------------------------------------------------------- rollout correction (common/correction.py)
def test_correction_weights_of_one_change_nothing(ppo):
    torch.manual_seed(3)
    lp0, adv = torch.randn(3, 5), torch.randn(3, 5)
    old, mask = lp0 + 0.3 * torch.randn(3, 5), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    a, b = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
    la, ma = ppo.policy_loss(a, old, adv, mask)
    lb, mb = ppo.policy_loss(b, old, adv, mask, is_weights=torch.ones(3, 5))
    la.backward()
    lb.backward()
    assert la.item() == lb.item() and torch.equal(a.grad, b.grad) and ma == mb  # exactly, not approximately


def test_correction_weights_multiply_the_clipped_surrogate_hand_values(ppo):
    # one sequence, two tokens, A = 1, ratios 1.1 (inside [0.8, 1.2]) and 1.5 (clipped to 1.2), weights w = [2, 0.5]
    # ℓ_1 = -w_1·1.1 = -2.2, ∂ℓ_1/∂log π = -w_1·ρ_1 = -2.2;  ℓ_2 = -w_2·1.2 = -0.6, ∂ℓ_2/∂log π = 0 (clipped)
    # token mean over 2 tokens: L = (-2.2 - 0.6)/2 = -1.4, grad = [-1.1, 0]
    old = torch.tensor([[-1.0, -2.0]])
    lp = (old + torch.log(torch.tensor([[1.1, 1.5]]))).requires_grad_()
    loss, _ = ppo.policy_loss(lp, old, torch.ones(1, 2), torch.ones(1, 2), is_weights=torch.tensor([[2.0, 0.5]]))
    loss.backward()
    assert loss.item() == pytest.approx(-1.4, rel=1e-6)
    assert lp.grad.tolist()[0] == pytest.approx([-1.1, 0.0], abs=1e-6)


def test_only_the_actor_loss_takes_the_correction_weights(ppo):
    """The critic's value loss is a regression on returns, not a policy gradient: no weight reaches it."""
    import ast
    import inspect

    assert "is_weights" not in inspect.signature(ppo.value_loss).parameters
    calls = [c for c in ast.walk(ast.parse(inspect.getsource(ppo.main))) if isinstance(c, ast.Call)]
    takers = {
        c.func.id for c in calls if isinstance(c.func, ast.Name) and any(k.arg == "is_weights" for k in c.keywords)
    }
    assert takers == {"policy_loss"}
