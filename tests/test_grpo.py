"""GRPO math against hand-derived values and properties (reference checklist items 1, 4-6, 8, 9)."""

import math

import pytest
import torch
from loss_checks import assert_micro_batches_accumulate, assert_padding_changes_nothing, random_batch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.data import TINY_MODEL_DIR, format_prompt
from common.rollout import HFEngine, left_pad


def test_advantages_hand_values(grpo):
    # sample std of [1,0,0,0] is 0.5 -> [1.5, -0.5, -0.5, -0.5]; population std would give 1.732
    adv = grpo.compute_advantages(torch.tensor([1.0, 0, 0, 0, 2.0, 2.0, 2.0, 2.0]), group_size=4)
    assert torch.allclose(adv[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4))  # all-equal group: exactly zero


def test_advantages_groups_are_independent_and_sum_to_zero(grpo):
    rewards = torch.tensor([0.3, 0.9, 0.1, 5.0, 7.0, 6.0])
    adv = grpo.compute_advantages(rewards, group_size=3)
    assert torch.allclose(adv.view(2, 3).sum(1), torch.zeros(2), atol=1e-5)
    assert torch.allclose(adv[3:], grpo.compute_advantages(rewards[3:], 3))
    with pytest.raises(ValueError, match="group_size"):
        grpo.compute_advantages(rewards, group_size=1)
    with pytest.raises(ValueError, match="groups of 4"):
        grpo.compute_advantages(rewards, group_size=4)


def _on_policy(values):
    lp = torch.tensor(values, requires_grad=True)
    return lp, lp.detach().clone()


def test_aggregation_is_per_sequence_token_mean(grpo):
    # per-token losses [a] and [b, b, b]: on-policy the per-token loss is -A, so A = -loss
    a, b = 0.7, -0.4
    lp, old = _on_policy([[-1.0, 0, 0, 0], [-1.0, -1.0, -1.0, 0]])
    adv = torch.tensor([[-a, 0, 0, 0], [-b, -b, -b, 0]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    loss, _ = grpo.policy_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx((a + b) / 2)  # not the token mean (a+3b)/4


def test_padding_changes_nothing(grpo):
    torch.manual_seed(0)
    lp0 = torch.randn(3, 5)
    old, adv = lp0 + 0.1 * torch.randn(3, 5), torch.randn(3)
    ref = old - 0.05  # the KL term's reference log-probs are rewritten at the padded positions too
    loss = lambda lp, o, a, m, shift: grpo.policy_loss(lp, o, a, m, kl_coef=0.1, ref_logprobs=ref + shift)
    assert_padding_changes_nothing(
        loss, lp0, old, adv, torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    )


@pytest.mark.parametrize(
    "adv, ratio, has_grad",
    [(1.0, 1.3, False), (1.0, 1.1, True), (1.0, 0.7, True), (-1.0, 0.7, False), (-1.0, 0.9, True), (-1.0, 1.3, True)],
)
def test_clipping_zeroes_gradient_only_where_ppo_says(grpo, adv, ratio, has_grad):
    old = torch.tensor([[-1.0]])
    lp = (old + math.log(ratio)).requires_grad_()
    loss, metrics = grpo.policy_loss(lp, old, torch.tensor([adv]), torch.ones(1, 1), clip_eps=0.2)
    loss.backward()
    assert (lp.grad.abs().item() > 0) == has_grad
    assert metrics["clip_frac"] == (0.0 if has_grad else 1.0)
    if has_grad:  # d/dlogp of -A·r is -A·r
        assert lp.grad.item() == pytest.approx(-adv * ratio, rel=1e-5)


def test_on_policy_gradient_is_reinforce(grpo):
    lp, old = _on_policy([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, _ = grpo.policy_loss(lp, old, adv, mask)
    loss.backward()
    expected = torch.tensor([[-2.0 / 2, -2.0 / 2, 0.0], [1.0 / 3, 1.0 / 3, 1.0 / 3]]) / 2  # -A / |o_i| / B
    assert torch.allclose(lp.grad, expected)


def test_k3_kl_value_and_gradient(grpo):
    lp, old = _on_policy([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    beta = 0.5
    loss, metrics = grpo.policy_loss(lp, old, torch.zeros(1), torch.ones(1, 2), kl_coef=beta, ref_logprobs=ref)
    loss.backward()
    delta = ref - old
    k3 = torch.exp(delta) - delta - 1
    assert k3[0, 1] == 0 and k3[0, 0] > 0
    assert metrics["kl"] == pytest.approx(k3.mean().item())
    assert loss.item() == pytest.approx(beta * k3.mean().item())
    # d(β·k3)/dlogp = β(1 - π_ref/π_θ), then the per-sequence mean over 2 tokens
    assert torch.allclose(lp.grad, beta * (1 - torch.exp(ref - old)) / 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo.policy_loss(lp, old, torch.zeros(1), torch.ones(1, 2), kl_coef=beta)


def test_micro_batches_accumulate_to_the_minibatch_gradient(grpo):
    lp0, old, adv, mask = random_batch()
    assert_micro_batches_accumulate(
        lambda lp: grpo.policy_loss(lp, old, adv, mask)[0],
        lambda lp, rows: grpo.policy_loss(lp[rows], old[rows], adv[rows], mask[rows], num_sequences=4)[0],
        lp0,
        (slice(0, 1), slice(1, 4)),
    )


@pytest.fixture(scope="module")
def tiny():
    return AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval(), AutoTokenizer.from_pretrained(TINY_MODEL_DIR)


def test_token_logprobs_ignore_left_padding(grpo, tiny):
    model, tok = tiny
    short = tok(format_prompt("1+2=?", "chat", tok))["input_ids"] + tok("1+2=3;")["input_ids"]
    long = tok(format_prompt("9-8+7-6=?", "chat", tok))["input_ids"] + tok("9-8=1;")["input_ids"]
    ids, am = left_pad([short, long], tok.pad_token_id, "cpu")
    with torch.no_grad():
        batched, _ = grpo.token_logprobs(model, ids, am, 4, 0.7)
        alone, _ = grpo.token_logprobs(
            model, torch.tensor([short]), torch.ones(1, len(short), dtype=torch.long), 4, 0.7
        )
        manual = torch.log_softmax(model(torch.tensor([short])).logits[0, -5:-1].float() / 0.7, -1)
    assert torch.allclose(batched[0], alone[0], atol=1e-5)
    assert torch.allclose(alone[0], manual.gather(-1, torch.tensor(short[-4:])[:, None]).squeeze(-1), atol=1e-5)


def test_sampler_logprobs_match_trainer_recomputation(grpo, tiny):
    model, tok = tiny
    prompts = [tok(format_prompt(p, "chat", tok))["input_ids"] for p in ("3+4-1=?", "8-9+2=?")]
    completions = HFEngine(model, tok).generate(prompts, n=3, max_new_tokens=12, temperature=0.8, top_p=1.0, seed=0)
    assert len(completions) == 6
    for i, c in enumerate(completions):
        ids = prompts[i // 3] + c.token_ids
        with torch.no_grad():
            lp, _ = grpo.token_logprobs(
                model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), len(c.token_ids), 0.8
            )
        assert torch.allclose(lp[0], torch.tensor(c.logprobs), atol=1e-4)
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == tok.eos_token_id)
