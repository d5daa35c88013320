"""Code datasets: the registry of code hub sets and their loading (``load_code_hub``, ``map_code_rows``).

A code ``Problem`` has ``verifier = "code"`` and its ``answer`` is a JSON string of tests in one of three formats
(stdin/stdout, call-based, test code), checked by ``validate_tests``; that format and the code prompt are
``common/code_format.py``'s, and the pure row mapper of each dataset is ``common/code_hub_rows.py``'s. This module
re-exports the public names of both, so callers import from here.

Mappers follow ``common/hub_data.py``: a malformed row raises ``RowError`` naming the field, and
``map_code_rows`` adds the dataset name and row index. ``CODE_HUB_SOURCES`` lists the code-only hub sets;
``EURUS2_CODE_SOURCES`` holds PRIME's ``eurus2-rl`` code and mixed sets (``eurus2_rl_row`` with
``eurus2_code_row`` as its code mapper).
"""

from __future__ import annotations

import dataclasses
import functools
import os

from common.code_format import (
    CODE_FORMAT_STDIN,
    CODE_FORMAT_WITH_STARTER,
    CODE_INSTRUCTION,
    code_prompt,
    validate_tests,
)
from common.code_hub_rows import (
    DEEPCODER_CONFIGS,
    HUMANEVAL_QUESTION,
    LCB_MAX_DECOMPRESSED,
    decode_lcb_private,
    deepcoder_row,
    eurus2_code_row,
    humaneval_row,
    jsonl_code_row,
    livecodebench_row,
    mbpp_row,
)
from common.hub_data import HubSource, HubUnavailableError, eurus2_rl_row, map_rows
from common.tasks import Problem

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


__all__ = [
    "CODE_HUB_SOURCES",
    "EURUS2_CODE_SOURCES",
    "LCB_RELEASE_FILES",
    "load_code_hub",
    "map_code_rows",
    "CODE_FORMAT_STDIN",
    "CODE_FORMAT_WITH_STARTER",
    "CODE_INSTRUCTION",
    "code_prompt",
    "validate_tests",
    "DEEPCODER_CONFIGS",
    "HUMANEVAL_QUESTION",
    "LCB_MAX_DECOMPRESSED",
    "decode_lcb_private",
    "deepcoder_row",
    "eurus2_code_row",
    "humaneval_row",
    "jsonl_code_row",
    "livecodebench_row",
    "mbpp_row",
]
