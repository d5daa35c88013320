"""The program that runs *inside* the sandbox: it sets the limits, then runs model-written code.

Standard library only, and nothing from the project: ``common/sandbox.py`` mounts this one file read-only into the
sandbox (or, for the remote backend, sends it with the job appended) and starts it with ``python -I``. It reads its
job (a JSON object: ``load_job``) and

* ``mode == "run"``: runs ``source`` once as ``__main__`` with the sandbox's own stdin, stdout and stderr;
* ``mode == "stdio" | "call" | "test"``: runs one forked child per test case, each with its own stdin file, its
  own stdout and stderr files and a per-case CPU and wall limit, and prints one JSON line after ``RESULT_MARKER``
  with, per case, the captured stdout (capped), the stderr tail and how the child ended. ``"call"`` children call
  ``fn_name`` (or ``Solution().fn_name``) on the case's arguments and write ``json.dumps`` of the return value;
  ``"test"`` (one case) runs the program, wraps each function it defined so that what it returns is copied into
  plain builtin data (``plain``), runs the test code, then ``check(entry_point)``, then prints the job's
  ``sentinel`` on its own line: a pass is that line, never an exit code.

Expected outputs never come here: the trainer compares what this prints. Limits are set with ``setrlimit`` in this
process before any model-written code runs (the trainer never uses a ``preexec_fn``). Exit code ``MEMORY_EXIT`` says
the program ran out of its address space.
"""

import builtins
import json
import os
import resource
import signal
import sys
import traceback

RESULT_MARKER = "\x00__SANDBOX_RESULT__\x00"
MEMORY_EXIT = 86  # the program raised MemoryError under RLIMIT_AS
JOB_PATH = "/sandbox/job.json"  # mode "run" only
CASE_DIR = "/tmp/.cases"


def set_limits(job):
    """Address space, CPU seconds, file size, open files, no core dumps: inherited by every child."""
    mem = job["memory_mb"] * 1024 * 1024
    cpu = int(job["cpu_s"]) + 1
    for limit, value in (
        (resource.RLIMIT_AS, mem),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_FSIZE, job["file_bytes"]),
        (resource.RLIMIT_NOFILE, job["open_files"]),
        (resource.RLIMIT_CORE, 0),
    ):
        hard = resource.getrlimit(limit)[1]
        if hard != resource.RLIM_INFINITY:  # already inside a sandbox (a remote service, a nested run)
            value = min(value, hard)
        resource.setrlimit(limit, (value, value))


def drop_privileges():
    """Rung without a user namespace: bwrap kept CAP_SETUID/CAP_SETGID for this call only; become nobody."""
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)  # from uid 0 to non-zero: every capability is cleared
    if os.getuid() == 0 or os.geteuid() == 0:
        os._exit(97)


def run_source(source, name="<program>"):
    """Run ``source`` as ``__main__`` in this process; the exit code says how it ended."""
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(source, name, "exec"), namespace)
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0, namespace
        if isinstance(code, int):
            return code & 0xFF, namespace
        print(code, file=sys.stderr)
        return 1, namespace
    except MemoryError:
        print("MemoryError", file=sys.stderr)
        return MEMORY_EXIT, namespace
    except BaseException:  # the program's own exception: its traceback is the diagnostic
        try:
            traceback.print_exc()
        except BaseException:
            pass
        return 1, namespace
    return 0, namespace


def flush_and_exit(code):
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code)


def child_case(job, index, case_input):
    """In a forked child: redirect fds 0-2 to this case's files, run the program, exit with its status."""
    os.setpgid(0, 0)
    cpu = min(max(1, int(job["case_timeout_s"] + 0.999)), resource.getrlimit(resource.RLIMIT_CPU)[1])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    base = f"{CASE_DIR}/{index}"
    with open(base + ".in", "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(case_input if isinstance(case_input, str) else "")
    fd_in = os.open(base + ".in", os.O_RDONLY)
    fd_out = os.open(base + ".out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    fd_err = os.open(base + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, "r", encoding="utf-8", errors="replace", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False)
    mode = job["mode"]
    if mode == "stdio":
        code, _ = run_source(job["source"])
        flush_and_exit(code)
    if mode == "call":
        code, namespace = run_source(job["source"])
        if code:
            flush_and_exit(code)
        name = job["fn_name"]
        fn = namespace.get(name)
        if not callable(fn) and isinstance(namespace.get("Solution"), type):
            fn = getattr(namespace["Solution"](), name, None)
        if not callable(fn):
            print(f"no function {name!r} defined", file=sys.stderr)
            flush_and_exit(1)
        try:
            value = fn(*case_input)
            text = json.dumps(value)  # an object that only pretends to equal something does not serialise
        except MemoryError:
            flush_and_exit(MEMORY_EXIT)
        except BaseException:
            traceback.print_exc()
            flush_and_exit(1)
        with open(base + ".ret", "w", encoding="utf-8") as f:
            f.write(text)
        flush_and_exit(0)
    # mode == "test": program, then its checks, then the sentinel after the last check
    code, namespace = run_source(job["source"])
    if code:
        flush_and_exit(code)
    guard_functions(namespace)
    checks = job["test"]
    if job.get("entry_point"):
        checks += f"\n\ncheck({job['entry_point']})\n"
    try:
        exec(compile(checks, "<tests>", "exec"), namespace)
    except MemoryError:
        flush_and_exit(MEMORY_EXIT)
    except BaseException:
        traceback.print_exc()
        flush_and_exit(1)
    sys.stdout.write("\n" + job["sentinel"] + "\n")
    flush_and_exit(0)


_PLAIN_SCALARS = (int, float, complex, str, bytes, bool, type(None))
_type, _list, _tuple, _dict, _set, _frozenset = type, list, tuple, dict, set, frozenset  # before any program runs


def plain(value, depth=0):
    """A copy of ``value`` built only from builtin data types (exact types, no subclasses), else TypeError: so an
    object whose ``__eq__`` always says True can never reach the checks' comparisons."""
    kind = _type(value)
    if depth > 100:
        raise TypeError("value nested too deeply")
    if kind in _PLAIN_SCALARS:
        return value
    if kind in (_list, _tuple, _set, _frozenset):
        return kind(plain(v, depth + 1) for v in value)
    if kind is _dict:
        return {plain(k, depth + 1): plain(v, depth + 1) for k, v in value.items()}
    raise TypeError(f"returned a {kind.__name__}, not plain data")


def guarded(fn):
    def call(*args, **kwargs):
        return plain(fn(*args, **kwargs))

    return call


def guard_functions(namespace):
    """Wrap every function the program defined, so the checks compare plain data only."""
    for name, obj in _list(namespace.items()):
        if _type(obj) is _type(guarded):
            namespace[name] = guarded(obj)


class _Deadline(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Deadline


def read_capped(path, cap):
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError:
        return b""
    return data


def run_cases(job):
    """One forked child per case; prints the results line. Never raises."""
    os.makedirs(CASE_DIR, exist_ok=True)
    signal.signal(signal.SIGALRM, _on_alarm)
    results, cap = [], job["case_output_bytes"]
    for index, case_input in enumerate(job["cases"]):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                child_case(job, index, case_input)
            finally:
                os._exit(1)
        status = "ok"
        try:
            signal.setitimer(signal.ITIMER_REAL, job["case_timeout_s"])
            _, wait_status = os.waitpid(pid, 0)
            signal.setitimer(signal.ITIMER_REAL, 0)
        except _Deadline:
            status = "timeout"
            for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                try:
                    target()
                except OSError:
                    pass
            _, wait_status = os.waitpid(pid, 0)
        try:
            os.killpg(pid, signal.SIGKILL)  # what the case left running in its group
        except OSError:
            pass
        base = f"{CASE_DIR}/{index}"
        out, err = read_capped(base + ".out", cap), read_capped(base + ".err", 4096)
        exit_code = os.waitstatus_to_exitcode(wait_status)
        if status == "ok":
            if exit_code == -signal.SIGXCPU:
                status = "timeout"
            elif exit_code == -signal.SIGXFSZ or len(out) > cap:
                status = "output_limit"
            elif exit_code == MEMORY_EXIT:
                status = "memory"
            elif exit_code != 0:
                status = "error"
        result = {
            "status": status,
            "exit_code": exit_code,
            "stdout": out[:cap].decode("utf-8", "replace"),
            "stderr": err[-2000:].decode("utf-8", "replace"),
        }
        if job["mode"] == "call" and status == "ok":
            ret = read_capped(base + ".ret", cap)
            result["return"] = ret[:cap].decode("utf-8", "replace") if len(ret) <= cap else None
        results.append(result)
        for suffix in (".in", ".out", ".err", ".ret"):
            try:
                os.unlink(base + suffix)
            except OSError:
                pass
        if job.get("stop_on_failure") and status != "ok":
            break
    sys.stdout.write(RESULT_MARKER + json.dumps(results) + "\n")
    sys.stdout.flush()


def _exit(code=None):
    raise SystemExit(code)


def main(job):
    builtins.exit = builtins.quit = _exit  # what site.py would define: programs call exit()
    if job.get("drop_privileges"):
        drop_privileges()
    os.environ.pop("SANDBOX_JOB", None)
    set_limits(job)
    if job["mode"] == "run":
        code, _ = run_source(job["source"])
        flush_and_exit(code)
    run_cases(job)
    flush_and_exit(0)


def load_job():
    """The job: embedded by the remote backend, else the read-only job file (mode "run": stdin is the program's),
    else all of stdin (the grading modes: a case's program never sees the job, its stdin is the case's file)."""
    if EMBEDDED_JOB is not None:
        return EMBEDDED_JOB
    if os.path.exists(JOB_PATH):
        with open(JOB_PATH, encoding="utf-8") as job_file:
            return json.load(job_file)
    return json.loads(sys.stdin.buffer.read().decode("utf-8"))


EMBEDDED_JOB = None  # --- the remote backend replaces this line ---
if __name__ == "__main__":
    main(load_job())
