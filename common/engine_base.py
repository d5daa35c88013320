"""What every rollout engine shares: the ``--rollout.*`` settings, the completion record, the engine interface, and
the rules both engines must apply alike (per-prompt seeds, stop ids, the fp32 LM head).

``common/rollout.py`` (the public entry point: ``HFEngine``, ``make_engine``) and ``common/vllm_engine.py`` both
import from here, and this module imports neither, so the imports among common modules run one way.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import torch

T = TypeVar("T")


@dataclass
class RolloutConfig:
    """Rollout back-end settings (``--rollout.*`` flags)."""

    backend: Literal["auto", "hf", "vllm", "vllm-server"] = "auto"
    """'auto' = vLLM when CUDA and vllm are available, else the Hugging Face engine; 'vllm-server' = running servers"""
    server_urls: str = ""
    """vllm-server: comma-separated base URLs of running vLLM servers (scripts/serve_rollout.py prints one)"""
    server_timeout_s: float = 600.0
    """vllm-server: a server that sends nothing this long stops the run (after checkpointing the last completed step)"""
    server_retries: int = 3
    """vllm-server: retries of a generation request that fails transiently (reset, cut stream, 5xx), same seeds"""
    trainer_address: str = ""
    """vllm-server over NCCL: this trainer's address the servers can reach ('' = $MASTER_ADDR, else 127.0.0.1)"""
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
    in_flight: bool = False
    """vllm-server only: a weight push pauses generation and resumes the same requests, not waiting for them"""


@dataclass
class ToolStats:
    """What common/tool_loop.py's loop did for one sample (``tool_metrics`` averages them)."""

    calls: int = 0  # tool calls run
    errors: int = 0  # calls whose observation has status "error" (a bad call, an exception, a refused expression)
    timeouts: int = 0  # calls that ran past --tools.timeout-s
    sandbox_errors: int = 0  # calls the sandbox itself failed (not the model's doing)
    obs_tokens: int = 0  # observation tokens appended
    turns: int = 1  # sampled turns (engine requests)
    void_turns: int = 0  # turns that stopped on a tool stop string with no call
    call_limited: bool = False  # ended on a call beyond --tools.max-calls, not run


@dataclass
class Completion:
    """One sampled completion."""

    token_ids: list[int]  # generated ids, the stop token / stop string's last token included when it stopped
    logprobs: list[float]  # log-prob of each generated id under the sampling distribution
    finish_reason: str  # "stop" (stop token or stop string) or "length" (hit max_new_tokens)
    version: int = 0  # the policy version that sampled it (common/async_rollout.py): the step whose weights
    # common/tool_loop.py: 1 where the tool loop appended the token (an observation; its logprobs entry is 0.0, no
    # sampler log-prob), 0 where it was sampled; None: every token was sampled (single turn, or no observation)
    observation_mask: list[int] | None = None
    tool_stats: ToolStats | None = None  # common/tool_loop.py: what the loop did for this sample (None: no loop)
    # common/tool_loop.py, --tools.void-filter (SimpleTIR): True when the sample holds a void turn; its reward still
    # counts in its group, but pack_rollout leaves all its tokens out of the loss mask
    excluded: bool = False
    # --rollout.in-flight: the policy version that sampled each token (weights may change mid-generation); None: the
    # whole completion is ``version``'s. Observation tokens carry the version of the sampled token before them.
    token_versions: list[int] | None = None


class Engine(Protocol):
    """What every rollout engine provides: all that ``LaggedRollouts`` (``common/async_rollout.py``), the
    ``Bookkeeper`` and the scripts use. ``InProcessEngine`` below gives the members an engine that generates in the
    trainer's process (HF, colocated vLLM) has no use for; the server engine implements them all."""

    overlaps: bool
    """True: generation runs off the trainer's process (rollout servers), so ``sample_local`` may run on a background
    thread while the trainer trains; False: it runs in place, on the trainer's device and weights, when asked."""
    on_fault: Callable[[bool], None] | None
    """Set by the ``Bookkeeper``: checkpoints the last completed step before a failure stops the run (its argument:
    whether this step's update is done). Engines whose failures are plain exceptions never call it."""

    @property
    def version(self) -> int | str | None:
        """The weights the engine serves now, passed back to ``sample_local`` so that a request sampled from an
        outgoing version is refused (servers); None where generation always uses the trainer's current weights."""
        ...

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | list[int],
        stop: Sequence[str] = (),
    ) -> list[Completion]:
        """``n`` completions per prompt, grouped by prompt (``temperature == 0``: greedy); one seed per prompt (or a
        call seed they derive from). A collective where the engine has one: every rank calls it."""
        ...

    def sample_local(
        self,
        prompt_ids: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | list[int],
        stop: Sequence[str] = (),
        version: int | str | None = None,
    ) -> list[Completion]:
        """``generate`` on this process alone, with no collective, raising on a failure (``all_ranks`` then agrees
        on it): what a background thread may call."""
        ...

    def all_ranks(self, fn: Callable[[], T], what: str, after_update: bool) -> T:
        """``fn()``, with its failure on any rank agreed by every rank (``on_fault``, then the run stops)."""
        ...

    def update_weights(self, model: torch.nn.Module) -> None:
        """Serve ``model``'s current weights from now on (a collective where the engine has one)."""
        ...

    def sleep(self) -> None:
        """Free what the engine holds on the trainer's device between rollouts (no-op where nothing is held)."""
        ...

    def wake(self) -> None:
        """Bring back what ``sleep`` freed."""
        ...


class InProcessEngine:
    """The ``Engine`` members of an engine that generates in the trainer's process, from the weights it was last
    given: no background sampling, no weight versions to check, and failures that are ordinary exceptions."""

    overlaps = False
    on_fault: Callable[[bool], None] | None = None
    version = None

    def sample_local(self, prompt_ids, n, max_new_tokens, temperature, top_p, seed, stop=(), version=None):
        """``generate``: in process, with no collective of its own (``version`` is never stale here)."""
        return self.generate(prompt_ids, n, max_new_tokens, temperature, top_p, seed, stop)

    def all_ranks(self, fn: Callable[[], T], what: str, after_update: bool) -> T:
        """``fn()``: a failure raises on the rank where it happens."""
        return fn()


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
