"""ScaleRL against hand-derived values: prompt-level averaging, batch-level advantages, zero-variance filtering, the
no-positive-resampling pool (with the data cursor and across a resume) and the sampler's lag."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, load_algo, resolved_correction
from loss_checks import assert_micro_batches_accumulate, assert_padding_changes_nothing, on_two_fake_ranks
from transformers import AutoTokenizer

from common.bookkeeping import Bookkeeper
from common.data import TINY_MODEL_DIR
from common.tracking import load_checkpoint


@pytest.fixture(scope="module")
def scalerl():
    return load_algo("scalerl")


def test_defaults(scalerl):
    args = scalerl.Args()
    assert (args.max_lag, args.retire_pass_rate, args.eps_max, args.kl_coef) == (8, 0.9, 5.0, 0.0)
    assert args.num_minibatches == 1  # the lag, not mini-batches, makes ρ ≠ 1


def test_zero_variance_groups_are_counted(scalerl):
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5])
    flat = scalerl.zero_variance_groups(rewards, 4)
    assert flat.tolist() == [True] * 4 + [False] * 4 + [True] * 8
    assert flat.sum().item() / 4 == 3  # three of the four groups leave the loss


def test_batch_level_advantages_hand_values(scalerl):
    # centred: [.75, -.25, -.25, -.25], [.5, .5, -.5, -.5]; the flat group is left out of the std:
    # Σ Â² = .75 + 1 = 1.75 over 8 kept rows, sample variance 1.75 / 7 = 0.25, std 0.5
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1])
    adv = scalerl.compute_advantages(rewards, group_size=4)
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, 1.0, 1.0, -1.0, -1.0, 0, 0, 0, 0])
    assert torch.allclose(adv, expected, atol=1e-5)
    assert torch.equal(adv[8:], torch.zeros(4))  # exactly zero on the filtered group
    # per-group normalisation (grpo.py) would scale the second group by its own std 0.577 instead: 0.866
    grpo_adv = load_algo("grpo").compute_advantages(rewards, group_size=4)
    assert grpo_adv[4].item() == pytest.approx(0.866, abs=1e-3)
    with pytest.raises(ValueError, match="group_size"):
        scalerl.compute_advantages(rewards, group_size=1)


def test_batch_std_is_over_all_processes(scalerl):
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1])
    whole = scalerl.compute_advantages(rewards, 4)
    split = on_two_fake_ranks(
        lambda r, _mask, all_reduce: scalerl.compute_advantages(r, 4, all_reduce=all_reduce), rewards, rewards
    )
    assert torch.allclose(whole, split, atol=1e-6)
    alone = scalerl.compute_advantages(rewards[:8], 4)  # one process's own std differs
    assert not torch.allclose(whole[:8], alone, atol=1e-3)


def _on_policy_loss(scalerl, per_token_adv, mask, group_size, **kw):
    """On-policy with log π = -1: ρ = 1 and the per-token loss -1·Â·(-1) is Â itself."""
    lp = torch.full(mask.shape, -1.0, requires_grad=True)
    return scalerl.policy_loss(lp, lp.detach(), per_token_adv, mask, group_size, **kw), lp


def test_prompt_level_averaging_hand_values(scalerl):
    # prompt 1: rows of 1 and 3 tokens with losses a and b (4 tokens); prompt 2: rows of 1 token each, c and d (2)
    a, b, c, d = 0.8, -0.2, 0.5, -1.0
    adv = torch.tensor([[a, 0, 0], [b, b, b], [c, 0, 0], [d, 0, 0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 0, 0]])
    (loss, _), lp = _on_policy_loss(scalerl, adv, mask, 2)
    assert loss.item() == pytest.approx(((a + 3 * b) / 4 + (c + d) / 2) / 2)  # -0.1
    assert loss.item() != pytest.approx((a + 3 * b + c + d) / 6)  # not the token mean (-0.05)
    assert loss.item() != pytest.approx((a + b + c + d) / 4)  # not the sample mean (0.025)
    loss.backward()  # each token of prompt 1 weighs 1/(2·4), each of prompt 2 1/(2·2): d loss / d log π = -Â·weight
    assert torch.allclose(lp.grad, -adv * mask / torch.tensor([8.0, 8.0, 4.0, 4.0])[:, None])
    # a filtered prompt (its rows masked out) is not one of the prompts averaged over
    mask[2:] = 0
    (loss, _), _ = _on_policy_loss(scalerl, adv, mask, 2)
    assert loss.item() == pytest.approx((a + 3 * b) / 4)


def test_gradient_is_weighted_reinforce_over_group_tokens(scalerl):
    torch.manual_seed(0)
    lp0 = torch.randn(4, 5) - 1
    old = lp0 + torch.tensor([[0.0, 1, -2, 0.5, 0], [2, -1, 0, 0.2, 0], [0.1, 0.1, -0.1, 2.5, 0], [0, 0, 0, 0, 0]])
    adv = torch.tensor([1.0, -0.5, 2.0, 0.3])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    lp = lp0.clone().requires_grad_()
    _, metrics = scalerl.policy_loss(lp, old, adv, mask, 2, eps_max=2.0)
    metrics_loss, _ = scalerl.policy_loss(lp, old, adv, mask, 2, eps_max=2.0)
    metrics_loss.backward()
    weight = torch.exp(lp0 - old).clamp(max=2.0)
    group_tokens = torch.tensor([6.0, 6.0, 4.0, 4.0])[:, None]
    expected = -weight * adv[:, None] * mask / group_tokens / 2  # 2 prompts
    assert torch.allclose(lp.grad, expected, atol=1e-6)  # no gradient through the capped weight
    w = weight[mask.bool()]
    assert metrics["is_weight"] == pytest.approx(w.mean().item(), rel=1e-5)
    assert metrics["is_weight_std"] == pytest.approx(w.std(unbiased=False).item(), rel=1e-5)
    assert metrics["clip_frac"] == pytest.approx((torch.exp(lp0 - old)[mask.bool()] > 2).float().mean().item())


def test_micro_batches_that_split_a_group_accumulate_to_the_minibatch_gradient(scalerl):
    g = torch.Generator().manual_seed(1)
    lp0, adv = torch.randn(6, 7, generator=g), torch.randn(6, generator=g)
    old = lp0 + 0.3 * torch.randn(6, 7, generator=g)
    mask = (torch.rand(6, 7, generator=g) > 0.4).long()
    mask[:, 0] = 1
    group_tokens = mask.sum(-1).view(-1, 3).sum(-1).repeat_interleave(3).float()
    assert_micro_batches_accumulate(
        lambda lp: scalerl.policy_loss(lp, old, adv, mask, 3)[0],
        lambda lp, rows: scalerl.policy_loss(
            lp[rows], old[rows], adv[rows], mask[rows], 3, group_tokens=group_tokens[rows], num_prompts=2.0
        )[0],
        lp0,
        (slice(0, 2), slice(2, 5), slice(5, 6)),  # both groups cut across micro-batches
    )
    with pytest.raises(ValueError, match="num_prompts"):
        scalerl.policy_loss(lp0, old, adv, mask, 3, group_tokens=group_tokens)


def test_padding_changes_nothing(scalerl):
    torch.manual_seed(0)
    lp0 = torch.randn(4, 5)
    old, adv = lp0 + 0.5 * torch.randn(4, 5), torch.randn(4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    assert_padding_changes_nothing(lambda lp, o, a, m, shift: scalerl.policy_loss(lp, o, a, m, 2), lp0, old, adv, mask)


def test_pool_retires_at_pass_rate_0_9_over_all_samples_so_far(scalerl):
    pool = scalerl.PromptPool(0.9)
    pool.record([3, 4, 5], [8, 7, 0], samples=8)  # 1.0, 0.875, 0.0
    assert pool.retired == {3}
    pool.record([4], [8], samples=8)  # 15 / 16 = 0.9375 over both visits
    assert pool.retired == {3, 4}
    restored = scalerl.PromptPool(0.9)
    restored.load_state_dict(pool.state_dict())
    assert restored.retired == {3, 4} and restored.counts == pool.counts


def _books(problems, cursor=0):
    """A Bookkeeper with only what next_prompts reads: one process, 4 prompts per step, the tiny tokenizer."""
    books = object.__new__(Bookkeeper)
    books.run = SimpleNamespace(rank=0, local_prompts=4, max_prompt_tokens=512)
    books.args = SimpleNamespace(prompts_per_step=4, seed=7)
    books.task = SimpleNamespace(train_problems=problems, template="plain")
    books.tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    books.cursor = cursor
    return books


def test_a_retired_prompt_never_returns_and_the_pool_resumes_with_the_cursor(scalerl):
    problems = [{"prompt": f"{i}+0=?", "answer": str(i)} for i in range(10)]
    books, pool = _books(problems), scalerl.PromptPool(0.9)
    books.next_prompts(exclude=pool.retired)
    first = list(books.prompt_indices)
    assert books.cursor == 4 and sorted(books.prompt_indices) == sorted(first)
    pool.record(first[:2], [8, 8], samples=8)  # two prompts solved: retired for good
    seen, saved = [], None
    for step in range(12):  # several epochs of the 10-prompt stream
        if step == 5:
            saved = (books.cursor, pool.state_dict())
        books.next_prompts(exclude=pool.retired)
        assert len(books.prompt_indices) == 4 and not set(books.prompt_indices) & set(first[:2])
        seen.append(list(books.prompt_indices))
    assert books.cursor > 4 + 12 * 4  # the cursor also counts the positions passed over
    assert {i for s in seen for i in s} == set(range(10)) - set(first[:2])
    # resume at step 5: the restored cursor and pool give the same prompts as the uninterrupted stream
    resumed, pool2 = _books(problems, cursor=saved[0]), scalerl.PromptPool(0.9)
    pool2.load_state_dict(saved[1])
    for step in range(5, 12):
        resumed.next_prompts(exclude=pool2.retired)
        assert resumed.prompt_indices == seen[step]
    with pytest.raises(SystemExit, match="excluded"):
        books.next_prompts(exclude=set(range(10)))


def test_lag_and_pool_survive_a_resume(tmp_path):
    small = (
        "--prompts-per-step 4 --group-size 4 --max-new-tokens 24 --micro-batch-size 8 --eval.max-problems 8 "
        "--eval.n 2 --eval.k 1 2 --eval-every 10 --save-every 1 --max-lag 2 --retire-pass-rate 0.5"
    ).split()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}

    def run(name, steps, *flags):
        cmd = [sys.executable, str(REPO / "algos" / "scalerl.py"), "--output-dir", str(tmp_path), *small]
        result = subprocess.run(
            [*cmd, "--run-name", name, "--total-steps", str(steps), *flags], capture_output=True, text=True, env=env
        )
        assert result.returncode == 0, result.stderr[-3000:]
        rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, rows) if "train/lag" in r]

    full = run("full", 4)
    run("split", 2)
    split = run("split", 4, "--resume")
    # batch s is sampled by version max(0, s - 1): lag min(s, 1), the batch sampled ahead taken from the checkpoint
    assert [r["train/lag"] for r in full] == [0, 1, 1, 1] == [r["train/lag"] for r in split]
    for key in ("train/reward", "train/retired_prompts", "train/is_weight"):
        assert [r[key] for r in split] == pytest.approx([r[key] for r in full], abs=1e-6), key
    saved = load_checkpoint(tmp_path / "split" / "checkpoints" / "step_000004")
    assert [(b["step"], b["version"]) for b in saved["rollouts"]["batches"]] == [(4, 3)]
    assert set(saved["pool"]) == {"counts", "retired"}


# ---------------------------------------------------------------- rollout correction
def test_no_correction_on_top_of_an_is_weight_taken_against_the_sampler(scalerl, monkeypatch):
    """ScaleRL's ρ = π_train/π_gen takes π_gen from the engine's reported log-probs (policy_loss gets rollout_logprobs
    as old_logprobs): with a perturbed sampler 'auto' resolves to none, and an explicit mode stops."""
    assert resolved_correction(scalerl, monkeypatch, "--rollout.logit-noise", "1.0").mode == "none"
    assert resolved_correction(scalerl, monkeypatch, "--correction.mode", "none").mode == "none"
    for mode in ("token_truncate", "geometric_mask"):
        with pytest.raises(SystemExit, match=f"--correction.mode {mode}: not for this script, its capped IS weight"):
            resolved_correction(scalerl, monkeypatch, "--correction.mode", mode)
