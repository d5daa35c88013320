"""Code as a verifiable reward: the program in a completion, run against hidden tests in the sandbox.

The gold of a code problem is a JSON string of tests in one of three formats (``load_tests`` checks it):

    stdin/stdout  {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}           APPS, TACO, CodeContests, DeepCoder
    call-based    {"fn_name": "f", "inputs": [[1, 2], ...], "outputs": [3, ...]}  APPS; LiveCodeBench's functional
                  tests (``Solution().f`` when no top-level ``f`` exists)
    test code     {"test": "<asserts, or def check(candidate)>", "entry_point": "f"}   HumanEval, MBPP (evaluation)

The program is the completion's last fenced code block: the last ```` ```python ```` / ```` ```py ```` block, else
the last plain fence (``extract_program``). A program's tests all run in one forked process of its own (each case
with its own stdin/stdout files and alarm, ``common/sandbox_harness.py``); up to MAX_PROGRAMS_PER_RUN programs share
one sandbox run, one after another, where the sandbox has its own pid namespace: between two programs every process
of the first is killed and the scratch folders emptied. Runs go in parallel on the sandbox's worker pool.

The grade cannot be forged from inside the sandbox: in the stdin/stdout and call-based formats the expected outputs
never enter it, and the trainer compares what the program printed (each output line with trailing whitespace
stripped, trailing blank lines dropped) or the JSON of what it returned (an object whose ``__eq__`` always says True
does not serialise). In the test-code format a pass is a random sentinel the harness prints after the last check,
never an exit code, so ``os._exit(0)`` before the asserts fails; that format shares a process between the program and
its checks, so it is for evaluation sets (HumanEval, MBPP), not training.
"""

from __future__ import annotations

import json
import re
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from common.sandbox import Limits, SandboxConfig, get_sandbox, parse_program_results

_FENCE_RE = re.compile(r"```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
PYTHON_TAGS = ("python", "py", "python3")


def extract_program(completion: str) -> str | None:
    """The last ```` ```python ````/```` ```py ```` block's body, else the last fenced block's, else None.

    A fence must be closed: a completion cut off inside its block has no program.
    """
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE_RE.finditer(completion)]
    python = [body for tag, body in blocks if tag in PYTHON_TAGS]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else None


def load_tests(gold: str) -> dict:
    """Parse and check a gold tests string; ``ValueError`` says what is wrong. Returns the dict, with a ``format``
    key added: "stdio", "call" or "test"."""
    try:
        tests = json.loads(gold)
    except (TypeError, ValueError) as e:
        raise ValueError(f"code tests are not valid JSON ({e}): {str(gold)[:80]!r}") from None
    if not isinstance(tests, dict):
        raise ValueError(f"code tests must be a JSON object, got {type(tests).__name__}")
    if "test" in tests:
        if not isinstance(tests["test"], str) or not tests["test"].strip():
            raise ValueError("code tests: 'test' must be non-empty code")
        if not isinstance(tests.get("entry_point", ""), str):
            raise ValueError("code tests: 'entry_point' must be a string")
        return {"format": "test", "test": tests["test"], "entry_point": tests.get("entry_point", "")}
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ValueError("code tests need 'inputs' and 'outputs' lists (or 'test' code)")
    if len(inputs) != len(outputs) or not inputs:
        raise ValueError(f"code tests: {len(inputs)} inputs and {len(outputs)} outputs (need equal, non-zero)")
    fn_name = tests.get("fn_name")
    if fn_name:
        if not isinstance(fn_name, str) or not fn_name.isidentifier():
            raise ValueError(f"code tests: fn_name {fn_name!r} is not an identifier")
        if not all(isinstance(args, list) for args in inputs):
            raise ValueError("code tests: call-based inputs must each be a list of arguments")
        return {"format": "call", "fn_name": fn_name, "inputs": inputs, "outputs": outputs}
    if not all(isinstance(x, str) for x in inputs + outputs):
        raise ValueError("code tests: stdin/stdout inputs and outputs must be strings")
    return {"format": "stdio", "inputs": inputs, "outputs": outputs}


def is_code_gold(gold: str) -> bool:
    """Whether ``gold`` is a code tests string (how a mixed math+code dataset's rows pick their verifier)."""
    if not isinstance(gold, str) or not gold.lstrip().startswith("{"):
        return False
    try:
        load_tests(gold)
    except ValueError:
        return False
    return True


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.replace("\r\n", "\n").rstrip().split("\n")]


def stdout_matches(actual: str, expected: str) -> bool:
    """Line by line, trailing whitespace of each line and trailing blank lines ignored."""
    return _lines(actual) == _lines(expected)


def return_matches(returned: str | None, expected) -> bool:
    """JSON of the returned value equals the expected value; APPS wraps some outputs in a one-element list, which
    counts as the value itself (as its own evaluator does)."""
    if returned is None:
        return False
    try:
        value = json.loads(returned)
    except ValueError:
        return False
    if value == expected:
        return True
    return isinstance(expected, list) and len(expected) == 1 and value == expected[0]


@dataclass
class CodeGrade:
    """One completion's grade: tests passed of total, and how each case ended."""

    passed: int
    total: int
    statuses: list[str] = field(default_factory=list)  # per case: ok (ran), wrong, error, timeout, memory, ...

    @property
    def correct(self) -> bool:
        return self.total > 0 and self.passed == self.total

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


MAX_PROGRAMS_PER_RUN = 16
"""Programs graded one after another in one sandbox run (its start-up, ~20-60 ms, is paid once per run)."""


def _program(source: str, tests: dict, timeout_s: float) -> tuple[dict, str]:
    """The harness's description of one program and its cases; returns it and its sentinel ("" unless test code)."""
    if tests["format"] == "test":
        sentinel = "PASSED-" + secrets.token_hex(16)
        program = {"kind": "test", "cases": [""], "test": tests["test"], "entry_point": tests["entry_point"]}
        return program | {"source": source, "sentinel": sentinel, "timeout_s": timeout_s}, sentinel
    kind = "call" if tests["format"] == "call" else "stdio"
    program = {"kind": kind, "source": source, "cases": tests["inputs"], "fn_name": tests.get("fn_name", "")}
    return program | {"timeout_s": timeout_s}, ""


def _grade_cases(cases: list[dict] | None, tests: dict, total: int, sentinel: str, died: str) -> CodeGrade:
    if cases is None:  # the program never reported: it took its sandbox run down with it
        return CodeGrade(0, total, [died] * total)
    statuses = []
    for i in range(total):
        case = cases[i] if i < len(cases) else {"status": "not_run"}
        status = case.get("status", "error")
        if status == "ok":
            if tests["format"] == "test":
                lines = [line for line in str(case.get("stdout", "")).splitlines() if line.strip()]
                passed = bool(lines) and lines[-1].strip() == sentinel
            elif tests["format"] == "call":
                passed = return_matches(case.get("return"), tests["outputs"][i])
            else:
                passed = stdout_matches(str(case.get("stdout", "")), tests["outputs"][i])
            status = "pass" if passed else "wrong"
        statuses.append(status)
    return CodeGrade(statuses.count("pass"), total, statuses)


def _run_programs(sandbox, programs: list[dict], config: SandboxConfig) -> list[list[dict] | None]:
    """Grade ``programs`` in sandbox runs of up to MAX_PROGRAMS_PER_RUN, in parallel; one per run where the rung has
    no pid namespace of its own (nothing then guarantees a program leaves nothing behind for the next). A program
    that brings its run down is failed; the programs after it in that run are graded again, each in a run of its own,
    so one hostile program cannot cost its neighbours their reward."""
    shared = sandbox.rung in ("bwrap", "bwrap-root")
    per_run = MAX_PROGRAMS_PER_RUN if shared else 1
    if shared:  # enough runs to keep every worker busy
        workers = sandbox.describe()["workers"]
        per_run = max(1, min(per_run, -(-len(programs) // (2 * workers))))
    common = {"mode": "grade", "case_timeout_s": config.case_timeout_s, "case_output_bytes": 1 << 16}

    def submit(indices: list[int]):
        job = common | {"programs": [programs[i] for i in indices], "kill_all": shared}
        limits = Limits(timeout_s=sum(programs[i]["timeout_s"] for i in indices) + 0.5, memory_mb=config.memory_mb)
        return indices, sandbox.submit(job, "", limits)

    runs = [
        submit(list(range(start, min(start + per_run, len(programs))))) for start in range(0, len(programs), per_run)
    ]
    results: list[list[dict] | None] = [None] * len(programs)
    again = []
    for indices, future in runs:
        found = parse_program_results(future.result())
        for position, index in enumerate(indices):
            if position in found:
                results[index] = found[position]
            elif position == len(found) or len(indices) == 1:  # the program that was running when the run ended
                results[index] = None
            else:
                again.append(index)
    for indices, future in [submit([i]) for i in again]:
        results[indices[0]] = parse_program_results(future.result()).get(0)
    return results


def grade_code_batch(
    completions: Sequence[str], golds: Sequence[str], config: SandboxConfig | None = None
) -> list[CodeGrade]:
    """Grade every completion against its gold tests in the sandbox, in parallel.

    A completion without a program fails every test ("no_code"); a gold that is not a tests string raises
    ValueError naming the row, since it is the dataset's fault, not the policy's.
    """
    sandbox = get_sandbox()
    config = config or sandbox.config
    parsed, programs, owners = [], [], []
    for row, (completion, gold) in enumerate(zip(completions, golds)):
        try:
            tests = load_tests(gold)
        except ValueError as e:
            raise ValueError(f"code reward, row {row}: {e}") from None
        source = extract_program(completion)
        total = 1 if tests["format"] == "test" else len(tests["inputs"])
        sentinel = ""
        if source is not None:
            program, sentinel = _program(source, tests, config.timeout_s)
            programs.append(program)
            owners.append(row)
        parsed.append((tests, total, sentinel, source is not None))
    ran = dict(zip(owners, _run_programs(sandbox, programs, config))) if programs else {}
    grades = []
    for row, (tests, total, sentinel, has_program) in enumerate(parsed):
        if not has_program:
            grades.append(CodeGrade(0, total, ["no_code"] * total))
        else:
            grades.append(_grade_cases(ran[row], tests, total, sentinel, "crashed"))
    return grades


def code_stats(grades: Sequence[CodeGrade]) -> dict[str, float]:
    """Step metrics: mean fraction of tests passed, all-pass rate, and the share of test cases per status."""
    if not grades:
        return {}
    counts = Counter(status for g in grades for status in g.statuses)
    cases = max(1, sum(counts.values()))
    stats = {
        "code/tests_passed_frac": sum(g.fraction for g in grades) / len(grades),
        "code/all_pass": sum(g.correct for g in grades) / len(grades),
    }
    stats |= {f"code/status_{status}": n / cases for status, n in sorted(counts.items())}
    return stats
