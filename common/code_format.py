"""The code prompt and the tests' JSON format: ``code_prompt`` and ``validate_tests``.

A code ``Problem`` has ``verifier = "code"`` and its ``answer`` is a JSON string of tests in exactly one of three
formats (``validate_tests`` checks one and returns its canonical JSON):

    stdin/stdout  {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}           APPS, TACO, CodeContests, DeepCoder
    call-based    {"fn_name": "add", "inputs": [[1, 2], ...], "outputs": [3, ...]}   APPS, LiveCodeBench functional
    test code     {"test": "<asserts or def check(candidate)>", "entry_point": "add"}  HumanEval, MBPP ("": asserts)

Call-based ``inputs`` are lists of positional arguments. For LiveCodeBench's functional tests (LeetCode's
``class Solution``) the grader calls ``Solution().<fn_name>(*args)`` when the program has no top-level function of
that name. Pure functions, no hub access. The row mappers (``common/code_hub_rows.py``) build their answers with
``_answer``, which raises ``RowError`` naming the field instead of a ValueError; ``common/code_data.py`` re-exports
the public names.
"""

from __future__ import annotations

import json
import keyword

from common.hub_data import RowError

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
