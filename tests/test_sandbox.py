"""The sandbox and the code reward: the hostile-program battery per isolation rung, statuses, forging, the remote
backend against a stub SandboxFusion server, and refusing to start without a sandbox.

The battery (``tests/sandbox_battery.py``) runs in a separate process started with a secret in its environment.
The default rung runs in the main suite; the weaker rungs (``bwrap-nopid``, and ``bwrap-root`` as root) are marked
``slow`` and run in CI's sandbox stage. Without bwrap the bwrap tests skip, naming why.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common import sandbox as sb
from common.code_reward import extract_program, load_tests, return_matches, stdout_matches
from common.verifiers import compute_rewards

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import sandbox_battery  # noqa: E402

HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="bwrap is not installed (apt-get install bubblewrap)")


def _rung_works(rung: str) -> bool:
    sandbox = sb.Sandbox(rung, sb.SandboxConfig(workers=1))
    try:
        result = sandbox.run_job({"mode": "run", "source": "print(1)"}, "", sb.Limits(timeout_s=20))
    finally:
        sandbox.close()
    return result.status == "ok" and result.stdout.strip() == "1"


def run_battery(rung: str) -> list[dict]:
    if not HAVE_BWRAP:
        pytest.skip("bwrap is not installed (apt-get install bubblewrap)")
    if rung == "bwrap-root" and os.geteuid() != 0:
        pytest.skip("rung bwrap-root needs root")
    if not _rung_works(rung):
        pytest.skip(f"rung {rung} does not start on this machine")
    secret = "SECRET-" + secrets.token_hex(4)
    env = dict(os.environ, **{sandbox_battery.SECRET_ENV: secret})
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "sandbox_battery.py"), rung],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"the battery's runner died (a case reached it?): {proc.stderr[-2000:]}"
    reports = [json.loads(line) for line in proc.stdout.splitlines()]
    has_cgroup = sb._cgroup_root() is not None
    assert {r["case"] for r in reports} == sandbox_battery.contained(rung, has_cgroup)
    for r in reports:
        assert secret not in json.dumps(r)
    return reports


def check_reports(reports: list[dict]) -> None:
    failures = [f"{r['case']}: {'; '.join(p)}" for r in reports if (p := sandbox_battery.problems_in(r))]
    assert not failures, "\n".join(failures)


@needs_bwrap
def test_battery_default_rung():
    check_reports(run_battery("bwrap"))


@pytest.mark.slow
@pytest.mark.parametrize("rung", ["bwrap-nopid", "bwrap-root"])
def test_battery_weaker_rungs(rung):
    check_reports(run_battery(rung))


def test_containment_lists():
    """What each rung is documented to contain (docs/code.md): a change here is a change to the threat model."""
    every = set(sandbox_battery.CASES)
    assert len(every) == 22
    assert sandbox_battery.CONTAINED["bwrap"] == every
    assert sandbox_battery.CONTAINED["bwrap-root"] == every
    assert every - sandbox_battery.CONTAINED["bwrap-nopid"] == {"kill_everything", "read_secret", "ptrace_runner"}
    assert sandbox_battery.contained("bwrap-nopid", True) == sandbox_battery.CONTAINED["bwrap-nopid"]
    assert sandbox_battery.CONTAINED["bwrap-nopid"] - sandbox_battery.contained("bwrap-nopid", False) == {
        "daemon_double_fork",
        "popen_left_running",
        "fork_bomb",
    }
    assert sandbox_battery.contained("bwrap", False) == every
    doc = (ROOT / "docs" / "code.md").read_text()
    for case in every - sandbox_battery.CONTAINED["bwrap-nopid"]:
        assert case in doc, f"docs/code.md does not name {case} as not contained by bwrap-nopid"


@needs_bwrap
def test_run_python_contract():
    ok = sb.run_python("print(input()[::-1])", stdin="abc\n", timeout_s=5)
    assert (ok.status, ok.exit_code, ok.stdout, ok.stderr) == ("ok", 0, "cba\n", "")
    assert ok.wall_s > 0
    err = sb.run_python("import sys\nprint('x', file=sys.stderr)\nsys.exit(3)", timeout_s=5)
    assert (err.status, err.exit_code, err.stderr) == ("error", 3, "x\n")
    exc = sb.run_python("1/0", timeout_s=5)
    assert exc.status == "error" and "ZeroDivisionError" in exc.stderr
    slow = sb.run_python("import time\ntime.sleep(30)", timeout_s=0.5)
    assert slow.status == "timeout" and slow.exit_code is None and slow.wall_s < 5
    env = sb.run_python("import os\nprint(sorted(os.environ['PYTHONHASHSEED'] + os.getcwd()))", timeout_s=5)
    assert env.stdout.strip() == str(sorted("0/work"))


def test_code_reward_parsing_by_hand():
    text = "Plan.\n```\nprint(0)\n```\nthen\n```python\nprint(1)\n```\nand\n```\nprint(2)\n```\n"
    assert extract_program(text) == "print(1)\n"  # a python block beats a later plain one
    assert extract_program("```\nprint(2)\n```") == "print(2)\n"
    assert extract_program("```py\nx=1\n```") == "x=1\n"
    assert extract_program("```python\nprint(1)\n") is None  # cut off inside its block
    assert extract_program("no code") is None
    assert stdout_matches("3  \n4\n\n\n", "3\n4")
    assert not stdout_matches("3\n4\n", "3\n5\n")
    assert not stdout_matches("34\n", "3\n4\n")
    assert return_matches("[1, 2]", [1, 2]) and return_matches("5", [5]) and not return_matches("5", 6)
    assert not return_matches(None, 1) and not return_matches("nan(", 1)
    assert load_tests('{"inputs": ["1"], "outputs": ["1"]}')["format"] == "stdio"
    assert load_tests('{"fn_name": "f", "inputs": [[1]], "outputs": [1]}')["format"] == "call"
    assert load_tests('{"test": "assert f()", "entry_point": "f"}')["format"] == "test"
    for bad, words in [
        ("not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"inputs": ["1"], "outputs": []}', "1 inputs and 0 outputs"),
        ('{"fn_name": "a b", "inputs": [[1]], "outputs": [1]}', "not an identifier"),
        ('{"inputs": [1], "outputs": ["1"]}', "must be strings"),
    ]:
        with pytest.raises(ValueError, match=words):
            load_tests(bad)
    with pytest.raises(ValueError, match="row 1"):
        compute_rewards("code", ["x", "y"], ['{"inputs": ["1"], "outputs": ["1"]}', "broken"])


STDIO = json.dumps({"inputs": ["1 2\n", "3 4\n", "2 2\n"], "outputs": ["3\n", "7\n", "4\n"]})
CALL = json.dumps({"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]})
HUMANEVAL = json.dumps({"test": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "entry_point": "add"})
MBPP = json.dumps({"test": "assert add(1, 2) == 3\nassert add(0, 0) == 0\n", "entry_point": ""})
ALWAYS_EQUAL = (
    "```python\nclass E(int):\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return E()\n```"
)
EXIT_EARLY = "```python\nimport os\ndef add(a, b):\n    return 0\nos._exit(0)\n```"
SYS_EXIT = "```python\nimport sys\ndef add(a, b):\n    return 0\nsys.exit(0)\n```"
FN = "```python\ndef add(a, b):\n    return a + b\n```"


@needs_bwrap
def test_code_reward_grades_and_cannot_be_forged():
    io = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong_io = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"  # right on 1 of 3
    solution_class = "```python\nclass Solution:\n    def add(self, a, b):\n        return a + b\n```"
    cases = [
        (io, STDIO, True),
        (wrong_io, STDIO, False),
        ("no program", STDIO, False),
        (FN, CALL, True),
        (solution_class, CALL, True),
        (ALWAYS_EQUAL, CALL, False),
        (FN, HUMANEVAL, True),
        (FN, MBPP, True),
        (ALWAYS_EQUAL, HUMANEVAL, False),
        (ALWAYS_EQUAL, MBPP, False),
        (EXIT_EARLY, HUMANEVAL, False),
        (EXIT_EARLY, MBPP, False),
        (SYS_EXIT, HUMANEVAL, False),
        ("```python\nprint('PASSED')\nimport os\nos._exit(0)\n```", HUMANEVAL, False),
    ]
    outputs = compute_rewards("code", [c for c, _, _ in cases], [g for _, g, _ in cases])
    assert [o.correct for o in outputs] == [want for _, _, want in cases]
    assert [o.reward for o in outputs] == [float(want) for _, _, want in cases]
    partial = compute_rewards("code-partial", [wrong_io, io], [STDIO, STDIO])
    assert [(p.reward, p.correct) for p in partial] == [(1 / 3, False), (1.0, True)]  # 2*2 = 2+2 is its one pass
    mixed = compute_rewards("per-row", ["\\boxed{4}", io, "\\boxed{5}"], ["4", STDIO, "4"])
    assert [m.correct for m in mixed] == [True, True, False]


class _StubSandboxFusion(http.server.BaseHTTPRequestHandler):
    """SandboxFusion's /run_code, answered by running the code in the local sandbox (or failing on demand)."""

    mode = "run"

    def do_POST(self):  # noqa: N802 - http.server's name
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/run_code" and request["language"] == "python"
        if self.mode == "timeout":
            answer = {"status": "Failed", "run_result": {"status": "TimeLimitExceeded", "stdout": "", "stderr": ""}}
        elif self.mode == "broken":
            answer = {"status": "SandboxError", "message": "no runner", "run_result": None}
        else:
            source = request["code"]
            local = sb.get_sandbox()
            result = local.run_job({"mode": "run", "source": source}, request["stdin"], sb.Limits(timeout_s=10))
            answer = {
                "status": "Success" if result.exit_code == 0 else "Failed",
                "run_result": {
                    "status": "Finished",
                    "return_code": result.exit_code,
                    "stdout": result.stdout,
                    "stderr": result.stderr,
                    "execution_time": result.wall_s,
                },
            }
        body = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StubSandboxFusion)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        _StubSandboxFusion.mode = "run"


@needs_bwrap
def test_remote_backend_against_a_stub(stub_server):
    server, url = stub_server
    remote = sb.Sandbox.probe(sb.SandboxConfig(backend="remote", url=url, workers=2))
    try:
        assert remote.rung == "remote" and remote.describe()["url"] == url
        got = remote.run_job({"mode": "run", "source": "print(input() * 2)"}, "ab\n", sb.Limits())
        assert (got.status, got.stdout) == ("ok", "abab\n")
        program = {"kind": "stdio", "source": "print(sum(map(int, input().split())))", "cases": ["1 2\n", "5 5\n"]}
        job = {"mode": "grade", "programs": [program | {"timeout_s": 5}], "case_timeout_s": 2, "case_output_bytes": 99}
        cases = sb.parse_program_results(remote.run_job(job, "", sb.Limits()))[0]
        assert [c["stdout"] for c in cases] == ["3\n", "10\n"]
        _StubSandboxFusion.mode = "timeout"
        assert remote.run_job({"mode": "run", "source": "pass"}, "", sb.Limits()).status == "timeout"
        _StubSandboxFusion.mode = "broken"
        broken = remote.run_job({"mode": "run", "source": "pass"}, "", sb.Limits())
        assert broken.status == "sandbox_error" and url in broken.stderr
        with pytest.raises(sb.SandboxUnavailableError, match=re.escape(url)):
            sb.Sandbox.probe(sb.SandboxConfig(backend="remote", url=url))
    finally:
        remote.close()
    dead = sb.Sandbox("remote", sb.SandboxConfig(url="http://127.0.0.1:9"))
    try:
        result = dead.run_job({"mode": "run", "source": "pass"}, "", sb.Limits(timeout_s=1))
        assert result.status == "sandbox_error" and "127.0.0.1:9" in result.stderr
    finally:
        dead.close()


def test_refuses_without_a_sandbox(monkeypatch):
    monkeypatch.setattr(sb.shutil, "which", lambda name: None)
    with pytest.raises(sb.SandboxUnavailableError) as info:
        sb.Sandbox.probe(sb.SandboxConfig())
    message = str(info.value)
    assert "bwrap is not installed" in message and "--sandbox.backend unsafe" in message
    for risk in ("memory", "environment", "kill", "files", "network"):
        assert risk in message
    with pytest.raises(sb.SandboxUnavailableError, match="--sandbox.url"):
        sb.Sandbox.probe(sb.SandboxConfig(backend="remote"))


def test_unsafe_mode_is_explicit_and_still_grades():
    unsafe = sb.Sandbox.probe(sb.SandboxConfig(backend="unsafe", workers=1))
    try:
        assert unsafe.rung == "unsafe"
        got = unsafe.run_job(
            {"mode": "run", "source": "import os\nprint(input(), 'HOME' in os.environ)"},
            "hi\n",
            sb.Limits(timeout_s=10),
        )
        assert (got.status, got.stdout) == ("ok", "hi True\n")
    finally:
        unsafe.close()


@needs_bwrap
def test_real_public_problems_grade_correctly():
    """39 problems from HumanEval, MBPP and TACO (tests/fixtures/code/README.md names each origin): every canonical
    solution is graded correct and every mutated one incorrect, through the sandbox."""
    rows = [json.loads(line) for line in (ROOT / "tests/fixtures/code/public_problems.jsonl").read_text().splitlines()]
    sources = {row["source"] for row in rows}
    assert len(rows) >= 30 and {"humaneval", "mbpp"} <= {s.split("-")[0].lower() for s in sources}
    fence = "```python\n{}\n```".format
    completions = [fence(r["solution"]) for r in rows] + [fence(r["wrong"]) for r in rows]
    outputs = compute_rewards("code", completions, [r["answer"] for r in rows] * 2)
    wrong_grades = [(r["id"], o.correct) for r, o in zip(rows * 2, outputs)]
    assert all(o.correct for o in outputs[: len(rows)]), wrong_grades[: len(rows)]
    assert not any(o.correct for o in outputs[len(rows) :]), wrong_grades[len(rows) :]


@needs_bwrap
def test_a_hostile_program_cannot_cost_its_neighbours_their_reward():
    """Programs share a sandbox run one after another: one that kills the harness, or leaves a daemon that kills
    everything later, or spins past its deadline, fails alone; the correct programs around it still pass."""
    io = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    hostile = [
        "```python\nimport os\nos.kill(os.getppid(), 9)\n```",
        "```python\nimport os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(0.3)\n    os.kill(-1, 9)\n"
        "print(3)\n```",
        "```python\nimport os\nopen('/tmp/x', 'w').write('1 2')\nos.chmod('/tmp', 0o500)\nprint(3)\n```",
        "```python\nwhile True:\n    try:\n        while True:\n            pass\n"
        "    except BaseException:\n        pass\n```",
    ]
    completions = [c for h in hostile for c in (io, h)] + [io]
    outputs = compute_rewards("code", completions, [STDIO] * len(completions))
    assert [o.correct for o in outputs] == [True, False] * len(hostile) + [True]


@needs_bwrap
def test_shared_runs_grade_as_one_run_per_program(monkeypatch):
    """The shared-run path (up to 16 programs a run) gives the same per-case statuses as one run per program."""
    from common import code_reward

    rows = [json.loads(line) for line in (ROOT / "tests/fixtures/code/public_problems.jsonl").read_text().splitlines()]
    fence = "```python\n{}\n```".format
    completions = [fence(r["solution"]) for r in rows] + [fence(r["wrong"]) for r in rows]
    golds = [r["answer"] for r in rows] * 2
    shared = [g.statuses for g in code_reward.grade_code_batch(completions, golds)]
    monkeypatch.setattr(code_reward, "MAX_PROGRAMS_PER_RUN", 1)
    alone = [g.statuses for g in code_reward.grade_code_batch(completions, golds)]
    assert shared == alone
