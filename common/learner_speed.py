"""The learner's speed options on a GPU (issue 41), applied by ``common/runtime.py`` as a run starts or loads a model:
a fused AdamW step, activation checkpointing (full or torchtitan's selective policies), a frozen LoRA base held in
bf16 under autocast, and per-layer ``torch.compile``. Each leaves the numbers of the CPU tiny default unchanged."""

from __future__ import annotations

import torch


def fuse_adamw(optimizer: torch.optim.Optimizer, device_types: tuple[str, ...] = ("cuda",)) -> bool:
    """Switch a fresh ``torch.optim.AdamW`` (no step taken, no implementation chosen) to the fused kernel when
    every parameter is a floating-point CUDA tensor; returns whether it did. Why: torch's CUDA default is foreach,
    whose step allocates temporaries as large as the gradients (the 20 bytes per parameter measured at the step's
    peak on an H100, issue 41); fused updates each tensor in place in one kernel, the same arithmetic (tests: the
    same step to fp32 rounding). The scripts build their AdamW with the defaults and pass it through
    ``Run.prepare``, which calls this; CPU runs (and ``--fsdp-offload``'s host-side step) keep torch's default.
    ``device_types``: where to fuse (tests fuse on the CPU, whose fused kernel is the same algorithm)."""
    if type(optimizer) is not torch.optim.AdamW or optimizer.state:
        return False
    groups = optimizer.param_groups
    params = [p for group in groups for p in group["params"]]
    chosen = any(
        group["foreach"] is not None or group["fused"] is not None or group["differentiable"] for group in groups
    )
    if chosen or not params or any(p.device.type not in device_types or not p.is_floating_point() for p in params):
        return False
    for group in groups:
        group["fused"], group["foreach"] = True, False
    optimizer.defaults["fused"], optimizer.defaults["foreach"] = True, False
    optimizer._step_supports_amp_scaling = True  # as AdamW(fused=True) sets it
    return True


CHECKPOINTING_POLICIES = ("full", "op", "every-2")


def enable_checkpointing(model: torch.nn.Module, policy: str = "full") -> None:
    """Activation checkpointing of ``model``'s decoder layers (non-reentrant), torchtitan's options
    (``torchtitan/distributed/activation_checkpoint.py``):

    * ``full``: every layer keeps only its input and recomputes the rest in the backward pass;
    * ``op``: selective per-op checkpointing: each layer keeps the outputs of its matmuls and attention kernels, except
      every second matmul's, and recomputes the cheap elementwise work (norms, RoPE, SwiGLU) and the other matmuls
      (torchtitan's ``_op_sac_save_list`` policy: ``aten.mm`` with every second one recomputed, the sdpa kernels);
    * ``every-2``: every second layer checkpointed in full, the others keep everything (torchtitan's layer-selective
      option with a frequency of 2; transformers' ``every_n_layers``).
    """
    if policy not in CHECKPOINTING_POLICIES:
        raise SystemExit(f"--checkpointing-policy {policy}: one of {', '.join(CHECKPOINTING_POLICIES)}")
    kwargs: dict = {"use_reentrant": False}
    if policy == "op":
        kwargs["context_fn"] = op_selective_contexts
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs=kwargs, every_n_layers=2 if policy == "every-2" else 1
    )


def _op_save_list() -> set:
    ops = torch.ops.aten
    names = (
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward",
    )
    return {ops.mm.default} | {getattr(ops, name).default for name in names if hasattr(ops, name)}


def op_selective_contexts():
    """``context_fn`` of one checkpointed layer under the ``op`` policy: a fresh matmul count per layer call, so that
    the forward and its recomputation choose the same ops."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = _op_save_list()
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[mode] += 1
        keep = func in save and not (func == torch.ops.aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def hold_frozen_linears_in_bf16(model: torch.nn.Module) -> int:
    """Cast every frozen linear layer inside the decoder (a LoRA policy's base matmuls: peft's ``base_layer``) to
    bf16 in place; the embeddings, norms, LM head and the adapters keep their dtype. Returns the parameters cast.
    Under bf16 autocast this changes no number: autocast computes those matmuls from the bf16-rounded weights anyway
    (round to nearest, as ``.to(bfloat16)``), now cast once instead of on every forward, and held at 2 bytes a
    parameter instead of 4 (~13 GB less at 7B) with no cast saved for the backward."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    cast = 0
    for module in inner.get_decoder().modules():
        if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad:
            module.to(torch.bfloat16)
            cast += sum(p.numel() for p in module.parameters(recurse=False))
    return cast


def compile_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """``torch.compile`` each decoder layer on its own, in place (``nn.Module.compile``), the way torchtitan compiles
    its transformer blocks: one graph per layer (reused by every layer of the same shape), the norms, RoPE, SwiGLU
    and a LoRA layer's side matmuls fused around the GEMMs, the rest of the model (embeddings, head, log-softmax)
    eager. Returns the number of layers compiled. The first forward compiles (tens of seconds). ``backend``: dynamo's
    (benchmarks' CPU smoke runs use 'eager': the same graph capture without inductor's compile time)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = inner.get_decoder().layers
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)
