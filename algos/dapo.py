"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization.

Paper: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476
(§3.1-3.4, objective eq. 8, soft overlong punishment eq. 13, Algorithm 1).

For each prompt q, sample a group of G completions o_1..o_G from π_old and score them with a verifier.

    reward        R_i = (+1 if o_i is correct else -1) + R_length(|o_i|)                             eq. 7 + eq. 13
    overlong      R_length(y) = 0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache up to L_max; -1 beyond
    dynamic samp. keep only groups with 0 < #correct < G; resample until the batch is full           eq. 11, §3.2
    advantage     Â_i = (R_i - mean_j R_j) / (std_j R_j + 1e-6)          sample std, same for every token of o_i
    ratio         r_{i,t} = π_θ(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | q, o_{i,<t})
    surrogate     ℓ_{i,t} = -min(r_{i,t} Â_i, clip(r_{i,t}, 1-ε_low, 1+ε_high) Â_i)             ε_low 0.2, ε_high 0.28
    objective     L = (1 / Σ_i |o_i|) Σ_i Σ_t ℓ_{i,t}                        token mean over the whole mini-batch

Relative to grpo.py this file changes:
- clip-higher: separate clip bounds ε_low = 0.2 and ε_high = 0.28 (§3.1); no KL and no reference model (§2.3).
- token-level loss (§3.3): one token mean over the optimiser mini-batch, exact under gradient accumulation and
  across processes (the token count is summed over ranks before DDP averages the gradients).
- dynamic sampling (§3.2): rollouts come in rounds; only groups whose correctness is mixed are kept, until
  prompts_per_step groups are kept (surplus discarded) or max_sampling_rounds is reached.
- rewards ±1 from the verifier's correctness plus the soft overlong punishment (§3.4, eq. 13), added before the
  group normalisation; overlong filtering (truncated samples get no loss) behind --overlong-filtering.
- 4 optimiser steps per rollout by default (the paper: 16), so the ratio leaves 1 and clip-higher acts.

CPU, offline (the defaults: the shipped tiny model on the synthetic `arith` task):
    python algos/dapo.py
GPU, the paper's setting (§4.1: lr 1e-6, warm-up 20 rollout steps = 320 optimiser steps, 512 prompts x G=16,
mini-batches of 512 responses = 16 updates per rollout, max 20480 tokens incl. a 4096-token cache, avg@32 at top-p 0.7).
Not run. 32B needs several nodes (docs/gpu.md, "Rollout servers"): 16 nodes of 8 H200 (141 GB), verl's scale. Nodes
9-16 each run one rollout server (tensor parallel 8; SERVERS holds their 8 URLs, comma-separated), nodes 1-8 the
trainer, 64 processes sharded with --fsdp (the same command with --machine_rank 1 to 7). On 80 GB cards bf16
autocast's weight copies (65.5 GB per GPU) leave the trainer no room: docs/dapo.md gives the fp32 alternative.
    python scripts/serve_rollout.py --model Qwen/Qwen2.5-32B --tp 8 --host 10.0.0.9 --port 8000 --max-model-len 20992
    # planner: fits on 141 GB: 125.1 GB per GPU
    accelerate launch --config_file scripts/accelerate/multi_node.yaml --num_machines 8 --num_processes 64 \
        --machine_rank 0 algos/dapo.py --fsdp --model Qwen/Qwen2.5-32B --dataset dapo17k --template dapo \
        --rollout.backend vllm-server --rollout.server-urls "$SERVERS" --rollout.server-tensor-parallel 8 \
        --learning-rate 1e-6 --warmup-steps 320 --max-new-tokens 20480 --prompts-per-step 512 --group-size 16 \
        --num-minibatches 16 --micro-batch-tokens 20992 --gradient-checkpointing --eval.dataset aime24 --eval.n 32 \
        --eval.top-p 0.7 --track
Smaller GPU run (one process; Qwen2.5-Math-1.5B has a 4096-token context):
    # planner: fits on 80 GB: 59.9 GB per GPU
    python algos/dapo.py --model Qwen/Qwen2.5-Math-1.5B --dataset math --template qwen-math --rollout.backend vllm \
        --learning-rate 1e-6 --max-new-tokens 3000 --prompts-per-step 128 --group-size 8 --num-minibatches 4 \
        --micro-batch-tokens 8192 --gradient-checkpointing --eval.dataset math500 --track
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
    num_minibatches: int = 4
    """optimiser steps per epoch over the rollout batch (DAPO §4.1: 16; > 1: later ones off-policy, clip-higher acts)"""
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
    # ALGO LOGIC: DAPO hyperparameters
    clip_eps_low: float = 0.2
    """ε_low, lower clip range of the ratio (DAPO eq. 8, §3.1 clip-higher)"""
    clip_eps_high: float = 0.28
    """ε_high, upper clip range of the ratio (DAPO eq. 8, §3.1 clip-higher)"""
    dynamic_sampling: bool = True
    """False: one round, every group kept (the paper's ablation: all-equal groups train with zero advantage)"""
    max_sampling_rounds: int = 4
    """dynamic sampling (DAPO §3.2, eq. 11): at most this many generation rounds per step (verl: max_num_gen_batches)"""
    overlong_cache_frac: float = 0.2
    """L_cache of the soft overlong punishment (DAPO eq. 13), fraction of max_new_tokens (paper 4096/20480; 0 = off)"""
    overlong_filtering: bool = False
    """overlong filtering (DAPO §3.4): truncated samples get zero loss weight and leave the token count"""
    kl_coef: float = 0.0
    """β of an optional k3 KL to a frozen reference; DAPO removes the KL (§2.3), so 0 = no reference model"""
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


# ALGO LOGIC: rewards, group filter, advantages and loss (the functions tests import)
def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, cache_len: int) -> torch.Tensor:
    """Soft overlong punishment R_length (DAPO eq. 13), with L_max = max_new_tokens and L_cache = cache_len.

    0 up to L_max - L_cache tokens, then linear down to -1 at L_max, and -1 beyond. lengths: (B,) completion
    lengths in tokens (EOS included). Returns (B,) floats in [-1, 0]. cache_len <= 0 turns the ramp off.
    """
    lengths = lengths.float()
    if cache_len <= 0:
        return torch.where(lengths > max_new_tokens, -1.0, 0.0)
    return ((max_new_tokens - cache_len - lengths) / cache_len).clamp(min=-1.0, max=0.0)


def filter_groups(correct: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic-sampling filter (DAPO eq. 11): keep a group iff 0 < #correct < G.

    correct: (B,) correctness flags (not the shaped reward: with the overlong penalty an all-wrong group can
    have unequal rewards and must still go). Returns a (B // G,) bool keep-mask, one entry per group.
    """
    if correct.numel() % group_size:
        raise ValueError(f"{correct.numel()} samples do not split into groups of {group_size}")
    num_correct = (correct.view(-1, group_size) > 0).sum(dim=1)
    return (num_correct > 0) & (num_correct < group_size)


def overlong_filter(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Overlong filtering (DAPO §3.4): zero the loss mask of truncated samples (B,) so they get no gradient
    and leave the token-mean normaliser. mask (B,T); returns a new (B,T) mask."""
    return mask * ~truncated.bool()[:, None]


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
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO loss: clip-higher surrogate (+ optional β·k3), summed over tokens and divided by ``num_tokens``.

    logprobs (B,T) with grad; old_logprobs, ref_logprobs (B,T) detached; advantages (B,) or (B,T);
    mask (B,T) 1 on generated tokens (EOS included). ``num_tokens`` is the token count of the optimiser
    mini-batch (default: this batch's): passing it lets micro-batches accumulate to exactly the token mean.
    ``is_weights`` (B,T) detached: rollout-correction weights π_old/μ, on the surrogate only (not the KL).
    """
    mask = mask.float()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # as verl: keeps exp finite
    ratio = torch.exp(log_ratio)
    per_token = torch.max(-adv * ratio, -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high))
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
    with torch.no_grad():
        clipped_high, clipped_low = (adv > 0) & (ratio > 1 + clip_eps_high), (adv < 0) & (ratio < 1 - clip_eps_low)
        metrics["clip_frac"] = (((clipped_high | clipped_low).float() * mask).sum() / mask.sum().clamp(min=1)).detach()
        metrics["clip_frac_high"] = ((clipped_high.float() * mask).sum() / mask.sum().clamp(min=1)).detach()
        metrics["clip_frac_low"] = ((clipped_low.float() * mask).sum() / mask.sum().clamp(min=1)).detach()
        metrics["ratio"] = ((ratio * mask).sum() / mask.sum().clamp(min=1)).detach()
    return loss, metrics


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

    def sample(step: int, round_idx: int = 0):
        """Round ``round_idx`` of batch ``step``: this process's share of the seeded, resumable prompt stream, and G
        samples per prompt."""
        problems, prompt_ids = books.next_prompts()
        # one seed per prompt from its global position (step, round, prompt): the same samples on any number of
        # processes and after a resume
        first_prompt = ((args.seed * 1_000_003 + step) * args.max_sampling_rounds + round_idx) * args.prompts_per_step
        first_prompt += run.rank * run.local_prompts
        seeds = [(first_prompt + i) * args.group_size for i in range(run.local_prompts)]
        request = rollouts.request(
            prompt_ids, args.group_size, args.max_new_tokens, args.temperature, args.top_p, seeds, stop=task.stop
        )
        return problems, prompt_ids, request

    # batch s comes from policy version max(0, s - max_lag + 1); rollout servers sample it while the trainer trains
    rollouts = LaggedRollouts(books, engine, sample, args.max_lag)

    for step in books.steps():
        t_step = time.time()
        # ALGO LOGIC: dynamic sampling (DAPO §3.2): steps 1-3 run in rounds; only groups whose correctness is mixed
        # (0 < #correct < G) are kept, until local_prompts groups are kept on every rank or max_sampling_rounds is hit
        problems, prompt_ids, completions, texts, golds, rewards, correct = [], [], [], [], [], [], []
        rollout_s, reward_s, sampled_correct, sampled_tokens = 0.0, 0.0, [], 0
        for round_idx in range(args.max_sampling_rounds if args.dynamic_sampling else 1):
            # 1-2. this round's prompts and rollouts: round 0 requested --max-lag - 1 steps ago, refills sampled now
            t0 = time.time()
            if round_idx == 0:
                round_problems, round_prompt_ids, round_completions = rollouts.take(step)
            else:
                round_problems, round_prompt_ids, request = sample(step, round_idx)
                round_completions = rollouts.collect(request)
            rollout_s += time.time() - t0

            # 3. rewards: ±1 from the verifier's correctness (eq. 7) plus the soft overlong punishment (eq. 13)
            t0 = time.time()
            round_texts = tokenizer.batch_decode([c.token_ids for c in round_completions], skip_special_tokens=True)
            round_golds = [p["answer"] for p in round_problems for _ in range(args.group_size)]
            outputs = compute_rewards(task.train_info.reward_fn, round_texts, round_golds)
            round_correct = torch.tensor([o.correct for o in outputs], dtype=torch.float32)
            # |y| counts the model's own tokens: a tool loop's observations are not sampled
            round_lengths = torch.tensor([len(c.token_ids) - sum(c.observation_mask or ()) for c in round_completions])
            cache_len = round(args.overlong_cache_frac * args.max_new_tokens)
            round_rewards = 2 * round_correct - 1 + overlong_penalty(round_lengths, args.max_new_tokens, cache_len)
            reward_s += time.time() - t0

            # keep whole groups by correctness (never by the shaped reward); every rank runs the same rounds
            sampled_correct.append(round_correct)
            sampled_tokens += int(round_lengths.sum())
            keep = filter_groups(round_correct, args.group_size)
            if not args.dynamic_sampling:  # the ablation: every group goes into the batch
                keep = torch.ones_like(keep)
            for g in keep.nonzero().flatten().tolist():
                rows = slice(g * args.group_size, (g + 1) * args.group_size)
                problems.append(round_problems[g])
                prompt_ids.append(round_prompt_ids[g])
                completions += round_completions[rows]
                texts += round_texts[rows]
                golds += round_golds[rows]
                rewards.append(round_rewards[rows])
                correct.append(round_correct[rows])
            fewest_kept = int(accelerator.gather(torch.tensor([len(problems)], device=device)).min())
            if fewest_kept >= run.local_prompts:
                break
        sampling_rounds, kept_frac = round_idx + 1, len(problems) / ((round_idx + 1) * run.local_prompts)
        if fewest_kept == 0:  # no group to learn from: every sampled group was all-correct or all-wrong
            raise SystemExit(
                f"step {step + 1}: dynamic sampling kept no group with mixed correctness in {sampling_rounds} rounds; "
                "the task is too easy or too hard for this policy (or raise --max-sampling-rounds)"
            )
        if (
            fewest_kept < run.local_prompts and run.is_main
        ):  # train on what was kept: fewer groups, same exact token mean
            books.progress.write(
                f"WARNING step {step + 1}: dynamic sampling kept {fewest_kept} of {run.local_prompts} groups per "
                f"process after {sampling_rounds} rounds; training on a smaller batch",
                file=sys.stderr,
            )
        # trim to the same number of groups on every process; the surplus of the last round is discarded
        num_groups = min(fewest_kept, run.local_prompts)
        batch_size = num_groups * args.group_size
        problems, prompt_ids, completions = problems[:num_groups], prompt_ids[:num_groups], completions[:batch_size]
        texts, golds = texts[:batch_size], golds[:batch_size]
        rewards, correct = torch.cat(rewards)[:batch_size], torch.cat(correct)[:batch_size]
        rollouts.stats |= rollouts.lag_stats(step, completions)  # the kept groups (refills sampled now: lag 0)

        # 4. ALGO LOGIC: group-relative advantages
        advantages = compute_advantages(rewards, args.group_size).to(device)

        # 5. tensors: [left-padded prompt | right-padded completion]
        input_ids, attention_mask, completion_mask, rollout_logprobs = pack_rollout(
            prompt_ids, completions, args.group_size, tokenizer.pad_token_id, device
        )
        completion_width = completion_mask.shape[1]
        # ALGO LOGIC: overlong filtering (DAPO §3.4, off by default): truncated samples get no loss and no token count
        truncated = torch.tensor([c.finish_reason == "length" for c in completions], device=device)
        loss_mask = overlong_filter(completion_mask, truncated) if args.overlong_filtering else completion_mask

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
        # ceil: a short batch (dynamic sampling) may split unevenly
        minibatch_size = -(-batch_size // args.num_minibatches)
        for epoch in range(args.num_epochs):
            generator = torch.Generator().manual_seed(args.seed * 7919 + step * 31 + epoch)
            order = torch.randperm(batch_size, generator=generator).to(device)
            for start in range(0, batch_size, minibatch_size):
                mb_rows, minibatch_loss = order[start : start + minibatch_size], 0.0
                mb_rows = mb_rows[attention_mask[mb_rows].sum(-1).argsort(stable=True)]  # similar lengths together
                # ALGO LOGIC: token-mean denominator = the mini-batch's tokens summed over processes; DDP averages the
                # gradients over processes, so each divides by (global count / world): the global token mean
                num_tokens = max(float(accelerator.reduce(loss_mask[mb_rows].sum(), "sum")), 1.0) / run.world
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
                        # rollout_logprobs come from the kept, trimmed completions: row for row with the batch
                        is_weights, correction_stats = correction_weights(
                            old, rollout_logprobs[rows], loss_mask[rows], args.correction
                        )
                        loss, loss_stats = policy_loss(
                            logprobs,
                            old,
                            advantages[rows],
                            loss_mask[rows],
                            clip_eps_low=args.clip_eps_low,
                            clip_eps_high=args.clip_eps_high,
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
            "train/sampling_rounds": sampling_rounds,  # ALGO LOGIC: dynamic sampling diagnostics
            "train/kept_frac": kept_frac,  # fraction of the generated groups with mixed correctness
            "train/batch_fill": num_groups / run.local_prompts,  # < 1 when max_sampling_rounds ran out
            # groups that carry a gradient (mixed correctness) per prompts_per_step share: the batch DAPO keeps full
            "train/effective_batch": float((correct.view(-1, args.group_size).std(1) > 0).sum()) / run.local_prompts,
            "train/sampled_accuracy": torch.cat(sampled_correct).mean().item(),  # over every sample generated this step
            "time/rollout_s": rollout_s,
            "time/reward_s": reward_s,
            "time/old_logprobs_s": old_logprobs_s,
            "time/train_s": train_s,
            "time/weight_sync_s": weight_sync_s,
            "time/tokens_per_s": float(sampled_tokens)
            / max(rollout_s, 1e-9),  # every round's tokens (engine throughput)
            "time/train_tokens_per_s": float(attention_mask.sum()) * args.num_epochs / max(train_s, 1e-9),
        } | rollouts.stats
        samples = sample_rows(problems, texts, golds, rewards, args.group_size, args.log_samples)
        books.log_step(step + 1, update_stats, step_log, t_step, samples)
        books.end_step(step + 1)

    books.finish(raw_model)


if __name__ == "__main__":
    main()
