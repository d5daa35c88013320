"""The local side of one sandboxed run: the bwrap command of each rung, a pids cgroup, feeding and killing the run.

``common/sandbox.py`` (the rung ladder, the ``Sandbox`` class, the remote backend, ``run_python``) builds every local
run (a bwrap rung, or the unsafe subprocess) from these pieces and re-exports the public ones; nothing here probes a
rung or turns an exit into a status. Standard library only, and nothing from the project: CI copies this module with
``common/sandbox.py`` and ``common/sandbox_harness.py`` to run the battery as nobody with the system ``python3``.
Contract:

    bwrap_argv(rung, limits, job_fd, tag="") -> argv       the full bwrap command line of one harness run
    base_python() -> (executable, prefix)                   the base interpreter, never a venv's
    _cgroup_root() -> Path | None                           a writable pids hierarchy, where one can be made
    _Cgroup(root, pids_max): .path, .kill(), .remove()      one run's pids cgroup
    _communicate(proc, stdin, deadline, cap) -> (stdout, stderr, None | "timeout" | "output_limit")
    _kill_tree(proc, cgroup)                                kill the run's process tree; returns once it is gone
    Limits                                                  one run's limits (time, memory, output, files, tmpfs, pids)
"""

from __future__ import annotations

import itertools
import os
import select
import selectors
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

HARNESS_PATH = Path(__file__).resolve().parent / "sandbox_harness.py"
BWRAP_RUNGS = ("bwrap", "bwrap-nopid", "bwrap-root")
SANDBOX_UID = 65534
FIXED_ENV = {
    "PYTHONHASHSEED": "0",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/work",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
}


@dataclass
class Limits:
    timeout_s: float = 10.0
    memory_mb: int = 1024
    output_bytes: int = 1 << 20  # per stream, while read
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE
    open_files: int = 64  # RLIMIT_NOFILE
    tmpfs_bytes: int = 64 << 20  # each of /work, /tmp, /dev/shm
    pids_max: int = 64  # cgroup pids.max, where a cgroup can be made


# ----------------------------------------------------------------------------------------------
# The bwrap command of each rung
# ----------------------------------------------------------------------------------------------
def base_python() -> tuple[str, str]:
    """(the base interpreter's executable, its prefix): never a venv's, which may live in the checkout."""
    prefix = os.path.realpath(sys.base_prefix)
    exe = Path(prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    if not exe.exists():
        exe = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    return str(exe), prefix


def _root_links() -> list[str]:
    """/bin, /lib, /lib64, /sbin: symlinks into /usr on merged-/usr systems, read-only binds elsewhere."""
    args = []
    for name in ("bin", "lib", "lib32", "lib64", "sbin"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


def bwrap_argv(rung: str, limits: Limits, job_fd: int | None, tag: str = "") -> list[str]:
    """The full command line of ``rung`` (one of BWRAP_RUNGS) running the harness; ``job_fd`` a readable fd; ``tag``
    an argument the harness ignores, so a test can find every process of one run by its command line."""
    exe, prefix = base_python()
    args = ["bwrap", "--die-with-parent", "--new-session", "--clearenv"]
    args += ["--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
    if rung in ("bwrap", "bwrap-nopid"):
        args += ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--disable-userns"]
    if rung in ("bwrap", "bwrap-root"):
        args += ["--unshare-pid", "--proc", "/proc"]
    if rung == "bwrap-root":
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    args += ["--ro-bind", "/usr", "/usr", *_root_links()]
    if not prefix.startswith("/usr/"):
        for parent in reversed(Path(prefix).parents[:-1]):  # traversable by nobody (e.g. /root of a pyenv)
            args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", prefix, prefix]
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = Path(prefix) / "lib" / minor / "site-packages"
    if site.is_dir():  # the base interpreter's third-party packages stay out of reach
        args += ["--tmpfs", str(site)]
    args += ["--dev", "/dev"]
    for mount in ("/dev/shm", "/tmp", "/work"):
        args += ["--perms", "1777", "--size", str(limits.tmpfs_bytes), "--tmpfs", mount]
    args += ["--ro-bind", str(HARNESS_PATH), "/sandbox/harness.py"]
    if job_fd is not None:
        args += ["--ro-bind-data", str(job_fd), "/sandbox/job.json"]
    for key, value in FIXED_ENV.items():
        args += ["--setenv", key, value]
    args += ["--remount-ro", "/"]  # the sandbox's own root (where bwrap made mount points) takes no writes
    # -S: no site import (a few ms a run; site-packages are hidden anyway); the harness defines exit() and quit()
    args += ["--chdir", "/work", exe, "-I", "-S", "/sandbox/harness.py"] + ([tag] if tag else [])
    return args


# ----------------------------------------------------------------------------------------------
KILL_WAIT_S = 10.0  # how long a kill waits for the run's pid namespace to empty


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (``/proc/<pid>/task/*/children``); empty once it has exited."""
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(p) for p in (task / "children").read_text().split()]
    except OSError:
        pass
    return found


# A pids cgroup per run, where one can be made
# ----------------------------------------------------------------------------------------------
_CGROUP_PARENTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")
_cgroup_counter = itertools.count()


def _cgroup_root() -> Path | None:
    """A writable pids hierarchy: cgroup v1's pids controller, or a v2 root whose children get pids.max."""
    for parent in _CGROUP_PARENTS:
        root = Path(parent)
        is_v2 = (root / "cgroup.controllers").exists()
        if is_v2 and "pids" not in (root / "cgroup.subtree_control").read_text(errors="replace").split():
            continue
        if not (root / "cgroup.procs").exists():
            continue
        probe = root / f"rl-sandbox-probe-{os.getpid()}"
        try:
            probe.mkdir()
            ok = (probe / "pids.max").exists()
            probe.rmdir()
        except OSError:
            continue
        if ok:
            return root
    return None


class _Cgroup:
    """One run's cgroup: ``pids.max`` caps its processes; ``kill`` ends every process in it."""

    def __init__(self, root: Path, pids_max: int):
        self.path = root / f"rl-sandbox-{os.getpid()}-{next(_cgroup_counter)}"
        self.path.mkdir()
        (self.path / "pids.max").write_text(str(pids_max))

    def kill(self) -> None:
        if (self.path / "cgroup.kill").exists():
            try:
                (self.path / "cgroup.kill").write_text("1")
            except OSError:
                pass
        for _ in range(50):
            try:
                pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.002)

    def remove(self) -> None:
        self.kill()
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.005)


# ----------------------------------------------------------------------------------------------
# Feeding, reading and killing one run
# ----------------------------------------------------------------------------------------------
def _communicate(proc: subprocess.Popen, stdin: bytes, deadline: float, cap: int) -> tuple[bytes, bytes, str | None]:
    """Feed stdin from a thread (a program that never reads must not deadlock us), read both streams up to ``cap``
    bytes each until EOF or the deadline; returns (stdout, stderr, None | "timeout" | "output_limit")."""

    def feed() -> None:
        try:
            if stdin:
                proc.stdin.write(stdin)
        except OSError:
            pass
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    stop = None
    with selectors.DefaultSelector() as selector:
        for stream in buffers:
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stop = "timeout"
                break
            for key, _ in selector.select(timeout=min(remaining, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffers[key.fileobj] += chunk
                if len(buffers[key.fileobj]) > cap:
                    stop = "output_limit"
            if stop:
                break
    return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), stop


def _kill_tree(proc: subprocess.Popen, cgroup: _Cgroup | None) -> None:
    """Kill the run's process tree and return only once it is gone.

    bwrap's child is the first process of the run's pid namespace. The kernel kills every other process of the
    namespace when it exits, and waits for them before it reports that process as exited; a fork bomb's
    thousands of processes take longer to die than the kill takes to send, so waiting on it (through a pidfd)
    means no process of the run outlives this call and competes with the next one.
    """
    pidfds = []
    for child in _children(proc.pid):
        try:
            pidfds.append(os.pidfd_open(child))
        except OSError:  # already gone, or a kernel without pidfds (the wait below is then skipped)
            pass
    for fd in pidfds:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap and, without a pid namespace, the run's process group
    except OSError:
        pass
    if cgroup is not None:
        cgroup.kill()
    deadline = time.monotonic() + KILL_WAIT_S
    for fd in pidfds:
        try:
            ready = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]
            if not ready:
                warnings.warn(f"sandbox: a run's processes were still exiting {KILL_WAIT_S:.0f} s after the kill")
        finally:
            os.close(fd)
