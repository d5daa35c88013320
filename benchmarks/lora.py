"""LoRA against full fine-tuning on the tiny default (grpo.py, arith, 2-core CPU): a learning-rate sweep, then seeds.

    PYTHONPATH=. .venv/bin/python benchmarks/lora.py             # results/lora/: results.json, table.md, mean4.png
    PYTHONPATH=. .venv/bin/python benchmarks/lora.py --quick     # smoke: 3 steps, one rate each, one seed

One invocation, sequential runs of ``algos/grpo.py`` with its defaults (60 steps, held-out mean@4 every 10):

1. **sweep** on seed 101: full fine-tuning and ``--lora.rank`` 1 and 8 (α = 32, every linear layer), each over its
   learning-rate grid ("LoRA Without Regret" puts LoRA's best rate ~10x full fine-tuning's). The best rate per
   configuration is the one with the highest mean of the held-out mean@4 over the run's evaluations after step 0 (the
   area under its curve: a rate that learns fast and stays there).
2. **seeds** 101-103 at each configuration's best rate (seed 101's run is the sweep's).

The judging seeds of the claims testbed (1-5) are not used. Reported per configuration: final held-out mean@4 (mean
and range over seeds), seconds per step, and the trainable parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.reporting import commit_label, write_results  # noqa: E402
from common.tracking import git_state, hardware  # noqa: E402

CONFIGS = {  # name: (extra flags, learning-rate grid)
    "full": ([], [3e-5, 1e-4, 3e-4]),
    "lora-r8": (["--lora.rank", "8"], [3e-4, 1e-3, 3e-3]),
    "lora-r1": (["--lora.rank", "1"], [3e-4, 1e-3, 3e-3]),
}
SEEDS = (101, 102, 103)


def run_grpo(out: Path, name: str, flags: list[str]) -> list[dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(REPO / "algos" / "grpo.py"), "--output-dir", str(out), "--run-name", name]
    cmd += ["--save-every", "0", *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def summarise(rows: list[dict]) -> dict:
    evals = [(r["step"], r["eval/arith/mean@4"]) for r in rows if "eval/arith/mean@4" in r]
    steps = [r["time/step_s"] for r in rows if "time/step_s" in r]
    return {
        "mean4": evals,
        "final": evals[-1][1],
        "area": statistics.mean(v for s, v in evals if s > 0),
        "seconds_per_step": statistics.median(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "lora"))
    parser.add_argument("--quick", action="store_true", help="3 steps, the middle rate of each grid, seed 101 only")
    args = parser.parse_args()
    started = time.time()
    base = ["--total-steps", "3", "--eval-every", "3"] if args.quick else []
    work = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    sweep: dict[str, dict[str, dict]] = {}
    for config, (flags, grid) in CONFIGS.items():
        sweep[config] = {}
        for lr in grid[1:2] if args.quick else grid:
            name = f"{config}_lr{lr:g}_s{SEEDS[0]}"
            res = summarise(
                run_grpo(work, name, [*base, *flags, "--learning-rate", f"{lr:g}", "--seed", str(SEEDS[0])])
            )
            sweep[config][f"{lr:g}"] = res
            print(f"sweep {config} lr {lr:g}: final mean@4 {res['final']:.3f}, area {res['area']:.3f}", flush=True)
    best = {config: max(rates, key=lambda lr: rates[lr]["area"]) for config, rates in sweep.items()}
    seeds: dict[str, list[dict]] = {}
    for config, (flags, _) in CONFIGS.items():
        seeds[config] = [sweep[config][best[config]] | {"seed": SEEDS[0]}]
        for seed in [] if args.quick else SEEDS[1:]:
            name = f"{config}_lr{best[config]}_s{seed}"
            rows = run_grpo(work, name, [*base, *flags, "--learning-rate", best[config], "--seed", str(seed)])
            seeds[config].append(summarise(rows) | {"seed": seed})
            print(f"seed {seed} {config} lr {best[config]}: final mean@4 {seeds[config][-1]['final']:.3f}", flush=True)

    from common.memory import lora_params, model_shape

    tiny = str(REPO / "common" / "tiny_model")
    trainable = {"full": model_shape(tiny).params}
    trainable |= {c: lora_params(tiny, int(f[1]), ("all-linear",)) for c, (f, _) in CONFIGS.items() if f}
    result = {
        "hardware": hardware(),
        "commit": commit_label(git_state()),
        "command": "PYTHONPATH=. .venv/bin/python benchmarks/lora.py" + (" --quick" * args.quick),
        "wall_clock_s": round(time.time() - started, 1),
        "sweep": sweep,
        "best_learning_rate": best,
        "seeds": seeds,
        "trainable_params": trainable,
    }
    out = Path(args.out)
    table = write_results(
        out, result, "# LoRA against full fine-tuning (grpo.py defaults on the tiny model, arith)"
    ) + [
        "Learning-rate sweep (seed 101; held-out mean@4 final / mean over the evaluations after step 0):",
        "",
        "| configuration | " + " | ".join(f"rate {i + 1}" for i in range(3)) + " |",
        "|---|---|---|---|",
    ]
    for config, rates in sweep.items():
        cells = [f"{lr}: {r['final']:.3f} / {r['area']:.3f}" for lr, r in rates.items()]
        table.append(f"| {config} | " + " | ".join(cells) + " |")
    table += [
        "",
        f"Seeds {', '.join(str(s) for s in SEEDS[: len(seeds['full'])])} at each configuration's best rate:",
        "",
        "| configuration | trainable params | learning rate | final mean@4 (mean, min-max) | s/step |",
        "|---|---|---|---|---|",
    ]
    for config, runs in seeds.items():
        finals = [r["final"] for r in runs]
        table.append(
            f"| {config} | {trainable[config]:,} | {best[config]} | {statistics.mean(finals):.3f} "
            f"({min(finals):.3f}-{max(finals):.3f}) | {statistics.median(r['seconds_per_step'] for r in runs):.2f} |"
        )
    (out / "table.md").write_text("\n".join(table) + "\n")
    plot(seeds, best, out)
    print("\n".join(table))


def plot(seeds: dict, best: dict, out: Path) -> None:
    """Held-out mean@4 against steps, mean over seeds, one line per configuration at its best rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for config, runs in seeds.items():
        steps = [s for s, _ in runs[0]["mean4"]]
        ax.plot(
            steps,
            [statistics.mean(r["mean4"][i][1] for r in runs) for i in range(len(steps))],
            marker="o",
            label=f"{config} (lr {best[config]})",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("arith held-out mean@4")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "mean4.png", dpi=100)


if __name__ == "__main__":
    main()
