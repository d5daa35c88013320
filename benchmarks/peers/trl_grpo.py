"""Peer row: TRL's GRPOTrainer (TRL 1.16, CPU, no vLLM) on exactly the work of our algos/grpo.py tiny default.

Runs in its own venv (TRL is not a dependency of the project):
    python -m venv .venv-trl && .venv-trl/bin/pip install -r benchmarks/peers/requirements-trl.txt
    .venv-trl/bin/python benchmarks/peers/trl_grpo.py --seed 1 --output-dir runs/tiny --run-name trl_grpo__1
It takes the flags benchmarks/run.py passes (--seed, --output-dir, --run-name) and the grpo.py flags that apply
(same names and defaults), and writes the same run folder: config.json (exp_name "trl_grpo"), metrics.jsonl with
grpo.py's keys, samples.jsonl, final/ and a closing `SUMMARY {json}` line, so benchmarks/collect.py puts it in the
same table and plots.

Same work as grpo.py (checked against TRL 1.16.0's source, trl/trainer/grpo_trainer.py and grpo_config.py):
* model, data, prompt, reward: the shipped tiny model (a local folder; the KL reference is loaded from the same
  folder), the `arith` train split, conversational prompts [{"role": "user", "content": q}] that TRL renders with
  the tokenizer's chat template (checked at start-up: rendered text and token ids equal common.data.format_prompt
  with the 'chat' template), and the `exact` verifier of common.verifiers on the decoded completion
  (tokenizer.batch_decode(completion_ids, skip_special_tokens=True), as grpo.py).
* batch: 16 prompts x G=8 = 128 completions of at most 40 new tokens per optimiser step. In TRL 1.16,
  `generation_batch_size = per_device_train_batch_size x processes x steps_per_generation` and
  `steps_per_generation` defaults to `gradient_accumulation_steps`; `_prepare_inputs` generates once every
  `steps_per_generation x num_iterations` micro-steps and hands out one `per_device_train_batch_size` slice per
  micro-step. So per_device_train_batch_size=64 (= --micro-batch-size) with gradient_accumulation_steps=2 means one
  generation of 128 completions feeds the 2 micro-batches of exactly one optimiser step. The script asserts this
  (generation_batch_size, steps_per_generation, and 128 new completions between consecutive optimiser steps).
* sampling: HF generate, temperature 1, top_p 1, top_k 0 (TRL's default is already 0 = off), min_p off,
  repetition_penalty 1, EOS id from the generation config (the same single id grpo.py uses).
* loss: `loss_type="grpo"` = per-sequence token mean, then mean over the sequences of a micro-batch, divided by
  gradient_accumulation_steps, so the 2 equal micro-batches of 64 give grpo.py's (1/128) sum over sequences;
  `beta=0.04` with TRL's k3 estimator exp(ref-logp) - (ref-logp) - 1 added per token before that mean (as ours);
  `epsilon=0.2` (epsilon_high defaults to it: symmetric PPO clip); `num_iterations=1` and generation aligned with
  the optimiser step, so TRL skips the old-log-prob forward and uses the detached current log-probs (as ours);
  `scale_rewards="group"`: (r - group mean) / (group sample std + eps), Bessel-corrected like ours;
  `importance_sampling_level="token"`, `mask_truncated_completions=False`, no entropy bonus, no top-entropy mask.
* optimiser: torch.optim.AdamW(lr 1e-4, betas (0.9, 0.99), eps 1e-8, weight decay 0) and the LambdaLR warm-up
  min(1, (step+1)/10) of grpo.py, passed to the trainer through `optimizers=`; grad-norm clip 1.0 (the trainer's).
  Not TRL's `lr_scheduler_type="constant_with_warmup"`: transformers' version gives lr 0 on the first optimiser step
  (factor step/warmup from step 0) and reaches full lr one step later than grpo.py; and transformers 5 defaults
  to the fused AdamW.
* precision: fp32 weights and eager attention, as grpo.py on the CPU; bf16 autocast when grpo.py uses it
  (--mixed-precision, same flag and default). `--attn-implementation sdpa` gives TRL the kernel transformers
  picks by default (what a TRL user gets): on this CPU its bf16 backward is several times slower. TRL's bf16=True
  is accelerate's autocast, which also covers TRL's generation (grpo.py samples in fp32), so `--mixed-precision no`
  on both compares the loops without it.
* defaults overridden because TRL's differ: learning_rate (1e-6), gradient_checkpointing (True -> False), use_cpu,
  max_completion_length (512), per_device_train_batch_size (8), beta (0), loss_type ("dapo"), save_strategy
  (checkpoints -> "no"), logging_steps (10 -> 1), report_to none,
  tqdm and the per-step log printer off (this script prints grpo.py's progress bar instead).
* data order (default --data-order ours): the train set is handed to TRL already in grpo.py's order
  (common.data.prompt_batch with the same seed) and TRL's sampler does not shuffle (shuffle_dataset=False), so step
  k trains on the same 16 prompts as grpo.py's step k. --data-order trl uses TRL's own RepeatSampler shuffle.
* sampling seed (default --match-sampling-seeds): before each rollout the global torch RNG is seeded exactly as
  grpo.py's HF engine does (seed * 1_000_003 + step), so with equal weights both sample the same tokens.
  Neither choice changes the work or the speed, only which prompts and random draws are used.
* evaluation: common.evaluate.evaluate with common.rollout.HFEngine on the trainer's model, grpo.py's EvalConfig
  defaults and seed 12345, at step 0, every --eval-every steps and at the end, in a TrainerCallback; its time is
  excluded from time/step_s and time/elapsed_s.

Remaining differences (none changes the objective beyond float rounding on this task):
* advantage epsilon: TRL divides by (std + 1e-4), grpo.py by (std + 1e-6). With 0/1 rewards a non-constant group of
  8 has std >= 0.35, so advantages differ by < 3e-4 relative; constant groups get 0 either way.
* log-probs: TRL scores completions with its fused, chunked LM head (trl.trainer.utils.add_fused_lm_head: log-probs
  and entropy computed in tiles without the full logits tensor, custom backward), in the autocast dtype; grpo.py
  (common.rollout.token_logprobs) runs the head in fp32 from the decoder's hidden states, in chunks. TRL's own fp32
  head (cast_lm_head_to_fp32) refuses tied embeddings, which the tiny model has, so it stays off: under bf16 the two
  differ by the head's rounding (~0.02 nats per token on this model); the cost of a 279-token head is negligible.
* position ids: TRL's training forward passes no position_ids (positions 0..T-1 counted over the left padding),
  grpo.py passes positions from the attention mask (as generate does). Every `arith` prompt is 14 tokens, so there
  is no left padding and no difference here; on data with prompts of different lengths TRL's trainer would see
  shifted positions for the shorter prompts.
* micro-batch composition: TRL shuffles the 128 completions before splitting them into the 2 micro-batches,
  grpo.py sorts its seeded permutation by length (similar lengths share a micro-batch); the summed gradient is the same.
* truncation flag: TRL counts a completion as truncated when its last token is neither EOS nor pad; grpo.py when it
  has no EOS. They differ only if a completion's 40th token is the pad token.
* no non-finite-step guard: grpo.py skips an optimiser step whose loss or gradient is not finite; the Trainer
  steps anyway. No checkpoints or --resume (a benchmark run is short and is rerun from scratch).
* RNG streams other than the rollout sampling (e.g. TRL's micro-batch shuffle) differ, so runs agree in
  distribution, not bit for bit, after the first update.

Logged keys (grpo.py's names): train/reward, train/accuracy, train/response_len, train/truncation_rate,
train/frac_zero_adv_groups, train/clip_frac (TRL clip_ratio/region_mean), train/entropy, train/kl, train/grad_norm
(before clipping), train/lr (after the scheduler step, as grpo.py), train/loss (TRL's full-batch loss; grpo.py's
train/loss is the mean of its micro-batch parts, i.e. this divided by the number of micro-batches), time/step_s
(one optimiser step: generation, reward, reference forward, forward/backward, optimiser; evaluation excluded),
time/elapsed_s (sum of step_s), time/rollout_s (HF generate), time/reward_s, time/train_s (the rest of the step),
time/tokens_per_s (generated tokens / rollout_s, grpo.py's definition), time/step_tokens_per_s (generated tokens /
step_s), memory/peak_rss_gb; eval/<dataset>/... rows as grpo.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import tyro
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
from common.data import dataset_info, format_prompt, load_problems, prompt_batch, resolve_model_path  # noqa: E402
from common.evaluate import EvalConfig, evaluate  # noqa: E402
from common.rollout import HFEngine  # noqa: E402
from common.tracking import Tracker, seed_everything  # noqa: E402
from common.verifiers import compute_rewards  # noqa: E402


@dataclass
class Args:
    # experiment
    exp_name: str = "trl_grpo"
    """name of this experiment (the peer's name in tables)"""
    seed: int = 1
    """seed of the experiment (data order, sampling, TRL's own RNG)"""
    run_name: str = ""
    """run folder name under output_dir ('' = {exp_name}__{dataset}__{seed})"""
    output_dir: str = "runs"
    """where run folders are written"""
    # model and data
    model: str = "tiny"
    """hub id or local folder of the policy ('tiny' = the shipped offline model in common/tiny_model)"""
    dataset: str = "arith"
    """training dataset (see common/data.py) or jsonl:<path>"""
    template: str = ""
    """prompt template ('' = the dataset's default); 'chat' goes to TRL as a conversation, others as rendered text"""
    # rollout
    total_steps: int = 60
    """number of rollout + update steps (optimiser steps)"""
    prompts_per_step: int = 16
    """prompts sampled per step"""
    group_size: int = 8
    """completions per prompt (G; TRL's num_generations)"""
    max_new_tokens: int = 40
    """token budget per completion (TRL's max_completion_length)"""
    temperature: float = 1.0
    """sampling temperature (TRL also divides the trainer's logits by it)"""
    top_p: float = 1.0
    """nucleus sampling threshold for rollouts"""
    # optimisation
    learning_rate: float | None = None
    """AdamW learning rate (None = 1e-4 for the tiny model; required for any other model)"""
    warmup_steps: int = 10
    """linear warm-up steps (optimiser steps), then constant"""
    adam_beta2: float = 0.99
    """AdamW β2"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping threshold"""
    micro_batch_size: int = 64
    """sequences per forward/backward (TRL's per_device_train_batch_size; the rest is gradient accumulation)"""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """as grpo.py: bf16 autocast over fp32 weights ('auto' = on for CPUs with bf16 instructions); TRL's bf16 flag"""
    attn_implementation: str = "eager"
    """attention kernel: 'eager' as grpo.py on the CPU; 'sdpa' is transformers' default, i.e. what TRL users get"""
    # ALGO LOGIC: GRPO hyperparameters (TRL's epsilon and beta)
    clip_eps: float = 0.2
    """ε, the PPO clip range of the ratio"""
    kl_coef: float = 0.04
    """β, weight of the k3 KL to the frozen reference in the loss (0 = no reference model)"""
    # peer alignment
    data_order: Literal["ours", "trl"] = "ours"
    """'ours': the prompts of grpo.py's step k at step k; 'trl': TRL's own shuffled sampler"""
    match_sampling_seeds: bool = True
    """seed the torch RNG before each rollout as grpo.py's HF engine does"""
    # evaluation, logging
    eval_every: int = 10
    """evaluate on the held-out set every this many steps (and before the first and after the last)"""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """evaluation protocol"""
    log_samples: int = 4
    """completions written to samples.jsonl per step"""


@dataclass
class StepRecord:
    """What the reward function and the rollout hook saw since the last optimiser step."""

    rollout_s: float = 0.0
    reward_s: float = 0.0
    completions: int = 0
    generated_tokens: int = 0
    rewards: list[float] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    decode_mismatches: int = 0


def main() -> None:
    args = tyro.cli(Args)
    if args.learning_rate is None:
        if args.model != "tiny":
            raise SystemExit("--learning-rate is required for a model other than 'tiny'")
        args.learning_rate = 1e-4
    batch_size = args.prompts_per_step * args.group_size
    if batch_size % args.micro_batch_size:
        raise SystemExit(
            f"{batch_size} completions per step do not split into --micro-batch-size {args.micro_batch_size}"
        )
    args.run_name = args.run_name or f"{args.exp_name}__{args.dataset.replace('/', '_')}__{args.seed}"
    run_dir = Path(args.output_dir) / args.run_name
    if (run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"{run_dir} already holds a run (this peer script does not resume); choose another --run-name")
    seed_everything(args.seed)

    # imported here so that --help works fast and the module imports without TRL installed; outside the TRL peer's
    # own environment the run stops with one line naming it, not a ModuleNotFoundError traceback
    try:
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        raise SystemExit(
            f"trl_grpo.py runs in the TRL peer environment, not this one ({err}): python -m venv .venv-trl && "
            ".venv-trl/bin/pip install -r benchmarks/peers/requirements-trl.txt (see this script's docstring)"
        ) from err
    import datasets
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback

    transformers.logging.set_verbosity_warning()
    datasets.disable_progress_bars()

    # SHARED: data, verifier, templates (as grpo.py)
    info = dataset_info(args.dataset)
    train_problems = load_problems(args.dataset, "train")
    eval_name = args.eval.dataset or args.dataset
    eval_info = dataset_info(eval_name)
    eval_problems = load_problems(eval_name, eval_info.eval_split)
    template = args.template or info.default_template
    eval_template = args.eval.template or eval_info.default_template
    eval_cfg = dataclasses.replace(args.eval, max_new_tokens=args.eval.max_new_tokens or args.max_new_tokens)

    model_path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # as grpo.py on the CPU: fp32 weights, eager attention by default (TRL builds the reference model the same way)
    use_bf16 = args.mixed_precision == "bf16" or (
        args.mixed_precision == "auto" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    )
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation=args.attn_implementation
    )

    def trl_prompt(question: str):
        # 'chat' is exactly the tokenizer's chat template over one user turn: let TRL apply it
        return (
            [{"role": "user", "content": question}]
            if template == "chat"
            else format_prompt(question, template, tokenizer)
        )

    if args.data_order == "ours":  # grpo.py's prompt stream, consumed in order by a non-shuffling sampler
        order = prompt_batch(len(train_problems), 0, args.total_steps * args.prompts_per_step, args.seed)
    else:
        order = range(len(train_problems))
    rows = [{"prompt": trl_prompt(train_problems[i]["prompt"]), "answer": train_problems[i]["answer"]} for i in order]
    train_dataset = datasets.Dataset.from_list(rows)

    record = StepRecord()

    def reward_fn(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
        # our decode of the generated ids, as grpo.py (TRL's own decode, in `completions`, is only cross-checked)
        t0 = time.time()
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        theirs = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        record.decode_mismatches += sum(a != b for a, b in zip(texts, theirs))
        outputs = compute_rewards(info.reward_fn, texts, list(answer))
        record.rewards += [o.reward for o in outputs]
        record.correct += [bool(o.correct) for o in outputs]
        for i in range(0, min(len(texts), args.log_samples * args.group_size), args.group_size):
            question = prompts[i][-1]["content"] if isinstance(prompts[i], list) else prompts[i]
            record.samples.append(
                {"prompt": question, "completion": texts[i], "answer": answer[i], "reward": float(outputs[i].reward)}
            )
        record.reward_s += time.time() - t0
        return [o.reward for o in outputs]

    reward_fn.__name__ = info.reward_fn

    class PeerGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with two hooks around generation: grpo.py's sampling seed, and timing/counting."""

        def _generate_single_turn(self, prompt_ids, *rest, **kwargs):
            training = self.model.training
            if training and args.match_sampling_seeds:
                torch.manual_seed(args.seed * 1_000_003 + self.state.global_step)  # = grpo.py's engine seed (1 process)
            t0 = time.time()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *rest, **kwargs)
            if training:
                record.rollout_s += time.time() - t0
                record.completions += len(completion_ids)
                record.generated_tokens += sum(len(c) for c in completion_ids)
            return completion_ids, logprobs

    config = GRPOConfig(
        output_dir=str(run_dir / "trl"),
        seed=args.seed,
        max_steps=args.total_steps,
        # batch: one generation of prompts_per_step x group_size completions per optimiser step
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=batch_size // args.micro_batch_size,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        shuffle_dataset=args.data_order == "trl",
        # sampling
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        use_vllm=False,
        # loss: GRPO paper (per-sequence token mean), k3 KL in the loss, symmetric clip, on-policy
        loss_type="grpo",
        beta=args.kl_coef,
        epsilon=args.clip_eps,
        num_iterations=1,
        scale_rewards="group",
        importance_sampling_level="token",
        mask_truncated_completions=False,
        # optimiser (the optimizer and scheduler objects passed below are what runs; these mirror them)
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=args.warmup_steps,
        adam_beta1=0.9,
        adam_beta2=args.adam_beta2,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        # CPU, grpo.py's precision, no checkpoints, quiet
        use_cpu=True,
        bf16=use_bf16,
        gradient_checkpointing=False,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
        log_completions=False,
    )
    if config.generation_batch_size != batch_size or config.steps_per_generation != config.gradient_accumulation_steps:
        raise SystemExit(
            f"TRL would generate {config.generation_batch_size} completions every {config.steps_per_generation} "
            f"micro-steps, not {batch_size} per optimiser step"
        )

    # grpo.py's optimiser and schedule, exactly
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.learning_rate, betas=(0.9, args.adam_beta2), weight_decay=args.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))

    tracker = Tracker(run_dir, args, track=False, project="")
    config_path = run_dir / "config.json"
    saved = json.loads(config_path.read_text())
    saved["peer"] = {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "grpo_config": {
            k: getattr(config, k)
            for k in (
                "loss_type",
                "beta",
                "epsilon",
                "epsilon_high",
                "num_iterations",
                "scale_rewards",
                "num_generations",
                "max_completion_length",
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "generation_batch_size",
                "steps_per_generation",
                "temperature",
                "top_p",
                "top_k",
                "shuffle_dataset",
                "gradient_checkpointing",
                "bf16",
                "use_cpu",
                "max_grad_norm",
                "learning_rate",
                "warmup_steps",
                "adam_beta2",
                "weight_decay",
            )
        },
    }
    config_path.write_text(json.dumps(saved, indent=2, default=str))

    key = f"eval/{eval_name}/mean@{eval_cfg.n}"

    class PeerCallback(TrainerCallback):
        """grpo.py's metrics rows and held-out evaluation, with evaluation time kept out of the step timings."""

        def __init__(self):
            self.first_eval: dict = {}
            self.last_eval: dict = {}
            self.elapsed = 0.0
            self.mark = 0.0
            self.progress = None

        def run_eval(self, model, step: int) -> dict:
            t0 = time.time()
            metrics = evaluate(
                HFEngine(model, tokenizer),
                tokenizer,
                eval_problems,
                eval_info.reward_fn,
                eval_template,
                eval_cfg,
                seed=12345,
                name=eval_name,
            )
            metrics["time/eval_s"] = time.time() - t0
            tracker.log(metrics, step)
            return metrics

        def on_train_begin(self, targs, state, control, model=None, **kwargs):
            self.first_eval = self.last_eval = self.run_eval(model, 0)
            self.progress = tqdm(total=args.total_steps, desc=args.exp_name)
            self.t_start = self.mark = time.time()

        def on_log(self, targs, state, control, logs=None, model=None, **kwargs):
            if not logs or "reward" not in logs:  # the trainer's closing summary, not a step
                return
            step = state.global_step
            step_s = time.time() - self.mark
            self.elapsed += step_s
            if record.completions != batch_size:
                raise RuntimeError(
                    f"optimiser step {step} followed {record.completions} new completions, "
                    f"expected exactly {batch_size}"
                )
            if record.decode_mismatches:
                print(
                    "[trl_grpo] warning: TRL's decoded completion text differed from ours "
                    f"in {record.decode_mismatches} completions"
                )
            rewards = torch.tensor(record.rewards)
            log = {
                "train/reward": rewards.mean().item(),
                "train/accuracy": sum(record.correct) / len(record.correct),
                "train/response_len": logs["completions/mean_length"],
                "train/truncation_rate": logs["completions/clipped_ratio"],
                "train/frac_zero_adv_groups": logs["frac_reward_zero_std"],
                "train/clip_frac": logs["clip_ratio/region_mean"],
                "train/entropy": logs["entropy"],
                "train/grad_norm": logs["grad_norm"],
                "train/loss": logs["loss"],
                "train/lr": scheduler.get_last_lr()[0],
            }
            if "kl" in logs:
                log["train/kl"] = logs["kl"]
            log |= {
                "time/rollout_s": record.rollout_s,
                "time/reward_s": record.reward_s,
                "time/train_s": step_s - record.rollout_s - record.reward_s,
                "time/tokens_per_s": record.generated_tokens / max(record.rollout_s, 1e-9),
                "time/step_tokens_per_s": record.generated_tokens / max(step_s, 1e-9),
                "time/step_s": step_s,
                "time/elapsed_s": self.elapsed,
                "memory/peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
            }
            tracker.log(log, step)
            tracker.log_samples(record.samples, step)
            self.progress.update(1)
            self.progress.set_postfix(
                reward=f"{log['train/reward']:.3f}",
                acc=f"{log['train/accuracy']:.3f}",
                len=f"{log['train/response_len']:.1f}",
                s=f"{step_s:.2f}",
            )
            record.__init__()  # a fresh record for the next step
            if step % args.eval_every == 0 or step == args.total_steps:
                self.last_eval = self.run_eval(model, step)
                self.progress.write(
                    f"step {step}: "
                    + "  ".join(
                        f"{k.split('/')[-1]} {v:.3f}" for k, v in self.last_eval.items() if not k.startswith("time")
                    )
                )
            self.mark = time.time()  # the evaluation above is not part of the next step

        def on_train_end(self, targs, state, control, **kwargs):
            if self.progress is not None:
                self.progress.close()

    callback = PeerCallback()
    trainer = PeerGRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=config,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        callbacks=[callback],
        optimizers=(optimizer, scheduler),
    )
    trainer.remove_callback(PrinterCallback)

    # the prompt TRL will tokenize is ours: same rendered text and the same token ids
    first = [train_problems[i]["prompt"] for i in list(order)[: args.prompts_per_step]]
    trl_ids, _, _ = trainer._tokenize_prompts([trl_prompt(q) for q in first])
    for q, ids in zip(first, trl_ids):
        text = format_prompt(q, template, tokenizer)
        if list(ids) != tokenizer(text)["input_ids"]:
            raise SystemExit(
                f"TRL tokenizes the prompt {q!r} differently from format_prompt(..., {template!r}): "
                f"{list(ids)} vs {tokenizer(text)['input_ids']}"
            )
        if (
            template == "chat"
            and tokenizer.apply_chat_template(trl_prompt(q), tokenize=False, add_generation_prompt=True) != text
        ):
            raise SystemExit(f"the chat template renders {q!r} differently from format_prompt")

    trainer.train()

    if trainer.state.global_step != args.total_steps:
        raise SystemExit(f"TRL stopped after {trainer.state.global_step} optimiser steps, expected {args.total_steps}")
    if (run_dir / "trl").is_dir() and not any((run_dir / "trl").iterdir()):
        (run_dir / "trl").rmdir()  # the Trainer's output_dir; nothing is saved there with save_strategy "no"
    model.save_pretrained(run_dir / "final")
    tokenizer.save_pretrained(run_dir / "final")
    summary = {
        "run": args.run_name,
        "steps": args.total_steps,
        "wall_s": round(time.time() - callback.t_start, 1),
        "train_s": round(callback.elapsed, 1),
        "eval_start": callback.first_eval.get(key),
        "eval_end": callback.last_eval.get(key),
    }
    print("SUMMARY " + json.dumps(summary))
    tracker.close()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
