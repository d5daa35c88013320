"""What every rollout engine shares: the ``--rollout.*`` settings, the completion record, the engine interface, and
the rules both engines must apply alike (per-prompt seeds, stop ids, the fp32 LM head).

``common/rollout.py`` (the public entry point: ``HFEngine``, ``make_engine``) and ``common/vllm_engine.py`` both
import from here, and this module imports neither, so the imports among common modules run one way.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch


@dataclass
class RolloutConfig:
    """Rollout back-end settings (``--rollout.*`` flags)."""

    backend: Literal["auto", "hf", "vllm", "vllm-server"] = "auto"
    """'auto' = vLLM when CUDA and vllm are available, else the Hugging Face engine; 'vllm-server' = running servers"""
    server_urls: str = ""
    """vllm-server: comma-separated base URLs of running vLLM servers (scripts/serve_rollout.py prints one)"""
    server_timeout_s: float = 600.0
    """vllm-server: a request unanswered this long stops the run (after checkpointing the last completed step)"""
    hf_max_batch: int = 512
    """HF engine: most sequences decoded at once (lower it to save memory; a prompt's group always goes together)"""
    server_tensor_parallel: int = 1
    """vllm-server: tensor-parallel size of each server, for the memory plan (serve_rollout.py --tp)"""
    gpu_memory_utilization: float = 0.35
    """vLLM: fraction of GPU memory for weights + KV cache (the trainer shares the GPU); vllm-server: the servers'
    fraction, for the memory plan only (left at 0.35 it is planned at serve_rollout.py's default, 0.9)"""
    vllm_dtype: str = "auto"
    """vLLM: weight dtype ('auto' follows the checkpoint; 'float32' matches the CPU trainer exactly)"""
    fp32_lm_head: Literal["auto", "on", "off"] = "auto"
    """fp32 LM head in the trainer's log-probs and in vLLM (sampler/trainer gap fix); 'auto' = on for CPU only"""
    max_model_len: int = 0
    """vLLM: context length (0 = prompt budget + max_new_tokens, computed by the script)"""
    enable_sleep_mode: bool = False
    """vLLM: free the KV cache and offload weights between rollouts (level 1) to make room for training"""
    enforce_eager: bool = False
    """vLLM: disable CUDA graphs (slower generation, faster start-up, less memory)"""
    logit_noise: float = 0.0
    """HF engine: std of Gaussian noise added to the sampler's logits, a deliberately mismatched sampler (0 = off)"""


@dataclass
class Completion:
    """One sampled completion."""

    token_ids: list[int]  # generated ids, the stop token / stop string's last token included when it stopped
    logprobs: list[float]  # log-prob of each generated id under the sampling distribution
    finish_reason: str  # "stop" (stop token or stop string) or "length" (hit max_new_tokens)
    version: int = 0  # the policy version that sampled it (common/async_rollout.py): the step whose weights


class Engine(Protocol):
    """What every rollout engine provides."""

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | list[int],
        stop: Sequence[str] = (),
    ) -> list[Completion]: ...

    def update_weights(self, model: torch.nn.Module) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


def prompt_seeds(seed: int | list[int], num_prompts: int) -> list[int]:
    """One seed per prompt: the given list, or a list derived from a single call seed."""
    if isinstance(seed, int):
        rng = random.Random(seed)
        return [rng.getrandbits(62) for _ in range(num_prompts)]
    if len(seed) != num_prompts:
        raise ValueError(f"got {len(seed)} seeds for {num_prompts} prompts")
    return list(seed)


def use_fp32_head(cfg: RolloutConfig, device: torch.device | str) -> bool:
    """``cfg.fp32_lm_head`` resolved for a run on ``device``: the trainer's token_logprobs and vLLM must agree."""
    return cfg.fp32_lm_head == "on" or (cfg.fp32_lm_head == "auto" and torch.device(device).type == "cpu")


def stop_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """Ids that end a completion: the EOS ids (``eos_ids``) plus the chat template's end-of-turn token."""
    eos = eos_ids(model, tokenizer)
    return eos + [t for t in end_of_turn_ids(tokenizer) if t not in eos]


def end_of_turn_ids(tokenizer) -> list[int]:
    """The special token that closes an assistant turn in the tokenizer's chat template ([] when there is none).

    Found by rendering a two-turn conversation and reading the first token after the assistant's text: ``<|im_end|>``
    for Qwen's ChatML, ``<|eot_id|>`` for Llama 3, ``<end_of_turn>`` for Gemma. Qwen2.5 base checkpoints declare
    only ``<|endoftext|>`` as EOS (config.json, generation_config.json), so without this a chat-templated completion
    would run to the token budget (QwenLM/Qwen2.5 issue #927).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return []
    marker = "ANSWER_END_MARKER"
    conversation = [{"role": "user", "content": "question"}, {"role": "assistant", "content": marker}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that rejects this conversation has no turn end to find
        return []
    if marker not in text:
        return []
    suffix_ids = tokenizer(text.split(marker, 1)[1], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {
        i for i, tok in tokenizer.added_tokens_decoder.items() if getattr(tok, "special", False)
    }
    return suffix_ids[:1] if suffix_ids and suffix_ids[0] in special else []


def eos_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """All ids that end a completion: the generation config's EOS id(s) plus the tokenizer's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model and tokenizer define no EOS token; set generation_config.eos_token_id")
    return ids
