"""Answer extraction, correctness checks and reward functions for math reasoning RL.

What lives here:

* ``extract_answer`` pulls the predicted final answer out of a completion: the last ``\\boxed{}``
  (or ``\\fbox{}``), else the last ``<answer>...</answer>``, else a final ``Answer: ...`` line.
* Gold helpers for GSM8K (``#### 42``) and MATH (last ``\\boxed{}`` of the solution).
* ``grade_math`` / ``grade_math_batch``: symbolic equivalence with math-verify, gold first.
* ``grade_boxed_exact``: the tiny synthetic task's exact-match checker (no sympy).
* ``format_reward_r1``: the R1-style ``<think>...</think><answer>...</answer>`` format check.
* ``RewardOutput`` and the reward registry (``"math"``, ``"exact"``, ``"code"``, ``"code-partial"``, ``"per-row"``;
  the code rewards run programs in the sandbox: ``common/code_reward.py``). Every reward function
  returns the shaped reward and a separate correctness flag, because DAPO's dynamic sampling
  filters groups on correctness, not on the shaped reward.

math-verify runs in worker processes (``common.math_grader``): each check has a deadline enforced
by killing its worker, which works from any thread and bounds C-level work too; a worker that hangs
or crashes scores its task ``False`` and is replaced; a worker never imports the training script,
and the trainer is never forked. This process never imports math-verify or sympy. The pool is
process-wide, starts on first use (about 0.5 s) and is forgotten in a child after ``os.fork``.
"""

from __future__ import annotations

import atexit
import os
import re
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from common.math_grader import GraderPool

NUM_WORKERS: int = max(2, min(4, os.cpu_count() or 1))
"""How many math-verify worker processes to run; read when the pool is (re)created."""
WORKER_STARTUP_TIMEOUT_S: float = 60.0
"""A worker that has not imported math-verify within this many seconds has failed to start."""
WORKER_MEMORY_LIMIT_BYTES: int = 4 * 1024**3
"""Address-space cap for each worker, so a runaway sympy expression raises MemoryError there
instead of drawing the OOM killer onto the trainer; read when the pool is (re)created."""

# ----------------------------------------------------------------------------------------------
# Answer extraction
# ----------------------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BRACE_TOKEN_RE = re.compile(r"\\.|[{}]", re.DOTALL)
_BARE_BOX_ARG_RE = re.compile(r"[ \t]*([^\s$]+)")
_ANSWER_LINE_RE = re.compile(r"(?im)^[^\n]*?\banswer\**[ \t]*:\**([^\n]*)")  # linear: no nested *
_INLINE_MATH_RE = re.compile(r"(?<!\\)\$((?:[^$\\]|\\.)+)\$", re.DOTALL)  # $...$, honouring \$
_SPAN_LIST_RE = re.compile(r"\$(?:[^$\\]|\\.)+\$(?:\s*,\s*\$(?:[^$\\]|\\.)+\$)+", re.DOTALL)  # $a$,$b$
# one math span from its opening delimiter (group 1) to its first closing one; \$ and \\) do not close it
_WRAPPER_RES = (
    re.compile(r"(\$\$?)(?:[^$\\]|\\.)*\1", re.DOTALL),  # $...$ or $$...$$
    re.compile(r"(\\\()(?:[^\\]|\\[^)])*\\\)", re.DOTALL),  # \(...\)
    re.compile(r"(\\\[)(?:[^\\]|\\[^\]])*\\\]", re.DOTALL),  # \[...\]
)
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:(?:,|\{,\}|\\,| )\d{3})+(?:\.\d+)?")
_INT_RE = re.compile(r"-?\d{1,4000}")  # int() refuses > 4300 digits by default
_SIMPLE_GOLD_RE = re.compile(r"-?\d+(?:\.\d+)?|-?\\d?frac\{\d+\}\{\d+\}")


def last_boxed(text: str) -> str | None:
    """Return the inner text of the last ``\\boxed``/``\\fbox`` in ``text``, or ``None``.

    The argument is matched with balanced braces (escaped ``\\{``/``\\}`` do not count), so
    ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. The brace-less form ``\\boxed 5`` gives the
    following run of non-space, non-``$`` characters. Only the last occurrence is considered: if
    its braces never close (a truncated completion) the result is ``None`` rather than an earlier
    box. Runs in linear time, so adversarially long or deeply nested text is cheap.
    """
    last = None
    for last in _BOX_RE.finditer(text):
        pass
    if last is None:
        return None
    start = last.end()
    rest = text[start:].lstrip(" \t")
    if rest.startswith("{"):
        open_pos = len(text) - len(rest)
        depth = 0
        for tok in _BRACE_TOKEN_RE.finditer(text, open_pos):
            if tok.group() == "{":
                depth += 1
            elif tok.group() == "}":
                depth -= 1
                if depth == 0:
                    return text[open_pos + 1 : tok.start()]
        return None
    bare = _BARE_BOX_ARG_RE.match(text, start)
    return bare.group(1) if bare else None


def _strip_math_wrappers(s: str) -> str:
    """Strip whitespace, enclosing ``$``/``$$``/``\\(\\)``/``\\[\\]`` and trailing full stops.

    A wrapper is stripped only when it is one math span holding the whole text: ``$69$,$84$`` is two spans, not
    ``69$,$84`` inside one pair of dollars. Text that is nothing but a comma-separated list of ``$...$`` spans (how
    OlympiadBench stores multi-answer golds) becomes the list of their stripped contents: ``$69$,$84$`` gives
    ``69, 84``. Works on indices, so it stays linear even on ``"$" * 100_000``.
    """
    i, j = 0, len(s)
    while True:
        while i < j and s[i].isspace():
            i += 1
        while j > i and s[j - 1].isspace():
            j -= 1
        for wrapper in _WRAPPER_RES:
            if span := wrapper.fullmatch(s, i, j):
                i, j = i + len(span.group(1)), j - len(span.group(1))
                break
        else:
            if j - i >= 2 and s[j - 1] == "." and s[j - 2] != ".":  # "5." but not "\\ldots" or "..."
                j -= 1
            elif _SPAN_LIST_RE.fullmatch(s, i, j):
                return ", ".join(_strip_math_wrappers(span) for span in _INLINE_MATH_RE.findall(s, i, j))
            else:
                return s[i:j]


def extract_answer(completion: str) -> str | None:
    """Return the predicted final answer text of ``completion``, or ``None`` if it has none.

    Priority: the inner text of the last ``\\boxed{...}``/``\\fbox{...}`` (also ``\\boxed 5``);
    else the inner text of the last complete ``<answer>...</answer>``; else the text after the
    last ``Answer:`` on a line (DAPO's "Answer: $Answer" convention; if that text holds ``$...$``
    spans, the last span's content is used, so Minerva's "The final answer is $5$." works, unless
    the text is just a comma-separated list of spans: "Answer: $69$, $84$" gives ``69, 84``).
    The result has surrounding whitespace, enclosing ``$`` delimiters and a trailing full stop removed.
    A bare "the answer is 42" with no marker yields ``None`` on purpose: rewards should not
    depend on guessing which number in free text was meant.
    """
    boxed = last_boxed(completion)
    if boxed is not None:
        return _strip_math_wrappers(boxed)
    close = completion.rfind("</answer>")
    if close != -1:
        open_ = completion.rfind("<answer>", 0, close)
        if open_ != -1:
            return _strip_math_wrappers(completion[open_ + len("<answer>") : close])
    text = None
    for line in _ANSWER_LINE_RE.finditer(completion):
        if line.group(1).strip():
            text = line.group(1)
    if text is None:
        return None
    text = _strip_math_wrappers(text)
    spans = _INLINE_MATH_RE.findall(text)
    return _strip_math_wrappers(spans[-1]) if spans else text


def extract_gsm8k_gold(answer_field: str) -> str:
    """Return the GSM8K gold answer: the text after the last ``####``, stripped, commas removed.

    GSM8K's ``answer`` field is a worked solution that ends in ``#### 1,000``; the result for
    that is ``"1000"``. Raises ``ValueError`` (quoting the end of the field) when there is no
    ``####`` marker or nothing after it, because a silently empty gold would score every
    completion as wrong (or, with a careless grader, as right).
    """
    if "####" not in answer_field:
        raise ValueError(
            f"GSM8K answer field has no '####' marker (expected '... #### <number>'): ...{answer_field[-120:]!r}"
        )
    gold = answer_field.rsplit("####", 1)[1].strip().replace(",", "")
    if not gold:
        raise ValueError(f"GSM8K answer field has nothing after '####': ...{answer_field[-120:]!r}")
    return gold


def extract_math_gold(solution: str) -> str:
    """Return the MATH gold answer: the content of the last ``\\boxed{}`` in ``solution``.

    This is the convention of the MATH / MATH-lighteval ``solution`` column (MATH-500 also has a
    clean ``answer`` column that can be used directly). Raises ``ValueError`` quoting the end
    of the solution when it has no complete ``\\boxed{}``.
    """
    boxed = last_boxed(solution)
    if boxed is None or not boxed.strip():
        raise ValueError(f"MATH solution has no complete \\boxed{{...}} answer: ...{solution[-120:]!r}")
    return boxed.strip()


def _normalize(s: str) -> str:
    """Cheap canonical form: strip wrappers, and drop thousands separators from a lone number."""
    s = _strip_math_wrappers(s)
    if _THOUSANDS_RE.fullmatch(s):
        s = re.sub(r"[^\d.\-]", "", s)
    return s


# ----------------------------------------------------------------------------------------------
# Simple checkers
# ----------------------------------------------------------------------------------------------


def grade_boxed_exact(completion: str, gold: str) -> bool:
    """Return whether the last ``\\boxed{}`` content equals ``gold`` exactly (after stripping).

    This is the tiny synthetic arithmetic task's checker: completions look like
    ``49+97=146;146-53=93;\\boxed{93}`` and the gold is an integer string. No sympy, no
    normalisation beyond whitespace, so ``\\boxed{93.0}`` is wrong on purpose.
    """
    boxed = last_boxed(completion)
    return boxed is not None and boxed.strip() == gold.strip()


def format_reward_r1(completion: str) -> bool:
    """Return whether ``completion`` has the R1 format ``<think>...</think> <answer>...</answer>``.

    The opening ``<think>`` may be missing, because the R1-Zero template ends the prompt with
    ``<think>`` and the completion starts inside it. Exactly one ``</think>``, one ``<answer>``
    and one ``</answer>`` (and at most one ``<think>``) must appear, in that order, with only
    whitespace between ``</think>`` and ``<answer>`` and after ``</answer>``, and a non-empty
    answer.
    """
    counts = {t: completion.count(t) for t in ("<think>", "</think>", "<answer>", "</answer>")}
    if counts["<think>"] > 1 or any(counts[t] != 1 for t in ("</think>", "<answer>", "</answer>")):
        return False
    body = completion.lstrip()
    if counts["<think>"] == 1:
        if not body.startswith("<think>"):
            return False
        body = body[len("<think>") :]
    m = re.fullmatch(r"(?s).*?</think>\s*<answer>(.*?)</answer>\s*", body)
    return m is not None and m.group(1).strip() != ""


# ----------------------------------------------------------------------------------------------
# The process-wide math-verify pool
# ----------------------------------------------------------------------------------------------

_POOL: GraderPool | None = None
_POOL_CREATE_LOCK = threading.Lock()


def _get_pool() -> GraderPool:
    """Return the process-wide pool, creating it on first use."""
    global _POOL
    with _POOL_CREATE_LOCK:
        if _POOL is None:
            _POOL = GraderPool(NUM_WORKERS, WORKER_MEMORY_LIMIT_BYTES, WORKER_STARTUP_TIMEOUT_S)
        return _POOL


def _forget_pool_after_fork() -> None:
    """In a forked child, drop the parent's pool (its connections and locks are not ours to use)."""
    global _POOL, _POOL_CREATE_LOCK
    _POOL = None
    _POOL_CREATE_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def shutdown_pool() -> None:
    """Kill the math-verify worker processes (they restart on the next call that needs them).

    Registered with ``atexit``; call it yourself to free the workers' memory early, or after
    changing ``NUM_WORKERS`` or ``WORKER_MEMORY_LIMIT_BYTES``.
    """
    global _POOL
    with _POOL_CREATE_LOCK:
        if _POOL is not None:
            _POOL.shutdown()
        _POOL = None


atexit.register(shutdown_pool)


# ----------------------------------------------------------------------------------------------
# math grading
# ----------------------------------------------------------------------------------------------


def _prepare(completion: str, gold: str) -> bool | tuple[str, str]:
    """Decide cheaply when possible (True/False); otherwise return the ``(gold, pred)`` task."""
    pred = extract_answer(completion)
    gold_n = _normalize(gold)
    if pred is None or not gold_n:
        return False
    pred_n = _normalize(pred)
    if not pred_n:
        return False
    # Fast paths, only for golds math-verify certainly parses (so "unparsable gold -> False"
    # holds): two integers are compared exactly (as math-verify does: "007" == "7", "-0" == "0");
    # otherwise an identical simple number or fraction is accepted.
    if _INT_RE.fullmatch(gold_n) and _INT_RE.fullmatch(pred_n):
        return int(gold_n) == int(pred_n)
    if pred_n == gold_n and _SIMPLE_GOLD_RE.fullmatch(gold_n):
        return True
    return gold_n, pred_n


def grade_math_batch(completions: Sequence[str], golds: Sequence[str], timeout_s: float = 5.0) -> list[bool]:
    """Grade many completions at once; element ``i`` is ``grade_math(completions[i], golds[i])``.

    Answers are extracted in the calling process; exact string matches of simple golds are
    decided there, and the rest are spread over the worker pool, each with its own
    ``timeout_s`` deadline counted from when a worker takes it. A task that overruns scores
    ``False`` and its worker is replaced; the other tasks carry on. Safe to call from any
    thread (concurrent callers take turns). This is the fast path for a training step.
    """
    if len(completions) != len(golds):
        raise ValueError(f"got {len(completions)} completions but {len(golds)} golds")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    prepared = [_prepare(c, g) for c, g in zip(completions, golds)]
    tasks = [p for p in prepared if isinstance(p, tuple)]
    graded = iter(_get_pool().run(tasks, timeout_s) if tasks else [])
    return [bool(next(graded)) if isinstance(p, tuple) else p for p in prepared]


def grade_math(completion: str, gold: str, timeout_s: float = 5.0) -> bool:
    """Return whether the completion's final answer is mathematically equivalent to ``gold``.

    The prediction is ``extract_answer(completion)`` (no marker means ``False``). Gold and
    prediction get wrapper and thousands-separator normalisation; two integers are then compared
    exactly, and an identical simple number or fraction is ``True``, all without sympy (the
    common GSM8K/AIME case costs microseconds). Otherwise math-verify parses
    the gold first (bare gold wrapped as ``$...$``), then the prediction, and calls
    ``verify(gold, pred)`` in a worker process. A gold that math-verify cannot turn into a sympy
    object scores ``False``, never ``True``. Returns within about ``timeout_s`` from any thread
    (plus about 1 s to start the pool on first use), and never raises for odd completions.
    """
    return grade_math_batch([completion], [gold], timeout_s)[0]


# ----------------------------------------------------------------------------------------------
# Reward functions
# ----------------------------------------------------------------------------------------------


@dataclass
class RewardOutput:
    """A reward and, separately, whether the answer was correct (DAPO filters on the latter)."""

    reward: float
    correct: bool


def math_reward(completion: str, gold: str) -> RewardOutput:
    """Binary math-equivalence reward: 1.0 if ``grade_math`` accepts the answer, else 0.0."""
    correct = grade_math(completion, gold)
    return RewardOutput(reward=float(correct), correct=correct)


def exact_reward(completion: str, gold: str) -> RewardOutput:
    """Binary exact-match reward for the tiny task: 1.0 if ``grade_boxed_exact``, else 0.0."""
    correct = grade_boxed_exact(completion, gold)
    return RewardOutput(reward=float(correct), correct=correct)


def code_reward(completion: str, gold: str) -> RewardOutput:
    """Binary code reward: 1.0 if the completion's program passes every hidden test in the sandbox, else 0.0."""
    return compute_rewards("code", [completion], [gold])[0]


def code_partial_reward(completion: str, gold: str) -> RewardOutput:
    """Partial-credit code reward: the fraction of hidden tests passed; correct only when all pass."""
    return compute_rewards("code-partial", [completion], [gold])[0]


def per_row_reward(completion: str, gold: str) -> RewardOutput:
    """A mixed dataset's reward: code tests golds get ``code``, every other gold ``math``."""
    return compute_rewards("per-row", [completion], [gold])[0]


REWARD_FNS: dict[str, Callable[[str, str], RewardOutput]] = {
    "math": math_reward,
    "exact": exact_reward,
    "code": code_reward,
    "code-partial": code_partial_reward,
    "per-row": per_row_reward,
}
_BATCHED = ("math", "code", "code-partial", "per-row")

_STATS_LOCK = threading.Lock()
_PENDING_STATS: list[dict[str, float]] = []


def drain_reward_stats() -> dict[str, float]:
    """The verifier-specific metrics of every batch scored since the last call (e.g. the code reward's fraction of
    tests passed and per-status shares), averaged over those batches; the run's step log merges them."""
    with _STATS_LOCK:
        batches = _PENDING_STATS[:]
        _PENDING_STATS.clear()
    keys = sorted({k for b in batches for k in b})
    return {k: sum(b.get(k, 0.0) for b in batches) / len(batches) for k in keys}


def get_reward_fn(name: str) -> Callable[[str, str], RewardOutput]:
    """Return the reward function registered as ``name``; ``ValueError`` lists valid names."""
    if name not in REWARD_FNS:
        raise ValueError(f"unknown reward function {name!r}; valid names: {sorted(REWARD_FNS)}")
    return REWARD_FNS[name]


def row_verifiers(name: str, golds: Sequence[str]) -> list[str]:
    """The verifier of each row under reward ``name``: itself, or for ``"per-row"`` (a dataset mixing domains,
    e.g. PRIME's eurus2-rl math+code) ``"code"`` where the gold is a code tests string and ``"math"`` elsewhere."""
    if name != "per-row":
        return [name] * len(golds)
    from common.code_reward import is_code_gold

    return ["code" if is_code_gold(g) else "math" for g in golds]


def compute_rewards(name: str, completions: Sequence[str], golds: Sequence[str]) -> list[RewardOutput]:
    """Score a whole batch with reward ``name``, dispatching per row (``row_verifiers``).

    ``"math"`` uses the batched grader pool; ``"code"`` / ``"code-partial"`` run every completion's program against
    its tests in the sandbox (``common/code_reward.py``), one run per completion, in parallel.
    """
    get_reward_fn(name)
    if len(completions) != len(golds):
        raise ValueError(f"{len(completions)} completions but {len(golds)} golds")
    if name not in _BATCHED:
        fn = REWARD_FNS[name]
        return [fn(c, g) for c, g in zip(completions, golds)]
    verifiers = row_verifiers(name, golds)
    outputs: list[RewardOutput | None] = [None] * len(golds)
    for verifier in sorted(set(verifiers)):
        rows = [i for i, v in enumerate(verifiers) if v == verifier]
        texts, row_golds = [completions[i] for i in rows], [golds[i] for i in rows]
        if verifier == "math":
            scored = [RewardOutput(float(c), c) for c in grade_math_batch(texts, row_golds)]
        else:
            from common.code_reward import code_stats, grade_code_batch

            grades = grade_code_batch(texts, row_golds)
            partial = verifier == "code-partial"
            scored = [RewardOutput(g.fraction if partial else float(g.correct), g.correct) for g in grades]
            with _STATS_LOCK:
                _PENDING_STATS.append(code_stats(grades))
        for i, out in zip(rows, scored):
            outputs[i] = out
    return outputs
