"""PPO with a learned critic, in the Open-Reasoner-Zero recipe.

Papers: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv 1707.06347 (clipped surrogate);
Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation", arXiv
1506.02438 (GAE); Hu et al. 2025, "Open-Reasoner-Zero: An Open Source Approach to Scaling Up Reinforcement
Learning on the Base Model", arXiv 2503.24290, §2.1-2.2 and §3.1 (the recipe: λ = γ = 1, ε = 0.2, no KL, no
entropy bonus, a critic initialised from the base model with lr 5× the actor's, batch-level advantage whitening).

For each prompt q, sample G completions o_i from π_old and score them with a verifier (R_i). The critic V_φ is a
separate copy of the base model (no weight sharing) with a scalar head; V(s_t) is read at the position BEFORE
response token t, i.e. the value of the state in which o_t is chosen.

    token reward  r_t = R_i·[t = |o_i|] - β·(log π_old(o_t) - log π_ref(o_t))    k1 in the reward, β = 0 by default
    TD error      δ_t = r_t + γ·V(s_{t+1}) - V(s_t),  with V(s_{|o_i|+1}) = 0
    GAE           Â_t = Σ_k (γλ)^k δ_{t+k},   return  R̂_t = Â_t + V(s_t)    (λ = γ = 1: Â_t = R_i - V(s_t), R̂_t = R_i)
    whitening     A_t = (Â_t - mean) / sqrt(var + 1e-8)    masked mean, population var over all batch tokens, all ranks
    ratio         ρ_t = π_θ(o_t | q, o_<t) / π_old(o_t | q, o_<t)
    policy loss   L_π = Σ_{i,t} -min(ρ_t A_t, clip(ρ_t, 1-ε, 1+ε) A_t) / Σ_{i,t} 1                      token mean
    value loss    L_V = Σ_{i,t} ½·max((V - R̂)², (V_old + clip(V - V_old, -c, c) - R̂)²) / Σ_{i,t} 1    token mean

The policy and the critic have separate AdamW optimisers; the critic takes several mini-batch steps per rollout
(ORZ: 12), the policy one by default (strictly on-policy, as ORZ). Parent of critic-based scripts (grpo.py is the
parent of critic-free ones); `diff algos/grpo.py algos/ppo.py` shows the critic, GAE and token-mean aggregation.

CPU, offline (the defaults: the shipped tiny model on the synthetic `arith` task):
    python algos/ppo.py
GPU, sharded over two nodes of 8 (ORZ §3.1: actor lr 1e-6, critic lr 5e-6, 128 prompts x 64 samples, 1 policy step
and 12 critic steps per rollout, AdamW β2 0.95, 50 warm-up steps; ORZ generates up to 8000 tokens; packed,
checkpointed, vLLM asleep during the update; the second node runs the same command with --machine_rank 1):
    # planner: fits on 80 GB: 52.1 GB per GPU
    accelerate launch --config_file scripts/accelerate/multi_node.yaml --machine_rank 0 algos/ppo.py --fsdp \
        --model Qwen/Qwen2.5-7B --dataset math --template r1-zero --rollout.backend vllm --rollout.enable-sleep-mode \
        --learning-rate 1e-6 --critic-learning-rate 5e-6 --adam-beta2 0.95 --warmup-steps 50 --max-new-tokens 8000 \
        --prompts-per-step 128 --group-size 64 --critic-num-minibatches 12 --micro-batch-tokens 16384 \
        --gradient-checkpointing --eval.dataset math500 --track
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
from transformers import AutoConfig, AutoModelForTokenClassification

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.async_rollout import LaggedRollouts  # noqa: E402
from common.bookkeeping import Bookkeeper, pack_rollout, rollout_stats, sample_rows  # noqa: E402
from common.correction import CorrectionConfig, correction_weights, resolve_correction  # noqa: E402
from common.evaluate import EvalConfig  # noqa: E402
from common.logprobs import token_logprobs, token_logprobs_batched  # noqa: E402
from common.lora import LoraConfig  # noqa: E402
from common.packing import micro_batches, model_layout  # noqa: E402
from common.rollout import RolloutConfig, make_engine  # noqa: E402
from common.runtime import load_model, load_task, load_tokenizer, reference_model, start_run  # noqa: E402
from common.sandbox import SandboxConfig  # noqa: E402
from common.sharding import save_pretrained_full  # noqa: E402
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
    # ALGO LOGIC: PPO hyperparameters
    clip_eps: float = 0.2
    """ε, the PPO clip range of the ratio (PPO eq. 7; ORZ §2.1: 0.2)"""
    kl_coef: float = 0.0
    """β, weight of the k1 KL to the frozen reference subtracted from the token rewards (ORZ: 0 = no reference model)"""
    gamma: float = 1.0
    """γ, the discount in the TD error δ_t (GAE eq. 16; ORZ §2.1: 1.0)"""
    lam: float = 1.0
    """λ, the GAE parameter (GAE eq. 16; ORZ §2.1: 1.0, and λ = 0.95 was unstable in its Fig. 7)"""
    vf_clip: float = 0.2
    """c, the clip range of the value change |V - V_old| in the value loss (ORZ: 0.2)"""
    critic_learning_rate: float | None = None
    """AdamW learning rate of the critic (None = 5x --learning-rate, as ORZ §3.1: 5e-6 vs 1e-6)"""
    critic_num_minibatches: int = 4
    """critic optimiser steps per rollout batch (ORZ §3.1: 12 mini-batches)"""
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


# ALGO LOGIC: rewards, GAE, whitening and the two losses (the functions tests import)
def token_rewards(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float = 0.0,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token rewards (B, T): R_i on the last response token, minus β·k1 = β·(log π_old - log π_ref) on every token.

    rewards (B,); mask (B, T) right-padded, 1 on generated tokens (EOS included). The KL term uses the detached
    log-probs of the sampling policy, so it reaches the policy only through the advantages.
    """
    mask = mask.float()
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    out = torch.zeros_like(mask)
    out[torch.arange(mask.shape[0]), last] = rewards.float() * (mask.sum(-1) > 0)
    if kl_coef > 0:
        if old_logprobs is None or ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs old_logprobs and ref_logprobs")
        out = out - kl_coef * (old_logprobs - ref_logprobs) * mask
    return out


def compute_gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GAE advantages and returns (B, T), before whitening; both are 0 on padding.

    δ_t = r_t + γ V_{t+1} - V_t with V = 0 after the last valid token; Â_t = δ_t + γλ Â_{t+1}; R̂_t = Â_t + V_t.
    The recursion restarts at every sequence end, so nothing leaks in from padded positions.
    """
    mask = mask.float()
    rewards, values = token_rewards.float() * mask, values.float() * mask
    advantages = torch.zeros_like(values)
    next_value, next_adv = torch.zeros_like(values[:, 0]), torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = (delta + gamma * lam * next_adv) * mask[:, t]
        advantages[:, t] = next_adv
        next_value = values[:, t]
    return advantages, (advantages + values) * mask


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, all_reduce=None, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with the mean and population variance over the masked entries; 0 on padding.

    ``all_reduce`` sums a tensor over processes (None = this process only), so the statistics are the batch's.
    """
    mask = mask.float()
    reduce = all_reduce or (lambda t: t)
    total, count = reduce(torch.stack([(x * mask).sum(), mask.sum()])).unbind()
    mean = total / count.clamp(min=1)
    var = reduce(((x - mean) ** 2 * mask).sum()) / count.clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    num_tokens: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, token mean: Σ_{i,t} m·ℓ / ``num_tokens``.

    logprobs (B,T) with grad; old_logprobs (B,T) detached; advantages (B,T) (or (B,)); mask (B,T).
    ``num_tokens`` is the token count of the optimiser mini-batch (default: the tokens passed in): passing it
    lets micro-batches accumulate to exactly the mini-batch loss. ``is_weights`` (B,T) detached: rollout-correction
    weights π_old/μ, on this surrogate only (the critic's value loss is untouched).
    """
    mask = mask.float()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # as verl: keeps exp finite
    ratio = torch.exp(log_ratio)
    per_token = torch.max(-adv * ratio, -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps))
    if is_weights is not None:  # the sampler was μ, not π_old: reweight the policy-gradient term
        per_token = per_token * is_weights
    loss = (per_token * mask).sum() / (num_tokens or mask.sum().clamp(min=1))
    metrics = {}
    with torch.no_grad():
        clipped = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
        metrics["clip_frac"] = ((clipped.float() * mask).sum() / mask.sum().clamp(min=1)).detach()
        metrics["ratio"] = ((ratio * mask).sum() / mask.sum().clamp(min=1)).detach()
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ½·max((V - R̂)², (V_old + clip(V - V_old, -c, c) - R̂)²), token mean over ``num_tokens``.

    values (B,T) with grad; old_values, returns (B,T) detached; mask (B,T). The max makes it pessimistic: the
    clip only ever removes gradient once V has moved more than c from V_old in the direction of the return.
    """
    mask = mask.float()
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_err, clipped_err = (values - returns) ** 2, (clipped - returns) ** 2
    per_token = 0.5 * torch.max(unclipped_err, clipped_err)
    loss = (per_token * mask).sum() / (num_tokens or mask.sum().clamp(min=1))
    with torch.no_grad():
        frac = (((clipped_err > unclipped_err).float() * mask).sum() / mask.sum().clamp(min=1)).detach()
    return loss, {"value_clip_frac": frac}


# ALGO LOGIC: the critic's values, aligned with the completion tokens
def critic_values(critic, input_ids, attention_mask, completion_width: int, packed: bool = False) -> torch.Tensor:
    """V(s_t) (B, T) for the last ``completion_width`` tokens: the scalar head at the position BEFORE each token, 0
    where a row has no token; ``packed`` runs the rows as one padding-free sequence (common/packing.py)."""
    layout = model_layout(input_ids, attention_mask, completion_width, packed)
    out = critic(**layout.inputs).logits[..., 0]
    return layout.scatter(out[layout.source].float())


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).detach()


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> float:
    return masked_mean((x - masked_mean(x, mask)) ** 2, mask).item()


def main() -> None:
    args = tyro.cli(Args)
    run = start_run(args)  # flags checked, processes started, precision chosen, run folder claimed, seeded
    # 'auto': on when the sampler is not the model (vLLM, or a lagging policy version). ALGO LOGIC: under lag this is
    # AReaL's decoupled PPO: the clip is taken around the recomputed π_old, the weight π_old/μ corrects the behaviour
    args.correction = resolve_correction(args.correction, args.rollout, max_lag=args.max_lag)
    accelerator, device, autocast = run.accelerator, run.device, run.autocast
    args.critic_learning_rate = args.critic_learning_rate or 5 * args.learning_rate
    batch_size = run.local_prompts * args.group_size  # sequences per process per step
    if batch_size < args.critic_num_minibatches:
        raise SystemExit(
            f"{batch_size} sequences per process cannot fill --critic-num-minibatches {args.critic_num_minibatches}"
        )
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
    # ALGO LOGIC: the critic: the base model with a zeroed scalar head (V = 0 at first), own optimiser and warm-up
    critic_config = AutoConfig.from_pretrained(run.model_path, num_labels=1)
    critic_config.classifier_dropout = 0.0  # the token-classification head would otherwise apply dropout 0.1
    raw_critic = load_model(
        run,
        gradient_checkpointing=args.gradient_checkpointing,
        model_cls=AutoModelForTokenClassification,
        config=critic_config,
    )
    torch.nn.init.zeros_(raw_critic.score.weight)
    torch.nn.init.zeros_(raw_critic.score.bias)
    critic_optimizer = torch.optim.AdamW(
        raw_critic.parameters(),
        lr=args.critic_learning_rate,
        betas=(0.9, args.adam_beta2),
        weight_decay=args.weight_decay,
    )
    critic_scheduler = torch.optim.lr_scheduler.LambdaLR(
        critic_optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps * args.critic_num_minibatches))
    )
    critic, critic_optimizer = run.prepare(raw_critic, critic_optimizer)  # the scheduler unprepared
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
            "critic": raw_critic,
            "critic_optimizer": critic_optimizer,
            "critic_scheduler": critic_scheduler,
        },
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

        # 4. ALGO LOGIC: no group statistics; the advantages come from the critic once the tensors exist (step 6)

        # 5. tensors: [left-padded prompt | right-padded completion]
        input_ids, attention_mask, completion_mask, rollout_logprobs = pack_rollout(
            prompt_ids, completions, args.group_size, tokenizer.pad_token_id, device
        )
        completion_width = completion_mask.shape[1]
        micro_batching, packed = (args.micro_batch_size, args.micro_batch_tokens), args.micro_batch_tokens > 0

        # 6. old log-probs (when the batch is reused or the KL reward needs them, otherwise the detached current ones
        # are exact), reference log-probs, and the critic's values V_old
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
            if not on_policy or ref_model is not None:
                old_logprobs = token_logprobs_batched(model, *logprob_args)
            if ref_model is not None:
                ref_logprobs = token_logprobs_batched(ref_model, *logprob_args)
            old_values = torch.zeros_like(completion_mask)
            for rows, _ in micro_batches(torch.arange(batch_size, device=device), attention_mask, *micro_batching):
                old_values[rows] = critic_values(
                    critic, input_ids[rows], attention_mask[rows], completion_width, packed
                )
        old_logprobs_s = time.time() - t0

        # ALGO LOGIC: token rewards -> GAE -> advantages whitened over the whole batch (every process's tokens)
        rewards_per_token = token_rewards(rewards.to(device), completion_mask, args.kl_coef, old_logprobs, ref_logprobs)
        raw_advantages, returns = compute_gae(rewards_per_token, old_values, completion_mask, args.gamma, args.lam)
        advantages = masked_whiten(raw_advantages, completion_mask, lambda t: accelerator.reduce(t, "sum"))

        def global_tokens(rows: torch.Tensor) -> float:
            """Token count of an optimiser mini-batch over all processes / their number (DDP averages gradients)."""
            return accelerator.reduce(completion_mask[rows].sum(), "sum").item() / run.world

        # 7a. ALGO LOGIC: critic update, --critic-num-minibatches optimiser steps over the batch
        t0 = time.time()
        update_stats: dict[str, list[float]] = {}
        generator = torch.Generator().manual_seed(args.seed * 7919 + step * 31 + 7)
        order = torch.randperm(batch_size, generator=generator).to(device)
        # exactly --critic-num-minibatches pieces, sizes differing by at most one (ORZ: 8192 rows in 12)
        for mb_rows in order.tensor_split(args.critic_num_minibatches):
            minibatch_loss, num_tokens = 0.0, global_tokens(mb_rows)
            for rows, sync in micro_batches(mb_rows, attention_mask, args.micro_batch_size, args.micro_batch_tokens):
                with accelerator.no_sync(critic) if not sync else contextlib.nullcontext():
                    with autocast():
                        values = critic_values(critic, input_ids[rows], attention_mask[rows], completion_width, packed)
                    loss, loss_stats = value_loss(
                        values,
                        old_values[rows],
                        returns[rows],
                        completion_mask[rows],
                        clip=args.vf_clip,
                        num_tokens=num_tokens,
                    )
                    accelerator.backward(loss)
                minibatch_loss += loss.detach().double()  # float64, as .item() summed it; no sync
                update_stats.setdefault("value_clip_frac", []).append(loss_stats["value_clip_frac"])
            grad_norm = accelerator.clip_grad_norm_(critic.parameters(), args.max_grad_norm)
            if math.isfinite(float(grad_norm)) and math.isfinite(minibatch_loss):
                critic_optimizer.step()
            else:  # a non-finite value loss or gradient never reaches the critic
                update_stats.setdefault("skipped_updates", []).append(1.0)
            critic_scheduler.step()
            critic_optimizer.zero_grad(set_to_none=True)
            update_stats.setdefault("value_loss", []).append(minibatch_loss)
            update_stats.setdefault("critic_grad_norm", []).append(float(grad_norm))
        critic_s = time.time() - t0

        # 7b. policy update: epochs x minibatches x micro-batches, one optimiser step per minibatch
        minibatch_size = batch_size // args.num_minibatches
        for epoch in range(args.num_epochs):
            generator = torch.Generator().manual_seed(args.seed * 7919 + step * 31 + epoch)
            order = torch.randperm(batch_size, generator=generator).to(device)
            for start in range(0, batch_size, minibatch_size):
                mb_rows, minibatch_loss = order[start : start + minibatch_size], 0.0
                mb_rows = mb_rows[attention_mask[mb_rows].sum(-1).argsort(stable=True)]  # similar lengths together
                num_tokens = global_tokens(mb_rows)
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
            "train/critic_lr": critic_scheduler.get_last_lr()[0],
            "train/value": masked_mean(old_values, completion_mask),
            "train/return": masked_mean(returns, completion_mask),
            "train/raw_advantage": masked_mean(raw_advantages, completion_mask),
            "train/explained_var": 1.0
            - masked_var(returns - old_values, completion_mask) / max(masked_var(returns, completion_mask), 1e-8),
            "time/rollout_s": rollout_s,
            "time/reward_s": reward_s,
            "time/old_logprobs_s": old_logprobs_s,
            "time/train_s": train_s,
            "time/critic_s": critic_s,
            **(
                {"train/kl": masked_mean(old_logprobs - ref_logprobs, completion_mask)} if ref_model is not None else {}
            ),
            "time/weight_sync_s": weight_sync_s,
            "time/tokens_per_s": float(completion_mask.sum()) / max(rollout_s, 1e-9),
            "time/train_tokens_per_s": float(attention_mask.sum()) * args.num_epochs / max(train_s, 1e-9),
        } | rollouts.stats
        samples = sample_rows(problems, texts, golds, rewards, args.group_size, args.log_samples)
        books.log_step(step + 1, update_stats, step_log, t_step, samples)
        books.end_step(step + 1)

    save_pretrained_full(raw_critic, run.run_dir / "final_critic", run.is_main)  # ALGO LOGIC: the value model
    books.finish(raw_model)


if __name__ == "__main__":
    main()
