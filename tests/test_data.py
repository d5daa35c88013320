"""Unit tests for common/data.py and common/tasks.py: the arith task, the resumable prompt order, JSONL loading, the
dataset registry, every hub row mapper on fixture rows that mirror the hub schemas (no network),
and the prompt templates rendered with the shipped tiny model's tokenizer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import types

import pytest

from common import data, tasks
from common.data import (
    DATASETS,
    REPO_ROOT,
    TEMPLATES,
    TINY_MODEL_DIR,
    dataset_info,
    format_prompt,
    load_problems,
    prompt_batch,
    teacher_completion,
    validate_rows,
)
from common.hub_data import HUB_SOURCES, HubUnavailableError, map_hub_rows
from common.tasks import ARITH_SPECS, make_arith_problems


# ----------------------------------------------------------------------------------------------
# arith
# ----------------------------------------------------------------------------------------------
def check_worked_solution(problem: dict) -> None:
    """The steps chain through the prompt's operands, each step is correct, the box holds the answer; any redundant
    restatements (arith-pad) repeat the answer."""
    *steps, boxed = problem["solution"].split(";")
    assert boxed == f"\\boxed{{{problem['answer']}}}"
    while steps and steps[-1] == f"{problem['answer']}={problem['answer']}":
        steps.pop()
    terms = re.findall(r"[+-]?\d+", problem["prompt"].removesuffix("=?"))
    total = int(terms[0])
    assert len(steps) == len(terms) - 1
    for step, term in zip(steps, terms[1:]):
        m = re.fullmatch(r"(-?\d+)([+-])(\d+)=(-?\d+)", step)
        assert m, step
        a, op, b, result = int(m[1]), m[2], int(m[3]), int(m[4])
        assert a == total and f"{op}{b}" == term
        assert result == (a + b if op == "+" else a - b), step
        total = result
    assert str(total) == problem["answer"]


@pytest.mark.parametrize("name", sorted(ARITH_SPECS))
def test_arith_splits_disjoint_deterministic_and_correct(name):
    train, test = load_problems(name, "train"), load_problems(name, "test")
    assert len(train) == tasks.ARITH_TRAIN_SIZE and len(test) == tasks.ARITH_TEST_SIZE
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in test}
    for p in test + train[::5]:  # every 5th train problem keeps this fast; the generator is shared
        check_worked_solution(p)
    spec = ARITH_SPECS[name]
    # regenerating from the seeds (no cache) gives the same problems in the same order
    fresh_test = make_arith_problems(tasks.ARITH_TEST_SIZE, tasks.ARITH_TEST_SEED, spec)
    assert fresh_test == test
    assert make_arith_problems(500, tasks.ARITH_TRAIN_SEED, spec, {p["prompt"] for p in test}) == train[:500]
    assert load_problems(name, "train") == train


def test_arith_stream_is_pinned():
    # the shipped tiny model was warm-started on this exact stream: a change here silently mixes splits
    assert load_problems("arith", "test")[0] == {
        "prompt": "1-9-9=?",
        "answer": "-17",
        "solution": "1-9=-8;-8-9=-17;\\boxed{-17}",
    }
    assert load_problems("arith", "train")[0]["prompt"] == "6-6-0=?"
    assert load_problems("arith-hard", "test")[0]["prompt"] == "1-9-9+8=?"  # 4 one-digit operands (LUFFY demo)


def test_arith_check_catches_a_wrong_step():
    bad = {"prompt": "4+7-2=?", "answer": "9", "solution": "4+7=12;12-2=10;\\boxed{9}"}
    with pytest.raises(AssertionError):
        check_worked_solution(bad)


def test_arith_loading_is_cheap_and_returns_copies():
    tasks._arith_split.cache_clear()
    start = time.perf_counter()
    train = load_problems("arith", "train")
    cold = time.perf_counter() - start
    start = time.perf_counter()
    again = load_problems("arith", "train")
    warm = time.perf_counter() - start
    assert cold < 2.0, f"generating {len(train)} arith problems took {cold:.2f}s"  # ~0.2 s measured
    assert warm < 0.5
    train[0]["answer"] = "mutated"
    dataset_info("arith").loader("train")[0]["answer"] = "mutated"  # the raw loader, before validate_rows copies
    assert again[0]["answer"] != "mutated" and load_problems("arith", "train")[0]["answer"] != "mutated"


def test_arith_unknown_split():
    with pytest.raises(ValueError, match="'train' and 'test'"):
        load_problems("arith", "validation")


# ----------------------------------------------------------------------------------------------
# prompt_batch
# ----------------------------------------------------------------------------------------------
def run_cursor(n, batch_size, seed, steps, cursor=0):
    """What a training loop does: take a batch, advance the cursor by batch_size."""
    out = []
    for _ in range(steps):
        out.extend(prompt_batch(n, cursor, batch_size, seed))
        cursor += batch_size
    return out, cursor


def test_prompt_batch_is_a_permutation_per_epoch_and_spans_epochs():
    n, bs = 50, 7  # 7 does not divide 50: batches straddle epoch boundaries
    order, _ = run_cursor(n, bs, seed=3, steps=30)  # 210 positions = 4.2 epochs
    epochs = [order[e * n : (e + 1) * n] for e in range(4)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]  # reshuffled every epoch
    assert epochs[0] != list(range(n))  # actually shuffled
    # a batch crossing the boundary: the end of epoch 0 then the start of epoch 1
    assert prompt_batch(n, n - 2, 4, seed=3) == epochs[0][-2:] + epochs[1][:2]
    # a batch larger than the dataset covers whole epochs
    assert prompt_batch(n, 0, 2 * n + 5, seed=3) == order[: 2 * n + 5]


def test_prompt_batch_deterministic_and_seeded():
    a, _ = run_cursor(40, 8, seed=1, steps=10)
    data._epoch_order.cache_clear()
    b, _ = run_cursor(40, 8, seed=1, steps=10)
    c, _ = run_cursor(40, 8, seed=2, steps=10)
    assert a == b
    assert a != c


def test_prompt_batch_resumes_exactly_where_a_run_stopped():
    n, bs, seed = 23, 5, 7
    full, _ = run_cursor(n, bs, seed, steps=12)
    first, cursor = run_cursor(n, bs, seed, steps=5)  # "crash" after 5 steps; the checkpoint holds the cursor
    data._epoch_order.cache_clear()  # a fresh process
    rest, _ = run_cursor(n, bs, seed, steps=7, cursor=cursor)
    assert cursor == 25 and first + rest == full


# ----------------------------------------------------------------------------------------------
# JSONL files
# ----------------------------------------------------------------------------------------------
def write_jsonl(tmp_path, lines) -> str:
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_jsonl_good_file(tmp_path):
    path = write_jsonl(
        tmp_path,
        [
            {"prompt": "1+1?", "answer": " 2 ", "solution": "1+1=2 \\boxed{2}"},
            "",
            {"prompt": "2+2?", "answer": "4", "extra": 1},
        ],
    )
    info = dataset_info(f"jsonl:{path}")
    assert info.reward_fn == "math" and info.default_template in TEMPLATES
    assert load_problems(f"jsonl:{path}", "test") == [
        {"prompt": "1+1?", "answer": "2", "solution": "1+1=2 \\boxed{2}"},
        {"prompt": "2+2?", "answer": "4", "solution": ""},
    ]


@pytest.mark.parametrize(
    "bad_row, expected",
    [
        ({"prompt": "q"}, r"row 1 \(line 3\): missing field 'answer'"),
        ({"prompt": "q", "answer": 4.2}, r"row 1 \(line 3\): field 'answer' must be a string or an integer, got float"),
        ({"prompt": "q", "answer": True}, r"row 1 \(line 3\): field 'answer' must be a string or an integer, got bool"),
        ({"prompt": "q", "answer": [42]}, r"row 1 \(line 3\): field 'answer' must be a string or an integer, got list"),
        ({"prompt": 7, "answer": "7"}, r"row 1 \(line 3\): field 'prompt' must be a string, got int"),
        ({"prompt": "   ", "answer": "1"}, r"row 1 \(line 3\): field 'prompt' is empty"),
        ({"prompt": "q", "answer": "1", "solution": ["x"]}, r"row 1 \(line 3\): field 'solution' must be a string"),
        (["not", "an", "object"], r"row 1 \(line 3\): expected an object"),
    ],
)
def test_jsonl_bad_rows_name_dataset_row_and_field(tmp_path, bad_row, expected):
    path = write_jsonl(tmp_path, [{"prompt": "ok", "answer": "1"}, "", bad_row])
    with pytest.raises(ValueError, match=expected) as err:
        load_problems(f"jsonl:{path}", "train")
    assert f"'jsonl:{path}'" in str(err.value)


def test_jsonl_integer_answers_become_strings(tmp_path):
    # some AIME copies store the answer as a JSON number; 0 is falsy but a valid answer
    path = write_jsonl(tmp_path, [{"prompt": "a?", "answer": 204}, {"prompt": "b?", "answer": 0, "solution": "s"}])
    assert load_problems(f"jsonl:{path}", "test") == [
        {"prompt": "a?", "answer": "204", "solution": ""},
        {"prompt": "b?", "answer": "0", "solution": "s"},
    ]


def test_jsonl_invalid_json_and_missing_file(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "ok", "answer": "1"}, '{"prompt": "x", "answer": '])
    with pytest.raises(ValueError, match=r"line 2: invalid JSON") as err:
        load_problems(f"jsonl:{path}", "train")
    assert f"jsonl:{path}" in str(err.value)
    with pytest.raises(FileNotFoundError, match="file not found"):
        load_problems(f"jsonl:{tmp_path / 'nope.jsonl'}", "train")
    empty = write_jsonl(tmp_path, [""])
    with pytest.raises(ValueError, match="is empty"):
        load_problems(f"jsonl:{empty}", "train")


def test_validate_rows_without_line_numbers():
    with pytest.raises(ValueError, match=r"dataset 'x', row 0: missing field 'prompt'"):
        validate_rows([{"answer": "1"}], "x")


# ----------------------------------------------------------------------------------------------
# Registry and names
# ----------------------------------------------------------------------------------------------
def test_unknown_dataset_exits_with_one_line_listing_choices():
    with pytest.raises(SystemExit) as err:
        dataset_info("gsm9k")
    message = str(err.value)
    assert message.startswith("--dataset: unknown dataset 'gsm9k'") and "\n" not in message
    for name in ["arith", "gsm8k", "math500", "openr1-luffy", "jsonl:<path>", "math:3-5"]:
        assert name in message
    with pytest.raises(SystemExit, match="^--eval.dataset: unknown dataset 'gsm8k:3'"):  # gsm8k has no levels
        dataset_info("gsm8k:3", "--eval.dataset")


def test_unknown_template_lists_choices():
    with pytest.raises(ValueError) as err:
        format_prompt("q", "qwen_math", tokenizer=None)
    for name in TEMPLATES:
        assert repr(name) in str(err.value)
    with pytest.raises(SystemExit) as err:
        data.check_template("qwen_math", "--eval.template")
    message = str(err.value)
    assert message.startswith("--eval.template: unknown template 'qwen_math'") and "\n" not in message
    for name in ["chat", "qwen-math", "r1-zero", "plain", "dapo"]:
        assert repr(name) in message
    for name in TEMPLATES:
        data.check_template(name)


@pytest.mark.parametrize(
    "dataset, template, eval_dataset, eval_template, message",
    [
        ("nosuch", "", "", "", "--dataset: unknown dataset 'nosuch'"),
        ("arith", "", "nosuch", "", "--eval.dataset: unknown dataset 'nosuch'"),
        ("arith", "chatml", "", "", "--template: unknown template 'chatml'"),
        ("arith", "", "", "chatml", "--eval.template: unknown template 'chatml'"),
    ],
)
def test_load_task_checks_names_before_loading_data(
    monkeypatch, dataset, template, eval_dataset, eval_template, message
):
    from common import runtime
    from common.evaluate import EvalConfig

    def no_loading(*args):
        raise AssertionError("data loaded before the names were checked")

    monkeypatch.setattr(runtime, "load_problems", no_loading)
    args = types.SimpleNamespace(
        dataset=dataset, template=template, eval=EvalConfig(dataset=eval_dataset, template=eval_template)
    )
    with pytest.raises(SystemExit) as err:
        runtime.load_task(args)
    assert str(err.value).startswith(message)


def test_unknown_dataset_flag_fails_without_traceback(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO_ROOT / "algos" / "grpo.py"), "--dataset", "nosuch", "--output-dir", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "--dataset: unknown dataset 'nosuch'" in result.stderr and "jsonl:<path>" in result.stderr


def test_registry_entries():
    from common.verifiers import REWARD_FNS

    assert set(HUB_SOURCES) == {"gsm8k", "math", "math500", "aime24", "aime25", "dapo17k", "openr1-luffy", "eurus2-rl"}
    for name, info in DATASETS.items():
        assert info.reward_fn in REWARD_FNS, name
        assert info.default_template in TEMPLATES, name
    for name in ARITH_SPECS:
        assert DATASETS[name].reward_fn == "exact"
    for name, source in HUB_SOURCES.items():
        assert DATASETS[name].reward_fn == "math"
        assert DATASETS[name].eval_split in source.splits, name
    assert DATASETS["dapo17k"].default_template == "dapo"
    assert DATASETS["eurus2-rl"].eval_split == "validation"
    assert HUB_SOURCES["aime24"].splits == {"test": "train"}


@pytest.mark.parametrize(
    "spec, levels",
    [("3-5", {3, 4, 5}), ("5", {5}), ("1,3-4", {1, 3, 4}), (" 2 - 3 ", {2, 3})],
)
def test_level_filter_syntax(spec, levels):
    assert data._parse_levels("math:" + spec, spec) == levels


@pytest.mark.parametrize("spec", ["0", "6", "5-3", "x", "", "3-"])
def test_level_filter_rejects(spec):
    with pytest.raises(ValueError, match="bad level filter"):
        dataset_info(f"math:{spec}")


# ----------------------------------------------------------------------------------------------
# Hub row mappers on fixture rows mirroring each schema (the hub is unreachable here)
# ----------------------------------------------------------------------------------------------
def verl_prompt(user: str, system: str | None = "SYSTEM PROMPT") -> list[dict]:
    return ([{"content": system, "role": "system"}] if system else []) + [{"content": user, "role": "user"}]


GSM8K_ROW = {
    "question": "Natalia sold clips to 48 friends in April, and half as many in May. How many in total?",
    "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn total 48+24 = <<48+24=72>>72 clips.\n#### 1,072",
}
MATH_ROW = {
    "problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?",
    "level": "Level 3",
    "type": "Prealgebra",
    "solution": "We get $\\boxed{1}$ wrong at first; in fact the sum is $\\boxed{\\frac{3}{4}}$.",
}
MATH500_ROW = {
    "problem": "Convert $(0,3)$ to polar coordinates.",
    "solution": "... so $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
    "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
    "subject": "Precalculus",
    "level": 2,
    "unique_id": "test/precalculus/807.json",
}
AIME24_ROW = {
    "id": 60,
    "problem": "Every morning Aya walks...",
    "solution": "... the answer is $\\boxed{204}$.",
    "answer": "204",
    "url": "https://...",
    "year": "2024",
}
AIME25_ROW = {"problem": "Find the sum of all integer bases $b>9$ ...", "answer": "70", "id": "0"}
DAPO17K_ROW = {
    "prompt": "In triangle $ABC$, $\\sin \\angle A = \\frac{4}{5}$ ... find $a + b + c$.",
    "solution": "34",
    "data_source": "https://artofproblemsolving.com/...",
    "source_prompt": [{"content": "Solve the following math problem step by step. ...", "role": "user"}],
    "ability": "MATH",
    "reward_model": {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
}
LUFFY_ROW = {
    "data_source": "openr1",
    "prompt": verl_prompt(
        "Find $x$ if $2x=14$.", system="Your role as an assistant involves thoroughly exploring questions ..."
    ),
    "ability": "math",
    "reward_model": {"ground_truth": "7", "style": "rule"},
    "extra_info": {"index": -1, "split": "default"},
    "target": [{"content": "<think>\nDivide by 2.\n</think>\n\nSo $x=\\boxed{7}$.", "role": "assistant"}],
}
EURUS_MATH_ROW = {
    "data_source": "numina_olympiads",
    "prompt": verl_prompt(
        "Compute $1/2+1/2$.\n\nPresent the answer in LaTex format: \\boxed{Your answer}",
        system="When tackling complex reasoning tasks, you have access to the following actions. [ASSESS] ...",
    ),
    "ability": "math",
    "reward_model": {"ground_truth": "1", "style": "rule"},
    "extra_info": {"index": 0, "split": "dummy"},
}
EURUS_CODE_ROW = {
    **EURUS_MATH_ROW,
    "data_source": "codecontests",
    "ability": "code",
    "reward_model": {"ground_truth": '{"inputs": ["1"], "outputs": ["2"]}', "style": "rule"},
}


@pytest.mark.parametrize(
    "name, row, expected",
    [
        (
            "gsm8k",
            GSM8K_ROW,
            {
                "prompt": GSM8K_ROW["question"],
                "answer": "1072",
                "solution": "In May she sold 48/2 = 24 clips.\nIn total 48+24 = 72 clips.\n\\boxed{1072}",
            },
        ),
        ("math", MATH_ROW, {"prompt": MATH_ROW["problem"], "answer": "\\frac{3}{4}", "solution": MATH_ROW["solution"]}),
        (
            "math500",
            MATH500_ROW,
            {"prompt": MATH500_ROW["problem"], "answer": MATH500_ROW["answer"], "solution": MATH500_ROW["solution"]},
        ),
        ("aime24", AIME24_ROW, {"prompt": AIME24_ROW["problem"], "answer": "204", "solution": AIME24_ROW["solution"]}),
        (
            "aime24",
            {**AIME24_ROW, "answer": "033"},
            {"prompt": AIME24_ROW["problem"], "answer": "33", "solution": AIME24_ROW["solution"]},
        ),
        ("aime25", AIME25_ROW, {"prompt": AIME25_ROW["problem"], "answer": "70", "solution": ""}),
        ("aime25", {**AIME25_ROW, "answer": 70}, {"prompt": AIME25_ROW["problem"], "answer": "70", "solution": ""}),
        ("dapo17k", DAPO17K_ROW, {"prompt": DAPO17K_ROW["prompt"], "answer": "34", "solution": ""}),
        (
            "openr1-luffy",
            LUFFY_ROW,
            {"prompt": "Find $x$ if $2x=14$.", "answer": "7", "solution": LUFFY_ROW["target"][0]["content"]},
        ),
        (
            "eurus2-rl",
            EURUS_MATH_ROW,
            {"prompt": EURUS_MATH_ROW["prompt"][1]["content"], "answer": "1", "solution": ""},
        ),
    ],
)
def test_hub_row_mappers(name, row, expected):
    problems = map_hub_rows(name, [row])
    assert problems == [expected]
    assert validate_rows(problems, name) == problems  # mapped rows are valid Problems


def test_eurus_keeps_math_only_and_reports_hub_row_index():
    assert map_hub_rows("eurus2-rl", [EURUS_CODE_ROW, EURUS_MATH_ROW, EURUS_CODE_ROW]) == map_hub_rows(
        "eurus2-rl", [EURUS_MATH_ROW]
    )
    bad = {**EURUS_MATH_ROW, "reward_model": {"style": "rule"}}
    with pytest.raises(ValueError, match=r"row 2: field 'reward_model.ground_truth': missing"):
        map_hub_rows("eurus2-rl", [EURUS_CODE_ROW, EURUS_MATH_ROW, bad])


def test_math_level_filter():
    rows = [{**MATH_ROW, "level": f"Level {k}"} for k in range(1, 6)] + [{**MATH_ROW, "level": "Level ?"}]
    assert len(map_hub_rows("math", rows)) == 6
    assert len(map_hub_rows("math", rows, levels=frozenset({3, 4, 5}))) == 3
    rows500 = [{**MATH500_ROW, "level": k} for k in range(1, 6)]
    assert len(map_hub_rows("math500", rows500, levels=frozenset({5}))) == 1
    with pytest.raises(ValueError, match=r"row 0: field 'level': missing"):
        map_hub_rows("math", [{k: v for k, v in MATH_ROW.items() if k != "level"}], levels=frozenset({3}))


def without(row: dict, key: str) -> dict:
    return {k: v for k, v in row.items() if k != key}


@pytest.mark.parametrize(
    "name, good, bad, field, reason",
    [
        ("gsm8k", GSM8K_ROW, {**GSM8K_ROW, "answer": "72 clips"}, "answer", "####"),
        ("gsm8k", GSM8K_ROW, {**GSM8K_ROW, "answer": "72 #### "}, "answer", "nothing after"),
        ("gsm8k", GSM8K_ROW, without(GSM8K_ROW, "question"), "question", "missing"),
        ("math", MATH_ROW, {**MATH_ROW, "solution": "The answer is 3/4."}, "solution", "boxed"),
        ("math", MATH_ROW, {**MATH_ROW, "problem": None}, "problem", "missing"),
        ("math500", MATH500_ROW, {**MATH500_ROW, "answer": ""}, "answer", "empty"),
        ("math500", MATH500_ROW, {**MATH500_ROW, "solution": 3}, "solution", "must be a string"),
        ("aime24", AIME24_ROW, {**AIME24_ROW, "answer": ["204"]}, "answer", "must be a string"),
        ("aime25", AIME25_ROW, without(AIME25_ROW, "problem"), "problem", "missing"),
        ("dapo17k", DAPO17K_ROW, without(DAPO17K_ROW, "solution"), "solution", "missing"),
        ("openr1-luffy", LUFFY_ROW, {**LUFFY_ROW, "target": []}, "target", "non-empty list"),
        ("openr1-luffy", LUFFY_ROW, {**LUFFY_ROW, "target": [{"role": "assistant"}]}, "target[0].content", "missing"),
        (
            "openr1-luffy",
            LUFFY_ROW,
            {**LUFFY_ROW, "prompt": verl_prompt("q")[:1]},
            "prompt",
            "no message with role 'user'",
        ),
        (
            "openr1-luffy",
            LUFFY_ROW,
            {**LUFFY_ROW, "reward_model": {"style": "rule"}},
            "reward_model.ground_truth",
            "missing",
        ),
        ("eurus2-rl", EURUS_MATH_ROW, without(EURUS_MATH_ROW, "ability"), "ability", "missing"),
        ("eurus2-rl", EURUS_MATH_ROW, {**EURUS_MATH_ROW, "prompt": "plain text"}, "prompt", "list of chat messages"),
        ("eurus2-rl", EURUS_MATH_ROW, {**EURUS_MATH_ROW, "prompt": verl_prompt("")}, "prompt[user].content", "empty"),
        ("dapo17k", DAPO17K_ROW, "not a row", "<row>", "expected an object"),
    ],
)
def test_hub_row_mappers_reject_malformed_rows(name, good, bad, field, reason):
    assert map_hub_rows(name, [good])  # the good fixture maps
    with pytest.raises(ValueError) as err:
        map_hub_rows(name, [good, bad], label=f"{name}[train]")
    message = str(err.value)
    assert message.startswith(f"dataset '{name}[train]' ({HUB_SOURCES[name].path}), row 1: field {field!r}"), message
    assert reason in message, message


def test_teacher_completion_strips_a_duplicated_think():
    trace = "<think>\nDivide by 2.\n</think>\n\\boxed{7}"
    assert (
        teacher_completion(trace, "<|im_start|>assistant\n<think>\n") == "Divide by 2.\n</think>\n\\boxed{7}"
    )  # LUFFY's rule
    assert teacher_completion(trace, data.R1_ZERO.format(prompt="q")) == "\nDivide by 2.\n</think>\n\\boxed{7}"
    assert teacher_completion(trace, "<|im_start|>assistant\n") == trace
    assert teacher_completion("Divide by 2.", "Assistant: <think>") == "Divide by 2."


# ----------------------------------------------------------------------------------------------
# Hub loading through a stand-in `datasets` module (the real hub is unreachable here)
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def fake_hub(monkeypatch):
    calls = []
    fixtures = {
        "openai/gsm8k": [GSM8K_ROW, GSM8K_ROW],
        "DigitalLearningGmbH/MATH-lighteval": [{**MATH_ROW, "level": f"Level {k}"} for k in range(1, 6)],
        "HuggingFaceH4/aime_2024": [AIME24_ROW],
    }

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        if path not in fixtures:
            raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")
        return fixtures[path]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_hub_loader_maps_splits_and_validates(fake_hub):
    assert len(load_problems("gsm8k", "test")) == 2
    assert load_problems("aime24", dataset_info("aime24").eval_split)[0]["answer"] == "204"
    assert len(dataset_info("math:4-5").loader("train")) == 2
    assert fake_hub == [
        ("openai/gsm8k", "main", "test"),
        ("HuggingFaceH4/aime_2024", None, "train"),
        ("DigitalLearningGmbH/MATH-lighteval", None, "train"),
    ]


def test_hub_loader_unknown_split_lists_splits(fake_hub):
    with pytest.raises(ValueError, match=r"dataset 'math500' has splits \['test'\], not 'train'"):
        load_problems("math500", "train")
    assert fake_hub == []  # rejected before touching the hub


def test_hub_unreachable_error_names_the_dataset(fake_hub):
    with pytest.raises(HubUnavailableError) as err:
        load_problems("eurus2-rl", "train")
    message = str(err.value)
    for text in [
        "'eurus2-rl'",
        "PRIME-RL/Eurus-2-RL-Data",
        "split 'train'",
        "ConnectionError",
        "unreachable or offline",
        "HF_HUB_OFFLINE",
        "jsonl:<path>",
    ]:
        assert text in message, text


def test_hub_malformed_row_through_the_loader(fake_hub):
    bad_rows = [GSM8K_ROW, {**GSM8K_ROW, "answer": "no marker"}]
    sys.modules["datasets"].load_dataset = lambda path, name=None, split=None: bad_rows
    with pytest.raises(ValueError, match=r"dataset 'gsm8k\[train\]' \(openai/gsm8k\), row 1: field 'answer'"):
        load_problems("gsm8k", "train")


# ----------------------------------------------------------------------------------------------
# Prompt templates with the shipped tiny model's tokenizer
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    import transformers

    # The class AutoTokenizer would pick (tokenizer_config.json), imported directly: `import
    # AutoTokenizer` pulls in torch and every auto mapping, which costs several seconds here.
    cls = json.loads((TINY_MODEL_DIR / "tokenizer_config.json").read_text())["tokenizer_class"]
    return getattr(transformers, cls).from_pretrained(str(TINY_MODEL_DIR))


def test_format_prompt_templates(tokenizer):
    q = "4+7-2=?"
    chat = format_prompt(q, "chat", tokenizer)
    assert chat == f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
    qwen = format_prompt(q, "qwen-math", tokenizer)
    assert (
        qwen == f"<|im_start|>system\n{data.QWEN_MATH_SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
    )
    dapo = format_prompt(q, "dapo", tokenizer)
    assert dapo.startswith(
        "<|im_start|>user\nSolve the following math problem step by step. The last line of your response should be of "
        "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n4+7-2=?\n\n"
        'Remember to put your answer on its own line after "Answer:".<|im_end|>\n'
    )
    assert f"{data.DAPO_INSTRUCTION}\n\n{q}\n\n{data.DAPO_REMINDER}<|im_end|>" in dapo
    assert dapo.endswith("<|im_start|>assistant\n") and "system" not in dapo
    r1 = format_prompt(q, "r1-zero", tokenizer)
    assert r1.startswith("A conversation between User and Assistant.") and r1.endswith(f"User: {q}. Assistant: <think>")
    assert format_prompt(q, "plain", tokenizer) == q
    # the tokenizer encodes the rendered prompt losslessly, special tokens included
    ids = tokenizer(qwen)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in ids
    assert tokenizer.decode(ids) == qwen


def test_chat_templates_need_a_chat_template():
    no_template = types.SimpleNamespace(chat_template=None)
    for template in ("chat", "qwen-math", "dapo"):
        with pytest.raises(ValueError, match="has none"):
            format_prompt("q", template, no_template)
    assert format_prompt("q", "plain", no_template) == "q"
    assert format_prompt("q", "r1-zero", None).endswith("User: q. Assistant: <think>")
