"""Padding-free packing (``--micro-batch-tokens``) against padded micro-batches: tokens computed, attention work, CPU
seconds per update step, and the memory planner's peak per GPU.

    OMP_NUM_THREADS=2 python benchmarks/packing.py   # ~3 min on 2 idle cores; writes benchmarks/results/packing/
    python benchmarks/packing.py --quick             # smoke run: small batches, 1 repeat, under a minute

What it measures, on two length distributions:

* ``arith-pad``: real rollouts of the shipped tiny model (``common/tiny_model``, HF engine, seed ``--seed``) on the
  claims testbed's free-length task (``common/tasks.py``), grpo.py's tiny default batch (16 prompts x 8) at the claims
  suite's 64 new tokens. ``--arith-model runs/claims/_models/arith-pad`` samples from the arith-pad warm start
  instead (``benchmarks/suites/claims.toml`` builds it), whose lengths vary more.
* ``long tail``: the flagship GPU command's batch (grpo.py's docstring: Qwen2.5-Math-1.5B, 128 prompts x 8, 4
  minibatches, ``--micro-batch-size 8``, 3,000 new tokens) with lengths drawn from a fit to published figures (no GPU
  here to sample them). Source: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
  (Dr. GRPO, https://arxiv.org/abs/2503.20783), Figure 1 (right; the same figure is
  https://github.com/sail-sg/understand-r1-zero/blob/main/assets/drgrpo.png): over training, GRPO's mean output
  length rises from ~390 to ~1,000 tokens (Dr. GRPO's from ~320 to ~520). The caption does not name the model; the
  paper's GRPO-vs-Dr. GRPO runs train Qwen2.5-Math-1.5B, and its repository's script for that model
  (``examples/qwen2.5-math-1.5b.sh``) samples 8 completions of at most 3,000 tokens for 128 prompts per step. Only
  the mean can be read off the figure (no spread, no truncation rate), so the completion lengths are a **parametric
  fit**: a lognormal of shape ``--tail-sigma`` (0.7, an assumption; the tables add 0.5 and 1.0) whose mean after
  truncation at 3,000 tokens (a truncated sample is 3,000 long) is the published ~1,000 (end of GRPO training,
  ``--tail-mean``), and ~390 (its start) beside it; the implied truncation rate is reported. Prompt lengths are
  MATH-style, also an assumption: 30 tokens of qwen-math template plus a question whose length in characters follows
  a lognormal fitted to the 500 MATH training questions of
  https://github.com/sail-sg/oat-zero/blob/main/data/math_train_500.json (median 140.5 characters, log-sd 0.82), at
  3.3 characters per token (Qwen2.5's tokenizer is not available offline), capped at the 512-token prompt budget.
  The 8 samples of a prompt share its prompt; their completion lengths are drawn independently.

Sections (``--sections``):

* ``tokens``: token positions each layout feeds the model per update step, over useful (attended) tokens. The rows go
  through grpo.py's own loop: a seeded random order, ``--num-minibatches`` minibatches, rows sorted by length within
  each, ``common.packing.micro_batches``, and each micro-batch's positions counted from ``common.packing.model_layout``
  (padded: rows x (longest prompt + longest completion) of the micro-batch, the columns some row uses; packed: the
  bin's flat row, so a padding tail, if one is ever added, is counted).
* attention work, apart from the token counts: sum of L^2 over the sequences (what flash-attention's varlen path
  computes for packed bins), against rows x width^2 of each padded micro-batch and against (bin tokens)^2, what eager
  or sdpa attention computes for a packed bin through its dense block-diagonal mask (the CPU path, and CUDA without
  flash-attn: ``common.packing.attention_implementation``).
* ``timing``: seconds per update step (forward + backward of ``common.logprobs.token_logprobs`` over one minibatch,
  gradient accumulation over its micro-batches, no optimiser step), grpo.py's CPU precision (fp32 weights, bf16
  autocast where the CPU has bf16 instructions, fp32 LM head, eager attention), padded and packed interleaved
  (ABAB..., ``--repeats`` each after one warm-up each), median and ratio. On arith-pad's rollouts with the tiny model,
  and on a random-weight Qwen2 shape (hidden 256, 4 layers, 4 heads, 2 KV heads, MLP 1408, vocabulary 4096) with the
  long tail scaled down to run in minutes on 2 cores: every prompt and completion length divided by
  ``--scale`` (8; rounded up), the token budget divided likewise (16384 / 8 = 2048), one minibatch of
  ``--scaled-prompts`` x 8 rows (8 x 8 = 64 instead of 256) at ``--micro-batch-size 8``.
* ``planner``: ``common.memory.plan_memory`` for the flagship command on an 80 GB card, padded and with
  ``--micro-batch-tokens 16384``: whatever the planner says, printed as it says it.

Outputs under ``--out``: results.json (hardware, threads, seed, git commit, command, wall-clock, every number),
table.md, lengths.png (the length distributions).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.reporting import portable_command, portable_path, pyplot  # noqa: E402
from common.logprobs import token_logprobs  # noqa: E402
from common.packing import micro_batches, model_layout  # noqa: E402
from common.tracking import git_state, hardware  # noqa: E402

FLAGSHIP = (  # grpo.py's GPU command (its module docstring), as the planner sees it
    "--model Qwen/Qwen2.5-Math-1.5B --dataset math --template qwen-math --rollout.backend vllm --learning-rate 1e-6 "
    "--max-new-tokens 3000 --prompts-per-step 128 --group-size 8 --num-minibatches 4 --micro-batch-size 8"
)
FLAGSHIP_BATCH = {"prompts": 128, "group_size": 8, "num_minibatches": 4, "micro_batch_size": 8, "max_new_tokens": 3000}
MAX_PROMPT_TOKENS = 512  # grpo.py's --max-prompt-tokens default, the flagship's prompt budget
# Dr. GRPO Figure 1 (right): GRPO's mean output length at the start and at the end of training (Qwen2.5-Math-1.5B)
PUBLISHED_MEANS = {"start of GRPO training": 390.0, "end of GRPO training": 1000.0}
MATH_QUESTION_CHARS = (140.5, 0.82)  # median and log-sd of oat-zero's 500 MATH training questions, in characters
CHARS_PER_TOKEN = 3.3  # assumed for Qwen2.5's tokenizer on MATH text (not measured: no Qwen tokenizer offline)
TEMPLATE_TOKENS = 30  # assumed: the qwen-math system prompt and chat markup around a question
# the random-weight shape the scaled long tail is timed on: at lengths / 8 its per-token shares of LM head (~0.2 of the
# body's matmuls), MLP and attention (~5% at the sorted padded widths, ~80% through a 2048-token dense mask) are close
# to Qwen2.5-1.5B's at full length (0.18; ~7%, ~107% at 16384 tokens), so the scaled step weighs them as the real one
SMALL_QWEN2 = {
    "hidden_size": 256,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}


# ------------------------------------------------------------------------------------------ lengths
def clipped_lognormal_mean(mu: float, sigma: float, clip: float) -> float:
    """E[min(X, clip)] for X ~ lognormal(mu, sigma): a completion that reaches the budget is cut there."""
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    z = (math.log(clip) - mu) / sigma
    return math.exp(mu + sigma**2 / 2) * phi(z - sigma) + clip * (1 - phi(z))


def fit_mu(mean: float, sigma: float, clip: float) -> float:
    """The lognormal location whose mean after clipping at ``clip`` is ``mean`` (bisection; the clipped mean rises
    monotonically with mu)."""
    low, high = -5.0, math.log(clip) + 10 * sigma
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if clipped_lognormal_mean(mid, sigma, clip) < mean else (low, mid)
    return (low + high) / 2


def long_tail_lengths(
    prompts: int, group_size: int, mean: float, sigma: float, max_new: int, seed: int
) -> tuple[list[int], list[int]]:
    """(prompt lengths, completion lengths) of ``prompts`` x ``group_size`` rows, a group's rows contiguous: MATH-style
    prompts shared within a group, completions from the clipped lognormal fitted to ``mean`` (module docstring)."""
    rng = random.Random(seed)
    median_chars, log_sd = MATH_QUESTION_CHARS
    prompt_lengths, completion_lengths = [], []
    mu = fit_mu(mean, sigma, max_new)
    for _ in range(prompts):
        question = rng.lognormvariate(math.log(median_chars), log_sd) / CHARS_PER_TOKEN
        prompt = min(MAX_PROMPT_TOKENS, TEMPLATE_TOKENS + max(1, round(question)))
        for _ in range(group_size):
            prompt_lengths.append(prompt)
            completion_lengths.append(min(max_new, max(1, round(rng.lognormvariate(mu, sigma)))))
    return prompt_lengths, completion_lengths


def rows_from_lengths(prompt_lengths: list[int], completion_lengths: list[int]) -> tuple[torch.Tensor, int]:
    """(attention_mask (B, P + W), W): rows laid out as ``pack_rollout`` makes them, [left-padded prompt |
    right-padded completion], P and W the longest prompt and completion."""
    prompt_width, width = max(prompt_lengths), max(completion_lengths)
    mask = torch.zeros(len(prompt_lengths), prompt_width + width, dtype=torch.long)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        mask[row, prompt_width - p : prompt_width + c] = 1
    return mask, width


def scaled(lengths: list[int], scale: int) -> list[int]:
    return [math.ceil(n / scale) for n in lengths]


# ------------------------------------------------------------------------------------------ tokens and attention
def update_plan(
    attention_mask: torch.Tensor,
    num_minibatches: int,
    micro_batch_size: int,
    micro_batch_tokens: int,
    seed: int,
    epoch_seed: int = 0,
) -> list[list[torch.Tensor]]:
    """The row indices of each forward of one update step, per minibatch, as grpo.py builds them: a seeded random
    order, ``num_minibatches`` slices, rows sorted by length within each, then ``micro_batches``."""
    batch = attention_mask.shape[0]
    generator = torch.Generator().manual_seed(seed * 7919 + epoch_seed)
    order = torch.randperm(batch, generator=generator)
    size = batch // num_minibatches
    plan = []
    for start in range(0, batch, size):
        rows = order[start : start + size]
        rows = rows[attention_mask[rows].sum(-1).argsort(stable=True)]  # similar lengths together, as the scripts
        plan.append([part for part, _ in micro_batches(rows, attention_mask, micro_batch_size, micro_batch_tokens)])
    return plan


def account(
    attention_mask: torch.Tensor,
    completion_width: int,
    num_minibatches: int,
    micro_batch_size: int,
    micro_batch_tokens: int,
    seed: int,
) -> dict:
    """Token positions and attention work of one update step (every minibatch once), counted from the layouts the
    model would be given (``model_layout``), against the useful tokens (those attended: prompt and completion)."""
    packed = micro_batch_tokens > 0
    ids = torch.zeros_like(attention_mask)  # token ids do not change a layout
    fed = attention_padded = varlen = forwards = largest = 0
    for minibatch in update_plan(attention_mask, num_minibatches, micro_batch_size, micro_batch_tokens, seed):
        for rows in minibatch:
            layout = model_layout(ids[rows], attention_mask[rows], completion_width, packed=packed)
            shape = layout.inputs["input_ids"].shape  # padded: (rows, width); packed: (1, bin tokens)
            forwards += 1
            fed += shape[0] * shape[1]
            largest = max(largest, shape[0] * shape[1])
            attention_padded += shape[0] * shape[1] ** 2  # rows x width^2, or (bin tokens)^2 through a dense mask
            varlen += int((attention_mask[rows].sum(-1) ** 2).sum())  # sum of L^2: each sequence alone
    useful = int(attention_mask.sum())
    return {
        "forwards": forwards,
        "tokens_fed": fed,
        "useful_tokens": useful,
        "tokens_per_useful": fed / useful,
        "largest_forward_tokens": largest,
        # padded: rows x width^2 per micro-batch; packed: (bin tokens)^2, what eager/sdpa compute through the mask
        "attention_dense": attention_padded,
        # sum of L^2 over sequences: the work of per-sequence attention (flash-attention's varlen path when packed)
        "attention_sum_l2": varlen,
    }


# ------------------------------------------------------------------------------------------ rollouts and timing
def arith_rollouts(model_dir: str, prompts: int, group_size: int, max_new_tokens: int, seed: int):
    """(policy, input_ids, attention_mask, completion_mask, completion_width) of one grpo.py-style rollout on
    ``arith-pad`` with the HF engine, rows as ``pack_rollout`` makes them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.bookkeeping import pack_rollout
    from common.data import dataset_info, format_prompt, load_problems
    from common.rollout import HFEngine

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    problems = random.Random(seed).sample(load_problems("arith-pad", "train"), prompts)
    template = dataset_info("arith-pad").default_template
    prompt_ids = [tokenizer(format_prompt(p["prompt"], template, tokenizer))["input_ids"] for p in problems]
    engine = HFEngine(model, tokenizer)
    seeds = [(seed * 1_000_003 + i) * group_size for i in range(prompts)]  # one seed per prompt, as grpo.py
    completions = engine.generate(prompt_ids, group_size, max_new_tokens, 1.0, 1.0, seeds)
    input_ids, attention_mask, completion_mask, _ = pack_rollout(
        prompt_ids, completions, group_size, tokenizer.pad_token_id, torch.device("cpu")
    )
    model.train()
    return model, input_ids, attention_mask, completion_mask, completion_mask.shape[1]


def small_qwen2(seed: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(**SMALL_QWEN2, attention_dropout=0.0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").train()


def time_layouts(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_width: int,
    micro_batch_size: int,
    micro_batch_tokens: int,
    repeats: int,
    bf16: bool,
) -> dict[str, list[float]]:
    """Seconds of one update step over the whole batch as one minibatch, padded and packed, interleaved."""
    completion_mask = attention_mask[:, -completion_width:]
    rows_all = torch.arange(input_ids.shape[0])
    order = rows_all[attention_mask.sum(-1).argsort(stable=True)]
    budgets = {"padded": 0, "packed": micro_batch_tokens}

    def update(tokens: int) -> None:
        for rows, _ in micro_batches(order, attention_mask, micro_batch_size, tokens):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logprobs, _ = token_logprobs(
                    model,
                    input_ids[rows],
                    attention_mask[rows],
                    completion_width,
                    1.0,
                    with_entropy=True,
                    fp32_head=True,
                    packed=tokens > 0,
                )
            (logprobs * completion_mask[rows]).sum().div(len(order)).backward()
        model.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {name: [] for name in budgets}
    for tokens in budgets.values():  # warm-up: allocator, autocast caches, first-call overheads
        update(tokens)
    for _ in range(repeats):
        for name, tokens in budgets.items():  # ABAB...: the machine's drift hits both layouts alike
            t0 = time.perf_counter()
            update(tokens)
            times[name].append(time.perf_counter() - t0)
    return times


# ------------------------------------------------------------------------------------------ planner
def load_grpo():
    spec = importlib.util.spec_from_file_location("grpo_for_packing_benchmark", REPO / "algos" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def planner_rows(micro_batch_tokens: int, card_gb: float) -> dict[str, dict]:
    """The planner's verdict for the flagship command, padded and packed, through its public API (as --dry-run)."""
    import tyro

    from common import memory
    from common.runtime import context_budget

    grpo = load_grpo()
    out = {}
    for name, extra in (("padded", []), ("packed", ["--micro-batch-tokens", str(micro_batch_tokens)])):
        flags = shlex.split(FLAGSHIP) + extra
        args = tyro.cli(grpo.Args, args=flags)
        config = memory.local_config(args.model)
        _, max_model_len = context_budget(args, config)
        plan = memory.plan_memory(args, config, max_model_len, world=1, card_gb=card_gb, backend="vllm")
        out[name] = {
            "flags": " ".join(flags),
            "peak_gb": plan.peak / memory.GB,
            "update_peak_gb": plan.update_peak / memory.GB,
            "rollout_peak_gb": plan.rollout_peak / memory.GB,
            "verdict": plan.verdict,
            "fixes": plan.fixes,
            "plan": memory.format_plan(plan).replace(f"{REPO}/", ""),  # committed results name no machine path
        }
    return out


# ------------------------------------------------------------------------------------------ report
def markdown(result: dict) -> str:
    lines = [
        "# Padding-free packing vs padded micro-batches",
        "",
        f"{result['hardware']}; bf16 autocast {result['bf16_autocast']}; seed {result['seed']}; commit "
        f"{str(result['git']['git_commit'])[:10]}{' (dirty)' if result['git']['git_dirty'] else ''}; "
        f"wall-clock {result['wall_clock_s']:.0f} s" + ("; **--quick smoke run**" if result["config"]["quick"] else ""),
        "",
        f"Regenerate: `{result['command']}` (see the script's docstring for the sources and assumptions).",
    ]
    if "tokens" in result:
        lines += [
            "",
            "## Tokens computed per useful token (one update step)",
            "",
            "| batch | layout | forwards | token positions fed | useful tokens | fed / useful | largest forward |",
            "|---|---|---|---|---|---|---|",
        ]
        for case in result["tokens"]:
            for name in ("padded", "packed"):
                r = case[name]
                lines.append(
                    f"| {case['label']} | {name} ({case['settings'][name]}) | {r['forwards']} | {r['tokens_fed']:,} | "
                    f"{r['useful_tokens']:,} | {r['tokens_per_useful']:.3f} | {r['largest_forward_tokens']:,} |"
                )
        lines += [
            "",
            "## Attention work (apart from token counts), relative to the sum of L^2 over sequences",
            "",
            "| batch | padded: rows x width^2 | packed, per-sequence kernel (varlen): sum L^2 | packed through a dense "
            "mask (eager / sdpa): sum (bin tokens)^2 |",
            "|---|---|---|---|",
        ]
        for case in result["tokens"]:
            base = case["packed"]["attention_sum_l2"]
            lines.append(
                f"| {case['label']} | {case['padded']['attention_dense'] / base:.3f} | "
                f"{case['packed']['attention_sum_l2'] / base:.3f} | {case['packed']['attention_dense'] / base:.3f} |"
            )
        if result.get("tail_fit"):
            lines += ["", "Long-tail fits (lognormal clipped at the token budget):", ""]
            lines += ["| published mean | shape sigma | fitted median | implied truncation rate |", "|---|---|---|---|"]
            for fit in result["tail_fit"]:
                lines.append(
                    f"| {fit['mean']:.0f} | {fit['sigma']} | {fit['median']:.0f} | {fit['truncation_rate']:.2%} |"
                )
    if "timing" in result:
        lines += [
            "",
            "## Seconds per update step (forward + backward over one minibatch, CPU), interleaved",
            "",
            "| batch | rows | padded, median s | packed, median s | packed / padded | fed / useful (padded, packed) | "
            "repeats |",
            "|---|---|---|---|---|---|---|",
        ]
        for case in result["timing"]:
            lines.append(
                f"| {case['label']} | {case['rows']} | {case['median_s']['padded']:.3f} | "
                f"{case['median_s']['packed']:.3f} | {case['ratio']:.2f} | "
                f"{case['tokens_per_useful']['padded']:.2f}, {case['tokens_per_useful']['packed']:.2f} | "
                f"{len(case['all_s']['padded'])} |"
            )
    if "planner" in result:
        lines += [
            "",
            "## The memory planner for the flagship command (80 GB card)",
            "",
            "| layout | peak per GPU | update phase | rollout phase | verdict |",
            "|---|---|---|---|---|",
        ]
        for name, r in result["planner"].items():
            lines.append(
                f"| {name} | {r['peak_gb']:.1f} GB | {r['update_peak_gb']:.1f} GB | {r['rollout_peak_gb']:.1f} GB | "
                f"{r['verdict']} |"
            )
        if result["planner"]["padded"]["peak_gb"] == result["planner"]["packed"]["peak_gb"]:
            lines += ["", "The planner gives the same peak for both: it does not plan --micro-batch-tokens."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    panels = [c for c in result.get("tokens", []) if c.get("completion_lengths")]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 3.8), squeeze=False)
    for ax, case in zip(axes[0], panels):
        lengths = case["completion_lengths"]
        low, high = min(lengths), max(lengths)
        bins = range(low, high + 2) if high - low < 60 else 60  # one bar per length when there are few
        ax.hist(lengths, bins=bins, color="tab:blue")
        ax.axvline(case["max_new_tokens"], color="tab:red", linestyle="--", label=f"budget {case['max_new_tokens']}")
        ax.set_title(
            f"{case['label']}\nmean {statistics.mean(lengths):.0f}, median {statistics.median(lengths):.0f}", fontsize=9
        )
        ax.set_xlabel("completion tokens")
        ax.set_ylabel("rows")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def command_line(argv: list[str] | None) -> str:
    """The command as run, without machine paths; the thread count is part of what the timings mean."""
    threads = os.environ.get("OMP_NUM_THREADS")
    words = ["python", "benchmarks/packing.py", *(sys.argv[1:] if argv is None else argv)]
    return (f"OMP_NUM_THREADS={threads} " if threads else "") + portable_command(shlex.join(words))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "packing"), help="output folder")
    parser.add_argument("--sections", nargs="+", default=["tokens", "timing", "planner"])
    parser.add_argument("--quick", action="store_true", help="smoke run: small batches, 1 repeat")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7, help="timed update steps per layout (after a warm-up)")
    parser.add_argument("--arith-model", default=str(REPO / "common" / "tiny_model"))
    parser.add_argument("--arith-prompts", type=int, default=16, help="grpo.py's --prompts-per-step default")
    parser.add_argument("--arith-max-new-tokens", type=int, default=64, help="the claims suite's arith-pad budget")
    parser.add_argument("--arith-micro-batch-size", type=int, default=64, help="grpo.py's --micro-batch-size default")
    parser.add_argument("--arith-micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="the flagship's packed budget")
    parser.add_argument("--tail-mean", type=float, default=PUBLISHED_MEANS["end of GRPO training"])
    parser.add_argument("--tail-sigma", type=float, default=0.7, help="assumed lognormal shape (none is published)")
    parser.add_argument("--scale", type=int, default=8, help="long-tail lengths and budget divided by this for timing")
    parser.add_argument("--scaled-prompts", type=int, default=8, help="prompts (x 8 samples) in the timed long tail")
    parser.add_argument("--card-gb", type=float, default=80.0)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.arith_prompts, args.scaled_prompts, args.scale = 1, 4, 2, 16
    t_start = time.time()
    out = Path(args.out)
    bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()  # grpo.py's auto on CPU
    git = git_state()
    result: dict = {
        "hardware": hardware(),
        "torch_threads": torch.get_num_threads(),
        "bf16_autocast": bf16,
        "seed": args.seed,
        "git": git,
        "command": command_line(argv),
        "config": {**vars(args), "out": portable_path(args.out), "arith_model": portable_path(args.arith_model)},
        "flagship": FLAGSHIP,
        "sources": {
            "completion_mean": "Liu et al. 2025, arXiv:2503.20783, Figure 1 (right); "
            "https://github.com/sail-sg/understand-r1-zero/blob/main/assets/drgrpo.png",
            "setting": "https://github.com/sail-sg/understand-r1-zero/blob/main/examples/qwen2.5-math-1.5b.sh",
            "prompt_chars": "https://github.com/sail-sg/oat-zero/blob/main/data/math_train_500.json",
        },
    }
    fb = FLAGSHIP_BATCH
    arith = None
    if "tokens" in args.sections or "timing" in args.sections:
        arith = arith_rollouts(
            args.arith_model, args.arith_prompts, 8, args.arith_max_new_tokens, args.seed
        )  # (model, input_ids, attention_mask, completion_mask, completion_width)

    if "tokens" in args.sections:
        cases = []
        _, _, mask, completion_mask, width = arith
        settings = {
            "padded": f"{args.arith_micro_batch_size} rows",
            "packed": f"{args.arith_micro_batch_tokens} tokens",
        }
        cases.append(
            {
                "label": f"arith-pad rollouts ({args.arith_prompts} x 8, 1 minibatch)",
                "settings": settings,
                "padded": account(mask, width, 1, args.arith_micro_batch_size, 0, args.seed),
                "packed": account(
                    mask, width, 1, args.arith_micro_batch_size, args.arith_micro_batch_tokens, args.seed
                ),
                "completion_lengths": completion_mask.sum(-1).long().tolist(),
                "max_new_tokens": args.arith_max_new_tokens,
            }
        )
        result["tail_fit"] = []
        means = sorted({args.tail_mean, *PUBLISHED_MEANS.values()}, reverse=True)
        for mean in means:
            for sigma in sorted({args.tail_sigma, 0.5, 1.0}) if mean == args.tail_mean else [args.tail_sigma]:
                prompts, completions = long_tail_lengths(
                    fb["prompts"], fb["group_size"], mean, sigma, fb["max_new_tokens"], args.seed
                )
                mask, width = rows_from_lengths(prompts, completions)
                mu = fit_mu(mean, sigma, fb["max_new_tokens"])
                z = (math.log(fb["max_new_tokens"]) - mu) / sigma
                result["tail_fit"].append(
                    {
                        "mean": mean,
                        "sigma": sigma,
                        "median": math.exp(mu),
                        "truncation_rate": 0.5 * math.erfc(z / math.sqrt(2)),
                        "sample_mean": statistics.mean(completions),
                        "sample_truncated": sum(c == fb["max_new_tokens"] for c in completions) / len(completions),
                    }
                )
                main_case = mean == args.tail_mean and sigma == args.tail_sigma
                micro, minibatches = fb["micro_batch_size"], fb["num_minibatches"]
                cases.append(
                    {
                        "label": f"long tail, mean {mean:.0f}, sigma {sigma} ({fb['prompts']} x 8, 4 minibatches)",
                        "settings": {"padded": f"{micro} rows", "packed": f"{args.micro_batch_tokens} tokens"},
                        "padded": account(mask, width, minibatches, micro, 0, args.seed),
                        "packed": account(mask, width, minibatches, micro, args.micro_batch_tokens, args.seed),
                        "completion_lengths": completions if main_case else None,
                        "prompt_lengths": prompts if main_case else None,
                        "max_new_tokens": fb["max_new_tokens"],
                    }
                )
        result["tokens"] = cases
        for case in cases:
            print(
                f"tokens | {case['label']}: fed/useful padded {case['padded']['tokens_per_useful']:.3f}, packed "
                f"{case['packed']['tokens_per_useful']:.3f}; attention / sum L^2: padded "
                f"{case['padded']['attention_dense'] / case['packed']['attention_sum_l2']:.2f}, packed dense mask "
                f"{case['packed']['attention_dense'] / case['packed']['attention_sum_l2']:.2f}"
            )

    if "timing" in args.sections:
        timing = []
        model, input_ids, mask, _, width = arith
        runs = [
            (
                f"arith-pad rollouts, tiny model ({args.arith_micro_batch_size} rows / "
                f"{args.arith_micro_batch_tokens} tokens)",
                model,
                input_ids,
                mask,
                width,
                args.arith_micro_batch_size,
                args.arith_micro_batch_tokens,
            )
        ]
        prompts, completions = long_tail_lengths(
            args.scaled_prompts, fb["group_size"], args.tail_mean, args.tail_sigma, fb["max_new_tokens"], args.seed
        )
        tail_mask, tail_width = rows_from_lengths(scaled(prompts, args.scale), scaled(completions, args.scale))
        generator = torch.Generator().manual_seed(args.seed)
        tail_ids = torch.randint(3, SMALL_QWEN2["vocab_size"], tail_mask.shape, generator=generator) * tail_mask
        budget = args.micro_batch_tokens // args.scale
        runs.append(
            (
                f"long tail / {args.scale}, random Qwen2 h256 x 4 layers ({fb['micro_batch_size']} rows / "
                f"{budget} tokens)",
                small_qwen2(args.seed),
                tail_ids,
                tail_mask,
                tail_width,
                fb["micro_batch_size"],
                budget,
            )
        )
        for label, model, ids, mask, width, micro, tokens in runs:
            times = time_layouts(model, ids, mask, width, micro, tokens, args.repeats, bf16)
            median = {name: statistics.median(ts) for name, ts in times.items()}
            case = {
                "label": label,
                "rows": int(mask.shape[0]),
                "useful_tokens": int(mask.sum()),
                "median_s": median,
                "all_s": times,
                "ratio": median["packed"] / median["padded"],
                "tokens_per_useful": {
                    "padded": account(mask, width, 1, micro, 0, args.seed)["tokens_per_useful"],
                    "packed": account(mask, width, 1, micro, tokens, args.seed)["tokens_per_useful"],
                },
            }
            timing.append(case)
            print(
                f"timing | {label}: padded {median['padded']:.3f} s, packed {median['packed']:.3f} s "
                f"(packed / padded {case['ratio']:.2f}; {case['rows']} rows, {case['useful_tokens']} tokens)"
            )
        result["timing"] = timing

    if "planner" in args.sections:
        result["planner"] = planner_rows(args.micro_batch_tokens, args.card_gb)
        for name, r in result["planner"].items():
            print(f"planner | {name}: {r['flags']}\n{r['plan']}")

    result["wall_clock_s"] = time.time() - t_start
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "table.md").write_text(markdown(result))
    plot(result, out / "lengths.png")
    print(f"wrote {portable_path(str(out))}/results.json, table.md, lengths.png in {result['wall_clock_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
