"""Code datasets: row mappers on fixture rows, the tests format, the restricted unpickler, the prompt.

Fixture rows are public rows (tests/fixtures/code/README.md names each origin); the expected values below are
written out by hand from those raw rows. Nothing here executes a program.
"""

import base64
import json
import os
import pickle
import zlib
from pathlib import Path

import pytest

from common.code_data import (
    CODE_FORMAT_STDIN,
    CODE_FORMAT_WITH_STARTER,
    CODE_HUB_SOURCES,
    CODE_INSTRUCTION,
    EURUS2_CODE_SOURCES,
    LCB_RELEASE_FILES,
    decode_lcb_private,
    deepcoder_row,
    eurus2_code_row,
    humaneval_row,
    jsonl_code_row,
    livecodebench_row,
    map_code_rows,
    mbpp_row,
    validate_tests,
)
from common.hub_data import HUB_SOURCES, RowError, eurus2_rl_row, map_hub_rows

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "code"


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]


def by_key(name: str, key: str) -> dict:
    return {row[key]: row for row in rows(name)}


ANSWER_CUE = "### Answer: (use the provided format with backticks)\n\n"


# ---------------------------------------------------------------------------------------------- prompt
def test_code_prompt_is_rllms_deepcoder_prompt():
    from common.code_data import code_prompt

    # rllm fetch_live_code_bench_system_prompt: instruction, "\n\n", question (no separator), format, answer cue
    assert code_prompt("Add two numbers.\n") == (
        "You are an expert Python programmer. You will be given a question (problem specification) and will "
        "generate a correct Python program that matches the specification and passes all tests.\n\n"
        "Add two numbers.\n"
        "### Format: Read the inputs from stdin solve the problem and write the answer to stdout (do not directly "
        "test on the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python "
        "program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n"
        "```python\n# YOUR CODE HERE\n```\n\n" + ANSWER_CUE
    )
    assert code_prompt("Q\n", "def f(x):\n    ") == (
        f"{CODE_INSTRUCTION}\n\nQ\n### Format: You will use the following starter code to write the solution to the "
        "problem and enclose your code within delimiters.\n```python\ndef f(x):\n    \n```\n\n" + ANSWER_CUE
    )


# ---------------------------------------------------------------------------------------------- HumanEval
def test_humaneval_rows():
    raw = by_key("humaneval_rows.jsonl", "task_id")
    assert len(raw) == 12
    problems = map_code_rows("humaneval", list(raw.values()))
    assert len(problems) == 12 and all(p["verifier"] == "code" for p in problems)

    strlen = humaneval_row(raw["HumanEval/23"])
    assert json.loads(strlen["answer"]) == {
        "test": "\n\nMETADATA = {\n    'author': 'jt',\n    'dataset': 'test'\n}\n\n\ndef check(candidate):\n"
        "    assert candidate('') == 0\n    assert candidate('x') == 1\n    assert candidate('asdasnakj') == 9\n",
        "entry_point": "strlen",
    }
    signature = 'def strlen(string: str) -> int:\n    """ Return length of given string\n    >>> strlen(\'\')\n    0\n    >>> strlen(\'abc\')\n    3\n    """'  # noqa: E501
    assert strlen["solution"] == f"```python\n{signature}\n    return len(string)\n```"
    assert strlen["prompt"] == (
        f"{CODE_INSTRUCTION}\n\nComplete the following Python function (repeat its imports and signature in your "
        f"answer).\n\n### Format: {CODE_FORMAT_WITH_STARTER}\n```python\n{signature}\n```\n\n{ANSWER_CUE}"
    )
    close = humaneval_row(raw["HumanEval/0"])
    assert json.loads(close["answer"])["entry_point"] == "has_close_elements"
    assert "```python\nfrom typing import List\n\n\ndef has_close_elements(" in close["prompt"]
    assert close["solution"].endswith("                    return True\n\n    return False\n```")


# ---------------------------------------------------------------------------------------------- MBPP
def test_mbpp_full_rows():
    raw = by_key("mbpp_rows.jsonl", "task_id")
    assert len(map_code_rows("mbpp", list(raw.values()))) == 12
    occ = mbpp_row(raw[11])
    # graded on test_list only (challenge_test_list ignored), plain asserts
    assert json.loads(occ["answer"]) == {
        "test": 'assert remove_Occ("hello","l") == "heo"\nassert remove_Occ("abcda","a") == "bcd"\n'
        'assert remove_Occ("PHP","P") == "H"',
        "entry_point": "",
    }
    assert occ["prompt"] == (
        f"{CODE_INSTRUCTION}\n\nWrite a python function to remove first and last occurrence of a given character "
        "from the string.\nYour code should pass these tests:\n\n"
        'assert remove_Occ("hello","l") == "heo"\nassert remove_Occ("abcda","a") == "bcd"\n'
        'assert remove_Occ("PHP","P") == "H"\n\n'
        f"### Format: {CODE_FORMAT_WITH_STARTER}\n```python\ndef remove_Occ(s, ch):\n    \n```\n\n{ANSWER_CUE}"
    )
    assert occ["solution"].startswith("```python\ndef remove_Occ(s,ch): \n    for i in range(len(s)): \n")
    assert "\r" not in occ["solution"]
    # the called function, not the first one defined: task 4 imports heapq as hq and defines heap_queue_largest
    assert "```python\ndef heap_queue_largest(nums, n):\n    \n```" in mbpp_row(raw[4])["prompt"]


def test_mbpp_setup_code_and_sanitized_imports():
    raw = by_key("mbpp_rows.jsonl", "task_id")
    with_setup = {**raw[17], "test_setup_code": "import math"}
    assert json.loads(mbpp_row(with_setup)["answer"])["test"] == (
        "import math\nassert square_perimeter(10)==40\nassert square_perimeter(5)==20\nassert square_perimeter(4)==16"
    )
    sanitized = by_key("mbpp_sanitized_rows.jsonl", "task_id")
    problems = map_code_rows("mbpp-sanitized", list(sanitized.values()))
    assert json.loads(problems[1]["answer"]) == {
        "test": "assert smallest_num([10, 20, 1, 45, 99]) == 1\nassert smallest_num([1, 2, 3]) == 1\n"
        "assert smallest_num([45, 46, 50, 60]) == 45",
        "entry_point": "",
    }
    with_imports = {**sanitized[3], "test_imports": ["import math", "import sys"]}
    assert json.loads(mbpp_row(with_imports)["answer"])["test"].startswith("import math\nimport sys\nassert is_not")


# ---------------------------------------------------------------------------------------------- LiveCodeBench
def test_livecodebench_functional_row_decodes_private_blob():
    functional, stdin = rows("lcb_rows.jsonl")
    problem = livecodebench_row(functional)
    # public "[5, 3, 10, 8, 2]\n5" -> "3"; private (in the blob): the statement's two examples
    assert json.loads(problem["answer"]) == {
        "fn_name": "numberOfEmployeesWhoMetTarget",
        "inputs": [[[5, 3, 10, 8, 2], 5], [[0, 1, 2, 3, 4], 2], [[5, 1, 4, 2, 2], 6]],
        "outputs": [3, 3, 0],
    }
    assert problem["prompt"].endswith(
        f"### Format: {CODE_FORMAT_WITH_STARTER}\n```python\nclass Solution:\n    def numberOfEmployeesWhoMetTarget"
        f"(self, hours: List[int], target: int) -> int:\n        \n```\n\n{ANSWER_CUE}"
    )
    assert json.loads(livecodebench_row(stdin)["answer"]) == {
        "inputs": ["3\n12345 530391 12345\n", "2\n1 2\n"],
        "outputs": ["2\n", "1\n"],
    }
    assert f"### Format: {CODE_FORMAT_STDIN}\n" in livecodebench_row(stdin)["prompt"]


def lcb_blob(obj) -> str:
    return base64.b64encode(zlib.compress(pickle.dumps(obj))).decode()


class _RunsCommand:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_restricted_unpickler_refuses_globals(tmp_path):
    assert decode_lcb_private(lcb_blob(json.dumps([{"input": "1\n", "output": "1\n", "testtype": "stdin"}])))
    marker = tmp_path / "pwned"
    evil = lcb_blob(_RunsCommand(f"touch {marker}"))
    with pytest.raises(ValueError, match=r"refused global (os|posix)\.system"):
        decode_lcb_private(evil)
    functional = rows("lcb_rows.jsonl")[0]
    with pytest.raises(ValueError, match=r"field 'private_test_cases': .*refused global"):
        map_code_rows("livecodebench", [{**functional, "private_test_cases": evil}])
    assert not marker.exists()
    # a builtin global (eval) is refused as well, and a pickle of anything but a string
    with pytest.raises(ValueError, match=r"refused global builtins\.eval"):
        decode_lcb_private(base64.b64encode(zlib.compress(pickle.dumps(eval))).decode())
    with pytest.raises(ValueError, match="must hold a JSON string, got list"):
        decode_lcb_private(lcb_blob([{"input": "1", "output": "1"}]))
    with pytest.raises(ValueError, match="not a base64"):
        decode_lcb_private("not base64 at all!")


def test_livecodebench_releases_map_to_files():
    assert LCB_RELEASE_FILES["release_v1"] == ("test.jsonl",)
    assert LCB_RELEASE_FILES["release_v6"][-1] == "test6.jsonl" and len(LCB_RELEASE_FILES["release_v6"]) == 6
    assert LCB_RELEASE_FILES["v3"] == ("test3.jsonl",)
    assert map_code_rows("livecodebench:release_v5", rows("lcb_rows.jsonl"))
    with pytest.raises(ValueError, match="unknown code dataset 'livecodebench:v9'"):
        map_code_rows("livecodebench:v9", [])


# ---------------------------------------------------------------------------------------------- DeepCoder
def test_deepcoder_rows_per_config():
    expected = [
        {"inputs": ["4\n1 1 2 2\n", "6\n1 2 3 4 5 6\n"], "outputs": ["YES\n", "NO\n"]},
        {"fn_name": "total", "inputs": [[[1, 2, 3, 4, 5]], [[42]]], "outputs": [[48], [42]]},
        {
            "inputs": [
                "4 3 3\n1 2 3\n1 2 3\n2 3 2\n3 4 4\n",
                "5 10 4\n1 2 3 4\n1 2 5\n1 3 5\n1 4 5\n1 5 5\n2 3 5\n2 4 5\n2 5 5\n3 4 5\n3 5 5\n4 5 5\n",
            ],
            "outputs": ["5\n", "15\n"],
        },
        {"fn_name": "is_anagram", "inputs": [["foefet", "toffee"], ["apple", "pale"]], "outputs": [[True], [False]]},
        {"inputs": ["2\n1 2\n3 4"], "outputs": ["3\n7"]},  # APPS line lists joined with newlines
        {"inputs": ["3\n12345 530391 12345\n"], "outputs": ["2\n"]},
        {"fn_name": "numberOfEmployeesWhoMetTarget", "inputs": [[[5, 3, 10, 8, 2], 5]], "outputs": [3]},
        {"fn_name": "numberOfEmployeesWhoMetTarget", "inputs": [[[0, 1, 2, 3, 4], 2]], "outputs": [3]},
        {"inputs": ["3 30\n2 2 1", "3 20\n2 1 1"], "outputs": ["5", "-1"]},
    ]
    fixture = rows("deepcoder_rows.jsonl")
    assert {r["config"] for r in fixture} == {"primeintellect", "taco", "lcbv5", "codeforces"}
    for item, want in zip(fixture, expected, strict=True):
        [problem] = map_code_rows(f"deepcoder:{item['config']}", [item["row"]])
        assert json.loads(problem["answer"]) == want, item["config"]
        assert problem["prompt"].startswith(f"{CODE_INSTRUCTION}\n\n{item['row']['problem']}### Format: ")
        assert problem["solution"] == "" and problem["verifier"] == "code"
    lcb_functional = fixture[6]["row"]
    assert "```python\nclass Solution:\n" in deepcoder_row(lcb_functional, "lcbv5")["prompt"]


@pytest.mark.parametrize(
    "index, change, field, reason",
    [
        (0, {"tests": "[{"}, "tests", "not valid JSON"),
        (0, {"tests": "[]"}, "tests", "non-empty list"),
        (1, {"tests": json.dumps([{"type": "function_call", "input": [[1]], "output": [1]}])}, "tests[].fn_name", ""),
        (2, {"tests": json.dumps({"inputs": ["1\n"], "outputs": []})}, "tests", "differ in length (1 vs 0)"),
        (
            6,
            {"metadata": "{}", "tests": json.dumps([{"input": "1", "output": "1", "testtype": "functional"}])},
            "metadata.func_name",
            "missing",
        ),  # fmt: skip
        (6, {"tests": json.dumps([{"input": "[1,", "output": "1", "testtype": "functional"}])}, "tests[0].input", ""),
        (8, {"tests": json.dumps([{"input": 3, "output": "1"}])}, "tests", "inputs[0] must be a string"),
        (8, {"problem": ""}, "problem", "is empty"),
    ],
)
def test_deepcoder_malformed_rows_name_the_field(index, change, field, reason):
    item = rows("deepcoder_rows.jsonl")[index]
    name = f"deepcoder:{item['config']}"
    with pytest.raises(ValueError) as err:
        map_code_rows(name, [item["row"], {**item["row"], **change}])
    message = str(err.value)
    assert message.startswith(f"dataset {name!r} (agentica-org/DeepCoder-Preview-Dataset), row 1: field {field!r}")
    assert reason in message, message


# ---------------------------------------------------------------------------------------------- eurus2-rl
EURUS_MATH_ROW = {
    "data_source": "numina_olympiads",
    "prompt": [{"role": "system", "content": "SYSTEM"}, {"role": "user", "content": "Compute $1+1$."}],
    "ability": "math",
    "reward_model": {"ground_truth": " 2 ", "style": "rule"},
}


def test_eurus2_code_rows_and_modes():
    call_row, stdin_row = rows("eurus2_code_rows.jsonl")
    call = eurus2_code_row(call_row)
    assert json.loads(call["answer"]) == {
        "fn_name": "minFlips",
        "inputs": [["01010101"], ["11111111"], ["00000000"], ["10101010"], ["00110101"], ["0"], ["1"], ["10"]]
        + [["11"], ["00"]],
        "outputs": [[0], [4], [4], [0], [2], [0], [0], [0], [1], [1]],
    }
    assert call["prompt"] == call_row["prompt"][0]["content"] and call["verifier"] == "code"
    stdin = eurus2_code_row(stdin_row)
    assert json.loads(stdin["answer"]) == {"inputs": ["1 5\n", "3 6\n"], "outputs": ["No\n", "Yes\n"]}
    assert stdin["prompt"] == stdin_row["prompt"][1]["content"]  # the system turn is dropped, as for math

    mixed = [EURUS_MATH_ROW, call_row, stdin_row]
    math = {"prompt": "Compute $1+1$.", "answer": "2", "solution": ""}
    assert map_hub_rows("eurus2-rl", mixed) == [math]  # today's math-only set, unchanged (no verifier key)
    assert map_code_rows("eurus2-rl-code", mixed) == [call, stdin]
    assert map_code_rows("eurus2-rl-mix", mixed) == [{**math, "verifier": "math"}, call, stdin]
    assert eurus2_rl_row({**EURUS_MATH_ROW, "ability": "chemistry"}, mode="mix") is None
    with pytest.raises(ValueError, match="mode must be one of"):
        eurus2_rl_row(EURUS_MATH_ROW, mode="all")
    bad = {**stdin_row, "reward_model": {"ground_truth": '{"inputs": ["1"], "outputs": [1]}'}}
    with pytest.raises(ValueError, match=r"row 1: field 'reward_model': outputs\[0\] must be a string"):
        map_code_rows("eurus2-rl-mix", [EURUS_MATH_ROW, bad])
    with pytest.raises(ValueError, match=r"row 0: field 'reward_model.ground_truth': is not valid JSON"):
        map_code_rows("eurus2-rl-code", [{**stdin_row, "reward_model": {"ground_truth": "{"}}])


# ---------------------------------------------------------------------------------------------- jsonl
def test_jsonl_code_row():
    tests = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    want = {
        "prompt": "Add.",
        "answer": '{"inputs": ["1 2\\n"], "outputs": ["3\\n"]}',
        "solution": "",
        "verifier": "code",
    }
    assert jsonl_code_row({"prompt": "Add.", "tests": tests}) == want
    assert jsonl_code_row({"prompt": "Add.", "tests": json.dumps(tests)}) == want
    row = {"prompt": "Add.", "tests": {"test": "assert add(1, 2) == 3"}, "solution": "def add(a, b): ..."}
    assert jsonl_code_row(row)["answer"] == '{"test": "assert add(1, 2) == 3", "entry_point": ""}'
    with pytest.raises(RowError, match=r"field 'tests': 'inputs' and 'outputs' differ in length \(1 vs 2\)"):
        jsonl_code_row({"prompt": "Add.", "tests": {"inputs": ["1"], "outputs": ["1", "2"]}})
    with pytest.raises(RowError, match="field 'tests': missing"):
        jsonl_code_row({"prompt": "Add."})


# ---------------------------------------------------------------------------------------------- validate_tests
@pytest.mark.parametrize(
    "tests, canonical",
    [
        ({"outputs": ["3\n"], "inputs": ["1 2\n"]}, {"inputs": ["1 2\n"], "outputs": ["3\n"]}),
        ({"inputs": ["1\n"], "outputs": ["1\n"], "fn_name": None}, {"inputs": ["1\n"], "outputs": ["1\n"]}),
        ({"fn_name": "add", "inputs": [[1, 2], []], "outputs": [3, None]}, None),
        ({"test": "def check(candidate):\n    assert candidate(1) == 2\n", "entry_point": "inc"}, None),
        ({"test": "assert f() == 1"}, {"test": "assert f() == 1", "entry_point": ""}),
    ],
)
def test_validate_tests_accepts(tests, canonical):
    assert json.loads(validate_tests(tests)) == (canonical or tests)
    assert validate_tests(validate_tests(tests)) == validate_tests(tests)  # its JSON string validates to itself


@pytest.mark.parametrize(
    "tests, message",
    [
        ([["1"], ["1"]], "must be an object"),
        ("{", "not valid JSON"),
        ({"inputs": [], "outputs": []}, "has no test cases"),
        ({"inputs": ["1"]}, "missing 'outputs'"),
        ({"inputs": "1", "outputs": "1"}, "'inputs' must be a list, got str"),
        ({"inputs": ["1", "2"], "outputs": ["1"]}, "differ in length (2 vs 1)"),
        ({"inputs": [1], "outputs": ["1"]}, "inputs[0] must be a string (stdin/stdout format), got int"),
        ({"inputs": ["1"], "outputs": [["1"]]}, "outputs[0] must be a string"),
        ({"fn_name": "f", "inputs": ["1"], "outputs": [1]}, "inputs[0] must be a list of positional arguments"),
        ({"fn_name": "not a name", "inputs": [[1]], "outputs": [1]}, "'fn_name' must be a Python identifier"),
        ({"fn_name": "class", "inputs": [[1]], "outputs": [1]}, "'fn_name' must be a Python identifier"),
        ({"fn_name": "f", "inputs": [[float("nan")]], "outputs": [1]}, "not JSON-serialisable"),
        ({"fn_name": "f", "inputs": [[{1, 2}]], "outputs": [1]}, "not JSON-serialisable"),
        ({"inputs": ["1"], "outputs": ["1"], "time_limit": 2}, "unexpected key(s) ['time_limit']"),
        ({"test": "", "entry_point": "f"}, "'test' must be a non-empty string"),
        ({"test": "assert 1", "entry_point": 3}, "'entry_point' must be a string, got int"),
        ({"test": "assert 1", "entry_point": "check(f)"}, "'entry_point' must be a Python identifier"),
        ({"test": "assert 1", "inputs": ["1"]}, "unexpected key(s) ['inputs'] in the test-code format"),
    ],
)
def test_validate_tests_rejects(tests, message):
    with pytest.raises(ValueError) as err:
        validate_tests(tests)
    assert str(err.value).startswith("tests: ") and message in str(err.value), str(err.value)


# ---------------------------------------------------------------------------------------------- malformed rows
@pytest.mark.parametrize(
    "name, fixture, change, field, reason",
    [
        ("humaneval", "humaneval_rows.jsonl", {"canonical_solution": None}, "canonical_solution", "missing"),
        ("humaneval", "humaneval_rows.jsonl", {"entry_point": "two words"}, "test", "Python identifier"),
        ("mbpp", "mbpp_rows.jsonl", {"test_list": "assert f(1) == 1"}, "test_list", "list of assert statements"),
        ("mbpp", "mbpp_rows.jsonl", {"test_list": []}, "test_list", "non-empty list"),
        ("mbpp", "mbpp_rows.jsonl", {"code": "def broken(:"}, "code", "not valid Python"),
        ("mbpp", "mbpp_rows.jsonl", {"test_list": ["assert other(1) == 1"]}, "test_list", "calls no function"),
        ("mbpp", "mbpp_rows.jsonl", {"text": ["x"]}, "text", "must be a string, got list"),
        ("livecodebench", "lcb_rows.jsonl", {"public_test_cases": "{}"}, "public_test_cases", "JSON list"),
        ("livecodebench", "lcb_rows.jsonl", {"metadata": "{}"}, "metadata.func_name", "missing"),
        ("livecodebench", "lcb_rows.jsonl", {"question_content": ""}, "question_content", "is empty"),
    ],
)
def test_malformed_rows_name_the_field(name, fixture, change, field, reason):
    good = rows(fixture)[0]
    with pytest.raises(ValueError) as err:
        map_code_rows(name, [good, {**good, **change}], label=f"{name}[test]")
    message = str(err.value)
    path = CODE_HUB_SOURCES[name].path
    assert message.startswith(f"dataset '{name}[test]' ({path}), row 1: field {field!r}"), message
    assert reason in message, message


def test_mixed_testtypes_and_non_row():
    row = rows("lcb_rows.jsonl")[1]
    mixed = json.dumps(
        [{"input": "1", "output": "1", "testtype": "stdin"}, {"input": "1", "output": "1", "testtype": "functional"}]
    )  # noqa: E501
    with pytest.raises(ValueError, match=r"field 'public_test_cases\[\]\.testtype': must all be"):
        map_code_rows("livecodebench", [{**row, "public_test_cases": mixed}])
    with pytest.raises(ValueError, match=r"row 0: field '<row>': expected an object"):
        map_code_rows("humaneval", ["not a row"])


# ---------------------------------------------------------------------------------------------- registry
def test_code_sources_registry():
    assert set(CODE_HUB_SOURCES) == {
        "humaneval",
        "mbpp",
        "mbpp-sanitized",
        "livecodebench",
        "deepcoder:primeintellect",
        "deepcoder:taco",
        "deepcoder:lcbv5",
        "deepcoder:codeforces",
    }
    assert set(EURUS2_CODE_SOURCES) == {"eurus2-rl-code", "eurus2-rl-mix"}
    assert not set(EURUS2_CODE_SOURCES) & set(HUB_SOURCES)  # the math registry is unchanged
    assert CODE_HUB_SOURCES["deepcoder:lcbv5"].splits == {"train": "train", "test": "test"}
    assert CODE_HUB_SOURCES["deepcoder:codeforces"].splits == {"test": "test"}
    assert CODE_HUB_SOURCES["livecodebench"].config in LCB_RELEASE_FILES
    for fixture, name in [
        ("humaneval_rows.jsonl", "humaneval"),
        ("mbpp_rows.jsonl", "mbpp"),
        ("mbpp_sanitized_rows.jsonl", "mbpp-sanitized"),
        ("lcb_rows.jsonl", "livecodebench"),
    ]:
        columns = set(CODE_HUB_SOURCES[name].columns)
        for row in rows(fixture):  # the mapper reads only the listed columns
            assert map_code_rows(name, [{k: v for k, v in row.items() if k in columns}]) == map_code_rows(name, [row])


# ---------------------------------------------------------------------------------------------- public problems
def test_public_problems_fixture():
    problems = rows("public_problems.jsonl")
    assert (FIXTURES / "public_problems.jsonl").stat().st_size < 200_000
    counts = {}
    for p in problems:
        counts[p["source"]] = counts.get(p["source"], 0) + 1
        assert set(p) == {"source", "id", "answer", "solution", "wrong"}
        assert validate_tests(p["answer"]) == p["answer"]  # stored in canonical form
        assert p["solution"] != p["wrong"]
        compile(p["solution"], p["id"], "exec")  # syntax only; the grader's tests run them in the sandbox
        compile(p["wrong"], p["id"], "exec")
    assert counts == {"humaneval": 12, "mbpp": 12, "taco": 12, "taco-call": 2, "lcb-functional": 1}
    assert len({p["id"] for p in problems}) == len(problems)
    formats = {p["source"]: set(json.loads(p["answer"])) for p in problems}
    assert formats["humaneval"] == formats["mbpp"] == {"test", "entry_point"}
    assert formats["taco"] == {"inputs", "outputs"} and formats["taco-call"] == {"fn_name", "inputs", "outputs"}
    # the fixture's tests are the raw rows' tests
    he = by_key("humaneval_rows.jsonl", "task_id")
    mb = by_key("mbpp_rows.jsonl", "task_id")
    for p in problems:
        if p["source"] == "humaneval":
            assert json.loads(p["answer"]) == {"test": he[p["id"]]["test"], "entry_point": he[p["id"]]["entry_point"]}
            assert p["solution"] == he[p["id"]]["prompt"] + he[p["id"]]["canonical_solution"]
        elif p["source"] == "mbpp":
            row = mb[int(p["id"].split("/")[1])]
            assert json.loads(p["answer"]) == {"test": "\n".join(row["test_list"]), "entry_point": ""}
            assert p["solution"] == row["code"]
