"""The memory planner: what a run needs per GPU, judged before any weights load (``--dry-run``).

    plan = plan_memory(args, model_path, max_model_len, world=1, card_gb=80.0)
    print(format_plan(plan))          # one line per component, in GB (1e9 bytes), then the verdict

Everything is counted from the model's ``config.json`` (``AutoConfig``; parameters counted on the meta device, tied
embeddings once) and the run's flags. Per GPU, with P parameters per model:

* trainer state of each trained model (the policy; PPO's critic, PRIME's PRM): fp32 weights 4P, gradients 4P,
  AdamW moments 8P (16P; with ``--dtype bfloat16`` 2P + 2P + 4P). PPO's critic is a token classifier: a hidden -> 1
  value head replaces the LM head (``critic_params``). ppo.py and prime.py step the critic or PRM and free its
  gradients before the policy's update, so every model's weights and moments stay but only one model's gradients,
  AdamW temporary and autocast copies are live: the update's peak is the larger of the two models' updates, and the
  table's gradient lines are the larger model's. Under DDP (N > 1 processes) each rank holds a replica, nothing
  divides, and DDP's gradient buckets (each model's, kept) add another copy of the gradients. Under ``--fsdp``
  (``common/sharding.py``) the state and the frozen reference divide by N, and each rank gathers the units it
  computes: the root (embeddings, head, final norm; kept from the forward to the backward) and about two decoder
  layers at a time, weights and their unsharded gradients; ``--fsdp-offload`` keeps the sharded weights, gradients
  and AdamW moments in host memory.
* a frozen reference: 4P (2P in bf16); loaded when ``kl_coef > 0``, and always by prime.py.
* opd.py's frozen teacher (``--teacher``): its own parameter count T from its config, 4T (2T with ``--dtype
  bfloat16`` or ``--teacher-dtype bfloat16``), divided by N under ``--fsdp``; resident throughout, LoRA or not. Its
  forward runs before the update, without gradients, so only its weights count at the peak.
* LoRA (``--lora.rank r``, ``common/lora.py``): the policy's base is frozen, in the trainer's weight dtype (4P, 2P
  with ``--dtype bfloat16``; under bf16 autocast and not sharded, its decoder matmuls at 2 bytes,
  ``common.learner_speed.hold_frozen_linears_in_bf16``, and no autocast casts of them), with no gradients or AdamW
  state;
  its adapters, A = r x in and B = out x r per adapted
  linear layer, train in fp32 (16 bytes per adapter parameter). No reference loads: it is the policy with its
  adapters disabled. A critic or PRM stays fully trained. Activations are planned as without LoRA (the adapters'
  own, r values per token and layer, are not counted).
* bf16 autocast weight copies: ~2P for the model being updated (autocast caches the bf16 cast of every weight a
  matmul uses; the autograd graph holds them until the backward pass). A frozen LoRA base's casts are not cached,
  only saved for backward: 2P without checkpointing, one layer's with it. On by default on CUDA
  (``--mixed-precision auto``).
* the rollout engine: vLLM takes ``gpu_memory_utilization`` x the card (its bf16 weights and KV cache). With tensor
  parallelism 1 (the only layout built) every GPU's engine holds the whole model's bf16 weights (2P, sharded or not):
  when no share leaves the trainer room for them (32B-class models), the verdict says vLLM cannot colocate. With
  ``--rollout.enable-sleep-mode`` it sleeps during the update (level 1: weights offloaded to host memory, KV cache
  freed; ``common/vllm_engine.py``); what stays on the GPU (CUDA graphs, workspaces) is assumed to be
  ``VLLM_ASLEEP_GB``, not measured. The HF engine instead decodes on the trainer's own weights and holds a KV cache
  for the rows it decodes at once (``--rollout.hf-max-batch``), in the trainer's weight dtype; under ``--fsdp`` it
  samples from a gathered copy (a full replica per rank). Rollout servers (``--rollout.backend vllm-server``) hold
  their own GPUs: the trainer's hold no engine, only, while the weights are pushed, vLLM's two 1 GiB packed NCCL
  buffers on rank 0 (``NCCL_PUSH_BYTES``) and under ``--fsdp`` the one gathered tensor being sent (at most the
  embedding). The servers' GPUs are planned apart (``plan_server``, ``common/memory_plan.py``).
* activations of one micro-batch: the bytes autograd saves for backward, measured (``common/memory_phases.py``
  holds the formula). Padded (``--micro-batch-size``): rows x the worst-case padded length (``max_model_len`` =
  prompt budget + token budget), each token under a mask row that wide. Packed (``--micro-batch-tokens N``): N
  tokens in one flat row (all N counted as completion tokens); under sdpa one N x N block-diagonal mask per layer
  (so the mask term grows as N²), under flash-attention's varlen path, PyTorch's (``varlen``, which runs padded rows
  packed too) or flex attention none. The kernel is the one a CUDA run would
  pick (``common.packing.attention_implementation``): flash_attention_2 for packed runs when flash-attn is importable
  on the planning machine, else sdpa.
* the log-prob head's chunk (``common/logprobs.py``): ``LOGPROB_CHUNK`` completion tokens (or all of them, when
  fewer) x vocab fp32 logits and their log-softmax, and in the backward pass their two gradients: 4 such buffers at
  the peak, whatever the number of rows, padded or packed.
* AdamW's step: fused on CUDA (``common.learner_speed.fuse_adamw``), in place: no temporary beside the gradients
  (torch's foreach default, with which the committed H100 rows were measured, allocates one as large as the gradients).
* ``--rollout.fp32-lm-head on``: the bf16x3 head's two bf16 copies of the head weight (4 V H bytes).
* ``--checkpointing-policy``: every-2 keeps half the layers' activations, op is planned as no checkpointing (an
  upper bound).
* ``CUDA_OVERHEAD_GB`` for the CUDA context, cuBLAS/NCCL workspaces and allocator slack.

The peak is the larger of the rollout phase (engine awake; no gradients, activations or autocast copies) and the
update phase, whose own peak is the largest of its three moments (``update_phases``: the head's backward, the
backward's end, AdamW's step), as measured phase by phase on an H100 (``benchmarks/gpu_check.py``; 0.86 to 1.01 of
the plan over its 38 learner probes, benchmarks/results/gpu/). A plan does not fit when its peak exceeds the card.
Nothing algorithmic lives here.

The planner is split along its seams: model shapes from ``config.json`` (``common/memory_shapes.py``), the byte
model of one update (``common/memory_phases.py``), the plan's types, rollout servers and the printed table
(``common/memory_plan.py``), and the flag sets offered when a plan does not fit (``common/memory_fixes.py``). This
module sums them into a plan and holds the entry points the scripts, tests and benchmarks import.
"""

from __future__ import annotations

import importlib.util

import torch

from common.engine_base import use_fp32_head
from common.logprobs import LOGPROB_CHUNK
from common.memory_fixes import suggest_fixes
from common.memory_phases import (
    activation_bytes,
    autocast_copy_bytes,
    head_input_bytes,
    layer_bytes_per_token,
    logprob_head_bytes,
    saved_bytes,
    saved_bytes_per_token,
    update_phases,
    value_head_bytes,
)
from common.memory_plan import (
    CUDA_OVERHEAD_GB,
    GB,
    SERVE_ROLLOUT_UTILIZATION,
    MemoryPlan,
    ServerPlan,
    format_plan,
    plan_server,
    server_utilization,
)
from common.memory_shapes import (
    LOCAL_CONFIGS,
    MODEL_CONFIGS,
    ModelShape,
    critic_params,
    decoder_matmul_params,
    local_config,
    lora_params,
    meta_model,
    model_shape,
)
from common.packing import MASKLESS_ATTENTION, attention_implementation

__all__ = [  # the planner's public names: scripts, tests and benchmarks import them from here
    "CUDA_OVERHEAD_GB",
    "DEFAULT_GPU_GB",
    "GB",
    "LOCAL_CONFIGS",
    "MODEL_CONFIGS",
    "NCCL_PUSH_BYTES",
    "SERVE_ROLLOUT_UTILIZATION",
    "VLLM_ASLEEP_GB",
    "MemoryPlan",
    "ModelShape",
    "ServerPlan",
    "activation_bytes",
    "autocast_copy_bytes",
    "check_memory_plan",
    "critic_params",
    "decoder_matmul_params",
    "format_plan",
    "frozen_teacher",
    "gpu_gb",
    "head_input_bytes",
    "layer_bytes_per_token",
    "local_config",
    "logprob_head_bytes",
    "lora_params",
    "meta_model",
    "model_shape",
    "plan_memory",
    "plan_server",
    "resolve_backend",
    "saved_bytes",
    "saved_bytes_per_token",
    "server_utilization",
    "suggest_fixes",
    "trained_models",
    "update_phases",
    "value_head_bytes",
]

DEFAULT_GPU_GB = 80.0  # the card a plan is judged against when no GPU is seen and --dry-run-gpu-gb is 0
VLLM_ASLEEP_GB = 2.0  # assumed: what a level-1-asleep vLLM engine keeps on the GPU (CUDA graphs, workspaces)
NCCL_PUSH_BYTES = 2 * 1024**3  # vLLM's packed NCCL weight broadcast: 2 buffers of 1 GiB on the sending trainer rank


def planned_attention(packed: bool, half_precision: bool = True) -> str:
    """The attention kernel a CUDA run would use (``common.packing.attention_implementation``): flash_attention_2
    for packed bf16 micro-batches when the flash-attn package is importable on the planning machine, else sdpa."""
    return attention_implementation("cuda", packed=packed, half_precision=half_precision)


def trained_models(args) -> tuple[int, bool]:
    """(number of trained copies of the base model, whether a frozen reference loads), read from a script's Args:
    a critic (``critic_learning_rate``, ppo.py) or an implicit PRM (``prm_learning_rate``, prime.py, which always
    loads the reference) is a trained copy; the others load a reference only when ``kl_coef > 0``."""
    critic = hasattr(args, "critic_learning_rate")
    prm = hasattr(args, "prm_learning_rate")
    return 1 + critic + prm, prm or getattr(args, "kl_coef", 0.0) > 0


def frozen_teacher(args) -> tuple[str, int, int] | None:
    """opd.py's teacher (``--teacher``): (the model, its parameter count, its bytes per parameter), or None for the
    other scripts. Its shape comes from a local config when there is one (a folder, the shipped 'tiny-teacher', or a
    hub id of ``LOCAL_CONFIGS``), else from the hub id's config."""
    teacher = getattr(args, "teacher", "")
    if not teacher:
        return None
    from common.data import resolve_model_path

    dtype = args.dtype if getattr(args, "teacher_dtype", "auto") == "auto" else args.teacher_dtype
    path = local_config(teacher) or resolve_model_path(teacher)
    return teacher, model_shape(path).params, 2 if dtype == "bfloat16" else 4


def resolve_backend(args, on_gpu: bool) -> str:
    """The rollout engine the planned run builds. 'auto': on a CUDA machine, vLLM where vllm is installed
    (requirements-gpu.txt), else the HF engine; planned from a machine without a GPU (``--dry-run`` on a laptop),
    the GPU install's vLLM. 'vllm-server' and the others as given."""
    if args.rollout.backend != "auto":
        return args.rollout.backend
    return "vllm" if not on_gpu or importlib.util.find_spec("vllm") is not None else "hf"


def plan_memory(
    args,
    model_path: str,
    max_model_len: int,
    world: int = 1,
    card_gb: float = DEFAULT_GPU_GB,
    backend: str | None = None,
    with_fixes: bool = True,
) -> MemoryPlan:
    """The per-GPU plan of a run of ``args`` (a script's Args) on ``world`` processes, judged against ``card_gb``.

    ``max_model_len`` is the run's padded length (``context_budget``: prompt budget + token budget);
    ``backend`` the rollout engine ('vllm', 'vllm-server' or 'hf'; None resolves ``--rollout.backend``);
    'vllm-server' adds the plan of a server GPU (``plan_server``), judged against the same card.
    """
    shape = model_shape(model_path)
    backend = backend or resolve_backend(args, torch.cuda.is_available())
    p, card = shape.params, card_gb * GB
    bf16_weights = args.dtype == "bfloat16"
    autocast = args.mixed_precision != "no" and not bf16_weights
    wbytes = 2 if bf16_weights else 4
    n_trained, has_ref = trained_models(args)
    critic = hasattr(args, "critic_learning_rate")  # ppo.py's second model; prime.py's is an implicit PRM
    lora = getattr(args, "lora", None)
    adapters = lora_params(model_path, lora.rank, tuple(lora.target_modules)) if lora and lora.rank > 0 else 0
    has_ref = has_ref and not adapters  # LoRA: the reference is the policy with its adapters disabled
    rank_rows = args.prompts_per_step // world * args.group_size  # the sequences one process trains on per step
    packed = args.micro_batch_tokens > 0
    attention = planned_attention(packed, half_precision=autocast or bf16_weights)
    if packed:  # one flat row of at most N tokens; under sdpa one N x N block-diagonal mask per layer
        tokens = min(args.micro_batch_tokens, rank_rows * max_model_len)
        mask_len = 0 if attention in MASKLESS_ATTENTION else tokens
        completion_tokens = tokens  # at most: a bin's tokens, prompts included
        mask = f"one {tokens} x {tokens} mask per layer" if mask_len else "no mask"
        micro = f"packed: {tokens} tokens in one row, {attention}, {mask}"
    else:  # rows at the worst-case padded length, each with a max_model_len-wide mask row per token
        rows = min(args.micro_batch_size, rank_rows)
        # (a varlen kernel runs them packed: no mask)
        tokens, mask_len = rows * max_model_len, 0 if attention == "varlen" else max_model_len
        completion_tokens = rows * min(args.max_new_tokens, max_model_len)
        micro = f"{rows} rows x {max_model_len} tokens, {attention}"
    fsdp = getattr(args, "fsdp", False) and world > 1
    shards = world if fsdp else 1  # the trainer state and the reference divide by the processes under --fsdp
    on_gpu = 0.0 if fsdp and args.fsdp_offload else 1.0  # --fsdp-offload: the sharded state in host memory
    where = (f", sharded over {world}" + ("" if on_gpu else ", in host memory (--fsdp-offload)")) if fsdp else ""
    # one byte-per-parameter unit of each trained model's state: the policy's (LoRA: its adapters, kept in fp32) and
    # a second model's, which stays fully trained: ppo.py's critic (its value head replaces the LM head) or prime.py's
    # PRM (a copy of the policy's architecture)
    second = (critic_params(model_path) if critic else p) if n_trained > 1 else 0
    policy_state = ((0 if adapters else wbytes * p) + 4 * adapters) / shards * on_gpu
    second_state = wbytes * second / shards * on_gpu
    state = policy_state + second_state  # every model's weights, and half its AdamW moments, stay throughout
    # the scripts step each model and free its gradients before the next one's update: they never coexist
    gradients = max(policy_state, second_state)
    frozen = (wbytes * p if adapters else 0.0) / shards * on_gpu  # LoRA: the policy's frozen base
    # under bf16 autocast on CUDA (not sharded) the base's decoder matmuls are held in bf16
    # (common.learner_speed.hold_frozen_linears_in_bf16): 2 bytes each, no autocast casts of them
    bf16_base = bool(adapters) and autocast and not fsdp
    if bf16_base:
        frozen -= 2 * decoder_matmul_params(shape)
    name = "critic" if critic else "PRM"
    second_what = f"critic ({second / 1e9:.3f} B: value head, no LM head)" if critic else "implicit PRM"
    if not adapters:
        what = f"policy + {second_what}" if second else f"{n_trained} trained model(s)"
        what += f", {wbytes} B/param"
    else:
        what = (f"{name} + " if second else "") + (
            f"LoRA adapters ({adapters / 1e6:.1f}M params, fp32) on a frozen "
            + ("base, its decoder matmuls in bf16" if bf16_base else f"{wbytes} B/param base")
        )
    one_at_a_time = " (one model's at a time: the larger)" if second else ""
    components = [
        (f"weights ({what}{where})", state + frozen),
        (f"gradients{one_at_a_time}", gradients),
        ("AdamW moments", 2 * state),
    ]
    # DDP allocates each wrapped model's gradient buckets with it and keeps them: both models' count
    buckets = (0 if adapters else wbytes * p) + 4 * adapters + wbytes * second if world > 1 and not fsdp else 0.0
    if buckets:
        components.append((f"DDP gradient buckets ({world} processes, each a replica)", buckets))
    components.append(("frozen reference", wbytes * p / shards * on_gpu if has_ref else 0.0))
    teacher = frozen_teacher(args)
    teacher_bytes = teacher[1] * teacher[2] / shards * on_gpu if teacher else 0.0
    if teacher:
        components.append(
            (f"frozen teacher ({teacher[0]}, {teacher[1] / 1e9:.3f} B, {teacher[2]} B/param)", teacher_bytes)
        )
    gathered_units = second_units = 0.0
    if fsdp:  # gathered units: the root kept from forward to backward, ~2 layers (prefetch); weights and gradients
        root = shape.vocab * shape.hidden * (1 if shape.tied else 2) + shape.hidden
        gathered_units = 2 * wbytes * (root + 2 * (p - root) / shape.layers)
        if second:  # one model's units at a time; a critic's root: the embedding, final norm and value head
            root = shape.vocab * shape.hidden + 2 * shape.hidden + 1 if critic else root
            second_units = 2 * wbytes * (root + 2 * (second - root) / shape.layers)
        label = "FSDP gathered units (root + 2 layers, weights and gradients)"
        components.append((label + (" of one model at a time" if second else ""), max(gathered_units, second_units)))
    trainer_state = sum(b for _, b in components)
    # AdamW steps fused on CUDA (common.learner_speed.fuse_adamw): no foreach temporary beside the gradients
    components.append(("AdamW step temporary (fused on CUDA: none)", 0.0))
    ckpt = args.gradient_checkpointing
    policy = getattr(args, "checkpointing_policy", "full") if ckpt else "none"
    lora_casts = bool(adapters) and not bf16_base
    copies = autocast_copy_bytes(p, shape.layers, 0 if adapters else 1, lora_casts, ckpt) if autocast else 0.0
    second_copies = autocast_copy_bytes(second, shape.layers, 1, False, ckpt) if autocast else 0.0
    components.append((f"bf16 autocast weight copies{one_at_a_time}", max(copies, second_copies)))
    bf16_act = autocast or bf16_weights
    act = activation_bytes(shape, tokens, mask_len, completion_tokens, bf16_act, False)
    act_ckpt = activation_bytes(shape, tokens, mask_len, completion_tokens, bf16_act, True)
    components.append((f"activations without checkpointing ({micro})", act))
    components.append(("activations with --gradient-checkpointing", act_ckpt))
    if critic:  # the same layers; its value head keeps its input at every position (memory_phases.value_head_bytes)
        critic_act = activation_bytes(shape, tokens, mask_len, completion_tokens, bf16_act, ckpt, value_head=True)
        label = f"critic's activations ({'with' if ckpt else 'without'} checkpointing; value head at every token)"
        components.append((label, critic_act))
    head = logprob_head_bytes(shape, completion_tokens)
    chunk = min(LOGPROB_CHUNK, completion_tokens)
    components.append((f"log-prob head chunk ({chunk} tokens x {shape.vocab} fp32 x 4)", head))
    saved = saved_bytes(shape, tokens, mask_len, completion_tokens, bf16_act, ckpt)
    if policy in ("op", "every-2"):  # selective checkpointing (common.learner_speed.enable_checkpointing)
        kept = saved_bytes(shape, tokens, mask_len, completion_tokens, bf16_act, False)
        # every-2: half the layers keep everything; op: planned as keeping everything (an upper bound: it recomputes
        # every second matmul and the elementwise work)
        saved = kept if policy == "op" else (saved + kept) / 2
        components.append((f"activations saved under --checkpointing-policy {policy}", saved))
    head_cache = 4 * shape.vocab * shape.hidden if use_fp32_head(args.rollout, "cuda") else 0.0
    if head_cache:  # the bf16x3 head's bf16 hi and lo copies of the head weight (common.head_precision)
        components.append(("bf16x3 LM head's bf16 weight parts (--rollout.fp32-lm-head on)", head_cache))
    head_gradient = 0.0 if adapters else shape.vocab * shape.hidden * wbytes / shards  # the LM head's weight
    engine_weights = engine_share = 0.0
    if backend == "vllm":
        share = engine_share = args.rollout.gpu_memory_utilization * card
        engine_weights = 2 * p  # tensor parallel 1: the whole model's bf16 weights in every GPU's engine
        asleep = min(share, VLLM_ASLEEP_GB * GB) if args.rollout.enable_sleep_mode else share
        components.append((f"vLLM share ({args.rollout.gpu_memory_utilization:g} x {card_gb:g} GB)", share))
        if args.rollout.enable_sleep_mode:
            components.append(("vLLM asleep during the update (assumed)", asleep))
        rollout_engine, update_engine = share, asleep
    elif backend == "vllm-server":  # the servers hold their own GPUs; the trainer's only send them the weights
        gathered = shape.vocab * shape.hidden * wbytes if fsdp else 0.0  # full_tensor() of the largest: the embedding
        what = "2 x 1 GiB NCCL buffers" + (" + the largest gathered tensor" if fsdp else "")
        components.append((f"weight push to the rollout servers (rank 0: {what})", NCCL_PUSH_BYTES + gathered))
        rollout_engine, update_engine = NCCL_PUSH_BYTES + gathered, 0.0
    else:
        decoded = min(max(1, args.rollout.hf_max_batch // args.group_size), args.prompts_per_step // world)
        kv = decoded * args.group_size * max_model_len * shape.layers * 2 * shape.kv_heads * shape.head_dim * wbytes
        components.append((f"HF engine KV cache ({decoded * args.group_size} rows)", kv))
        sampler = 0.0  # --max-lag samples ahead from the live weights (common/async_rollout.py): no weight copy
        if fsdp:  # the HF engine samples from a gathered, unsharded copy of the policy on each rank
            components.append(("HF engine's gathered policy copy (--fsdp)", wbytes * p))
            sampler += wbytes * p
        rollout_engine, update_engine = kv + sampler, sampler
    overhead = CUDA_OVERHEAD_GB * GB
    components.append(("CUDA context and workspaces", overhead))
    resident = 3 * state + frozen + (wbytes * p if has_ref else 0.0) / shards * on_gpu + teacher_bytes + overhead
    resident += head_cache
    rollout_peak = resident + rollout_engine
    phases = update_phases(
        resident + buckets + update_engine,
        policy_state,
        copies,
        saved,
        act_ckpt - saved if ckpt else 0.0,
        head,
        head_gradient,
        gathered_units,
        adamw_temporary=False,
    )
    update_peak = max(phases.values())
    if second:  # the critic's or PRM's update runs first, and its gradients are freed before the policy's
        if critic:  # no log-prob head, and no LM head's gradient
            saved_2 = saved_bytes(shape, tokens, mask_len, completion_tokens, bf16_act, ckpt, value_head=True)
            recomputed_2, head_2, lm_head_2 = critic_act - saved_2, 0.0, 0.0
        else:  # the PRM: the policy's log-prob path, its LM head trained even when the policy is a LoRA
            saved_2, recomputed_2, head_2 = saved, act_ckpt - saved if ckpt else 0.0, head
            lm_head_2 = shape.vocab * shape.hidden * wbytes / shards
        base = resident + buckets + update_engine
        phases_2 = update_phases(
            base,
            second_state,
            second_copies,
            saved_2,
            recomputed_2,
            head_2,
            lm_head_2,
            second_units,
            adamw_temporary=False,
        )
        components.append((f"peak during the {name}'s update", max(phases_2.values())))
        components.append((f"peak during the policy's update (the {name}'s gradients freed)", update_peak))
        update_peak = max(update_peak, *phases_2.values())
    plan = MemoryPlan(
        model=model_path,
        params=p,
        components=components,
        rollout_peak=rollout_peak,
        update_peak=update_peak,
        card=card,
        trainer_state=trainer_state,
        world=world,
        fsdp=fsdp,
        engine_weights=engine_weights,
        engine_share=engine_share,
        server=plan_server(args, shape, max_model_len, card_gb) if backend == "vllm-server" else None,
    )
    if with_fixes and not plan.fits:
        plan.fixes = suggest_fixes(args, model_path, max_model_len, world, card_gb, backend, plan, plan_memory)
    return plan


def gpu_gb(args) -> float:
    """The card a plan is judged against: ``--dry-run-gpu-gb``, else the GPU seen, else ``DEFAULT_GPU_GB``."""
    if args.dry_run_gpu_gb > 0:
        return args.dry_run_gpu_gb
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[1] / GB
    return DEFAULT_GPU_GB


def check_memory_plan(args, model_path: str, max_model_len: int, world: int, on_gpu: bool, print_fn=print) -> None:
    """``--dry-run``: print the plan and exit 0. A CUDA run whose plan does not fit stops here, before any weights
    load, naming the flags that would make it fit (``--ignore-memory-plan`` lets it go on); with rollout servers only
    its own GPUs can stop it (the servers are running already, whatever their plan says). CPU runs are not planned
    (host memory is not what this guards) and cost nothing here."""
    if not args.dry_run and not on_gpu:
        return
    backend = resolve_backend(args, torch.cuda.is_available())
    plan = plan_memory(args, model_path, max_model_len, world, gpu_gb(args), backend)
    if args.dry_run:
        print_fn(format_plan(plan))
        raise SystemExit(0)
    if not (plan.trainer_fits if plan.server else plan.fits) and not args.ignore_memory_plan:
        raise SystemExit(
            format_plan(plan) + "\nthe plan does not fit this GPU: change the flags above, or pass "
            "--ignore-memory-plan to run anyway"
        )
