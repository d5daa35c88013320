"""Bookkeeping every script shares around its RL step: tensors from completions, step metrics, the run folder,
resume, evaluation and checkpoint cadence, stop signals, and the final save.

    books = Bookkeeper(run, args, tokenizer, task, engine, state={"model": raw_model, "optimizer": optimizer, ...})
    for step in books.steps():                          # resumes, evaluates first, shows progress
        problems, prompt_ids = books.next_prompts()     # this process's share of the step's prompts
        ...the algorithm: sample, reward, advantages, log-probs, loss, update...
        books.log_step(step + 1, ...)                   # averaged over processes, written to metrics.jsonl (+ wandb)
        books.end_step(step + 1)                        # evaluate / checkpoint on cadence; stop after SIGTERM
    books.finish(raw_model)                             # final model, summary line

Nothing algorithmic lives here: the scripts compute every loss, advantage and algorithm-specific metric.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import resource
import signal
import sys
import time
from collections.abc import Collection

import torch
from tqdm.auto import tqdm

from common.data import prompt_batch
from common.evaluate import EVAL_SEED, describe_protocol, evaluate
from common.lora import is_lora, save_adapter
from common.rollout import Completion, left_pad
from common.runtime import Run, Task, encode_prompts
from common.sharding import gather_state, restore_state, save_pretrained_full
from common.tracking import (
    Tracker,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from common.verifiers import drain_reward_stats


def pack_rollout(
    prompt_ids: list[list[int]], completions: list[Completion], group_size: int, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``[left-padded prompt | right-padded completion]`` for a batch of groups, on ``device``.

    ``completions`` holds ``group_size`` rows per prompt, contiguous. Returns ``input_ids`` and ``attention_mask``
    (B, P + W), and ``completion_mask`` (1 on generated tokens, EOS included) and the sampler's ``rollout_logprobs``
    (B, W), where W, the completion width, is the longest completion.

    A tool loop's completion (``Completion.observation_mask``, common/tool_loop.py) also holds the observation tokens
    it appended: the attention mask covers them (the model sees them, positions stay those of the sampled sequence),
    while ``completion_mask``, the loss mask of every script, is 0 there, and so is their ``rollout_logprobs``: only
    the model's own tokens count in the losses, KL, entropy, correction weights, lengths and metrics. A completion
    the void filter dropped (``Completion.excluded``, ``--tools.void-filter``) is attended to but has no loss token.
    """
    batch_size = len(completions)
    completion_width = max(len(c.token_ids) for c in completions)
    prompts = [ids for ids in prompt_ids for _ in range(group_size)]
    prompt_tensor, prompt_mask = left_pad(prompts, pad_id, "cpu")
    completion_tensor = torch.full((batch_size, completion_width), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((batch_size, completion_width))
    rollout_logprobs = torch.zeros((batch_size, completion_width))
    token_mask = torch.zeros((batch_size, completion_width))  # every completion token, observations included
    for i, c in enumerate(completions):
        completion_tensor[i, : len(c.token_ids)] = torch.tensor(c.token_ids)
        token_mask[i, : len(c.token_ids)] = 1
        sampled = 1 - torch.tensor(c.observation_mask, dtype=torch.float) if c.observation_mask is not None else 1
        sampled = 0 * sampled if c.excluded else sampled  # SimpleTIR's void filter: none of its tokens train
        completion_mask[i, : len(c.token_ids)] = sampled
        rollout_logprobs[i, : len(c.token_ids)] = torch.tensor(c.logprobs) * sampled
    input_ids = torch.cat([prompt_tensor, completion_tensor], dim=1).to(device)
    attention_mask = torch.cat([prompt_mask, token_mask.long()], dim=1).to(device)
    return input_ids, attention_mask, completion_mask.to(device), rollout_logprobs.to(device)


def rollout_stats(
    rewards: torch.Tensor,
    correct: torch.Tensor,
    completion_mask: torch.Tensor,
    completions: list[Completion],
    group_size: int,
) -> dict[str, float]:
    """The sampled batch's ``train/`` statistics: mean reward, accuracy, length (also of the correct and of the
    incorrect completions apart, 0 when there are none: Dr. GRPO's length bias shows in the wrong ones), truncation,
    zero-advantage groups."""
    grouped_rewards = rewards.view(-1, group_size)
    # sampled tokens per completion (a tool loop's observations not counted), excluded samples included
    lengths = torch.tensor([len(c.token_ids) - sum(c.observation_mask or ()) for c in completions], dtype=torch.float)
    right = correct.float().cpu()
    return {
        "train/reward": rewards.mean().item(),
        "train/accuracy": correct.mean().item(),
        "train/response_len": lengths.mean().item(),
        "train/response_len_correct": ((lengths * right).sum() / right.sum().clamp(min=1)).item(),
        "train/response_len_incorrect": ((lengths * (1 - right)).sum() / (1 - right).sum().clamp(min=1)).item(),
        "train/truncation_rate": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "train/frac_zero_adv_groups": (grouped_rewards.max(1).values == grouped_rewards.min(1).values)
        .float()
        .mean()
        .item(),
    }


def read_to_host(
    update_stats: dict[str, list], metrics: dict[str, object]
) -> tuple[dict[str, list[float]], dict[str, object]]:
    """``update_stats`` and ``metrics`` with every 0-dim tensor replaced by its float, all read in one device transfer.

    The update loop keeps its per-micro-batch statistics on the device, so that no micro-batch waits for the device
    to report a number; this is where they reach the host, once a step. Values go through float64, so a float32
    statistic reads exactly as its ``.item()`` would. Floats and other values pass through unchanged.
    """
    tensors = [v for values in update_stats.values() for v in values if isinstance(v, torch.Tensor)]
    tensors += [v for v in metrics.values() if isinstance(v, torch.Tensor)]
    if not tensors:
        return update_stats, metrics
    device = tensors[0].device
    read = iter(torch.stack([t.detach().reshape(()).to(device, torch.float64) for t in tensors]).tolist())
    stats = {
        k: [next(read) if isinstance(v, torch.Tensor) else v for v in values] for k, values in update_stats.items()
    }
    return stats, {k: next(read) if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}


class Bookkeeper:
    """Run folder, metrics, resume, evaluation and checkpoint cadence, stop signals and the final save of one run.

    ``state`` names every object the checkpoint saves and a resume restores (anything with ``state_dict`` and
    ``load_state_dict``: models unwrapped or FSDP-sharded, optimisers, schedulers; each optimiser steps the
    parameters of exactly one model of ``state``); ``state["model"]`` is the policy, which is pushed into ``engine``
    after a resume. Checkpoints also hold every process's RNG state, the data cursor and
    the step. Every process must make the same calls in the same order (evaluation is sharded over all of them;
    the main process writes checkpoints while the others wait).
    """

    def __init__(self, run: Run, args, tokenizer, task: Task, engine, state: dict) -> None:
        self.run, self.args, self.tokenizer, self.task, self.engine, self.state = (
            run,
            args,
            tokenizer,
            task,
            engine,
            state,
        )
        self.tracker = Tracker(run.run_dir, args, args.track, args.wandb_project, enabled=run.is_main)
        self.start_step, self.cursor, self.train_time = 0, 0, 0.0  # train_time: seconds in steps, evaluation excluded
        self.first_eval: dict[str, float] = {}
        self.last_eval: dict[str, float] = {}
        self.bad_updates = 0  # consecutive optimiser steps skipped for a non-finite loss or gradient
        self.stop_signal: list[int] = []  # SIGTERM / SIGINT: finish the current step, checkpoint, exit
        self.progress = None
        self.step = 0  # the step in progress (0-based)
        self.step_start: tuple[int, object] = (0, None)  # the data cursor and RNG state when that step began
        self.step_done = False  # the step in progress is updated, pushed and logged (only its evaluation remains)
        self.prompt_indices: list[int] = []  # training-set indices of this process's prompts from next_prompts
        run.accelerator.print(describe_protocol(task.eval_cfg, task.eval_name, task.eval_template, EVAL_SEED))

    def register(self, name: str, obj) -> None:
        """Checkpoint ``obj`` (``state_dict``/``load_state_dict``) with the run as ``name``; one whose
        ``resume_cursor`` is set after a restore rewinds the data cursor to it."""
        self.state[name] = obj

    def steps(self):
        """Resume from the latest checkpoint (with ``--resume``), evaluate the starting policy, then yield steps."""
        run, args = self.run, self.args
        if args.resume and (ckpt := latest_checkpoint(run.run_dir)) is not None:
            saved = load_checkpoint(ckpt)
            self.start_step, self.cursor, self.train_time = saved["step"], saved["cursor"], saved["train_time"]
            restore_state(self.state, saved)  # full state dicts: each process keeps its shards (or replica)
            for obj in self.state.values():  # LaggedRollouts: batches whose sampling failed give their prompts back
                if getattr(obj, "resume_cursor", None) is not None:
                    self.cursor = obj.resume_cursor
            if not isinstance(saved["rng"], list):
                set_rng_state(saved["rng"])
            elif len(saved["rng"]) == run.world:
                set_rng_state(saved["rng"][run.rank])
            else:  # the sampling noise is per prompt: the same samples on any number of processes
                run.accelerator.print(
                    f"resuming on {run.world} process(es) a run checkpointed on {len(saved['rng'])}: each process's "
                    "RNG restarts from the seed (rollouts draw per-prompt seeds and do not depend on it)"
                )
            self.engine.update_weights(self.state["model"])
            self.tracker.truncate_after(self.start_step)
            run.accelerator.print(f"resumed from {ckpt} at step {self.start_step}")
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal exits at once
            signal.signal(
                sig,
                lambda signum, frame: (
                    self.stop_signal.append(signum) if not self.stop_signal else sys.exit(128 + signum)
                ),
            )
        if self.start_step == 0:
            self.first_eval = self.last_eval = self.evaluate(0)
        else:  # resumed: the run's step-0 and latest evaluations as logged (main process; the others get {})
            self.first_eval = self.tracker.logged(0, "eval/")
            self.last_eval = self.tracker.logged(self.start_step, "eval/")
        self.progress = tqdm(
            range(self.start_step, args.total_steps),
            initial=self.start_step,
            total=args.total_steps,
            desc=args.exp_name,
            disable=not run.is_main,
        )
        self.engine.on_fault = self.checkpoint_on_fault  # a rollout server that fails mid-run: checkpoint, then exit
        for step in self.progress:
            self.step = step
            self.step_start = (self.cursor, rng_state())  # what a fault before this step's update gives back
            self.step_done = False  # set once the step is logged
            yield step

    def checkpoint_on_fault(self, after_update: bool) -> None:
        """Checkpoint the last completed step after a rollout-server failure, so that ``--resume`` continues exactly.

        A failed rollout before this step's update gives the step's prompts and RNG draws back and saves the previous
        step (nothing, in the first step). A failure after the update (the weight push) saves the updated state as
        this step, whose metrics row is then missing from metrics.jsonl; one after the step was logged (its
        evaluation) saves this step as it was logged."""
        if after_update or self.step_done:
            self.checkpoint(self.step + 1)
            return
        if self.step == 0:
            return
        self.cursor = self.step_start[0]
        set_rng_state(self.step_start[1])
        self.checkpoint(self.step)

    def next_prompts(self, exclude: Collection[int] = ()) -> tuple[list[dict], list[list[int]]]:
        """The next ``--prompts-per-step`` prompts of the seeded stream: this process's contiguous share (whole
        groups stay on one rank), as problems and encoded prompts. Advances the data cursor.

        ``exclude``: training-set indices the stream passes over (a script's retired prompts; the same on every
        process). The cursor counts the positions passed over too, so a resume that restores the cursor and the
        same ``exclude`` continues with the same prompts."""
        run, args, num_items = self.run, self.args, len(self.task.train_problems)
        if len(exclude) >= num_items:
            raise SystemExit(
                f"every one of the {num_items} training prompts is excluded (retired): nothing to train on"
            )
        indices = []
        while len(indices) < args.prompts_per_step:
            wanted = args.prompts_per_step - len(indices)
            indices += [i for i in prompt_batch(num_items, self.cursor, wanted, args.seed) if i not in exclude]
            self.cursor += wanted
        self.prompt_indices = indices[run.rank * run.local_prompts : (run.rank + 1) * run.local_prompts]
        return self.prompts_at(self.prompt_indices)

    def prompts_at(self, indices: list[int]) -> tuple[list[dict], list[list[int]]]:
        """The problems and encoded prompts at these training-set indices."""
        problems = [self.task.train_problems[i] for i in indices]
        return problems, encode_prompts(self.tokenizer, problems, self.task.template, self.run.max_prompt_tokens)

    def update_is_finite(
        self, grad_norm: torch.Tensor | float, loss: torch.Tensor | float, update_stats: dict[str, list]
    ) -> bool:
        """Whether an optimiser step may use this gradient: a non-finite loss or gradient never reaches the weights.

        A skipped update is counted in ``update_stats["skipped_updates"]``; ``--max-bad-steps`` consecutive skips
        abort the run with a message. The one device sync of a mini-batch: its summed loss and its gradient norm.
        """
        if math.isfinite(float(grad_norm)) and math.isfinite(float(loss)):
            self.bad_updates = 0
            return True
        self.bad_updates += 1
        update_stats.setdefault("skipped_updates", []).append(1.0)
        if self.bad_updates >= self.args.max_bad_steps:
            raise SystemExit(
                f"step {self.step}: {self.bad_updates} consecutive updates with a non-finite loss or gradient; aborting"
            )
        return False

    def log_step(
        self,
        step: int,
        update_stats: dict[str, list[float]],
        metrics: dict[str, float],
        t_step: float,
        samples: list[dict],
    ) -> None:
        """Write one step's metrics: ``update_stats`` (lists over micro/mini-batches) averaged as ``train/<key>``,
        ``metrics`` as given, each averaged over the processes that logged it, plus step time, elapsed time and peak
        memory. Values may be floats or 0-dim tensors (``read_to_host``)."""
        run = self.run
        self.step_done = True
        update_stats, metrics = read_to_host(update_stats, metrics)
        log = {f"train/{k}": sum(v) / len(v) for k, v in update_stats.items() if k != "skipped_updates"}
        log |= metrics
        log |= {f"train/{k}": v for k, v in drain_reward_stats().items()}  # e.g. code/tests_passed_frac
        log["train/skipped_updates"] = float(sum(update_stats.get("skipped_updates", [])))
        # averaged over processes by name: a process may lack a key (LUFFY's teacher statistics when none of its
        # micro-batches held a teacher trace), so each key is the mean over the processes that logged it
        keys = list(log)
        if run.world > 1:
            every_rank = run.accelerator.gather_for_metrics([keys], use_gather_object=True)
            keys = list(dict.fromkeys(k for rank_keys in every_rank for k in rank_keys))
        sums = torch.tensor([[log.get(k, 0.0), float(k in log)] for k in keys], device=run.device)
        sums = run.accelerator.reduce(sums, "sum")
        log = {k: float(total / count) for k, (total, count) in zip(keys, sums.tolist())}
        log["time/step_s"] = time.time() - t_step
        self.train_time += log["time/step_s"]
        log["time/elapsed_s"] = self.train_time
        log["memory/peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        if run.device.type == "cuda":  # what the memory planner predicts: the most this process's tensors held
            log["memory/peak_gpu_gb"] = torch.cuda.max_memory_allocated(run.device) / 1e9
        self.tracker.log(log, step)
        self.tracker.log_samples(samples, step)
        self.progress.set_postfix(
            reward=f"{log['train/reward']:.3f}",
            acc=f"{log['train/accuracy']:.3f}",
            len=f"{log['train/response_len']:.1f}",
        )

    def end_step(self, step: int) -> None:
        """Evaluate and checkpoint on their cadence (and after the last step); exit cleanly after a stop signal."""
        args = self.args
        # 0 = never on a cadence: only before the first step and after the last
        if (args.eval_every and step % args.eval_every == 0) or step == args.total_steps:
            self.last_eval = self.evaluate(step)
            if self.run.is_main:
                scores = (f"{k.split('/')[-1]} {v:.3f}" for k, v in self.last_eval.items() if not k.startswith("time"))
                self.progress.write(f"step {step}: " + "  ".join(scores))
        if (args.save_every and step % args.save_every == 0) or step == args.total_steps or self.stop_signal:
            self.checkpoint(step)
        if self.stop_signal:
            self.tracker.close()
            raise SystemExit(
                f"stopped by signal {self.stop_signal[0]} after step {step}; checkpoint saved, continue with --resume"
            )

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out evaluation, sharded over the processes and gathered (logged at ``step`` by the main process)."""
        run, task = self.run, self.task
        t0 = time.time()
        metrics = evaluate(
            self.engine,
            self.tokenizer,
            task.eval_problems,
            task.eval_info.reward_fn,
            task.eval_template,
            task.eval_cfg,
            seed=EVAL_SEED,
            name=task.eval_name,
            stop=task.eval_stop,
            max_prompt_tokens=run.max_prompt_tokens,
            rank=run.rank,
            world=run.world,
            gather=(lambda results: run.accelerator.gather_for_metrics(results, use_gather_object=True))
            if run.world > 1
            else None,
            tools=getattr(self.args, "tools", None),
            context_len=run.max_model_len,
        )
        metrics["time/eval_s"] = time.time() - t0
        if run.is_main:
            self.tracker.log(metrics, step)
        return metrics

    def checkpoint(self, step: int) -> None:
        """Save ``state``, every process's RNG state, the data cursor and the step (atomically, main process).

        Models and optimisers are saved as full state dicts keyed by parameter name, gathered from every process
        (``common/sharding.py``): one format for one process, DDP and FSDP, which a resume on any number of
        processes, sharded or not, loads. Frozen parameters (a LoRA policy's base) are not saved."""
        run = self.run
        states = [rng_state()]
        if run.world > 1:
            states = run.accelerator.gather_for_metrics(states, use_gather_object=True)
        saved = gather_state(self.state)  # a collective under --fsdp; complete on the main process
        if run.is_main:
            saved |= {"rng": states, "step": step, "cursor": self.cursor, "train_time": self.train_time}
            model = self.state["model"]  # a LoRA policy: its adapter also in PEFT's format, in the checkpoint
            adapter = (
                (lambda folder: save_adapter(model, saved["model"], folder / "adapter")) if is_lora(model) else None
            )
            save_checkpoint(run.run_dir, step, saved, keep_last=self.args.keep_checkpoints, also=adapter)
        run.accelerator.wait_for_everyone()

    def finish(self, raw_model: torch.nn.Module) -> None:
        """Save the final policy and tokenizer (Hugging Face format) and print the ``SUMMARY`` line; on several
        processes, end the process (``exit_distributed``)."""
        run, args = self.run, self.args
        save_pretrained_full(raw_model, run.run_dir / "final", run.is_main)  # gathered from every process
        if run.is_main:
            self.tokenizer.save_pretrained(run.run_dir / "final")
            key = f"eval/{self.task.eval_name}/mean@{self.task.eval_cfg.n}"
            summary = {
                "run": args.run_name,
                "steps": args.total_steps,
                "train_s": round(self.train_time, 1),
                "eval_start": self.first_eval.get(key),
                "eval_end": self.last_eval.get(key),
            }
            print("SUMMARY " + json.dumps(summary))
        self.tracker.close()
        if run.world > 1:
            exit_distributed(run)


def exit_distributed(run: Run) -> None:
    """End a multi-process run's process with exit code 0 once every process has finished writing.

    The process group is destroyed after a barrier, the ``atexit`` handlers run (worker pools, engines, wandb) while the
    interpreter is whole, then the process leaves without interpreter teardown: there, gloo's C++ threads can still
    abort a finished run ("terminate called without an active exception": twice in our clean-clone CI runs), and the
    launcher then reports the whole run as failed and kills the other processes."""
    run.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def sample_rows(
    problems: list[dict], texts: list[str], golds: list[str], rewards: torch.Tensor, group_size: int, count: int
) -> list[dict]:
    """The first completion of each of the first ``count`` groups, for ``samples.jsonl``."""
    return [
        {
            "prompt": problems[i // group_size]["prompt"],
            "completion": texts[i],
            "answer": golds[i],
            "reward": float(rewards[i]),
        }
        for i in range(0, min(len(texts), count * group_size), group_size)
    ]
