"""LUFFY: mixed-policy GRPO with off-policy teacher traces and policy shaping.

Paper: Yan, Li, Hu, Wang, Cui, Qu, Cheng, Zhang 2025, "Learning to Reason under Off-Policy Guidance",
arXiv 2504.14945 (official code: github.com/ElliottYan/LUFFY, luffy/verl/verl/mix_src/mix_core_alg.py).

For each prompt q, sample G-1 completions o_1..o_{G-1} from π_old and append one off-policy teacher trace
o_G (the dataset's worked solution, + EOS); score all G with the same verifier (R_i).

    advantage     Â_i = R_i - mean_{j=1..G} R_j                          over the union, teacher included
                  (--std-normalize: divide by std_j R_j + 1e-6, the paper's text; the released script has no std)
    on-policy     ℓ_{i,t} = -min(r_{i,t} Â_i, clip(r_{i,t}, 1-ε, 1+ε) Â_i),  r = π_θ/π_old   (i < G)
    off-policy    ℓ_{G,t} = -Â_G · f(π_θ(o_{G,t} | q, o_{G,<t})),  f(p) = p / (p + γ)   π_φ taken as 1, no clip
                  ∇ℓ = -Â_G · γ p/(p+γ)² · ∇log p: low-probability teacher tokens keep a large gradient
    objective     L = Σ_i Σ_t ℓ_{i,t} / Σ_i |o_i|                           token mean over the whole mini-batch

Relative to grpo.py this file changes:
  * sampling: G-1 on-policy samples per prompt plus the dataset's `solution` as a teacher completion
    (`teacher_completions`: tokenised + EOS, truncated to max_new_tokens), scored by the same verifier
  * advantages: R - mean over the union, no std by default (`--std-normalize` for the paper's text)
  * loss: teacher tokens use -A·f(π_θ) with f(p) = p/(p+γ), unclipped (`--no-shaping`: f(p) = p);
    on-policy tokens keep the PPO clip (`--no-on-policy-clip`: plain ratio, as LUFFY's train.sh)
  * aggregation: token mean over the mini-batch instead of the per-sequence mean; no KL (β = 0)
  * logging: on-policy reward/accuracy/entropy, teacher reward, teacher-token entropy and mean f-weight

Sources disagree; we follow design.md §4: advantages without std (the script's `grpo_use_std=False`), PPO
clip on on-policy tokens (train.sh removes it: `--no-on-policy-clip`), token mean (train.sh divides by the
padded length), no entropy bonus (train.sh: 0.001).

CPU, offline (the defaults: the shipped tiny model on `arith`, teacher = the task's worked solutions):
    python algos/luffy.py
The teacher's effect: `arith-hard` has 4 operands where the warm start saw 3 (sampled accuracy ~3%). Held-out mean@4
on its 200 problems after 60 steps, seeds 1-3 (benchmarks/results/teacher): GRPO 0.035 -> 0.058 +- 0.001, LUFFY
0.035 -> 0.094 +- 0.003 (greedy 0.057 vs 0.113), from
    python benchmarks/run.py teacher && python benchmarks/collect.py teacher
GPU, sharded over one node of 8 (paper: Qwen2.5-Math-7B with a 16k context, OpenR1 traces, lr 1e-6, 128 prompts x
(7+1), 8k tokens, 2 updates per batch; packed, checkpointed, vLLM asleep during the update; add --no-on-policy-clip
to match the released train.sh):
    # planner: fits on 80 GB: 52.7 GB per GPU
    accelerate launch --config_file scripts/accelerate/fsdp2.yaml algos/luffy.py --fsdp \
        --model Elliott/Qwen2.5-Math-7B-16k-think --dataset openr1-luffy --template qwen-math --rollout.backend vllm \
        --rollout.enable-sleep-mode --learning-rate 1e-6 --max-new-tokens 8192 --max-prompt-tokens 1024 \
        --prompts-per-step 128 --group-size 8 --num-minibatches 2 --micro-batch-tokens 16384 \
        --gradient-checkpointing --eval.dataset math500 --eval.temperature 0.6 --eval.n 1 --eval.k 1 --track
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.async_rollout import LaggedRollouts  # noqa: E402
from common.bookkeeping import Bookkeeper, pack_rollout, sample_rows  # noqa: E402
from common.correction import CorrectionConfig, correction_weights, resolve_correction  # noqa: E402
from common.data import format_prompt, teacher_completion  # noqa: E402
from common.evaluate import EvalConfig  # noqa: E402
from common.logprobs import token_logprobs, token_logprobs_batched  # noqa: E402
from common.lora import LoraConfig  # noqa: E402
from common.packing import micro_batches  # noqa: E402
from common.rollout import Completion, RolloutConfig, make_engine  # noqa: E402
from common.runtime import load_model, load_task, load_tokenizer, reference_model, start_run  # noqa: E402
from common.sandbox import SandboxConfig  # noqa: E402
from common.tool_loop import ToolConfig  # noqa: E402
from common.verifiers import compute_rewards  # noqa: E402


@dataclass
class Args:
    # experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the script's name)"""
    seed: int = 1
    """seed of the experiment (data order, sampling, initialisation)"""
    run_name: str = ""
    """run folder name under output_dir ('' = {exp_name}__{dataset}__{seed})"""
    output_dir: str = "runs"
    """where run folders are written"""
    resume: bool = False
    """continue runs/<run_name> from its latest checkpoint (same data order and sampling seeds)"""
    track: bool = False
    """mirror metrics to Weights & Biases (works with WANDB_MODE=offline)"""
    wandb_project: str = "rl-reasoning"
    """wandb project name"""
    dist_timeout_minutes: int = 60
    """how long a process waits for the others at a collective before the run fails (NCCL's own default: 10)"""
    # model and data
    model: str = "tiny"
    """hub id or local folder of the policy ('tiny' = the shipped offline model in common/tiny_model)"""
    dataset: str = "arith"
    """training dataset (see common/data.py) or jsonl:<path>"""
    template: str = ""
    """prompt template: chat, qwen-math, r1-zero, dapo, plain ('' = the dataset's default)"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """trainer weight dtype ('auto' = float32 master weights: bf16 weights drop AdamW updates below their resolution)"""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """bf16 autocast of the trainer's forward/backward ('auto' = on for CUDA and bf16-capable CPUs)"""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """where to train ('auto' = CUDA when usable; a GPU install with unusable CUDA stops; 'cpu' = the CPU anyway)"""
    # rollout
    total_steps: int = 60
    """number of rollout + update steps"""
    prompts_per_step: int = 16
    """prompts sampled per step, across all processes"""
    group_size: int = 8
    """completions per prompt (G), the teacher trace included: G-1 on-policy samples + 1 off-policy (LUFFY: 7 + 1)"""
    max_new_tokens: int = 40
    """token budget per completion (tiny task: 40; math with a 1.5B model: ~3000)"""
    max_prompt_tokens: int = 512
    """prompts longer than this (after templating) are an error"""
    temperature: float = 1.0
    """sampling temperature, also applied to the trainer's logits so log-probs match the sampler"""
    top_p: float = 1.0
    """nucleus threshold of training rollouts: must be 1 (the trainer's log-probs are of the full distribution)"""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """rollout engine settings"""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """importance weights for the sampler/trainer gap on the policy-gradient term (common/correction.py)"""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the policy (--lora.rank > 0; the reference is the base, adapters off; common/lora.py)"""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """where model-written programs run for code rewards (common/sandbox.py; bwrap rung probed at start-up)"""
    tools: ToolConfig = field(default_factory=ToolConfig)
    """tool-integrated rollouts: the model calls a calculator or sandboxed Python mid-answer (common/tool_loop.py)"""
    max_lag: int = 1
    """asynchronous RL: batch s is sampled by policy version max(0, s-k+1), k = max_lag (1 = synchronous)"""
    # optimisation
    learning_rate: float | None = None
    """AdamW learning rate (None = 1e-4 for the tiny model; required for any other model, ~1e-6 at 1.5B-7B)"""
    warmup_steps: int = 10
    """linear warm-up steps (optimiser steps), then constant"""
    adam_beta2: float = 0.99
    """AdamW β2"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold"""
    num_epochs: int = 1
    """passes over each rollout batch (μ in the GRPO paper)"""
    num_minibatches: int = 1
    """optimiser steps per epoch over the rollout batch"""
    micro_batch_size: int = 64
    """sequences per forward/backward (gradient accumulation; does not change the objective)"""
    micro_batch_tokens: int = 0
    """tokens per forward/backward, sequences packed without padding (replaces --micro-batch-size; 0 = padded rows)"""
    gradient_checkpointing: bool = False
    """recompute each layer's activations in the backward pass: less memory for ~30% more compute (long completions)"""
    checkpointing_policy: Literal["full", "op", "every-2"] = "full"
    """what --gradient-checkpointing recomputes: every layer, torchtitan's per-op selective policy, every 2nd layer"""
    compile: bool = False
    """torch.compile each decoder layer on its own (torchtitan-style; the first step compiles for tens of seconds)"""
    max_bad_steps: int = 5
    """abort after this many consecutive steps with a non-finite loss or gradient (each is skipped)"""
    dry_run: bool = False
    """print the per-GPU memory plan and exit without loading weights"""
    dry_run_gpu_gb: float = 0.0
    """GPU memory the plan is judged against (0 = the GPU seen, 80 without one)"""
    ignore_memory_plan: bool = False
    """start a CUDA run even when the memory plan says it does not fit"""
    fsdp: bool = False
    """shard policy, reference, critic, PRM per decoder layer with FSDP2 (launch: torchrun or accelerate launch)"""
    fsdp_offload: bool = False
    """with --fsdp: sharded weights, gradients and AdamW moments in host memory (the optimiser steps on the CPU)"""
    # ALGO LOGIC: LUFFY hyperparameters
    shaping_gamma: float = 0.1
    """γ in LUFFY's policy shaping f(p) = p/(p+γ) on teacher tokens (train.sh `off_policy_reshape=p_div_p_0.1`)"""
    shaping: bool = True
    """apply f to teacher tokens (--no-shaping: plain importance weight π_θ/π_φ with π_φ = 1, i.e. f(p) = p)"""
    clip_eps: float = 0.2
    """ε, the PPO clip range of the on-policy ratio (GRPO eq. 3; teacher tokens are never clipped)"""
    on_policy_clip: bool = True
    """clip the on-policy ratio (--no-on-policy-clip: -A·r unclipped, LUFFY's train.sh `loss_remove_clip=True`)"""
    std_normalize: bool = False
    """divide advantages by the group std over the union (the paper's text; the released script does not)"""
    kl_coef: float = 0.0
    """β, weight of a k3 KL to the frozen reference (LUFFY uses none; 0 = no reference model)"""
    # evaluation, logging, checkpoints
    eval_every: int = 10
    """evaluate on the held-out set every this many steps (and before the first and after the last)"""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """evaluation protocol"""
    save_every: int = 20
    """checkpoint every this many steps (and at the end)"""
    keep_checkpoints: int = 2
    """number of most recent checkpoints kept (0 = all)"""
    log_samples: int = 4
    """completions written to samples.jsonl per step"""


# ALGO LOGIC: advantages, loss and teacher completions (the functions tests import)
def compute_advantages(
    rewards: torch.Tensor, group_size: int, std_normalize: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages over the union of a group's on- and off-policy samples: Â_i = R_i - mean_g R.

    rewards: (B,) with prompt i's group (G-1 samples, then the teacher) in rows i*G .. i*G+G-1. The mean
    includes the teacher's own reward. ``std_normalize`` divides by the sample std + eps. Returns (B,).
    """
    if group_size < 2:
        raise ValueError(
            f"LUFFY needs group_size >= 2 (at least one on-policy sample besides the teacher), got {group_size}"
        )
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size).float()
    adv = grouped - grouped.mean(dim=1, keepdim=True)
    if std_normalize:
        adv = adv / (grouped.std(dim=1, unbiased=True, keepdim=True) + eps)
    return adv.view(-1)


def shaping_fn(p: torch.Tensor, gamma: float) -> torch.Tensor:
    """LUFFY's policy shaping f(p) = p / (p + γ); df/dp = γ/(p+γ)², df/dlog p = γp/(p+γ)² (peak 1/4 at p = γ)."""
    return p / (p + gamma)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    off_policy_mask: torch.Tensor,
    shaping_gamma: float = 0.1,
    clip_eps: float = 0.2,
    on_policy_clip: bool = True,
    shaping: bool = True,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: int | float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """LUFFY loss: PPO clip on on-policy rows, -A·f(π_θ) on teacher rows (``off_policy_mask``), token mean.

    logprobs (B,T) with grad; old_logprobs, ref_logprobs (B,T) detached (old_logprobs is ignored on teacher
    rows: π_φ is taken as 1); advantages (B,) or (B,T); mask (B,T) 1 on completion tokens (EOS included);
    off_policy_mask (B,) bool, True for teacher traces. ``num_tokens`` is the number of valid tokens in the
    optimiser mini-batch (default mask.sum()): passing it lets micro-batches accumulate to the mini-batch loss.
    ``is_weights`` (B,T) detached: rollout-correction weights π_old/μ, on the on-policy surrogate only (teacher rows
    had no sampler: their weight is 1 whatever is passed there; never on the KL).
    """
    mask = mask.float()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    off = off_policy_mask.to(torch.bool).view(-1, 1).expand_as(mask)
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # as verl: keeps exp finite
    ratio = torch.exp(log_ratio)
    on_token = -adv * ratio
    if on_policy_clip:
        on_token = torch.max(on_token, -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps))
    prob = torch.exp(logprobs)  # π_θ of the teacher token; π_φ = 1, so this is the importance ratio
    off_token = -adv * (shaping_fn(prob, shaping_gamma) if shaping else prob)
    if is_weights is not None:  # the sampler was μ, not π_old: reweight the on-policy policy-gradient term
        on_token = on_token * is_weights
    per_token = torch.where(off, off_token, on_token)
    metrics = {}
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        delta = ref_logprobs - logprobs
        k3 = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * k3
        metrics["kl"] = ((k3 * mask).sum() / mask.sum().clamp(min=1)).detach()
    loss = (per_token * mask).sum() / (num_tokens or mask.sum().clamp(min=1))  # token mean over the mini-batch
    with torch.no_grad():
        on_mask, off_mask = mask * (~off).float(), mask * off.float()
        clipped = (
            ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
            if on_policy_clip
            else torch.zeros_like(off)
        )
        if on_mask.sum() > 0:  # policy-token statistics, only from micro-batches that hold the policy's own samples
            metrics["clip_frac"] = ((clipped.float() * on_mask).sum() / on_mask.sum()).detach()
            metrics["ratio"] = ((ratio * on_mask).sum() / on_mask.sum()).detach()
        if off_mask.sum() > 0:  # teacher-token statistics, only from micro-batches that hold a teacher trace
            p = prob.detach()
            metrics["teacher_prob"] = ((p * off_mask).sum() / off_mask.sum()).detach()
            metrics["teacher_f"] = ((shaping_fn(p, shaping_gamma) * off_mask).sum() / off_mask.sum()).detach()
            weight = shaping_gamma * p / (p + shaping_gamma) ** 2 if shaping else p  # coefficient of -A·∇log π_θ
            metrics["teacher_grad_weight"] = ((weight * off_mask).sum() / off_mask.sum()).detach()
    return loss, metrics


def teacher_completions(
    problems: list[dict], rendered_prompts: list[str], tokenizer, max_new_tokens: int
) -> list[Completion]:
    """Each problem's ``solution`` as a completion: its tokens + EOS, cut to ``max_new_tokens`` ("length").

    ``teacher_completion`` drops a ``<think>`` the rendered prompt already ends with (LUFFY's dataset
    code). The log-probs are 0: the teacher's probabilities are taken as 1 (π_φ = 1).
    """
    out = []
    for problem, rendered in zip(problems, rendered_prompts):
        if not problem.get("solution", "").strip():
            raise ValueError(f"LUFFY needs a teacher trace: problem {problem['prompt'][:60]!r} has an empty 'solution'")
        ids = tokenizer(teacher_completion(problem["solution"], rendered), add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        finish = "stop" if len(ids) <= max_new_tokens else "length"
        ids = ids[:max_new_tokens]
        out.append(Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish))
    return out


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).detach()


def main() -> None:
    args = tyro.cli(Args)
    run = start_run(args)  # flags checked, processes started, precision chosen, run folder claimed, seeded
    # 'auto': on when the sampler is not the model (vLLM, or a lagging policy version). ALGO LOGIC: under lag this is
    # AReaL's decoupled PPO: the clip is taken around the recomputed π_old, the weight π_old/μ corrects the behaviour
    args.correction = resolve_correction(args.correction, args.rollout, max_lag=args.max_lag)
    accelerator, device, autocast = run.accelerator, run.device, run.autocast
    compute_advantages(torch.zeros(2 * args.group_size), args.group_size)  # fail fast on a group size it rejects
    if args.group_size < 2:  # ALGO LOGIC
        raise SystemExit("--group-size must be >= 2: G-1 on-policy samples plus the teacher trace")
    batch_size = run.local_prompts * args.group_size  # sequences per process per step
    task = load_task(args)
    tokenizer = load_tokenizer(run.model_path)
    raw_model = load_model(run, gradient_checkpointing=args.gradient_checkpointing, lora=args.lora)
    ref_model = reference_model(run, raw_model) if args.kl_coef > 0 else None  # ALGO LOGIC: only the KL term needs it
    optimizer = torch.optim.AdamW(
        raw_model.parameters(), lr=args.learning_rate, betas=(0.9, args.adam_beta2), weight_decay=args.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    # model: the DDP-wrapped policy (raw_model itself on one process or under --fsdp); the scheduler stays unprepared
    model, optimizer = run.prepare(raw_model, optimizer)
    engine = make_engine(
        args.rollout, raw_model, tokenizer, run.model_path, args.seed + run.rank, run.max_model_len, run.autocast
    )
    books = Bookkeeper(
        run, args, tokenizer, task, engine, {"model": raw_model, "optimizer": optimizer, "scheduler": scheduler}
    )

    def sample(step: int):
        """Batch ``step``: this process's share of the seeded, resumable prompt stream, and G-1 samples per prompt."""
        problems, prompt_ids = books.next_prompts()
        # one seed per prompt from its global position: the same samples on any number of processes and after a resume
        first_prompt = (args.seed * 1_000_003 + step) * args.prompts_per_step + run.rank * run.local_prompts
        seeds = [(first_prompt + i) * args.group_size for i in range(run.local_prompts)]
        request = rollouts.request(
            prompt_ids, args.group_size - 1, args.max_new_tokens, args.temperature, args.top_p, seeds, stop=task.stop
        )
        return problems, prompt_ids, request

    # batch s comes from policy version max(0, s - max_lag + 1); rollout servers sample it while the trainer trains
    rollouts = LaggedRollouts(books, engine, sample, args.max_lag)

    for step in books.steps():
        t_step = time.time()
        # 1-2. ALGO LOGIC: this step's prompts and G-1 samples per prompt from the policy, then the teacher trace as G
        t0 = time.time()
        problems, prompt_ids, sampled = rollouts.take(step)
        teachers = teacher_completions(
            problems,
            [format_prompt(p["prompt"], task.template, tokenizer) for p in problems],
            tokenizer,
            args.max_new_tokens,
        )
        completions = [
            c
            for i, t in enumerate(teachers)
            for c in sampled[i * (args.group_size - 1) : (i + 1) * (args.group_size - 1)] + [t]
        ]
        off_policy = torch.tensor([i % args.group_size == args.group_size - 1 for i in range(batch_size)])
        rollout_s = time.time() - t0

        # 3. rewards from the verifier
        t0 = time.time()
        texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        golds = [p["answer"] for p in problems for _ in range(args.group_size)]
        outputs = compute_rewards(task.train_info.reward_fn, texts, golds)
        rewards = torch.tensor([o.reward for o in outputs], dtype=torch.float32)
        correct = torch.tensor([o.correct for o in outputs], dtype=torch.float32)
        reward_s = time.time() - t0

        # 4. ALGO LOGIC: group-relative advantages over the union of on- and off-policy samples
        advantages = compute_advantages(rewards, args.group_size, std_normalize=args.std_normalize).to(device)

        # 5. tensors: [left-padded prompt | right-padded completion]
        input_ids, attention_mask, completion_mask, rollout_logprobs = pack_rollout(
            prompt_ids, completions, args.group_size, tokenizer.pad_token_id, device
        )
        completion_width, off_policy = completion_mask.shape[1], off_policy.to(device)

        # 6. old log-probs (only when the batch is reused, else the detached current ones are exact) and reference ones
        t0 = time.time()
        on_policy = args.num_epochs == 1 and args.num_minibatches == 1
        old_logprobs, ref_logprobs = None, None
        logprob_args = (
            input_ids,
            attention_mask,
            completion_width,
            args.temperature,
            args.micro_batch_size,
            run.fp32_head,
            args.micro_batch_tokens,
        )
        with torch.no_grad(), autocast():
            if not on_policy:
                old_logprobs = token_logprobs_batched(model, *logprob_args)
            if ref_model is not None:
                ref_logprobs = token_logprobs_batched(ref_model, *logprob_args)
        old_logprobs_s = time.time() - t0

        # 7. update: epochs x minibatches x micro-batches, one optimiser step per minibatch
        t0 = time.time()
        update_stats: dict[str, list[float]] = {}
        minibatch_size = batch_size // args.num_minibatches
        for epoch in range(args.num_epochs):
            generator = torch.Generator().manual_seed(args.seed * 7919 + step * 31 + epoch)
            order = torch.randperm(batch_size, generator=generator).to(device)
            for start in range(0, batch_size, minibatch_size):
                mb_rows, minibatch_loss = order[start : start + minibatch_size], 0.0
                mb_rows = mb_rows[attention_mask[mb_rows].sum(-1).argsort(stable=True)]  # similar lengths together
                # ALGO LOGIC: global token mean (DDP averages)
                num_tokens = max(float(accelerator.reduce(completion_mask[mb_rows].sum(), "sum")), 1.0) / run.world
                for rows, sync in micro_batches(
                    mb_rows, attention_mask, args.micro_batch_size, args.micro_batch_tokens
                ):
                    with accelerator.no_sync(model) if not sync else contextlib.nullcontext():
                        with autocast():
                            logprobs, entropy = token_logprobs(
                                model,
                                input_ids[rows],
                                attention_mask[rows],
                                completion_width,
                                args.temperature,
                                with_entropy=True,
                                fp32_head=run.fp32_head,
                                packed=args.micro_batch_tokens > 0,
                            )
                        old = logprobs.detach() if on_policy else old_logprobs[rows]
                        # ALGO LOGIC: the policy's own tokens; a teacher row's "rollout log-probs" are 0 (π_φ = 1), not
                        # a sampler's: it is left out of the mismatch metrics and policy_loss gives it weight 1
                        on_mask = completion_mask[rows] * (~off_policy[rows]).float().unsqueeze(-1)
                        is_weights, correction_stats = correction_weights(
                            old, rollout_logprobs[rows], on_mask, args.correction
                        )
                        loss, loss_stats = policy_loss(
                            logprobs,
                            old,
                            advantages[rows],
                            completion_mask[rows],
                            off_policy[rows],
                            shaping_gamma=args.shaping_gamma,
                            clip_eps=args.clip_eps,
                            on_policy_clip=args.on_policy_clip,
                            shaping=args.shaping,
                            kl_coef=args.kl_coef,
                            ref_logprobs=None if ref_logprobs is None else ref_logprobs[rows],
                            num_tokens=num_tokens,
                            is_weights=is_weights,
                        )
                        accelerator.backward(loss)
                    minibatch_loss += loss.detach().double()  # float64, as .item() summed it; no sync
                    if on_mask.sum() > 0:  # length-sorted micro-batches can hold teacher traces only
                        loss_stats["entropy"] = masked_mean(entropy, on_mask)
                    if off_policy[rows].any():
                        loss_stats["teacher_entropy"] = masked_mean(entropy, completion_mask[rows] - on_mask)
                    if (
                        epoch == 0 and start == 0 and on_mask.sum() > 0
                    ):  # sampler vs trainer log-prob gap, untouched policy
                        gap = (logprobs.detach() - rollout_logprobs[rows]).abs()
                        loss_stats["logprob_gap"] = masked_mean(gap, on_mask)
                    if epoch == 0 and on_mask.sum() > 0:  # every sampled token once: the mismatch and the weights
                        loss_stats |= correction_stats
                    for k, v in loss_stats.items():
                        update_stats.setdefault(k, []).append(v)
                update_stats.setdefault("loss", []).append(minibatch_loss)
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                if books.update_is_finite(grad_norm, minibatch_loss, update_stats):
                    optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                update_stats.setdefault("grad_norm", []).append(float(grad_norm))
        train_s = time.time() - t0

        # 8. push the new weights into the rollout engine (once the rollouts sampling from the old ones are done)
        t0 = time.time()
        rollouts.update_weights(raw_model)
        weight_sync_s = time.time() - t0

        # 9. log, then evaluate and checkpoint on their cadence
        lengths, grouped_rewards = completion_mask.sum(-1).cpu(), rewards.view(-1, args.group_size)
        off = off_policy.cpu()  # ALGO LOGIC: the policy's samples (~off) are logged as in grpo.py, the teacher's apart
        on, truncated = ~off, torch.tensor([c.finish_reason == "length" for c in completions])
        step_log = {
            "train/reward": rewards[on].mean().item(),
            "train/accuracy": correct[on].mean().item(),
            "train/response_len": lengths[on].mean().item(),
            "train/truncation_rate": truncated[on].float().mean().item(),
            "train/teacher_reward": rewards[off].mean().item(),
            "train/teacher_accuracy": correct[off].mean().item(),
            "train/teacher_len": lengths[off].mean().item(),
            "train/teacher_truncation_rate": truncated[off].float().mean().item(),
            "train/teacher_advantage": advantages[off_policy].mean().item(),
            "train/frac_zero_adv_groups": (grouped_rewards.max(1).values == grouped_rewards.min(1).values)
            .float()
            .mean()
            .item(),
            "train/lr": scheduler.get_last_lr()[0],
            "time/rollout_s": rollout_s,
            "time/reward_s": reward_s,
            "time/old_logprobs_s": old_logprobs_s,
            "time/train_s": train_s,
            "time/weight_sync_s": weight_sync_s,
            "time/tokens_per_s": float(lengths[on].sum()) / max(rollout_s, 1e-9),
            "time/train_tokens_per_s": float(attention_mask.sum()) * args.num_epochs / max(train_s, 1e-9),
        } | rollouts.stats
        samples = sample_rows(problems, texts, golds, rewards, args.group_size, args.log_samples)
        books.log_step(step + 1, update_stats, step_log, t_step, samples)
        books.end_step(step + 1)

    books.finish(raw_model)


if __name__ == "__main__":
    main()
