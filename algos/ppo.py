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
    GAE           Â_t = Σ_k (γλ)^k δ_{t+k},   return  R̂_t = Â_t + V(s_t)       (λ = γ = 1: Â_t = R_i - V(s_t), R̂_t = R_i)
    whitening     A_t = (Â_t - mean) / sqrt(var + 1e-8)       masked mean/var over all batch tokens, across processes (ORZ: population var)
    ratio         ρ_t = π_θ(o_t | q, o_<t) / π_old(o_t | q, o_<t)
    policy loss   L_π = Σ_{i,t} -min(ρ_t A_t, clip(ρ_t, 1-ε, 1+ε) A_t) / Σ_{i,t} 1                      token mean
    value loss    L_V = Σ_{i,t} ½·max((V - R̂)², (V_old + clip(V - V_old, -c, c) - R̂)²) / Σ_{i,t} 1    token mean

The policy and the critic have separate AdamW optimisers; the critic takes several mini-batch steps per rollout
(ORZ: 12), the policy one by default (strictly on-policy, as ORZ). Parent of critic-based scripts (grpo.py is the
parent of critic-free ones); `diff algos/grpo.py algos/ppo.py` shows the critic, GAE and token-mean aggregation.

CPU, offline (the defaults: the shipped tiny model on the synthetic `arith` task):
    python algos/ppo.py
GPU, one process (ORZ §3.1: actor lr 1e-6, critic lr 5e-6, 128 prompts x 64 samples, 1 policy step and 12
critic steps per rollout, AdamW β2 0.95, 50 warm-up steps; ORZ generates up to 8000 tokens):
    python algos/ppo.py --model Qwen/Qwen2.5-7B --dataset math --template r1-zero --rollout.backend vllm \
        --learning-rate 1e-6 --critic-learning-rate 5e-6 --adam-beta2 0.95 --warmup-steps 50 \
        --max-new-tokens 8000 --prompts-per-step 128 --group-size 64 --critic-num-minibatches 12 \
        --micro-batch-size 4 --eval.dataset math500 --track
GPU, several processes (each rank its own colocated engine; a prompt's group stays on one rank):
    accelerate launch --num_processes 8 algos/ppo.py <the flags above>
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import tyro
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.data import dataset_info, format_prompt, load_problems, prompt_batch, resolve_model_path  # noqa: E402
from common.evaluate import EvalConfig, evaluate  # noqa: E402
from common.rollout import RolloutConfig, left_pad, make_engine, token_logprobs, token_logprobs_batched, use_fp32_head  # noqa: E402
from common.tracking import Tracker, latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, seed_everything, set_rng_state  # noqa: E402
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
    """bf16 autocast of the trainer's forward/backward ('auto' = on for CUDA and bf16-capable CPUs); HF rollouts stay fp32"""
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
    """nucleus sampling threshold for rollouts"""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """rollout engine settings"""
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
    gradient_checkpointing: bool = False
    """recompute each layer's activations in the backward pass: less memory for ~30% more compute (long completions)"""
    max_bad_steps: int = 5
    """abort after this many consecutive steps with a non-finite loss or gradient (each is skipped)"""
    # ALGO LOGIC: PPO hyperparameters
    clip_eps: float = 0.2
    """ε, the PPO clip range of the ratio (PPO eq. 7; ORZ §2.1: 0.2)"""
    kl_coef: float = 0.0
    """β, weight of the k1 KL to the frozen reference subtracted from the token rewards (ORZ: none; 0 = no reference model)"""
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
    rewards: torch.Tensor, mask: torch.Tensor, kl_coef: float = 0.0, old_logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None
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


def compute_gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
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
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate, token mean: Σ_{i,t} m·ℓ / ``num_tokens``.

    logprobs (B,T) with grad; old_logprobs (B,T) detached; advantages (B,T) (or (B,)); mask (B,T).
    ``num_tokens`` is the token count of the optimiser mini-batch (default: the tokens passed in): passing it
    lets micro-batches accumulate to exactly the mini-batch loss.
    """
    mask = mask.float()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # as verl: keeps exp finite
    ratio = torch.exp(log_ratio)
    per_token = torch.max(-adv * ratio, -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps))
    loss = (per_token * mask).sum() / (num_tokens or mask.sum().clamp(min=1))
    metrics = {}
    with torch.no_grad():
        clipped = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
        metrics["clip_frac"] = ((clipped.float() * mask).sum() / mask.sum().clamp(min=1)).item()
        metrics["ratio"] = ((ratio * mask).sum() / mask.sum().clamp(min=1)).item()
    return loss, metrics


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float = 0.2, num_tokens: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
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
        frac = (((clipped_err > unclipped_err).float() * mask).sum() / mask.sum().clamp(min=1)).item()
    return loss, {"value_clip_frac": frac}


# ALGO LOGIC: the critic's values, aligned with the completion tokens
def critic_values(critic, input_ids, attention_mask, completion_width: int) -> torch.Tensor:
    """V(s_t) (B, T) for the last ``completion_width`` tokens: the scalar head at the position BEFORE each token."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return out[:, -completion_width - 1 : -1, 0].float()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).item()


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> float:
    return masked_mean((x - masked_mean(x, mask)) ** 2, mask)


def main() -> None:
    args = tyro.cli(Args)
    # SHARED: set-up (flags, processes, run folder)
    if args.learning_rate is None:
        if args.model != "tiny":
            raise SystemExit("--learning-rate is required for a model other than 'tiny' (the tiny default 1e-4 would wreck a 1.5B model; papers use ~1e-6)")
        args.learning_rate = 1e-4
    args.critic_learning_rate = args.critic_learning_rate or 5 * args.learning_rate
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0 for training rollouts (log-probs are of logits / temperature)")
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    rank, world = accelerator.process_index, accelerator.num_processes
    accelerator.print(f"{world} process(es), {accelerator.distributed_type.value}, device {accelerator.device}")
    if args.prompts_per_step % world:
        raise SystemExit(f"--prompts-per-step {args.prompts_per_step} must be divisible by the number of processes ({world})")
    local_prompts = args.prompts_per_step // world
    batch_size = local_prompts * args.group_size  # sequences per rank per step
    if batch_size % args.num_minibatches:
        raise SystemExit(f"{batch_size} sequences per process do not split into --num-minibatches {args.num_minibatches}")
    if batch_size % args.critic_num_minibatches:
        raise SystemExit(f"{batch_size} sequences per process do not split into --critic-num-minibatches {args.critic_num_minibatches}")
    args.run_name = args.run_name or f"{args.exp_name}__{args.dataset.replace('/', '_')}__{args.seed}"
    run_dir = Path(args.output_dir) / args.run_name
    if run_dir.exists() and not args.resume and latest_checkpoint(run_dir) is not None:
        raise SystemExit(f"{run_dir} already holds a run; pass --resume to continue it or choose another --run-name")
    seed_everything(args.seed + rank)
    device = accelerator.device
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype, torch.float32)
    # bf16 matmuls (GPU tensor cores; ~2x faster on CPUs with AVX512-BF16/AMX); weights and optimiser stay fp32
    native_bf16 = torch.cuda.is_bf16_supported() if device.type == "cuda" else torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    use_bf16 = args.mixed_precision == "bf16" or (args.mixed_precision == "auto" and native_bf16)
    autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=use_bf16)
    attn = "sdpa" if device.type == "cuda" else "eager"  # CPU: sdpa's bf16 backward is several times slower than eager here
    fp32_head = use_fp32_head(args.rollout, device)  # the LM head's matmul in fp32 (--rollout.fp32-lm-head), in the trainer as in vLLM

    # SHARED: data, verifier, templates
    info = dataset_info(args.dataset)
    train_problems = load_problems(args.dataset, "train")
    eval_name = args.eval.dataset or args.dataset
    eval_info = dataset_info(eval_name)
    eval_problems = load_problems(eval_name, eval_info.eval_split)
    template = args.template or info.default_template
    eval_template = args.eval.template or eval_info.default_template
    eval_cfg = dataclasses.replace(args.eval, max_new_tokens=args.eval.max_new_tokens or args.max_new_tokens)

    # SHARED: models, optimiser, rollout engine
    model_path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attn).to(device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if args.kl_coef > 0:  # ALGO LOGIC: the frozen reference exists only for the KL term
        ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attn).to(device).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, args.adam_beta2), weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    model, optimizer = accelerator.prepare(model, optimizer)  # not the scheduler: accelerate would step it once per process
    policy = accelerator.unwrap_model(model)
    # ALGO LOGIC: the critic, a separate copy of the base model with a scalar head (zero-initialised: V = 0 at the
    # start), its own optimiser, and the same warm-up counted in rollout steps
    critic_config = AutoConfig.from_pretrained(model_path, num_labels=1)
    critic_config.classifier_dropout = 0.0  # the token-classification head would otherwise apply dropout 0.1
    critic_model = AutoModelForTokenClassification.from_pretrained(model_path, config=critic_config, dtype=dtype, attn_implementation=attn).to(device)
    if args.gradient_checkpointing:
        critic_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.nn.init.zeros_(critic_model.score.weight)
    torch.nn.init.zeros_(critic_model.score.bias)
    critic_optimizer = torch.optim.AdamW(critic_model.parameters(), lr=args.critic_learning_rate, betas=(0.9, args.adam_beta2), weight_decay=args.weight_decay)
    critic_scheduler = torch.optim.lr_scheduler.LambdaLR(critic_optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps * args.critic_num_minibatches)))
    critic, critic_optimizer = accelerator.prepare(critic_model, critic_optimizer)  # the scheduler unprepared, as the policy's
    engine = make_engine(args.rollout, policy, tokenizer, model_path, args.seed + rank, args.max_prompt_tokens + args.max_new_tokens)

    start_step, cursor, train_time = 0, 0, 0.0  # train_time: seconds spent in steps, evaluation excluded
    tracker = Tracker(run_dir, args, args.track, args.wandb_project, enabled=accelerator.is_main_process)
    if args.resume and (ckpt := latest_checkpoint(run_dir)) is not None:
        state = load_checkpoint(ckpt)
        policy.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        critic_model.load_state_dict(state["critic"])
        critic_optimizer.load_state_dict(state["critic_optimizer"])
        critic_scheduler.load_state_dict(state["critic_scheduler"])
        set_rng_state(state["rng"][rank] if isinstance(state["rng"], list) else state["rng"])
        start_step, cursor, train_time = state["step"], state["cursor"], state["train_time"]
        engine.update_weights(policy)
        tracker.truncate_after(start_step)
        accelerator.print(f"resumed from {ckpt} at step {start_step}")

    def encode_prompts(problems: list[dict], tmpl: str) -> list[list[int]]:
        ids = [tokenizer(format_prompt(p["prompt"], tmpl, tokenizer))["input_ids"] for p in problems]
        for p, x in zip(problems, ids):
            if len(x) > args.max_prompt_tokens:
                raise SystemExit(f"prompt of {len(x)} tokens exceeds --max-prompt-tokens {args.max_prompt_tokens}: {p['prompt'][:80]!r}")
        return ids

    def run_eval(step: int) -> dict[str, float]:
        t0 = time.time()
        metrics = {}
        if accelerator.is_main_process:
            metrics = evaluate(engine, tokenizer, eval_problems, eval_info.reward_fn, eval_template, eval_cfg, seed=12345, name=eval_name)
            metrics["time/eval_s"] = time.time() - t0
            tracker.log(metrics, step)
        accelerator.wait_for_everyone()
        return metrics

    def checkpoint(step: int) -> None:
        states = accelerator.gather_for_metrics([rng_state()], use_gather_object=True) if world > 1 else [rng_state()]
        if accelerator.is_main_process:
            state = {"model": policy.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": states, "step": step, "cursor": cursor, "train_time": train_time}
            state |= {"critic": critic_model.state_dict(), "critic_optimizer": critic_optimizer.state_dict(), "critic_scheduler": critic_scheduler.state_dict()}
            save_checkpoint(run_dir, step, state, keep_last=args.keep_checkpoints)
        accelerator.wait_for_everyone()

    stop_signal: list[int] = []  # SIGTERM / SIGINT: finish the current step, checkpoint, exit
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum) if not stop_signal else sys.exit(128 + signum))
    first_eval = run_eval(start_step) if start_step == 0 else {}
    last_eval, bad_steps = first_eval, 0
    progress = tqdm(range(start_step, args.total_steps), initial=start_step, total=args.total_steps, desc=args.exp_name, disable=not accelerator.is_main_process)
    for step in progress:
        t_step = time.time()
        # 1. prompts for this step; this process takes its contiguous share (whole groups stay on one rank)
        indices = prompt_batch(len(train_problems), cursor, args.prompts_per_step, args.seed)[rank * local_prompts : (rank + 1) * local_prompts]
        cursor += args.prompts_per_step
        problems = [train_problems[i] for i in indices]
        prompt_ids = encode_prompts(problems, template)

        # 2. rollout: G samples per prompt from the current policy
        t0 = time.time()
        engine.wake()
        # one seed per prompt from its global position: the same samples on any number of processes and after a resume
        seeds = [((args.seed * 1_000_003 + step) * args.prompts_per_step + rank * local_prompts + i) * args.group_size for i in range(local_prompts)]
        completions = engine.generate(prompt_ids, args.group_size, args.max_new_tokens, args.temperature, args.top_p, seed=seeds)
        engine.sleep()
        rollout_s = time.time() - t0

        # 3. rewards from the verifier
        t0 = time.time()
        texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        golds = [p["answer"] for p in problems for _ in range(args.group_size)]
        outputs = compute_rewards(info.reward_fn, texts, golds)
        rewards = torch.tensor([o.reward for o in outputs], dtype=torch.float32)
        correct = torch.tensor([o.correct for o in outputs], dtype=torch.float32)
        reward_s = time.time() - t0

        # 4. ALGO LOGIC: no group statistics; the advantages come from the critic once the tensors exist (step 6)

        # 5. tensors: [left-padded prompt | right-padded completion]
        width = max(len(c.token_ids) for c in completions)
        prompt_tensor, prompt_mask = left_pad([ids for ids in prompt_ids for _ in range(args.group_size)], tokenizer.pad_token_id, "cpu")
        completion_tensor = torch.full((batch_size, width), tokenizer.pad_token_id, dtype=torch.long)
        completion_mask = torch.zeros((batch_size, width))
        rollout_logprobs = torch.zeros((batch_size, width))
        for i, c in enumerate(completions):
            completion_tensor[i, : len(c.token_ids)] = torch.tensor(c.token_ids)
            completion_mask[i, : len(c.token_ids)] = 1
            rollout_logprobs[i, : len(c.token_ids)] = torch.tensor(c.logprobs)
        input_ids = torch.cat([prompt_tensor, completion_tensor], dim=1).to(device)
        attention_mask = torch.cat([prompt_mask, completion_mask.long()], dim=1).to(device)
        completion_mask, rollout_logprobs = completion_mask.to(device), rollout_logprobs.to(device)
        micro_batches = [slice(i, min(i + args.micro_batch_size, batch_size)) for i in range(0, batch_size, args.micro_batch_size)]

        # 6. old log-probs (when the batch is reused or the KL reward needs them, otherwise the detached current ones
        # are exact), reference log-probs, and the critic's values V_old
        t0 = time.time()
        on_policy = args.num_epochs == 1 and args.num_minibatches == 1
        old_logprobs, ref_logprobs = None, None
        with torch.no_grad(), autocast():
            if not on_policy or ref_model is not None:
                old_logprobs = token_logprobs_batched(model, input_ids, attention_mask, width, args.temperature, args.micro_batch_size, fp32_head)
            if ref_model is not None:
                ref_logprobs = token_logprobs_batched(ref_model, input_ids, attention_mask, width, args.temperature, args.micro_batch_size, fp32_head)
            old_values = torch.cat([critic_values(critic, input_ids[mb], attention_mask[mb], width) for mb in micro_batches])
        old_logprobs_s = time.time() - t0

        # ALGO LOGIC: token rewards -> GAE -> advantages whitened over the whole batch (every process's tokens)
        rewards_per_token = token_rewards(rewards.to(device), completion_mask, args.kl_coef, old_logprobs, ref_logprobs)
        raw_advantages, returns = compute_gae(rewards_per_token, old_values, completion_mask, args.gamma, args.lam)
        advantages = masked_whiten(raw_advantages, completion_mask, lambda t: accelerator.reduce(t, "sum"))

        def global_tokens(rows: torch.Tensor) -> float:
            """Token count of an optimiser mini-batch over all processes, divided by their number (DDP averages gradients)."""
            return accelerator.reduce(completion_mask[rows].sum(), "sum").item() / world

        # 7a. ALGO LOGIC: critic update, --critic-num-minibatches optimiser steps over the batch
        t0 = time.time()
        step_metrics: dict[str, list[float]] = {}
        critic_minibatch_size = batch_size // args.critic_num_minibatches
        order = torch.randperm(batch_size, generator=torch.Generator().manual_seed(args.seed * 7919 + step * 31 + 7)).to(device)
        for start in range(0, batch_size, critic_minibatch_size):
            mb_rows, minibatch_loss = order[start : start + critic_minibatch_size], 0.0
            num_tokens = global_tokens(mb_rows)
            for j in range(0, critic_minibatch_size, args.micro_batch_size):
                rows = mb_rows[j : j + args.micro_batch_size]
                with accelerator.no_sync(critic) if j + args.micro_batch_size < critic_minibatch_size else contextlib.nullcontext():
                    with autocast():
                        values = critic_values(critic, input_ids[rows], attention_mask[rows], width)
                    loss, metrics = value_loss(values, old_values[rows], returns[rows], completion_mask[rows], clip=args.vf_clip, num_tokens=num_tokens)
                    accelerator.backward(loss)
                minibatch_loss += loss.item()
                step_metrics.setdefault("value_clip_frac", []).append(metrics["value_clip_frac"])
            grad_norm = accelerator.clip_grad_norm_(critic.parameters(), args.max_grad_norm)
            if math.isfinite(float(grad_norm)) and math.isfinite(minibatch_loss):
                critic_optimizer.step()
            else:  # a non-finite value loss or gradient never reaches the critic
                step_metrics.setdefault("skipped_updates", []).append(1.0)
            critic_scheduler.step()
            critic_optimizer.zero_grad(set_to_none=True)
            step_metrics.setdefault("value_loss", []).append(minibatch_loss)
            step_metrics.setdefault("critic_grad_norm", []).append(float(grad_norm))
        critic_s = time.time() - t0

        # 7b. policy update: epochs x minibatches x micro-batches, one optimiser step per minibatch
        minibatch_size = batch_size // args.num_minibatches
        for epoch in range(args.num_epochs):
            order = torch.randperm(batch_size, generator=torch.Generator().manual_seed(args.seed * 7919 + step * 31 + epoch)).to(device)
            for start in range(0, batch_size, minibatch_size):
                mb_rows, minibatch_loss = order[start : start + minibatch_size], 0.0
                mb_rows = mb_rows[attention_mask[mb_rows].sum(-1).argsort(stable=True)]  # similar lengths share a micro-batch: less padding
                num_tokens = global_tokens(mb_rows)
                for j in range(0, minibatch_size, args.micro_batch_size):
                    rows = mb_rows[j : j + args.micro_batch_size]
                    sync = j + args.micro_batch_size >= minibatch_size
                    with accelerator.no_sync(model) if not sync else contextlib.nullcontext():
                        with autocast():
                            logprobs, entropy = token_logprobs(model, input_ids[rows], attention_mask[rows], width, args.temperature, with_entropy=True, fp32_head=fp32_head)
                        old = logprobs.detach() if on_policy else old_logprobs[rows]
                        loss, metrics = policy_loss(logprobs, old, advantages[rows], completion_mask[rows], clip_eps=args.clip_eps, num_tokens=num_tokens)
                        accelerator.backward(loss)
                    minibatch_loss += loss.item()
                    metrics["entropy"] = masked_mean(entropy, completion_mask[rows])
                    if epoch == 0 and start == 0:  # sampler vs trainer log-prob gap, on the untouched policy
                        metrics["logprob_gap"] = masked_mean((logprobs.detach() - rollout_logprobs[rows]).abs(), completion_mask[rows])
                    for k, v in metrics.items():
                        step_metrics.setdefault(k, []).append(v)
                step_metrics.setdefault("loss", []).append(minibatch_loss)
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                if math.isfinite(float(grad_norm)) and math.isfinite(minibatch_loss):
                    optimizer.step()
                    bad_steps = 0
                else:  # a non-finite loss or gradient never reaches the weights
                    bad_steps += 1
                    step_metrics.setdefault("skipped_updates", []).append(1.0)
                    if bad_steps >= args.max_bad_steps:
                        raise SystemExit(f"step {step}: {bad_steps} consecutive updates with a non-finite loss or gradient; aborting")
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step_metrics.setdefault("grad_norm", []).append(float(grad_norm))
        train_s = time.time() - t0

        # 8. push the new weights into the rollout engine
        t0 = time.time()
        engine.update_weights(policy)
        weight_sync_s = time.time() - t0

        # 9. log
        lengths = completion_mask.sum(-1)
        grouped_rewards = rewards.view(-1, args.group_size)
        generated = float(lengths.sum())
        log = {f"train/{k}": sum(v) / len(v) for k, v in step_metrics.items() if k != "skipped_updates"}
        log |= {
            "train/reward": rewards.mean().item(),
            "train/accuracy": correct.mean().item(),
            "train/response_len": lengths.mean().item(),
            "train/truncation_rate": sum(c.finish_reason == "length" for c in completions) / batch_size,
            "train/frac_zero_adv_groups": (grouped_rewards.max(1).values == grouped_rewards.min(1).values).float().mean().item(),
            "train/skipped_updates": float(sum(step_metrics.get("skipped_updates", []))),
            "train/lr": scheduler.get_last_lr()[0],
            "train/critic_lr": critic_scheduler.get_last_lr()[0],
            "train/value": masked_mean(old_values, completion_mask),
            "train/return": masked_mean(returns, completion_mask),
            "train/raw_advantage": masked_mean(raw_advantages, completion_mask),
            "train/explained_var": 1.0 - masked_var(returns - old_values, completion_mask) / max(masked_var(returns, completion_mask), 1e-8),
            "time/rollout_s": rollout_s,
            "time/reward_s": reward_s,
            "time/old_logprobs_s": old_logprobs_s,
            "time/train_s": train_s,
            "time/critic_s": critic_s,
            **({"train/kl": masked_mean(old_logprobs - ref_logprobs, completion_mask)} if ref_model is not None else {}),
            "time/weight_sync_s": weight_sync_s,
            "time/tokens_per_s": generated / max(rollout_s, 1e-9),
            "time/train_tokens_per_s": float(attention_mask.sum()) * args.num_epochs / max(train_s, 1e-9),
        }
        log = {k: float(v) for k, v in zip(log, accelerator.reduce(torch.tensor(list(log.values()), device=device), "mean").tolist())}
        log["time/step_s"] = time.time() - t_step
        train_time += log["time/step_s"]
        log["time/elapsed_s"] = train_time
        log["memory/peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        tracker.log(log, step + 1)
        tracker.log_samples([{"prompt": problems[i // args.group_size]["prompt"], "completion": texts[i], "answer": golds[i], "reward": float(rewards[i])} for i in range(0, min(batch_size, args.log_samples * args.group_size), args.group_size)], step + 1)
        progress.set_postfix(reward=f"{log['train/reward']:.3f}", acc=f"{log['train/accuracy']:.3f}", len=f"{log['train/response_len']:.1f}")

        # 10. evaluate and checkpoint
        if (step + 1) % args.eval_every == 0 or step + 1 == args.total_steps:
            last_eval = run_eval(step + 1)
            if accelerator.is_main_process:
                progress.write(f"step {step + 1}: " + "  ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in last_eval.items() if not k.startswith("time")))
        if (step + 1) % args.save_every == 0 or step + 1 == args.total_steps or stop_signal:
            checkpoint(step + 1)
        if stop_signal:
            tracker.close()
            raise SystemExit(f"stopped by signal {stop_signal[0]} after step {step + 1}; checkpoint saved, continue with --resume")

    # SHARED: final model and one summary line (read by benchmarks/collect.py)
    if accelerator.is_main_process:
        policy.save_pretrained(run_dir / "final")
        tokenizer.save_pretrained(run_dir / "final")
        critic_model.save_pretrained(run_dir / "final_critic")  # ALGO LOGIC: the value model, for critic-based follow-ups
        key = f"eval/{eval_name}/mean@{eval_cfg.n}"
        summary = {"run": args.run_name, "steps": args.total_steps, "train_s": round(train_time, 1), "eval_start": first_eval.get(key), "eval_end": last_eval.get(key)}
        print("SUMMARY " + json.dumps(summary))
    tracker.close()


if __name__ == "__main__":
    main()
