"""OPD: on-policy distillation. The student samples; a frozen teacher scores every sampled token.

Papers: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes" (GKD),
arXiv 2306.13649; Lu and Thinking Machines Lab 2025, "On-Policy Distillation",
https://thinkingmachines.ai/blog/on-policy-distillation, whose recipe this builds (tinker-cookbook
tinker_cookbook/distillation/train_on_policy.py; also prime-rl src/prime_rl/orchestrator/algo/opd.py).

For each prompt q, sample G completions from the sampler μ (the student's weights as the rollout engine ran them),
keep μ's per-token log-probs, and score the same tokens with the frozen teacher π_T in one forward pass over prompt
and completion, at the sampling temperature. π(t) is short for π(o_{i,t} | q, o_{i,<t}).

    reverse KL    d_{i,t} = log μ(t) - log π_T(t)            k1 estimate of KL(μ(·|q,o_{i,<t}) ‖ π_T(·|q,o_{i,<t}))
    advantage     A_{i,t} = -d_{i,t} + c_R · Â_i              Â_i: GRPO's group-normalised verifier reward, c_R = 0
    ratio         ρ_{i,t} = π_θ(t) / μ(t)                     with gradient, never clipped
    objective     L = -(1/N) Σ_i Σ_t ρ_{i,t} A_{i,t}          N = completion tokens in the optimiser mini-batch

KL direction and estimator: the reverse KL, KL(student ‖ teacher), estimated per token by the one-sample k1 estimator
log μ(t) - log π_T(t) on the student's own token, as Thinking Machines' blog and tinker-cookbook's
`incorporate_kl_penalty` (advantage = -kl_penalty_coef · (sampled_logprobs - teacher_logprobs), coef 1, no discount)
and prime-rl's `ref_kl_loss_fn` (src/prime_rl/trainer/rl/loss.py). Reverse KL is mode-seeking: the student is
pushed off tokens the teacher finds unlikely, not made to cover all of the teacher's mass (forward KL, i.e. SFT on
teacher samples). At θ = μ the gradient -(1/N) Σ A ∇log π_θ is REINFORCE with a per-token reward, which drops the
later tokens' KL from each token's return (tinker-cookbook's kl_discount_factor = 0, its default). The student's
log-prob in d is μ's, the sampler's, as tinker-cookbook's `sampled_logprobs`: fixed for the batch and scored once.
prime-rl instead takes the live trainer log-prob (detached) and adds a one-sided mask and 1e-3·(log ρ)²; at one
optimiser step per batch the two agree up to the sampler/trainer gap. The loss is tinker's `importance_sampling`
(-ρ·A, ρ against μ, no clip), aggregated as a token mean over the mini-batch (tinker sums; prime-rl's ref_kl
divides by the token count).

Relative to grpo.py this file changes:
  - a frozen teacher (--teacher, the same tokenizer) scores the sampled tokens; its forward is packed like the
    reference's (--micro-batch-tokens) and its weights load, shard and plan like any frozen model's
  - advantages: per token, the negative k1 reverse KL to the teacher; no group baseline (--reward-coef adds GRPO's)
  - loss: -ρ·A with ρ = π_θ/μ against the sampler's log-probs, no clip, token mean over the mini-batch
  - rollout correction: none on top (auto -> none, other modes refused): ρ already divides by μ
  - no π_old forward, and no reference model (--kl-coef 0)

CPU, offline (the defaults: the shipped tiny model on `arith`, taught by common/tiny_teacher_model, the same model
after 60 GRPO steps; held-out mean@4 0.374 -> 0.888 at step 30, 0.870 at 60, against the teacher's 0.904):
    python algos/opd.py
GPU, Thinking Machines' reasoning run (their student is Qwen3-8B-Base after SFT on OpenThoughts3: pass that folder
as --model; teacher Qwen3-32B; tinker-cookbook: 512 prompts x 4, 4096 tokens, rank-128 LoRA at lr 1e-4, 100 steps):
    # planner: not planned (no local config for Qwen/Qwen3-8B-Base)
    accelerate launch --num_processes 8 algos/opd.py --fsdp --model Qwen/Qwen3-8B-Base --teacher Qwen/Qwen3-32B \
        --teacher-dtype bfloat16 --dataset math --template chat --rollout.backend vllm --rollout.enable-sleep-mode \
        --lora.rank 128 --learning-rate 1e-4 --max-new-tokens 4096 --prompts-per-step 512 --group-size 4 \
        --total-steps 100 --micro-batch-tokens 16384 --gradient-checkpointing --eval.dataset aime24 --track
GPU, one process (a 1.5B student, a 7B teacher of the same tokenizer; put a stronger checkpoint in its place):
    # planner: fits on 80 GB: 75.1 GB per GPU
    python algos/opd.py --model Qwen/Qwen2.5-Math-1.5B --teacher Qwen/Qwen2.5-Math-7B --teacher-dtype bfloat16 \
        --dataset math --template qwen-math --rollout.backend vllm --learning-rate 1e-6 --max-new-tokens 3000 \
        --prompts-per-step 128 --group-size 8 --micro-batch-tokens 8192 --gradient-checkpointing \
        --eval.dataset math500 --track
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from common.bookkeeping import Bookkeeper, pack_rollout, rollout_stats, sample_rows  # noqa: E402
from common.correction import CorrectionConfig, correction_weights, resolve_correction  # noqa: E402
from common.data import resolve_model_path  # noqa: E402
from common.evaluate import EvalConfig  # noqa: E402
from common.logprobs import token_logprobs, token_logprobs_batched  # noqa: E402
from common.lora import LoraConfig  # noqa: E402
from common.packing import micro_batches  # noqa: E402
from common.rollout import RolloutConfig, make_engine  # noqa: E402
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
    """completions per prompt (G)"""
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
    # ALGO LOGIC: OPD hyperparameters
    teacher: str = "tiny-teacher"
    """frozen teacher: hub id or local folder, the student's tokenizer ('tiny-teacher' = common/tiny_teacher_model)"""
    teacher_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """the teacher's weight dtype ('auto' = the trainer's, --dtype; bfloat16 halves a large teacher's memory)"""
    reward_coef: float = 0.0
    """c_R, weight of GRPO's group-normalised verifier advantage added to every token's (0 = pure distillation)"""
    kl_coef: float = 0.0
    """β, weight of a k3 KL to the frozen reference (the student's base) in the loss (OPD: none; 0 = no reference)"""
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


# ALGO LOGIC: advantages and loss (the functions tests import)
def compute_advantages(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor | None = None,
    group_size: int = 0,
    reward_coef: float = 0.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-token OPD advantages A_t = -(log μ_t - log π_T,t) + c_R·Â_i, 0 off the mask. Returns (B,T).

    student_logprobs (B,T) are μ's, the sampler's log-probs of its own tokens; teacher_logprobs (B,T) the teacher's of
    the same tokens; mask (B,T) 1 on generated tokens. The first term is minus the k1 estimate of the per-token reverse
    KL(μ ‖ π_T): exactly 0 where student and teacher agree on the token. With ``reward_coef`` > 0, ``rewards`` (B,),
    grouped contiguously in ``group_size`` rows, add GRPO's Â_i = (R_i - mean_g R) / (std_g R + eps) to every token.
    """
    valid = mask.bool()
    advantages = torch.where(valid, teacher_logprobs - student_logprobs, 0.0).float()
    if reward_coef:
        if group_size < 2 or rewards is None or rewards.numel() % group_size:
            raise ValueError(f"--reward-coef needs rewards in groups of group_size >= 2, got group_size {group_size}")
        grouped = rewards.view(-1, group_size).float()
        mean, std = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, unbiased=True, keepdim=True)
        outcome = ((grouped - mean) / (std + eps)).view(-1, 1).to(advantages.device)
        advantages = advantages + torch.where(valid, reward_coef * outcome, 0.0)
    return advantages


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """OPD loss, tinker's ``importance_sampling``: -ρ·A with ρ = π_θ/μ (+ β·k3), summed and divided by ``num_tokens``.

    logprobs (B,T) with grad; old_logprobs (B,T) are μ, the SAMPLER's log-probs (ρ carries the gradient and is never
    clipped); advantages (B,T) per token, or (B,); ref_logprobs (B,T) detached, for the optional k3 KL; mask (B,T) 1
    on generated tokens (EOS included). ``num_tokens`` is the token count of the optimiser mini-batch (default: this
    batch's): passing it lets micro-batches accumulate to exactly the mini-batch's token mean.
    """
    mask = mask.float()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))  # as verl: keeps exp finite
    per_token = -ratio * adv  # ∇ = -ρ·A·∇log π_θ: REINFORCE with a per-token reward, importance-weighted to μ
    metrics = {}
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        delta = ref_logprobs - logprobs
        k3 = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * k3
        metrics["kl"] = masked_mean(k3.detach(), mask)
    loss = (per_token * mask).sum() / (num_tokens if num_tokens is not None else mask.sum().clamp(min=1))  # token mean
    metrics["clip_frac"] = 0.0  # nothing is clipped (tinker's importance_sampling); every script logs the key
    metrics["ratio"] = masked_mean(ratio.detach(), mask)
    return loss, metrics


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).detach()


def main() -> None:
    args = tyro.cli(Args)
    # ALGO LOGIC: ρ = π_θ/μ is taken against the sampler's log-probs already (under lag too): no correction on top
    own = "its importance ratio π_θ/μ is taken against the sampler's log-probs μ (tinker's importance_sampling loss)"
    run = start_run(args, own_correction=own)  # flags checked (LoRA dropout against its own weight), processes started
    args.correction = resolve_correction(args.correction, args.rollout, own_correction=own)  # 'auto' -> none
    accelerator, device, autocast = run.accelerator, run.device, run.autocast
    if args.reward_coef and args.group_size < 2:
        raise SystemExit(f"--reward-coef {args.reward_coef} needs --group-size >= 2 to form GRPO's group baseline")
    batch_size = run.local_prompts * args.group_size  # sequences per process per step
    task = load_task(args)
    tokenizer = load_tokenizer(run.model_path)
    # ALGO LOGIC: the teacher scores the student's token ids, so it must read them as the student wrote them
    teacher_path = resolve_model_path(args.teacher)
    if load_tokenizer(teacher_path).get_vocab() != tokenizer.get_vocab():
        raise SystemExit(
            f"--teacher {args.teacher}: its tokenizer differs from --model {args.model}'s; the teacher scores the "
            "student's token ids, so both need the same tokenizer"
        )
    raw_model = load_model(run, gradient_checkpointing=args.gradient_checkpointing, lora=args.lora)
    # a frozen model like the reference (eval mode, no gradients, sharded under --fsdp), from the teacher's folder
    teacher_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.teacher_dtype, run.dtype)
    teacher = load_model(dataclasses.replace(run, model_path=teacher_path, dtype=teacher_dtype), frozen=True)
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
        """Batch ``step``: this process's share of the seeded, resumable prompt stream, and G samples per prompt."""
        problems, prompt_ids = books.next_prompts()
        # one seed per prompt from its global position: the same samples on any number of processes and after a resume
        first_prompt = (args.seed * 1_000_003 + step) * args.prompts_per_step + run.rank * run.local_prompts
        seeds = [(first_prompt + i) * args.group_size for i in range(run.local_prompts)]
        request = rollouts.request(
            prompt_ids, args.group_size, args.max_new_tokens, args.temperature, args.top_p, seeds, stop=task.stop
        )
        return problems, prompt_ids, request

    # batch s comes from policy version max(0, s - max_lag + 1); rollout servers sample it while the trainer trains
    rollouts = LaggedRollouts(books, engine, sample, args.max_lag)

    for step in books.steps():
        t_step = time.time()
        # 1-2. this step's prompts and rollouts (requested --max-lag - 1 steps ago)
        t0 = time.time()
        problems, prompt_ids, completions = rollouts.take(step)
        rollout_s = time.time() - t0

        # 3. rewards from the verifier
        t0 = time.time()
        texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        golds = [p["answer"] for p in problems for _ in range(args.group_size)]
        outputs = compute_rewards(task.train_info.reward_fn, texts, golds)
        rewards = torch.tensor([o.reward for o in outputs], dtype=torch.float32)
        correct = torch.tensor([o.correct for o in outputs], dtype=torch.float32)
        reward_s = time.time() - t0

        # 5. tensors: [left-padded prompt | right-padded completion]
        input_ids, attention_mask, completion_mask, rollout_logprobs = pack_rollout(
            prompt_ids, completions, args.group_size, tokenizer.pad_token_id, device
        )
        completion_width = completion_mask.shape[1]

        # 6. ALGO LOGIC: the teacher's log-probs of the sampled tokens (packed like any frozen forward), and the
        # per-token advantages from them; no π_old forward (ρ is taken against μ), reference log-probs only for the KL
        t0 = time.time()
        ref_logprobs = None
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
            teacher_logprobs = token_logprobs_batched(teacher, *logprob_args)
            if ref_model is not None:
                ref_logprobs = token_logprobs_batched(ref_model, *logprob_args)
        advantages = compute_advantages(
            rollout_logprobs, teacher_logprobs, completion_mask, rewards, args.group_size, args.reward_coef
        )
        teacher_kl = masked_mean(rollout_logprobs - teacher_logprobs, completion_mask)  # k1 estimate of KL(μ ‖ π_T)
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
                # ALGO LOGIC: token-mean denominator = the mini-batch's tokens summed over processes; DDP averages the
                # gradients over processes, so each divides by (global count / world): the global token mean
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
                        loss, loss_stats = policy_loss(  # ALGO LOGIC: old_logprobs = μ, the sampler's
                            logprobs,
                            rollout_logprobs[rows],
                            advantages[rows],
                            completion_mask[rows],
                            kl_coef=args.kl_coef,
                            ref_logprobs=None if ref_logprobs is None else ref_logprobs[rows],
                            num_tokens=num_tokens,
                        )
                        accelerator.backward(loss)
                    minibatch_loss += loss.detach().double()  # float64, as .item() summed it; no sync
                    loss_stats["entropy"] = masked_mean(entropy, completion_mask[rows])
                    if epoch == 0 and start == 0:  # sampler vs trainer log-prob gap, on the untouched policy
                        gap = (logprobs.detach() - rollout_logprobs[rows]).abs()
                        loss_stats["logprob_gap"] = masked_mean(gap, completion_mask[rows])
                    if epoch == 0:  # every sampled token once: the sampler/trainer mismatch (mode none: metrics only)
                        loss_stats |= correction_weights(
                            logprobs.detach(), rollout_logprobs[rows], completion_mask[rows], args.correction
                        )[1]
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
        step_log = rollout_stats(rewards, correct, completion_mask, completions, args.group_size)
        step_log |= {
            "train/lr": scheduler.get_last_lr()[0],
            "train/teacher_kl": teacher_kl,
            "time/rollout_s": rollout_s,
            "time/reward_s": reward_s,
            "time/old_logprobs_s": old_logprobs_s,
            "time/train_s": train_s,
            "time/weight_sync_s": weight_sync_s,
            "time/tokens_per_s": float(completion_mask.sum()) / max(rollout_s, 1e-9),
            "time/train_tokens_per_s": float(attention_mask.sum()) * args.num_epochs / max(train_s, 1e-9),
        } | rollouts.stats
        samples = sample_rows(problems, texts, golds, rewards, args.group_size, args.log_samples)
        books.log_step(step + 1, update_stats, step_log, t_step, samples)
        books.end_step(step + 1)

    books.finish(raw_model)


if __name__ == "__main__":
    main()
