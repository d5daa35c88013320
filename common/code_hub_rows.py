"""Code datasets' row mappers: one pure function per dataset, from a hub row to a code ``Problem``.

Mappers follow ``common/hub_data.py``: a malformed row raises ``RowError`` naming the field, and
``common/code_data.py``'s ``map_code_rows`` adds the dataset name and row index. Each answer is a tests JSON string
in one of the three formats of ``common/code_format.py`` (prompts come from its ``code_prompt``). Outputs are kept as
the dataset stores them: APPS/TACO (and so PRIME's and DeepCoder's taco rows) often wrap a call-based return value in
a one-element list (``[[True], [False]]`` for ``True``/``False``), which their checker (APPS ``testing_util.py``)
accepts as ``output == expected or output == expected[0]``. Which hub id, config and columns use which mapper is
``common/code_data.py``'s registry (``CODE_HUB_SOURCES``, ``EURUS2_CODE_SOURCES``), which re-exports the mappers.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import pickle
import zlib

from common.code_format import _answer, code_prompt
from common.hub_data import RowError, _get, _text, _user_content
from common.tasks import Problem

# ----------------------------------------------------------------------------------------------
# Field helpers shared by the mappers
# ----------------------------------------------------------------------------------------------
HUMANEVAL_QUESTION = "Complete the following Python function (repeat its imports and signature in your answer).\n\n"


def _fence(code: str) -> str:
    """A reference solution as one fenced block (Windows line ends, as in MBPP's ``code``, become ``\\n``)."""
    return "```python\n" + code.replace("\r\n", "\n").strip("\n") + "\n```"


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
