"""Datasets by name, prompt templates, and the offline synthetic task.

Every dataset is loaded as a list of ``Problem`` dicts with three string fields:

    prompt    the question as the user would ask it (no template applied)
    answer    the gold final answer, checked by the dataset's reward function
    solution  a worked solution ending in the answer ("" when the dataset has none); LUFFY uses it
              as the off-policy teacher trace, the tiny model's warm start uses it as SFT data

``load_problems(name, split)`` returns that list; ``format_prompt`` applies a named template;
``prompt_batch`` walks a list in a seeded, resumable order (the data cursor saved in checkpoints).

The offline tasks (``arith``, ``arith-hard``; ``common/tasks.py``) need no network: chain arithmetic such as
``4+7-2=?`` with the worked solution ``4+7=11;11-2=9;\\boxed{9}``. Held-out splits are disjoint from train splits.
``code-expr`` (``common/tasks.py``; ``--dataset code-expr`` wants ``--model tiny-code``) is its code counterpart: a
prompt such as ``Read a b c. Print a*b-c.``, a one-block Python solution, and hidden stdin/stdout tests as the gold.
``arith-tool`` (``--dataset arith-tool`` wants ``--model tiny-tool`` and ``--tools.format python --tools.tool
calculator``) is the tool task: products such as ``347*29=?`` that the model answers by calling the calculator.

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
what the Dr. GRPO / oat recipe trains on). Each hub row goes through a small pure mapper in ``common/hub_data.py``
that raises ``ValueError`` naming the dataset, the hub row index and the field when a row is malformed.
For ``openr1-luffy`` the ``solution`` is the DeepSeek-R1 teacher trace, kept verbatim; pass it
through ``teacher_completion`` with the rendered prompt to drop a ``<think>`` the prompt already ends with.
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from common.code_data import CODE_HUB_SOURCES, EURUS2_CODE_SOURCES, jsonl_code_row, load_code_hub
from common.hub_data import HUB_SOURCES, load_hub
from common.tasks import ARITH_SPECS, CODE_SPECS, TOOL_ARITH_SPECS, Problem, load_arith, load_code, load_tool_arith

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL_DIR = REPO_ROOT / "common" / "tiny_model"
TINY_CODE_MODEL_DIR = REPO_ROOT / "common" / "tiny_code_model"  # the code-expr warm start (--model tiny-code)
TINY_TOOL_MODEL_DIR = REPO_ROOT / "common" / "tiny_tool_model"  # the arith-tool warm start (--model tiny-tool)
# algos/opd.py's teacher for the tiny default (--teacher tiny-teacher): the tiny model after 60 GRPO steps, shipped
# with the command that built it in its README.md (a GRPO run is not bit-reproducible across CPUs)
TINY_TEACHER_MODEL_DIR = REPO_ROOT / "common" / "tiny_teacher_model"
# the shipped offline policies (--model): CPU-sized, trained at the tiny default learning rate
SHIPPED_MODELS = ("tiny", "tiny-code", "tiny-tool")


def resolve_model_path(name_or_path: str) -> str:
    """Map ``"tiny"`` (``"tiny-code"``, ``"tiny-tool"``) to the shipped offline (code, tool) model folder; pass any
    other hub id or path through."""
    if name_or_path == "tiny-teacher":  # opd.py's shipped teacher
        return str(TINY_TEACHER_MODEL_DIR)
    shipped = {
        "tiny": (TINY_MODEL_DIR, ""),
        "tiny-code": (TINY_CODE_MODEL_DIR, " --task code-expr"),
        "tiny-tool": (TINY_TOOL_MODEL_DIR, " --task arith-tool --sft-steps 1000"),
    }
    if name_or_path in shipped:
        folder, flags = shipped[name_or_path]
        if not (folder / "config.json").exists():
            raise FileNotFoundError(
                f"the shipped {name_or_path} model is missing from {folder}; rebuild it with "
                f"`python scripts/build_tiny_model.py{flags}`"
            )
        return str(folder)
    local = Path(name_or_path).expanduser()
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1
    if looks_local and not local.exists():
        raise FileNotFoundError(f"--model {name_or_path!r}: no such local path (and not a hub id of the form org/name)")
    return str(local) if local.exists() else name_or_path


# ----------------------------------------------------------------------------------------------
# Local JSONL files
# ----------------------------------------------------------------------------------------------
def validate_rows(rows: list[dict], dataset: str, line_numbers: list[int] | None = None) -> list[Problem]:
    """Check every row has non-empty string ``prompt`` and ``answer`` (and string ``solution`` if present).

    An integer ``answer`` (some AIME copies store it so) becomes its decimal string, as in the hub mappers; a bool or
    float does not. Raises ValueError naming the dataset, the row index and the field, so a bad row never trains
    silently. ``line_numbers`` (1-based, one per row) adds the file line to the message, e.g. ``row 2 (line 4)``.
    """
    problems = []
    for index, row in enumerate(rows):
        i = f"{index} (line {line_numbers[index]})" if line_numbers else index
        if not isinstance(row, dict):
            raise ValueError(f"dataset {dataset!r}, row {i}: expected an object, got {type(row).__name__}")
        values = {}
        for field in ("prompt", "answer"):
            if field not in row:
                raise ValueError(f"dataset {dataset!r}, row {i}: missing field {field!r}")
            value = row[field]
            # an int's decimal string is exact; a float's repr ("1e-05", "0.30000000000000004") need not be the gold
            if field == "answer" and isinstance(value, int) and not isinstance(value, bool):
                value = str(value)
            if not isinstance(value, str):
                kind = "a string or an integer" if field == "answer" else "a string"
                raise ValueError(
                    f"dataset {dataset!r}, row {i}: field {field!r} must be {kind}, got {type(value).__name__}"
                )
            if not value.strip():
                raise ValueError(f"dataset {dataset!r}, row {i}: field {field!r} is empty")
            values[field] = value
        solution = row.get("solution", "")
        if not isinstance(solution, str):
            raise ValueError(f"dataset {dataset!r}, row {i}: field 'solution' must be a string")
        problem = {"prompt": values["prompt"], "answer": values["answer"].strip(), "solution": solution}
        if "verifier" in row:  # the row's own verifier (a mixed set); it must agree with what its gold is
            from common.code_reward import is_code_gold

            if row["verifier"] not in ("math", "exact", "code", "code-partial"):
                raise ValueError(f"dataset {dataset!r}, row {i}: unknown verifier {row['verifier']!r}")
            if row["verifier"].startswith("code") != is_code_gold(problem["answer"]):
                raise ValueError(
                    f"dataset {dataset!r}, row {i}: verifier {row['verifier']!r} but its answer "
                    f"{'is' if is_code_gold(problem['answer']) else 'is not'} a code tests string"
                )
            problem["verifier"] = row["verifier"]
        problems.append(problem)
    if not problems:
        raise ValueError(f"dataset {dataset!r} is empty")
    return problems


def _jsonl_has_tests(path: str) -> bool:
    """Whether the file's first row has a ``tests`` field (the whole file is then read as code problems)."""
    file = Path(path).expanduser()
    if not file.exists():
        return False
    with file.open() as f:
        for line in f:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(row, dict) and "tests" in row
    return False


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
    if rows and isinstance(rows[0], dict) and "tests" in rows[0]:
        mapped = []
        for index, row in enumerate(rows):
            try:
                mapped.append(jsonl_code_row(row))
            except ValueError as e:
                raise ValueError(f"dataset 'jsonl:{path}', row {index} (line {line_numbers[index]}): {e}") from None
        rows = mapped
    return validate_rows(rows, f"jsonl:{path}", line_numbers)


def _parse_levels(name: str, spec: str) -> frozenset[int]:
    """``"3-5"`` -> {3, 4, 5}; ``"5"`` -> {5}; ``"1,3-4"`` -> {1, 3, 4}; levels are 1..5."""
    levels: set[int] = set()
    for part in spec.split(","):
        m = re.fullmatch(r"\s*([1-5])\s*(?:-\s*([1-5])\s*)?", part)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ValueError(
                f"dataset {name!r}: bad level filter {spec!r}; "
                "use levels 1..5 such as 'math:3-5', 'math:5' or 'math:1,3-4'"
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
    name: DatasetInfo(
        loader=lambda split, name=name: load_arith(name, split), reward_fn="exact", default_template="chat"
    )
    for name in ARITH_SPECS
}
# the offline code task (read integers, print an expression): graded by its hidden stdin/stdout tests; its warm
# start is --model tiny-code (the tiny arith model has never seen a program)
DATASETS.update(
    {
        name: DatasetInfo(
            loader=lambda split, name=name: load_code(name, split), reward_fn="code", default_template="chat"
        )
        for name in CODE_SPECS
    }
)
# the same problems under partial credit (the fraction of hidden tests passed, not all-or-nothing): the claims
# testbed's code-reward comparison trains on <name>-partial and evaluates on <name> (all-pass)
DATASETS.update(
    {
        f"{name}-partial": DatasetInfo(
            loader=lambda split, name=name: load_code(name, split), reward_fn="code-partial", default_template="chat"
        )
        for name in CODE_SPECS
    }
)
# the offline tool task (products for the calculator): exact match on the last \boxed{}, which follows the tool's
# output fence; its warm start is --model tiny-tool, run with --tools.format python --tools.tool calculator
DATASETS.update(
    {
        name: DatasetInfo(
            loader=lambda split, name=name: load_tool_arith(name, split), reward_fn="exact", default_template="chat"
        )
        for name in TOOL_ARITH_SPECS
    }
)
# Hub sets. eval_split is the dataset's own held-out split; the training-only sets (dapo17k,
# openr1-luffy) have none, so evaluate models trained on them on math500 / aime24 / aime25.
_HUB_EVAL_SPLITS = {"dapo17k": "train", "openr1-luffy": "train", "eurus2-rl": "validation"}
DATASETS.update(
    {
        name: DatasetInfo(
            loader=lambda split, name=name: load_hub(name, split),
            reward_fn="math",
            default_template="dapo" if name == "dapo17k" else "qwen-math",
            eval_split=_HUB_EVAL_SPLITS.get(name, "test"),
        )
        for name in HUB_SOURCES
    }
)


# Code sets (common/code_data.py): prompts carry DeepCoder's instruction and any starter code already, so they render
# with the plain chat template; eurus2-rl-mix mixes math and code rows, each scored by its own verifier (per-row)
_CODE_EVAL_SPLITS = {"humaneval": "test", "livecodebench": "test", "eurus2-rl-code": "validation"}
_CODE_EVAL_SPLITS["eurus2-rl-mix"] = "validation"
for _name, _source in {**CODE_HUB_SOURCES, **EURUS2_CODE_SOURCES}.items():
    DATASETS[_name] = DatasetInfo(
        loader=lambda split, name=_name: load_code_hub(name, split),
        reward_fn="per-row" if _name == "eurus2-rl-mix" else "code",
        default_template="qwen-math" if _name == "eurus2-rl-mix" else "chat",
        eval_split=_CODE_EVAL_SPLITS.get(_name, "test" if "test" in _source.splits else "train"),
    )


def dataset_info(name: str, flag: str = "--dataset") -> DatasetInfo:
    """The registry entry for ``name``; ``jsonl:<path>`` is scored with the math verifier.

    ``math:3-5`` (any hub set with MATH levels, i.e. ``math`` and ``math500``) is that dataset
    restricted to the given difficulty levels. An unknown name exits (``SystemExit``) with a one-line message
    naming ``flag`` (the command-line flag it came from), the known names and the ``jsonl:<path>`` form.
    """
    if name.startswith("jsonl:"):
        path = name[len("jsonl:") :]
        if _jsonl_has_tests(path):  # code problems: a ``tests`` field in one of common/code_reward.py's formats
            return DatasetInfo(loader=lambda split: _load_jsonl(path), reward_fn="code", default_template="chat")
        return DatasetInfo(loader=lambda split: _load_jsonl(path), reward_fn="math", default_template="qwen-math")
    base, sep, level_spec = name.partition(":")
    if sep and base in HUB_SOURCES and HUB_SOURCES[base].has_levels:
        levels = _parse_levels(name, level_spec)
        info = DATASETS[base]
        return DatasetInfo(
            loader=lambda split: load_hub(base, split, levels, name),
            reward_fn=info.reward_fn,
            default_template=info.default_template,
            eval_split=info.eval_split,
        )
    if name not in DATASETS:
        levelled = [n for n, s in HUB_SOURCES.items() if s.has_levels]
        raise SystemExit(  # a mistyped flag, not a bug: the message says it all, a traceback would bury it
            f"{flag}: unknown dataset {name!r}; choose one of {sorted(DATASETS)}, 'jsonl:<path>', "
            f"or a level filter such as 'math:3-5' (for {levelled})"
        )
    return DATASETS[name]


def load_problems(name: str, split: str) -> list[Problem]:
    """Load dataset ``name`` (a registry key or ``jsonl:<path>``) as validated ``Problem`` dicts."""
    return validate_rows(dataset_info(name).loader(split), f"{name}[{split}]")


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
# text that ends a completion under a template, besides the stop tokens (EOS, the chat template's end of turn):
# r1-zero's answer closes with a tag, not a token (oat and the R1-zero recipes stop there; the tag stays in the text)
STOP_STRINGS = {"r1-zero": ("</answer>",)}


def check_template(template: str, flag: str = "--template") -> None:
    """Exit (``SystemExit``) with a one-line message naming ``flag`` and the known templates if ``template`` is unknown.

    Scripts call it when they load their task, so a mistyped template stops the run before any model loads.
    """
    if template not in TEMPLATES:
        raise SystemExit(f"{flag}: unknown template {template!r}; choose one of {list(TEMPLATES)}")


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
        raise ValueError(
            f"template {template!r} needs a tokenizer chat template; this tokenizer has none (use 'plain' or 'r1-zero')"
        )
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
