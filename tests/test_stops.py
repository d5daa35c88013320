"""Where a completion stops: the chat template's end-of-turn token whatever the checkpoint declares as EOS, and
stop strings (r1-zero's ``</answer>``) matched on the decoded text, kept in the completion, finish_reason "stop".

The tokenizer variants carry Qwen2.5's special tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) under
both EOS declarations Qwen2.5 checkpoints ship: ``<|im_end|>`` (the shipped tiny model, like the Instruct models)
and ``<|endoftext|>`` in the tokenizer and generation config (the base and Math base models). Built locally from
the tiny model's files; no download.
"""

import copy
import dataclasses

import pytest
import torch
from conftest import load_algo
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.data import STOP_STRINGS, TINY_MODEL_DIR, format_prompt, load_problems
from common.rollout import HFEngine, eos_ids, stop_token_ids
from common.runtime import load_task


@pytest.fixture(scope="module")
def variants():
    """(model, tokenizer) with EOS = <|im_end|> (as shipped) and with EOS = <|endoftext|> (Qwen2.5 base files)."""
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    chat_eos = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    base_eos = AutoTokenizer.from_pretrained(TINY_MODEL_DIR, eos_token="<|endoftext|>")
    base_model = copy.deepcopy(model)
    base_model.generation_config.eos_token_id = base_eos.convert_tokens_to_ids("<|endoftext|>")
    return {"im_end": (model, chat_eos), "endoftext": (base_model, base_eos)}


def chat_prompts(tokenizer, count=8):
    problems = load_problems("arith", "test")[:count]
    return [tokenizer(format_prompt(p["prompt"], "chat", tokenizer))["input_ids"] for p in problems]


def test_end_of_turn_is_a_stop_token_under_either_eos_declaration(variants):
    for model, tokenizer in variants.values():
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert im_end in stop_token_ids(model, tokenizer)
    model, tokenizer = variants["endoftext"]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") not in eos_ids(model, tokenizer)  # what the fix adds
    no_template = copy.copy(tokenizer)
    no_template.chat_template = None
    assert stop_token_ids(model, no_template) == eos_ids(model, tokenizer)  # nothing invented without a template


def test_chat_turn_ends_at_im_end_when_eos_is_endoftext(variants):
    """The model ends its turn with <|im_end|>; under the base EOS declaration it must still stop there."""
    completions = {}
    for name, (model, tokenizer) in variants.items():
        engine = HFEngine(model, tokenizer)
        completions[name] = engine.generate(chat_prompts(tokenizer), 4, 40, 1.0, 1.0, seed=[1, 2, 3, 4, 5, 6, 7, 8])
    im_end = variants["im_end"][1].convert_tokens_to_ids("<|im_end|>")
    stopped = [c for c in completions["endoftext"] if c.finish_reason == "stop"]
    assert len(stopped) > 0.9 * len(completions["endoftext"])  # the tiny model answers in ~18 tokens
    assert all(c.token_ids[-1] == im_end and im_end not in c.token_ids[:-1] for c in stopped)
    # the same samples as under the chat EOS declaration: the checkpoint's files no longer decide where turns end
    assert [c.token_ids for c in completions["endoftext"]] == [c.token_ids for c in completions["im_end"]]


def test_stop_string_scan_finds_the_token_that_completes_it(variants):
    """Feed a token stream one token at a time: the first hit is the token whose prefix text first holds the string,
    also when the string is spread over several tokens (the tiny tokenizer splits "</answer>" into 5)."""
    model, tokenizer = variants["im_end"]
    engine = HFEngine(model, tokenizer)
    text = "<think> 3+4 is 7, and </think> <answer> 7 </answer> more </answer>"
    ids = tokenizer(text)["input_ids"]
    assert len(tokenizer("</answer>")["input_ids"]) > 1
    expected = next(t for t in range(len(ids)) if "</answer>" in tokenizer.decode(ids[: t + 1]))
    tokens = torch.full((1, len(ids)), -1)
    hits = []
    for step, token in enumerate(ids):
        tokens[0, step] = token
        hit = engine._stop_string_hit(
            tokens, torch.tensor([0]), torch.tensor([token]), torch.tensor([False]), step, ("</answer>",)
        )
        hits.append(bool(hit[0]))
    assert hits.index(True) == expected
    assert tokenizer.decode(ids[: expected + 1]).endswith("</answer>")


def test_generation_stops_at_a_stop_string_and_keeps_it(variants):
    """Greedy and sampled: a completion with finish_reason "stop" ends with the first token whose text completes the
    stop string; the unstopped completion's prefix up to that token is exactly what is returned."""
    model, tokenizer = variants["im_end"]
    engine = HFEngine(model, tokenizer)
    prompts = chat_prompts(tokenizer)
    free = engine.generate(prompts, 1, 40, 0.0, 1.0, seed=0)
    # a stop string from the model's own greedy output, spanning a token boundary: its 2nd-4th characters
    text = tokenizer.decode(free[0].token_ids, skip_special_tokens=True)
    stop = text[1:4]
    assert len(stop) == 3
    stopped = engine.generate(prompts, 1, 40, 0.0, 1.0, seed=0, stop=(stop,))
    for full, cut in zip(free, stopped):
        decoded = [tokenizer.decode(full.token_ids[: t + 1]) for t in range(len(full.token_ids))]
        first = next((t for t, d in enumerate(decoded) if stop in d), None)
        if first is None:
            assert cut.token_ids == full.token_ids and cut.finish_reason == full.finish_reason
        else:
            assert cut.token_ids == full.token_ids[: first + 1] and cut.finish_reason == "stop"
            assert cut.logprobs == pytest.approx(full.logprobs[: first + 1])
    assert stopped[0].finish_reason == "stop" and len(stopped[0].token_ids) < len(free[0].token_ids)
    sampled = engine.generate(prompts, 4, 40, 1.0, 1.0, seed=[11] * 8, stop=(stop,))
    assert any(stop in tokenizer.decode(c.token_ids) for c in sampled)
    for c in sampled:
        if stop in tokenizer.decode(c.token_ids):  # it ended at the first occurrence, with the string kept
            assert c.finish_reason == "stop" and stop not in tokenizer.decode(c.token_ids[:-1])
        else:
            assert c.finish_reason == "length" or c.token_ids[-1] in engine.stop_ids


def test_r1_zero_template_stops_at_the_answer_tag():
    args = load_algo("grpo").Args(template="r1-zero")
    assert load_task(args).stop == ("</answer>",) == STOP_STRINGS["r1-zero"]
    args = load_algo("grpo").Args(eval=dataclasses.replace(args.eval, template="r1-zero"))
    task = load_task(args)
    assert task.stop == () and task.eval_stop == ("</answer>",)
