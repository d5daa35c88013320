"""Code datasets: one pure row mapper per dataset, the tests' JSON format, and the code prompt.

A code ``Problem`` has ``verifier = "code"`` and its ``answer`` is a JSON string of tests in exactly one of three
formats (``validate_tests`` checks one and returns its canonical JSON):

    stdin/stdout  {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}           APPS, TACO, CodeContests, DeepCoder
    call-based    {"fn_name": "add", "inputs": [[1, 2], ...], "outputs": [3, ...]}   APPS, LiveCodeBench functional
    test code     {"test": "<asserts or def check(candidate)>", "entry_point": "add"}  HumanEval, MBPP ("": asserts)

Call-based ``inputs`` are lists of positional arguments. For LiveCodeBench's functional tests (LeetCode's
``class Solution``) the grader calls ``Solution().<fn_name>(*args)`` when the program has no top-level function of
that name. Outputs are kept as the dataset stores them: APPS/TACO (and so PRIME's and DeepCoder's taco rows) often
wrap a call-based return value in a one-element list (``[[True], [False]]`` for ``True``/``False``), which their
checker (APPS ``testing_util.py``) accepts as ``output == expected or output == expected[0]``.

Mappers follow ``common/hub_data.py``: a malformed row raises ``RowError`` naming the field, and
``map_code_rows`` adds the dataset name and row index. ``CODE_HUB_SOURCES`` lists the code-only hub sets;
``EURUS2_CODE_SOURCES`` holds PRIME's ``eurus2-rl`` code and mixed sets (``eurus2_rl_row`` with this module's
code mapper).
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import functools
import io
import json
import keyword
import os
import pickle
import zlib

from common.hub_data import (
    HubSource,
    HubUnavailableError,
    RowError,
    _get,
    _text,
    _user_content,
    eurus2_rl_row,
    map_rows,
)
from common.tasks import Problem

# ----------------------------------------------------------------------------------------------
# Prompt
# ----------------------------------------------------------------------------------------------
# DeepCoder's code prompt, kept line for line: `fetch_live_code_bench_system_prompt` in rllm's `rllm/data/utils.py`
# (used by `examples/deepcoder/prepare_deepcoder_data.py`) with the three constants of rllm's `rllm/system_prompts.py`
# (agentica-project/rllm, now rllm-org/rllm), itself a port of LiveCodeBench's `lcb_runner/prompts/code_generation.py`.
# Like rllm it puts no separator between the question and "### Format:" (questions end in their own newlines).
# Qwen2.5-Coder's evaluation prompt (QwenLM/Qwen2.5-Coder `qwencoder-eval/instruct/livecode_bench/lcb_runner/prompts/
# code_generation.py`, generic chat style) differs: the instruction is a separate system turn and adds "You will NOT
# return anything except for the program."; the user turn opens with "### Question:\n{question}\n\n"; and its stdin
# format line stops at "...within delimiters as follows." (no "Ensure that when the python program runs..." sentence).
CODE_INSTRUCTION = (
    "You are an expert Python programmer. You will be given a question (problem specification) and will generate a "
    "correct Python program that matches the specification and passes all tests."
)
CODE_FORMAT_WITH_STARTER = (
    "You will use the following starter code to write the solution to the problem and enclose your code within "
    "delimiters."
)
CODE_FORMAT_STDIN = (
    "Read the inputs from stdin solve the problem and write the answer to stdout (do not directly test on the sample "
    "inputs). Enclose your code within delimiters as follows. Ensure that when the python program runs, it reads the "
    "inputs, runs the algorithm and writes output to STDOUT."
)


def code_prompt(question: str, starter_code: str = "") -> str:
    """The user turn DeepCoder trains on: instruction, question, format (starter code or stdin), answer cue."""
    prompt = CODE_INSTRUCTION + "\n\n" + question
    if starter_code:
        prompt += f"### Format: {CODE_FORMAT_WITH_STARTER}\n"
        prompt += f"```python\n{starter_code}\n```\n\n"
    else:
        prompt += f"### Format: {CODE_FORMAT_STDIN}\n"
        prompt += "```python\n# YOUR CODE HERE\n```\n\n"
    prompt += "### Answer: (use the provided format with backticks)\n\n"
    return prompt


HUMANEVAL_QUESTION = "Complete the following Python function (repeat its imports and signature in your answer).\n\n"


def _fence(code: str) -> str:
    """A reference solution as one fenced block (Windows line ends, as in MBPP's ``code``, become ``\\n``)."""
    return "```python\n" + code.replace("\r\n", "\n").strip("\n") + "\n```"


# ----------------------------------------------------------------------------------------------
# Tests format
# ----------------------------------------------------------------------------------------------
def _identifier(value, what: str) -> str:
    if not isinstance(value, str) or not value.isidentifier() or keyword.iskeyword(value):
        raise ValueError(f"{what} must be a Python identifier, got {value!r}")
    return value


def _canonical_tests(tests) -> dict:
    """The canonical dict of one tests object; ValueError (no prefix) saying what is wrong."""
    if not isinstance(tests, dict):
        raise ValueError(f"must be an object with 'inputs'/'outputs' or 'test', got {type(tests).__name__}")
    if "test" in tests:
        extra = sorted(set(tests) - {"test", "entry_point"})
        if extra:
            raise ValueError(f"unexpected key(s) {extra} in the test-code format (keys: 'test', 'entry_point')")
        test, entry_point = tests["test"], tests.get("entry_point", "")
        if not isinstance(test, str) or not test.strip():
            raise ValueError("'test' must be a non-empty string of Python code")
        if not isinstance(entry_point, str):
            raise ValueError(f"'entry_point' must be a string, got {type(entry_point).__name__}")
        if entry_point:
            _identifier(entry_point, "'entry_point'")
        return {"test": test, "entry_point": entry_point}
    extra = sorted(set(tests) - {"inputs", "outputs", "fn_name"})
    if extra:
        raise ValueError(f"unexpected key(s) {extra} (keys: 'inputs', 'outputs', optional 'fn_name'; or 'test')")
    for key in ("inputs", "outputs"):
        if key not in tests:
            raise ValueError(f"missing {key!r}")
        if not isinstance(tests[key], list):
            raise ValueError(f"{key!r} must be a list, got {type(tests[key]).__name__}")
    inputs, outputs = tests["inputs"], tests["outputs"]
    if not inputs:
        raise ValueError("has no test cases ('inputs' is empty)")
    if len(inputs) != len(outputs):
        raise ValueError(f"'inputs' and 'outputs' differ in length ({len(inputs)} vs {len(outputs)})")
    fn_name = tests.get("fn_name")
    if fn_name is None:  # stdin/stdout
        for key, values in (("inputs", inputs), ("outputs", outputs)):
            for i, value in enumerate(values):
                if not isinstance(value, str):
                    raise ValueError(f"{key}[{i}] must be a string (stdin/stdout format), got {type(value).__name__}")
        canonical = {"inputs": inputs, "outputs": outputs}
    else:
        _identifier(fn_name, "'fn_name'")
        for i, args in enumerate(inputs):
            if not isinstance(args, list):
                raise ValueError(
                    f"inputs[{i}] must be a list of positional arguments (call-based format), got {type(args).__name__}"
                )
        canonical = {"fn_name": fn_name, "inputs": inputs, "outputs": outputs}
    try:
        json.dumps(canonical, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"is not JSON-serialisable: {e}") from None
    return canonical


def validate_tests(tests) -> str:
    """Check a tests object (or its JSON string) in one of the three formats; return its canonical JSON string.

    Raises ValueError starting with ``tests:`` and saying what is wrong (a missing or unexpected key, an empty or
    ragged list, a wrongly typed case, a bad identifier, a value JSON cannot hold).
    """
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as e:
            raise ValueError(f"tests: not valid JSON: {e}") from None
    try:
        return json.dumps(_canonical_tests(tests))
    except ValueError as e:
        raise ValueError(f"tests: {e}") from None


def _answer(tests, field: str) -> str:
    """validate_tests for a mapper: a RowError naming ``field`` instead of a ValueError."""
    try:
        return json.dumps(_canonical_tests(tests))
    except ValueError as e:
        raise RowError(field, str(e)) from None


def _json_field(row: dict, path: str):
    """A field that datasets store as a JSON string (some copies store it already parsed)."""
    value = _get(row, path)
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise RowError(path, f"is not valid JSON: {e}") from None
    return value


def _optional_text(row: dict, path: str) -> str:
    value = row.get(path)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RowError(path, f"must be a string, got {type(value).__name__}")
    return value


def _apps_case(value):
    """APPS/TACO stdin cases sometimes come as a list of lines; their checker joins them with newlines."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    return value


def _apps_tests(tests, field: str) -> str:
    """APPS-style ``{"inputs", "outputs"[, "fn_name"]}`` (TACO, PRIME's eurus2 code rows) to a validated answer."""
    if not isinstance(tests, dict):
        raise RowError(field, f"must be an object with 'inputs' and 'outputs', got {type(tests).__name__}")
    tests = {k: v for k, v in tests.items() if not (k == "fn_name" and v in (None, ""))}
    if "fn_name" not in tests:
        for key in ("inputs", "outputs"):
            if isinstance(tests.get(key), list):
                tests[key] = [_apps_case(v) for v in tests[key]]
    return _answer(tests, field)


def _functional_args(text, field: str) -> list:
    """LiveCodeBench functional input: one JSON value per line, the positional arguments in order."""
    if not isinstance(text, str):
        raise RowError(field, f"must be a string of JSON lines, got {type(text).__name__}")
    try:
        return [json.loads(line) for line in text.split("\n")]
    except ValueError as e:
        raise RowError(field, f"is not one JSON value per line: {e}") from None


def _functional_output(text, field: str):
    if not isinstance(text, str):
        raise RowError(field, f"must be a JSON string, got {type(text).__name__}")
    try:
        return json.loads(text)
    except ValueError as e:
        raise RowError(field, f"is not JSON: {e}") from None


def _lcb_style_tests(cases: list, field: str, func_name: str | None, func_field: str) -> str:
    """A list of LiveCodeBench cases ``{input, output, testtype: stdin|functional}`` to a validated answer."""
    if not isinstance(cases, list) or not cases:
        raise RowError(field, "must be a non-empty list of test cases")
    kinds = set()
    for i, case in enumerate(cases):
        if not isinstance(case, dict) or "input" not in case or "output" not in case:
            raise RowError(f"{field}[{i}]", "must be an object with 'input' and 'output'")
        kinds.add(case.get("testtype", "stdin"))
    if len(kinds) > 1 or not kinds <= {"stdin", "functional"}:
        raise RowError(f"{field}[].testtype", f"must all be 'stdin' or all 'functional', got {sorted(kinds)}")
    if kinds == {"stdin"}:
        return _answer({"inputs": [c["input"] for c in cases], "outputs": [c["output"] for c in cases]}, field)
    if not func_name:
        raise RowError(func_field, "missing (functional tests need the method name)")
    tests = {
        "fn_name": func_name,
        "inputs": [_functional_args(c["input"], f"{field}[{i}].input") for i, c in enumerate(cases)],
        "outputs": [_functional_output(c["output"], f"{field}[{i}].output") for i, c in enumerate(cases)],
    }
    return _answer(tests, field)


def _code_problem(prompt: str, answer: str, solution: str = "") -> Problem:
    return {"prompt": prompt, "answer": answer, "solution": solution, "verifier": "code"}


# ----------------------------------------------------------------------------------------------
# Row mappers
# ----------------------------------------------------------------------------------------------
def humaneval_row(row: dict) -> Problem:
    """openai/openai_humaneval: ``prompt`` (signature + docstring), ``canonical_solution`` (the body), ``test``
    (``def check(candidate)``), ``entry_point``. The grader runs program, ``test``, then ``check(entry_point)``.

    prompt = ``code_prompt`` with the signature as starter code; solution = prompt + canonical solution, fenced.
    """
    signature = _text(row, "prompt")
    body = _text(row, "canonical_solution")
    answer = _answer({"test": _text(row, "test"), "entry_point": _text(row, "entry_point").strip()}, "test")
    return _code_problem(code_prompt(HUMANEVAL_QUESTION, signature.strip("\n")), answer, _fence(signature + body))


def _mbpp_entry(code: str, tests: list[str]) -> ast.FunctionDef:
    """The top-level function of ``code`` that the first test calls (its signature becomes the starter code)."""
    try:
        module = ast.parse(code)
    except SyntaxError as e:
        raise RowError("code", f"is not valid Python: {e}") from None
    defined = {node.name: node for node in module.body if isinstance(node, ast.FunctionDef)}
    for test in tests:
        try:
            tree = ast.parse(test)
        except SyntaxError as e:
            raise RowError("test_list", f"is not valid Python: {e}") from None
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in defined:
                return defined[node.func.id]
    raise RowError("test_list", "calls no function that 'code' defines")


def mbpp_row(row: dict) -> Problem:
    """MBPP, ``full`` (``text``, ``test_setup_code``, ``challenge_test_list``) or ``sanitized`` (``prompt``,
    ``test_imports``): ``code``, ``test_list`` (asserts). Graded on ``test_list`` as plain asserts (entry_point "")
    after the setup code; ``challenge_test_list`` is not graded (the standard MBPP protocol ignores it).

    prompt = the task text plus its asserts, as in the MBPP paper ("Your code should pass these tests:"), through
    ``code_prompt`` with the called function's signature as starter code; solution = ``code``, fenced.
    """
    text = _text(row, "text") if "text" in row else _text(row, "prompt")
    code = _text(row, "code").replace("\r\n", "\n")
    tests = _get(row, "test_list")
    if isinstance(tests, (str, bytes, dict)) or not hasattr(tests, "__iter__"):
        raise RowError("test_list", f"must be a list of assert statements, got {type(tests).__name__}")
    tests = list(tests)
    if not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise RowError("test_list", "must be a non-empty list of non-empty strings")
    if "test_imports" in row and row["test_imports"] is not None:
        imports = row["test_imports"]
        if isinstance(imports, (str, bytes)) or not all(isinstance(t, str) for t in imports):
            raise RowError("test_imports", "must be a list of import statements")
        setup = "\n".join(imports)
    else:
        setup = _optional_text(row, "test_setup_code")
    test = "\n".join(([setup.replace("\r\n", "\n")] if setup.strip() else []) + tests)
    entry = _mbpp_entry(code, tests)
    starter = f"def {entry.name}({ast.unparse(entry.args)}):\n    "
    question = f"{text.strip()}\nYour code should pass these tests:\n\n" + "\n".join(tests) + "\n\n"
    return _code_problem(
        code_prompt(question, starter), _answer({"test": test, "entry_point": ""}, "test_list"), _fence(code)
    )


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Unpickles only plain data (strings, numbers, containers): any global (a class or function) is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused global {module}.{name}: test-case blobs may only hold plain data")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused persistent id: test-case blobs may only hold plain data")


LCB_MAX_DECOMPRESSED = 1 << 30  # bytes; a larger blob is refused (a zlib bomb), far above LiveCodeBench's largest


def decode_lcb_private(blob: str) -> list:
    """LiveCodeBench ``private_test_cases``: a JSON list, or base64 of zlib of a pickle of that JSON string.

    The pickle goes through an unpickler that refuses every global, and must yield a string; ValueError otherwise.
    """
    if not isinstance(blob, str):
        raise ValueError(f"must be a string, got {type(blob).__name__}")
    if not blob.strip():
        return []
    if blob.lstrip().startswith("["):  # plain JSON (base64 has no '[')
        text = blob
    else:
        try:
            packed = base64.b64decode(blob.encode("ascii"), validate=True)
            inflater = zlib.decompressobj()
            raw = inflater.decompress(packed, LCB_MAX_DECOMPRESSED)
            if inflater.unconsumed_tail:
                raise ValueError(f"decompresses past {LCB_MAX_DECOMPRESSED} bytes")
            text = _NoGlobalsUnpickler(io.BytesIO(raw)).load()
        except (ValueError, zlib.error, pickle.UnpicklingError, EOFError) as e:
            raise ValueError(f"not a base64+zlib+pickle test blob: {type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise ValueError(f"the pickle must hold a JSON string, got {type(text).__name__}")
    try:
        cases = json.loads(text)
    except ValueError as e:
        raise ValueError(f"is not a JSON list of test cases: {e}") from None
    if not isinstance(cases, list):
        raise ValueError(f"must decode to a list of test cases, got {type(cases).__name__}")
    return cases


def livecodebench_row(row: dict) -> Problem:
    """livecodebench/code_generation_lite: ``question_content``, ``starter_code``, ``public_test_cases`` (JSON list
    of {input, output, testtype}), ``private_test_cases`` (the same, or base64+zlib+pickle of it), ``metadata``
    (JSON; ``func_name`` for functional problems). Tests = public + private (as ``lcb_runner`` grades).

    stdin tests map to stdin/stdout; functional ones (input = one JSON argument per line, output = JSON) to
    call-based with ``fn_name = metadata.func_name``. prompt = ``code_prompt(question, starter_code)``.
    """
    question = _text(row, "question_content")
    starter = _optional_text(row, "starter_code")
    public = _json_field(row, "public_test_cases")
    if not isinstance(public, list):
        raise RowError("public_test_cases", f"must be a JSON list of test cases, got {type(public).__name__}")
    private = row.get("private_test_cases") or []
    if not isinstance(private, list):
        try:
            private = decode_lcb_private(private)
        except ValueError as e:
            raise RowError("private_test_cases", str(e)) from None
    metadata = _json_field(row, "metadata") if row.get("metadata") else {}
    if not isinstance(metadata, dict):
        raise RowError("metadata", f"must be a JSON object, got {type(metadata).__name__}")
    answer = _lcb_style_tests(public + private, "public_test_cases", metadata.get("func_name"), "metadata.func_name")
    return _code_problem(code_prompt(question, starter), answer)


DEEPCODER_CONFIGS = ("primeintellect", "taco", "lcbv5", "codeforces")


def _primeintellect_tests(cases, field: str) -> str:
    """PrimeIntellect: a list of {type: stdin_stdout|function_call, fn_name, input, output}."""
    if not isinstance(cases, list) or not cases:
        raise RowError(field, "must be a non-empty list of test cases")
    kinds, names = set(), set()
    for i, case in enumerate(cases):
        if not isinstance(case, dict) or "input" not in case or "output" not in case:
            raise RowError(f"{field}[{i}]", "must be an object with 'input' and 'output'")
        kinds.add(case.get("type", "stdin_stdout"))
        if case.get("type") == "function_call":
            names.add(case.get("fn_name"))
    if len(kinds) > 1 or not kinds <= {"stdin_stdout", "function_call"}:
        raise RowError(f"{field}[].type", f"must all be 'stdin_stdout' or all 'function_call', got {sorted(kinds)}")
    tests = {"inputs": [c["input"] for c in cases], "outputs": [c["output"] for c in cases]}
    if kinds == {"function_call"}:
        if len(names) != 1 or not next(iter(names)):
            raise RowError(f"{field}[].fn_name", f"must name one function, got {sorted(map(str, names))}")
        tests["fn_name"] = names.pop()
    return _apps_tests(tests, field)


def deepcoder_row(row: dict, config: str) -> Problem:
    """agentica-org/DeepCoder-Preview-Dataset: ``problem``, ``tests`` (JSON string), ``metadata`` (JSON; lcbv5
    keeps ``func_name`` there), ``starter_code`` when present. ``tests`` differs per config (rllm's
    ``rllm/rewards/code_reward.py``): primeintellect a list of {type, fn_name, input, output}; taco an APPS dict
    {inputs, outputs[, fn_name]}; lcbv5 a list of {input, output, testtype[, metadata.func_name]}; codeforces a list
    of {input, output}. prompt = ``code_prompt(problem, starter_code)`` as in rllm's ``prepare_deepcoder_data.py``.
    """
    if config not in DEEPCODER_CONFIGS:
        raise ValueError(f"DeepCoder config must be one of {DEEPCODER_CONFIGS}, not {config!r}")
    problem = _text(row, "problem")
    starter = _optional_text(row, "starter_code")
    tests = _json_field(row, "tests")
    if config == "primeintellect":
        answer = _primeintellect_tests(tests, "tests")
    elif config == "taco":
        answer = _apps_tests(tests, "tests")
    elif config == "lcbv5":
        metadata = _json_field(row, "metadata") if row.get("metadata") else {}
        if not isinstance(metadata, dict):
            raise RowError("metadata", f"must be a JSON object, got {type(metadata).__name__}")
        first = tests[0] if isinstance(tests, list) and tests and isinstance(tests[0], dict) else {}
        func_name = (first.get("metadata") or {}).get("func_name") or metadata.get("func_name")
        answer = _lcb_style_tests(tests, "tests", func_name, "metadata.func_name")
    else:  # codeforces: stdin/stdout only
        if not isinstance(tests, list) or not tests:
            raise RowError("tests", "must be a non-empty list of test cases")
        cases = [{**c, "testtype": "stdin"} if isinstance(c, dict) else c for c in tests]
        answer = _lcb_style_tests(cases, "tests", None, "metadata.func_name")
    return _code_problem(code_prompt(problem, starter), answer)


def eurus2_code_row(row: dict) -> Problem:
    """A code row of PRIME-RL/Eurus-2-RL-Data (``ability == "code"``): verl format whose
    ``reward_model.ground_truth`` is the JSON string ``{"inputs", "outputs"[, "fn_name"]}`` that PRIME's
    ``prime_code`` scorer (verl ``verl/utils/reward_score/prime_code``) passes to APPS' ``run_test``.

    prompt = the user message (which already asks for a ```python block; the system turn is dropped, as for math).
    """
    return _code_problem(_user_content(row), _apps_tests(_json_field(row, "reward_model.ground_truth"), "reward_model"))


def jsonl_code_row(row: dict) -> Problem:
    """A ``jsonl:`` row with a ``tests`` field: ``prompt`` (used as is), ``tests`` (an object in one of the three
    formats, or its JSON string), optional ``solution``."""
    tests = _get(row, "tests")
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as e:
            raise RowError("tests", f"is not valid JSON: {e}") from None
    return _code_problem(_text(row, "prompt"), _answer(tests, "tests"), _optional_text(row, "solution"))


# ----------------------------------------------------------------------------------------------
# Registry and loading
# ----------------------------------------------------------------------------------------------
_LCB_COLUMNS = ("question_content", "starter_code", "public_test_cases", "private_test_cases", "metadata")
_DEEPCODER_COLUMNS = ("problem", "tests", "metadata", "starter_code")
_DEEPCODER_SPLITS = {
    "primeintellect": {"train": "train"},
    "taco": {"train": "train"},
    "lcbv5": {"train": "train", "test": "test"},
    "codeforces": {"test": "test"},
}

CODE_HUB_SOURCES: dict[str, HubSource] = {
    "humaneval": HubSource(
        "openai/openai_humaneval",
        None,
        {"test": "test"},
        humaneval_row,
        ("task_id", "prompt", "canonical_solution", "test", "entry_point"),
    ),
    "mbpp": HubSource(
        "google-research-datasets/mbpp",
        "full",
        {"train": "train", "validation": "validation", "test": "test"},
        mbpp_row,
        ("task_id", "text", "code", "test_list", "test_setup_code", "challenge_test_list"),
    ),
    "mbpp-sanitized": HubSource(
        "google-research-datasets/mbpp",
        "sanitized",
        {"train": "train", "validation": "validation", "test": "test"},
        mbpp_row,
        ("task_id", "prompt", "code", "test_imports", "test_list"),
    ),
    # config = the release tag; loaded from its jsonl files (load_livecodebench), not through the loading script
    "livecodebench": HubSource(
        "livecodebench/code_generation_lite", "release_v6", {"test": "test"}, livecodebench_row, _LCB_COLUMNS
    ),
    **{
        f"deepcoder:{config}": HubSource(
            "agentica-org/DeepCoder-Preview-Dataset",
            config,
            _DEEPCODER_SPLITS[config],
            functools.partial(deepcoder_row, config=config),
            _DEEPCODER_COLUMNS,
        )
        for config in DEEPCODER_CONFIGS
    },
}

# release tag -> jsonl files of livecodebench/code_generation_lite (its loading script's mapping): release_vN is
# every file up to the Nth, vN the Nth alone (v1 = test.jsonl).
_LCB_FILES = ("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl")
LCB_RELEASE_FILES: dict[str, tuple[str, ...]] = {
    **{f"release_v{n}": _LCB_FILES[:n] for n in range(1, 7)},
    "release_latest": _LCB_FILES,
    **{f"v{n}": (_LCB_FILES[n - 1],) for n in range(1, 7)},
}


# PRIME's own mixture: code-only and math+code views of ``eurus2-rl``, its math rows mapped as ``eurus2-rl`` maps them
EURUS2_CODE_SOURCES: dict[str, HubSource] = {
    f"eurus2-rl-{mode}": HubSource(
        "PRIME-RL/Eurus-2-RL-Data",
        None,
        {"train": "train", "validation": "validation"},
        functools.partial(eurus2_rl_row, mode=mode, code_row=eurus2_code_row),
        ("prompt", "ability", "reward_model"),
    )
    for mode in ("code", "mix")
}


def _code_source(name: str) -> HubSource:
    sources = {**CODE_HUB_SOURCES, **EURUS2_CODE_SOURCES}
    if name in sources:
        return sources[name]
    base, _, release = name.partition(":")
    if base == "livecodebench" and release in LCB_RELEASE_FILES:
        return dataclasses.replace(CODE_HUB_SOURCES["livecodebench"], config=release)
    raise ValueError(
        f"unknown code dataset {name!r}; choose one of {sorted(sources)} or 'livecodebench:<release>' "
        f"with a release in {sorted(LCB_RELEASE_FILES)}"
    )


def map_code_rows(name: str, rows, label: str | None = None) -> list[Problem]:
    """``map_hub_rows`` for the code sets (``CODE_HUB_SOURCES``, ``EURUS2_CODE_SOURCES``, ``livecodebench:<tag>``).

    A malformed row raises ValueError naming the dataset, the hub id, the row index and the field.
    """
    source = _code_source(name)
    return map_rows(source.path, source.row_fn, rows, label or name)


def load_code_hub(name: str, split: str, label: str | None = None) -> list[Problem]:
    """Load a code set from the hub (or the HF cache) and map its rows.

    LiveCodeBench is a script dataset, which ``datasets`` >= 4 refuses, so its release's jsonl files are read with
    the ``json`` builder from ``hf://datasets/livecodebench/code_generation_lite/...``.
    """
    source = _code_source(name)
    label = label or name
    if split not in source.splits:
        raise ValueError(f"dataset {label!r} has splits {sorted(source.splits)}, not {split!r}")
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"dataset {label!r} needs the `datasets` package (pip install datasets)") from e
    lcb = source.path == CODE_HUB_SOURCES["livecodebench"].path
    try:
        if lcb:
            files = [f"hf://datasets/{source.path}/{f}" for f in LCB_RELEASE_FILES[source.config]]
            ds = datasets.load_dataset("json", data_files=files, split="train")
        else:
            ds = datasets.load_dataset(source.path, source.config, split=source.splits[split])
    except Exception as e:  # noqa: BLE001 - any hub/cache failure becomes one actionable message
        cache = os.environ.get("HF_DATASETS_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        reason = (str(e).strip().splitlines() or [""])[0][:300]
        raise HubUnavailableError(
            f"dataset {label!r}: could not load {source.path!r} (config {source.config!r}): "
            f"{type(e).__name__}: {reason}\nThe Hugging Face hub is unreachable or offline "
            f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', 'unset')}) and no cached copy was found under "
            f"{cache}. Download it once where the hub is reachable, or export prompt/tests rows to a JSONL file and "
            "use --dataset jsonl:<path>."
        ) from e
    if source.columns and hasattr(ds, "select_columns"):
        ds = ds.select_columns([c for c in source.columns if c in ds.column_names])
    return map_code_rows(name, ds, f"{label}[{split}]")
