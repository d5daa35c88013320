"""Datasets by name, prompt templates, and the offline synthetic task.

Every dataset is loaded as a list of ``Problem`` dicts with three string fields:

    prompt    the question as the user would ask it (no template applied)
    answer    the gold final answer, checked by the dataset's reward function
    solution  a worked solution ending in the answer ("" when the dataset has none); LUFFY uses it
              as the off-policy teacher trace, the tiny model's warm start uses it as SFT data

``load_problems(name, split)`` returns that list; ``format_prompt`` applies a named template;
``prompt_batch`` walks a list in a seeded, resumable order (the data cursor saved in checkpoints).

The offline task ``arith`` needs no network: chain arithmetic such as ``4+7-2=?`` with the worked
solution ``4+7=11;11-2=9;\\boxed{9}``. Its held-out split is disjoint from its train split.

Hub datasets (need ``datasets`` and hub access or a warm HF cache; all scored with the ``math`` reward):

    name          hub id (config)                             splits: ours (-> hub)      gold answer
    gsm8k         openai/gsm8k (main)                         train, test                text after ``####``
    math          DigitalLearningGmbH/MATH-lighteval          train, test                last ``\\boxed{}`` of solution
    math500       HuggingFaceH4/MATH-500                      test                       ``answer`` column
    aime24        HuggingFaceH4/aime_2024                     test (-> train), 30 rows   ``answer`` column
    aime25        math-ai/aime25                              test, 30 rows (I + II)     ``answer`` column
    dapo17k       open-r1/DAPO-Math-17k-Processed (all)       train, 17,398 de-duped     ``solution`` column
    openr1-luffy  Elliott/Openr1-Math-46k-8192                train                      reward_model.ground_truth
    eurus2-rl     PRIME-RL/Eurus-2-RL-Data (ability == math)  train, validation          reward_model.ground_truth

``math:3-5`` (or ``math:5``, ``math500:1,2``) keeps only those MATH difficulty levels (levels 3-5 are
what the Dr. GRPO / oat recipe trains on). Each hub row goes through a small pure mapper (``gsm8k_row``, ...)
that raises ``ValueError`` naming the dataset, the hub row index and the field when a row is malformed.
For ``openr1-luffy`` the ``solution`` is the DeepSeek-R1 teacher trace, kept verbatim; pass it
through ``teacher_completion`` with the rendered prompt to drop a ``<think>`` the prompt already ends with.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

Problem = dict[str, str]

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL_DIR = REPO_ROOT / "common" / "tiny_model"


def resolve_model_path(name_or_path: str) -> str:
    """Map ``"tiny"`` to the shipped offline model folder; pass any other hub id or path through."""
    if name_or_path == "tiny":
        if not (TINY_MODEL_DIR / "config.json").exists():
            raise FileNotFoundError(
                f"the shipped tiny model is missing from {TINY_MODEL_DIR}; rebuild it with "
                "`python scripts/build_tiny_model.py`"
            )
        return str(TINY_MODEL_DIR)
    local = Path(name_or_path).expanduser()
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1
    if looks_local and not local.exists():
        raise FileNotFoundError(f"--model {name_or_path!r}: no such local path (and not a hub id of the form org/name)")
    return str(local) if local.exists() else name_or_path


# ----------------------------------------------------------------------------------------------
# The offline synthetic task: chain arithmetic with a worked solution
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ArithSpec:
    """Shape of the synthetic chain-arithmetic task."""

    n_terms: int = 3  # operands per problem
    max_operand: int = 9  # operands are drawn from 0..max_operand


ARITH_SPECS = {
    "arith": ArithSpec(n_terms=3, max_operand=9),  # the tiny default: 1-digit operands
    "arith-hard": ArithSpec(n_terms=4, max_operand=9),  # one operand more than the warm start saw: ~3% sampled accuracy (LUFFY demo)
}
ARITH_TEST_SIZE = 200  # held-out problems per arith task
ARITH_TEST_SEED = 999
ARITH_TRAIN_SIZE = 20_000
ARITH_TRAIN_SEED = 0


def make_arith_problem(rng: random.Random, spec: ArithSpec) -> Problem:
    """One problem, e.g. prompt ``4+7-2=?``, answer ``9``, solution ``4+7=11;11-2=9;\\boxed{9}``."""
    operands = [rng.randint(0, spec.max_operand) for _ in range(spec.n_terms)]
    ops = [rng.choice("+-") for _ in range(spec.n_terms - 1)]
    prompt, total, steps = str(operands[0]), operands[0], []
    for op, x in zip(ops, operands[1:]):
        new_total = total + x if op == "+" else total - x
        steps.append(f"{total}{op}{x}={new_total}")
        prompt += f"{op}{x}"
        total = new_total
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
    train = make_arith_problems(ARITH_TRAIN_SIZE, ARITH_TRAIN_SEED, spec, exclude={p["prompt"] for p in test})
    return tuple(train)


def _load_arith(name: str, split: str) -> list[Problem]:
    if split not in ("train", "test"):
        raise ValueError(f"dataset {name!r} has splits 'train' and 'test', not {split!r}")
    return [dict(p) for p in _arith_split(name, split)]  # copies, so callers cannot corrupt the cache


# ----------------------------------------------------------------------------------------------
# Local JSONL files
# ----------------------------------------------------------------------------------------------
def validate_rows(rows: list[dict], dataset: str, line_numbers: list[int] | None = None) -> list[Problem]:
    """Check every row has non-empty string ``prompt`` and ``answer`` (and string ``solution`` if present).

    Raises ValueError naming the dataset, the row index and the field, so a bad row never trains silently.
    ``line_numbers`` (1-based, one per row) adds the file line to the message, e.g. ``row 2 (line 4)``.
    """
    problems = []
    for index, row in enumerate(rows):
        i = f"{index} (line {line_numbers[index]})" if line_numbers else index
        if not isinstance(row, dict):
            raise ValueError(f"dataset {dataset!r}, row {i}: expected an object, got {type(row).__name__}")
        for field in ("prompt", "answer"):
            if field not in row:
                raise ValueError(f"dataset {dataset!r}, row {i}: missing field {field!r}")
            if not isinstance(row[field], str):
                raise ValueError(
                    f"dataset {dataset!r}, row {i}: field {field!r} must be a string, got {type(row[field]).__name__}"
                )
            if not row[field].strip():
                raise ValueError(f"dataset {dataset!r}, row {i}: field {field!r} is empty")
        solution = row.get("solution", "")
        if not isinstance(solution, str):
            raise ValueError(f"dataset {dataset!r}, row {i}: field 'solution' must be a string")
        problems.append({"prompt": row["prompt"], "answer": row["answer"].strip(), "solution": solution})
    if not problems:
        raise ValueError(f"dataset {dataset!r} is empty")
    return problems


def _load_jsonl(path: str) -> list[Problem]:
    file = Path(path).expanduser()
    if not file.exists():
        raise FileNotFoundError(f"dataset 'jsonl:{path}': file not found")
    rows, line_numbers = [], []
    for i, line in enumerate(file.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"dataset 'jsonl:{path}', line {i + 1}: invalid JSON ({e})") from None
        line_numbers.append(i + 1)
    return validate_rows(rows, f"jsonl:{path}", line_numbers)


# ----------------------------------------------------------------------------------------------
# Hugging Face hub datasets: one pure row mapper per dataset, one generic loader
# ----------------------------------------------------------------------------------------------
class RowError(ValueError):
    """A hub row that cannot become a ``Problem``; ``field`` names the offending column."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"field {field!r}: {reason}")
        self.field = field


class HubUnavailableError(RuntimeError):
    """``datasets.load_dataset`` failed: no hub access (offline) and no cached copy, or a bad id/split."""


def _get(row: dict, path: str):
    """``row["a"]["b"]`` for ``path="a.b"``; RowError naming the dotted field when a key is missing."""
    value = row
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value or value[key] is None:
            raise RowError(path, "missing")
        value = value[key]
    return value


def _text(row: dict, path: str) -> str:
    """A non-empty string field (integers, e.g. AIME answers, become their decimal string)."""
    value = _get(row, path)
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise RowError(path, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowError(path, "is empty")
    return value


def _user_content(row: dict, path: str = "prompt") -> str:
    """The content of the last user message of a verl-style ``prompt`` message list (system turns dropped)."""
    messages = _get(row, path)
    if isinstance(messages, (str, bytes, dict)) or not hasattr(messages, "__iter__"):
        raise RowError(path, f"must be a list of chat messages, got {type(messages).__name__}")
    user = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not user:
        raise RowError(path, "has no message with role 'user'")
    content = user[-1].get("content")
    if not isinstance(content, str) or not content.strip():
        raise RowError(f"{path}[user].content", "missing or empty")
    return content


def _integer_answer(answer: str) -> str:
    """AIME answers are integers 0..999; drop leading zeros some copies keep ("033" -> "33")."""
    answer = answer.strip()
    return str(int(answer)) if answer.isdigit() else answer


def _math_level(row: dict) -> int | None:
    """MATH difficulty from ``level`` ("Level 3" in MATH-lighteval, 3 in MATH-500); None for "Level ?"."""
    level = _get(row, "level")
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    if isinstance(level, str):
        m = re.fullmatch(r"\s*(?:Level\s*)?(\d+)\s*", level)
        return int(m.group(1)) if m else None
    raise RowError("level", f"must be 'Level N' or an integer, got {type(level).__name__}")


def _gold_from(extract: Callable[[str], str], text: str, path: str) -> str:
    try:
        return extract(text)
    except ValueError as e:
        raise RowError(path, str(e)) from None


_GSM8K_CALC = re.compile(r"<<[^<>]*>>")  # calculator annotations such as <<48/2=24>>


def gsm8k_row(row: dict) -> Problem:
    """openai/gsm8k: ``question``; ``answer`` = worked solution ending in ``#### 72``.

    The solution keeps the rationale (calculator annotations removed) and ends in ``\\boxed{gold}``.
    """
    from common.verifiers import extract_gsm8k_gold

    answer_field = _text(row, "answer")
    gold = _gold_from(extract_gsm8k_gold, answer_field, "answer")
    rationale = _GSM8K_CALC.sub("", answer_field.rsplit("####", 1)[0]).strip()
    return {"prompt": _text(row, "question"), "answer": gold, "solution": f"{rationale}\n\\boxed{{{gold}}}".lstrip()}


def math_row(row: dict, levels: frozenset[int] | None = None) -> Problem | None:
    """MATH-lighteval: ``problem``, ``solution`` (gold = its last ``\\boxed{}``), ``level`` "Level 1".."Level 5".

    With ``levels``, rows of other levels (and the few "Level ?" rows) are skipped (None).
    """
    from common.verifiers import extract_math_gold

    if levels is not None and _math_level(row) not in levels:
        return None
    solution = _text(row, "solution")
    gold = _gold_from(extract_math_gold, solution, "solution")
    return {"prompt": _text(row, "problem"), "answer": gold, "solution": solution}


def math500_row(row: dict, levels: frozenset[int] | None = None) -> Problem | None:
    """MATH-500: ``problem``, ``answer`` (clean gold), ``solution``, ``level`` 1..5."""
    if levels is not None and _math_level(row) not in levels:
        return None
    solution = row.get("solution") or ""
    if not isinstance(solution, str):
        raise RowError("solution", f"must be a string, got {type(solution).__name__}")
    return {"prompt": _text(row, "problem"), "answer": _text(row, "answer").strip(), "solution": solution}


def aime24_row(row: dict) -> Problem:
    """HuggingFaceH4/aime_2024: ``problem``, ``answer`` (integer, as text or int), ``solution``."""
    solution = row.get("solution") or ""
    if not isinstance(solution, str):
        raise RowError("solution", f"must be a string, got {type(solution).__name__}")
    return {"prompt": _text(row, "problem"), "answer": _integer_answer(_text(row, "answer")), "solution": solution}


def aime25_row(row: dict) -> Problem:
    """math-ai/aime25: ``problem``, ``answer``, ``id`` (AIME 2025 I and II, 30 rows); no solutions."""
    return {"prompt": _text(row, "problem"), "answer": _integer_answer(_text(row, "answer")), "solution": ""}


def dapo17k_row(row: dict) -> Problem:
    """open-r1/DAPO-Math-17k-Processed: ``prompt`` = the bare problem, ``solution`` = the final answer.

    The processed copy dropped DAPO's instruction from the prompt; the ``dapo`` template re-adds it.
    """
    return {"prompt": _text(row, "prompt"), "answer": _text(row, "solution").strip(), "solution": ""}


def openr1_luffy_row(row: dict) -> Problem:
    """Elliott/Openr1-Math-46k-8192 (LUFFY): verl format plus ``target`` = [{"role": "assistant", "content": trace}].

    prompt = the user message (the OpenR1 system prompt is dropped), answer = reward_model.ground_truth,
    solution = the DeepSeek-R1 teacher trace verbatim, usually starting with "<think>\\n" (see ``teacher_completion``).
    """
    target = _get(row, "target")
    if isinstance(target, (str, bytes, dict)) or not hasattr(target, "__len__") or len(target) == 0:
        raise RowError("target", "must be a non-empty list holding the teacher message")
    first = target[0]
    trace = first.get("content") if isinstance(first, dict) else None
    if not isinstance(trace, str) or not trace.strip():
        raise RowError("target[0].content", "missing or empty")
    return {
        "prompt": _user_content(row),
        "answer": _text(row, "reward_model.ground_truth").strip(),
        "solution": trace,
    }


def eurus2_rl_row(row: dict) -> Problem | None:
    """PRIME-RL/Eurus-2-RL-Data: verl format; keeps ``ability == "math"`` rows (code rows give None).

    prompt = the user message (PRIME's action-tag system prompt is dropped), answer = reward_model.ground_truth.
    """
    if _text(row, "ability") != "math":
        return None
    return {"prompt": _user_content(row), "answer": _text(row, "reward_model.ground_truth").strip(), "solution": ""}


def teacher_completion(solution: str, rendered_prompt: str) -> str:
    """The teacher trace as the completion of ``rendered_prompt``, without a duplicated ``<think>``.

    LUFFY strips a leading ``<think>\\n`` from the trace when the chat-templated prompt already ends
    with ``<think>\\n`` (``rl_dataset_with_target.py``). Generalised: when the prompt ends with
    ``<think>`` plus optional whitespace (``r1-zero`` ends with ``<think>``), the trace's own leading
    ``<think>`` and that same whitespace are dropped; otherwise the trace is returned unchanged.
    """
    head = rendered_prompt.rstrip()
    if not (head.endswith("<think>") and solution.startswith("<think>")):
        return solution
    rest, already = solution[len("<think>") :], rendered_prompt[len(head) :]
    return rest[len(already) :] if rest.startswith(already) else rest


@dataclass(frozen=True)
class HubSource:
    """Where a hub dataset lives and how its rows become Problems."""

    path: str  # hub id
    config: str | None  # hub config name (None = default)
    splits: dict[str, str]  # our split name -> hub split name
    row_fn: Callable[..., Problem | None]  # pure row mapper; None = skip the row
    columns: tuple[str, ...] = ()  # columns the mapper reads (others are dropped before iterating)
    has_levels: bool = False  # accepts the ``name:LEVELS`` filter


HUB_SOURCES: dict[str, HubSource] = {
    "gsm8k": HubSource("openai/gsm8k", "main", {"train": "train", "test": "test"}, gsm8k_row, ("question", "answer")),
    "math": HubSource(
        "DigitalLearningGmbH/MATH-lighteval", None, {"train": "train", "test": "test"}, math_row,
        ("problem", "solution", "level"), has_levels=True,
    ),
    "math500": HubSource(
        "HuggingFaceH4/MATH-500", None, {"test": "test"}, math500_row, ("problem", "answer", "solution", "level"), has_levels=True
    ),
    "aime24": HubSource("HuggingFaceH4/aime_2024", None, {"test": "train"}, aime24_row, ("problem", "answer", "solution")),
    "aime25": HubSource("math-ai/aime25", None, {"test": "test"}, aime25_row, ("problem", "answer")),
    "dapo17k": HubSource("open-r1/DAPO-Math-17k-Processed", "all", {"train": "train"}, dapo17k_row, ("prompt", "solution")),
    "openr1-luffy": HubSource(
        "Elliott/Openr1-Math-46k-8192", None, {"train": "train"}, openr1_luffy_row, ("prompt", "reward_model", "target")
    ),
    "eurus2-rl": HubSource(
        "PRIME-RL/Eurus-2-RL-Data", None, {"train": "train", "validation": "validation"}, eurus2_rl_row,
        ("prompt", "ability", "reward_model"),
    ),
}


def map_hub_rows(name: str, rows, levels: frozenset[int] | None = None, label: str | None = None) -> list[Problem]:
    """Map raw rows of hub dataset ``name`` to Problems with its row mapper (skipped rows dropped).

    A malformed row raises ValueError naming the dataset (``label``), the hub id, the row index
    (in the hub split, before any filtering) and the field.
    """
    source = HUB_SOURCES[name]
    row_fn = functools.partial(source.row_fn, levels=levels) if levels is not None else source.row_fn
    label = label or name
    problems = []
    for i, row in enumerate(rows):
        try:
            if not isinstance(row, dict):
                raise RowError("<row>", f"expected an object, got {type(row).__name__}")
            problem = row_fn(row)
        except RowError as e:
            raise ValueError(f"dataset {label!r} ({source.path}), row {i}: {e}") from None
        if problem is not None:
            problems.append(problem)
    return problems


def _load_hub(name: str, split: str, levels: frozenset[int] | None = None, label: str | None = None) -> list[Problem]:
    source = HUB_SOURCES[name]
    label = label or name
    if split not in source.splits:
        raise ValueError(f"dataset {label!r} has splits {sorted(source.splits)}, not {split!r}")
    hub_split = source.splits[split]
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"dataset {label!r} needs the `datasets` package (pip install datasets)") from e
    try:
        ds = datasets.load_dataset(source.path, source.config, split=hub_split)
    except Exception as e:  # noqa: BLE001 - any hub/cache failure becomes one actionable message
        cache = os.environ.get("HF_DATASETS_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        reason = (str(e).strip().splitlines() or [""])[0][:300]
        raise HubUnavailableError(
            f"dataset {label!r}: could not load hub dataset {source.path!r} (config {source.config!r}, "
            f"split {hub_split!r}): {type(e).__name__}: {reason}\n"
            f"The Hugging Face hub is unreachable or offline (HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', 'unset')}) "
            f"and no cached copy was found under {cache}. Download it once where the hub is reachable "
            f"(same HF cache, then set HF_HUB_OFFLINE=1), or export prompt/answer/solution rows to a JSONL "
            f"file and use --dataset jsonl:<path>."
        ) from e
    if source.columns and hasattr(ds, "select_columns"):
        ds = ds.select_columns([c for c in source.columns if c in ds.column_names])
    return map_hub_rows(name, ds, levels, f"{label}[{split}]")


def _parse_levels(name: str, spec: str) -> frozenset[int]:
    """``"3-5"`` -> {3, 4, 5}; ``"5"`` -> {5}; ``"1,3-4"`` -> {1, 3, 4}; levels are 1..5."""
    levels: set[int] = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*([1-5])\s*(?:-\s*([1-5])\s*)?", part)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ValueError(
                f"dataset {name!r}: bad level filter {spec!r}; use levels 1..5 such as 'math:3-5', 'math:5' or 'math:1,3-4'"
            )
        levels.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    return frozenset(levels)


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DatasetInfo:
    """How to load a named dataset and how to score it."""

    loader: Callable[[str], list[Problem]]  # split -> problems
    reward_fn: str  # key of common.verifiers.REWARD_FNS
    default_template: str  # key of TEMPLATES
    eval_split: str = "test"


DATASETS: dict[str, DatasetInfo] = {
    name: DatasetInfo(loader=lambda split, name=name: _load_arith(name, split), reward_fn="exact", default_template="chat")
    for name in ARITH_SPECS
}
# Hub sets. eval_split is the dataset's own held-out split; the training-only sets (dapo17k,
# openr1-luffy) have none, so evaluate models trained on them on math500 / aime24 / aime25.
_HUB_EVAL_SPLITS = {"dapo17k": "train", "openr1-luffy": "train", "eurus2-rl": "validation"}
DATASETS.update(
    {
        name: DatasetInfo(
            loader=lambda split, name=name: _load_hub(name, split),
            reward_fn="math",
            default_template="dapo" if name == "dapo17k" else "qwen-math",
            eval_split=_HUB_EVAL_SPLITS.get(name, "test"),
        )
        for name in HUB_SOURCES
    }
)


def dataset_info(name: str) -> DatasetInfo:
    """The registry entry for ``name``; ``jsonl:<path>`` is scored with the math verifier.

    ``math:3-5`` (any hub set with MATH levels, i.e. ``math`` and ``math500``) is that dataset
    restricted to the given difficulty levels.
    """
    if name.startswith("jsonl:"):
        path = name[len("jsonl:") :]
        return DatasetInfo(loader=lambda split: _load_jsonl(path), reward_fn="math", default_template="qwen-math")
    base, sep, level_spec = name.partition(":")
    if sep and base in HUB_SOURCES and HUB_SOURCES[base].has_levels:
        levels = _parse_levels(name, level_spec)
        info = DATASETS[base]
        return DatasetInfo(
            loader=lambda split: _load_hub(base, split, levels, name),
            reward_fn=info.reward_fn,
            default_template=info.default_template,
            eval_split=info.eval_split,
        )
    if name not in DATASETS:
        levelled = [n for n, s in HUB_SOURCES.items() if s.has_levels]
        raise ValueError(
            f"unknown dataset {name!r}; choose one of {sorted(DATASETS)}, 'jsonl:<path>', "
            f"or a level filter such as 'math:3-5' (for {levelled})"
        )
    return DATASETS[name]


def load_problems(name: str, split: str) -> list[Problem]:
    """Load dataset ``name`` (a registry key or ``jsonl:<path>``) as validated ``Problem`` dicts."""
    return validate_rows(dataset_info(name).loader(split), f"{name}[{split}]")


# ----------------------------------------------------------------------------------------------
# Prompt templates
# ----------------------------------------------------------------------------------------------
QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
R1_ZERO = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with the "
    "answer. The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>. "
    "User: {prompt}. Assistant: <think>"
)
DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem."
)
DAPO_REMINDER = 'Remember to put your answer on its own line after "Answer:".'
TEMPLATES = ("chat", "qwen-math", "r1-zero", "plain", "dapo")


def format_prompt(prompt: str, template: str, tokenizer) -> str:
    """Render one question with a named template.

    chat:      the tokenizer's chat template, one user turn, generation prompt added
    qwen-math: chat template with the Qwen-Math system prompt asking for ``\\boxed{}``
    r1-zero:   the DeepSeek-R1-Zero plain-text prompt for base models (ends inside ``<think>``)
    plain:     the question text as is
    dapo:      chat template, one user turn holding DAPO's instruction, the question and its reminder
               (as in BytedTsinghua-SIA/DAPO-Math-17k): the answer goes on a final ``Answer: ...`` line
    """
    if template == "chat":
        messages = [{"role": "user", "content": prompt}]
    elif template == "dapo":
        messages = [{"role": "user", "content": f"{DAPO_INSTRUCTION}\n\n{prompt}\n\n{DAPO_REMINDER}"}]
    elif template == "qwen-math":
        messages = [{"role": "system", "content": QWEN_MATH_SYSTEM}, {"role": "user", "content": prompt}]
    elif template == "r1-zero":
        return R1_ZERO.format(prompt=prompt)
    elif template == "plain":
        return prompt
    else:
        raise ValueError(f"unknown template {template!r}; choose one of {TEMPLATES}")
    if tokenizer.chat_template is None:
        raise ValueError(f"template {template!r} needs a tokenizer chat template; this tokenizer has none (use 'plain' or 'r1-zero')")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ----------------------------------------------------------------------------------------------
# Resumable, seeded prompt order
# ----------------------------------------------------------------------------------------------
def prompt_batch(num_items: int, cursor: int, batch_size: int, seed: int) -> list[int]:
    """Indices of the next ``batch_size`` items starting at ``cursor`` in a seeded epoch-wise shuffle.

    Epoch e uses the permutation of ``random.Random(seed * 1_000_003 + e)``; the caller advances the
    cursor by ``batch_size``. Saving the cursor in a checkpoint reproduces the data order on resume.
    """
    indices = []
    for position in range(cursor, cursor + batch_size):
        epoch, offset = divmod(position, num_items)
        indices.append(_epoch_order(num_items, seed, epoch)[offset])
    return indices


@functools.lru_cache(maxsize=4)
def _epoch_order(num_items: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(num_items))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)
