"""The claims testbed's code test mix ``code-expr-eq`` and the partial-credit registrations ``<name>-partial``.

``code-expr-eq`` is ``code-expr`` with its last 5 of 10 hidden tests reading one value into every variable, so that a
program that confuses two variables passes half the tests (the claims4 code-reward comparison; design log:
benchmarks/results/claims/README.md, "Round 3a / claims4"). Expected values are worked out by hand.
"""

from __future__ import annotations

import json

import pytest

from common import tasks
from common.data import DATASETS, load_problems
from common.tasks import CODE_SPECS, CodeSpec, load_code, make_code_problems


@pytest.fixture(scope="module")
def eq_test():
    return load_problems("code-expr-eq", "test")


def rows_of(problem: dict) -> list[list[int]]:
    return [[int(x) for x in line.split()] for line in json.loads(problem["answer"])["inputs"]]


def test_the_default_stream_is_unchanged():
    # equal_tests = 0 draws nothing more: code-expr's problems (the tiny-code warm start's stream) stay as pinned
    assert CodeSpec().equal_tests == 0
    assert load_code("code-expr", "test")[0]["prompt"] == "Read a b. Print abs(a*b)+5."
    assert json.loads(load_code("code-expr", "test")[0]["answer"])["inputs"][:3] == ["0 -5\n", "-4 -5\n", "-5 2\n"]


def test_the_test_mix(eq_test):
    train = load_problems("code-expr-eq", "train")
    assert len(eq_test) == tasks.CODE_TEST_SIZE and len(train) == tasks.CODE_TRAIN_SIZE
    assert not {p["prompt"] for p in eq_test} & {p["prompt"] for p in train}
    for p in eq_test + train[::50]:
        rows = rows_of(p)
        assert len(rows) == 10
        assert 0 in rows[0] and all(x < 0 for x in rows[1])  # the zero row and the all-negative row stay
        assert all(len(set(row)) == 1 for row in rows[5:])  # the easy tests: a = b (= c)
        assert all(-9 <= x <= 9 for row in rows for x in row)


def test_first_held_out_problem_by_hand(eq_test):
    problem = eq_test[0]
    assert problem["prompt"] == "Read a b. Print abs(a*b)+5."
    tests = json.loads(problem["answer"])
    assert tests["inputs"][5:] == ["-9 -9\n", "-8 -8\n", "-2 -2\n", "-6 -6\n", "-2 -2\n"]
    # |81|+5, |64|+5, |4|+5, |36|+5, |4|+5
    assert tests["outputs"][5:] == ["86\n", "69\n", "9\n", "41\n", "9\n"]


def test_a_confused_variable_passes_the_easy_tests(eq_test):
    # abs(a*a)+5 instead of abs(a*b)+5: right on (0, -5) (5 = 5) and on the five a = b rows, wrong on
    # (-4, -5): 21 vs 25, (-5, 2): 30 vs 15, (-8, -9): 69 vs 77, (-6, 9): 41 vs 59 -> 6 of 10
    from common.verifiers import compute_rewards

    problem = eq_test[0]
    wrong = problem["solution"].replace("a*b", "a*a")
    binary = compute_rewards("code", [problem["solution"], wrong], [problem["answer"]] * 2)
    partial = compute_rewards("code-partial", [problem["solution"], wrong], [problem["answer"]] * 2)
    assert [o.reward for o in binary] == [1.0, 0.0]
    assert [o.reward for o in partial] == [1.0, 0.6]
    assert [o.correct for o in partial] == [True, False]  # partial credit never counts as correct


def test_partial_registrations():
    for name in CODE_SPECS:
        assert DATASETS[name].reward_fn == "code"
        assert DATASETS[f"{name}-partial"].reward_fn == "code-partial"
        assert DATASETS[f"{name}-partial"].loader("test") == DATASETS[name].loader("test")  # the same problems


def test_equal_tests_bounds():
    with pytest.raises(ValueError, match="equal_tests"):
        make_code_problems(1, 0, CodeSpec(equal_tests=9))
    spec = CodeSpec(equal_tests=8)  # the largest: the zero row and the all-negative row stay
    rows = rows_of(make_code_problems(1, 0, spec)[0])
    assert all(len(set(row)) == 1 for row in rows[2:])
