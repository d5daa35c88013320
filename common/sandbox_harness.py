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


class CaseTimeout(BaseException):
    """Raised by the case alarm inside a program's process; a program that swallows it meets the program's deadline."""


def _on_alarm(signum, frame):
    raise CaseTimeout


def read_capped(path, cap):
    try:
        with open(path, "rb") as f:
            return f.read(cap + 1)
    except OSError:
        return b""


def _redirect(base, case_input):
    """fds 0, 1, 2 of this process become the case's input, output and error files; sys.std* follow them."""
    with open(base + ".in", "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(case_input if isinstance(case_input, str) else "")
    for path, target, flags in (
        (base + ".in", 0, os.O_RDONLY),
        (base + ".out", 1, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (base + ".err", 2, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        fd = os.open(path, flags, 0o600)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, "r", encoding="utf-8", errors="replace", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False)


def _run_case(program, code, index, case_input, base):
    """One case inside the program's process: returns (status, exit_code, returned JSON or None)."""
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    returned = None
    try:
        exec(code, namespace)
        if program["kind"] == "call":
            name = program["fn_name"]
            fn = namespace.get(name)
            if not callable(fn) and isinstance(namespace.get("Solution"), type):
                fn = getattr(namespace["Solution"](), name, None)
            if not callable(fn):
                raise NameError(f"no function {name!r} defined")
            returned = json.dumps(fn(*case_input))  # an object that only pretends to equal something fails here
        elif program["kind"] == "test":
            guard_functions(namespace)
            checks = program["test"]
            if program.get("entry_point"):
                checks += f"\n\ncheck({program['entry_point']})\n"
            exec(compile(checks, "<tests>", "exec"), namespace)
            sys.stdout.write("\n" + program["sentinel"] + "\n")
        status, exit_code = "ok", 0
    except SystemExit as e:
        exit_code = 0 if e.code is None else (e.code & 0xFF if isinstance(e.code, int) else 1)
        status = "ok" if exit_code == 0 and program["kind"] == "stdio" else "error"
    except CaseTimeout:
        status, exit_code = "timeout", None
    except MemoryError:
        status, exit_code = "memory", MEMORY_EXIT
    except BaseException:
        status, exit_code = "error", 1
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return status, exit_code, returned


def program_child(job, program, folder):
    """In the forked child of one program: every case in this one process, each with its own fds 0-2 and alarm;
    each case's outcome goes to ``<folder>/<k>.done`` as soon as it is known."""
    os.setpgid(0, 0)
    cpu = min(max(1, int(program["timeout_s"] + 0.999)), resource.getrlimit(resource.RLIMIT_CPU)[1])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        code = compile(program["source"], "<program>", "exec")
    except BaseException:
        code = None
    for index, case_input in enumerate(program["cases"]):
        base = f"{folder}/{index}"
        _redirect(base, case_input)
        if code is None:
            status, exit_code, returned = "error", 1, None
            print("SyntaxError: the program does not compile", file=sys.stderr)
        else:
            signal.setitimer(signal.ITIMER_REAL, job["case_timeout_s"])
            status, exit_code, returned = _run_case(program, code, index, case_input, base)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        done = {"status": status, "exit_code": exit_code, "return": returned}
        fd = os.open(base + ".done", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, json.dumps(done).encode())
        os.close(fd)
    os._exit(0)


def _wait(pid, timeout_s):
    """waitpid with a deadline; returns (wait status, timed out)."""
    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        _, status = os.waitpid(pid, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        return status, False
    except CaseTimeout:
        for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                target()
            except OSError:
                pass
        return os.waitpid(pid, 0)[1], True


def wipe(top):
    """Empty ``top`` (a scratch tmpfs), whatever modes the program left on what it made there."""
    for root, dirs, _ in os.walk(top):
        for d in dirs:
            try:
                os.chmod(os.path.join(root, d), 0o700)
            except OSError:
                pass
    for root, dirs, files in os.walk(top, topdown=False):
        for name in files:
            try:
                os.unlink(os.path.join(root, name))
            except OSError:
                pass
        for name in dirs:
            try:
                os.rmdir(os.path.join(root, name))
            except OSError:
                pass


def grade_program(job, index, program):
    """Run one program's cases in a forked child; afterwards nothing of it is left: with ``kill_all`` (a pid
    namespace of our own) every other process in the sandbox is killed, and the scratch folders are emptied."""
    folder = f"{CASE_DIR}/{index}"
    os.makedirs(folder, exist_ok=True)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            program_child(job, program, folder)
        finally:
            os._exit(1)
    wait_status, timed_out = _wait(pid, program["timeout_s"])
    if job.get("kill_all"):
        try:
            os.kill(-1, signal.SIGKILL)  # everything but this harness and the namespace's init
        except OSError:
            pass
    else:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    exit_code = os.waitstatus_to_exitcode(wait_status)
    died = "timeout" if timed_out or exit_code == -signal.SIGXCPU else "memory" if exit_code == MEMORY_EXIT else "error"
    cap, cases = job["case_output_bytes"], []
    for k in range(len(program["cases"])):
        base = f"{folder}/{k}"
        out, err = read_capped(base + ".out", cap), read_capped(base + ".err", 4096)
        try:
            done = json.loads(read_capped(base + ".done", 1 << 20).decode("utf-8", "replace") or "null")
        except ValueError:
            done = None
        if not isinstance(done, dict):  # the process died or was killed in (or before) this case
            done = {"status": died if k == len(cases) else "not_run", "exit_code": exit_code, "return": None}
        status = str(done.get("status"))
        if status == "ok" and len(out) > cap:
            status = "output_limit"
        case = {"status": status, "exit_code": done.get("exit_code"), "stdout": out[:cap].decode("utf-8", "replace")}
        case["stderr"] = err[-2000:].decode("utf-8", "replace")
        if program["kind"] == "call" and status == "ok":
            ret = done.get("return")
            case["return"] = ret if isinstance(ret, str) and len(ret) <= cap else None
        cases.append(case)
    for top in ("/tmp", "/dev/shm", os.getcwd()):
        wipe(top)
    return cases


def make_undumpable():
    """No process of this uid may ptrace this one or read its /proc/<pid>/mem and fds (a program's children inherit
    it): a program cannot reach into the harness that grades the next program."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        pass


def run_grading(job):
    """Each program in turn; one results line per program, printed as soon as it is graded."""
    make_undumpable()
    os.makedirs(CASE_DIR, exist_ok=True)
    for index, program in enumerate(job["programs"]):
        cases = grade_program(job, index, program)
        sys.stdout.write(RESULT_MARKER + json.dumps({"index": index, "cases": cases}) + "\n")
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
    run_grading(job)
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
