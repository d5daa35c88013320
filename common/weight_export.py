"""The one path from the trainer's model to a sampler's weights: ``(Hugging Face name, full tensor)`` pairs.

    for name, tensor in export_weights(model, dtype):   # what every engine loads; a collective under --fsdp
    metas = export_metadata(model, dtype)                # the same names, dtypes and shapes: gathers, merges nothing

``model`` is the trainer's model as a script holds it, in any combination of:

* wrapped by DDP / accelerate / DeepSpeed (``.module``) or torch.compile (``._orig_mod``): unwrapped;
* FSDP2-sharded (``--fsdp``, DTensor parameters): each tensor is gathered (``full_tensor()``, an all-gather), one at a
  time, so ``export_weights`` is a collective: every process iterates it to the end, in the same order;
* a LoRA policy (peft, ``--lora.rank``): the base model's names, each adapted linear weight merged as
  W + (α/r) B A, computed in fp32 and rounded once to the output dtype (rounding B A to a bf16 base's dtype first,
  and the sum again, can land an ulp from the exact merge); the adapters themselves are not exported.

The output dtype is ``dtype`` (the dtype the engine holds: vLLM's ``model_config.dtype``, a server's ``--dtype``) for
floating-point tensors, the stored dtype when ``dtype`` is None. Tied weights come once, under their first name (the
input embedding). A tensor that needs no gather, merge or cast is the parameter itself, detached (no copy): a caller
that keeps it past the next optimiser step must clone it.

``export_metadata`` declares what ``export_weights`` yields, element for element (vLLM's NCCL sender sizes the
receiver's buffers from it, then checks every tensor against it), from the stored parameters alone: a DTensor's
``shape`` is its global shape, so nothing is gathered, merged or copied, and no collective runs.

Every engine goes through here: the colocated vLLM engine's direct and reload pushes (``common/vllm_engine.py``),
the rollout servers' shared-memory file and NCCL source (``common/vllm_server.py``), and the HF engine's unsharded
copy under ``--fsdp`` (``common/sharding.py``); so does the merged ``final/`` model a LoRA run saves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from common.lora import adapted_layer, hf_model, is_lora, live_adapter, merged_weight

# module-name parts that wrappers insert (activation checkpointing, FSDP1, torch.compile): not in checkpoint names
WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


@dataclass(frozen=True)
class WeightMeta:
    """One exported tensor, declared without materialising it (the fields of vLLM's ``ParamMeta``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Entry:
    name: str  # the Hugging Face name the sampler loads it under
    param: torch.Tensor  # as stored: a DTensor shard under FSDP2, never gathered here
    adapter: tuple[torch.Tensor, torch.Tensor, float] | None  # (A, B, α/r) of a LoRA update to merge in, as stored


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / DeepSpeed / accelerate (``.module``) and torch.compile (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def exported_module(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model whose names and config the export uses: wrappers stripped, and for a LoRA policy the
    model inside peft (its linear layers carry the adapters)."""
    return hf_model(unwrap_model(model))


def _entries(model: torch.nn.Module) -> Iterator[_Entry]:
    """What the export yields, in order, before anything is gathered or merged."""
    policy = unwrap_model(model)
    lora = is_lora(policy)
    module = hf_model(policy)
    for name, param in module.named_parameters():  # tied weights once (remove_duplicate)
        adapter = None
        if lora and ".lora_" in name:
            continue  # the adapters: merged into their base weight, never sent on their own
        if lora and ".base_layer." in name:
            owner, leaf = name.split(".base_layer.")
            layer = adapted_layer(module, owner)  # raises for a layer kind the merge does not cover
            adapter = live_adapter(layer) if leaf == "weight" else None
            name = f"{owner}.{leaf}"
        for part in WRAPPER_PARTS:
            name = name.replace(part, "")
        yield _Entry(name, param, adapter)


def _out_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 shard (DTensor) is all-gathered (a collective), anything else returned as is."""
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def export_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the sampler's ``(Hugging Face name, full tensor)`` pairs from the trainer's ``model``, one at a time
    (see the module docstring: unwrapped, gathered, LoRA merged and rounded once, cast to ``dtype``). A collective
    under FSDP2: every process iterates it to the end in the same order."""
    for entry in _entries(model):
        tensor = _full(entry.param)
        out = _out_dtype(tensor, dtype)
        if entry.adapter is not None:
            a, b, scale = entry.adapter
            tensor = merged_weight(tensor, _full(a), _full(b), scale, out)
        elif tensor.dtype != out:
            tensor = tensor.to(out)  # lazily, one tensor at a time: no second full copy of the model
        yield entry.name, tensor


def export_metadata(model: torch.nn.Module, dtype: torch.dtype | None = None) -> list[WeightMeta]:
    """``(name, dtype, shape)`` of every pair ``export_weights(model, dtype)`` yields, in the same order, read from the
    stored parameters: no gather, no merge, no collective."""
    return [WeightMeta(e.name, _out_dtype(e.param, dtype), tuple(e.param.shape)) for e in _entries(model)]
