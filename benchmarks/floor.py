"""The bare model compute in one step of grpo.py's tiny default, to bound how fast any GRPO loop can be here.

    python benchmarks/floor.py            # writes benchmarks/results/floor.json and prints a table

One step of the tiny default is 16 `arith` prompts x G = 8 completions. Whatever the loop around it, a step must
(1) decode the completions one token at a time, (2) run the frozen reference over every sequence (kl_coef 0.04),
(3) run the policy forward and backward over every sequence, (4) take an AdamW step. This script times those model
calls alone, on a batch made by one real rollout, with grpo.py's precision (bf16 autocast where the CPU has bf16
instructions, fp32 weights) and eager attention, each part repeated --repeats times, interleaved:

* decode, per-call floor: L forwards of ONE sequence with a KV cache, L = the longest completion of the rollout.
  Decoding needs L sequential forwards and each costs at least the framework's per-call time, so no decoder built
  on the Hugging Face forward can beat this, whatever its batching.
* decode, batched: the prefill of the 16 prompts plus L forwards of all 128 rows (no sampling, no early exit).
* the HF engine's whole rollout (sampling, early exit of finished rows), for reference.
* reference forward, policy forward+backward: token_logprobs over the padded batch, micro-batches of 64 as grpo.py.
* AdamW step with gradient clipping.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.reporting import portable_path  # noqa: E402
from common.data import TINY_MODEL_DIR, format_prompt, load_problems  # noqa: E402
from common.logprobs import token_logprobs  # noqa: E402
from common.rollout import HFEngine, left_pad  # noqa: E402
from common.tracking import hardware  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "floor.json"))
    args = parser.parse_args()

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)

    def load():
        return AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32, attn_implementation="eager")

    policy, ref = load(), load().eval().requires_grad_(False)
    bf16 = (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    )  # grpo.py's --mixed-precision auto
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)  # noqa: E731
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-12)  # a real step that leaves the weights (almost) alone
    problems = load_problems("arith", "train")[: args.prompts]
    prompts = [tokenizer(format_prompt(p["prompt"], "chat", tokenizer))["input_ids"] for p in problems]
    engine = HFEngine(policy, tokenizer)
    completions = engine.generate(
        prompts, args.group_size, args.max_new_tokens, 1.0, 1.0, seed=list(range(args.prompts))
    )
    longest = max(len(c.token_ids) for c in completions)
    rows = len(completions)
    prompt_ids, prompt_mask = left_pad(
        [p for p in prompts for _ in range(args.group_size)], tokenizer.pad_token_id, "cpu"
    )
    completion_ids = torch.full((rows, longest), tokenizer.pad_token_id)
    completion_mask = torch.zeros((rows, longest), dtype=torch.long)
    for i, c in enumerate(completions):
        completion_ids[i, : len(c.token_ids)], completion_mask[i, : len(c.token_ids)] = torch.tensor(c.token_ids), 1
    input_ids, attention_mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    micro = [slice(s, s + args.micro_batch_size) for s in range(0, rows, args.micro_batch_size)]

    @torch.no_grad()
    def decode(batch: int) -> None:
        ids, mask = left_pad(prompts if batch > 1 else prompts[:1], tokenizer.pad_token_id, "cpu")
        cache = DynamicCache(config=policy.config)
        policy(input_ids=ids, attention_mask=mask, use_cache=True, past_key_values=cache, logits_to_keep=1)
        if batch > len(prompts):
            cache.batch_repeat_interleave(batch // len(prompts))
            mask = mask.repeat_interleave(batch // len(prompts), dim=0)
        token, position = torch.full((len(mask), 1), 5), torch.full((len(mask), 1), mask.shape[1])
        for t in range(longest):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            policy(
                input_ids=token, attention_mask=mask, position_ids=position + t, past_key_values=cache, use_cache=True
            )

    def reference() -> None:
        with torch.no_grad(), autocast():
            for mb in micro:
                token_logprobs(ref, input_ids[mb], attention_mask[mb], longest, 1.0)

    def policy_update() -> None:
        for mb in micro:
            with autocast():
                logprobs, _ = token_logprobs(policy, input_ids[mb], attention_mask[mb], longest, 1.0, with_entropy=True)
            ((logprobs * completion_mask[mb]).sum() / rows).backward()

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    parts = {
        "decode, per-call floor (1 row)": lambda: decode(1),
        f"decode, batched ({rows} rows)": lambda: decode(rows),
        "HF engine rollout (grpo.py's)": lambda: engine.generate(
            prompts, args.group_size, args.max_new_tokens, 1.0, 1.0, seed=list(range(args.prompts))
        ),
        "reference forward": reference,
        "policy forward + backward": policy_update,
        "AdamW step + clip": optimizer_step,
    }
    times: dict[str, list[float]] = {name: [] for name in parts}
    policy_update()  # gradients exist before the first optimizer step is timed
    for name, fn in parts.items():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in parts.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    floor = (
        med["decode, per-call floor (1 row)"]
        + med["reference forward"]
        + med["policy forward + backward"]
        + med["AdamW step + clip"]
    )
    batched = (
        med[f"decode, batched ({rows} rows)"]
        + med["reference forward"]
        + med["policy forward + backward"]
        + med["AdamW step + clip"]
    )
    result = {
        "hardware": hardware(),
        "torch_threads": torch.get_num_threads(),
        "bf16_autocast": bf16,
        "config": {**vars(args), "out": portable_path(args.out)},  # no machine path in committed results
        "batch": {
            "rows": rows,
            "prompt_tokens": prompt_ids.shape[1],
            "longest_completion": longest,
            "mean_completion": completion_mask.sum().item() / rows,
        },
        "median_s": med,
        "min_s": {name: min(ts) for name, ts in times.items()},
        "all_s": times,
        "floor_s": floor,
        "floor_batched_decode_s": batched,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{hardware()}, bf16 autocast {bf16}; "
        f"batch {rows} rows x ({prompt_ids.shape[1]} prompt + {longest} completion) tokens"
    )
    print("| part | median s | min s |\n|---|---|---|")
    for name in parts:
        print(f"| {name} | {med[name]:.3f} | {min(times[name]):.3f} |")
    print(f"| **floor: per-call decode + reference + forward/backward + AdamW** | {floor:.3f} | |")
    print(f"| same with batched decode | {batched:.3f} | |")


if __name__ == "__main__":
    main()
