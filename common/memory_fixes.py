"""What ``--dry-run`` offers when a plan does not fit (``common/memory.py``): flag sets under which the trainer's
GPUs fit (packing, micro-batch size, checkpointing, vLLM's sleep mode or a smaller share, ``--fsdp``), or sharding,
and a larger tensor-parallel size for rollout servers that do not.

Contract: ``suggest_fixes`` re-plans each candidate with ``replan`` (``common.memory.plan_memory``, passed in so this
module does not import the planner that calls it) and never changes ``args``: candidates are copies (``_with``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from common.memory_plan import GB, MemoryPlan, plan_server
from common.memory_shapes import model_shape


def longest_sequence(args, max_model_len: int) -> int:
    """The longest training sequence: prompt budget + ``--max-new-tokens`` (``max_model_len`` holds the larger of
    the training and evaluation token budgets; ``common.runtime.context_budget``)."""
    budget = max(args.max_new_tokens, args.eval.max_new_tokens)
    return max_model_len - budget + args.max_new_tokens


def suggest_fixes(
    args, model_path, max_model_len, world, card_gb, backend, plan: MemoryPlan, replan: Callable[..., MemoryPlan]
) -> list[str]:
    """Flag sets that make a failing plan fit (fewest changes first, packing first, then the largest micro-batch,
    ``--fsdp`` last when several processes run unsharded), or sharding. Packing's token budgets
    (``--micro-batch-tokens``) are the smallest power of two that holds the longest sequence (prompt budget +
    ``--max-new-tokens``) and its doublings; a packed run is offered smaller budgets, down to the longest sequence.
    A rollout server that does not fit is offered the smallest larger tensor-parallel size that does (up to 8, one
    node), appended to each of the trainer's flag sets."""
    if plan.needs_sharding or plan.server is None or plan.server.fits:
        return trainer_fixes(args, model_path, max_model_len, world, card_gb, backend, plan, replan)
    shape = model_shape(model_path)
    larger = [t for t in (2, 4, 8) if t > plan.server.tensor_parallel]
    fit = [t for t in larger if plan_server(_with(args, server_tensor_parallel=t), shape, max_model_len, card_gb).fits]
    if not fit:
        return [
            f"a rollout server cannot hold the weights and one {max_model_len}-token sequence's KV cache at tensor "
            f"parallel up to 8 in a {plan.server.utilization:g} x {card_gb:g} GB share: a larger GPU"
        ]
    server_fix = _flag("server_tensor_parallel", fit[0])
    if plan.trainer_fits:
        return [server_fix]
    fixes = trainer_fixes(args, model_path, max_model_len, world, card_gb, backend, plan, replan)
    return [f"{fix} {server_fix}" if fix.startswith("--") else fix for fix in fixes]


def trainer_fixes(
    args, model_path, max_model_len, world, card_gb, backend, plan: MemoryPlan, replan: Callable[..., MemoryPlan]
) -> list[str]:
    """``suggest_fixes`` for the trainer's GPUs (a colocated engine included): flag sets under which they fit."""
    if plan.needs_sharding:
        return [
            f"trainer state alone ({plan.trainer_state / GB:.1f} GB per GPU) exceeds the card: FSDP2 sharding "
            "(--fsdp over several processes), a larger GPU, or a smaller model"
        ]
    halvings = lambda n, low: [n >> k for k in range(n.bit_length()) if n >> k >= low]  # noqa: E731
    if backend == "vllm":
        engine = [{}] if args.rollout.enable_sleep_mode else [{}, {"enable_sleep_mode": True}]
    else:
        engine = [{}] + [{"hf_max_batch": n} for n in halvings(args.rollout.hf_max_batch, args.group_size)[1:]]
    ckpt = [{}] if args.gradient_checkpointing else [{}, {"gradient_checkpointing": True}]
    # token budgets that hold the longest sequence: powers of two from the smallest that does, up to the first that
    # holds every token one process trains on per step (at most 64 x the longest); a packed run's rows no longer
    # count, so it is offered smaller budgets, never --micro-batch-size
    longest = longest_sequence(args, max_model_len)
    if args.micro_batch_tokens > 0:
        micro = [{}] + [{"micro_batch_tokens": n} for n in halvings(args.micro_batch_tokens, longest)[1:]]
    else:
        micro = [{}] + [{"micro_batch_size": n} for n in halvings(args.micro_batch_size, 1)[1:]]
        rank_tokens = args.prompts_per_step // world * args.group_size * max_model_len
        budget = 1 << (longest - 1).bit_length()
        while budget < 2 * rank_tokens and budget <= 64 * longest:
            micro.append({"micro_batch_tokens": budget})
            budget *= 2
    # several processes without --fsdp: sharding over them is a fix too (tried after the single-process knobs)
    shard = [{}, {"fsdp": True}] if world > 1 and not plan.fsdp else [{}]
    candidates = [s | e | c | m for s in shard for e in engine for c in ckpt for m in micro if s | e | c | m]
    # fewest changes first; among them packing (the recommended GPU setting), the largest micro-batch first
    candidates.sort(
        key=lambda ch: (
            len(ch),
            "micro_batch_tokens" not in ch,
            -ch.get("micro_batch_tokens", args.micro_batch_tokens),
            -ch.get("micro_batch_size", args.micro_batch_size),
        )
    )
    found: list[dict] = []
    for changes in candidates:
        if any(f.items() <= changes.items() or set(f) == set(changes) for f in found):
            continue  # a simpler (or same-flag) set already fits
        trial = replan(_with(args, **changes), model_path, max_model_len, world, card_gb, backend, False)
        if trial.trainer_fits:
            found.append(changes)
        if len(found) == 3:
            break
    fixes = [" ".join(_flag(k, v) for k, v in f.items()) for f in found]
    if backend == "vllm" and plan.engine_weights + GB > plan.engine_share:  # the engine cannot hold its weights
        for util in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
            if plan.engine_weights + GB <= util * card_gb * GB:
                trial = _with(args, gpu_memory_utilization=util)
                if replan(trial, model_path, max_model_len, world, card_gb, backend, False).fits:
                    return [_flag("gpu_memory_utilization", util)]
        plan.no_colocation = True
        return [
            f"a colocated vLLM engine (tensor parallel 1) holds the whole model's bf16 weights on every GPU "
            f"({plan.engine_weights / GB:.1f} GB), and no share of the card leaves the trainer room: this needs a "
            "tensor-parallel or separate rollout engine, which the scripts do not build"
        ]
    if backend == "vllm":  # a smaller engine: its bf16 weights plus a GB of KV cache must still fit in it
        low = (2 * plan.params + GB) / (card_gb * GB)
        for util in (0.3, 0.25, 0.2, 0.15, 0.1):
            if low <= util < args.rollout.gpu_memory_utilization:
                trial = _with(args, gpu_memory_utilization=util)
                if replan(trial, model_path, max_model_len, world, card_gb, backend, False).fits:
                    fixes.append(_flag("gpu_memory_utilization", util))
                    break
    return fixes or [
        "a larger GPU (no combination of micro-batch size or tokens, checkpointing and engine settings fits)"
    ]


ROLLOUT_FIELDS = ("enable_sleep_mode", "gpu_memory_utilization", "hf_max_batch", "server_tensor_parallel")


def _flag(name: str, value) -> str:
    flag = ("--rollout." if name in ROLLOUT_FIELDS else "--") + name.replace("_", "-")
    return flag if value is True else f"{flag} {value}"


def _with(args, **changes):
    """A copy of ``args`` with some fields (rollout ones included) replaced."""
    rollout = {k: changes.pop(k) for k in ROLLOUT_FIELDS if k in changes}
    return dataclasses.replace(args, rollout=dataclasses.replace(args.rollout, **rollout), **changes)
