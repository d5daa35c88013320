"""Set-up every script shares: processes, precision, the run folder, models, the task's data and prompts.

    run = start_run(args)                       # flags checked, processes started, memory planned, seeded
    task = load_task(args)                      # train and held-out problems, templates, verifier
    tokenizer = load_tokenizer(run.model_path)
    raw_model = load_model(run, gradient_checkpointing=args.gradient_checkpointing, lora=args.lora)
    ref_model = reference_model(run, raw_model)   # LoRA: the policy with its adapters disabled; else a frozen copy
    prompt_ids = encode_prompts(tokenizer, problems, task.template, args.max_prompt_tokens)

``args`` is a script's tyro ``Args``; these functions read only the fields every script shares (the consistency
test holds the scripts to the same names and defaults). Nothing algorithmic lives here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common.attention import VARLEN, register_varlen
from common.data import (
    SHIPPED_MODELS,
    STOP_STRINGS,
    DatasetInfo,
    dataset_info,
    format_prompt,
    load_problems,
    resolve_model_path,
)
from common.evaluate import EvalConfig
from common.learner_speed import compile_layers, enable_checkpointing, fuse_adamw, hold_frozen_linears_in_bf16
from common.lora import AdapterDisabled, LoraConfig, apply_lora, check_lora, is_lora
from common.memory import LOCAL_CONFIGS, check_memory_plan, local_config
from common.packing import attention_implementation
from common.rollout import use_fp32_head
from common.run_checks import (
    check_device,
    check_in_flight,
    check_micro_batch_tokens,
    check_sampling_flags,
    check_sandbox,
    lora_dropout_hazards,
)
from common.sharding import shard_model
from common.tracking import latest_checkpoint, seed_everything


@dataclass
class Run:
    """One process's view of a training run."""

    accelerator: Accelerator
    rank: int  # this process's index
    world: int  # number of processes
    device: torch.device
    dtype: torch.dtype  # trainer weight dtype (fp32 master weights unless --dtype says otherwise)
    autocast: Callable[[], contextlib.AbstractContextManager]  # bf16 autocast of forward/backward, or a no-op
    attn_implementation: str
    fp32_head: bool  # LM head in fp32 in the trainer's log-probs, as in the sampler (--rollout.fp32-lm-head)
    model_path: str  # local folder or hub id of the policy
    run_dir: Path
    local_prompts: int  # prompts per step on this process
    max_prompt_tokens: int  # longest prompt that fits: --max-prompt-tokens, or less on a short-context model
    max_model_len: int  # positions a sequence may use (prompt + token budget), within the model's own limit
    fsdp: bool = False  # models sharded per decoder layer with FSDP2 (--fsdp); accelerate does not wrap them
    fsdp_offload: bool = False  # sharded parameters and optimiser state in host memory (--fsdp-offload)
    seed: int = 0  # --seed (the same on every process: e.g. LoRA's adapter initialisation)
    bf16_autocast: bool = False  # the forward and backward run under bf16 autocast (``autocast`` is not a no-op)
    checkpointing_policy: str = "full"  # with --gradient-checkpointing: CHECKPOINTING_POLICIES (--checkpointing-policy)
    compile_layers: bool = False  # each decoder layer torch.compile'd on its own (--compile)

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        """``(model for forward/backward, optimizer)``: under ``--fsdp`` the sharded module and the optimiser
        themselves (accelerate must not wrap them again), else ``accelerator.prepare`` (DDP on several processes).
        An AdamW whose parameters are all on CUDA steps with the fused kernel (``fuse_adamw``)."""
        fuse_adamw(optimizer)
        return (model, optimizer) if self.fsdp else self.accelerator.prepare(model, optimizer)


def start_run(args, own_correction: str = "") -> Run:
    """Check the shared flags, start the processes, choose precision and attention, claim the run folder, seed.

    Exits with a message naming the flag when a shared flag is invalid. Each process is seeded with seed + rank.
    ``own_correction``: what the script passes to ``resolve_correction`` (why its loss takes its importance weight
    against the sampler's log-probs itself; empty when it does not), so the LoRA checks see the run as it will be.
    """
    if args.learning_rate is None:
        if args.model not in SHIPPED_MODELS:
            raise SystemExit(
                "--learning-rate is required for a model other than the shipped 'tiny', 'tiny-code' and 'tiny-tool' "
                "(the tiny default 1e-4 would wreck a 1.5B model; papers use ~1e-6)"
            )
        args.learning_rate = 1e-4
    check_sampling_flags(args)
    check_in_flight(args)
    if (tools := getattr(args, "tools", None)) is not None:
        try:
            tools.check()
        except ValueError as e:
            raise SystemExit(str(e)) from None
    check_sandbox(args)
    if (lora := getattr(args, "lora", None)) is not None:
        check_lora(lora, *lora_dropout_hazards(args, own_correction))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the fast tokenizer's threads would fight the trainer's
    use_cuda = check_device(args)
    # a generous collective timeout: rank 0 alone writes checkpoints while the others wait (NCCL's default is 10 min)
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=args.dist_timeout_minutes))
    accelerator = Accelerator(cpu=not use_cuda, kwargs_handlers=[timeout])
    rank, world = accelerator.process_index, accelerator.num_processes
    if args.prompts_per_step % world:
        raise SystemExit(
            f"--prompts-per-step {args.prompts_per_step} must be divisible by the number of processes ({world})"
        )
    if args.fsdp_offload and not args.fsdp:
        raise SystemExit("--fsdp-offload offloads FSDP2 shards: pass --fsdp as well")
    local_prompts = args.prompts_per_step // world
    if (local_prompts * args.group_size) % args.num_minibatches:
        raise SystemExit(
            f"{local_prompts * args.group_size} sequences per process do not split into "
            f"--num-minibatches {args.num_minibatches}"
        )
    args.run_name = args.run_name or f"{args.exp_name}__{args.dataset.replace('/', '_')}__{args.seed}"
    run_dir = Path(args.output_dir) / args.run_name
    model_path = resolve_model_path(args.model)
    # --dry-run plans from a config.json alone: a hub id of common/model_configs' table needs no network
    config_path = (local_config(model_path) or model_path) if args.dry_run else model_path
    max_prompt_tokens, max_model_len = context_budget(args, config_path)
    check_micro_batch_tokens(args, max_prompt_tokens)
    # --dry-run prints the per-GPU memory plan and exits, before the run folder is claimed: it writes nothing and
    # works beside an existing run; a CUDA run that cannot fit stops before any weights load
    check_memory_plan(args, config_path, max_model_len, world, use_cuda, accelerator.print)
    if run_dir.exists() and not args.resume and latest_checkpoint(run_dir) is not None:
        raise SystemExit(f"{run_dir} already holds a run; pass --resume to continue it or choose another --run-name")
    if args.fsdp and world == 1:
        raise SystemExit(
            "--fsdp shards the models over processes, and this run has one: launch it with torchrun or accelerate "
            "launch (e.g. torchrun --nproc_per_node 8 algos/grpo.py --fsdp ...), or drop --fsdp"
        )
    seed_everything(args.seed + rank)
    device = accelerator.device
    # bf16 matmuls (GPU tensor cores; ~2x faster on CPUs with AVX512-BF16/AMX); weights and optimiser stay fp32
    if device.type == "cuda":
        native_bf16 = torch.cuda.is_bf16_supported()
    else:
        native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    use_bf16 = args.mixed_precision == "bf16" or (args.mixed_precision == "auto" and native_bf16)
    accelerator.print(describe_processes(world, accelerator.distributed_type.value, args.fsdp, use_bf16, device))
    return Run(
        accelerator=accelerator,
        rank=rank,
        world=world,
        device=device,
        dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype, torch.float32),
        autocast=functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=use_bf16),
        attn_implementation=attention_implementation(
            device.type, packed=args.micro_batch_tokens > 0, half_precision=use_bf16 or args.dtype == "bfloat16"
        ),
        fp32_head=use_fp32_head(args.rollout, device),
        model_path=model_path,
        run_dir=run_dir,
        local_prompts=local_prompts,
        max_prompt_tokens=max_prompt_tokens,
        max_model_len=max_model_len,
        fsdp=args.fsdp,
        fsdp_offload=args.fsdp_offload,
        seed=args.seed,
        bf16_autocast=use_bf16,
        checkpointing_policy=getattr(args, "checkpointing_policy", "full"),
        compile_layers=getattr(args, "compile", False),
    )


def describe_processes(world: int, distributed_type: str, fsdp: bool, bf16: bool, device: torch.device) -> str:
    """The start-up line in words, e.g. ``1 process, not distributed, bf16 autocast off, device cpu``."""
    processes = f"{world} process" + ("es" if world > 1 else "")
    layout = "not distributed" if world == 1 else ("FSDP2-sharded" if fsdp else "data-parallel (DDP)")
    layout += "" if world == 1 else f" over {'NCCL' if device.type == 'cuda' else 'gloo'} ({distributed_type})"
    return f"{processes}, {layout}, bf16 autocast {'on' if bf16 else 'off'}, device {device}"


def load_config(model_path: str):
    """``model_path``'s transformers config; a config that cannot be read (offline, or no such hub id) stops with a
    message naming the local folders that would do (``--dry-run`` plans from a folder holding config.json alone)."""
    try:
        return AutoConfig.from_pretrained(model_path)
    except OSError as error:
        raise SystemExit(
            f"--model {model_path}: cannot read its config.json ({str(error).splitlines()[0]}). Pass a local folder "
            "holding the model (for --dry-run, config.json alone is enough); common/model_configs holds the configs "
            f"of {', '.join(sorted(LOCAL_CONFIGS))}"
        ) from None


def context_budget(args, model_path: str) -> tuple[int, int]:
    """``(max_prompt_tokens, max_model_len)`` within the model's position limit (``max_position_embeddings``).

    The token budget is the larger of ``--max-new-tokens`` and ``--eval.max-new-tokens``; the prompt budget is
    ``--max-prompt-tokens``, cut down so that prompt + budget fits the model (vLLM refuses a longer context).
    ``--rollout.max-model-len`` overrides the total. A budget that leaves no room for a prompt is an error naming
    the flags.
    """
    budget = max(args.max_new_tokens, args.eval.max_new_tokens)
    limit = getattr(load_config(model_path), "max_position_embeddings", None) or 1 << 62
    # a tool loop's observations take positions too: the context holds the whole budget where the model allows, and
    # a sample that reaches the context ends with "length" (common/tool_loop.py); the prompt room below counts only
    # the sampled budget, which must fit
    tools = getattr(args, "tools", None)
    total = max(budget, tools.total_budget(budget)) if tools is not None and tools.format != "none" else budget
    requested = args.rollout.max_model_len or args.max_prompt_tokens + total
    if requested > limit and args.rollout.max_model_len:
        raise SystemExit(
            f"--rollout.max-model-len {args.rollout.max_model_len} exceeds the model's {limit} positions "
            "(max_position_embeddings); vLLM would refuse it"
        )
    max_model_len = min(requested, limit)
    max_prompt_tokens = min(args.max_prompt_tokens, max_model_len - budget)
    if max_prompt_tokens < 1:
        raise SystemExit(
            f"a token budget of {budget} (--max-new-tokens {args.max_new_tokens}, --eval.max-new-tokens "
            f"{args.eval.max_new_tokens}) leaves no room for a prompt in {max_model_len} positions (the model's "
            f"max_position_embeddings {limit if limit < 1 << 62 else 'unset'}, or --rollout.max-model-len)"
        )
    return max_prompt_tokens, min(max_model_len, max_prompt_tokens + total)


def load_tokenizer(model_path: str):
    """The policy's tokenizer, left-padding (prompts are left-padded), with a pad token (EOS when it has none)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    run: Run,
    frozen: bool = False,
    gradient_checkpointing: bool = False,
    model_cls=AutoModelForCausalLM,
    lora: LoraConfig | None = None,
    **kwargs,
) -> torch.nn.Module:
    """A copy of the base model on this process's device, in the run's dtype and attention implementation.

    A trained model comes back in train mode (transformers checkpoints a layer only when ``gradient_checkpointing
    and training``); ``frozen``: eval mode, no gradients (a reference model). Every dropout probability of the config
    is set to 0 either way: each RL quantity (ratios, the sampler/trainer gap, old and reference log-probs) assumes
    the same forward gives the same log-probs, in train mode as in eval mode. ``gradient_checkpointing``: recompute
    each layer in the backward pass. ``model_cls`` and ``kwargs`` go to ``from_pretrained`` (e.g. a critic's token
    classifier). ``lora`` with a rank > 0: the model comes back wrapped by peft, only its adapters trainable
    (``common/lora.py``).
    Under ``--fsdp`` the model comes back sharded per decoder layer over the processes (``common/sharding.py``):
    build its optimiser after this call.
    """
    config = kwargs.pop("config", None) or load_config(run.model_path)
    zero_dropout(config)
    if run.attn_implementation == VARLEN:  # PyTorch's varlen kernel, registered with transformers under its name
        register_varlen()
    model = model_cls.from_pretrained(
        run.model_path, config=config, dtype=run.dtype, attn_implementation=run.attn_implementation, **kwargs
    ).to(run.device)
    if gradient_checkpointing:
        enable_checkpointing(model, run.checkpointing_policy)
    if lora is not None and lora.rank > 0 and not frozen:
        model = apply_lora(model, lora, seed=run.seed)
        # under bf16 autocast on CUDA the frozen base's matmul weights are held in bf16: the numbers autocast would
        # cast them to on every forward anyway, at half the memory and with no per-step casts (issue 41)
        if run.bf16_autocast and run.device.type == "cuda" and run.dtype == torch.float32 and not run.fsdp:
            hold_frozen_linears_in_bf16(model)
    if frozen:
        model.eval().requires_grad_(False)
    else:
        model.train()
    if run.compile_layers:
        compile_layers(model)
    return shard_model(model, run.fsdp_offload) if run.fsdp else model


def reference_model(run: Run, policy: torch.nn.Module) -> torch.nn.Module:
    """The frozen reference policy (the base model): a LoRA policy with its adapters disabled (no second copy),
    else a fresh frozen copy of the base (``load_model(run, frozen=True)``)."""
    return AdapterDisabled(policy) if is_lora(policy) else load_model(run, frozen=True)


def zero_dropout(config) -> list[str]:
    """Set every dropout probability of ``config`` and of its text sub-config to 0 in place; returns the names set.

    Numeric attributes named ``*dropout*`` or ``*_pdrop`` (Qwen2: ``attention_dropout``; a token classifier:
    ``classifier_dropout``; GPT-2: ``resid_pdrop``, ...). A layer that reads none of them has no dropout to turn off.
    """
    changed = []
    for cfg in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        for name, value in vars(cfg).items():
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ("dropout" in name or name.endswith("_pdrop")) and numeric:
                setattr(cfg, name, 0.0)
                changed.append(name)
    return changed


@dataclass
class Task:
    """The training and held-out data of a run, with their templates and verifiers."""

    train_info: DatasetInfo
    train_problems: list[dict]
    template: str  # training prompt template
    stop: tuple[str, ...]  # stop strings of the training template (engine.generate(..., stop=task.stop))
    eval_name: str
    eval_info: DatasetInfo
    eval_problems: list[dict]
    eval_template: str
    eval_stop: tuple[str, ...]
    eval_cfg: EvalConfig  # the evaluation protocol, its token budget resolved


def load_task(args) -> Task:
    """Load ``--dataset``'s train split and the held-out set (``--eval.dataset``, default the same dataset).

    An unknown dataset or template name exits with a one-line message naming its flag before any data loads.
    """
    from common.data import check_template

    train_info = dataset_info(args.dataset, "--dataset")
    eval_name = args.eval.dataset or args.dataset
    eval_info = dataset_info(eval_name, "--eval.dataset" if args.eval.dataset else "--dataset")
    template = args.template or train_info.default_template
    eval_template = args.eval.template or eval_info.default_template
    check_template(template, "--template")
    check_template(eval_template, "--eval.template")
    return Task(
        train_info=train_info,
        train_problems=load_problems(args.dataset, "train"),
        template=template,
        stop=STOP_STRINGS.get(template, ()),
        eval_name=eval_name,
        eval_info=eval_info,
        eval_problems=load_problems(eval_name, eval_info.eval_split),
        eval_template=eval_template,
        eval_stop=STOP_STRINGS.get(eval_template, ()),
        eval_cfg=dataclasses.replace(args.eval, max_new_tokens=args.eval.max_new_tokens or args.max_new_tokens),
    )


def encode_prompts(tokenizer, problems: list[dict], template: str, max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of each problem's templated prompt; a prompt over ``max_prompt_tokens`` is an error naming it.

    ``max_prompt_tokens`` is the run's prompt budget (``Run.max_prompt_tokens``: --max-prompt-tokens, or less
    when the model's positions minus the token budget leave less).
    """
    ids = [tokenizer(format_prompt(p["prompt"], template, tokenizer))["input_ids"] for p in problems]
    for problem, prompt_ids in zip(problems, ids):
        if len(prompt_ids) > max_prompt_tokens:
            raise SystemExit(
                f"prompt of {len(prompt_ids)} tokens exceeds the prompt budget of {max_prompt_tokens} tokens "
                "(--max-prompt-tokens, capped by the model's max_position_embeddings minus --max-new-tokens / "
                f"--eval.max-new-tokens): {problem['prompt'][:80]!r}"
            )
    return ids
