"""FSDP2 sharding (``--fsdp``) and the full, process-count-independent state dicts every checkpoint uses.

    model = shard_model(model, offload)           # torch's fully_shard per decoder layer, then the root
    model, optimizer = run.prepare(model, opt)    # the sharded module itself under --fsdp, accelerator.prepare else
    saved = gather_state(state)                   # collective: full state dicts (main process), any number of ranks
    restore_state(state, saved)                   # every process: its shards (or replica) from the full state
    save_pretrained_full(model, path, is_main)    # collective: a Hugging Face folder from the gathered weights

One code path: our own ``fully_shard`` calls, never accelerate's FSDP plugin (which turns on only for GPU process
types, so it cannot be tested on a CPU; a model it wrapped again would be sharded twice). Weights and AdamW state
stay fp32 and sharded; the forward/backward runs under the scripts' bf16 autocast; gradients are reduce-scattered
in fp32 after every micro-batch (``accelerator.no_sync`` is a null context for a non-DDP module: accumulating
unsharded gradients would cost a full fp32 gradient per rank, what sharding is there to avoid). The root module
keeps its parameters (embeddings, final norm, LM head) gathered from its forward until its backward:
``common/logprobs.py`` applies the LM head outside the model's forward. Nothing algorithmic lives here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from common.lora import AdapterDisabled, hf_model, is_lora, save_adapter
from common.weight_export import export_weights

# gathered to full tensors, on the CPU, held by rank 0 alone (the other ranks get empty dicts); frozen parameters
# (a LoRA policy's base) are left out: they never change, and a resume reloads them from --model
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
# every rank passes the full state dict and keeps its own shard of each tensor (frozen parameters: as loaded)
SCATTER = StateDictOptions(full_state_dict=True, strict=False)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds FSDP-sharded parameters (DTensors)."""
    return isinstance(model, FSDPModule) or any(hasattr(p, "full_tensor") for p in model.parameters())


def shard_model(model: torch.nn.Module, offload: bool = False) -> torch.nn.Module:
    """Shard ``model`` in place with FSDP2 over all processes: each decoder layer (the classes the model lists in
    ``_no_split_modules``) is one unit, gathered for its forward and backward; the root holds the rest.

    ``offload``: sharded parameters, gradients and the AdamW moments live in host memory (``CPUOffloadPolicy``);
    the optimiser steps on the CPU.
    """
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise SystemExit(f"--fsdp: {type(model).__name__} names no decoder layer class (_no_split_modules) to shard")
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, offload_policy=policy)
    # the root stays gathered after its forward: token_logprobs applies the LM head outside the forward
    fully_shard(model, offload_policy=policy, reshard_after_forward=False)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters of every FSDP unit of ``model`` (no-op when unsharded or already sharded). The
    reference model of a LoRA policy (``AdapterDisabled``) reshards the policy: it has no modules of its own, and
    its forward, the policy's, leaves the policy's root gathered like any forward does."""
    if isinstance(model, AdapterDisabled):
        model = model.policy
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _inner_optimizer(obj):
    """The torch optimiser inside accelerate's wrapper, or None when ``obj`` is not an optimiser (a learning-rate
    scheduler also has an ``optimizer`` attribute: it is saved with its own ``state_dict``)."""
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        return None
    obj = getattr(obj, "optimizer", obj)
    return obj if isinstance(obj, torch.optim.Optimizer) else None


def _owner(state: dict, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
    """The module of ``state`` whose parameters ``optimizer`` steps (each optimiser belongs to exactly one)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = [m for m in state.values() if isinstance(m, torch.nn.Module) and id(next(m.parameters())) in params]
    if len(owners) != 1:
        raise ValueError(
            f"an optimiser must step the parameters of exactly one model of the state; found {len(owners)}"
        )
    return owners[0]


def gather_state(state: dict) -> dict:
    """Full state dicts of ``state``'s models and optimisers (keyed by parameter name) and the other objects'
    ``state_dict()``. A collective: every process calls it; the models' and optimisers' entries are complete on the
    main process only. The same format whether the run is sharded, replicated or in one process."""
    out = {}
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            reshard(obj)
            frozen = {n for n, p in obj.named_parameters(remove_duplicate=False) if not p.requires_grad}
            full = get_model_state_dict(obj, options=GATHER)
            out[name] = {k: v for k, v in full.items() if k not in frozen}  # a tied alias of a frozen tensor too
        elif (optimizer := _inner_optimizer(obj)) is not None:
            out[name] = get_optimizer_state_dict(_owner(state, optimizer), optimizer, options=GATHER)
        else:
            out[name] = obj.state_dict()
    return out


def restore_state(state: dict, saved: dict) -> None:
    """Load ``gather_state``'s output into ``state`` on every process (each keeps its shards); models first."""
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            reshard(obj)
            keys = set_model_state_dict(obj, saved[name], options=SCATTER)
            trainable = {n for n, p in obj.named_parameters() if p.requires_grad}
            missing = [k for k in keys.missing_keys if any(k == t or k.endswith("." + t) for t in trainable)]
            if keys.unexpected_keys or missing:  # not strict about frozen parameters only
                raise RuntimeError(
                    f"checkpoint does not match the model {name!r}: missing {missing[:5]}, unexpected "
                    f"{keys.unexpected_keys[:5]} (a LoRA checkpoint needs the same --lora flags)"
                )
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            continue
        if (optimizer := _inner_optimizer(obj)) is not None:
            set_optimizer_state_dict(_owner(state, optimizer), optimizer, saved[name], options=SCATTER)
        else:
            obj.load_state_dict(saved[name])


def save_pretrained_full(model: torch.nn.Module, path, is_main: bool) -> None:
    """Write ``model`` as a Hugging Face folder from its gathered weights. A collective: every process calls it,
    the main process writes. A LoRA policy: the merged model at ``path`` and the adapter (PEFT's format) at
    ``<path>_adapter``."""
    reshard(model)
    if is_lora(model):  # the merged model, loadable as any Hugging Face model, and the adapter beside it
        merged = {name: tensor.cpu() for name, tensor in export_weights(model)}
        adapter = get_model_state_dict(model, options=GATHER)
        if is_main:
            hf_model(model).save_pretrained(path, state_dict=merged)
            save_adapter(model, adapter, Path(path).parent / f"{Path(path).name}_adapter")
        return
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        model.save_pretrained(path, state_dict=full)


def unsharded_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain (unsharded) copy of a sharded causal LM on the same device, in eval mode without gradients: what the
    HF engine samples from, since ranks decode different numbers of steps and would deadlock in FSDP's all-gathers.
    A collective (every process calls it)."""
    source = model  # what copy_weights exports: gathered, a LoRA policy merged
    model = hf_model(model)  # a LoRA policy: the model inside peft, whose class and config the copy takes
    base = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        copy = base(model.config)
    # the compute device: buffers stay there (with --fsdp-offload the sharded parameters live on the CPU)
    device = next(iter(model.buffers()), next(model.parameters())).device
    copy.to_empty(device=device)
    copy.tie_weights()  # to_empty replaces meta parameters one by one, which unties tied embeddings
    for name, buffer in model.named_buffers():
        copy.get_buffer(name).data = buffer.detach().clone()
    copy.generation_config = model.generation_config
    copy_weights(source, copy, allocate=True)
    return copy.eval().requires_grad_(False)


@torch.no_grad()
def copy_weights(source: torch.nn.Module, target: torch.nn.Module, allocate: bool = False) -> None:
    """Copy the trainer's (sharded, possibly LoRA) ``source`` into the plain ``target``, one exported tensor at a
    time (``common.weight_export.export_weights``: gathered, merged, in the stored dtype). A collective (every
    process calls it, in the same order)."""
    reshard(source)
    params = dict(target.named_parameters())
    for name, full in export_weights(source):
        if allocate:
            params[name].data = full.to(params[name].device).clone()
        else:
            params[name].copy_(full)
