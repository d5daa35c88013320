"""GRPO: Group Relative Policy Optimization, as in the paper.

Paper: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
Models", arXiv 2402.03300, §4.1 (objective restated as eq. 5 of DAPO, arXiv 2503.14476).

For each prompt q, sample a group of G completions o_1..o_G from π_old and score them with a verifier (R_i).

    advantage     Â_i = (R_i - mean_j R_j) / (std_j R_j + 1e-6)          sample std, same for every token of o_i
    ratio         r_{i,t} = π_θ(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | q, o_{i,<t})
    surrogate     ℓ_{i,t} = -min(r_{i,t} Â_i, clip(r_{i,t}, 1-ε, 1+ε) Â_i) + β · k3_{i,t}
    KL (k3)       k3_{i,t} = π_ref/π_θ - log(π_ref/π_θ) - 1                 unbiased, >= 0 (Schulman 2020)
    objective     L = (1/G) Σ_i (1/|o_i|) Σ_t ℓ_{i,t}                       per-sequence token mean, then mean

This is the parent of every critic-free script in algos/: `diff algos/grpo.py algos/<name>.py` shows the
other algorithm's delta. Differences from common re-implementations, on purpose: the per-sequence token
mean above (TRL's default is the DAPO token mean), and β = 0.04 with k3 in the loss (β = 0 loads no
reference model at all).

CPU, offline (the defaults: the shipped tiny model on the synthetic `arith` task, ~1 s per step):
    python algos/grpo.py
GPU, one process (vLLM colocated with the trainer; set the learning rate and token budget for the model):
    python algos/grpo.py --model Qwen/Qwen2.5-Math-1.5B --dataset math --template qwen-math \
        --rollout.backend vllm --learning-rate 1e-6 --max-new-tokens 3000 --prompts-per-step 128 \
        --group-size 8 --num-minibatches 4 --micro-batch-size 8 --eval.dataset math500 --track
GPU, several processes (each rank its own colocated engine; a prompt's group stays on one rank):
    accelerate launch --num_processes 8 algos/grpo.py <the flags above>
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
from transformers import AutoModelForCausalLM, AutoTokenizer

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
    # ALGO LOGIC: GRPO hyperparameters
    clip_eps: float = 0.2
    """ε, the PPO clip range of the ratio (GRPO eq. 3)"""
    kl_coef: float = 0.04
    """β, weight of the k3 KL to the frozen reference in the loss (DeepSeekMath §4.2; 0 = no reference model)"""
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
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    num_sequences: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss: clipped surrogate + β·k3, per-sequence token mean, summed and divided by ``num_sequences``.

    logprobs (B,T) with grad; old_logprobs, ref_logprobs (B,T) detached; advantages (B,) or (B,T);
    mask (B,T) 1 on generated tokens (EOS included). ``num_sequences`` is the size of the optimiser
    mini-batch (default B): passing it lets micro-batches accumulate to exactly the mini-batch loss.
    """
    mask = mask.float()
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # as verl: keeps exp finite
    ratio = torch.exp(log_ratio)
    per_token = torch.max(-adv * ratio, -adv * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps))
    metrics = {}
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        delta = ref_logprobs - logprobs
        k3 = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * k3
        metrics["kl"] = ((k3 * mask).sum() / mask.sum().clamp(min=1)).item()
    seq_loss = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # token mean within each sequence
    loss = seq_loss.sum() / (num_sequences or logprobs.shape[0])
    with torch.no_grad():
        clipped = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
        metrics["clip_frac"] = ((clipped.float() * mask).sum() / mask.sum().clamp(min=1)).item()
        metrics["ratio"] = ((ratio * mask).sum() / mask.sum().clamp(min=1)).item()
    return loss, metrics


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).item()


def main() -> None:
    args = tyro.cli(Args)
    # SHARED: set-up (flags, processes, run folder)
    if args.learning_rate is None:
        if args.model != "tiny":
            raise SystemExit("--learning-rate is required for a model other than 'tiny' (the tiny default 1e-4 would wreck a 1.5B model; papers use ~1e-6)")
        args.learning_rate = 1e-4
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0 for training rollouts (log-probs are of logits / temperature)")
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    rank, world = accelerator.process_index, accelerator.num_processes
    accelerator.print(f"{world} process(es), {accelerator.distributed_type.value}, device {accelerator.device}")
    if args.prompts_per_step % world:
        raise SystemExit(f"--prompts-per-step {args.prompts_per_step} must be divisible by the number of processes ({world})")
    compute_advantages(torch.zeros(2 * args.group_size), args.group_size)  # fail fast on a group size the method rejects
    local_prompts = args.prompts_per_step // world
    batch_size = local_prompts * args.group_size  # sequences per rank per step
    if batch_size % args.num_minibatches:
        raise SystemExit(f"{batch_size} sequences per process do not split into --num-minibatches {args.num_minibatches}")
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
    engine = make_engine(args.rollout, policy, tokenizer, model_path, args.seed + rank, args.max_prompt_tokens + args.max_new_tokens)

    start_step, cursor, train_time = 0, 0, 0.0  # train_time: seconds spent in steps, evaluation excluded
    tracker = Tracker(run_dir, args, args.track, args.wandb_project, enabled=accelerator.is_main_process)
    if args.resume and (ckpt := latest_checkpoint(run_dir)) is not None:
        state = load_checkpoint(ckpt)
        policy.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
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

        # 4. ALGO LOGIC: group-relative advantages
        advantages = compute_advantages(rewards, args.group_size)

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
        completion_mask, advantages, rollout_logprobs = completion_mask.to(device), advantages.to(device), rollout_logprobs.to(device)

        # 6. old log-probs (only when the batch is reused, otherwise the detached current ones are exact) and reference log-probs
        t0 = time.time()
        on_policy = args.num_epochs == 1 and args.num_minibatches == 1
        old_logprobs, ref_logprobs = None, None
        with torch.no_grad(), autocast():
            if not on_policy:
                old_logprobs = token_logprobs_batched(model, input_ids, attention_mask, width, args.temperature, args.micro_batch_size, fp32_head)
            if ref_model is not None:
                ref_logprobs = token_logprobs_batched(ref_model, input_ids, attention_mask, width, args.temperature, args.micro_batch_size, fp32_head)
        old_logprobs_s = time.time() - t0

        # 7. update: epochs x minibatches x micro-batches, one optimiser step per minibatch
        t0 = time.time()
        step_metrics: dict[str, list[float]] = {}
        minibatch_size = batch_size // args.num_minibatches
        for epoch in range(args.num_epochs):
            order = torch.randperm(batch_size, generator=torch.Generator().manual_seed(args.seed * 7919 + step * 31 + epoch)).to(device)
            for start in range(0, batch_size, minibatch_size):
                mb_rows, minibatch_loss = order[start : start + minibatch_size], 0.0
                mb_rows = mb_rows[attention_mask[mb_rows].sum(-1).argsort(stable=True)]  # similar lengths share a micro-batch: less padding
                for j in range(0, minibatch_size, args.micro_batch_size):
                    rows = mb_rows[j : j + args.micro_batch_size]
                    sync = j + args.micro_batch_size >= minibatch_size
                    with accelerator.no_sync(model) if not sync else contextlib.nullcontext():
                        with autocast():
                            logprobs, entropy = token_logprobs(model, input_ids[rows], attention_mask[rows], width, args.temperature, with_entropy=True, fp32_head=fp32_head)
                        old = logprobs.detach() if on_policy else old_logprobs[rows]
                        loss, metrics = policy_loss(
                            logprobs, old, advantages[rows], completion_mask[rows], clip_eps=args.clip_eps,
                            kl_coef=args.kl_coef, ref_logprobs=None if ref_logprobs is None else ref_logprobs[rows], num_sequences=minibatch_size,
                        )
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
            "time/rollout_s": rollout_s,
            "time/reward_s": reward_s,
            "time/old_logprobs_s": old_logprobs_s,
            "time/train_s": train_s,
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
        key = f"eval/{eval_name}/mean@{eval_cfg.n}"
        summary = {"run": args.run_name, "steps": args.total_steps, "train_s": round(train_time, 1), "eval_start": first_eval.get(key), "eval_end": last_eval.get(key)}
        print("SUMMARY " + json.dumps(summary))
    tracker.close()


if __name__ == "__main__":
    main()
