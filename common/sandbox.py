"""Run untrusted, model-written Python in a sandbox: ``run_python`` and the grading jobs behind the code reward.

Every completion a code reward grades is a program written by a model under optimisation pressure, which will use any
hole that raises its reward. It never runs in the trainer's process, never with the trainer's environment, files or
network. The isolation comes from bubblewrap (``bwrap``; Debian/Ubuntu package ``bubblewrap``); the rung in force
is found at start-up by running the exact command on a no-op program, top rung first:

    rung               namespaces                         uid inside   what it does not contain
    bwrap              user, pid, net, ipc, uts, mount    65534        (the full set: docs/code.md)
    bwrap-nopid        user, net, ipc, uts, mount; no     65534        signals to the trainer's uid (kill(-1)); a
                       fresh /proc (containers that mask             daemon that setsids survives the deadline
                       /proc)                                         unless a pids cgroup is delegated
    bwrap-root         pid, net, ipc, uts, mount; no      65534        (root without user namespaces: bwrap keeps
                       user namespace                     (setuid)     CAP_SETUID/SETGID for the harness's drop)
    remote             SandboxFusion's HTTP API (--sandbox.url): whatever that service isolates
    unsafe             none: a plain subprocess; only by name (--sandbox.backend unsafe)

Inside: a read-only view of ``/usr`` (and ``/lib*``, ``/bin``) and of ``sys.base_prefix`` with its site-packages
hidden; a fresh ``/proc`` and a minimal ``/dev``; the working directory (``/work``), ``/tmp`` and ``/dev/shm`` as
size-capped tmpfs; never ``$HOME``, the HF cache, the checkout, ``runs/`` or the host's ``/dev/shm``. The environment
is fixed (``PYTHONHASHSEED=0``, ``LANG=C.UTF-8``, one OpenMP/BLAS thread, ``HOME=/work``; ``python -I``), so grades
are deterministic. ``common/sandbox_harness.py`` sets the rlimits (CPU seconds, address space, file size, open files)
before any model-written code runs. Where a pids cgroup can be made (root with cgroup v1's ``pids`` controller, or a
writable cgroup v2 subtree), each run gets ``pids.max`` and is killed through it. stdout and stderr are capped while
they are read; at the deadline the whole process tree is killed (the pid namespace dies with its first process).

Runs start from a pool of long-lived threads (``--die-with-parent`` follows the thread that spawned bwrap), so a
batch of completions grades in parallel off the caller's thread. This module holds the rung ladder (``Sandbox.probe``),
the ``Sandbox`` class, the remote backend and the process-wide sandbox; the bwrap command line, the pids cgroup and
the feeding, reading and killing of a local run are ``common/sandbox_bwrap.py``'s (``Limits``, ``bwrap_argv``,
``base_python`` and the constants are re-exported here). Both are standard library only. Contract:

    run_python(source, stdin="", timeout_s=10.0, memory_mb=1024) -> SandboxResult
    SandboxResult.status in STATUSES; exit_code, stdout, stderr, wall_s
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Literal

from common.sandbox_bwrap import (  # the local run's machinery; the public names are re-exported from here
    BWRAP_RUNGS,
    FIXED_ENV,
    HARNESS_PATH,
    SANDBOX_UID,
    Limits,
    _Cgroup,
    _cgroup_root,
    _communicate,
    _kill_tree,
    base_python,
    bwrap_argv,
)

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "sandbox_error")
"""ok: exited 0 within its limits; error: non-zero exit or an uncaught exception; timeout: past its wall or CPU
deadline; memory: out of its address space; output_limit: more stdout/stderr than the cap (or a file past the
file-size limit); sandbox_error: the sandbox itself failed (bwrap could not start, the remote service failed)."""
MEMORY_EXIT = 86  # common/sandbox_harness.py's exit code for MemoryError
RESULT_MARKER = "\x00__SANDBOX_RESULT__\x00"
STARTUP_GRACE_S = 0.5  # added to a run's deadline for the sandbox's own start-up (about 50 ms here)
UNSAFE_WARNING = (
    "code rewards run model-written programs WITHOUT a sandbox (--sandbox.backend unsafe): a program can read and "
    "use the trainer's memory, environment and secrets, signal or kill its processes, read and write its files "
    "(checkpoints, hidden tests), reach the network, and exhaust memory; use this only on a disposable machine"
)


class SandboxUnavailableError(RuntimeError):
    """No isolation rung works here and no unsafe mode was asked for."""


@dataclass
class SandboxConfig:
    """How model-written code runs (code rewards and the Python tool)."""

    backend: Literal["auto", "bwrap", "remote", "unsafe"] = "auto"
    """auto: the highest bwrap rung that works here, else refuse; remote: SandboxFusion at --sandbox.url; unsafe: a
    plain subprocess, no isolation (named on purpose)"""
    url: str = ""
    """SandboxFusion service URL for the remote backend (http://host:port; its /run_code route)"""
    workers: int = 0
    """programs run at once (0 = the number of CPUs)"""
    timeout_s: float = 10.0
    """wall-clock limit of one program run, all of a completion's test cases together"""
    case_timeout_s: float = 2.0
    """wall-clock (and CPU) limit of one test case"""
    memory_mb: int = 1024
    """address-space limit of a program"""


@dataclass
class SandboxResult:
    """How one sandboxed program run ended."""

    status: str  # one of STATUSES
    exit_code: int | None  # None when killed at the deadline or when the sandbox failed
    stdout: str
    stderr: str
    wall_s: float


# ----------------------------------------------------------------------------------------------
# Running one job
# ----------------------------------------------------------------------------------------------
def _status_from_exit(exit_code: int) -> str:
    if exit_code == 0:
        return "ok"
    if exit_code == MEMORY_EXIT:
        return "memory"
    if exit_code in (128 + signal.SIGXCPU, -signal.SIGXCPU):
        return "timeout"
    if exit_code in (128 + signal.SIGXFSZ, -signal.SIGXFSZ):
        return "output_limit"
    return "error"


class Sandbox:
    """One isolation rung and its worker pool. ``Sandbox.probe(config)`` picks the rung; ``run_job`` runs one job."""

    def __init__(self, rung: str, config: SandboxConfig, why_not: dict[str, str] | None = None):
        self.rung, self.config, self.why_not = rung, config, why_not or {}
        self.cgroup_root = _cgroup_root() if rung in BWRAP_RUNGS else None
        workers = config.workers or os.cpu_count() or 1
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")

    # -- start-up ------------------------------------------------------------------------------
    @classmethod
    def probe(cls, config: SandboxConfig) -> "Sandbox":
        """The highest working rung for ``config.backend``; raises SandboxUnavailableError naming why each failed."""
        if config.backend == "unsafe":
            return cls("unsafe", config)
        if config.backend == "remote" or (config.backend == "auto" and config.url):
            if not config.url:
                raise SandboxUnavailableError("--sandbox.backend remote needs --sandbox.url (a SandboxFusion service)")
            sandbox = cls("remote", config)
            result = sandbox.run_job({"mode": "run", "source": "print('ok')"}, "", Limits(timeout_s=30))
            if result.status != "ok" or result.stdout.strip() != "ok":
                raise SandboxUnavailableError(
                    f"--sandbox.url {config.url}: the remote sandbox failed a no-op program ({result.status}: "
                    f"{(result.stderr or result.stdout).strip()[:300]})"
                )
            return sandbox
        why_not: dict[str, str] = {}
        if shutil.which("bwrap") is None:
            why_not = {rung: "bwrap is not installed (apt-get install bubblewrap)" for rung in BWRAP_RUNGS}
        else:
            for rung in BWRAP_RUNGS:
                if rung == "bwrap-root" and os.geteuid() != 0:
                    why_not[rung] = "needs root"
                    continue
                sandbox = cls(rung, config, dict(why_not))
                result = sandbox.run_job({"mode": "run", "source": "import os\nprint(os.getuid())"}, "", Limits(30))
                if result.status == "ok" and result.stdout.strip() == str(SANDBOX_UID):
                    return sandbox
                sandbox.close()
                why_not[rung] = f"{result.status}: {(result.stderr or result.stdout).strip().splitlines()[-1:]}"
        reasons = "; ".join(f"{rung}: {why}" for rung, why in why_not.items())
        raise SandboxUnavailableError(
            f"no sandbox for model-written code works here ({reasons}). Install bubblewrap and allow user "
            "namespaces (sysctl user.max_user_namespaces, Ubuntu's kernel.apparmor_restrict_unprivileged_userns, "
            "Docker's seccomp profile), or use --sandbox.url with a SandboxFusion service, or pass "
            f"--sandbox.backend unsafe, which does not protect: {UNSAFE_WARNING}"
        )

    def describe(self) -> dict:
        """What the run's config.json records: the rung, why the ones above it failed, the cgroup, the limits."""
        return {
            "rung": self.rung,
            "rungs_failed": self.why_not,
            "pids_cgroup": str(self.cgroup_root) if self.cgroup_root else None,
            "url": self.config.url or None,
            "workers": self._pool._max_workers,
        }

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- running ---------------------------------------------------------------------------------
    def submit(self, job: dict, stdin: str, limits: Limits) -> concurrent.futures.Future:
        """Run ``job`` on a pool thread; the future's result is a SandboxResult."""
        return self._pool.submit(self.run_job, job, stdin, limits)

    def run_job(self, job: dict, stdin: str, limits: Limits, tag: str = "") -> SandboxResult:
        """One harness run. ``job["mode"] == "run"``: ``stdin`` is the program's; other modes carry their cases.
        ``tag`` is appended to the harness's command line (``bwrap_argv``)."""
        job = {
            "memory_mb": limits.memory_mb,
            "cpu_s": limits.timeout_s,
            "file_bytes": limits.file_bytes,
            "open_files": limits.open_files,
            "drop_privileges": self.rung == "bwrap-root",
            **job,
        }
        if self.rung == "remote":
            return self._run_remote(job, stdin, limits)
        start = time.monotonic()
        payload = json.dumps(job).encode()
        job_fd = None
        if job["mode"] == "run":  # the job as a read-only file; the program's own stdin stays the pipe
            job_fd = os.memfd_create("sandbox-job", 0)
            os.write(job_fd, payload)
            os.lseek(job_fd, 0, os.SEEK_SET)
            stdin_bytes = stdin.encode("utf-8", "surrogateescape")
        else:  # the grading modes read their job from stdin; each case's program gets its own stdin file
            stdin_bytes = payload
        cgroup = None
        try:
            if self.rung == "unsafe":
                argv, env, cwd = self._unsafe_argv(job_fd), dict(FIXED_ENV), tempfile.mkdtemp(prefix="sandbox-")
                env["HOME"] = cwd
            else:
                argv, env, cwd = bwrap_argv(self.rung, limits, job_fd, tag), {"PATH": "/usr/bin:/bin"}, "/"
                if self.cgroup_root is not None:
                    cgroup = _Cgroup(self.cgroup_root, limits.pids_max)
                    # a launcher shim joins the cgroup, then becomes bwrap: no preexec_fn in a threaded trainer
                    argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup.path / "cgroup.procs"), *argv]
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(job_fd,) if job_fd is not None else (),
                    start_new_session=True,
                    env=env,
                    cwd=cwd,
                )
            except OSError as e:
                return SandboxResult("sandbox_error", None, "", f"could not start the sandbox: {e}", 0.0)
            if job_fd is not None:
                os.close(job_fd)
                job_fd = None
            deadline = start + limits.timeout_s + STARTUP_GRACE_S
            out, err, stop = _communicate(proc, stdin_bytes, deadline, limits.output_bytes)
            if stop:
                _kill_tree(proc, cgroup)
            try:
                exit_code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_tree(proc, cgroup)
                exit_code, stop = proc.wait(), stop or "timeout"
            _kill_tree(proc, cgroup)  # anything the program left behind in its session or cgroup
        finally:
            if job_fd is not None:
                os.close(job_fd)
            if cgroup is not None:
                cgroup.remove()
            if self.rung == "unsafe":
                shutil.rmtree(cwd, ignore_errors=True)
        wall = time.monotonic() - start
        stdout = out[: limits.output_bytes].decode("utf-8", "replace")
        stderr = err[: limits.output_bytes].decode("utf-8", "replace")
        if stop:
            return SandboxResult(stop, None, stdout, stderr, wall)
        if self.rung != "unsafe" and exit_code != 0 and stderr.startswith("bwrap:"):
            return SandboxResult("sandbox_error", exit_code, stdout, stderr, wall)
        return SandboxResult(_status_from_exit(exit_code), exit_code, stdout, stderr, wall)

    def _unsafe_argv(self, job_fd: int | None) -> list[str]:
        exe, _ = base_python()
        # no bwrap to place the job file: the harness reads it from the inherited fd instead
        bootstrap = (
            f"import os,sys; sys.argv=['harness']; "
            f"ns={{'__name__':'sandbox_harness'}}; exec(open({str(HARNESS_PATH)!r}).read(), ns); "
            f"job=ns['json'].loads(os.read({job_fd},1<<30)) if {job_fd is not None} else ns['load_job'](); "
            f"ns['main'](job)"
        )
        return [exe, "-I", "-c", bootstrap]

    def _run_remote(self, job: dict, stdin: str, limits: Limits) -> SandboxResult:
        """One POST to SandboxFusion's /run_code; the harness goes with the job embedded, the stdin as ``stdin``."""
        start = time.monotonic()
        source = HARNESS_PATH.read_text()
        marker = "EMBEDDED_JOB = None"
        code = source.replace(marker, f"EMBEDDED_JOB = json.loads({json.dumps(json.dumps(job))})", 1)
        request = {
            "code": code,
            "language": "python",
            "run_timeout": limits.timeout_s,
            "memory_limit_MB": limits.memory_mb,
            "stdin": stdin if job["mode"] == "run" else "",
        }
        url = self.config.url.rstrip("/") + "/run_code"
        try:
            req = urllib.request.Request(
                url, data=json.dumps(request).encode(), headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=limits.timeout_s + 30) as response:
                answer = json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError) as e:
            return SandboxResult("sandbox_error", None, "", f"{url}: {e}", time.monotonic() - start)
        run = answer.get("run_result") or {}
        wall = time.monotonic() - start
        out, err = str(run.get("stdout") or ""), str(run.get("stderr") or "")
        if run.get("status") == "TimeLimitExceeded":
            return SandboxResult("timeout", None, out, err, wall)
        if not run or answer.get("status") == "SandboxError":
            return SandboxResult("sandbox_error", None, out, f"{url}: {answer.get('message', answer)}", wall)
        exit_code = run.get("return_code")
        if exit_code is None:
            return SandboxResult("error", None, out, err, wall)
        if max(len(out), len(err)) > limits.output_bytes:
            return SandboxResult("output_limit", exit_code, out[: limits.output_bytes], err, wall)
        return SandboxResult(_status_from_exit(int(exit_code)), int(exit_code), out, err, wall)


# ----------------------------------------------------------------------------------------------
# The process-wide sandbox and the public contract
# ----------------------------------------------------------------------------------------------
_DEFAULT: Sandbox | None = None
_DEFAULT_LOCK = threading.Lock()


def configure(config: SandboxConfig | None = None) -> Sandbox:
    """Probe and install the process-wide sandbox for ``config`` (default: auto); returns it. Raises
    SandboxUnavailableError, with what each rung lacked, when nothing works and unsafe was not asked for."""
    global _DEFAULT
    config = config or SandboxConfig()
    with _DEFAULT_LOCK:
        if _DEFAULT is not None and _DEFAULT.config == config:
            return _DEFAULT
        sandbox = Sandbox.probe(config)
        if sandbox.rung == "unsafe":
            print(f"WARNING: {UNSAFE_WARNING}", file=sys.stderr, flush=True)
        if _DEFAULT is not None:
            _DEFAULT.close()
        _DEFAULT = sandbox
        return sandbox


def configured() -> Sandbox | None:
    """The process-wide sandbox if one was configured or probed, else None (nothing probed yet)."""
    return _DEFAULT


def get_sandbox() -> Sandbox:
    """The process-wide sandbox, probed with the default (auto) config on first use."""
    return _DEFAULT if _DEFAULT is not None else configure()


@atexit.register
def _close_default() -> None:
    if _DEFAULT is not None:
        _DEFAULT._pool.shutdown(wait=False, cancel_futures=True)


def run_python(source: str, stdin: str = "", timeout_s: float = 10.0, memory_mb: int = 1024) -> SandboxResult:
    """Run one untrusted Python program in the process-wide sandbox and say how it ended.

    ``status`` is "ok" (exited 0 within its limits), "error" (non-zero exit or an uncaught exception), "timeout",
    "memory", "output_limit" or "sandbox_error" (see STATUSES). Thread-safe; runs on a pool thread.
    """
    limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb)
    return get_sandbox().submit({"mode": "run", "source": source}, stdin, limits).result()


def parse_program_results(result: SandboxResult) -> dict[int, list[dict]]:
    """The per-program results lines a grading job printed (program index -> its cases); a program whose line is
    missing was cut off (the run died or hit its deadline while it ran, or before it started)."""
    found: dict[int, list[dict]] = {}
    for line in result.stdout.split("\n"):
        if not line.startswith(RESULT_MARKER):
            continue
        try:
            record = json.loads(line[len(RESULT_MARKER) :])
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("index"), int) and isinstance(record.get("cases"), list):
            if all(isinstance(c, dict) for c in record["cases"]):
                found.setdefault(record["index"], record["cases"])
    return found


__all__ = [
    "STATUSES",
    "SandboxConfig",
    "SandboxResult",
    "Sandbox",
    "Limits",
    "SandboxUnavailableError",
    "configure",
    "get_sandbox",
    "run_python",
    "parse_program_results",
]
