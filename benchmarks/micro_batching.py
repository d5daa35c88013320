"""Padding in the learning step: micro-batches of rows in random order vs rows sorted by length.

    python benchmarks/micro_batching.py        # writes benchmarks/results/micro_batching.json and prints a table

The tiny task's completions all stop at ~18 tokens, so it cannot show what a reasoning run's spread of lengths
costs. This script builds one learning batch with such a spread on the tiny model: 64 rows, a 14-token prompt and
completion lengths drawn from a log-normal (median 60 tokens, clipped to 8..240, the model's context is 256), in
micro-batches of 8. It counts the token positions each layout feeds the model and times the policy's
forward+backward (token_logprobs, grpo.py's precision) for:

* whole-batch width: every micro-batch padded to the batch's longest row (the scripts before length sorting and
  per-micro-batch trimming; token count only, the code no longer runs this way);
* random order: rows in the scripts' random order, each micro-batch cut to its own longest row;
* sorted: rows sorted by length within the mini-batch (what the scripts do now), each micro-batch cut likewise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.reporting import portable_path  # noqa: E402
from common.data import TINY_MODEL_DIR  # noqa: E402
from common.logprobs import token_logprobs  # noqa: E402
from common.tracking import hardware  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=14)
    parser.add_argument("--median-completion", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "micro_batching.json"))
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32, attn_implementation="eager")
    bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    lengths = (
        (torch.randn(args.rows, generator=generator) * 0.8 + torch.log(torch.tensor(args.median_completion)))
        .exp()
        .round()
        .clamp(8, 240)
        .long()
    )
    width = int(lengths.max())
    input_ids = torch.randint(3, model.config.vocab_size, (args.rows, args.prompt_tokens + width), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, n in enumerate(lengths.tolist()):
        attention_mask[row, args.prompt_tokens + n :] = 0
    random_order = torch.randperm(args.rows, generator=generator)
    layouts = {
        "random order": random_order,
        "sorted": random_order[attention_mask[random_order].sum(-1).argsort(stable=True)],
    }

    def positions(order: torch.Tensor) -> int:
        return sum(
            len(rows) * (args.prompt_tokens + int(lengths[rows].max())) for rows in order.split(args.micro_batch_size)
        )

    def learn(order: torch.Tensor) -> None:
        for rows in order.split(args.micro_batch_size):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logprobs, _ = token_logprobs(
                    model, input_ids[rows], attention_mask[rows], width, 1.0, with_entropy=True
                )
            (logprobs * attention_mask[rows, args.prompt_tokens :]).sum().div(args.rows).backward()
        model.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {name: [] for name in layouts}
    for order in layouts.values():  # warm-up
        learn(order)
    for _ in range(args.repeats):
        for name, order in layouts.items():
            t0 = time.perf_counter()
            learn(order)
            times[name].append(time.perf_counter() - t0)
    counts = {"whole-batch width": args.rows * (args.prompt_tokens + width)} | {
        name: positions(order) for name, order in layouts.items()
    }
    real = int(attention_mask.sum())
    result = {
        "hardware": hardware(),
        "bf16_autocast": bf16,
        "config": {**vars(args), "out": portable_path(args.out)},  # no machine path in committed results
        "completion_lengths": lengths.tolist(),
        "real_tokens": real,
        "token_positions": counts,
        "median_s": {name: statistics.median(ts) for name, ts in times.items()},
        "all_s": times,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{hardware()}, bf16 autocast {bf16}; {args.rows} rows, micro-batches of {args.micro_batch_size}, "
        f"completions {int(lengths.min())}-{width} tokens (median {int(lengths.median())}); {real} real tokens"
    )
    print("| layout | token positions fed to the model | forward+backward, median s |\n|---|---|---|")
    for name, count in counts.items():
        print(
            f"| {name} | {count} ({count / real:.2f}x the real tokens) | {statistics.median(times[name]):.3f} |"
            if name in times
            else f"| {name} | {count} ({count / real:.2f}x the real tokens) | not run |"
        )


if __name__ == "__main__":
    main()
