"""ScaleRL: the best-practice recipe of "The Art of Scaling Reinforcement Learning Compute for LLMs".

Paper: Khatri et al. 2025, arXiv 2510.13786 (§3 the ablations, §4 the recipe and its loss J_ScaleRL). The loss is
CISPO's (MiniMax-M1, arXiv 2506.13585, §3.1), as in cispo.py.

For each prompt x, sample G completions y_1..y_G from π_gen, the sampler, which lags the trainer π_train (below).

    filter        keep x only if its rewards differ: 0 < mean_j r_j < 1 for 0/1 rewards  (zero-variance filtering)
    advantage     Â_i = r_i - mean_j r_j;   Â_i^norm = Â_i / (std of Â over the kept batch + 1e-6)   (batch-level)
    IS weight     ρ_{i,t} = π_train(y_{i,t} | x, y_{i,<t}) / π_gen(y_{i,t} | x, y_{i,<t})   π_gen: engine's log-probs
    surrogate     ℓ_{i,t} = -sg(min(ρ_{i,t}, ε_max)) Â_i^norm log π_train(y_{i,t} | x, y_{i,<t})      (CISPO)
    objective     L = (1/|kept x|) Σ_x (1 / Σ_{g∈x} |y_g|) Σ_{i∈x} Σ_t ℓ_{i,t}    prompt-level: each prompt's group
                                                                                  token mean, then the mean over prompts
    curriculum    a prompt whose pass rate reaches 0.9 leaves the training pool for good  (no-positive-resampling)
    off-policy    batch s is sampled by π_train's version max(0, s - k + 1), k = 8           (PipelineRL-k)
    precision     the LM head in fp32 in the trainer and the sampler

PipelineRL streams generations while the trainer steps and pushes each new policy into the generators, so a
sample is at most k - 1 weight versions older than the policy that learns from it. Here batch s is sampled by
version max(0, s - k + 1) (`--max-lag`, common/async_rollout.py): with rollout servers the next batches generate
while the trainer trains; with the HF or colocated vLLM engine they are sampled ahead, in place. Either way the lag
is min(s, k - 1) weight versions (train/lag), and ρ is taken against the log-probs the engine reported while
sampling, never a recomputation, which would hide the lag. `--max-lag 1` is on-policy.
Held-out evaluation always sees the current policy. The paper's length control (forced "interruptions" of long
reasoning) is not built: the tiny task never runs long, and the other scripts have no interruptions either.

Relative to cispo.py this file changes:
- prompt-level aggregation: each prompt's group is one token mean (Σ over the group's tokens / the group's token
  count), then the mean over the kept prompts of the mini-batch (groups stay whole in a mini-batch).
- advantages: r - group mean, divided by the std over the whole kept batch (all processes), not per group.
- zero-variance filtering: groups with identical rewards leave the loss and the advantage statistics (counted).
- no-positive-resampling: prompts at pass rate >= 0.9 leave the pool for good (checkpointed with the data cursor).
- PipelineRL-style lag: --max-lag 8 by default, and ρ uses the sampler's reported log-probs; 1 optimiser step per
  rollout batch (the lag makes ρ ≠ 1); the fp32 LM head is on unless --rollout.fp32-lm-head off.
- rollout correction: none on top (--correction.mode auto -> none, others refused): ρ is π_train/π_gen already.

CPU, offline (the defaults: the shipped tiny model on the synthetic `arith` task):
    python algos/scalerl.py
GPU, one process (G = 16 and 48 prompts per batch as ScaleRL's 768-sample batches; lr and token budget for the model):
    # planner: fits on 80 GB: 59.9 GB per GPU
    python algos/scalerl.py --model Qwen/Qwen2.5-Math-1.5B --dataset math --template qwen-math \
        --rollout.backend vllm --learning-rate 1e-6 --max-new-tokens 3000 --prompts-per-step 48 --group-size 16 \
        --micro-batch-tokens 8192 --gradient-checkpointing --max-lag 8 --eval.dataset math500 --track
GPU, several processes (each rank its own colocated engine, on the same schedule):
    accelerate launch --num_processes 8 algos/scalerl.py <the flags above>
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
    """optimiser steps per epoch over the rollout batch (each holds whole groups; ScaleRL: 1, the lag makes ρ ≠ 1)"""
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
    # ALGO LOGIC: ScaleRL hyperparameters
    eps_max: float = 5.0
    """ε_max, absolute cap on the detached IS weight (CISPO; 5.0 as TRL's ScaleRL/CISPO setting), no lower bound"""
    max_lag: int = 8
    """k: batch s is sampled by policy version max(0, s-k+1) (PipelineRL-k; ScaleRL: 8; 1 = on-policy)"""
    retire_pass_rate: float = 0.9
    """no-positive-resampling: a prompt whose pass rate over its samples so far reaches this leaves the pool for good"""
    kl_coef: float = 0.0
    """β of an optional k3 KL to a frozen reference; ScaleRL has none, so 0 = no reference model"""
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


# ALGO LOGIC: advantages, filters and loss (the functions tests import)
def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) bool: True on every row of a group whose rewards are all equal (no learning signal; ScaleRL filters it)."""
    grouped = rewards.view(-1, group_size)
    return (grouped.max(1).values == grouped.min(1).values).repeat_interleave(group_size)


def compute_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6, all_reduce=None) -> torch.Tensor:
    """Batch-normalised advantages Â_i = (R_i - mean_g R) / (std_batch Â + eps), zero on zero-variance groups.

    rewards: (B,) with prompt i's group in rows i*G .. i*G+G-1. Returns (B,). The std is the sample (Bessel) std of
    the centred rewards over the rows of every group that is kept (not zero-variance); ``all_reduce`` sums a tensor
    over processes (None = this process only), so the std is the whole batch's.
    """
    if group_size < 2:
        raise ValueError(f"ScaleRL needs group_size >= 2 to form a baseline, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size).float()
    kept = (~zero_variance_groups(rewards, group_size)).float()
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1) * kept  # exactly 0 on filtered groups
    square_sum, count = (all_reduce or (lambda t: t))(torch.stack([(centred**2).sum(), kept.sum()])).unbind()
    std = torch.sqrt(square_sum / (count - 1).clamp(min=1))
    return centred / (std + eps)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    eps_max: float = 5.0,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    group_tokens: torch.Tensor | None = None,
    num_prompts: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ScaleRL loss: -sg(min(ρ, ε_max))·A·log π (+ optional β·k3), a token mean per prompt's group, mean over prompts.

    logprobs (B,T) with grad; old_logprobs (B,T) the sampler's, detached; ref_logprobs (B,T) detached; advantages
    (B,) or (B,T); mask (B,T) 1 on the generated tokens that enter the loss (a filtered group's rows all 0). By default
    the B rows are whole groups of ``group_size``, contiguous, and a group with no tokens in the mask is not a prompt
    of the mean. For micro-batches pass ``group_tokens`` (B,), each row's group's token count, and ``num_prompts``,
    the kept prompts of the optimiser mini-batch: the micro-batch losses then accumulate to exactly the mini-batch's.
    """
    mask = mask.float()
    if group_tokens is None:
        per_group = mask.sum(-1).view(-1, group_size).sum(-1)
        group_tokens = per_group.repeat_interleave(group_size)
        num_prompts = float((per_group > 0).sum()) if num_prompts is None else num_prompts
    elif num_prompts is None:
        raise ValueError("with group_tokens, pass num_prompts (the mini-batch's kept prompts)")
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # as verl: keeps exp finite
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=eps_max).detach()  # the capped IS weight carries no gradient: only log π does
    per_token = -weight * adv * logprobs
    metrics = {}
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        delta = ref_logprobs - logprobs
        k3 = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * k3
        metrics["kl"] = ((k3 * mask).sum() / mask.sum().clamp(min=1)).detach()
    # prompt-level: each row's token sum over its group's token count, summed, over the number of prompts
    loss = ((per_token * mask).sum(-1) / group_tokens.clamp(min=1)).sum() / max(num_prompts, 1.0)
    with torch.no_grad():  # clip_frac: tokens whose IS weight was capped at ε_max (they still get gradient)
        tokens = mask.sum().clamp(min=1)
        metrics["clip_frac"] = (((ratio > eps_max).float() * mask).sum() / tokens).detach()
        metrics["is_weight"] = ((weight * mask).sum() / tokens).detach()
        metrics["is_weight_std"] = (((weight - metrics["is_weight"]) ** 2 * mask).sum() / tokens).sqrt().detach()
        metrics["ratio"] = ((ratio * mask).sum() / tokens).detach()
    return loss, metrics


class PromptPool:
    """No-positive-resampling: the training prompts still in play. A prompt whose pass rate over all its samples so
    far reaches ``threshold`` is retired for good; ``retired`` goes to ``books.next_prompts(exclude=...)``, which
    then passes over it in later epochs. Checkpointed with the run (Bookkeeper's ``state``)."""

    def __init__(self, threshold: float) -> None:
        self.threshold, self.counts, self.retired = threshold, {}, set()

    def record(self, indices: list[int], correct: list[int], samples: int) -> None:
        """Add each prompt's correct count out of ``samples`` (every process records every process's groups)."""
        for index, c in zip(indices, correct):
            seen = self.counts.get(index, (0, 0))
            self.counts[index] = (seen[0] + c, seen[1] + samples)
            if self.counts[index][0] >= self.threshold * self.counts[index][1]:
                self.retired.add(index)

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts), "retired": sorted(self.retired)}

    def load_state_dict(self, state: dict) -> None:
        self.counts, self.retired = dict(state["counts"]), set(state["retired"])


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).detach()


def main() -> None:
    args = tyro.cli(Args)
    if args.rollout.fp32_lm_head == "auto":  # ALGO LOGIC: ScaleRL's fp32 LM head, in the trainer and in vLLM
        args.rollout.fp32_lm_head = "on"
    # ALGO LOGIC: the loss's IS weight is min(π_θ/μ, ε_max) already (μ = the engine's log-probs): no weight on top
    own = "its capped IS weight min(π_θ/μ, ε_max) is taken against the sampler's log-probs μ"
    run = start_run(args, own_correction=own)  # flags checked (LoRA dropout against its own weight), processes started
    args.correction = resolve_correction(args.correction, args.rollout, own_correction=own)  # 'auto' -> none
    accelerator, device, autocast = run.accelerator, run.device, run.autocast
    compute_advantages(torch.zeros(2 * args.group_size), args.group_size)  # fail fast on a group size it rejects
    batch_size = run.local_prompts * args.group_size  # sequences per process per step
    if run.local_prompts % args.num_minibatches:  # ALGO LOGIC: prompt-level averaging keeps groups whole
        raise SystemExit(f"{run.local_prompts} prompts per process do not split into --num-minibatches whole groups")
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
    pool = PromptPool(args.retire_pass_rate)
    state = {"model": raw_model, "optimizer": optimizer, "scheduler": scheduler, "pool": pool}
    books = Bookkeeper(run, args, tokenizer, task, engine, state)

    def sample(step: int):
        """Batch ``step``: this process's share of the seeded, resumable prompt stream, retired prompts passed over,
        and G samples per prompt."""
        problems, prompt_ids = books.next_prompts(exclude=pool.retired)
        # one seed per prompt from its global position: the same samples on any number of processes and after a resume
        first_prompt = (args.seed * 1_000_003 + step) * args.prompts_per_step + run.rank * run.local_prompts
        seeds = [(first_prompt + i) * args.group_size for i in range(run.local_prompts)]
        request = rollouts.request(
            prompt_ids, args.group_size, args.max_new_tokens, args.temperature, args.top_p, seeds, stop=task.stop
        )
        return problems, prompt_ids, request

    # ALGO LOGIC: the sampler lags the trainer (PipelineRL-k): batch s comes from policy version max(0, s - k + 1);
    # rollout servers sample it while the trainer trains
    rollouts = LaggedRollouts(books, engine, sample, args.max_lag)

    for step in books.steps():
        t_step = time.time()
        # 1-2. this step's prompts and rollouts, from the sampler --max-lag - 1 versions behind (fewer at the start)
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

        # 4. ALGO LOGIC: zero-variance filtering, batch-normalised advantages, retirement of solved prompts
        keep = ~zero_variance_groups(rewards, args.group_size)
        all_reduce = lambda t: accelerator.reduce(t, "sum")  # noqa: E731 - the std over every process's batch
        advantages = compute_advantages(rewards.to(device), args.group_size, all_reduce=all_reduce)
        solved = [rollouts.prompt_indices, correct.view(-1, args.group_size).sum(-1).int().tolist()]
        for indices, counts in accelerator.gather_for_metrics([solved], use_gather_object=True):  # every process's
            pool.record(indices, counts, args.group_size)

        # 5. tensors: [left-padded prompt | right-padded completion]
        input_ids, attention_mask, completion_mask, rollout_logprobs = pack_rollout(
            prompt_ids, completions, args.group_size, tokenizer.pad_token_id, device
        )
        completion_width = completion_mask.shape[1]
        # ALGO LOGIC: filtered groups leave the loss; each row's denominator is its whole group's token count
        loss_mask = completion_mask * keep.to(device)[:, None]
        group_tokens = completion_mask.sum(-1).view(-1, args.group_size).sum(-1).repeat_interleave(args.group_size)

        # 6. reference log-probs (only with --kl-coef > 0). ALGO LOGIC: π_old is the sampler, its log-probs the engine's
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
            if ref_model is not None:
                ref_logprobs = token_logprobs_batched(ref_model, *logprob_args)
        old_logprobs_s = time.time() - t0

        # 7. update: epochs x minibatches x micro-batches, one optimiser step per minibatch
        t0 = time.time()
        update_stats: dict[str, list[float]] = {}
        minibatch_size = batch_size // args.num_minibatches
        for epoch in range(args.num_epochs):
            generator = torch.Generator().manual_seed(args.seed * 7919 + step * 31 + epoch)
            groups = torch.randperm(run.local_prompts, generator=generator)  # ALGO LOGIC: whole groups, shuffled
            order = (groups[:, None] * args.group_size + torch.arange(args.group_size)).view(-1).to(device)
            for start in range(0, batch_size, minibatch_size):
                mb_rows, minibatch_loss = order[start : start + minibatch_size], 0.0
                mb_rows = mb_rows[attention_mask[mb_rows].sum(-1).argsort(stable=True)]  # similar lengths together
                # ALGO LOGIC: prompt-mean denominator = the mini-batch's kept prompts summed over processes; DDP
                # averages the gradients over processes, so each divides by (global count / world): the global mean
                kept_prompts = keep[mb_rows.cpu()].float().sum() / args.group_size
                num_prompts = max(float(accelerator.reduce(kept_prompts.to(device), "sum")), 1.0) / run.world
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
                        loss, loss_stats = policy_loss(
                            logprobs,
                            rollout_logprobs[rows],
                            advantages[rows],
                            loss_mask[rows],
                            args.group_size,
                            eps_max=args.eps_max,
                            kl_coef=args.kl_coef,
                            ref_logprobs=None if ref_logprobs is None else ref_logprobs[rows],
                            group_tokens=group_tokens[rows],
                            num_prompts=num_prompts,
                        )
                        accelerator.backward(loss)
                    minibatch_loss += loss.detach().double()  # float64, as .item() summed it; no sync
                    loss_stats["entropy"] = masked_mean(entropy, completion_mask[rows])
                    if epoch == 0 and start == 0:  # sampler vs trainer log-prob gap, on the untouched policy
                        gap = (logprobs.detach() - rollout_logprobs[rows]).abs()
                        loss_stats["logprob_gap"] = masked_mean(gap, completion_mask[rows])
                        _, correction_stats = correction_weights(  # ALGO LOGIC: mode none, the metrics only
                            logprobs.detach(), rollout_logprobs[rows], completion_mask[rows], args.correction
                        )
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
            "train/filtered_groups": float((~keep).sum()) / args.group_size,
            "train/retired_prompts": float(len(pool.retired)),
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
