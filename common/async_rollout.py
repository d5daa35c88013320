"""Asynchronous rollouts with a fixed lag: batch s is sampled by policy version max(0, s - k + 1), k = ``--max-lag``.

With ``--tools.format`` set, every request runs through the tool loop (``common/tool_loop.py``) on this process's
engine at the request's weight version (``sample_local``: ranks take different numbers of turns), its completions
carrying observation masks and ``ToolStats``, whose ``tools/*`` metrics ``take`` adds to ``stats``.

Versions count weight pushes: version v is the policy after v training steps (one push per step). The lag of a batch
is (the version its step updates) - (the version that sampled it) = min(s, k - 1), whatever the timing, so runs and
resumes are reproducible; k = 1 is the synchronous loop. This is PipelineRL's ``max_lag`` and AReaL's
``max_head_offpolicyness`` as a deterministic schedule rather than a bound (prime-rl ``max_off_policy_steps``,
verl's ``staleness_threshold``, TRL's ``AsyncGRPOTrainer`` ``max_staleness``).

    def sample(step):  # the script's: this step's prompts, their seeds, and the request for G samples each
        problems, prompt_ids = books.next_prompts()
        return problems, prompt_ids, rollouts.request(prompt_ids, G, max_new_tokens, temperature, top_p, seeds, stop)

    rollouts = LaggedRollouts(books, engine, sample, args.max_lag)   # checkpointed with the run
    for step in books.steps():
        problems, prompt_ids, completions = rollouts.take(step)      # asks for batches up to step + k - 1 first
        ...                                                          # score, advantages, update
        rollouts.update_weights(raw_model)                           # waits for generation in flight, then pushes
        step_log |= rollouts.stats                                   # train/lag, waits, overlap

Batches for the next steps are requested at the top of a step, from the weights just pushed, so they sample while
the trainer trains. With rollout servers (``--rollout.backend vllm-server``) that is real overlap: the requests run on
a background thread with no collective, and every rank agrees on failures when it collects (``take``). With the HF
and colocated vLLM engines, which share the trainer's device and weights, a request generates at once: the same
schedule (one meaning of lag), no overlap. The weight push waits for the generation in flight (weights never change
mid-generation), so at most one batch samples at a time and a checkpoint, taken after the push, holds the finished
batches sampled ahead, which older weights produced and a resume cannot regenerate; their prompts were drawn, so the
data cursor needs nothing more.

``--rollout.in-flight`` (server engine only; docs/gpu.md, "In-flight weight updates") keeps the schedule's requests
(admission: batch s is requested at the top of step s - k + 1, so every sample starts at most k - 1 versions before
its step) but not its wait: ``update_weights`` pauses the servers, pushes and resumes the same requests
(``VLLMServerEngine.update_weights_in_flight``), so up to k batches generate at once and each token carries the
version that sampled it (``Completion.token_versions``; ``train/token_lag_*``). A completion's ``version`` is the one
its generation started at. Checkpoints keep every finished prompt group and resubmit the others from their prompts.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import repeat
from typing import Callable

import torch

from common.engine_base import Completion, prompt_seeds
from common.tool_loop import ToolConfig, ToolStats, generate_with_tools, tool_metrics


@dataclass
class Request:
    """One batch's generation: finished (``completions``) or running on the servers (``future``)."""

    version: int  # the policy version that samples it
    completions: list[Completion] | None = None
    future: Future | None = None
    start: float = 0.0  # wall-clock interval of the generation (time.time())
    end: float = 0.0
    # --rollout.in-flight only: the request's Engine.generate arguments (per-prompt seeds), each prompt's group as it
    # finishes (None while it runs), and the version at which each group's generation started
    args: tuple | None = None
    groups: list[list[Completion] | None] | None = None
    group_versions: list[int] | None = None
    pending: bool = False  # restored from a checkpoint with groups still to generate: take() submits them


@dataclass
class Batch:
    step: int
    cursor: int  # the data cursor before its prompts were drawn
    problems: list[dict]
    prompt_ids: list[list[int]]
    indices: list[int]  # this process's training-set indices
    request: Request


class LaggedRollouts:
    """The fixed-lag schedule around one engine (see the module docstring); ``sample(step)`` is the script's."""

    def __init__(self, books, engine, sample: Callable, max_lag: int) -> None:
        if max_lag < 1:
            raise SystemExit(f"--max-lag must be >= 1 (1 = synchronous), got {max_lag}")
        self.books, self.engine, self.sample, self.max_lag = books, engine, sample, max_lag
        # servers sample on a background thread (one batch at a time, in step order); other engines generate in place
        self.overlap = engine.overlaps
        # --rollout.in-flight (server engine only): pushes do not wait, so up to k batches generate at once
        self.in_flight = bool(getattr(engine, "in_flight", False))
        workers = max_lag + 1 if self.in_flight else 1
        self.worker = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollouts") if self.overlap else None
        self.queue: list[Batch] = []  # requested, not yet taken, in step order
        self.next_step = 0  # the next batch to request
        self.version = 0  # the version the engine serves now: the step whose top it is
        self.stats: dict[str, float] = {}
        self.train_start = 0.0  # when take() returned: the trainer works until update_weights
        self.prompt_indices: list[int] = []  # training-set indices of the prompts of the batch take() returned
        self.resume_cursor: int | None = None  # a restored checkpoint's rewound data cursor (see load_state_dict)
        # --tools.*: every request goes through the tool loop, on this process's engine at the request's version
        self.tools: ToolConfig = getattr(getattr(books, "args", None), "tools", None) or ToolConfig()
        books.register("rollouts", self)  # checkpointed with the run

    def request(
        self,
        prompt_ids: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seeds: list[int],
        stop=(),
    ) -> Request:
        """Ask the engine for ``n`` samples per prompt from its current weights (``Engine.generate``'s arguments)."""
        args = (prompt_ids, n, max_new_tokens, temperature, top_p, seeds, stop)
        if self.in_flight:
            return self.request_in_flight(args)
        req = Request(version=self.version)
        if self.overlap:
            version = self.engine.version

            def run() -> list[Completion]:
                req.start = time.time()
                try:
                    if self.tools.format != "none":
                        return self.with_tools(_AtVersion(self.engine, version), args)
                    return self.engine.sample_local(*args, version=version)
                finally:
                    req.end = time.time()

            req.future = self.worker.submit(run)
        else:
            req.start = time.time()
            self.engine.wake()
            if self.tools.format != "none":  # ranks may take different turns: no collective inside the loop
                req.completions = self.with_tools(_AtVersion(self.engine, None), args)
            else:
                req.completions = self.engine.generate(*args)
            self.engine.sleep()
            req.end = time.time()
        return req

    def with_tools(self, engine, args: tuple) -> list[Completion]:
        """``args`` (``Engine.generate``'s) through the tool loop; each completion carries its ``ToolStats``."""
        completions, _ = generate_with_tools(
            engine, self.books.tokenizer, *args, cfg=self.tools, context_len=self.books.run.max_model_len
        )
        return completions

    def collect(self, req: Request, after_update: bool = False) -> list[Completion]:
        """The request's completions, each tagged with its version; a collective with servers (failures agreed, then
        ``on_fault(after_update)``: whether this step's update is done)."""
        if req.completions is None:
            req.completions = self.engine.all_ranks(req.future.result, "sampling", after_update=after_update)
        if req.group_versions is not None:  # in flight: a restored batch's groups may have started at other versions
            size = len(req.completions) // max(1, len(req.group_versions))
            for i, c in enumerate(req.completions):
                c.version = req.group_versions[i // size]
            return req.completions
        for c in req.completions:
            c.version = req.version
        return req.completions

    def take(self, step: int) -> tuple[list[dict], list[list[int]], list[Completion]]:
        """Request the batches up to ``step + max_lag - 1`` from the current weights (version ``step``), then return
        batch ``step``: its problems, prompt ids and completions (waiting for them if they are still sampling)."""
        t0 = time.time()
        self.version, self.next_step = step, max(self.next_step, step)
        if self.in_flight:
            self.engine.token_version = step  # a resumed run's first step (later ones: set by the push)
            for b in self.queue:  # batches a checkpoint held in flight: their unfinished groups start again, now
                if b.request.pending:
                    b.request = self.request_in_flight(b.request.args, b.request.groups, b.request.group_versions)
        # also past the run's last step: the final checkpoint keeps those batches, so that a run extended by --resume
        # with more steps is the longer run exactly (the older weights that sampled them are not in the checkpoint)
        while self.next_step < step + self.max_lag:
            cursor = self.books.cursor
            problems, prompt_ids, req = self.sample(self.next_step)
            self.queue.append(Batch(self.next_step, cursor, problems, prompt_ids, list(self.books.prompt_indices), req))
            self.next_step += 1
        batch = self.queue[0]
        if batch.step != step:
            raise RuntimeError(f"rollout schedule out of order: batch {batch.step} at step {step}")
        completions = self.collect(batch.request)
        self.queue.pop(0)
        self.prompt_indices = batch.indices  # the prompts this step trains on
        self.stats = self.lag_stats(step, completions)
        if self.tools.format != "none":  # the loop's metrics of the samples this step trains on
            self.stats |= tool_metrics([c.tool_stats or ToolStats() for c in completions])
        self.stats["time/rollout_wait_s"] = time.time() - t0  # the trainer idle, waiting for this batch (all if sync)
        self.train_start, self.taken = time.time(), batch.request
        return batch.problems, batch.prompt_ids, completions

    def lag_stats(self, step: int, completions: list[Completion]) -> dict[str, float]:
        """``train/lag`` (mean) and ``train/lag_max`` of the samples step ``step`` trains on (this process's), and in
        flight their ``train/token_lag_*`` (``token_lag_stats``). A script that trains on other samples than ``take``
        returned (dapo's kept groups and refills) logs these of its own."""
        lags = [step - c.version for c in completions] or [0]
        stats = {"train/lag": sum(lags) / len(lags), "train/lag_max": float(max(lags))}
        if self.in_flight:
            stats |= self.token_lag_stats(step, completions)
        return stats

    def update_weights(self, model: torch.nn.Module) -> None:
        """Wait for the generation in flight (weights never change under it), then push ``model`` as the next
        version. Logs the servers' idle time and how much of this step's training the generation overlapped."""
        train_end = time.time()
        if self.in_flight:
            return self.push_in_flight(model, train_end)
        for batch in self.queue:  # finish (and agree on) every request made from the outgoing weights
            self.collect(batch.request, after_update=True)
        idle_from = max([b.request.end for b in self.queue] + [self.taken.end])
        push_start = time.time()
        self.engine.update_weights(model)
        running = [b.request for b in self.queue if b.request.future is not None]
        overlap = sum(max(0.0, min(r.end, train_end) - max(r.start, self.train_start)) for r in running)
        self.stats |= {
            "time/generation_overlap_s": overlap,  # generation on the servers during this step's training
            "time/sampler_wait_s": (time.time() - idle_from) if self.overlap else 0.0,  # servers idle for weights
            "time/weight_push_s": time.time() - push_start,
        }

    def state_dict(self) -> dict:
        """The batches sampled ahead whose prompts the data cursor has passed, global across processes (a resume on
        any number of processes takes its share). A batch whose sampling failed on some process (a server fault) is
        dropped with the batches after it, and ``cursor`` rewinds to its prompts: a resume samples them again, from
        the resumed weights. A collective on several processes."""
        if self.in_flight:
            return self.state_dict_in_flight()
        local = []
        for b in self.queue:
            if b.cursor >= self.books.cursor:  # requested in a step a fault rewound
                break
            req = b.request
            if req.completions is None and req.future.exception() is None:  # waits for a request still running
                req.completions = req.future.result()
            # a tool loop's completions keep which tokens were observations, what the loop did, and the void filter
            sampled = [_saved(c) for c in req.completions or []] or None
            local.append(
                {
                    "step": b.step,
                    "version": req.version,
                    "cursor": b.cursor,
                    "indices": b.indices,
                    "completions": sampled,
                }
            )
        run = self.books.run
        shares = run.accelerator.gather_for_metrics([local], use_gather_object=True) if run.world > 1 else [local]
        batches, cursor = [], None
        for parts in zip(*shares):
            if any(p["completions"] is None for p in parts):
                cursor = parts[0]["cursor"]
                break
            batches.append(
                {
                    "step": parts[0]["step"],
                    "version": parts[0]["version"],
                    "indices": [i for p in parts for i in p["indices"]],
                    "completions": [c for p in parts for c in p["completions"]],
                }
            )
        return {"batches": batches, "cursor": cursor}

    def load_state_dict(self, state: dict) -> None:
        """Restore the batches sampled ahead (this process's share). A rewound ``cursor`` becomes ``resume_cursor``,
        which the ``Bookkeeper`` takes as its data cursor."""
        run = self.books.run
        self.queue = []
        for saved in state["batches"]:
            if "groups" in saved:  # an in-flight run's batch, by prompt group
                self.queue.append(self.restore_in_flight(saved))
                continue
            per_process = len(saved["indices"]) // run.world
            group = len(saved["completions"]) // len(saved["indices"])
            lo, hi = run.rank * per_process, (run.rank + 1) * per_process
            indices = saved["indices"][lo:hi]
            completions = [_completion(*saved_c) for saved_c in saved["completions"][lo * group : hi * group]]
            problems, prompt_ids = self.books.prompts_at(indices)
            req = Request(version=saved["version"], completions=completions)
            self.queue.append(Batch(saved["step"], -1, problems, prompt_ids, indices, req))
        self.next_step = self.queue[-1].step + 1 if self.queue else 0  # take() requests from here on
        self.resume_cursor = state["cursor"]

    # ------------------------------------------------------------------------------------ --rollout.in-flight
    def request_in_flight(self, args: tuple, groups=None, group_versions=None) -> Request:
        """Start ``args``' generation on the background pool without any version bound on its tokens (pushes pause
        and resume it). ``groups``: a restored batch's finished groups (None where one is still to generate); the
        others start now, at this version. Each group is kept as it finishes (``Request.groups``), so that a
        checkpoint holds it."""
        prompt_ids, n, max_new_tokens, temperature, top_p, seeds, stop = args
        seeds = prompt_seeds(seeds, len(prompt_ids))  # explicit per prompt: a resume resubmits a subset of them
        args = (prompt_ids, n, max_new_tokens, temperature, top_p, seeds, stop)
        req = Request(version=self.version, args=args, groups=list(groups or [None] * len(prompt_ids)))
        todo = [i for i, g in enumerate(req.groups) if g is None]
        started = group_versions or [self.version] * len(prompt_ids)
        req.group_versions = [self.version if g is None else v for g, v in zip(req.groups, started)]
        version = self.engine.version

        def keep(j: int, completions: list[Completion]) -> None:  # group j of the submitted ones has finished
            req.groups[todo[j]] = completions

        def run() -> list[Completion]:
            req.start = time.time()
            try:
                sub = ([prompt_ids[i] for i in todo], n, max_new_tokens, temperature, top_p, [seeds[i] for i in todo])
                if todo and self.tools.format != "none":  # the loop's turns span the batch: kept when it ends
                    out = self.with_tools(_AtVersion(self.engine, version, seeded=False), (*sub, stop))
                    for j in range(len(todo)):
                        keep(j, out[j * n : (j + 1) * n])
                elif todo:
                    self.engine.sample_local(*sub, stop, version=version, on_group=keep, seeded=False)
                return [c for g in req.groups for c in g]
            finally:
                req.end = time.time()

        req.future = self.worker.submit(run)
        return req

    @staticmethod
    def token_lag_stats(step: int, completions: list[Completion]) -> dict[str, float]:
        """``train/token_lag_{min,max,mean}``: ``step`` minus the version that sampled each sampled token (observation
        tokens left out) of the samples step ``step`` trains on (this process's)."""
        lags = [
            step - v
            for c in completions
            for v, obs in zip(c.token_versions or [c.version] * len(c.token_ids), c.observation_mask or repeat(0))
            if not obs
        ] or [0]
        return {
            "train/token_lag_min": float(min(lags)),
            "train/token_lag_max": float(max(lags)),
            "train/token_lag_mean": sum(lags) / len(lags),
        }

    def push_in_flight(self, model: torch.nn.Module, train_end: float) -> None:
        """Push ``model`` as the next version without waiting: the servers pause, take the weights, recompute the
        running requests' KV and resume them (``VLLMServerEngine.update_weights_in_flight``)."""
        running = [b.request for b in self.queue if b.request.future is not None]
        busy = any(not r.future.done() for r in running)
        push_start = time.time()
        self.engine.update_weights_in_flight(model, self.version + 1)
        push_end = time.time()
        ends = [r.end for r in running if r.end] + [self.taken.end]
        # several requests generate at once: the time any of them ran during this step's training, counted once (a
        # request whose thread has not started yet has no start time)
        spans = sorted((max(r.start, self.train_start), min(r.end or train_end, train_end)) for r in running if r.start)
        overlap, covered_to = 0.0, self.train_start
        for start, end in spans:
            overlap += max(0.0, end - max(start, covered_to))
            covered_to = max(covered_to, end)
        self.stats |= {
            "time/generation_overlap_s": overlap,
            # paused for the push while requests run; otherwise idle since the last generation ended
            "time/sampler_wait_s": push_end - (push_start if busy else max(ends)),
            "time/weight_push_s": push_end - push_start,
        }

    def state_dict_in_flight(self) -> dict:
        """``state_dict`` of an in-flight run, without waiting: for each batch ahead, each prompt's finished group
        (with its tokens' versions and log-probs, and the version its generation started at) or None for one still
        generating, which a resume submits again from its prompt at the resumed version; the request's settings
        and per-prompt seeds. A batch whose request failed rewinds the cursor as in ``state_dict``, except one restored
        from a checkpoint (its prompts were drawn before that checkpoint, so no cursor redraws them): it stays pending,
        its unfinished groups submitted again on resume."""
        local = []
        for b in self.queue:
            if b.cursor >= self.books.cursor:
                break
            req = b.request
            failed = req.future is not None and req.future.done() and req.future.exception() is not None
            failed = failed and b.cursor >= 0  # a restored batch (cursor -1) is kept pending instead
            if req.args is None:  # finished, restored from a fixed-lag checkpoint: no settings needed
                size = len(req.completions) // len(b.indices)
                groups = [req.completions[i * size : (i + 1) * size] for i in range(len(b.indices))]
                seeds, settings, started = [0] * len(b.indices), None, [req.version] * len(b.indices)
            else:
                prompt_ids, n, max_new_tokens, temperature, top_p, seeds, stop = req.args
                settings, started = [n, max_new_tokens, temperature, top_p, list(stop)], req.group_versions
                groups = list(req.groups)  # a snapshot: groups keep finishing meanwhile
            local.append(
                {
                    "step": b.step,
                    "version": req.version,
                    "cursor": b.cursor,
                    "indices": b.indices,
                    "failed": failed,
                    "groups": [None if g is None else [_saved(c) for c in g] for g in groups],
                    "group_versions": list(started),
                    "seeds": list(seeds),
                    "settings": settings,
                }
            )
        run = self.books.run
        shares = run.accelerator.gather_for_metrics([local], use_gather_object=True) if run.world > 1 else [local]
        batches, cursor = [], None
        for parts in zip(*shares):
            if any(p["failed"] for p in parts):
                cursor = parts[0]["cursor"]
                break
            merged = {
                key: [x for p in parts for x in p[key]] for key in ("indices", "groups", "group_versions", "seeds")
            }
            batches.append({"step": parts[0]["step"], "version": parts[0]["version"], "settings": parts[0]["settings"]})
            batches[-1] |= merged
        return {"batches": batches, "cursor": cursor}

    def restore_in_flight(self, saved: dict) -> Batch:
        """This process's share of a checkpointed in-flight batch: finished when every group is, else pending (its
        missing groups are submitted at the next ``take``)."""
        if not self.in_flight and any(g is None for g in saved["groups"]):
            raise SystemExit(
                "this checkpoint holds batches still generating in an --rollout.in-flight run: resume with "
                "--rollout.in-flight (and --rollout.backend vllm-server)"
            )
        run = self.books.run
        per_process = len(saved["indices"]) // run.world
        lo, hi = run.rank * per_process, (run.rank + 1) * per_process
        indices = saved["indices"][lo:hi]
        groups = [None if g is None else [_completion(*c) for c in g] for g in saved["groups"][lo:hi]]
        problems, prompt_ids = self.books.prompts_at(indices)
        args = None
        if saved["settings"] is not None:
            n, max_new_tokens, temperature, top_p, stop = saved["settings"]
            args = (prompt_ids, n, max_new_tokens, temperature, top_p, saved["seeds"][lo:hi], tuple(stop))
        req = Request(version=saved["version"], args=args, groups=groups)
        req.group_versions = saved["group_versions"][lo:hi]
        if all(g is not None for g in groups):
            req.completions = [c for g in groups for c in g]
        else:
            req.pending = True
        return Batch(saved["step"], -1, problems, prompt_ids, indices, req)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()


class _AtVersion:
    """``engine`` as an ``Engine.generate`` for the tool loop: ``sample_local`` at weight version ``version``, on this
    process alone (ranks take different numbers of turns, so the loop must not call a collective); ``options``: a
    server engine's further ``sample_local`` options (in flight: ``seeded=False``)."""

    def __init__(self, engine, version, **options) -> None:
        self.engine, self.version, self.options = engine, version, options

    def generate(self, prompt_ids, n, max_new_tokens, temperature, top_p, seed, stop=()) -> list[Completion]:
        return self.engine.sample_local(
            prompt_ids, n, max_new_tokens, temperature, top_p, seed, stop, version=self.version, **self.options
        )


def _saved(c: Completion) -> tuple:
    """A completion as a checkpoint holds it; its per-token versions only where it has them (in-flight runs)."""
    saved = (c.token_ids, c.logprobs, c.finish_reason, c.observation_mask, _stats_dict(c.tool_stats), c.excluded)
    return saved if c.token_versions is None else (*saved, c.token_versions)


def _stats_dict(stats: ToolStats | None) -> dict | None:
    return dataclasses.asdict(stats) if stats is not None else None


def _completion(
    token_ids, logprobs, finish_reason, observation_mask=None, tool_stats=None, excluded=False, token_versions=None
) -> Completion:
    """A checkpointed completion (checkpoints from before tool loops hold three fields, from before tool stats four;
    in-flight runs' a seventh, the per-token versions)."""
    mask = list(observation_mask) if observation_mask is not None else None
    stats = ToolStats(**tool_stats) if tool_stats is not None else None
    versions = list(token_versions) if token_versions is not None else None
    return Completion(
        list(token_ids),
        list(logprobs),
        finish_reason,
        observation_mask=mask,
        tool_stats=stats,
        excluded=excluded,
        token_versions=versions,
    )
