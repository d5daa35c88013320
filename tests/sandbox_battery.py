"""The hostile-program battery: every case runs through the sandbox from a separate "trainer" process.

``python tests/sandbox_battery.py RUNG CASE...`` (standard library only, so any user's ``python3`` can run it;
``RL_BATTERY_CHECKOUT`` names the checkout when a copy runs) is started by ``tests/test_sandbox.py`` with a secret in
its environment (so the secret is in ``/proc/<pid>/environ``) and in its heap; it listens on TCP at 127.0.0.1 and at
this machine's non-loopback address, runs each named case under rung RUNG, and prints one JSON line per case: how the
program ended, and what the runner saw afterwards (a connection accepted, a file created outside the sandbox, a
process of the program still alive, the secret in the program's output). It never runs a case the rung is not listed
to contain (``CONTAINED``), so a weaker rung is documented rather than assumed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.sandbox import Limits, Sandbox, SandboxConfig  # noqa: E402

CHECKOUT = Path(os.environ.get("RL_BATTERY_CHECKOUT") or Path(__file__).resolve().parent.parent)
SECRET_ENV = "RL_BATTERY_SECRET"
TIMEOUT_S = 1.5

# name -> (program, stdin, statuses it may end with). Placeholders: {pid} the runner's real pid, {port}/{port2}
# its listening ports, {ip} its non-loopback address, {marker} a unique token, {checkout}, {home}, {parent}.
CASES: dict[str, tuple[str, str, set[str]]] = {
    # loops and sleeps
    "infinite_loop": ("while True:\n    pass\n", "", {"timeout"}),
    "busy_c_call": ("import re\nre.match(r'(a*)*b', 'a' * 64)\n", "", {"timeout"}),
    "sleep_past_deadline": ("import time\ntime.sleep(60)\n", "", {"timeout"}),
    # resource exhaustion
    "fork_bomb": (
        "import os, time\n"
        "for _ in range(11):  # at most 2**11 processes even if nothing stopped it\n"
        "    try:\n        os.fork()\n    except OSError:\n        pass\n"
        "time.sleep(60)\n",
        "",
        {"timeout"},
    ),
    "allocate_20gb": ("x = bytearray(20 * 1024**3)\n", "", {"memory"}),
    "print_forever": ("while True:\n    print('y' * 1000)\n", "", {"output_limit"}),
    "invalid_utf8": ("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe\\xfa end')\n", "", {"ok"}),
    "fill_tmp_and_shm": (
        "import os\n"
        "for d in ('/tmp', '/dev/shm', '.'):\n"
        "    total = 0\n"
        "    try:\n"
        "        for i in range(100):\n"
        "            with open(f'{{d}}/fill{{i}}', 'wb') as f:\n"
        "                for _ in range(8):\n"
        "                    f.write(b'x' * (1 << 20)); total += 1\n"
        "    except OSError as e:\n"
        "        print(d, 'full at', total, 'MB', e.errno)\n",
        "",
        {"ok"},
    ),
    "recursion_segfault": (
        "import json, sys\nsys.setrecursionlimit(10**8)\njson.loads('[' * 10**7 + ']' * 10**7)\n",
        "",
        {"error", "memory"},
    ),
    "fd_exhaustion": ("fs = [open('/dev/null') for _ in range(100000)]\n", "", {"error"}),
    "ctypes_crash": ("import ctypes\nctypes.string_at(0)\n", "", {"error"}),
    "never_reads_stdin": ("print('done')\n", "z" * (8 << 20), {"ok"}),
    # reaching outside
    "write_outside": (
        "import os\n"
        "for p in ['/tmp/{marker}', '{home}/{marker}', '{parent}/{marker}', '{checkout}/{marker}',\n"
        "          '../{marker}', '/dev/shm/{marker}']:\n"
        "    try:\n        open(p, 'w').write('x'); print('wrote', p)\n"
        "    except OSError as e:\n        print('refused', p, e.errno)\n",
        "",
        {"ok"},
    ),
    "read_secret": (
        "import os, re\n"
        "print('env', [v for v in os.environ.values() if 'SECRET' in v])\n"
        "for pid in ['{pid}', str(os.getppid()), '1']:\n"
        "    try:\n        print(pid, open(f'/proc/{{pid}}/environ', 'rb').read()[-400:])\n"
        "    except OSError as e:\n        print('no environ', pid, e.errno)\n"
        "    try:\n"
        "        maps = open(f'/proc/{{pid}}/maps').read().splitlines()\n"
        "        mem = open(f'/proc/{{pid}}/mem', 'rb')\n"
        "        for line in maps:\n"
        "            if 'rw' not in line.split()[1]:\n                continue\n"
        "            lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
        "            try:\n                mem.seek(lo); chunk = mem.read(min(hi - lo, 1 << 24))\n"
        "            except OSError:\n                continue\n"
        "            for m in re.finditer(rb'SECRET-[0-9a-f]{{8}}', chunk):\n"
        "                print('found', m.group())\n"
        "    except OSError as e:\n        print('no mem', pid, e.errno)\n",
        "",
        {"ok"},
    ),
    "tcp_out": (
        "import socket\n"
        "for host, port in [('127.0.0.1', {port}), ('{ip}', {port2}), ('localhost', {port})]:\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=2).sendall(b'hello'); print('connected', host)\n"
        "    except OSError as e:\n        print('refused', host, e.errno)\n",
        "",
        {"ok"},
    ),
    "kill_everything": (
        "import os, signal\n"
        "for target in (lambda: os.kill(-1, signal.SIGKILL), lambda: os.kill({pid}, signal.SIGKILL)):\n"
        "    try:\n        target()\n    except OSError as e:\n        print('refused', e.errno)\n",
        "",
        {"ok", "error"},
    ),
    "ptrace_runner": (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "r = libc.ptrace(16, {pid}, 0, 0)  # PTRACE_ATTACH\n"
        "print('ptrace', r, ctypes.get_errno())\n",
        "",
        {"ok"},
    ),
    "read_checkout": (
        "import os\n"
        "for p in ['{checkout}/README.md', '{checkout}/tests/fixtures', '{checkout}/runs', '{home}',\n"
        "          '/root', '/etc/passwd']:\n"
        "    try:\n"
        "        print('read', p, os.listdir(p) if os.path.isdir(p) else open(p).read()[:50])\n"
        "    except OSError as e:\n        print('refused', p, e.errno)\n",
        "",
        {"ok"},
    ),
    # escaping the deadline
    "ignore_sigterm": (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True:\n    time.sleep(0.1)\n",
        "",
        {"timeout"},
    ),
    "daemon_double_fork": (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execv('/bin/sleep', ['sleep', '{marker_seconds}'])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\nprint('parent exits')\n",
        "",
        {"ok", "timeout"},  # timeout where no pid namespace ends it with its parent: the daemon holds stdout open
    ),
    "popen_left_running": (
        "import subprocess\nsubprocess.Popen(['sleep', '{marker_seconds}'])\nprint('started')\n",
        "",
        {"ok", "timeout"},
    ),
    "thread_outlives_main": (
        "import threading, time\nthreading.Thread(target=lambda: time.sleep(60)).start()\nprint('main done')\n",
        "",
        {"ok", "timeout"},
    ),
}

# which cases each rung contains (run and checked); a case missing from a rung's list is not contained there
CONTAINED = {
    "bwrap": set(CASES),
    "bwrap-root": set(CASES),
    # no pid namespace: the program can signal every process of the trainer's uid, and read /proc/<pid>/* of them
    # (read_secret's environ and mem); a setsid daemon survives only where no pids cgroup can be made
    "bwrap-nopid": set(CASES) - {"kill_everything", "read_secret", "ptrace_runner"},
}
ESCAPE_WITHOUT_PID_NAMESPACE_OR_CGROUP = {"daemon_double_fork", "popen_left_running", "fork_bomb"}


def contained(rung: str, pids_cgroup: bool) -> set[str]:
    """The cases ``rung`` contains; without a pid namespace, processes that leave the session survive the deadline
    unless a pids cgroup holds them (unprivileged users rarely get one delegated)."""
    cases = set(CONTAINED[rung])
    if rung == "bwrap-nopid" and not pids_cgroup:
        cases -= ESCAPE_WITHOUT_PID_NAMESPACE_OR_CGROUP
    return cases


def _non_loopback_ip() -> str:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent by a UDP connect
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def _listener(host: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen(8)
    sock.setblocking(False)
    return sock


def _accepted(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
        conn.close()
        return True
    except BlockingIOError:
        return False


def _processes_with(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def run_case(sandbox: Sandbox, name: str, secret: str, listeners: dict) -> dict:
    source, stdin, allowed = CASES[name]
    marker = "rlbattery" + secrets.token_hex(6)
    marker_seconds = f"{1000 + secrets.randbelow(10**6)}.{secrets.randbelow(10**6):06d}"
    home = os.path.expanduser("~")
    fields = {
        "pid": os.getpid(),
        "port": listeners["lo"].getsockname()[1],
        "port2": listeners["ip"].getsockname()[1],
        "ip": listeners["ip"].getsockname()[0],
        "marker": marker,
        "marker_seconds": marker_seconds,
        "checkout": str(CHECKOUT),
        "home": home,
        "parent": str(CHECKOUT.parent),
    }
    program = source.format(**fields)
    limits = Limits(timeout_s=TIMEOUT_S, memory_mb=512)
    result = sandbox.run_job({"mode": "run", "source": program}, stdin, limits, tag=marker)
    # no grace period: when run_job returns, every process of the run has been reaped
    outside = [
        p
        for p in (Path("/tmp") / marker, Path(home) / marker, CHECKOUT.parent / marker, CHECKOUT / marker)
        if os.path.lexists(p)  # False where this user may not look (nobody and /root): nor could the program
    ]
    for p in outside:
        p.unlink()
    survivors = _processes_with(marker_seconds) + _processes_with(marker)  # the run's harness and its forks
    for pid in survivors:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    connected = [key for key, sock in listeners.items() if _accepted(sock)]
    text = result.stdout + result.stderr
    return {
        "case": name,
        "status": result.status,
        "allowed": sorted(allowed),
        "wall_s": round(result.wall_s, 3),
        "secret_leaked": secret in text,
        "files_outside": [str(p) for p in outside],
        "survivors": survivors,
        "connections": connected,
        "stdout": result.stdout[-600:],
    }


def problems_in(report: dict) -> list[str]:
    """What went wrong in one case's report: a status outside its allowed set, anything that reached outside."""
    problems = []
    if report["status"] not in report["allowed"]:
        problems.append(f"status {report['status']} not in {report['allowed']}")
    for key in ("secret_leaked", "files_outside", "survivors", "connections"):
        if report[key]:
            problems.append(f"{key}: {report[key]}")
    out, case = report["stdout"], report["case"]
    if case == "tcp_out" and (out.count("refused") != 3 or "connected" in out):
        problems.append(f"a connection got through: {out!r}")
    if case == "read_secret" and ("found" in out or "SECRET" in out):
        problems.append(f"secret search: {out!r}")
    if case == "read_checkout" and "read " + str(CHECKOUT) in out:
        problems.append(f"read the checkout: {out!r}")
    if case == "write_outside" and "refused " + str(CHECKOUT) not in out:
        problems.append(f"the checkout was writable: {out!r}")
    if case == "fill_tmp_and_shm":
        sizes = [int(n) for n in re.findall(r"full at (\d+) MB", out)]
        if len(sizes) != 3 or max(sizes) > Limits().tmpfs_bytes >> 20:
            problems.append(f"tmpfs caps: {out!r}")
    if case == "kill_everything" and "refused" not in out and report["status"] == "ok":
        problems.append(f"kill went through: {out!r}")
    return problems


def main() -> None:
    """``RUNG [CASE...] [--check]``: with --check, also judge each report and exit 1 on any problem (CI's
    unprivileged run, which has no pytest)."""
    check = "--check" in sys.argv
    argv = [a for a in sys.argv[1:] if a != "--check"]
    rung, names = argv[0], argv[1:]
    failures = []
    secret = os.environ[SECRET_ENV]
    heap_copy = ("heap:" + secret).encode()  # noqa: F841 - the secret also lives in this process's memory
    sandbox = Sandbox(rung, SandboxConfig(workers=1))
    listeners = {"lo": _listener("127.0.0.1"), "ip": _listener(_non_loopback_ip())}
    cases = contained(rung, sandbox.cgroup_root is not None)
    for name in names or sorted(cases):
        if name not in cases:
            raise SystemExit(f"case {name!r} is not contained by rung {rung!r}: refusing to run it")
        report = run_case(sandbox, name, secret, listeners)
        print(json.dumps(report), flush=True)
        failures += [f"{name}: {p}" for p in problems_in(report)]
    sandbox.close()
    if check:
        print(f"battery as uid {os.getuid()}, rung {rung}: {len(failures)} problems", file=sys.stderr)
        if failures:
            raise SystemExit("\n".join(failures))


if __name__ == "__main__":
    main()
