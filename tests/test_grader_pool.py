"""The math-verify worker pool's guarantees (common/math_grader.py, through common/verifiers.py where it can).

Each test fails if its guarantee is dropped: bounded time from any thread, crash and memory isolation, workers that
never import the training script and die with it, workers that outlive the thread that started them, deadlines that
exclude start-up, and a pool that a forked child does not share.
"""

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from common import math_grader as G
from common import verifiers as V

REPO = Path(__file__).resolve().parent.parent
POWER_TOWER = "\\boxed{9^{9^{9^{9^{9}}}}}"  # C-level integer power: uninterruptible, runs for hours
HALF = ("\\boxed{\\frac{2}{4}}", "0.5")  # needs math-verify (no fast path)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, relies on prctl")


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _worker_pids() -> list[int]:
    return [w.proc.pid for w in V._POOL.workers]


def _busy_worker_pid(pool: G.GraderPool, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = [w.proc.pid for w in list(pool.workers) if w.index is not None]
        if busy:
            return busy[0]
        time.sleep(0.02)
    raise AssertionError("no worker took the task")


def _hook_pool(tmp_path: Path, num_workers: int = 1, memory_limit: int = 4 * 1024**3, startup_delay_s: float = 0.0):
    """A pool whose workers run ``serve`` with test commands: exit, alloc, pid; anything else is graded."""
    script = tmp_path / "hook_worker.py"
    script.write_text(
        textwrap.dedent(f"""
            import os, sys, time
            sys.path.insert(0, {str(REPO)!r})
            from common import math_grader

            def handle(cmd, arg):
                if cmd == "exit":
                    os._exit(int(arg))
                if cmd == "alloc":  # bytes(n) is calloc: address space, but no resident memory
                    return len(bytes(int(arg))) == int(arg)
                if cmd == "pid":
                    return os.getpid()
                return math_grader.verify_answer(cmd, arg)

            time.sleep({startup_delay_s})
            math_grader.serve(handle)
        """)
    )
    return G.GraderPool(num_workers, memory_limit, 60.0, worker_argv=[sys.executable, str(script)])


# ----------------------------------------------------------------------------------------------
# 1. bounded time from any thread
# ----------------------------------------------------------------------------------------------


def test_pathological_answer_off_main_thread_is_bounded():
    results = {}

    def run(key, completion, gold):
        start = time.monotonic()
        results[key] = (V.grade_math(completion, gold, timeout_s=1.5), time.monotonic() - start)

    threads = [
        threading.Thread(target=run, args=("tower", POWER_TOWER, "1"), daemon=True),
        threading.Thread(target=run, args=("half", *HALF), daemon=True),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "a grading thread hung"
    assert results["tower"][0] is False and results["half"][0] is True
    assert results["tower"][1] < 1.5 + 2.0


def test_deadline_excludes_worker_start_up(tmp_path):
    pool = _hook_pool(tmp_path, startup_delay_s=1.5)  # the worker takes > 1.5 s to say ready
    try:
        assert pool.run([("\\frac{1}{2}", "0.5"), ("\\frac{1}{2}", "0.6")], timeout_s=0.5) == [True, False]
    finally:
        pool.shutdown()


def test_workers_that_cannot_start_raise_instead_of_hanging():
    pool = G.GraderPool(2, 4 * 1024**3, 60.0, worker_argv=[sys.executable, "-c", "import sys; sys.exit(3)"])
    raised = []

    def run():
        try:
            pool.run([("1", "1")], timeout_s=1.0)
        except RuntimeError as exc:
            raised.append(str(exc))

    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive(), "run() kept restarting workers that cannot start"
    pool.shutdown()
    assert len(raised) == 1 and "start-up" in raised[0]


# ----------------------------------------------------------------------------------------------
# 2. crashes and memory stay in the worker
# ----------------------------------------------------------------------------------------------


def test_worker_sigkilled_mid_task_scores_false_and_pool_recovers():
    assert V.grade_math(*HALF) is True  # pool up
    got = {}
    grader = threading.Thread(
        target=lambda: got.update(r=V.grade_math_batch([POWER_TOWER], ["1"], timeout_s=60)), daemon=True
    )
    grader.start()
    victim = _busy_worker_pid(V._POOL)
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)  # like the OOM killer
    grader.join(timeout=20)
    assert got == {"r": [False]}
    assert time.monotonic() - killed_at < 5.0, "the crash was noticed only at the 60 s deadline"
    assert V.grade_math_batch([HALF[0], "\\boxed{3}", "\\boxed{1/3}"], ["1/2", "3", "0.3"]) == [True, True, False]
    assert victim not in _worker_pids()


def test_worker_exiting_mid_task_scores_false_and_pool_recovers(tmp_path):
    pool = _hook_pool(tmp_path, num_workers=2)
    try:
        start = time.monotonic()
        got = pool.run([("exit", "3"), ("\\frac{1}{2}", "0.5"), ("exit", "0"), ("2", "2")], timeout_s=30)
        assert got == [False, True, False, True]
        assert time.monotonic() - start < 10.0
        assert pool.run([("\\frac{1}{2}", "0.5")] * 3, timeout_s=30) == [True] * 3
        pool.shutdown()  # kills and reaps every worker; the next run starts new ones
        assert pool.workers == [] and pool.run([("2", "2")], timeout_s=30) == [True]
    finally:
        pool.shutdown()


def test_memory_cap_raises_memory_error_in_the_worker(tmp_path):
    parent_limit = resource.getrlimit(resource.RLIMIT_AS)
    pool = _hook_pool(tmp_path, memory_limit=512 * 1024**2)
    try:
        (pid,) = pool.run([("pid", "")], timeout_s=10)
        assert pool.run([("alloc", str(64 * 1024**2))], timeout_s=10) == [True]  # under the cap: fine
        assert pool.run([("alloc", str(1024**3))], timeout_s=10) == [False]  # over it: MemoryError -> False
        assert pool.run([("pid", "")], timeout_s=10) == [pid]  # the same worker: it raised, nobody killed it
    finally:
        pool.shutdown()
    assert resource.getrlimit(resource.RLIMIT_AS) == parent_limit


def test_verifiers_pool_applies_its_memory_limit(monkeypatch):
    monkeypatch.setattr(V, "WORKER_MEMORY_LIMIT_BYTES", 3 * 1024**3)
    V.shutdown_pool()
    try:
        assert V.grade_math(*HALF) is True
        for pid in _worker_pids():
            limits = Path(f"/proc/{pid}/limits").read_text()
            line = next(line for line in limits.splitlines() if line.startswith("Max address space"))
            assert line.split()[3:5] == [str(3 * 1024**3)] * 2
    finally:
        V.shutdown_pool()


# ----------------------------------------------------------------------------------------------
# 3. workers never import the training script; the trainer is never forked; workers die with it
# ----------------------------------------------------------------------------------------------

TRAINING_SCRIPT = r"""
import json, os, sys, threading, time
sys.path.insert(0, "@REPO@")
with open("@MARKER@", "a") as f:  # runs on every import of this file, whatever the module is called
    f.write(f"{os.getpid()}\n")
import torch  # noqa: F401  a heavy import that a worker must not repeat
from common import verifiers as V

if __name__ == "__main__":
    if sys.argv[1] == "imports":
        assert V.grade_math("\\boxed{\\frac{2}{4}}", "0.5") is True
        pids = [w.proc.pid for w in V._POOL.workers]
        maps = {pid: open(f"/proc/{pid}/maps").read() for pid in [os.getpid(), *pids]}
        heavy = sorted({m.split(".")[0] for m in sys.modules} & {"math_verify", "sympy", "latex2sympy2_extended"})
        print(json.dumps({"parent": os.getpid(), "workers": pids, "parent_imports": heavy,
                          "libtorch": [pid for pid, text in maps.items() if "libtorch" in text]}))
    else:  # "orphan": leave a worker stuck in C code, then wait to be killed
        tower = "\\boxed{9^{9^{9^{9^{9}}}}}"
        threading.Thread(target=V.grade_math, args=(tower, "1", 600.0), daemon=True).start()
        for _ in range(6000):  # up to 2 min for the pool to start and take the task
            if V._POOL is not None and any(w.index is not None for w in list(V._POOL.workers)):
                break
            time.sleep(0.02)
        print(json.dumps([w.proc.pid for w in V._POOL.workers]), flush=True)
        time.sleep(600)
"""


def _training_script(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "imported_by.txt"
    script = tmp_path / "train_canary.py"
    script.write_text(TRAINING_SCRIPT.replace("@REPO@", str(REPO)).replace("@MARKER@", str(marker)))
    return script, marker


def test_workers_never_import_the_training_script(tmp_path):
    script, marker = _training_script(tmp_path)
    out = subprocess.run([sys.executable, str(script), "imports"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report["workers"]) == V.NUM_WORKERS
    assert marker.read_text().split() == [str(report["parent"])]  # the script ran once, in the trainer only
    assert report["libtorch"] == [report["parent"]]  # torch is mapped in the trainer, in no worker
    assert report["parent_imports"] == []  # and the trainer never imports math-verify or sympy


def test_workers_die_with_the_trainer_even_in_c_code(tmp_path):
    script, _ = _training_script(tmp_path)
    trainer = subprocess.Popen([sys.executable, str(script), "orphan"], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = json.loads(trainer.stdout.readline())
        assert pids and all(_alive(pid) for pid in pids)
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 5.0
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids), "a worker outlived the trainer"
    finally:
        trainer.kill()
        trainer.wait()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_workers_outlive_the_thread_that_started_them():
    V.shutdown_pool()
    starter = threading.Thread(target=V.grade_math, args=HALF)
    starter.start()
    starter.join(timeout=60)
    pids = _worker_pids()
    time.sleep(0.5)
    assert all(_alive(pid) for pid in pids), "the workers died with the thread that started them"
    assert V.grade_math(*HALF) is True
    assert _worker_pids() == pids


def test_forked_child_does_not_reuse_the_parents_pool():
    assert V.grade_math(*HALF) is True
    parent_pids = _worker_pids()
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            os.close(read_end)
            result = {"ok": V.grade_math(*HALF), "pids": _worker_pids()}
            V.shutdown_pool()
            os.write(write_end, json.dumps(result).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        report = json.loads(f.read() or "{}")
    os.waitpid(child, 0)
    assert report.get("ok") is True
    assert not set(report["pids"]) & set(parent_pids), "the child talked to the parent's workers"
    assert V.grade_math(*HALF) is True and _worker_pids() == parent_pids
