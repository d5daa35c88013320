"""CISPO: Clipped IS-weight Policy Optimization.

Paper: MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", arXiv 2506.13585,
§3.1 (eq. 3-5). The cap ε_max = 5 follows ScaleRL (Khatri et al. 2025, arXiv 2510.13786) and TRL's CISPO loss.

For each prompt q, sample a group of G completions o_1..o_G from π_old and score them with a verifier (R_i).

    advantage     Â_i = (R_i - mean_j R_j) / (std_j R_j + 1e-6)          sample std, same for every token of o_i (eq. 2)
    IS weight     r_{i,t} = π_θ(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | q, o_{i,<t})
    capped        r̂_{i,t} = min(r_{i,t}, ε_max)                         absolute cap, no lower bound (eq. 5)
    surrogate     ℓ_{i,t} = -sg(r̂_{i,t}) Â_i log π_θ(o_{i,t} | q, o_{i,<t})   sg = stop-gradient (eq. 4)
    objective     L = (1 / Σ_i |o_i|) Σ_i Σ_t ℓ_{i,t}                        token mean over the whole mini-batch

The gradient of ℓ is -r̂·Â·∇log π for every token: CISPO clips the importance-sampling weight, never the
token's update, so tokens PPO would clip (rare "fork" tokens with large ratios) keep contributing. M1 writes
the cap as 1 + ε^IS_high and gives no value; ε_max = 5 is the same cap written absolutely (ε^IS_high = 4).
On-policy (r = 1) the gradient equals GRPO's / PPO's under the same aggregation, so the rollout batch is split
into several mini-batches (2 here; M1 takes 16 off-policy updates per generation batch): after the first
update the ratio leaves 1 and the weight matters.

Relative to grpo.py this file changes:
- the per-token loss: -sg(min(r, ε_max))·Â·log π instead of the PPO clip (every token gets gradient).
- token-level aggregation over the optimiser mini-batch, exact under gradient accumulation and across processes.
- no KL and no reference model (M1 §3.1: "There is no KL penalty term in CISPO").
- 2 optimiser steps per rollout by default, so the IS weights are not all 1 (one seed, 30 steps, tiny lr 1e-4:
  4 mini-batches peaked at step 10 and fell back, mean@4 0.37 -> 0.83 -> 0.72; 2 gave 0.37 -> 0.78 -> 0.87).
M1 also used DAPO's dynamic sampling and length penalty; those live in dapo.py and are left out here.

CPU, offline (the defaults: the shipped tiny model on the synthetic `arith` task):
    python algos/cispo.py
GPU, one process (lr 1e-6 as the other recipes; G = 16 as ScaleRL's CISPO runs; 16 updates per rollout as M1):
    # planner: fits on 80 GB: 59.9 GB per GPU
    python algos/cispo.py --model Qwen/Qwen2.5-Math-1.5B --dataset math --template qwen-math --rollout.backend vllm \
        --learning-rate 1e-6 --max-new-tokens 3000 --prompts-per-step 64 --group-size 16 --num-minibatches 16 \
        --micro-batch-tokens 8192 --gradient-checkpointing --eval.dataset math500 --track
GPU, several processes (each rank its own colocated engine; a prompt's group stays on one rank):
    accelerate launch --num_processes 8 algos/cispo.py <the flags above>
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
from common.bookkeeping import Bookkeeper, pack_rollout, rollout_stats, sample_rows  # noqa: E402
from common.correction import CorrectionConfig, correction_weights, resolve_correction  # noqa: E402
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
    num_minibatches: int = 2
    """optimiser steps per epoch over the rollout batch (M1: 16; > 1 makes later updates off-policy, r ≠ 1; tiny: 2)"""
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
    # ALGO LOGIC: CISPO hyperparameters
    eps_max: float = 5.0
    """ε_max, absolute cap on the detached IS weight (M1 eq. 5 as 1 + ε^IS_high; 5.0 as ScaleRL/TRL), no lower bound"""
    kl_coef: float = 0.0
    """β of an optional k3 KL to a frozen reference; CISPO has none (M1 §3.1), so 0 = no reference model"""
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
def compute_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages Â_i = (R_i - mean_g R) / (std_g R + eps), sample (Bessel) std.

    rewards: (B,) with prompt i's group in rows i*G .. i*G+G-1. Returns (B,). A group whose rewards are
    all equal gets exactly 0.
    """
    if group_size < 2:
        raise ValueError(f"GRPO needs group_size >= 2 to form a baseline, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size).float()
    mean, std = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, unbiased=True, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_max: float = 5.0,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO loss: -sg(min(r, ε_max))·A·log π (+ optional β·k3), summed over tokens and divided by ``num_tokens``.

    logprobs (B,T) with grad; old_logprobs, ref_logprobs (B,T) detached; advantages (B,) or (B,T);
    mask (B,T) 1 on generated tokens (EOS included). ``num_tokens`` is the token count of the optimiser
    mini-batch (default: this batch's): passing it lets micro-batches accumulate to exactly the token mean.
    ``is_weights`` (B,T) detached: rollout-correction weights π_old/μ, a second factor beside sg(min(r, ε_max))
    (that one corrects π_θ/π_old, this one π_old/μ), on the surrogate only (not the KL).
    """
    mask = mask.float()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # as verl: keeps exp finite
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=eps_max).detach()  # the capped IS weight carries no gradient: only log π does
    per_token = -weight * adv * logprobs
    if is_weights is not None:  # the sampler was μ, not π_old: reweight the policy-gradient term
        per_token = per_token * is_weights
    metrics = {}
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        delta = ref_logprobs - logprobs
        k3 = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * k3
        metrics["kl"] = ((k3 * mask).sum() / mask.sum().clamp(min=1)).detach()
    loss = (per_token * mask).sum() / (num_tokens if num_tokens is not None else mask.sum().clamp(min=1))  # token mean
    with torch.no_grad():  # clip_frac: tokens whose IS weight was capped at ε_max (they still get gradient)
        metrics["clip_frac"] = (((ratio > eps_max).float() * mask).sum() / mask.sum().clamp(min=1)).detach()
        metrics["is_weight"] = ((weight * mask).sum() / mask.sum().clamp(min=1)).detach()
        metrics["ratio"] = ((ratio * mask).sum() / mask.sum().clamp(min=1)).detach()
    return loss, metrics


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).detach()


def main() -> None:
    args = tyro.cli(Args)
    # ALGO LOGIC: under lag (--max-lag > 1) the IS weight min(π_θ/μ, ε_max) is taken against the sampler μ itself, as
    # ScaleRL's CISPO: its cap then bounds the whole gap, so no correction weight goes on top
    own = "under --max-lag > 1 its IS weight is taken against the sampler's log-probs μ" if args.max_lag > 1 else ""
    run = start_run(args, own_correction=own)  # flags checked (LoRA dropout against its own weight), processes started
    args.correction = resolve_correction(args.correction, args.rollout, own_correction=own)  # 'auto': on for vLLM
    accelerator, device, autocast = run.accelerator, run.device, run.autocast
    compute_advantages(torch.zeros(2 * args.group_size), args.group_size)  # fail fast on a group size it rejects
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

        # 4. ALGO LOGIC: group-relative advantages
        advantages = compute_advantages(rewards, args.group_size).to(device)

        # 5. tensors: [left-padded prompt | right-padded completion]
        input_ids, attention_mask, completion_mask, rollout_logprobs = pack_rollout(
            prompt_ids, completions, args.group_size, tokenizer.pad_token_id, device
        )
        completion_width = completion_mask.shape[1]

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
                        old = logprobs.detach() if on_policy else old_logprobs[rows]
                        is_weights, correction_stats = correction_weights(  # mismatch: recomputed old policy vs μ
                            old, rollout_logprobs[rows], completion_mask[rows], args.correction
                        )
                        old = rollout_logprobs[rows] if args.max_lag > 1 else old  # ALGO LOGIC: μ under lag
                        loss, loss_stats = policy_loss(
                            logprobs,
                            old,
                            advantages[rows],
                            completion_mask[rows],
                            eps_max=args.eps_max,
                            kl_coef=args.kl_coef,
                            ref_logprobs=None if ref_logprobs is None else ref_logprobs[rows],
                            num_tokens=num_tokens,
                            is_weights=is_weights,
                        )
                        accelerator.backward(loss)
                    minibatch_loss += loss.detach().double()  # float64, as .item() summed it; no sync
                    loss_stats["entropy"] = masked_mean(entropy, completion_mask[rows])
                    if epoch == 0 and start == 0:  # sampler vs trainer log-prob gap, on the untouched policy
                        gap = (logprobs.detach() - rollout_logprobs[rows]).abs()
                        loss_stats["logprob_gap"] = masked_mean(gap, completion_mask[rows])
                    if epoch == 0:  # every sampled token once: the sampler/trainer mismatch and the weights' statistics
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
        step_log = rollout_stats(rewards, correct, completion_mask, completions, args.group_size)
        step_log |= {
            "train/lr": scheduler.get_last_lr()[0],
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
