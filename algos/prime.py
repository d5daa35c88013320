"""PRIME: Process Reinforcement through IMplicit rEwards.

Paper: Cui et al. 2025, "Process Reinforcement through Implicit Rewards", arXiv 2502.01456 (Algorithm 1, §3), and
its code PRIME-RL/PRIME (training/verl); the implicit PRM is Yuan et al. 2024, arXiv 2412.01981.

Three models: the policy π_θ, the implicit PRM π_φ (a copy of the base model, trained online) and a frozen
reference π_ref (the base model). For each prompt q, sample K completions y^1..y^K and verify them (r_o, correct).

    prompt filter   keep a group only if its accuracy is in [0.2, 0.8]; draw more prompts until the batch is full
    process reward  r_φ(y_t) = β·(log π_φ(y_t | y_<t) - log π_ref(y_t | y_<t))    Σ_t r_φ(y_t) = β·log π_φ(y)/π_ref(y)
                    then r_φ / (max_{i,t} |Σ_{s>=t} r_φ(y^i_s)| + 1e-6), the max over the whole rollout batch (code)
    PRM loss        L_φ = BCE(σ(β Σ_t log π_φ(y_t)/π_ref(y_t)), correct)           mean over sequences, every step
    advantage       A^i_t = Σ_{s>=t} γ^{s-t} [r_φ(y^i_s) - 1/(K-1) Σ_{j≠i} mean_s r_φ(y^j_s)]  LOO on implicit rewards
                          + r_o(y^i) - 1/(K-1) Σ_{j≠i} r_o(y^j)                                     RLOO on the outcome
                    then whitened over every token of the batch (γ = 1)
    policy loss     L = Σ_{i,t} -min(ρ_t A_t, clip(ρ_t, 1-ε, 1+ε) A_t) / Σ_{i,t} 1            PPO clip, token mean

Relative to grpo.py this file changes:
  - a third model: the implicit PRM, a trained copy of the base model with its own AdamW (constant lr), updated every
    step on the current rollouts with the BCE loss above; the reference is always loaded (for the PRM)
  - per-token advantages: leave-one-out returns of the implicit process rewards plus RLOO of the outcome reward, summed
    and batch-whitened (replaces the group z-score); process rewards scaled as PRIME's code (`prime_norm: batch_norm`)
  - online prompt filtering: groups with accuracy outside [0.2, 0.8] are dropped and refilled from the data stream
    for a bounded number of rounds (the surplus is discarded, not buffered as in PRIME's code)
  - token-mean aggregation over the optimiser mini-batch (PRIME's masked_mean) instead of the per-sequence mean
  - no KL by default (kl_coef = 0, as PRIME); logs the PRM loss and its within-group ranking accuracy

CPU, offline (the defaults: the shipped tiny model on the synthetic `arith` task):
    python algos/prime.py
GPU, sharded over two nodes of 8 (PRIME's run script: policy lr 5e-7, PRM lr 1e-6, 256 prompts x 4, 3072 tokens,
4 policy/PRM steps per batch; packed, checkpointed, vLLM asleep during the update; one colocated engine per rank;
the second node runs the same command with --machine_rank 1):
    # planner: fits on 80 GB: 50.5 GB per GPU
    accelerate launch --config_file scripts/accelerate/multi_node.yaml --machine_rank 0 algos/prime.py --fsdp \
        --model PRIME-RL/Eurus-2-7B-SFT --dataset eurus2-rl --template qwen-math --track --rollout.backend vllm \
        --rollout.enable-sleep-mode --learning-rate 5e-7 --prm-learning-rate 1e-6 --warmup-steps 0 --group-size 4 \
        --prompts-per-step 256 --max-new-tokens 3072 --num-minibatches 4 --micro-batch-tokens 8192 \
        --gradient-checkpointing --eval.dataset math500
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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
    """asynchronous RL (batch s sampled by version max(0, s-k+1)): not for PRIME, only 1 (synchronous)"""
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
    # ALGO LOGIC: PRIME hyperparameters
    clip_eps: float = 0.2
    """ε, the PPO clip range of the ratio (PRIME's policy update, clip_ratio 0.2)"""
    kl_coef: float = 0.0
    """weight of a k3 KL to the frozen reference in the loss, as in grpo.py (PRIME: 0)"""
    prm_beta: float = 0.05
    """β in the implicit reward r_φ(y_t) = β·log π_φ(y_t)/π_ref(y_t) and in the PRM's BCE loss (PRIME: 0.05)"""
    prm_learning_rate: float | None = None
    """AdamW learning rate of the implicit PRM, constant (None = 2x --learning-rate, PRIME's 1e-6 PRM vs 5e-7 policy)"""
    prm_double_forward: bool = False
    """recompute the process rewards with the updated PRM ('double forward'; default: the PRM's training forward)"""
    process_reward_norm: Literal["batch_norm", "none"] = "batch_norm"
    """scale r_φ by the batch's largest |reverse cumulative sum| (PRIME's code, prime_norm); 'none' = the paper's r_φ"""
    process_reward_zero_last: bool = False
    """set each response's last-token r_φ to 0, as verl recipe/prime/prime_dp_rm.py does (PRIME's dp_prime.py: kept)"""
    filter_low: float = 0.2
    """keep a prompt's group only if its accuracy is >= this (PRIME: accuracy_lower_bound 0.2)"""
    filter_high: float = 0.8
    """keep a prompt's group only if its accuracy is <= this (PRIME: accuracy_upper_bound 0.8)"""
    filter_max_rounds: int = 4
    """rollout rounds per step to collect enough kept groups; any shortfall is filled with rejected groups"""
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


# ALGO LOGIC: implicit rewards, PRM loss, advantages, prompt filter and loss (the functions tests import)
def implicit_process_rewards(
    prm_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, beta: float = 0.05, zero_last=False
) -> torch.Tensor:
    """Token rewards r_φ(y_t) = β·(log π_φ(y_t|y_<t) - log π_ref(y_t|y_<t)), (B, T), 0 on padding, no gradient.

    ``zero_last``: 0 also on each row's last masked token (verl's recipe; PRIME-RL/PRIME's dp_prime.py keeps it)."""
    m = mask.float() * (mask.float().cumsum(-1) < mask.float().sum(-1, keepdim=True)) if zero_last else mask.float()
    return (beta * (prm_logprobs - ref_logprobs) * m).detach()


def normalize_process_rewards(process_rewards: torch.Tensor, all_reduce_max=None) -> torch.Tensor:
    """PRIME's ``prime_norm: batch_norm``: r_φ / (max over rows and tokens of |Σ_{s>=t} r_φ(y_s)| + 1e-6), (B, T).

    ``all_reduce_max`` takes the max over processes (None = this process), so 1 and N processes scale alike."""
    scale = process_rewards.flip(-1).cumsum(-1).flip(-1).abs().max()
    return process_rewards / ((all_reduce_max(scale) if all_reduce_max else scale) + 1e-6)


def prm_loss(
    prm_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    correct: torch.Tensor,
    beta: float = 0.05,
    num_sequences: int | None = None,
) -> torch.Tensor:
    """Implicit-PRM cross-entropy BCE(σ(β Σ_t (log π_φ - log π_ref)), correct), summed, divided by ``num_sequences``.

    prm_logprobs (B,T) with grad; ref_logprobs (B,T) detached; correct (B,) in {0,1}. ``num_sequences`` is the
    size of the PRM's optimiser mini-batch (default B), so micro-batches accumulate to the mini-batch mean."""
    seq_reward = beta * ((prm_logprobs - ref_logprobs) * mask.float()).sum(-1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(seq_reward, correct.float(), reduction="sum")
    return bce / (num_sequences or prm_logprobs.shape[0])


def prm_ranking_accuracy(seq_rewards: torch.Tensor, correct: torch.Tensor, group_size: int) -> float:
    """PRIME's "DPO accuracy": share of (correct, incorrect) pairs in a group ordered right (ties 1/2, none 0.5)."""
    r, c = seq_rewards.view(-1, group_size, 1), correct.view(-1, group_size, 1).bool()
    pairs = (c & ~c.transpose(1, 2)).float()  # [g, i, j]: i correct, j incorrect
    score = (r > r.transpose(1, 2)).float() + 0.5 * (r == r.transpose(1, 2)).float()
    return ((score * pairs).sum() / pairs.sum()).item() if pairs.sum() > 0 else 0.5


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, all_reduce=None, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries, sample variance (verl's masked_whiten); 0 on padding.

    ``all_reduce`` sums a tensor over processes (None = this process only), so the statistics are the batch's."""
    mask = mask.float()
    reduce = all_reduce or (lambda t: t)
    total, count = reduce(torch.stack([(x * mask).sum(), mask.sum()])).unbind()
    mean = total / count.clamp(min=1)
    var = reduce(((x - mean) ** 2 * mask).sum()) / (count - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def compute_advantages(
    outcome_rewards: torch.Tensor, process_rewards: torch.Tensor, mask: torch.Tensor, group_size: int, all_reduce=None
) -> torch.Tensor:
    """PRIME advantages (B, T): LOO returns of the implicit rewards + RLOO of the outcome reward, batch-whitened.

    outcome_rewards (B,), process_rewards (B,T) (0 on padding), mask (B,T) right-padded; prompt i's group in
    rows i*K .. i*K+K-1. Process: every token reward minus the mean over the group's OTHER responses of their
    mean token reward, then the return Σ_{s>=t} (γ = 1). Outcome: R_i - mean_{j≠i} R_j on the last token, whose
    γ = 1 return is the same at every token. The sum is whitened over all valid tokens (and processes)."""
    if group_size < 2:
        raise ValueError(f"PRIME needs group_size >= 2 to form a leave-one-out baseline, got {group_size}")
    if outcome_rewards.numel() % group_size:
        raise ValueError(f"{outcome_rewards.numel()} rewards do not split into groups of {group_size}")
    mask = mask.float()
    r = outcome_rewards.float().view(-1, group_size)
    outcome = (r - (r.sum(1, keepdim=True) - r) / (group_size - 1)).view(-1, 1)
    q = process_rewards.float() * mask
    mean_q = (q.sum(-1) / mask.sum(-1).clamp(min=1)).view(-1, group_size)
    baseline = ((mean_q.sum(1, keepdim=True) - mean_q) / (group_size - 1)).view(-1, 1)
    process_returns = ((q - baseline) * mask).flip(-1).cumsum(-1).flip(-1)
    return masked_whiten((outcome + process_returns) * mask, mask, all_reduce)


def filter_groups(correct: torch.Tensor, group_size: int, low: float = 0.2, high: float = 0.8) -> torch.Tensor:
    """PRIME's online prompt filter: True for the groups whose accuracy lies in [low, high] (bounds included)."""
    accuracy = correct.float().view(-1, group_size).mean(1)
    return (accuracy >= low - 1e-6) & (accuracy <= high + 1e-6)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PRIME policy loss: clipped surrogate (+ optional β·k3), token mean Σ_{i,t} m·ℓ / ``num_tokens``.

    logprobs (B,T) with grad; old_logprobs, ref_logprobs (B,T) detached; advantages (B,T) or (B,);
    mask (B,T) 1 on generated tokens (EOS included). ``num_tokens`` is the token count of the optimiser
    mini-batch (default: the tokens passed in), so that micro-batches accumulate to exactly the mini-batch loss.
    ``is_weights`` (B,T) detached: rollout-correction weights π_old/μ, on the surrogate only (not the KL; the PRM's
    BCE loss and the implicit rewards never see them)."""
    mask = mask.float()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # as verl: keeps exp finite
    ratio = torch.exp(log_ratio)
    per_token = torch.max(-adv * ratio, -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps))
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
    loss = (per_token * mask).sum() / (num_tokens or mask.sum().clamp(min=1))  # token mean over the mini-batch
    with torch.no_grad():
        clipped = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
        metrics["clip_frac"] = ((clipped.float() * mask).sum() / mask.sum().clamp(min=1)).detach()
        metrics["ratio"] = ((ratio * mask).sum() / mask.sum().clamp(min=1)).detach()
    return loss, metrics


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).detach()


def main() -> None:
    args = tyro.cli(Args)
    run = start_run(args)  # flags checked, processes started, precision chosen, run folder claimed, seeded
    if args.max_lag > 1:  # ALGO LOGIC: PRIME's online filter and implicit PRM are defined on the current policy
        raise SystemExit("--max-lag > 1: not for prime.py; its filter's refill rounds and its PRM are on-policy")
    args.correction = resolve_correction(args.correction, args.rollout)  # 'auto': on when the sampler is not the model
    accelerator, device, autocast = run.accelerator, run.device, run.autocast
    args.prm_learning_rate = args.prm_learning_rate or 2 * args.learning_rate
    k = 2 * args.group_size  # fail fast on a group size the method rejects
    compute_advantages(torch.zeros(k), torch.zeros(k, 1), torch.ones(k, 1), args.group_size)
    batch_size = run.local_prompts * args.group_size  # sequences per process per step
    task = load_task(args)
    tokenizer = load_tokenizer(run.model_path)
    raw_model = load_model(run, gradient_checkpointing=args.gradient_checkpointing, lora=args.lora)
    # ALGO LOGIC: frozen reference (implicit reward's denominator); implicit PRM: the base, own optimiser, constant lr
    ref_model = reference_model(run, raw_model)  # the base model (LoRA: the policy, adapters off)
    raw_prm = load_model(run, gradient_checkpointing=args.gradient_checkpointing)
    prm_optimizer = torch.optim.AdamW(
        raw_prm.parameters(), lr=args.prm_learning_rate, betas=(0.9, args.adam_beta2), weight_decay=args.weight_decay
    )
    prm, prm_optimizer = run.prepare(raw_prm, prm_optimizer)
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
        run,
        args,
        tokenizer,
        task,
        engine,
        {
            "model": raw_model,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "prm": raw_prm,
            "prm_optimizer": prm_optimizer,
        },
    )

    for step in books.steps():
        t_step = time.time()
        # ALGO LOGIC: steps 1-3 run in rounds (PRIME's online prompt filter): each round takes the next
        # prompts_per_step prompts of the stream and keeps the groups with accuracy in [filter_low, filter_high], until
        # every process holds local_prompts kept groups or filter_max_rounds is reached (rejected groups fill the rest)
        kept, rejected, rounds, rollout_s, reward_s = [], [], 0, 0.0, 0.0
        while True:
            # 1. prompts for this round: this process's share of the seeded, resumable stream
            problems, prompt_ids = books.next_prompts()

            # 2. rollout: G samples per prompt from the current policy
            t0 = time.time()
            engine.wake()
            # one seed per prompt from its global position in the stream (grpo.py's seeds when no round is refilled)
            first_prompt = args.seed * 1_000_003 * args.prompts_per_step + books.cursor - args.prompts_per_step
            first_prompt += run.rank * run.local_prompts
            seeds = [(first_prompt + i) * args.group_size for i in range(run.local_prompts)]
            completions = engine.generate(
                prompt_ids, args.group_size, args.max_new_tokens, args.temperature, args.top_p, seeds, stop=task.stop
            )
            engine.sleep()
            rollout_s += time.time() - t0

            # 3. rewards from the verifier
            t0 = time.time()
            texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
            golds = [p["answer"] for p in problems for _ in range(args.group_size)]
            outputs = compute_rewards(task.train_info.reward_fn, texts, golds)
            reward_s += time.time() - t0
            keep = filter_groups(
                torch.tensor([float(o.correct) for o in outputs]), args.group_size, args.filter_low, args.filter_high
            )
            for g in range(run.local_prompts):
                rows = slice(g * args.group_size, (g + 1) * args.group_size)
                group = (problems[g], prompt_ids[g], completions[rows], texts[rows], golds[rows], outputs[rows])
                (kept if keep[g] else rejected).append(group)
            rounds += 1
            short = torch.tensor(float(len(kept) < run.local_prompts), device=device)
            if rounds >= args.filter_max_rounds or accelerator.reduce(short, "sum").item() == 0:
                break
        shortfall = max(0, run.local_prompts - len(kept))
        groups = (kept + rejected)[: run.local_prompts]  # kept groups first; the surplus is discarded
        problems, prompt_ids = [g[0] for g in groups], [g[1] for g in groups]
        completions, texts, golds, outputs = ([x for g in groups for x in g[k]] for k in (2, 3, 4, 5))
        rewards = torch.tensor([o.reward for o in outputs], dtype=torch.float32)
        correct = torch.tensor([o.correct for o in outputs], dtype=torch.float32)

        # 4. ALGO LOGIC: the advantages need the implicit PRM's rewards (step 6b)

        # 5. tensors: [left-padded prompt | right-padded completion]
        input_ids, attention_mask, completion_mask, rollout_logprobs = pack_rollout(
            prompt_ids, completions, args.group_size, tokenizer.pad_token_id, device
        )
        completion_width, correct = completion_mask.shape[1], correct.to(device)

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
            ref_logprobs = token_logprobs_batched(ref_model, *logprob_args)
        old_logprobs_s = time.time() - t0

        # 6b. ALGO LOGIC: implicit PRM update on this batch, one optimiser step per mini-batch; the process rewards come
        # from the same forward pass, before the step (PRIME's single forward), or after it with --prm-double-forward.
        # The PRM and the reference score at the sampling temperature, like every log-prob here (PRIME: 1)
        t0 = time.time()
        prm_logprobs, prm_losses = torch.zeros_like(ref_logprobs), []
        prm_minibatch_size = batch_size // args.num_minibatches
        for start in range(0, batch_size, prm_minibatch_size):
            prm_losses.append(0.0)
            prm_rows = torch.arange(start, start + prm_minibatch_size, device=device)
            for rows, sync in micro_batches(prm_rows, attention_mask, args.micro_batch_size, args.micro_batch_tokens):
                with accelerator.no_sync(prm) if not sync else contextlib.nullcontext():
                    with autocast():
                        lp, _ = token_logprobs(
                            prm,
                            input_ids[rows],
                            attention_mask[rows],
                            completion_width,
                            args.temperature,
                            fp32_head=run.fp32_head,
                            packed=args.micro_batch_tokens > 0,
                        )
                    loss = prm_loss(
                        lp, ref_logprobs[rows], completion_mask[rows], correct[rows], args.prm_beta, prm_minibatch_size
                    )
                    accelerator.backward(loss)
                prm_logprobs[rows], prm_losses[-1] = lp.detach(), prm_losses[-1] + loss.detach().double()
            prm_grad_norm = accelerator.clip_grad_norm_(prm.parameters(), args.max_grad_norm)
            if math.isfinite(float(prm_grad_norm)) and math.isfinite(prm_losses[-1]):
                prm_optimizer.step()
            prm_optimizer.zero_grad(set_to_none=True)
        if args.prm_double_forward:
            with torch.no_grad(), autocast():
                prm_logprobs = token_logprobs_batched(prm, *logprob_args)
        process_rewards = implicit_process_rewards(
            prm_logprobs, ref_logprobs, completion_mask, args.prm_beta, args.process_reward_zero_last
        )
        if args.process_reward_norm == "batch_norm":  # the scale of PRIME's code, over the batch of every process
            process_rewards = normalize_process_rewards(process_rewards, lambda t: accelerator.gather(t[None]).max())
        advantages = compute_advantages(
            rewards.to(device),
            process_rewards,
            completion_mask,
            args.group_size,
            lambda t: accelerator.reduce(t, "sum"),
        )
        prm_s = time.time() - t0

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
                num_tokens = accelerator.reduce(completion_mask[mb_rows].sum(), "sum").item() / run.world
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
                            clip_eps=args.clip_eps,
                            kl_coef=args.kl_coef,
                            ref_logprobs=ref_logprobs[rows],
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

        # 8. push the new weights into the rollout engine
        t0 = time.time()
        engine.update_weights(raw_model)
        weight_sync_s = time.time() - t0

        # 9. log, then evaluate and checkpoint on their cadence
        step_log = rollout_stats(rewards, correct, completion_mask, completions, args.group_size)
        step_log |= {
            "train/lr": scheduler.get_last_lr()[0],
            "train/prm_loss": sum(prm_losses) / len(prm_losses),
            "train/prm_rank_acc": prm_ranking_accuracy(process_rewards.sum(-1), correct, args.group_size),
            "train/process_reward": process_rewards.sum(-1).mean().item(),
            "train/rollout_accuracy": sum(o.correct for g in kept + rejected for o in g[5])
            / ((len(kept) + len(rejected)) * args.group_size),
            "train/filter_rounds": float(rounds),
            "train/filter_kept_frac": len(kept) / (rounds * run.local_prompts),
            "train/filter_shortfall": float(shortfall),
            "time/rollout_s": rollout_s,
            "time/reward_s": reward_s,
            "time/old_logprobs_s": old_logprobs_s,
            "time/train_s": train_s,
            "time/prm_s": prm_s,
            "time/weight_sync_s": weight_sync_s,
            "time/tokens_per_s": float(completion_mask.sum()) / max(rollout_s, 1e-9),
            "time/train_tokens_per_s": float(attention_mask.sum()) * args.num_epochs / max(train_s, 1e-9),
        }
        samples = sample_rows(problems, texts, golds, rewards, args.group_size, args.log_samples)
        books.log_step(step + 1, update_stats, step_log, t_step, samples)
        books.end_step(step + 1)

    books.finish(raw_model)


if __name__ == "__main__":
    main()
