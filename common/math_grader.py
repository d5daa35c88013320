"""math-verify in worker processes, with a deadline per task that the parent enforces.

``GraderPool(num_workers, memory_limit_bytes, startup_timeout_s).run(tasks, timeout_s)`` hands each task (by default
a ``(gold, pred)`` pair, answered with ``verify_answer``) to an idle worker and returns the answers in task order.
Contract:

* Bounded time, from any thread: a task has ``timeout_s`` from the moment a worker takes it. A worker that misses its
  deadline is killed (SIGKILL) and replaced, and that task's answer is ``False``. Killing a process is the only bound
  that holds: math-verify's own timeouts use ``signal.alarm``, which raises ``ValueError`` off the main thread and
  cannot interrupt C-level work such as a huge integer power, so they are switched off here.
* A worker that dies mid-task makes that task ``False`` and is replaced; the pool keeps working. A task that raises
  in the worker is ``False``. Each worker caps its address space at ``memory_limit_bytes`` (``RLIMIT_AS``), so a
  runaway expression raises ``MemoryError`` there, not in the caller and not through the OOM killer.
* A worker starts as ``python -P <this file>`` (``subprocess.Popen``), so its ``__main__`` is this module (standard
  library imports only, then math-verify), never the caller's training script, and the caller is never forked
  without an exec. multiprocessing's spawn and forkserver children re-import the parent's ``__main__``; its fork
  children inherit the trainer's CUDA and OpenMP state.
* Workers start in the background and get tasks only once they report ready (math-verify imported, about 0.5 s), so
  no deadline includes start-up. Three start-ups in a row that fail (exit, or no report within
  ``startup_timeout_s``) raise ``RuntimeError``: math-verify is probably not installed for ``sys.executable``.
* On Linux a worker is killed when the process that started it dies, even while stuck in C code.

Messages are pickled over a socketpair (``multiprocessing.Pipe``); the parent watches all workers at once with
``multiprocessing.connection.wait``. One ``run`` at a time per pool; concurrent callers take turns. POSIX only.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

logger = logging.getLogger(__name__)

_HAS_DELIMITERS_RE = re.compile(r"(?<!\\)\$|\\boxed|\\\(|\\\[")  # unescaped $, \boxed, \(, \[
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_MAX_FAILED_STARTS = 3


def verify_answer(gold: str, pred: str) -> bool:
    """Parse ``gold``, then ``pred``, with math-verify (no timeouts) and return ``verify(gold, pred)``.

    A string without math delimiters is parsed as ``$...$`` first. A gold that yields no sympy object is ``False``
    whatever the prediction: math-verify falls back to the raw string, and two identical raw strings would verify.
    """
    from math_verify import parse, verify

    def parse_text(s: str) -> list:
        wrapped = s if _HAS_DELIMITERS_RE.search(s) else f"${s}$"
        return parse(wrapped, parsing_timeout=None) or parse(s, parsing_timeout=None)

    gold_parsed = parse_text(gold)
    if all(isinstance(x, str) for x in gold_parsed):
        return False
    pred_parsed = parse_text(pred)
    return bool(pred_parsed) and bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def serve(handle: Callable[..., Any] = verify_answer) -> None:
    """Worker main loop; ``sys.argv[1:4]`` is ``fd parent_pid memory_limit_bytes`` (see ``_Worker``).

    Sets the worker up, imports math-verify, sends ``"ready"`` on the connection ``fd``, then answers each task
    ``t`` with ``handle(*t)`` (``False`` if it raises) until the parent closes the connection.
    """
    fd, parent_pid, memory_limit = (int(a) for a in sys.argv[1:4])
    if sys.platform.startswith("linux"):
        # PR_SET_PDEATHSIG: the kernel kills this worker when its parent dies. Nothing inside the worker could do
        # it: a watchdog thread needs the GIL, which a huge integer power holds for as long as it runs.
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal is the parent's business
    import resource

    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    except ValueError:  # above an existing hard limit, which then caps the worker instead
        pass
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)  # the deadline, not this limit, bounds the work
    logging.basicConfig(level=logging.ERROR)
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    conn = Connection(fd)
    verify_answer("1", "1")  # import sympy and the LaTeX parser, warm their caches
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        try:
            answer = handle(*task)
        except Exception:  # MemoryError, RecursionError, parser bugs: a check that fails is "wrong"
            answer = False
        conn.send(answer)


def _spawner(requests: queue.SimpleQueue) -> None:
    """Run worker constructors sent by a pool until ``None`` arrives.

    All workers of a pool start from this one thread, which lives as long as the pool: PR_SET_PDEATHSIG fires when
    the *thread* that started a process exits, so a worker started from a caller's short-lived thread would die
    with that thread.
    """
    while (job := requests.get()) is not None:
        make, reply = job
        try:
            reply.put(make())
        except BaseException as exc:
            reply.put(exc)


def _exit_code(proc: subprocess.Popen) -> int | None:
    """The exit code of a process whose connection has just closed (it is exiting), or ``None`` after 1 s."""
    try:
        return proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return None


class _Worker:
    """The parent's handle on one worker process: its ``Popen``, its connection, its state and its deadline."""

    def __init__(self, argv: Sequence[str], memory_limit: int, startup_timeout_s: float) -> None:
        self.conn, theirs = Pipe()
        try:
            args = [*argv, str(theirs.fileno()), str(os.getpid()), str(memory_limit)]
            kwargs: dict[str, Any] = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)  # stderr kept
            self.proc = subprocess.Popen(args, pass_fds=(theirs.fileno(),), **kwargs)
        except BaseException:
            self.conn.close()
            raise
        finally:
            theirs.close()
        self.ready = False
        self.index: int | None = None  # the task it holds
        self.deadline = time.monotonic() + startup_timeout_s  # for saying ready, then for its task


class GraderPool:
    """``num_workers`` worker processes with per-task deadlines (see the module docstring).

    ``worker_argv`` is the command that starts a worker (default: this file under ``sys.executable``); the worker
    receives three more arguments and must call ``serve``.
    """

    def __init__(
        self,
        num_workers: int,
        memory_limit_bytes: int,
        startup_timeout_s: float,
        worker_argv: Sequence[str] | None = None,
    ) -> None:
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []  # keep common/ off the worker's sys.path
        self.argv = list(worker_argv or [sys.executable, *safe_path, os.path.abspath(__file__)])
        self.num_workers = num_workers
        self.memory_limit = memory_limit_bytes
        self.startup_timeout_s = startup_timeout_s
        self.workers: list[_Worker] = []
        self.dying: list[subprocess.Popen] = []  # killed, not yet reaped
        self.failed_starts = 0
        self.lock = threading.Lock()
        self.requests: queue.SimpleQueue | None = None  # the spawner thread's queue, while it runs

    def _start_worker(self) -> None:
        if self.requests is None:
            self.requests = queue.SimpleQueue()
            threading.Thread(target=_spawner, args=(self.requests,), name="math-grader-spawner", daemon=True).start()
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self.requests.put((lambda: _Worker(self.argv, self.memory_limit, self.startup_timeout_s), reply))
        worker = reply.get()
        if isinstance(worker, BaseException):
            raise worker
        self.workers.append(worker)

    def _retire(self, worker: _Worker, replace: bool = True) -> None:
        """Kill ``worker`` (reaped later, so this never blocks) and, by default, start a replacement."""
        worker.conn.close()
        worker.proc.kill()  # a no-op once reaped, so never another process's pid
        self.dying.append(worker.proc)
        self.workers.remove(worker)
        if replace:
            self._start_worker()

    def _failed_start(self, worker: _Worker, why: str) -> None:
        self._retire(worker, replace=False)
        self.failed_starts += 1
        if self.failed_starts >= _MAX_FAILED_STARTS:
            raise RuntimeError(
                f"math-verify worker {why} ({self.failed_starts} start-ups in a row); is math-verify installed "
                f"for {self.argv[0]}? See the worker's stderr above."
            )
        logger.warning("math-verify worker %s; starting another", why)
        self._start_worker()

    def shutdown(self) -> None:
        """Kill every worker, reap them, and stop the spawner thread; the next ``run`` starts afresh."""
        with self.lock:
            for w in list(self.workers):
                self._retire(w, replace=False)
            for proc in self.dying:
                proc.wait()
            self.dying = []
            if self.requests is not None:
                self.requests.put(None)
                self.requests = None

    def run(self, tasks: Sequence[tuple], timeout_s: float) -> list[Any]:
        """Return each task's answer in order; ``False`` for a task whose worker missed its deadline or died."""
        with self.lock:
            self.dying = [p for p in self.dying if p.poll() is None]
            while len(self.workers) < self.num_workers:
                self._start_worker()
            try:
                return self._run_locked(tasks, timeout_s)
            except BaseException:  # e.g. KeyboardInterrupt: busy workers hold tasks nobody will collect
                for w in [w for w in self.workers if w.index is not None]:
                    self._retire(w, replace=False)
                raise

    def _run_locked(self, tasks: Sequence[tuple], timeout_s: float) -> list[Any]:
        answers: list[Any] = [False] * len(tasks)
        todo = collections.deque(range(len(tasks)))
        while True:
            for w in list(self.workers):
                if todo and w.ready and w.index is None:
                    try:
                        w.conn.send(tasks[todo[0]])
                    except OSError:  # died while idle; the task waits for the next worker
                        self._retire(w)
                        continue
                    w.index, w.deadline = todo.popleft(), time.monotonic() + timeout_s
            if not todo and all(w.index is None for w in self.workers):
                return answers
            watched = {w.conn: w for w in self.workers if w.index is not None or not w.ready}
            timeout = min(w.deadline for w in watched.values()) - time.monotonic()
            for conn in wait(list(watched), max(0.0, timeout)):
                w = watched[conn]
                try:
                    # A worker writes each (small) message with one send, so a readable connection holds all of it.
                    message = conn.recv()
                except (EOFError, OSError):
                    if not w.ready:
                        self._failed_start(w, f"exited during start-up (exit code {_exit_code(w.proc)})")
                    else:
                        logger.warning(
                            "math-verify worker died (exit code %s); its task scores False", _exit_code(w.proc)
                        )
                        self._retire(w)
                    continue
                if w.ready:
                    answers[w.index], w.index = message, None
                else:
                    w.ready, self.failed_starts = True, 0
                w.deadline = math.inf
            now = time.monotonic()
            for w in list(self.workers):
                if now >= w.deadline:
                    if w.ready:
                        self._retire(w)  # missed its deadline: its task stays False
                    else:
                        self._failed_start(w, f"did not start within {self.startup_timeout_s:.0f} s")


if __name__ == "__main__":
    serve()
