"""The HF engine samples at the trainer's precision: its forwards run under the trainer's autocast with the trainer's
LM-head precision, so that its log-probs are π_old's token for token (μ = π_old, nothing left for rollout correction
to fix), and flash-attention, which packing picks for a bf16 trainer, is handed bf16 inputs when the engine decodes on
the same module.

flash-attn is not installed here: the dispatch is tested with transformers' ``flash_attention_2`` name bound, for the
test only, to a stand-in that records the dtype flash-attention would be given (``get_target_dtype``, the dtype
transformers casts fp32 queries to) and computes sdpa attention with sdpa's mask.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.flash_attention import get_target_dtype
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from common.bookkeeping import pack_rollout
from common.data import TINY_MODEL_DIR, format_prompt
from common.logprobs import token_logprobs
from common.packing import attention_implementation
from common.rollout import RolloutConfig, make_engine

# the trainer's bf16 autocast, as common/runtime.py's start_run builds it (run.autocast)
BF16 = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
GROUP = 3


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tok.padding_side = "left"
    return tok


def prompts(tok, questions=("1+2-3=?", "9-9+9=?", "12+7=?")) -> list[list[int]]:
    return [tok(format_prompt(q, "chat", tok))["input_ids"] for q in questions]


@pytest.mark.parametrize(
    ("fp32_lm_head", "softcapping"),
    [("on", None), ("off", None), ("on", 30.0)],
    ids=["fp32-head", "bf16-head", "own-logits"],
)
def test_engine_logprobs_are_the_trainers_under_bf16_autocast(tokenizer, fp32_lm_head, softcapping):
    """Sampled under the trainer's bf16 autocast, each token's engine log-prob equals the trainer's for the same
    tokens, padded or packed: fp32 LM head, bf16 head, and a config that post-processes logits (the trainer then uses
    the model's own logits, and so must the engine). The engine that sampled in fp32 while the trainer ran under bf16
    autocast was off on 43-56% of these tokens, by up to 0.06 nats."""
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, attn_implementation="eager")
    model.config.final_logit_softcapping = softcapping  # Qwen2 ignores the field; token_logprobs does not
    cfg = RolloutConfig(backend="hf", fp32_lm_head=fp32_lm_head)
    engine = make_engine(cfg, model, tokenizer, str(TINY_MODEL_DIR), 0, 64, autocast=BF16)
    ids = prompts(tokenizer)
    completions = engine.generate(ids, n=GROUP, max_new_tokens=24, temperature=0.7, top_p=1.0, seed=[5, 6, 7])
    input_ids, attention_mask, completion_mask, sampler = pack_rollout(
        ids, completions, GROUP, tokenizer.pad_token_id, "cpu"
    )
    mask = completion_mask.bool()
    for packed in (False, True):
        with torch.no_grad(), BF16():
            trainer, _ = token_logprobs(
                model,
                input_ids,
                attention_mask,
                completion_mask.shape[1],
                0.7,
                fp32_head=fp32_lm_head == "on",
                packed=packed,
            )
        # fp32 rounding only: the trainer's fp32 head multiplies all of a micro-batch's completion positions at once,
        # the engine's one position per row (measured: at most 1.5e-6, on 6 of 166 tokens; the bf16 head's: 0)
        torch.testing.assert_close(sampler[mask], trainer[mask], rtol=1e-6, atol=1e-6)


def flash_standin(seen: list[torch.dtype]):
    """An attention function for the ``flash_attention_2`` name: records the dtype flash-attention would compute in,
    then runs sdpa (the model runs, and its mask is sdpa's: see the monkeypatched mask below)."""

    def forward(module, query, *args, **kwargs):
        seen.append(get_target_dtype(query, module) or query.dtype)
        return sdpa_attention_forward(module, query, *args, **kwargs)

    return forward


@pytest.mark.parametrize("autocast", ["the trainer's", "none given"])
def test_engine_hands_flash_attention_half_precision_on_a_packed_bf16_policy(tokenizer, monkeypatch, autocast):
    """bf16 packing with flash-attn installed puts the whole policy on flash-attention (common/packing.py); the HF
    engine decodes on that same module, and each of its attention calls must get bf16 inputs (flash-attn rejects
    fp32): under the trainer's autocast, or, when none is given, under the bf16 autocast an fp32 module on
    flash-attention implies. The engine that decoded in fp32 outside autocast handed it fp32 on every call."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else find_spec(name)
    )
    attention = attention_implementation("cuda", packed=True, half_precision=True)  # what start_run chooses
    assert attention == "flash_attention_2"
    assert attention_implementation("cuda", packed=True, half_precision=False) == "sdpa"  # fp32: never flash
    assert attention_implementation("cuda", packed=False, half_precision=True) == "sdpa"

    seen: list[torch.dtype] = []
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, attention, flash_standin(seen))
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, attention, sdpa_mask)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, attn_implementation="sdpa")
    model.config._attn_implementation = attention  # as load_model's attn_implementation= would set it
    kwargs = {"autocast": BF16} if autocast == "the trainer's" else {}
    engine = make_engine(RolloutConfig(backend="hf"), model, tokenizer, str(TINY_MODEL_DIR), 0, 64, **kwargs)
    engine.generate(prompts(tokenizer), n=2, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=0)
    layers = model.config.num_hidden_layers
    assert len(seen) >= 2 * layers  # the prefill and at least one decode step, every layer
    assert set(seen) == {torch.bfloat16}


def test_outside_autocast_an_fp32_engine_keeps_the_models_own_logits(tokenizer):
    """Without autocast (``--mixed-precision no``) an fp32 engine's forwards are the module's own: no autocast around
    them, and the same samples with the fp32 head on as off (an fp32 module's own head is already fp32)."""
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    states = []
    hook = model.register_forward_pre_hook(lambda module, args: states.append(torch.is_autocast_enabled("cpu")))
    out = {}
    try:
        for head in ("on", "off"):
            engine = make_engine(RolloutConfig(backend="hf", fp32_lm_head=head), model, tokenizer, "", 0, 64)
            out[head] = engine.generate(prompts(tokenizer), n=2, max_new_tokens=12, temperature=1.0, top_p=1.0, seed=3)
    finally:
        hook.remove()
    assert states and not any(states)
    assert [c.token_ids for c in out["on"]] == [c.token_ids for c in out["off"]]
    assert [c.logprobs for c in out["on"]] == [c.logprobs for c in out["off"]]
