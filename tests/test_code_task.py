"""The tiny code task ``code-expr`` (common/tasks.py) and its shipped warm start (common/tiny_code_model).

Programs here are the generator's own (trusted): they run in a plain subprocess, all of them in one, through a small
harness that feeds each test's stdin and captures stdout. Model-written programs never run here.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common import tasks
from common.data import DATASETS, TINY_CODE_MODEL_DIR, load_problems, resolve_model_path
from common.tasks import CODE_SPECS, corrupt_code_solution, load_code, make_code_problems

FENCE = re.compile(r"```python\n(.*?)```", re.DOTALL)
HARNESS = """
import io, json, sys
out = []
for source, inputs in json.load(sys.stdin):
    results = []
    for stdin in inputs:
        sys.stdin, sys.stdout = io.StringIO(stdin), io.StringIO()
        try:
            exec(source, {"__name__": "__main__"})
            results.append(sys.stdout.getvalue())
        except Exception as e:
            results.append(f"error: {type(e).__name__}")
        finally:
            sys.stdout = sys.__stdout__
    out.append(results)
sys.stdout.write(json.dumps(out))
"""


def program_of(solution: str) -> str:
    blocks = FENCE.findall(solution)
    assert len(blocks) == 1, solution
    return blocks[0]


def run_trusted(jobs: list[tuple[str, list[str]]]) -> list[list[str]]:
    """stdout of each (program, stdin) pair, every program run in one trusted subprocess."""
    done = subprocess.run(
        [sys.executable, "-I", "-c", HARNESS], input=json.dumps(jobs), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def passes(outputs: list[str], expected: list[str]) -> list[bool]:
    return [got.rstrip() == want.rstrip() for got, want in zip(outputs, expected, strict=True)]


@pytest.fixture(scope="module")
def splits():
    return load_problems("code-expr", "train"), load_problems("code-expr", "test")


def test_sizes_disjoint_and_deterministic(splits):
    train, test = splits
    assert len(train) == tasks.CODE_TRAIN_SIZE and len(test) == tasks.CODE_TEST_SIZE == 200
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in test}
    spec = CODE_SPECS["code-expr"]
    assert make_code_problems(tasks.CODE_TEST_SIZE, tasks.CODE_TEST_SEED, spec) == test  # no cache: same stream
    assert make_code_problems(300, tasks.CODE_TRAIN_SEED, spec, {p["prompt"] for p in test}) == train[:300]
    assert load_code("code-expr", "test") == test
    with pytest.raises(ValueError, match="splits"):
        load_code("code-expr", "validation")


def test_first_problem_is_pinned(splits):
    # the shipped tiny-code model was warm-started on this exact stream; values below worked out by hand
    problem = splits[1][0]
    assert problem["prompt"] == "Read a b. Print abs(a*b)+5."
    assert problem["solution"] == "```python\na,b=map(int,input().split())\nprint(abs(a*b)+5)\n```"
    assert problem["verifier"] == "code"
    tests = json.loads(problem["answer"])
    assert tests["inputs"][:3] == ["0 -5\n", "-4 -5\n", "-5 2\n"]
    assert tests["outputs"][:3] == ["5\n", "25\n", "15\n"]  # |0*-5|+5, |-4*-5|+5, |-5*2|+5
    assert splits[0][0]["prompt"] == "Read a b c. Print abs(c*a)+b."


def test_problem_shape(splits):
    train, test = splits
    for p in test + train[::50]:
        assert set(p) == {"prompt", "answer", "solution", "verifier"} and p["verifier"] == "code"
        names = p["prompt"].split(". Print ")[0].removeprefix("Read ").split()
        assert names in (["a", "b"], ["a", "b", "c"]), p["prompt"]
        expr = p["prompt"].split(". Print ")[1].removesuffix(".")
        assert program_of(p["solution"]) == f"{','.join(names)}=map(int,input().split())\nprint({expr})\n"
        tests = json.loads(p["answer"])
        assert set(tests) == {"inputs", "outputs"} and len(tests["inputs"]) == len(tests["outputs"]) == 10
        rows = [[int(x) for x in line.split()] for line in tests["inputs"]]
        assert all(line.endswith("\n") for line in tests["inputs"] + tests["outputs"])
        assert all(len(row) == len(names) and all(-9 <= x <= 9 for x in row) for row in rows)
        assert 0 in rows[0] and all(x < 0 for x in rows[1])  # every problem tests a zero and all-negative inputs
        assert len(set(tests["outputs"])) > 1  # a program that prints a constant fails


def test_canonical_programs_pass_their_hidden_tests(splits):
    train, test = splits
    problems = test + train[::20]
    golds = [json.loads(p["answer"]) for p in problems]
    outputs = run_trusted([(program_of(p["solution"]), g["inputs"]) for p, g in zip(problems, golds)])
    for p, g, out in zip(problems, golds, outputs):
        assert all(passes(out, g["outputs"])), (p["prompt"], out, g["outputs"])
    # and as a real program on a real stdin, byte for byte
    for p, g in zip(problems[:3], golds[:3]):
        done = subprocess.run(
            [sys.executable, "-I", "-c", program_of(p["solution"])],
            input=g["inputs"][2],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.stdout == g["outputs"][2], p["prompt"]


def test_corrupted_demonstrations_fail_a_hidden_test(splits):
    train, test = splits
    rng = random.Random(0)
    problems = test[:100] + train[:200]
    corrupted = [corrupt_code_solution(p, rng) for p in problems]
    golds = [json.loads(p["answer"]) for p in problems]
    outputs = run_trusted([(program_of(s), g["inputs"]) for s, g in zip(corrupted, golds)])
    for p, wrong, g, out in zip(problems, corrupted, golds, outputs):
        right_lines, wrong_lines = p["solution"].split("\n"), wrong.split("\n")
        assert wrong_lines[:2] == right_lines[:2] and wrong_lines[3:] == right_lines[3:]  # only the print line
        changed = [
            (x, y)
            for x, y in zip(re.findall(r"[a-z]+|\d+|.", right_lines[2]), re.findall(r"[a-z]+|\d+|.", wrong_lines[2]))
            if x != y
        ]
        assert len(changed) == 1, (right_lines[2], wrong_lines[2])  # one token swapped for one of its kind
        assert not all(passes(out, g["outputs"])), (p["prompt"], wrong)
    # deterministic given the rng
    rng = random.Random(0)
    assert [corrupt_code_solution(p, rng) for p in problems] == corrupted


def test_corruption_by_hand():
    problem = {
        "prompt": "Read a b. Print a*b.",
        "answer": json.dumps({"inputs": ["2 3\n", "0 5\n"], "outputs": ["6\n", "0\n"]}),
        "solution": "```python\na,b=map(int,input().split())\nprint(a*b)\n```",
    }
    seen = {corrupt_code_solution(problem, random.Random(seed)).split("\n")[2] for seed in range(200)}
    # a+b (5, 5) and a-b (-1, -5) fail; b*b (9, 25) fails; a*a (4, 0) fails the first test
    assert seen == {"print(a+b)", "print(a-b)", "print(b*b)", "print(a*a)"}
    with pytest.raises(ValueError, match="not a code-expr solution"):
        corrupt_code_solution({**problem, "solution": "print(1)"}, random.Random(0))


def test_registry_and_model_name():
    assert DATASETS["code-expr"].reward_fn == "code"
    assert DATASETS["code-expr"].default_template == "chat"
    assert Path(resolve_model_path("tiny-code")) == TINY_CODE_MODEL_DIR


def test_shipped_tokenizer_fits_the_default_budget(splits):
    from transformers import AutoTokenizer

    from common.data import format_prompt

    tokenizer = AutoTokenizer.from_pretrained(TINY_CODE_MODEL_DIR)
    for p in splits[1][:50]:
        text = format_prompt(p["prompt"], "chat", tokenizer) + p["solution"]
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
        # the scripts' default --max-new-tokens is 40: a solution plus its end-of-turn token fits with room to spare
        assert len(tokenizer(p["solution"] + tokenizer.eos_token)["input_ids"]) <= 30, p["solution"]


def test_code_reward_grades_the_task():
    """The gold format is the grader's: canonical programs score 1, corrupted ones 0 (through the sandbox)."""
    verifiers = pytest.importorskip("common.verifiers")
    sandbox = pytest.importorskip("common.sandbox")
    problems = load_code("code-expr", "test")[:8]
    rng = random.Random(1)
    texts = [p["solution"] for p in problems] + [corrupt_code_solution(p, rng) for p in problems]
    try:
        rewards = verifiers.compute_rewards("code", texts, [p["answer"] for p in problems] * 2)
    except sandbox.SandboxUnavailableError as e:
        pytest.skip(f"no sandbox rung on this machine: {e}")
    assert [r.correct for r in rewards] == [True] * 8 + [False] * 8
    assert [r.reward for r in rewards] == [1.0] * 8 + [0.0] * 8


def test_shipped_model_card_names_the_command():
    card = (TINY_CODE_MODEL_DIR / "README.md").read_text()
    assert "`python scripts/build_tiny_model.py --task code-expr` (seed 0)" in card
