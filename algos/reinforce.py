"""REINFORCE with a baseline, and REINFORCE++ (its -baseline variant and the full estimator).

Papers: Williams 1992, "Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement
Learning", Machine Learning 8:229-256 (REINFORCE; a baseline from a running average of past rewards); Hu, Liu, Xu,
Shen 2025, "REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global Advantage Normalization", arXiv
2501.03262 (REINFORCE++ and REINFORCE++-baseline, as verl's compute_reinforce_plus_plus_* functions build them).

For each prompt q, sample G completions o_i from π_old and score them with a verifier (R_i). k1_t = log π_old(o_t) -
log π_ref(o_t) is the KL in the reward (β = 0, no reference model, unless --baseline rpp-kl or --kl-coef > 0).

    score         S_i = R_i - β Σ_t k1_{i,t}                                        no gradient through the penalty
    ema (default) A_i = S_i - b_s,  b_s = α b_{s-1} + (1-α) mean_batch(S)            b_s from earlier batches only
    batch         A_i = S_i - mean_batch(S)
    rpp           A_{i,t} = whiten(S_i - mean_group(S))                              REINFORCE++-baseline
    rpp-kl        r_t = R_i [t = |o_i|] - β k1_t,  G_t = Σ_{k>=t} γ^(k-t) r_k,  A_{i,t} = whiten(G_t)   REINFORCE++
    whiten        (x - mean) / sqrt(var + 1e-8) over every completion token of the batch, Bessel variance (verl)
    ratio         ρ_t = π_θ(o_t | q, o_<t) / π_old(o_t | q, o_<t)
    ema, batch    L = (1/B) Σ_i (1/|o_i|) Σ_t -ρ_t A_i                   no clip, sample average (the surveys' row)
    rpp, rpp-kl   L = Σ_{i,t} -min(ρ_t A, clip(ρ_t, 1-ε, 1+ε) A) / Σ_{i,t} 1            PPO clip, token mean

On-policy (the default: one optimiser step per rollout) ρ = 1 and the ema/batch gradient is REINFORCE's,
-(1/B) Σ_i A_i (1/|o_i|) Σ_t ∇log π_θ. The default baseline is the EMA, the running-average baseline of
REINFORCE: it is built from earlier batches only, so it never holds a sample's own reward (the batch mean does, with
weight 1/B). REINFORCE++ puts k1 in the reward per token with γ = 1, as verl's defaults (algorithm.kl_penalty: kl,
algorithm.gamma: 1.0) and OpenRLHF's (--algo.kl.estimator k1, --algo.advantage.gamma 1) do; β = 0.001 is verl's.

Relative to grpo.py this file changes:
  - advantages: --baseline ema (a checkpointed EMA of the batch-mean score) or batch (this batch's mean), no std;
    rpp (group mean, then whitened over the batch's tokens); rpp-kl (discounted token returns, whitened)
  - KL: k1 on π_old in the reward (summed into the score; per token for rpp-kl) instead of k3 in the loss
  - loss: ema/batch have no clip and keep the sample average; rpp/rpp-kl keep the clip with a token mean
  - state: the EMA baseline is saved in every checkpoint and restored by --resume

CPU, offline (the defaults: the shipped tiny model on the synthetic `arith` task, ~1 s per step):
    python algos/reinforce.py
GPU, one process (REINFORCE with the EMA baseline; set the learning rate and token budget for the model):
    # planner: fits on 80 GB: 59.9 GB per GPU
    python algos/reinforce.py --model Qwen/Qwen2.5-Math-1.5B --dataset math --template qwen-math \
        --rollout.backend vllm --learning-rate 1e-6 --max-new-tokens 3000 --prompts-per-step 128 --group-size 8 \
        --micro-batch-tokens 8192 --gradient-checkpointing --eval.dataset math500 --track
GPU, two nodes of 8 (REINFORCE++ as verl's run_qwen2-7b_math_rf.sh: 1024 prompts x 8, 1024 tokens, lr 3e-6, one
optimiser step per rollout, k1 in the reward with β 0.001; the second node runs it with --machine_rank 1):
    # planner: fits on 80 GB: 74.7 GB per GPU
    accelerate launch --config_file scripts/accelerate/multi_node.yaml --machine_rank 0 algos/reinforce.py --fsdp \
        --baseline rpp-kl --model Qwen/Qwen2.5-7B --dataset math --template qwen-math --rollout.backend vllm \
        --learning-rate 3e-6 --max-new-tokens 1024 --prompts-per-step 1024 --group-size 8 \
        --micro-batch-tokens 16384 --gradient-checkpointing --eval.dataset math500 --track
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
    # ALGO LOGIC: REINFORCE / REINFORCE++ hyperparameters
    baseline: Literal["ema", "batch", "rpp", "rpp-kl"] = "ema"
    """ema / batch: R - EMA or batch mean, no clip (REINFORCE); rpp: REINFORCE++-baseline; rpp-kl: REINFORCE++"""
    ema_decay: float = 0.9
    """α of --baseline ema: b <- α b + (1-α) mean of the batch's scores"""
    kl_coef: float | None = None
    """β of the k1 KL (log π_old - log π_ref) in the reward (None = 0.001 for rpp-kl, verl's kl_coef; else 0)"""
    gamma: float = 1.0
    """γ of REINFORCE++'s discounted token returns (rpp-kl; verl's algorithm.gamma, 1.0)"""
    clip_eps: float = 0.2
    """ε, the PPO clip range of the ratio for rpp and rpp-kl (ema and batch do not clip)"""
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

    def __post_init__(self):  # ALGO LOGIC: REINFORCE++ proper has its KL on by default (the planner reads β too)
        if self.kl_coef is None:
            self.kl_coef = 0.001 if self.baseline == "rpp-kl" else 0.0


# ALGO LOGIC: rewards, baselines, returns, whitening and the loss (the functions tests import)
def token_rewards(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float = 0.0,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token rewards (B, T): R_i on the last completion token, minus β·k1 = β·(log π_old - log π_ref) on every one.

    rewards (B,); mask (B, T) right-padded, 1 on generated tokens (EOS included); 0 on padding. Their sum over a row
    is the score S_i = R_i - β Σ_t k1_t. The log-probs are detached: the KL reaches the policy through A alone."""
    mask = mask.float()
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0]), last] = rewards.float() * (mask.sum(-1) > 0)
    if kl_coef > 0:
        if old_logprobs is None or ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs old_logprobs and ref_logprobs")
        out = out - kl_coef * (old_logprobs - ref_logprobs).detach() * mask
    return out


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = Σ_{k>=t} γ^(k-t) r_k within each row (verl's compute_reinforce_plus_plus_outcome_advantage before its
    whitening); 0 on padding, and nothing carries over from a padded position."""
    mask = mask.float()
    rewards, returns = token_rewards.float() * mask, torch.zeros_like(mask)
    running = torch.zeros_like(mask[:, 0])
    for t in reversed(range(mask.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        returns[:, t] = running
    return returns


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, all_reduce=None, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries, Bessel-corrected variance (verl's masked_whiten); 0 on
    padding. ``all_reduce`` sums a tensor over processes (None = this process only): the batch's statistics."""
    mask = mask.float()
    reduce = all_reduce or (lambda t: t)
    total, count = reduce(torch.stack([(x * mask).sum(), mask.sum()])).unbind()
    mean = total / count.clamp(min=1)
    var = reduce(((x - mean) ** 2 * mask).sum()) / (count - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def batch_mean(x: torch.Tensor, all_reduce=None) -> float:
    """Mean of ``x`` (B,) over the whole batch, every process's rows (``all_reduce`` sums over processes)."""
    total, count = (all_reduce or (lambda t: t))(torch.stack([x.float().sum(), x.new_tensor(float(x.numel()))]))
    return (total / count).item()


class RewardEMA:
    """The EMA baseline: b <- α b + (1-α) m after each batch (m its mean score); the first batch's m starts it.

    Checkpointed with the run (``state_dict`` / ``load_state_dict``), so a resumed run subtracts the same b."""

    def __init__(self, decay: float) -> None:
        self.decay, self.value, self.count = decay, 0.0, 0

    def baseline(self, mean: float) -> float:
        """This batch's b: the EMA of the earlier batches, or the batch's own mean m before there are any."""
        return self.value if self.count else mean

    def update(self, mean: float) -> None:
        self.value = mean if self.count == 0 else self.decay * self.value + (1 - self.decay) * mean
        self.count += 1

    def state_dict(self) -> dict:
        return {"value": self.value, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.count = float(state["value"]), int(state["count"])


def compute_advantages(
    scores: torch.Tensor,
    group_size: int,
    baseline: str = "ema",
    baseline_value: float | None = None,
    mask: torch.Tensor | None = None,
    all_reduce=None,
) -> torch.Tensor:
    """Advantages from the scores S (B,) (rewards, KL-penalised when β > 0), grouped contiguously by prompt.

    ema: S - ``baseline_value``, the EMA's b (B,); batch: S - the batch's mean (B,) over every process's rows
    (``baseline_value`` when given, else computed); rpp: S minus its group's mean, broadcast over the completion
    ``mask`` (B, T) and whitened over the batch's tokens (B, T)."""
    if scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} rewards do not split into groups of {group_size}")
    scores = scores.float()
    if baseline == "ema":
        if baseline_value is None:
            raise ValueError("--baseline ema needs the EMA's value (RewardEMA.baseline)")
        return scores - baseline_value
    if baseline == "batch":
        return scores - (batch_mean(scores, all_reduce) if baseline_value is None else baseline_value)
    if baseline == "rpp":
        if mask is None:
            raise ValueError("--baseline rpp whitens over tokens: pass the completion mask")
        grouped = scores.view(-1, group_size)  # a group of one keeps its score (verl takes its mean as 0)
        centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1) if group_size > 1 else scores
        return masked_whiten(centred.unsqueeze(-1) * mask.float(), mask, all_reduce)
    raise ValueError(f"compute_advantages takes ema, batch or rpp, not {baseline!r} (rpp-kl: discounted_returns)")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | None = None,
    aggregation: Literal["sample", "token"] = "sample",
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-ρ·A per token (PPO-clipped when ``clip_eps`` is set), aggregated as a sample or a token average.

    logprobs (B,T) with grad; old_logprobs (B,T) detached; advantages (B,) or (B,T); mask (B,T) 1 on generated tokens
    (EOS included). ``aggregation="sample"``: per-sequence token mean, summed and divided by ``num_sequences`` (the
    optimiser mini-batch's sequences; default B). ``"token"``: Σ over tokens / ``num_tokens`` (the mini-batch's
    tokens; default the mask's). ``is_weights`` (B,T) detached: rollout-correction weights π_old/μ on every term.
    """
    mask = mask.float()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # as verl: keeps exp finite
    ratio = torch.exp(log_ratio)
    per_token = -adv * ratio
    if clip_eps is not None:
        per_token = torch.max(per_token, -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps))
    if is_weights is not None:  # the sampler was μ, not π_old: reweight the policy-gradient term
        per_token = per_token * is_weights
    if aggregation == "token":
        loss = (per_token * mask).sum() / (num_tokens or mask.sum().clamp(min=1))
    else:
        seq_loss = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # token mean within each sequence
        loss = seq_loss.sum() / (num_sequences or logprobs.shape[0])
    metrics = {}
    with torch.no_grad():
        eps = clip_eps if clip_eps is not None else float("inf")
        clipped = ((adv > 0) & (ratio > 1 + eps)) | ((adv < 0) & (ratio < 1 - eps))
        metrics["clip_frac"] = ((clipped.float() * mask).sum() / mask.sum().clamp(min=1)).detach()
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
    ema = RewardEMA(args.ema_decay)  # ALGO LOGIC: the EMA baseline's state goes into every checkpoint
    books = Bookkeeper(
        run,
        args,
        tokenizer,
        task,
        engine,
        {"model": raw_model, "optimizer": optimizer, "scheduler": scheduler, "reward_ema": ema},
    )
    token_mean = args.baseline in ("rpp", "rpp-kl")  # ALGO LOGIC: REINFORCE++ keeps PPO's clip and token mean
    all_reduce = lambda t: accelerator.reduce(t, "sum")  # noqa: E731  (a sum over processes: the batch's statistics)

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

        # 4. tensors: [left-padded prompt | right-padded completion]
        input_ids, attention_mask, completion_mask, rollout_logprobs = pack_rollout(
            prompt_ids, completions, args.group_size, tokenizer.pad_token_id, device
        )
        completion_width = completion_mask.shape[1]

        # 5. old log-probs (when the batch is reused or the KL reward needs them, else the detached current ones are
        # exact) and reference ones
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
            if not on_policy or ref_model is not None:  # ALGO LOGIC: the KL penalty is on π_old, so it needs them too
                old_logprobs = token_logprobs_batched(model, *logprob_args)
            if ref_model is not None:
                ref_logprobs = token_logprobs_batched(ref_model, *logprob_args)
        old_logprobs_s = time.time() - t0

        # 6. ALGO LOGIC: k1 KL in the reward (no gradient), then the baseline: the step's advantages
        per_token = token_rewards(rewards.to(device), completion_mask, args.kl_coef, old_logprobs, ref_logprobs)
        scores, baseline = per_token.sum(-1), None  # S_i = R_i - β Σ_t k1_t
        if args.baseline == "rpp-kl":  # REINFORCE++: discounted token returns, whitened over the batch
            returns = discounted_returns(per_token, completion_mask, args.gamma)
            advantages = masked_whiten(returns, completion_mask, all_reduce)
        elif args.baseline == "rpp":  # REINFORCE++-baseline: the group mean off, then whitened over the batch
            advantages = compute_advantages(scores, args.group_size, "rpp", mask=completion_mask, all_reduce=all_reduce)
        else:  # REINFORCE: one b, the EMA of earlier batches' mean score or this batch's mean, off every score
            mean = batch_mean(scores, all_reduce)
            baseline = ema.baseline(mean) if args.baseline == "ema" else mean
            advantages = compute_advantages(scores, args.group_size, args.baseline, baseline, all_reduce=all_reduce)
            if args.baseline == "ema":
                ema.update(mean)  # before the weight push: a checkpoint after this step's update holds this mean

        def global_tokens(rows: torch.Tensor) -> float:
            """Token count of an optimiser mini-batch over all processes / their number (DDP averages gradients)."""
            return accelerator.reduce(completion_mask[rows].sum(), "sum").item() / run.world

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
                num_tokens = global_tokens(mb_rows) if token_mean else None
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
                            clip_eps=args.clip_eps if token_mean else None,
                            aggregation="token" if token_mean else "sample",
                            num_sequences=minibatch_size,
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
        if baseline is not None:  # ALGO LOGIC: the b subtracted from every score (ema, batch)
            step_log["train/baseline"] = baseline
        if ref_model is not None:  # the reward's k1 KL, per token (as rloo and ppo log it) and summed per sequence
            step_log["train/kl"] = masked_mean(old_logprobs - ref_logprobs, completion_mask)
            step_log["train/kl_seq"] = ((old_logprobs - ref_logprobs) * completion_mask).sum(-1).mean().item()
        samples = sample_rows(problems, texts, golds, rewards, args.group_size, args.log_samples)
        books.log_step(step + 1, update_stats, step_log, t_step, samples)
        books.end_step(step + 1)

    books.finish(raw_model)


if __name__ == "__main__":
    main()
