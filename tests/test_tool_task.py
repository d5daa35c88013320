"""The tiny tool task ``arith-tool`` (common/tasks.py) and its shipped warm start (common/tiny_tool_model).

The products are checked by hand; the demonstrations' observations are checked against what the tool loop itself
appends (``generate_with_tools`` around a scripted engine, with the shipped model's tokenizer), so the warm start's
SFT data are the token ids an RL rollout holds.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from common.data import DATASETS, TINY_TOOL_MODEL_DIR, dataset_info, load_problems, resolve_model_path
from common.engine_base import Completion
from common.tasks import (
    TOOL_ARITH_SPECS,
    load_tool_arith,
    make_tool_arith_problems,
    sample_tool_demonstration,
    tool_arith_segments,
)
from common.tool_loop import ToolConfig, generate_with_tools
from common.tools import calculator, format_python_observation
from common.verifiers import exact_reward

PROBLEM = {"prompt": "347*29=?", "answer": "10063", "solution": ""}  # 347*29 = 347*30 - 347 = 10410 - 347 = 10063


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY_TOOL_MODEL_DIR)


def test_problems_are_deterministic_and_the_gold_is_the_product():
    spec = TOOL_ARITH_SPECS["arith-tool"]
    first, again = make_tool_arith_problems(50, 7, spec), make_tool_arith_problems(50, 7, spec)
    assert first == again and first != make_tool_arith_problems(50, 8, spec)
    # the head of the shipped stream (the warm start and the held-out figures depend on it), products by hand
    test = load_tool_arith("arith-tool", "test")
    assert [(p["prompt"], p["answer"]) for p in test[:2]] == [("900*96=?", "86400"), ("181*82=?", "14842")]
    # 900*96 = 9*96 hundreds = 864 hundreds; 181*82 = 181*80 + 181*2 = 14480 + 362
    for p in test + load_tool_arith("arith-tool", "train")[:2000]:
        left, right = p["prompt"].removesuffix("=?").split("*")
        assert 100 <= int(left) <= 999 and 10 <= int(right) <= 99
        assert p["answer"] == str(int(left) * int(right))
        assert (
            p["solution"] == f"```python\n{left}*{right}\n```\n```output\n{p['answer']}\n```\n\\boxed{{{p['answer']}}}"
        )
        assert exact_reward(p["solution"], p["answer"]).correct


def test_splits_are_disjoint_sized_and_registered():
    train, test = load_problems("arith-tool", "train"), load_problems("arith-tool", "test")
    assert (len(train), len(test)) == (20_000, 200)
    prompts = [p["prompt"] for p in train]
    assert len(set(prompts)) == len(prompts) and not set(prompts) & {p["prompt"] for p in test}
    info = dataset_info("arith-tool")
    assert "arith-tool" in DATASETS and (info.reward_fn, info.default_template, info.eval_split) == (
        "exact",
        "chat",
        "test",
    )
    with pytest.raises(ValueError, match="splits"):
        load_tool_arith("arith-tool", "validation")


def test_demonstrations_by_hand():
    call = [
        ("```python\n347*29\n```\n", False),
        ("```output\n10063\n```\n", True),
        ("\\boxed{10063}", False),
    ]
    assert tool_arith_segments(PROBLEM, "call") == call
    assert tool_arith_segments(PROBLEM, "malformed") == [
        ("```python\n347x29\n```\n", False),
        ("```output\nError: invalid expression\n```\n", True),  # Python cannot parse 347x29
        ("\\boxed{10063}", False),
    ]
    assert tool_arith_segments(PROBLEM, "direct") == [("\\boxed{10063}", False)]
    # the observation is the tool's own answer in the loop's output fence
    assert call[1][0] == format_python_observation(calculator("347*29"))
    assert calculator("347x29").status == "error"
    with pytest.raises(ValueError, match="unknown demonstration"):
        tool_arith_segments(PROBLEM, "guess")


def test_the_warm_start_mix():
    rng = random.Random(0)
    kinds = []
    for _ in range(20_000):
        segments = sample_tool_demonstration(PROBLEM, rng, call_prob=0.4, malformed_prob=0.15)
        kinds.append("direct" if len(segments) == 1 else "malformed" if "x" in segments[0][0] else "call")
    # 0.6 direct, 0.4 * 0.85 = 0.34 call, 0.4 * 0.15 = 0.06 malformed; 4 standard errors ~ 0.007 at 20k draws
    assert abs(kinds.count("direct") / 20_000 - 0.60) < 0.015
    assert abs(kinds.count("call") / 20_000 - 0.34) < 0.015
    assert abs(kinds.count("malformed") / 20_000 - 0.06) < 0.01


class ScriptedEngine:
    """Returns the next scripted turn, encoded by the tokenizer, for each request (one prompt, n = 1 each)."""

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns, self.prompts = tok, list(turns), []

    def generate(self, prompt_ids, n, max_new_tokens, temperature, top_p, seed, stop=()):
        assert len(prompt_ids) == 1 and n == 1
        self.prompts.append(list(prompt_ids[0]))
        ids = self.tok(self.turns.pop(0), add_special_tokens=False)["input_ids"]
        return [Completion(ids, [-0.5] * len(ids), "stop")]


@pytest.mark.parametrize("kind", ["call", "malformed"])
def test_the_loop_appends_the_demonstrations_observation(tok, kind):
    turn1, observation, answer = tool_arith_segments(PROBLEM, kind)
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    engine = ScriptedEngine(tok, [turn1[0], answer[0] + tok.eos_token])
    prompt = encode("<|im_start|>user\n347*29=?<|im_end|>\n<|im_start|>assistant\n")
    (c,), (stats,) = generate_with_tools(
        engine, tok, [prompt], 1, 40, 1.0, 1.0, 0, (), ToolConfig(format="python", tool="calculator")
    )
    assert observation[1] and not turn1[1] and not answer[1]
    # the ids the loop holds are the SFT encoding: each segment on its own, the observation masked
    sft_ids = encode(turn1[0]) + encode(observation[0]) + encode(answer[0] + tok.eos_token)
    sft_mask = [0] * len(encode(turn1[0])) + [1] * len(encode(observation[0])) + [0] * len(encode(answer[0]) + [0])
    assert c.token_ids == sft_ids and c.observation_mask == sft_mask
    assert tok.decode([t for t, m in zip(c.token_ids, c.observation_mask) if m]) == observation[0]
    assert engine.prompts[1] == prompt + encode(turn1[0]) + encode(observation[0])
    assert (stats.calls, stats.errors) == (1, int(kind == "malformed"))
    assert c.finish_reason == "stop"


def test_tiny_tool_resolves_to_the_shipped_model(tok):
    assert Path(resolve_model_path("tiny-tool")) == TINY_TOOL_MODEL_DIR
    assert (TINY_TOOL_MODEL_DIR / "model.safetensors").exists() and (TINY_TOOL_MODEL_DIR / "README.md").exists()
    # the fences, the python tag and \boxed are single tokens; digits stay one token each (Qwen's split)
    for text in ("```", "python", "output", "\\boxed", "```\n"):
        assert len(tok(text, add_special_tokens=False)["input_ids"]) == 1, text
    assert len(tok("10063", add_special_tokens=False)["input_ids"]) == 5
