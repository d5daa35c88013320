"""MaxRL: Maximum Likelihood Reinforcement Learning (REINFORCE on a truncated log pass-rate).

Paper: Tajwar, Zeng, et al. 2026, "Maximum Likelihood Reinforcement Learning", arXiv 2602.02710 (Sec. 3-4,
Algorithm 1, App. E-F). Official code: github.com/tajwarfahim/maxrl (a verl fork).

RL maximises the pass rate p = p_θ(q); maximum likelihood maximises log p = -Σ_{k>=1} (1-p)^k / k. MaxRL
follows the gradient of its truncation at order N = G (the number of samples per prompt), J^(N) =
-Σ_{k=1..N} (1-p)^k / k, whose gradient Σ_{k<=N} (1/k) ∇pass@k weights each prompt by (1-(1-p)^N)/p ~ 1/p
(GRPO: 1/√(p(1-p)); plain RL: 1). For each prompt q, sample N completions from π_θ and score them (R_i):

    pass rate     r̂ = mean_j R_j = K/N                     K = number of successes among the N samples
    advantage     Â_i = (R_i - r̂) / (r̂ + 1e-6)            binary R: success (N-K)/K, failure -1; K = 0 or N: 0
    surrogate     ℓ_{i,t} = -Â_i · π_θ(t) / sg(π_θ(t))      on-policy REINFORCE (value -Â_i, gradient -Â_i ∇log π_θ(t))
    objective     L = Σ_i Σ_t ℓ_{i,t} / Σ_i |o_i|            token mean over the whole batch

With one update per batch this is Algorithm 1, ĝ = 1/(N r̂) Σ_j (R_j - r̂) ∇log π(o_j) (0 when K = 0), up to
the token-mean weighting; its expectation is ∇J^(N) - (1-p)^(N-1) ∇p (dropping the K = 0 groups costs a bias
that vanishes as N grows).

Relative to grpo.py this file changes:
  - advantages: divided by the group mean pass rate (+1e-6) instead of the std
  - loss: plain on-policy REINFORCE, no clipping; exactly one update per batch (other values are refused)
  - aggregation: token mean over the mini-batch (the normaliser is the mini-batch's token count)
  - group size 16 by default (the truncation order; the paper's Qwen3 runs), no KL (kl_coef = 0)
  - logs the fraction of groups with at least one success (train/frac_solved_groups, the paper's Fig. 7)

CPU, offline (the defaults: the shipped tiny model on the synthetic `arith` task, 16 prompts x 16 samples):
    python algos/maxrl.py
GPU, the paper's Qwen3 setting (Qwen3-1.7B/4B-Base on POLARIS-53K, exported as a jsonl of prompt/answer):
    # planner: not planned (no local config for Qwen/Qwen3-4B-Base)
    accelerate launch --num_processes 8 algos/maxrl.py --model Qwen/Qwen3-4B-Base --dataset jsonl:polaris53k.jsonl \
        --template qwen-math --rollout.backend vllm --learning-rate 1e-6 --max-grad-norm 0.3 --max-new-tokens 4096 \
        --prompts-per-step 256 --group-size 16 --micro-batch-size 8 --total-steps 1000 --eval.dataset aime25 --track
GPU, the paper's small-model setting (SmolLM2-360M-Instruct on GSM8K, 128 samples per prompt):
    # planner: not planned (no local config for HuggingFaceTB/SmolLM2-360M-Instruct)
    accelerate launch --num_processes 8 algos/maxrl.py --model HuggingFaceTB/SmolLM2-360M-Instruct --dataset gsm8k \
        --rollout.backend vllm --learning-rate 1e-5 --max-new-tokens 2048 --prompts-per-step 256 --group-size 128 \
        --micro-batch-size 16 --total-steps 1500 --track
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
    group_size: int = 16
    """completions per prompt (N; MaxRL: 16, its truncation order, as the paper's Qwen3 runs; the gain grows with N)"""
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
    """passes over each rollout batch (MaxRL: must be 1, on-policy REINFORCE with one update per batch)"""
    num_minibatches: int = 1
    """optimiser steps per epoch over the rollout batch (MaxRL: must be 1, as the paper's PPO_MINI_BATCH = batch)"""
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
    # ALGO LOGIC: MaxRL hyperparameters
    adv_eps: float = 1e-6
    """ε in Â = (R - r̂)/(r̂ + ε) (App. F; keep it tiny, a larger ε reweights hard prompts)"""
    kl_coef: float = 0.0
    """β, weight of a k3 KL to the frozen reference (MaxRL uses none, App. E.3: 0 loads no reference model)"""
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
    """MaxRL advantages Â_i = (R_i - r̂) / (r̂ + eps), r̂ = the group's mean reward (its pass rate).

    rewards: (B,) in [0, 1] (success rewards) with prompt i's group in rows i*G .. i*G+G-1. Returns (B,).
    A group with no success, or with every sample correct, gets exactly 0.
    """
    if group_size < 2:
        raise ValueError(f"MaxRL needs group_size >= 2 to form a baseline, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if (rewards < 0).any():
        raise ValueError("MaxRL divides by the mean reward (a pass rate): rewards must be >= 0")
    grouped = rewards.view(-1, group_size).float()
    mean = grouped.mean(dim=1, keepdim=True)
    return ((grouped - mean) / (mean + eps)).view(-1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """MaxRL loss: REINFORCE -Â·π/π_old (+ β·k3), summed over tokens and divided by ``num_tokens``.

    logprobs (B,T) with grad; old_logprobs (B,T) detached (on-policy: logprobs.detach(), so the ratio is 1
    and the gradient is -Â∇log π); advantages (B,) or (B,T); mask (B,T) 1 on generated tokens (EOS
    included). ``num_tokens`` is the optimiser mini-batch's token count (default mask.sum()): passing it
    lets micro-batches accumulate to exactly the mini-batch token mean.
    ``is_weights`` (B,T) detached: rollout-correction weights π_old/μ, on the REINFORCE term only (not the KL).
    """
    valid = mask.bool()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))  # as verl: keeps exp finite
    per_token = -adv * ratio
    if is_weights is not None:  # the sampler was μ, not π_old: reweight the policy-gradient term
        per_token = per_token * is_weights
    metrics = {}
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        delta = ref_logprobs - logprobs
        k3 = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * k3
        metrics["kl"] = masked_mean(k3.detach(), mask)
    loss = torch.where(valid, per_token, 0.0).sum() / (
        num_tokens if num_tokens is not None else valid.sum().clamp(min=1)
    )
    metrics["clip_frac"] = 0.0  # no clipping: one on-policy update per batch
    metrics["ratio"] = masked_mean(ratio.detach(), mask)
    return loss, metrics


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).detach()


def main() -> None:
    args = tyro.cli(Args)
    run = start_run(args)  # flags checked, processes started, precision chosen, run folder claimed, seeded
    if args.max_lag > 1:  # ALGO LOGIC: the estimator is on-policy
        raise SystemExit(
            "--max-lag > 1: not for maxrl.py. Its gradient is the on-policy REINFORCE estimator of the log pass rate, "
            "normalised by each prompt's own sample mean; samples of an older policy bias it, and an importance weight "
            "would reweight the mean it divides by. Use --max-lag 1"
        )
    args.correction = resolve_correction(args.correction, args.rollout)  # 'auto': on when the sampler is not the model
    accelerator, device, autocast = run.accelerator, run.device, run.autocast
    compute_advantages(torch.zeros(2 * args.group_size), args.group_size)  # fail fast on a group size it rejects
    if args.num_minibatches != 1 or args.num_epochs != 1:  # ALGO LOGIC
        raise SystemExit(
            "MaxRL is on-policy REINFORCE with one update per batch: --num-minibatches and --num-epochs must be 1"
        )
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

        # 4. ALGO LOGIC: advantages normalised by the group's pass rate
        advantages = compute_advantages(rewards, args.group_size, eps=args.adv_eps).to(device)

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
                        is_weights, correction_stats = correction_weights(
                            old, rollout_logprobs[rows], completion_mask[rows], args.correction
                        )
                        loss, loss_stats = policy_loss(
                            logprobs,
                            old,
                            advantages[rows],
                            completion_mask[rows],
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
        solved = rewards.view(-1, args.group_size).max(1).values > 0  # ALGO LOGIC: MaxRL Fig. 7
        step_log["train/frac_solved_groups"] = solved.float().mean().item()
        samples = sample_rows(problems, texts, golds, rewards, args.group_size, args.log_samples)
        books.log_step(step + 1, update_stats, step_log, t_step, samples)
        books.end_step(step + 1)

    books.finish(raw_model)


if __name__ == "__main__":
    main()
