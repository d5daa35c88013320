"""Answer extraction, correctness checks and reward functions for math reasoning RL.

What lives here:

* ``extract_answer`` pulls the predicted final answer out of a completion: the last ``\\boxed{}``
  (or ``\\fbox{}``), else the last ``<answer>...</answer>``, else a final ``Answer: ...`` line.
* Gold helpers for GSM8K (``#### 42``) and MATH (last ``\\boxed{}`` of the solution).
* ``grade_math`` / ``grade_math_batch``: symbolic equivalence with math-verify, gold first.
* ``grade_boxed_exact``: the tiny synthetic task's exact-match checker (no sympy).
* ``format_reward_r1``: the R1-style ``<think>...</think><answer>...</answer>`` format check.
* ``RewardOutput`` and the reward registry (``"math"``, ``"exact"``). Every reward function
  returns the shaped reward and a separate correctness flag, because DAPO's dynamic sampling
  filters groups on correctness, not on the shaped reward.

Why worker processes: math-verify (0.9) bounds its sympy work with ``signal.alarm``, which
raises ``ValueError`` outside the main thread and cannot interrupt long C-level work (huge integer
powers). So math-verify runs with its own timeouts disabled in a few persistent worker processes,
and each task gets a deadline in the parent; a worker that misses it is killed (SIGKILL), and the
task scores ``False``. The workers are forked from a "zygote": one ``python -c`` subprocess that
imports math-verify once (about 1 s, on first use) and then forks a warmed worker in about 10 ms
whenever one is needed, so a killed worker is replaced at once. The parent talks to them over
Unix sockets (length-prefixed pickle) and never imports math-verify or sympy. This works from any
thread, never re-imports the training script (as multiprocessing's ``spawn`` would), and never
forks the trainer itself (which may hold CUDA or OpenMP state). POSIX only (``fork``,
``socket.send_fds``).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import pickle
import re
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

NUM_WORKERS: int = max(2, min(4, os.cpu_count() or 1))
"""How many math-verify worker processes to run; read when the pool is (re)created."""
WORKER_STARTUP_TIMEOUT_S: float = 60.0
"""A zygote that has not imported math-verify within this many seconds is an error."""
WORKER_MEMORY_LIMIT_BYTES: int = 4 * 1024**3
"""Address-space cap for each worker, so a runaway sympy expression raises MemoryError there
instead of drawing the OOM killer onto the trainer."""

# ----------------------------------------------------------------------------------------------
# Answer extraction
# ----------------------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BRACE_TOKEN_RE = re.compile(r"\\.|[{}]", re.DOTALL)
_BARE_BOX_ARG_RE = re.compile(r"[ \t]*([^\s$]+)")
_ANSWER_LINE_RE = re.compile(r"(?im)^[^\n]*?\banswer\**[ \t]*:\**([^\n]*)")  # linear: no nested *
_INLINE_MATH_RE = re.compile(r"(?<!\\)\$((?:[^$\\]|\\.)+)\$")  # $...$, honouring \$
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:(?:,|\{,\}|\\,| )\d{3})+(?:\.\d+)?")
_HAS_DELIMITERS_RE = re.compile(r"(?<!\\)\$|\\boxed|\\\(|\\\[")  # unescaped $, \boxed, \(, \[
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
    """Strip whitespace, enclosing ``$``/``\\(\\)``/``\\[\\]`` and trailing full stops.

    Works on indices, so it stays linear even on ``"$" * 100_000``.
    """
    i, j = 0, len(s)
    while True:
        while i < j and s[i].isspace():
            i += 1
        while j > i and s[j - 1].isspace():
            j -= 1
        for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if j - i >= len(left) + len(right) and s.startswith(left, i) and s.endswith(right, i, j):
                i, j = i + len(left), j - len(right)
                break
        else:
            if j - i >= 2 and s[j - 1] == "." and s[j - 2] != ".":  # "5." but not "\\ldots" or "..."
                j -= 1
            else:
                return s[i:j]


def extract_answer(completion: str) -> str | None:
    """Return the predicted final answer text of ``completion``, or ``None`` if it has none.

    Priority: the inner text of the last ``\\boxed{...}``/``\\fbox{...}`` (also ``\\boxed 5``);
    else the inner text of the last complete ``<answer>...</answer>``; else the text after the
    last ``Answer:`` on a line (DAPO's "Answer: $Answer" convention; if that text holds ``$...$``
    spans, the last span's content is used, so Minerva's "The final answer is $5$." works).
    The result has surrounding whitespace, ``$`` delimiters and a trailing full stop removed.
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
    spans = _INLINE_MATH_RE.findall(text)
    return _strip_math_wrappers(spans[-1] if spans else text)


def extract_gsm8k_gold(answer_field: str) -> str:
    """Return the GSM8K gold answer: the text after the last ``####``, stripped, commas removed.

    GSM8K's ``answer`` field is a worked solution that ends in ``#### 1,000``; the result for
    that is ``"1000"``. Raises ``ValueError`` (quoting the end of the field) when there is no
    ``####`` marker or nothing after it, because a silently empty gold would score every
    completion as wrong (or, with a careless grader, as right).
    """
    if "####" not in answer_field:
        raise ValueError(
            f"GSM8K answer field has no '####' marker (expected '... #### <number>'): "
            f"...{answer_field[-120:]!r}"
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
        raise ValueError(
            f"MATH solution has no complete \\boxed{{...}} answer: ...{solution[-120:]!r}"
        )
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
# math-verify worker pool
# ----------------------------------------------------------------------------------------------

_FRAME = struct.Struct(">I")  # length prefix of a pickled message on a worker socket
_CMD = struct.Struct(">ci")  # zygote command: b"F" (fork; worker socket attached) or b"K" pid
_PID = struct.Struct(">i")
_ZYGOTE_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_rl_verifiers_zygote', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = mod\n"
    "spec.loader.exec_module(mod)\n"
    "mod._zygote_main(int(sys.argv[2]))\n"
)


def _worker_grade(gold: str, pred: str) -> bool:
    """In a worker: parse gold, then prediction, with math-verify; return ``verify(gold, pred)``."""
    from math_verify import parse, verify

    def parse_text(s: str) -> list:
        wrapped = s if _HAS_DELIMITERS_RE.search(s) else f"${s}$"
        return parse(wrapped, parsing_timeout=None) or parse(s, parsing_timeout=None)

    gold_parsed = parse_text(gold)
    # math-verify falls back to the raw string when LaTeX parsing fails, and two identical raw
    # strings then "verify". A gold without any sympy object is unparsable: never reward it.
    if not any(not isinstance(x, str) for x in gold_parsed):
        return False
    pred_parsed = parse_text(pred)
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes from ``sock``; raise ``EOFError`` if the peer closed it first."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("peer closed the socket")
        data += chunk
    return data


def _serve(sock: socket.socket) -> None:
    """Worker loop (in a forked child of the zygote): answer ``(task_id, gold, pred)`` messages."""
    while True:
        try:
            (n,) = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
            task_id, gold, pred = pickle.loads(_recv_exact(sock, n))
        except EOFError:
            return  # the parent is gone or dropped us
        try:
            ok = _worker_grade(gold, pred)
        except Exception:  # includes MemoryError and RecursionError: a failed check is "wrong"
            ok = False
        data = pickle.dumps((task_id, ok))
        sock.sendall(_FRAME.pack(len(data)) + data)


def _zygote_main(fd: int) -> None:
    """Entry point of the zygote subprocess: import math-verify once, then fork workers on demand.

    Commands arrive on the control socket ``fd``: ``F`` carries a socket for a new worker (the
    zygote forks, the child serves on it, the zygote replies with the child's pid) and ``K pid``
    kills one of its children. When the parent closes the control socket (or dies), the zygote
    kills every worker and exits; on Linux the workers also die if the zygote is killed. Forking
    a warmed, single-threaded zygote takes milliseconds, so a worker killed on a deadline is
    replaced at once instead of re-importing sympy.
    """
    import signal
    import traceback

    prctl = None
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            prctl = ctypes.CDLL(None).prctl
        except (ImportError, OSError, AttributeError):
            pass
    zygote_pid = os.getpid()
    ctrl = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    try:
        import resource

        limit = WORKER_MEMORY_LIMIT_BYTES
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):
        pass
    if hasattr(sys, "set_int_max_str_digits"):  # Python >= 3.11 refuses ints over 4300 digits
        sys.set_int_max_str_digits(0)  # the deadline, not this limit, bounds the work here
    logging.basicConfig(level=logging.ERROR)
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    _worker_grade("1", "1")  # import sympy/antlr and warm the caches before saying ready
    ctrl.sendall(b"R")
    children: set[int] = set()
    try:
        while True:
            msg, fds, _, _ = socket.recv_fds(ctrl, _CMD.size, 1)
            if not msg:
                return
            msg += _recv_exact(ctrl, _CMD.size - len(msg)) if len(msg) < _CMD.size else b""
            for pid in list(children):  # reap workers that exited on their own
                if os.waitpid(pid, os.WNOHANG)[0]:
                    children.discard(pid)
            cmd, arg = _CMD.unpack(msg)
            if cmd == b"F" and fds:
                pid = os.fork()
                if pid == 0:
                    code = 0
                    try:
                        if prctl is not None:
                            prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the zygote
                        if os.getppid() != zygote_pid:
                            os._exit(0)
                        ctrl.close()
                        _serve(socket.socket(fileno=fds[0]))
                    except BaseException:
                        traceback.print_exc()
                        code = 1
                    finally:
                        os._exit(code)
                os.close(fds[0])
                children.add(pid)
                ctrl.sendall(_PID.pack(pid))
            elif cmd == b"K" and arg in children:  # only our unreaped children: no pid reuse
                os.kill(arg, signal.SIGKILL)
                os.waitpid(arg, 0)
                children.discard(arg)
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


class _Zygote:
    """The parent's handle on the zygote subprocess (see ``_zygote_main``)."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE_BOOT, os.path.abspath(__file__), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # library prints; tracebacks still reach stderr
        )
        theirs.close()
        self.sock = mine
        self.sock.settimeout(WORKER_STARTUP_TIMEOUT_S)
        try:
            ready = self.sock.recv(1)
        except TimeoutError:
            self.close()
            raise RuntimeError(
                f"math-verify zygote did not start within {WORKER_STARTUP_TIMEOUT_S:.0f} s"
            ) from None
        if ready != b"R":
            code = self.proc.wait()
            self.close()
            raise RuntimeError(
                f"math-verify zygote exited during start-up (exit code {code}); is math-verify "
                f"installed for {sys.executable}? See its stderr above."
            )
        self.sock.settimeout(30.0)  # a fork reply should take milliseconds

    def fork_worker(self) -> _Worker:
        """Fork a new worker; raises ``OSError``/``EOFError`` if the zygote is gone."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            socket.send_fds(self.sock, [_CMD.pack(b"F", 0)], [theirs.fileno()])
        finally:
            theirs.close()
        (pid,) = _PID.unpack(_recv_exact(self.sock, _PID.size))
        return _Worker(mine, pid)

    def kill_worker(self, worker: _Worker) -> None:
        """SIGKILL ``worker`` (via the zygote, its real parent) and close our end of its socket."""
        worker.sock.close()
        try:
            self.sock.sendall(_CMD.pack(b"K", worker.pid))
        except OSError:
            pass  # zygote gone: its workers were killed with it

    def close(self) -> None:
        """Close the control socket (the zygote then kills its workers and exits) and reap it."""
        self.sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Worker:
    """The parent's view of one forked worker: its socket, pid, read buffer and current task."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.buf = b""
        self.task: tuple[int, int, float] | None = None  # (task_id, index in batch, deadline)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.sock.sendall(_FRAME.pack(len(data)) + data)

    def read_frames(self) -> list[Any] | None:
        """Read what is available; return complete messages, or None on EOF (worker died)."""
        try:
            chunk = self.sock.recv(1 << 16)
        except OSError:
            return None
        if not chunk:
            return None
        self.buf += chunk
        frames = []
        while len(self.buf) >= _FRAME.size:
            (n,) = _FRAME.unpack_from(self.buf)
            if len(self.buf) < _FRAME.size + n:
                break
            frames.append(pickle.loads(self.buf[_FRAME.size : _FRAME.size + n]))
            self.buf = self.buf[_FRAME.size + n :]
        return frames


class _Pool:
    """A zygote plus ``num_workers`` forked workers with per-task deadlines; one batch at a time."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.zygote: _Zygote | None = None
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()
        self.task_ids = itertools.count()

    def _new_worker(self) -> _Worker:
        """Fork a worker, (re)starting the zygote if it is missing or has died."""
        for attempt in range(2):
            if self.zygote is not None and self.zygote.proc.poll() is not None:
                self.zygote.close()  # it died; on Linux its workers died with it
                self.zygote = None
            if self.zygote is None:
                self.zygote = _Zygote()
            try:
                return self.zygote.fork_worker()
            except (OSError, EOFError):
                time.sleep(0.1)  # let a dying zygote become visible to poll()
                if attempt == 1 or self.zygote.proc.poll() is None:
                    raise  # the zygote is alive, so this is a real system error
        raise AssertionError("unreachable")

    def _replace(self, worker: _Worker, alive: bool = True) -> None:
        """Kill ``worker`` (unless it already died) and add a fresh fork in its place."""
        if alive and self.zygote is not None:
            self.zygote.kill_worker(worker)
        else:
            worker.sock.close()
        self.workers.remove(worker)
        self.workers.append(self._new_worker())

    def shutdown(self) -> None:
        """Kill every worker and the zygote."""
        for w in self.workers:
            w.sock.close()
        self.workers = []
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None

    def run(self, tasks: Sequence[tuple[str, str]], timeout_s: float) -> list[bool]:
        """Grade ``(gold, pred)`` pairs; a task that runs past ``timeout_s`` scores ``False``."""
        with self.lock:
            while len(self.workers) < self.num_workers:
                self.workers.append(self._new_worker())
            try:
                return self._run_locked(tasks, timeout_s)
            except BaseException:
                # Interrupted (e.g. KeyboardInterrupt): busy workers hold stale tasks; drop them
                # (the next call forks replacements).
                for w in [w for w in self.workers if w.task is not None]:
                    if self.zygote is not None:
                        self.zygote.kill_worker(w)
                    self.workers.remove(w)
                raise

    def _run_locked(self, tasks: Sequence[tuple[str, str]], timeout_s: float) -> list[bool]:
        results: list[bool] = [False] * len(tasks)
        todo = list(range(len(tasks)))[::-1]  # a stack; pop() takes tasks in order
        busy = 0
        while todo or busy:
            for w in list(self.workers):
                if todo and w.task is None:
                    i = todo.pop()
                    task_id = next(self.task_ids)
                    try:
                        w.send((task_id, *tasks[i]))
                    except OSError:  # died while idle: replace it and retry the task
                        todo.append(i)
                        self._replace(w, alive=False)
                        continue
                    w.task = (task_id, i, time.monotonic() + timeout_s)
                    busy += 1
            if busy == 0:
                continue  # every send failed; the replacements take the tasks next round
            deadline = min(w.task[2] for w in self.workers if w.task is not None)
            with selectors.DefaultSelector() as sel:  # not select.select: fds may exceed 1024
                for w in self.workers:
                    if w.task is not None:
                        sel.register(w, selectors.EVENT_READ)
                events = sel.select(max(0.0, deadline - time.monotonic()))
                ready = [key.fileobj for key, _ in events]
            for w in ready:
                assert isinstance(w, _Worker) and w.task is not None
                frames = w.read_frames()
                if frames is None:  # EOF: the worker crashed; its task scores False
                    logger.warning("math-verify worker crashed; scoring its task as wrong")
                    busy -= 1
                    self._replace(w, alive=False)
                    continue
                for task_id, ok in frames:
                    if w.task is not None and task_id == w.task[0]:
                        results[w.task[1]] = bool(ok)
                        w.task = None
                        busy -= 1
            now = time.monotonic()
            for w in list(self.workers):
                if w.task is not None and now >= w.task[2]:  # overran: scores False
                    busy -= 1
                    self._replace(w)
        return results


_POOL: _Pool | None = None
_POOL_CREATE_LOCK = threading.Lock()


def _get_pool() -> _Pool:
    """Return the process-wide pool, creating it on first use."""
    global _POOL
    with _POOL_CREATE_LOCK:
        if _POOL is None:
            _POOL = _Pool(NUM_WORKERS)
        return _POOL


def _forget_pool_after_fork() -> None:
    """In a forked child, drop the parent's pool (its sockets and locks are not ours to use)."""
    global _POOL, _POOL_CREATE_LOCK
    _POOL = None
    _POOL_CREATE_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def shutdown_pool() -> None:
    """Kill the math-verify worker processes (they restart on the next call that needs them).

    Registered with ``atexit``; call it yourself to free the workers' memory early, or after
    changing ``NUM_WORKERS``.
    """
    global _POOL
    with _POOL_CREATE_LOCK:
        if _POOL is not None:
            with _POOL.lock:
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


def grade_math_batch(
    completions: Sequence[str], golds: Sequence[str], timeout_s: float = 5.0
) -> list[bool]:
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
    return [next(graded) if isinstance(p, tuple) else p for p in prepared]


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


REWARD_FNS: dict[str, Callable[[str, str], RewardOutput]] = {
    "math": math_reward,
    "exact": exact_reward,
}


def get_reward_fn(name: str) -> Callable[[str, str], RewardOutput]:
    """Return the reward function registered as ``name``; ``ValueError`` lists valid names."""
    if name not in REWARD_FNS:
        raise ValueError(f"unknown reward function {name!r}; valid names: {sorted(REWARD_FNS)}")
    return REWARD_FNS[name]


def compute_rewards(
    name: str, completions: Sequence[str], golds: Sequence[str]
) -> list[RewardOutput]:
    """Score a whole batch with reward ``name``; for ``"math"`` this uses the batched pool path."""
    fn = get_reward_fn(name)
    if fn is math_reward:
        return [RewardOutput(float(c), c) for c in grade_math_batch(completions, golds)]
    return [fn(c, g) for c, g in zip(completions, golds)]
