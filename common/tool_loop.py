"""The tool loop: multi-turn, tool-calling rollouts around any engine (issue 39).

    completions, stats = generate_with_tools(engine, tokenizer, prompt_ids, n, max_new_tokens, temperature, top_p,
                                             seeds, stop, cfg)
    metrics = tool_metrics(stats)       # tools/calls_per_sample, tools/call_rate, ...

``engine`` is anything with the ``Engine.generate`` of ``common/engine_base.py`` (HF, colocated vLLM, vLLM server):
token-id prompts in, ``Completion`` out. The loop samples a turn, looks at the decoded text of that turn's sampled
ids for a call (``common.tools.detect_tool_call``, in ToRL's python-block format or the chat ``<tool_call>`` format of
``common.tool_format``), runs the calls of all waiting samples in parallel, appends each observation's token ids and
samples the next turn. Each returned ``Completion`` holds every token after the prompt, sampled and appended, with
``observation_mask`` 1 on the appended ones (None when a sample has none) and ``logprobs`` 0.0 there (one entry per
token, as the Completion contract says; the sampler has no log-prob for a token it did not draw). ``stats`` holds one
``ToolStats`` per completion. ``cfg.format == "none"`` turns the loop off: one ``engine.generate`` call with the
caller's arguments, its completions returned as they are.

Token in, token out. Turn k's prompt is ``prompt_ids + the sample's ids so far``, the exact ids the engine returned
plus the observation ids; the history is never decoded and re-encoded (re-tokenisation drift would silently change the
tokens the trainer scores). Decoding serves only to read a turn's text. An observation's text is encoded on its own,
``tokenizer(text, add_special_tokens=False)``, so the chat framing's ``<|im_end|>`` / ``<|im_start|>`` become their
special ids.

Turn 1 is exactly ``engine.generate(prompt_ids, n, max_new_tokens, temperature, top_p, seeds, stop + tool stop
strings)``: with no tool call the result is the single-turn result bit for bit, the very Completion objects. A stop
string only changes a completion whose text contains it; the one case that breaks equality is a turn that stops on a
tool stop string with no call after it (a fence that closes no python block, e.g. "```text ... ```"): such a turn
continues with no observation, from where it stopped, under a new seed (SimpleTIR's "void" turn, counted). (A
``max_total_tokens`` or ``context_len`` below ``max_new_tokens`` also cuts turn 1 shorter than single-turn would.)

Seeds. Later turns send one request per continuing sample (``n=1``), all continuing samples of a turn in one
``engine.generate`` call, each with the seed ``turn_seed(prompt seed, sample index, turn)``: blake2b of the three ints,
62 bits. Never the prompt's seed: HF and vLLM draw sample j's noise from seed + j, so reusing it would replay turn 1's
draws in turn 2, and the trajectory would not be sampled from pi.

Budgets (``ToolConfig``). ``max_new_tokens`` counts sampled tokens only, across turns: each turn may sample what is
left. ``max_total_tokens`` bounds sampled + observation tokens (0: max_new_tokens + max_calls * max_obs_tokens, which
no sample can exceed, so only ``context_len`` can bind), and ``context_len`` (the engine's context, 0 = none)
bounds prompt + all of them. A turn's budget is the least of the three; one call serves every continuing sample, so it
asks for the largest budget and cuts each sample at its own (a cut turn ends the sample with finish "length"; vLLM caps
a request at its context by itself). An observation that would leave no room to sample after it is not appended and
the sample ends with "length", as TRL (`_tool_call_loop` in trl/trainer/grpo_trainer.py drops tool results past
max_completion_length or the model's length) and verl (experimental/agent_loop/tool_agent_loop.py breaks before
appending a response that reaches response_length) do. An observation is cut to ``max_obs_chars`` (head + tail with a
counted marker, ``truncate_observation``), then, while its ids exceed ``max_obs_tokens``, its text is cut further
and encoded again; the ids appended are one encoding of the final text, framing intact.

Ending. A turn ends the sample when it hits its budget ("length") or stops without a call (EOS, the end-of-turn id,
one of the caller's stop strings: "stop"). A call beyond ``max_calls`` is not run and the sample ends there with
"stop", as TRL (``max_tool_calling_iterations``: the loop exits and the last completion keeps its unexecuted call) and
verl (``max_user_turns``: break) do; sampling on after a call the model will never see answered would teach it to
ignore its own calls. Chat format: a turn that ends with "</tool_call>" and then the end-of-turn id (a stop id) is a
call too; its observation does not repeat the end-of-turn (``ChatFraming.observation(result, turn_ended=True)``).
Tool errors and timeouts are observations with a status (``common.tools.run_tool_call``), never exceptions.

Void turns (SimpleTIR, arXiv 2509.02479: "a turn that yields neither a complete code block nor a final answer") are
counted here as turns that stopped on a tool stop string with no call after it, and turns that end the sample with no
call and without ``cfg.answer_marker`` ("\\boxed{" by default, the answer format of every math template here; '' counts
only the first kind). A turn cut by a budget is not counted as void: its finish reason "length" reports it already.
``cfg.void_filter`` (off by default, as in SimpleTIR's own scripts, ``--mask_void_turns``) marks a sample with a void
turn ``Completion.excluded``: its reward still counts in its group's baseline, and ``pack_rollout`` gives it no loss
token, as SimpleTIR zeroes such a trajectory's loss mask after the advantages are computed. Every returned completion
carries its ``ToolStats`` (``Completion.tool_stats``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from common.engine_base import Completion, Engine, ToolStats, prompt_seeds
from common.tools import (
    TOOLS,
    ToolCall,
    ToolOutput,
    chat_framing,
    detect_tool_call,
    format_python_observation,
    run_tool_call,
    stop_strings,
    truncate_observation,
)


@dataclass
class ToolConfig:
    """Tool-integrated rollouts (``--tools.*`` flags)."""

    format: Literal["none", "python", "chat"] = "none"
    """'none' = single-turn rollouts; 'python' = ToRL's ```python blocks; 'chat' = <tool_call> JSON in a chat turn"""
    tool: str = "python"
    """python format: the tool a closed ```python block calls ('python': sandboxed program; 'calculator')"""
    max_calls: int = 4
    """tool calls run per sample; a call beyond them ends the sample unanswered"""
    timeout_s: float = 5.0
    """wall-clock limit of one python tool call, in seconds"""
    memory_mb: int = 1024
    """memory limit of one python tool call, in MB"""
    max_obs_chars: int = 1024
    """an observation's result is cut to this many characters, head + tail with a marker (0 = no cut)"""
    max_obs_tokens: int = 256
    """an observation (framing included) is cut to this many tokens"""
    max_total_tokens: int = 0
    """sampled + observation tokens per sample (0 = max_new_tokens + max_calls * max_obs_tokens)"""
    workers: int = 8
    """tool calls run in parallel (threads; a python call is a sandboxed process)"""
    answer_marker: str = "\\boxed{"
    """a turn that ends the sample with no call and without this text is void, as SimpleTIR counts ('' = none is)"""
    void_filter: bool = False
    """SimpleTIR's filter: a sample with a void turn keeps its reward in its group but trains on none of its tokens"""

    def total_budget(self, max_new_tokens: int) -> int:
        """Tokens after the prompt a sample may hold: ``max_total_tokens``, or by default what no sample can exceed."""
        return self.max_total_tokens or max_new_tokens + self.max_calls * self.max_obs_tokens

    def check(self, tools: Mapping[str, Callable[..., str]] = TOOLS) -> None:
        """Raise ValueError on settings the loop cannot run with."""
        if self.format not in ("none", "python", "chat"):
            raise ValueError(f"--tools.format {self.format!r}: expected 'none', 'python' or 'chat'")
        if self.format == "python" and self.tool not in tools:
            raise ValueError(f"--tools.tool {self.tool!r}: expected one of {', '.join(sorted(tools))}")
        if self.max_calls < 0 or self.max_obs_chars < 0 or self.max_total_tokens < 0:
            raise ValueError("--tools.max-calls, --tools.max-obs-chars and --tools.max-total-tokens must be >= 0")
        if self.max_obs_tokens < 1 or self.workers < 1 or self.timeout_s <= 0:
            raise ValueError("--tools.max-obs-tokens and --tools.workers must be >= 1, --tools.timeout-s > 0")


def turn_seed(seed: int, sample: int, turn: int) -> int:
    """The request seed of ``turn`` (1, 2, ...; turn 0 is the engine's own seed + sample) of sample ``sample`` of a
    prompt whose seed is ``seed``: blake2b of the three ints, 62 bits (vLLM and HF take any int below 2**63)."""
    key = b"".join(x.to_bytes(16, "little", signed=True) for x in (seed, sample, turn))
    digest = hashlib.blake2b(key, digest_size=8, person=b"tool-loop-turn").digest()
    return int.from_bytes(digest, "little") >> 2


def generate_with_tools(
    engine: Engine,
    tokenizer,
    prompt_ids: list[list[int]],
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seeds: int | list[int],
    stop: Sequence[str] = (),
    cfg: ToolConfig | None = None,
    *,
    tools: Mapping[str, Callable[..., str]] = TOOLS,
    context_len: int = 0,
) -> tuple[list[Completion], list[ToolStats]]:
    """``n`` multi-turn completions per prompt, grouped by prompt as ``engine.generate``'s, and one ``ToolStats`` each
    (see the module docstring). ``tools``: the registry calls are looked up in (``common.tools.TOOLS``);
    ``context_len``: the engine's context in tokens, prompt included (0 = no bound beyond the budgets)."""
    cfg = cfg or ToolConfig()
    cfg.check(tools)
    if cfg.format == "none":
        out = engine.generate(prompt_ids, n, max_new_tokens, temperature, top_p, seeds, stop)
        return out, [ToolStats() for _ in out]
    loop = _Loop(tokenizer, cfg, tools, tuple(stop), max_new_tokens, context_len)
    first = engine.generate(prompt_ids, n, max_new_tokens, temperature, top_p, seeds, loop.stops)
    if len(first) != len(prompt_ids) * n:
        raise RuntimeError(f"the engine returned {len(first)} completions for {len(prompt_ids)} prompts x {n}")
    per_prompt = prompt_seeds(seeds, len(prompt_ids))  # the engine's own per-prompt seeds
    samples = [_Sample(prompt_ids[i // n], per_prompt[i // n], i % n, c) for i, c in enumerate(first)]
    for s in samples:
        s.budget = max(0, loop.room(s))  # a prompt that fills the context leaves turn 1 nothing: "length"
    active, outs, turn = samples, first, 0
    with ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="tool") as pool:
        while active:
            waiting: list[tuple[_Sample, ToolCall, bool]] = []
            for s, c in zip(active, outs):
                action = loop.absorb(s, c)
                if isinstance(action, tuple):
                    waiting.append((s, *action))
            # every waiting sample's call at once: a sandboxed program mostly waits on its process
            results = list(pool.map(loop.call, [call for _, call, _ in waiting]))
            for (s, _, turn_ended), result in zip(waiting, results):
                loop.observe(s, result, turn_ended)
            active = [s for s in active if not s.done]  # in sample order: the engine call's rows are deterministic
            if not active:
                break
            turn += 1
            for s in active:
                s.budget = loop.room(s)
            outs = engine.generate(
                [s.prompt + s.token_ids for s in active],
                1,
                max(s.budget for s in active),  # one request for all; each sample is cut at its own budget
                temperature,
                top_p,
                [turn_seed(s.seed, s.index, turn) for s in active],
                loop.stops,
            )
            if len(outs) != len(active):
                raise RuntimeError(f"the engine returned {len(outs)} completions for {len(active)} prompts")
    return [s.completion(cfg.void_filter) for s in samples], [s.stats for s in samples]


@dataclass(eq=False)
class _Sample:
    """One sample's state across turns."""

    prompt: list[int]
    seed: int  # its prompt's seed
    index: int  # its index among the prompt's n samples
    first: Completion  # turn 1's completion, returned as it is when the sample ends there uncut
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 = observation
    versions: list[int] | None = None  # --rollout.in-flight: each token's policy version (observations: the last's)
    sampled: int = 0
    budget: int = 0  # tokens this turn may keep
    finish: str = "stop"
    done: bool = False
    stats: ToolStats = field(default_factory=lambda: ToolStats(turns=0))

    def end(self, finish: str) -> None:
        self.finish, self.done = finish, True

    def completion(self, void_filter: bool) -> Completion:
        if self.stats.turns == 1 and self.token_ids == self.first.token_ids and self.finish == self.first.finish_reason:
            out = self.first
        else:
            mask = self.mask if any(self.mask) else None
            out = Completion(list(self.token_ids), list(self.logprobs), self.finish, self.first.version, mask)
            out.token_versions = list(self.versions) if self.versions is not None else None
        out.tool_stats, out.excluded = self.stats, void_filter and self.stats.void_turns > 0
        return out


class _Loop:
    """The per-run parts of the loop: stop strings, budgets, reading a turn, running a call, encoding its result."""

    def __init__(
        self,
        tokenizer,
        cfg: ToolConfig,
        tools: Mapping[str, Callable[..., str]],
        stop: tuple[str, ...],
        max_new_tokens: int,
        context_len: int,
    ):
        self.tokenizer, self.cfg, self.tools, self.user_stops = tokenizer, cfg, tools, stop
        self.tool_stops = stop_strings(cfg.format)
        self.stops = list(stop) + [s for s in self.tool_stops if s not in stop]
        # tokens that decode to at least one character each: this many hold any stop string that ends a turn
        self.window = max(len(s) for s in self.stops)
        self.max_new_tokens, self.context_len = max_new_tokens, context_len
        self.total = cfg.total_budget(max_new_tokens)
        self.framing = chat_framing(tokenizer) if cfg.format == "chat" else None
        self.end_of_turn = self.framing.end_of_turn if self.framing else ""  # "" in the python format: no such call
        # tokens of the framing alone (empty result), for each way a call's turn can end
        self.framing_tokens = {ended: len(self.encode(self.frame("", ended))) for ended in (False, True)}
        if max(self.framing_tokens.values()) >= cfg.max_obs_tokens:
            raise ValueError(
                f"--tools.max-obs-tokens {cfg.max_obs_tokens} leaves no room for a result: the {cfg.format} "
                f"format's framing alone takes {max(self.framing_tokens.values())} tokens"
            )

    def room(self, s: _Sample) -> int:
        """Tokens ``s`` may still sample: the least of its sampled, total and context budgets."""
        room = min(self.max_new_tokens - s.sampled, self.total - len(s.token_ids))
        if self.context_len:
            room = min(room, self.context_len - len(s.prompt) - len(s.token_ids))
        return room

    def absorb(self, s: _Sample, c: Completion) -> tuple[ToolCall, bool] | None:
        """Append turn ``c`` to ``s``, cut at ``s.budget``; return the call to run and whether the turn's text ended
        with the end-of-turn token, or None (the sample ended, or it samples on with no observation)."""
        ids, logprobs, finish = c.token_ids, c.logprobs, c.finish_reason
        if len(ids) > s.budget:
            ids, logprobs, finish = ids[: s.budget], logprobs[: s.budget], "length"
        s.token_ids += ids
        s.logprobs += logprobs
        s.mask += [0] * len(ids)
        if c.token_versions is not None:  # in-flight weight updates: tokens of one turn may span pushes
            s.versions = (s.versions or []) + list(c.token_versions[: len(ids)])
        s.sampled += len(ids)
        s.stats.turns += 1
        if finish != "stop":
            s.end("length")
            return None
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if self.stopped_on(ids, self.user_stops):  # the caller's stop string ends the sample, as it does single-turn
            s.end("stop")
            s.stats.void_turns += bool(self.cfg.answer_marker) and self.cfg.answer_marker not in text
            return None
        call = detect_tool_call(
            text, self.cfg.format, block_tool=self.cfg.tool, tools=self.tools, end_of_turn=self.end_of_turn
        )
        if call is None:
            if not self.stopped_on(ids, self.tool_stops):
                s.end("stop")  # EOS or the end-of-turn id: the answer is complete
                s.stats.void_turns += bool(self.cfg.answer_marker) and self.cfg.answer_marker not in text
                return None
            s.stats.void_turns += 1  # a fence that is no call: sample on from where it stopped
            if self.room(s) <= 0:
                s.end("length")
            return None
        if s.stats.calls >= self.cfg.max_calls:
            s.stats.call_limited = True
            s.end("stop")
            return None
        if self.room(s) <= 0:  # no token could follow the observation: do not run the call
            s.end("length")
            return None
        return call, bool(self.end_of_turn) and text.endswith(self.end_of_turn)

    def stopped_on(self, ids: list[int], strings: Sequence[str]) -> bool:
        """Whether the turn ``ids`` ended on one of ``strings``: one ends inside the last token's text (the token that
        completes a stop string holds its end; after an EOS such as "</tool_call><|endoftext|>" none does)."""
        if not ids or not strings:
            return False
        tail = self.tokenizer.decode(ids[-self.window :], skip_special_tokens=False)
        start_of_last = len(tail) - len(self.tokenizer.decode(ids[-1:], skip_special_tokens=False))
        return any(s and tail.rfind(s) >= 0 and tail.rfind(s) + len(s) > start_of_last for s in strings)

    def call(self, call: ToolCall) -> ToolOutput:
        """Run ``call`` uncut (``observe`` cuts it); on a pool thread."""
        return run_tool_call(
            call, tools=self.tools, max_chars=0, timeout_s=self.cfg.timeout_s, memory_mb=self.cfg.memory_mb
        )

    def observe(self, s: _Sample, result: ToolOutput, turn_ended: bool) -> None:
        """Count the call, then append its observation to ``s`` if a token can still be sampled after it."""
        s.stats.calls += 1
        s.stats.errors += result.status == "error"
        s.stats.timeouts += result.status == "timeout"
        s.stats.sandbox_errors += result.status == "sandbox_error"
        ids = self.observation_ids(result, turn_ended)
        s.token_ids += ids
        if self.room(s) <= 0:  # it would overflow: drop it and end the sample (TRL, verl)
            del s.token_ids[-len(ids) :]
            s.end("length")
            return
        s.logprobs += [0.0] * len(ids)
        s.mask += [1] * len(ids)
        if s.versions is not None:
            s.versions += s.versions[-1:] * len(ids)
        s.stats.obs_tokens += len(ids)

    def frame(self, result: str, turn_ended: bool) -> str:
        if self.framing is None:
            return format_python_observation(result)
        return self.framing.observation(result, turn_ended)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def observation_ids(self, result: str, turn_ended: bool) -> list[int]:
        """The framed observation's ids, at most ``max_obs_tokens``: the result cut to ``max_obs_chars``, then cut
        further, in proportion to its token excess, until the framed text's encoding fits (the framing alone fits:
        checked at start-up). Always cut from the whole result, so the one marker counts every character cut."""
        limit, base = self.cfg.max_obs_tokens, self.framing_tokens[turn_ended]
        keep = min(len(result), self.cfg.max_obs_chars or len(result))
        while True:
            text = truncate_observation(result, keep) if keep > 0 else ""  # truncate_observation(x, 0) keeps all
            ids = self.encode(self.frame(text, turn_ended))
            if len(ids) <= limit or keep == 0:
                return ids
            keep = max(0, min(keep - 1, keep * (limit - base) // max(1, len(ids) - base)))


def gathered_tool_metrics(stats: Sequence[ToolStats], gather: Callable[[list], list] | None = None) -> dict[str, float]:
    """``tool_metrics`` over every process's ``stats`` (``gather``: a list from every process, concatenated)."""
    return tool_metrics(gather(list(stats)) if gather is not None else stats)


def tool_metrics(stats: Sequence[ToolStats]) -> dict[str, float]:
    """Step metrics of the tool loop over one step's samples (for docs/metrics.md): per-sample means of calls,
    observation tokens, turns and void turns; the fractions of samples that called a tool, that hold a void turn
    (SimpleTIR's filter would drop them) and that hit --tools.max-calls; error, timeout and sandbox-failure rates per
    call (0 when no call was made)."""
    if not stats:
        return {}
    samples, calls = len(stats), sum(s.calls for s in stats)
    per_call = lambda count: count / calls if calls else 0.0
    return {
        "tools/calls_per_sample": calls / samples,
        "tools/call_rate": sum(s.calls > 0 for s in stats) / samples,
        "tools/error_rate": per_call(sum(s.errors for s in stats)),
        "tools/timeout_rate": per_call(sum(s.timeouts for s in stats)),
        "tools/sandbox_error_rate": per_call(sum(s.sandbox_errors for s in stats)),
        "tools/obs_tokens": sum(s.obs_tokens for s in stats) / samples,
        "tools/turns": sum(s.turns for s in stats) / samples,
        "tools/void_turns": sum(s.void_turns for s in stats) / samples,
        "tools/void_rate": sum(s.void_turns > 0 for s in stats) / samples,
        "tools/call_limit_rate": sum(s.call_limited for s in stats) / samples,
        "tools/success_rate": per_call(calls - sum(s.errors + s.timeouts + s.sandbox_errors for s in stats)),
    }


__all__ = ["ToolConfig", "ToolStats", "gathered_tool_metrics", "generate_with_tools", "tool_metrics", "turn_seed"]
