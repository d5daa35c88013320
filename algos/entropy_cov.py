"""Clip-Cov and KL-Cov: entropy control through the token covariance of log-probability and advantage.

Paper: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
arXiv 2505.22617: the entropy change is driven by Cov(log π, A), and Clip-Cov / KL-Cov restrain it. Code: the authors'
PRIME-RL/Entropy-Mechanism-of-RL and verl's compute_policy_loss_clip_cov / compute_policy_loss_kl_cov
(verl/trainer/ppo/core_algos.py), whose aggregation and defaults this file follows.

For each prompt q, sample a group of G completions o_1..o_G from π_old and score them with a verifier (R_i). Over
the N response tokens of an optimiser mini-batch (every process's share):

    advantage     Â_i = (R_i - mean_j R_j) / (std_j R_j + 1e-6)          GRPO's, the same for every token of o_i
    ratio         r_{i,t} = π_θ(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | q, o_{i,<t})
    covariance    C_{i,t} = (Â_i - mean Â) (log π_old(o_{i,t}) - mean log π_old)      means over the N tokens
    acted on      k = max(int(ratio · N), 1) tokens
    KL-Cov        ℓ_{i,t} = -r_{i,t} Â_i + β_cov |log r_{i,t}| · [C_{i,t} among the k largest]      (no clip)
    Clip-Cov      ℓ_{i,t} = -min(r Â, clip(r, 1-ε, 1+ε) Â) · (1 - [(i,t) among k drawn at random from ω_lo < C < ω_hi])
    objective     L = (1/N) Σ_{i,t} ℓ_{i,t}                                token mean over the mini-batch

Tokens with a large positive covariance (a likely token with a positive advantage, an unlikely one with a negative)
are the ones whose update lowers the entropy. KL-Cov pulls the top-k of them back toward π_old with an L1
penalty on the log-ratio; Clip-Cov removes a random k of the band's tokens from the gradient. KL-Cov is the default:
it scored higher on average in the paper's main table (Qwen2.5-7B: 40.6 against Clip-Cov's 40.4; 32B: 52.2 against
50.3; GRPO 38.6 / 45.8) and verl's own recipes lead with it.

Relative to grpo.py this file changes:
- the per-token loss: KL-Cov (unclipped ratio, |log r| penalty on the top-k covariance tokens, verl) or Clip-Cov
  (the PPO clip at ε = 1 as the recipes, the selected tokens' loss set to 0), by --cov-variant.
- the covariance and the token choice span the whole optimiser mini-batch on every process, from π_old's
  log-probs, so micro-batching and packing do not change the objective (verl: per micro-batch, from π_θ's).
- token-mean aggregation over the mini-batch (verl's token-mean), exact under accumulation and across processes.
- no KL to a reference (β = 0: the recipes' use_kl_loss=False), so no reference model loads.
- 4 optimiser steps per rollout (paper: 256 / 32 = 8): KL-Cov's penalty acts through r, which is 1 before the
  first step; that first step takes π_old as the detached current log-probs, so |log r| is exactly 0 at its kink.
- the tiny default acts on ~2% of each mini-batch's tokens (ratio 2e-2, both variants), not the paper's 0.02-0.2%:
  at 2e-4 the tiny task's ~590 tokens per mini-batch give int(0.12) = 0, floored to 1 token (0.17%, 4 a step);
  2e-2 is the smallest round ratio above 1% (11 tokens). The GPU command keeps the paper's ratio.
The recipes also sample DAPO-style (groups filtered to mixed correctness); that lives in dapo.py and is left out.

CPU, offline (the defaults: the shipped tiny model on the synthetic `arith` task):
    python algos/entropy_cov.py
GPU, the paper's 7B KL-Cov setting (verl's recipe: k = 2e-3 at 7B, 2e-4 at 32B; 256 prompts x 8, 8 mini-batches):
    # planner: fits on 80 GB: 52.7 GB per GPU
    accelerate launch --config_file scripts/accelerate/fsdp2.yaml algos/entropy_cov.py --fsdp \
        --model Qwen/Qwen2.5-7B --dataset dapo17k --template dapo --rollout.backend vllm --rollout.enable-sleep-mode \
        --learning-rate 1e-6 --warmup-steps 0 --max-new-tokens 8192 --prompts-per-step 256 --group-size 8 \
        --num-minibatches 8 --kl-cov-ratio 2e-3 --micro-batch-tokens 16384 --gradient-checkpointing \
        --eval.dataset aime24 --eval.temperature 0.6 --track
Clip-Cov, the same with: --cov-variant clip-cov --clip-cov-ratio 2e-4 (bounds 1 and 5 and ε = 1 are the defaults).
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
    """optimiser steps per epoch over the rollout batch (paper: 256 / 32 = 8; > 1 so KL-Cov's |log r| acts; tiny: 4)"""
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
    # ALGO LOGIC: Clip-Cov / KL-Cov hyperparameters
    cov_variant: Literal["kl-cov", "clip-cov"] = "kl-cov"
    """KL-Cov: |log r| penalty on the top-k covariance tokens; Clip-Cov: drop a random k of the band's tokens"""
    kl_cov_ratio: float = 2e-2
    """KL-Cov's k as a share of the mini-batch's tokens (paper 2e-3 at 7B, 2e-4 at 32B; tiny 2e-2, see above)"""
    kl_cov_coef: float = 1.0
    """β_cov, weight of the |log r| penalty on KL-Cov's tokens (paper and recipes: 1; verl's config default 0.1)"""
    clip_cov_ratio: float = 2e-2
    """Clip-Cov's share of the mini-batch's tokens whose gradient is dropped (paper 2e-4; tiny 2e-2, see above)"""
    clip_cov_lb: float = 1.0
    """ω_low: Clip-Cov draws from tokens with covariance above this (paper and verl: 1)"""
    clip_cov_ub: float = 5.0
    """ω_high: ... and below this (paper and verl: 5)"""
    clip_eps: float = 1.0
    """ε of Clip-Cov's PPO clip, r in [1-ε, 1+ε] (the recipes: clip_ratio_low = high = 1); KL-Cov has no clip"""
    kl_coef: float = 0.0
    """β of an optional k3 KL to a frozen reference (the recipes: none; 0 = no reference model)"""
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


def token_covariance(advantages: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """C = (A - mean A)(log π - mean log π) per token, for flat (N,) vectors of the mini-batch's valid tokens.

    The means are over the N tokens (a sequence weighs by its length, as in verl); C's mean is Cov(A, log π), the
    term the paper finds driving the entropy down while it is positive.
    """
    adv, lp = advantages.float(), logprobs.float()
    return (adv - adv.mean()) * (lp - lp.mean())


def select_tokens(
    cov: torch.Tensor,
    variant: str,
    ratio: float,
    lb: float = 1.0,
    ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The tokens a variant acts on, as a bool mask over flat (N,) covariances; k = max(int(ratio · N), 1) as verl.

    KL-Cov: the k largest covariances. Clip-Cov: k drawn without replacement from the tokens with lb < C < ub (all of
    them when fewer), by a permutation from ``generator`` (a CPU generator: seeded, the draw survives a resume).
    """
    chosen = torch.zeros(cov.shape, dtype=torch.bool, device=cov.device)
    if cov.numel() == 0:
        return chosen
    k = max(int(ratio * cov.numel()), 1)
    if variant == "kl-cov":
        chosen[torch.topk(cov, min(k, cov.numel())).indices] = True
    elif variant == "clip-cov":
        band = torch.nonzero((cov > lb) & (cov < ub)).squeeze(-1)
        draw = torch.randperm(band.numel(), generator=generator).to(cov.device)
        chosen[band[draw[:k]]] = True
    else:
        raise ValueError(f"unknown covariance variant {variant!r}")
    return chosen


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    acted: torch.Tensor | None = None,
    variant: str = "kl-cov",
    clip_eps: float = 1.0,
    kl_cov_coef: float = 1.0,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov or Clip-Cov loss (+ optional β·k3), summed over tokens and divided by ``num_tokens``.

    logprobs (B,T) with grad; old_logprobs, ref_logprobs (B,T) detached; advantages (B,) or (B,T); mask (B,T) 1 on
    generated tokens (EOS included); ``acted`` (B,T) bool, the tokens ``select_tokens`` chose (None: none).
    KL-Cov: -r·A on every token plus kl_cov_coef·|log r| on the acted ones, no clip (verl). Clip-Cov: the PPO-clip
    surrogate with the acted tokens' terms set to 0, so they give no gradient (verl's ``corr``). ``num_tokens`` is
    the token count of the optimiser mini-batch (default: this batch's). ``is_weights`` (B,T) detached: rollout-
    correction weights π_old/μ on the whole per-token policy term, penalty included (verl), not on the k3 KL.
    """
    mask = mask.float()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    acted = torch.zeros_like(mask) if acted is None else acted.float()
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # as verl: keeps exp finite
    ratio = torch.exp(log_ratio)
    if variant == "kl-cov":
        # the gradient of |log r| is sign(log r)·∇log π: 0 at r = 1 exactly, a pull of kl_cov_coef toward π_old after
        per_token = -adv * ratio + kl_cov_coef * log_ratio.abs() * acted
        dropped = torch.zeros_like(mask)
    elif variant == "clip-cov":
        per_token = torch.max(-adv * ratio, -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)) * (1.0 - acted)
        clipped = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
        dropped = torch.maximum(clipped.float(), acted).detach()
    else:
        raise ValueError(f"unknown covariance variant {variant!r}")
    if is_weights is not None:  # the sampler was μ, not π_old: reweight the per-token policy term
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
    with torch.no_grad():  # clip_frac: tokens the surrogate gives no gradient (clipped, or dropped by Clip-Cov)
        metrics["clip_frac"] = ((dropped * mask).sum() / mask.sum().clamp(min=1)).detach()
        metrics["ratio"] = ((ratio * mask).sum() / mask.sum().clamp(min=1)).detach()
    return loss, metrics


def covariance_choice(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    gather,
    variant: str,
    ratio: float,
    lb: float,
    ub: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``select_tokens`` over the whole optimiser mini-batch: this process's rows (advantages (B,), log-probs and mask
    (B,T)) joined to every other process's by ``gather`` ((n, 2) -> every process's rows in rank order, and where this
    process's begin). Returns the acted-on mask (B,T) bool, the same choice on every process, and its counts."""
    valid = mask.bool()
    local = torch.stack([advantages[:, None].expand_as(valid)[valid].float(), logprobs[valid].float()], dim=-1)
    every, offset = gather(local)
    cov = token_covariance(every[:, 0], every[:, 1])
    chosen = select_tokens(cov, variant, ratio, lb, ub, generator)
    acted = torch.zeros_like(valid)
    acted[valid] = chosen[offset : offset + local.shape[0]]
    band = ((cov > lb) & (cov < ub)).sum()
    return acted, {"tokens": cov.numel(), "acted": float(chosen.sum()), "cov": float(cov.sum()), "band": float(band)}


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
    ratio = args.kl_cov_ratio if args.cov_variant == "kl-cov" else args.clip_cov_ratio
    choice_args = (args.cov_variant, ratio, args.clip_cov_lb, args.clip_cov_ub)

    def gather_tokens(local: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every process's rows of ``local`` (n, 2), in rank order, and where this process's rows begin."""
        counts = accelerator.gather(torch.tensor([local.shape[0]], device=device)).tolist()
        every = accelerator.gather(accelerator.pad_across_processes(local, dim=0)).view(run.world, -1, local.shape[1])
        return torch.cat([every[r, :n] for r, n in enumerate(counts)]), sum(counts[: run.rank])

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

        # 6. old log-probs (ALGO LOGIC: always: the covariance needs a whole mini-batch's before its first backward) and
        # reference ones
        t0 = time.time()
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
            old_logprobs = token_logprobs_batched(model, *logprob_args)
            if ref_model is not None:
                ref_logprobs = token_logprobs_batched(ref_model, *logprob_args)
        old_logprobs_s = time.time() - t0

        # 7. update: epochs x minibatches x micro-batches, one optimiser step per minibatch
        t0 = time.time()
        update_stats: dict[str, list[float]] = {}
        minibatch_size = batch_size // args.num_minibatches
        acted_rows = torch.zeros_like(completion_mask, dtype=torch.bool)
        cov_counts: dict[str, float] = {}
        for epoch in range(args.num_epochs):
            generator = torch.Generator().manual_seed(args.seed * 7919 + step * 31 + epoch)
            order = torch.randperm(batch_size, generator=generator).to(device)
            for start in range(0, batch_size, minibatch_size):
                mb_rows, minibatch_loss = order[start : start + minibatch_size], 0.0
                # ALGO LOGIC: covariances from π_old over the whole mini-batch on every process; Clip-Cov's draw is
                # seeded by (seed, step, epoch, mini-batch), the same on every process and after a resume
                draw = torch.Generator().manual_seed(
                    ((args.seed * 1_000_003 + step) * 1009 + epoch) * 1009 + start // minibatch_size
                )
                acted, counts = covariance_choice(
                    advantages[mb_rows],
                    old_logprobs[mb_rows],
                    completion_mask[mb_rows],
                    gather_tokens,
                    *choice_args,
                    draw,
                )
                acted_rows[mb_rows] = acted
                for k, v in counts.items():
                    cov_counts[k] = cov_counts.get(k, 0.0) + v
                num_tokens = max(counts["tokens"], 1) / run.world  # DDP averages gradients: each divides by N / world
                on_policy = epoch == 0 and start == 0  # no update yet: π_θ is π_old, r exactly 1 (|log r| has a kink)
                mb_rows = mb_rows[attention_mask[mb_rows].sum(-1).argsort(stable=True)]  # similar lengths together
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
                            acted=acted_rows[rows],
                            variant=args.cov_variant,
                            clip_eps=args.clip_eps,
                            kl_cov_coef=args.kl_cov_coef,
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
            # ALGO LOGIC: what the covariance mechanism did this step, summed over its optimiser steps (all processes)
            "train/cov_tokens": cov_counts["acted"],
            "train/cov_frac": cov_counts["acted"] / max(cov_counts["tokens"], 1),
            "train/cov_mean": cov_counts["cov"] / max(cov_counts["tokens"], 1),
        } | rollouts.stats
        if args.cov_variant == "clip-cov":
            step_log["train/cov_band_frac"] = cov_counts["band"] / max(cov_counts["tokens"], 1)
        samples = sample_rows(problems, texts, golds, rewards, args.group_size, args.log_samples)
        books.log_step(step + 1, update_stats, step_log, t_step, samples)
        books.end_step(step + 1)

    books.finish(raw_model)


if __name__ == "__main__":
    main()
