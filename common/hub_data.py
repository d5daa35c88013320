"""Hugging Face hub datasets: one pure row mapper per dataset, one generic loader.

Each hub row goes through a small pure mapper (``gsm8k_row``, ...) that returns a ``Problem`` (or None for a row
the dataset's filter skips) and raises ``RowError`` naming the field when a row is malformed; ``map_hub_rows``
adds the dataset name and row index to that message. ``HUB_SOURCES`` lists the hub id, config, splits and columns
of every dataset; ``common/data.py`` registers them by name.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Callable

from common.tasks import Problem


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
    solution = the DeepSeek-R1 teacher trace verbatim, usually starting with "<think>\\n"
    (``common.data.teacher_completion`` drops it after a prompt that ends with one).
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


EURUS2_MODES = ("math", "code", "mix")


def eurus2_rl_row(row: dict, mode: str = "math", code_row: Callable[[dict], Problem] | None = None) -> Problem | None:
    """PRIME-RL/Eurus-2-RL-Data: verl format, ``ability`` "math" or "code"; ``mode`` picks the rows kept.

    ``"math"`` (the ``eurus2-rl`` set) keeps math rows, mapped as always (no ``verifier`` key: the dataset's reward
    scores them); ``"code"`` keeps code rows, mapped by ``code_row`` (``common.code_data.eurus2_code_row``, verifier
    "code"); ``"mix"`` keeps both, each naming its verifier ("math" or "code"). Rows of other abilities give None.
    Math: prompt = the user message (PRIME's action-tag system prompt is dropped), answer = reward_model.ground_truth.
    """
    if mode not in EURUS2_MODES:
        raise ValueError(f"eurus2-rl mode must be one of {EURUS2_MODES}, not {mode!r}")
    ability = _text(row, "ability")
    if ability == "math" and mode != "code":
        problem = {
            "prompt": _user_content(row),
            "answer": _text(row, "reward_model.ground_truth").strip(),
            "solution": "",
        }
        return problem if mode == "math" else {**problem, "verifier": "math"}
    if ability == "code" and mode != "math":
        if code_row is None:
            raise ValueError("eurus2-rl code rows need a code_row mapper (common.code_data.eurus2_code_row)")
        return code_row(row)
    return None


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
        "DigitalLearningGmbH/MATH-lighteval",
        None,
        {"train": "train", "test": "test"},
        math_row,
        ("problem", "solution", "level"),
        has_levels=True,
    ),
    "math500": HubSource(
        "HuggingFaceH4/MATH-500",
        None,
        {"test": "test"},
        math500_row,
        ("problem", "answer", "solution", "level"),
        has_levels=True,
    ),
    "aime24": HubSource(
        "HuggingFaceH4/aime_2024", None, {"test": "train"}, aime24_row, ("problem", "answer", "solution")
    ),
    "aime25": HubSource("math-ai/aime25", None, {"test": "test"}, aime25_row, ("problem", "answer")),
    "dapo17k": HubSource(
        "open-r1/DAPO-Math-17k-Processed", "all", {"train": "train"}, dapo17k_row, ("prompt", "solution")
    ),
    "openr1-luffy": HubSource(
        "Elliott/Openr1-Math-46k-8192", None, {"train": "train"}, openr1_luffy_row, ("prompt", "reward_model", "target")
    ),
    "eurus2-rl": HubSource(
        "PRIME-RL/Eurus-2-RL-Data",
        None,
        {"train": "train", "validation": "validation"},
        eurus2_rl_row,
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
    return map_rows(source.path, row_fn, rows, label or name)


def map_rows(hub_id: str, row_fn: Callable[[dict], Problem | None], rows, label: str) -> list[Problem]:
    """Every row through ``row_fn`` (None drops it); a malformed row raises ValueError naming the dataset
    (``label``), the hub id, the row index and the field."""
    problems = []
    for i, row in enumerate(rows):
        try:
            if not isinstance(row, dict):
                raise RowError("<row>", f"expected an object, got {type(row).__name__}")
            problem = row_fn(row)
        except RowError as e:
            raise ValueError(f"dataset {label!r} ({hub_id}), row {i}: {e}") from None
        if problem is not None:
            problems.append(problem)
    return problems


def load_hub(name: str, split: str, levels: frozenset[int] | None = None, label: str | None = None) -> list[Problem]:
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
            "The Hugging Face hub is unreachable or offline "
            f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', 'unset')}) "
            f"and no cached copy was found under {cache}. Download it once where the hub is reachable "
            f"(same HF cache, then set HF_HUB_OFFLINE=1), or export prompt/answer/solution rows to a JSONL "
            f"file and use --dataset jsonl:<path>."
        ) from e
    if source.columns and hasattr(ds, "select_columns"):
        ds = ds.select_columns([c for c in source.columns if c in ds.column_names])
    return map_hub_rows(name, ds, levels, f"{label}[{split}]")
