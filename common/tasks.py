"""The offline synthetic tasks: verifiable problems generated from a seed, no network needed.

``arith`` (the tiny default) is chain arithmetic such as ``4+7-2=?`` with the worked solution
``4+7=11;11-2=9;\\boxed{9}`` and the gold answer ``9``; ``arith-hard`` has one operand more than the shipped model's
warm start saw. Each task's held-out split is disjoint from its train split. ``common/data.py`` registers every
task here by name, the arith tasks scored with the exact-match verifier.

``code-expr`` is the tiny code task: the prompt ``Read a b c. Print (a-b)*c.`` asks for a program, the worked solution
is one fenced Python block (``a,b,c=map(int,input().split())`` then ``print((a-b)*c)``), and the gold answer is 10
hidden stdin/stdout tests as JSON, graded by the ``code`` verifier (every problem says ``"verifier": "code"``). Its
warm start (``--model tiny-code``, ``scripts/build_tiny_model.py --task code-expr``) saw one token of the printed
expression swapped in half the demonstrations (``corrupt_code_solution``), so RL has a habit to remove.

``arith-tool`` is the tiny tool task: products such as ``347*29=?`` (3-digit times 2-digit), too large for a
1M-parameter model to multiply in its head, trivial for the calculator tool (``--tools.format python --tools.tool
calculator``). The worked solution calls it (``tool_arith_segments``): a python block ``347*29``, the output fence the
tool loop appends, then ``\\boxed{10063}``. Its warm start (``--model tiny-tool``, ``scripts/build_tiny_model.py
--task arith-tool``) saw a call in 40% of the demonstrations (about one call in seven of them malformed, ``347x29``,
refused by the calculator and followed by a guess) and a direct answer in the rest (``sample_tool_demonstration``),
so RL has a call rate to raise and a tool error rate to lower.

The claims testbed (``benchmarks/suites/claims.toml``) adds two variants built so a paper's mechanism can act:

* ``arith-pad``: the worked solutions restate the running total 0..``max_redundant`` times (``11=11;``) before the
  answer, so a policy warm-started on them (``scripts/build_tiny_model.py --task arith-pad``) chooses its length
  freely; the verifier reads only ``\\boxed{}`` (Dr. GRPO's length bias).
* ``arith-mix``: 3 or 4 operands at random, easy and hard prompts in one batch; its train split excludes
  ``arith-hard``'s held-out problems, the set it is evaluated on (MaxRL's pass@k at large k).
* ``arith-long``: 6 operands, a 5-step worked solution. Its warm start (``--corrupt step``) saw one intermediate
  result wrong in half the demonstrations, the later steps carried on from the wrong total, so a wrong answer
  comes from one token somewhere in the chain: per-token credit has something to find (the dense-credit claim).
* ``arith-pad-long``: ``arith-pad`` with 4 operands and the same step-corrupted warm start, so that wrong answers
  stay common late in training (Dr. GRPO's length claim, redesigned).
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass

Problem = dict[str, str]  # prompt, answer, solution (code tasks: and verifier): see common/data.py


# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ArithSpec:
    """Shape of the synthetic chain-arithmetic task."""

    n_terms: int = 3  # operands per problem (the most, with min_terms)
    max_operand: int = 9  # operands are drawn from 0..max_operand
    min_terms: int = 0  # > 0: each problem draws its operand count from min_terms..n_terms
    max_redundant: int = 0  # > 0: each solution restates the running total 0..max_redundant times (free length)
    exclude_test_of: tuple[str, ...] = ()  # tasks whose held-out prompts this task's train split leaves out


ARITH_SPECS = {
    "arith": ArithSpec(n_terms=3, max_operand=9),  # the tiny default: 1-digit operands
    "arith-hard": ArithSpec(
        n_terms=4, max_operand=9
    ),  # one operand more than the warm start saw: ~3% sampled accuracy (LUFFY demo)
    "arith-pad": ArithSpec(n_terms=3, max_operand=9, max_redundant=6),  # Dr. GRPO claim: length is the policy's choice
    "arith-mix": ArithSpec(n_terms=4, max_operand=9, min_terms=3, exclude_test_of=("arith-hard",)),  # MaxRL claim
    "arith-long": ArithSpec(n_terms=6, max_operand=9),  # dense-credit and asymptote claims: 5 steps, one can go wrong
    "arith-pad-long": ArithSpec(n_terms=4, max_operand=9, max_redundant=6),  # Dr. GRPO, redesigned: errors stay common
}
ARITH_TEST_SIZE = 200  # held-out problems per arith task
ARITH_TEST_SEED = 999
ARITH_TRAIN_SIZE = 20_000
ARITH_TRAIN_SEED = 0


def make_arith_problem(rng: random.Random, spec: ArithSpec) -> Problem:
    """One problem, e.g. prompt ``4+7-2=?``, answer ``9``, solution ``4+7=11;11-2=9;\\boxed{9}``.

    With ``spec.max_redundant`` the solution repeats the final total k times, k uniform in 0..max_redundant, e.g.
    ``4+7=11;11-2=9;9=9;9=9;\\boxed{9}``: the same answer at a length the policy is free to choose.
    """
    n_terms = rng.randint(spec.min_terms, spec.n_terms) if spec.min_terms else spec.n_terms
    operands = [rng.randint(0, spec.max_operand) for _ in range(n_terms)]
    ops = [rng.choice("+-") for _ in range(n_terms - 1)]
    prompt, total, steps = str(operands[0]), operands[0], []
    for op, x in zip(ops, operands[1:]):
        new_total = total + x if op == "+" else total - x
        steps.append(f"{total}{op}{x}={new_total}")
        prompt += f"{op}{x}"
        total = new_total
    if spec.max_redundant:
        steps += [f"{total}={total}"] * rng.randint(0, spec.max_redundant)
    solution = ";".join(steps) + f";\\boxed{{{total}}}"
    return {"prompt": prompt + "=?", "answer": str(total), "solution": solution}


def make_arith_problems(n: int, seed: int, spec: ArithSpec, exclude: set[str] | None = None) -> list[Problem]:
    """``n`` problems from a seeded stream, skipping any whose prompt is in ``exclude``."""
    rng, out = random.Random(seed), []
    exclude = exclude or set()
    while len(out) < n:
        p = make_arith_problem(rng, spec)
        if p["prompt"] not in exclude:
            out.append(p)
    return out


@functools.lru_cache(maxsize=None)
def _arith_split(name: str, split: str) -> tuple[Problem, ...]:
    """Generated once per process (about 0.2 s for the 20k train problems), then reused."""
    spec = ARITH_SPECS[name]
    test = make_arith_problems(ARITH_TEST_SIZE, ARITH_TEST_SEED, spec)
    if split == "test":
        return tuple(test)
    exclude = {p["prompt"] for p in test} | {
        p["prompt"] for other in spec.exclude_test_of for p in _arith_split(other, "test")
    }
    train = make_arith_problems(ARITH_TRAIN_SIZE, ARITH_TRAIN_SEED, spec, exclude=exclude)
    return tuple(train)


def load_arith(name: str, split: str) -> list[Problem]:
    if split not in ("train", "test"):
        raise ValueError(f"dataset {name!r} has splits 'train' and 'test', not {split!r}")
    return [dict(p) for p in _arith_split(name, split)]  # copies, so callers cannot corrupt the cache


# ----------------------------------------------------------------------------------------------
# code-expr: short programs graded by hidden stdin/stdout tests
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CodeSpec:
    """Shape of the synthetic read-integers-print-an-expression task."""

    max_vars: int = 3  # the program reads 2..max_vars integers, named a, b, c
    max_constant: int = 9  # constants in the expression are drawn from 2..max_constant
    max_input: int = 9  # test inputs are drawn from -max_input..max_input
    num_tests: int = 10  # hidden stdin/stdout tests per problem
    equal_tests: int = 0  # of those, the last ones read one value into every variable (a=b=c): the easy tests


CODE_SPECS = {
    "code-expr": CodeSpec(),  # the tiny code task; its warm start is common/tiny_code_model (--model tiny-code)
    # the claims testbed's test mix (claims4, code reward design): half the tests read one value into every
    # variable, so a program that confuses two variables passes them; tiny-code's warm start fits it unchanged
    "code-expr-eq": CodeSpec(equal_tests=5),
}
CODE_TEST_SIZE = 200  # held-out problems per code task
CODE_TEST_SEED = 999
CODE_TRAIN_SIZE = 10_000
CODE_TRAIN_SEED = 0
CODE_VARS = "abc"
CODE_OPS = "+-*"
CODE_FUNCS = ("max", "min")
_CODE_EXPR_RE = re.compile(r"[a-z0-9+\-*(),]+")
_CODE_TOKEN_RE = re.compile(r"[a-z]+|\d+|.")
_CODE_BUILTINS = {"__builtins__": {}, "max": max, "min": min, "abs": abs}


def code_program(names: str, expr: str) -> str:
    """The canonical program: read the integers ``names`` (e.g. ``"abc"``) from one stdin line, print ``expr``."""
    return f"{','.join(names)}=map(int,input().split())\nprint({expr})\n"


def code_solution(names: str, expr: str) -> str:
    """The worked solution: exactly one fenced Python block holding ``code_program(names, expr)``."""
    return f"```python\n{code_program(names, expr)}```"


def eval_code_expr(expr: str, names: str, values: list[int]) -> int:
    """Value of one of this module's own generated expressions (never model output) at ``values``."""
    if not _CODE_EXPR_RE.fullmatch(expr):
        raise ValueError(f"not a code-expr expression: {expr!r}")
    return eval(_compile_code_expr(expr), dict(_CODE_BUILTINS), dict(zip(names, values)))


@functools.lru_cache(maxsize=1 << 16)
def _compile_code_expr(expr: str):
    return compile(expr, "<code-expr>", "eval")  # trusted: built from this module's grammar (CODE_FORMS)


# operand slots X (a variable or a constant), operators O (+ - *) and S (+ -), functions F (max, min)
# (no bare abs(XOX): its rare closing "))" is the one bracket pattern a 1M-parameter warm start fails to copy)
CODE_FORMS = ("XOX", "XOXOX", "XOXOXOX", "(XSX)*X", "(XSX)*XOX", "F(X,X)OX", "F(X,X)OXOX", "abs(XOX)OX")


def _code_expr(rng: random.Random, names: str, spec: CodeSpec) -> str:
    """One expression over ``names`` in one of ``CODE_FORMS`` with at least one slot per variable, e.g. ``a+b*c``,
    ``(c-a)*b+4``, ``max(a,b)-c`` or ``abs(a-b)*7``: each variable in a slot of its own, every other slot a variable
    or a constant 2..max_constant (even odds)."""
    form = rng.choice([f for f in CODE_FORMS if f.count("X") >= len(names)])
    slots = form.count("X")
    operands = [
        rng.choice(names) if rng.random() < 0.5 else str(rng.randint(2, spec.max_constant)) for _ in range(slots)
    ]
    for name, slot in zip(names, rng.sample(range(slots), len(names))):
        operands[slot] = name
    operands.reverse()
    out = []
    for c in form.replace("abs", "@"):
        if c == "X":
            out.append(operands.pop())
        elif c == "O":
            out.append(rng.choice(CODE_OPS))
        elif c == "S":
            out.append(rng.choice("+-"))
        elif c == "F":
            out.append(rng.choice(CODE_FUNCS))
        else:
            out.append("abs" if c == "@" else c)
    return "".join(out)


def _code_tests(rng: random.Random, names: str, spec: CodeSpec) -> list[list[int]]:
    """``spec.num_tests`` input rows: the first has one zero, the second is all negative, the rest uniform; the last
    ``spec.equal_tests`` then read one uniform value into every variable (drawn after the others, so a spec without
    them draws exactly the stream it always did)."""
    values = range(-spec.max_input, spec.max_input + 1)
    rows = [rng.choices(values, k=len(names)) for _ in range(spec.num_tests)]
    rows[0][rng.randrange(len(names))] = 0
    rows[1] = rng.choices(range(-spec.max_input, 0), k=len(names))
    if not 0 <= spec.equal_tests <= spec.num_tests - 2:  # keep the zero row and the all-negative row
        raise ValueError(f"equal_tests must be in 0..num_tests-2, got {spec.equal_tests} of {spec.num_tests}")
    for i in range(spec.num_tests - spec.equal_tests, spec.num_tests):
        rows[i] = [rng.choice(values)] * len(names)
    return rows


def code_tests_json(rows: list[list[int]], outputs: list[int]) -> str:
    """The gold: hidden tests in the stdin/stdout format ``{"inputs": ["3 4 5\\n", ...], "outputs": ["7\\n", ...]}``."""
    return json.dumps(
        {"inputs": [" ".join(map(str, row)) + "\n" for row in rows], "outputs": [f"{y}\n" for y in outputs]}
    )


def make_code_problem(rng: random.Random, spec: CodeSpec) -> Problem:
    """One problem, e.g. prompt ``Read a b c. Print (a-b)*c.``, the solution

    ```python
    a,b,c=map(int,input().split())
    print((a-b)*c)
    ```

    and the gold ``answer``: ``spec.num_tests`` hidden stdin/stdout tests as JSON (``code_tests_json``). Every read
    variable appears in the expression, and the expression is not constant on the tests.
    """
    names = CODE_VARS[: rng.randint(2, spec.max_vars)]
    while True:
        expr = _code_expr(rng, names, spec)
        rows = _code_tests(rng, names, spec)
        outputs = [eval_code_expr(expr, names, row) for row in rows]
        if len(set(outputs)) > 1:
            break
    return {
        "prompt": f"Read {' '.join(names)}. Print {expr}.",
        "answer": code_tests_json(rows, outputs),
        "solution": code_solution(names, expr),
        "verifier": "code",
    }


def corrupt_code_solution(problem: Problem, rng: random.Random) -> str:
    """``problem``'s solution with one token of the printed expression changed so it fails a hidden test.

    The changed token is an operator (``+ - *``), a variable (another one the program reads), a constant (another
    2..9) or ``max``/``min`` (the other one): ``print(a*b-c)`` may become ``print(a*b+c)`` or ``print(a*a-c)``.
    Candidates that still pass every test are redrawn, so a corrupted demonstration always fails at least one.
    """
    match = re.fullmatch(
        r"```python\n([a-c](?:,[a-c])*)=map\(int,input\(\)\.split\(\)\)\nprint\((.+)\)\n```", problem["solution"]
    )
    if match is None:
        raise ValueError(f"not a code-expr solution: {problem['solution']!r}")
    names, expr = match.group(1).replace(",", ""), match.group(2)
    tests = json.loads(problem["answer"])
    rows = [[int(x) for x in line.split()] for line in tests["inputs"]]
    expected = [int(out) for out in tests["outputs"]]
    tokens = _CODE_TOKEN_RE.findall(expr)
    choices = {
        **{op: [o for o in CODE_OPS if o != op] for op in CODE_OPS},
        **{v: [w for w in names if w != v] for v in names},
        **{f: [g for g in CODE_FUNCS if g != f] for f in CODE_FUNCS},
        **{str(k): [str(j) for j in range(2, 10) if j != k] for k in range(2, 10)},
    }
    positions = [i for i, t in enumerate(tokens) if choices.get(t)]
    for _ in range(1000):
        i = rng.choice(positions)
        wrong = "".join(tokens[:i] + [rng.choice(choices[tokens[i]])] + tokens[i + 1 :])
        if [eval_code_expr(wrong, names, row) for row in rows] != expected:
            return code_solution(names, wrong)
    raise ValueError(f"no corruption of {expr!r} fails a test")  # not reached for this grammar's expressions


def make_code_problems(n: int, seed: int, spec: CodeSpec, exclude: set[str] | None = None) -> list[Problem]:
    """``n`` problems from a seeded stream, skipping any whose prompt is in ``exclude``."""
    rng, out = random.Random(seed), []
    exclude = exclude or set()
    while len(out) < n:
        p = make_code_problem(rng, spec)
        if p["prompt"] not in exclude:
            out.append(p)
    return out


@functools.lru_cache(maxsize=None)
def _code_split(name: str, split: str) -> tuple[Problem, ...]:
    spec = CODE_SPECS[name]
    test = make_code_problems(CODE_TEST_SIZE, CODE_TEST_SEED, spec)
    if split == "test":
        return tuple(test)
    return tuple(make_code_problems(CODE_TRAIN_SIZE, CODE_TRAIN_SEED, spec, exclude={p["prompt"] for p in test}))


def load_code(name: str, split: str) -> list[Problem]:
    if split not in ("train", "test"):
        raise ValueError(f"dataset {name!r} has splits 'train' and 'test', not {split!r}")
    return [dict(p) for p in _code_split(name, split)]


# ----------------------------------------------------------------------------------------------
# arith-tool: products too large to do in the head, easy with the calculator tool
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolArithSpec:
    """Shape of the products task that needs the calculator: ``left*right=?``."""

    min_left: int = 100  # the first factor is drawn from min_left..max_left (3 digits)
    max_left: int = 999
    min_right: int = 10  # the second from min_right..max_right (2 digits)
    max_right: int = 99


TOOL_ARITH_SPECS = {
    "arith-tool": ToolArithSpec(),  # the tiny tool task; its warm start is common/tiny_tool_model (--model tiny-tool)
}
TOOL_DEMONSTRATIONS = ("call", "malformed", "direct")


def make_tool_arith_problem(rng: random.Random, spec: ToolArithSpec) -> Problem:
    """One problem, e.g. prompt ``347*29=?``, answer ``10063``, and the solution that calls the calculator

    ```python
    347*29
    ```
    ```output
    10063
    ```
    \\boxed{10063}

    (``tool_arith_segments(problem, "call")`` joined; the output fence is what the tool loop appends for the call).
    """
    left = rng.randint(spec.min_left, spec.max_left)
    right = rng.randint(spec.min_right, spec.max_right)
    problem = {"prompt": f"{left}*{right}=?", "answer": str(left * right), "solution": ""}
    problem["solution"] = "".join(text for text, _ in tool_arith_segments(problem, "call"))
    return problem


def tool_arith_segments(problem: Problem, kind: str) -> list[tuple[str, bool]]:
    """A demonstration of ``kind`` as (text, is_observation) segments, in the order the tool loop produces them.

    call       ```python\\n347*29\\n```\\n, then the observation ```output\\n10063\\n```\\n, then \\boxed{10063}
    malformed  the call written with ``x`` for ``*`` (``347x29``, which the calculator refuses), the error
               observation ```output\\nError: invalid expression\\n```\\n, then the true answer as a guess
    direct     \\boxed{10063} alone: an answer from the head, which a 1M-parameter model mostly gets wrong

    Each observation is ``format_python_observation(calculator(code))``: byte for byte the text the loop appends
    after the model closes the block (``--tools.format python --tools.tool calculator``). The warm start encodes each
    segment on its own, as the loop does (the sampled turn, then the observation), and leaves observations out of its
    loss, as every script's loss mask does.
    """
    from common.tools import calculator, format_python_observation  # the tool itself, so the text cannot drift

    if kind not in TOOL_DEMONSTRATIONS:
        raise ValueError(f"unknown demonstration kind {kind!r}; choose one of {TOOL_DEMONSTRATIONS}")
    answer = f"\\boxed{{{problem['answer']}}}"
    if kind == "direct":
        return [(answer, False)]
    code = problem["prompt"].removesuffix("=?")
    if kind == "malformed":
        code = code.replace("*", "x")
    return [(f"```python\n{code}\n```\n", False), (format_python_observation(calculator(code)), True), (answer, False)]


def sample_tool_demonstration(
    problem: Problem, rng: random.Random, call_prob: float, malformed_prob: float
) -> list[tuple[str, bool]]:
    """The warm start's demonstration: a call with probability ``call_prob`` (malformed with probability
    ``malformed_prob`` among calls), otherwise a direct answer, so that the warm start calls the tool for some
    problems and not for others and RL has a call rate and an error rate to move."""
    if rng.random() >= call_prob:
        return tool_arith_segments(problem, "direct")
    return tool_arith_segments(problem, "malformed" if rng.random() < malformed_prob else "call")


def make_tool_arith_problems(n: int, seed: int, spec: ToolArithSpec, exclude: set[str] | None = None) -> list[Problem]:
    """``n`` distinct problems from a seeded stream, skipping any whose prompt is in ``exclude``."""
    rng, out, seen = random.Random(seed), [], set(exclude or ())
    while len(out) < n:
        p = make_tool_arith_problem(rng, spec)
        if p["prompt"] not in seen:
            seen.add(p["prompt"])
            out.append(p)
    return out


@functools.lru_cache(maxsize=None)
def _tool_arith_split(name: str, split: str) -> tuple[Problem, ...]:
    spec = TOOL_ARITH_SPECS[name]
    test = make_tool_arith_problems(ARITH_TEST_SIZE, ARITH_TEST_SEED, spec)
    if split == "test":
        return tuple(test)
    exclude = {p["prompt"] for p in test}
    return tuple(make_tool_arith_problems(ARITH_TRAIN_SIZE, ARITH_TRAIN_SEED, spec, exclude=exclude))


def load_tool_arith(name: str, split: str) -> list[Problem]:
    if split not in ("train", "test"):
        raise ValueError(f"dataset {name!r} has splits 'train' and 'test', not {split!r}")
    return [dict(p) for p in _tool_arith_split(name, split)]
