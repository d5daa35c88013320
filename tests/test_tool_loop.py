"""common/tool_loop.py: the multi-turn tool loop around an engine.

A scripted engine (the tiny model's tokenizer, which is close to character level, turns scripted text into ids; stop
ids, stop strings and the token budget cut them as the real engines do; every call is recorded) checks token in /
token out, the observation ids, mask and zero log-probs, per-turn seeds, the three budgets, max_calls, parallel calls,
tool errors as observations, a fence that is no call, the chat format, and observation truncation. The real HFEngine
on the tiny model checks that with the loop on and no call made, the rollout is the single-turn one bit for bit.
Expected ids are built from the texts written out by hand here, never from the loop's own output.
"""

import hashlib
import re
import threading
from dataclasses import dataclass

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.data import TINY_MODEL_DIR, format_prompt
from common.engine_base import Completion
from common.rollout import HFEngine
from common.tool_loop import ToolConfig, ToolStats, generate_with_tools, tool_metrics, turn_seed

TOK = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
EOS, IM_START = 2, 1  # the tiny tokenizer's <|im_end|> (its EOS) and <|im_start|>


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def char_ids(text: str) -> list[int]:
    """One id per character (special tokens such as <|im_end|> kept whole)."""
    pieces = re.split(r"(<\|[a-z_]+\|>)", text)
    return [i for piece in pieces for i in (ids(piece) if piece.startswith("<|") else [ids(ch)[0] for ch in piece])]


def fake_logprobs(token_ids: list[int]) -> list[float]:
    return [-(t + 1) / 1000 for t in token_ids]  # never 0.0: an observation's 0.0 stands out


@dataclass
class Call:
    prompts: list[list[int]]
    n: int
    max_new_tokens: int
    seeds: int | list[int]
    stop: tuple[str, ...]


class ScriptedEngine:
    """``script[decoded prompt]`` = the texts of its n samples (one for a later turn's prompt). Each text is encoded,
    then cut after the first stop id (<|endoftext|>, <|im_end|>), after the token that completes a stop string, or at
    ``max_new_tokens``, as HFEngine cuts; ``stop_strings=False`` ignores stop strings (an engine that missed one);
    ``by_char``: one id per character, not the tokenizer's merges (a sampler may draw any tokenization of a text)."""

    def __init__(self, script: dict[str, list[str]], stop_strings: bool = True, by_char: bool = False):
        self.script, self.stop_strings, self.by_char = script, stop_strings, by_char
        self.calls: list[Call] = []
        self.outputs: list[list[Completion]] = []

    def generate(self, prompt_ids, n, max_new_tokens, temperature, top_p, seed, stop=()):
        self.calls.append(Call([list(p) for p in prompt_ids], n, max_new_tokens, seed, tuple(stop)))
        out = []
        for prompt in prompt_ids:
            texts = self.script[TOK.decode(prompt)]
            assert len(texts) == n
            out += [
                self.complete(char_ids(text) if self.by_char else ids(text), max_new_tokens, stop) for text in texts
            ]
        self.outputs.append(out)
        return out

    def complete(self, token_ids: list[int], max_new_tokens: int, stop) -> Completion:
        for k, t in enumerate(token_ids[:max_new_tokens]):
            hit = self.stop_strings and any(s in TOK.decode(token_ids[: k + 1]) for s in stop)
            if t in (0, EOS) or hit:
                return Completion(token_ids[: k + 1], fake_logprobs(token_ids[: k + 1]), "stop")
        cut = token_ids[:max_new_tokens]
        return Completion(cut, fake_logprobs(cut), "length" if len(token_ids) > max_new_tokens else "stop")


class KeyDefault(dict):
    """A script whose unknown prompts (an observation cut where the test does not fix it) all get ``default``."""

    def __init__(self, script, default):
        super().__init__(script)
        self.default = default

    def __missing__(self, key):
        return self.default


Q = "Q: 12*34?\n"
CALL = "The answer is this.\n```python\n12*34\n```\n"  # the python format's stop string "\n```\n" closes it
OBS = "```output\n408\n```\n"  # 12*34 = 408, ToRL's output fence
ANSWER = "So \\boxed{408}.<|im_end|>"


def calculator_cfg(**kw) -> ToolConfig:
    """The python format with the calculator; no answer marker unless asked (void = a fence with no call)."""
    return ToolConfig(format="python", tool="calculator", **{"answer_marker": "", **kw})


def test_token_in_token_out_observation_mask_and_logprobs():
    # turn 1 is sampled one character per token: re-encoding the history would merge "The answer is" and change ids
    assert char_ids(CALL) != ids(CALL) and TOK.decode(char_ids(CALL)) == CALL
    engine = ScriptedEngine({Q: [CALL, "It is 408.<|im_end|>"], Q + CALL + OBS: [ANSWER]}, by_char=True)
    out, stats = generate_with_tools(
        engine, TOK, [ids(Q)], 2, 64, 1.0, 1.0, [5], stop=("</answer>",), cfg=calculator_cfg()
    )
    first, second = engine.calls
    assert (first.n, first.max_new_tokens, first.seeds) == (2, 64, [5])
    assert first.stop == ("</answer>", "\n```\n")  # the caller's stop strings, then the tool's
    # the second turn's prompt: the prompt + turn 1's ids as the engine returned them + the observation's ids
    turn1, turn2 = char_ids(CALL), char_ids(ANSWER)
    assert second.prompts == [ids(Q) + turn1 + ids(OBS)]
    assert (second.n, second.max_new_tokens, second.seeds) == (1, 64 - len(turn1), [turn_seed(5, 0, 1)])
    c = out[0]
    assert c.token_ids == turn1 + ids(OBS) + turn2
    assert c.observation_mask == [0] * len(turn1) + [1] * len(ids(OBS)) + [0] * len(turn2)
    assert c.logprobs == fake_logprobs(turn1) + [0.0] * len(ids(OBS)) + fake_logprobs(turn2)
    assert c.finish_reason == "stop"
    assert stats[0] == ToolStats(calls=1, obs_tokens=len(ids(OBS)), turns=2)
    # the sample that made no call is the engine's own completion, untouched
    assert out[1] is engine.outputs[0][1] and out[1].observation_mask is None
    assert stats[1] == ToolStats(turns=1)


def test_seeds_of_later_turns_are_derived_per_sample_and_turn():
    again = "```python\n2+2\n```\n"
    script = {
        "A\n": [CALL, CALL],
        "B\n": [CALL, CALL],
        "A\n" + CALL + OBS: [again],
        "B\n" + CALL + OBS: [again],
        "A\n" + CALL + OBS + again + "```output\n4\n```\n": ["done<|im_end|>"],
        "B\n" + CALL + OBS + again + "```output\n4\n```\n": ["done<|im_end|>"],
    }
    engine = ScriptedEngine(script)
    out, stats = generate_with_tools(
        engine, TOK, [ids("A\n"), ids("B\n")], 2, 200, 1.0, 1.0, [11, 22], cfg=calculator_cfg()
    )
    assert [s.turns for s in stats] == [3] * 4 and [s.calls for s in stats] == [2] * 4
    assert engine.calls[0].seeds == [11, 22] and engine.calls[0].n == 2
    later = [engine.calls[1].seeds, engine.calls[2].seeds]
    assert later == [[turn_seed(p, j, t) for p in (11, 22) for j in (0, 1)] for t in (1, 2)]
    flat = later[0] + later[1]
    assert len(set(flat)) == 8  # distinct across samples and turns
    assert not set(flat) & {11, 12, 22, 23}  # never the seeds turn 1's samples drew from (seed + j)
    assert all(0 <= s < 2**62 for s in flat)
    # the documented definition: blake2b-64 of the three ints (16-byte little-endian each), personalised, >> 2
    key = b"".join(x.to_bytes(16, "little", signed=True) for x in (11, 1, 2))
    assert (
        turn_seed(11, 1, 2)
        == int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"tool-loop-turn").digest(), "little") >> 2
    )
    rerun = ScriptedEngine(script)
    generate_with_tools(rerun, TOK, [ids("A\n"), ids("B\n")], 2, 200, 1.0, 1.0, [11, 22], cfg=calculator_cfg())
    assert [c.seeds for c in rerun.calls] == [c.seeds for c in engine.calls]


def test_sampled_budget_spans_turns_and_each_sample_is_cut_at_its_own():
    short = "```python\n1+1\n```\n"
    long = "Let me think first.\n```python\n1+1\n```\n"
    rambling = "x" * 80
    script = {
        Q: [short, long],
        Q + short + "```output\n2\n```\n": [rambling],
        Q + long + "```output\n2\n```\n": [rambling],
    }
    engine = ScriptedEngine(script)
    out, stats = generate_with_tools(engine, TOK, [ids(Q)], 2, 48, 1.0, 1.0, [0], cfg=calculator_cfg())
    assert len(engine.calls) == 2
    # one request for both continuing samples, with the larger of their remaining sampled budgets
    assert engine.calls[1].max_new_tokens == 48 - len(ids(short))
    for c, turn1 in zip(out, (short, long)):
        assert c.finish_reason == "length"
        assert c.observation_mask.count(0) == 48  # sampled tokens, across both turns, fill max_new_tokens exactly
        assert c.token_ids == ids(turn1) + ids("```output\n2\n```\n") + ids(rambling)[: 48 - len(ids(turn1))]


def test_total_budget_drops_an_observation_that_leaves_no_room():
    engine = ScriptedEngine({Q: [CALL]})
    cfg = calculator_cfg(max_total_tokens=len(ids(CALL)) + len(ids(OBS)))  # room for the observation, none after
    out, stats = generate_with_tools(engine, TOK, [ids(Q)], 1, 64, 1.0, 1.0, [0], cfg=cfg)
    assert len(engine.calls) == 1
    assert out[0].token_ids == ids(CALL) and out[0].finish_reason == "length" and out[0].observation_mask is None
    assert stats[0].calls == 1 and stats[0].obs_tokens == 0
    # one more token of total budget: the observation goes in and turn 2 may sample exactly one token
    engine = ScriptedEngine({Q: [CALL], Q + CALL + OBS: [ANSWER]})
    cfg = calculator_cfg(max_total_tokens=len(ids(CALL)) + len(ids(OBS)) + 1)
    out, _ = generate_with_tools(engine, TOK, [ids(Q)], 1, 64, 1.0, 1.0, [0], cfg=cfg)
    assert engine.calls[1].max_new_tokens == 1
    assert out[0].token_ids == ids(CALL) + ids(OBS) + ids(ANSWER)[:1] and out[0].finish_reason == "length"


def test_context_length_bounds_the_turn():
    engine = ScriptedEngine({Q: [CALL], Q + CALL + OBS: [ANSWER]})
    context = len(ids(Q)) + len(ids(CALL)) + len(ids(OBS)) + 3
    out, _ = generate_with_tools(engine, TOK, [ids(Q)], 1, 64, 1.0, 1.0, [0], cfg=calculator_cfg(), context_len=context)
    assert engine.calls[1].max_new_tokens == 3
    assert len(ids(Q)) + len(out[0].token_ids) == context and out[0].finish_reason == "length"


def test_max_calls_ends_the_sample_on_an_unrun_call():
    second = "```python\n1+1\n```\n"
    engine = ScriptedEngine({Q: [CALL], Q + CALL + OBS: [second]})
    out, stats = generate_with_tools(engine, TOK, [ids(Q)], 1, 64, 1.0, 1.0, [0], cfg=calculator_cfg(max_calls=1))
    assert len(engine.calls) == 2  # no third turn
    assert out[0].token_ids == ids(CALL) + ids(OBS) + ids(second) and out[0].finish_reason == "stop"
    assert stats[0].calls == 1 and stats[0].call_limited and stats[0].turns == 2


def slow_tool_run(workers: int, barrier_timeout: float) -> tuple[list[str], list[ToolStats]]:
    barrier = threading.Barrier(2, timeout=barrier_timeout)

    def slow(code: str) -> str:
        barrier.wait()  # returns only once both samples' calls are running at the same time
        return "ok"

    call = "```python\nwait()\n```\n"
    engine = ScriptedEngine(KeyDefault({Q: [call, call]}, ["done<|im_end|>"]))
    cfg = ToolConfig(format="python", tool="slow", workers=workers, answer_marker="")
    out, stats = generate_with_tools(engine, TOK, [ids(Q)], 2, 64, 1.0, 1.0, [0], cfg=cfg, tools={"slow": slow})
    return [TOK.decode([t for t, m in zip(c.token_ids, c.observation_mask) if m]) for c in out], stats


def test_waiting_samples_call_their_tools_in_parallel():
    observations, stats = slow_tool_run(workers=8, barrier_timeout=10.0)
    assert observations == ["```output\nok\n```\n"] * 2 and [s.errors for s in stats] == [0, 0]
    # one worker runs the calls one after the other: the first waits for a partner that never comes
    observations, stats = slow_tool_run(workers=1, barrier_timeout=0.2)
    assert all(o.startswith("```output\nError: slow failed: BrokenBarrierError") for o in observations)
    assert [s.errors for s in stats] == [1, 1]


def test_a_tool_error_is_an_observation():
    call = "```python\n1/0\n```\n"
    obs = "```output\nError: division by zero\n```\n"
    engine = ScriptedEngine({Q: [call], Q + call + obs: [ANSWER]})
    out, stats = generate_with_tools(engine, TOK, [ids(Q)], 1, 64, 1.0, 1.0, [0], cfg=calculator_cfg())
    assert out[0].token_ids == ids(call) + ids(obs) + ids(ANSWER)
    assert stats[0] == ToolStats(calls=1, errors=1, obs_tokens=len(ids(obs)), turns=2)


def test_a_fence_that_is_no_call_samples_on_without_an_observation():
    fence = "See:\n```text\nhi\n```\n"  # stops at the closing fence of a text block: no python call
    engine = ScriptedEngine({Q: [fence], Q + fence: ["Done.<|im_end|>"]})
    out, stats = generate_with_tools(engine, TOK, [ids(Q)], 1, 64, 1.0, 1.0, [9], cfg=calculator_cfg())
    assert engine.calls[1].prompts == [ids(Q) + ids(fence)] and engine.calls[1].seeds == [turn_seed(9, 0, 1)]
    assert out[0].token_ids == ids(fence) + ids("Done.<|im_end|>") and out[0].observation_mask is None
    assert out[0].logprobs == fake_logprobs(ids(fence)) + fake_logprobs(ids("Done.<|im_end|>"))
    assert stats[0] == ToolStats(turns=2, void_turns=1)


CHAT_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
# the tiny model's template frames a tool turn as "<|im_end|>" + "\n<|im_start|>tool\n" + result + after
CHAT_OBS = "<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("stopped_on_end_of_turn", [False, True])
def test_chat_format_and_a_call_closed_by_the_end_of_turn(stopped_on_end_of_turn):
    # True: the engine did not stop at "</tool_call>" but at the end-of-turn id after it (a stop id), so the
    # observation must not repeat <|im_end|>
    call = CHAT_CALL + ("<|im_end|>" if stopped_on_end_of_turn else "")
    obs = CHAT_OBS.removeprefix("<|im_end|>") if stopped_on_end_of_turn else CHAT_OBS
    engine = ScriptedEngine(
        {Q: [call], Q + call + obs: ["It is 5.<|im_end|>"]}, stop_strings=not stopped_on_end_of_turn
    )
    out, stats = generate_with_tools(
        engine, TOK, [ids(Q)], 1, 128, 1.0, 1.0, [0], cfg=ToolConfig(format="chat", answer_marker="")
    )
    assert engine.calls[0].stop == ("</tool_call>",)
    obs_ids = ids(obs)
    assert obs_ids.count(EOS) == (1 if stopped_on_end_of_turn else 2) and obs_ids.count(IM_START) == 2  # special ids
    assert out[0].token_ids == ids(call) + obs_ids + ids("It is 5.<|im_end|>")
    assert out[0].observation_mask == [0] * len(ids(call)) + [1] * len(obs_ids) + [0] * len(ids("It is 5.<|im_end|>"))
    assert stats[0].calls == 1 and stats[0].errors == 0


def test_an_eos_after_a_closed_call_tag_ends_the_sample():
    # "</tool_call>" then <|endoftext|>, not the end-of-turn: no call, and not a tool stop either (the long stop
    # string of the caller widens the window of tokens read back, so "</tool_call>" lies inside it)
    call = CHAT_CALL + "<|endoftext|>"
    engine = ScriptedEngine({Q: [call]}, stop_strings=False)
    stop = ("</a-long-final-answer-tag>",)
    out, stats = generate_with_tools(
        engine, TOK, [ids(Q)], 1, 128, 1.0, 1.0, [0], stop, ToolConfig(format="chat", answer_marker="")
    )
    assert len(engine.calls) == 1 and out[0] is engine.outputs[0][0] and stats[0] == ToolStats(turns=1)


def test_observation_truncation_in_characters_then_tokens():
    call = "```python\n10**60\n```\n"  # 1 followed by 60 zeros: 61 characters
    # characters: 20 is too few for the marker, so the head alone is kept
    obs = "```output\n1" + "0" * 19 + "\n```\n"
    engine = ScriptedEngine({Q: [call], Q + call + obs: [ANSWER]})
    out, _ = generate_with_tools(engine, TOK, [ids(Q)], 1, 64, 1.0, 1.0, [0], cfg=calculator_cfg(max_obs_chars=20))
    assert out[0].token_ids == ids(call) + ids(obs) + ids(ANSWER)
    # tokens: the framing takes len(ids("```output\n\n```\n")) tokens; 40 more for the result, which must be cut
    limit = len(ids("```output\n\n```\n")) + 40
    engine = ScriptedEngine({Q: [call]}, stop_strings=True)
    engine.script = KeyDefault(engine.script, [ANSWER])
    out, stats = generate_with_tools(
        engine, TOK, [ids(Q)], 1, 200, 1.0, 1.0, [0], cfg=calculator_cfg(max_obs_tokens=limit)
    )
    obs_ids = [t for t, m in zip(out[0].token_ids, out[0].observation_mask) if m]
    text = TOK.decode(obs_ids)
    assert limit - 3 <= len(obs_ids) <= limit and stats[0].obs_tokens == len(obs_ids)
    assert text.startswith("```output\n1000") and text.endswith("000\n```\n") and "...[truncated " in text
    with pytest.raises(ValueError, match="max-obs-tokens"):
        generate_with_tools(engine, TOK, [ids(Q)], 1, 64, 1.0, 1.0, [0], cfg=calculator_cfg(max_obs_tokens=5))


def test_format_none_is_the_engine_call_itself():
    engine = ScriptedEngine({Q: [CALL, ANSWER]})
    out, stats = generate_with_tools(engine, TOK, [ids(Q)], 2, 64, 0.5, 0.9, 7, stop=("</answer>",), cfg=ToolConfig())
    assert out is engine.outputs[0] and len(engine.calls) == 1
    assert engine.calls[0] == Call([ids(Q)], 2, 64, 7, ("</answer>",))  # no tool stop strings
    assert stats == [ToolStats(), ToolStats()]


def test_tool_metrics_hand_values():
    stats = [
        ToolStats(calls=2, errors=1, obs_tokens=10, turns=3),
        ToolStats(turns=1, void_turns=1),
        ToolStats(calls=1, timeouts=1, obs_tokens=5, turns=2, call_limited=True),
    ]
    assert tool_metrics(stats) == pytest.approx(
        {
            "tools/calls_per_sample": 1.0,  # 3 calls / 3 samples
            "tools/call_rate": 2 / 3,
            "tools/error_rate": 1 / 3,  # per call
            "tools/timeout_rate": 1 / 3,
            "tools/sandbox_error_rate": 0.0,
            "tools/obs_tokens": 5.0,  # 15 / 3
            "tools/turns": 2.0,
            "tools/void_turns": 1 / 3,
            "tools/void_rate": 1 / 3,
            "tools/call_limit_rate": 1 / 3,
            "tools/success_rate": 1 / 3,  # 3 calls, 1 error, 1 timeout: one ran cleanly
        }
    )
    assert tool_metrics([]) == {}
    assert tool_metrics([ToolStats()])["tools/error_rate"] == 0.0  # no call: no division by zero


def test_a_final_turn_without_the_answer_marker_is_void_and_the_filter_excludes_the_sample():
    no_answer = "I give up.<|im_end|>"
    engine = ScriptedEngine({Q: [CALL, no_answer, ANSWER], Q + CALL + OBS: [ANSWER]})  # a call, no answer, an answer
    cfg = calculator_cfg(answer_marker="\\boxed{", void_filter=True)
    out, stats = generate_with_tools(engine, TOK, [ids(Q)], 3, 64, 1.0, 1.0, [0], cfg=cfg)
    # sample 0: call, then "\boxed{408}": no void; sample 1: ends with no call and no \boxed{: one void turn
    assert [s.void_turns for s in stats] == [0, 1, 0]
    assert [c.excluded for c in out] == [False, True, False]
    assert [c.tool_stats for c in out] == stats
    off = generate_with_tools(
        ScriptedEngine({Q: [no_answer]}), TOK, [ids(Q)], 1, 64, 1.0, 1.0, [0], cfg=calculator_cfg()
    )
    assert off[1][0].void_turns == 0 and not off[0][0].excluded  # answer_marker "": only fences are void


@pytest.mark.parametrize("fmt", ["python", "chat"])
def test_hf_engine_without_a_call_is_the_single_turn_rollout_bit_for_bit(fmt):
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR), TOK)
    prompts = [ids(format_prompt(q, "chat", TOK)) for q in ("1+2-3=?", "9-9+9=?", "4+4+4=?")]
    args = (prompts, 4, 18, 1.0, 1.0, [3, 4, 5])  # 18 tokens: some samples stop, some are cut
    single = engine.generate(*args, stop=("</answer>",))
    calls = []
    generate = engine.generate
    engine.generate = lambda *a, **k: calls.append(a) or generate(*a, **k)
    looped, stats = generate_with_tools(
        engine, TOK, *args, stop=("</answer>",), cfg=ToolConfig(format=fmt, tool="calculator", answer_marker="")
    )
    assert len(calls) == 1 and all(s == ToolStats(turns=1) for s in stats)  # no call was made: the case under test
    assert [c.token_ids for c in looped] == [c.token_ids for c in single]
    assert [c.logprobs for c in looped] == [c.logprobs for c in single]  # exact, not approximate
    assert [c.finish_reason for c in looped] == [c.finish_reason for c in single]
    assert all(c.observation_mask is None for c in looped)
    print(sorted(len(c.token_ids) for c in looped))
