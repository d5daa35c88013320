"""Run a benchmark suite: expand its manifest (algorithm x flags x seed) into script invocations and run them.

    python benchmarks/run.py tiny                 # every run of benchmarks/suites/tiny.toml not yet done
    python benchmarks/run.py tiny --seeds 1 --jobs 1 --only grpo dapo
    python benchmarks/run.py tiny --rerun         # run again even where results exist
    python benchmarks/run.py gpu-small --dry-run  # print the commands only

A manifest's [[setup]] entries run first, once: a command that builds what the runs need (e.g. a warm-started model),
skipped when the path it `creates` exists. Each run writes runs/<suite>/<label>__<seed>/ (the scripts' usual run
folder) plus bench.json: the exact command, git commit, dirty flag and the uncommitted paths, threads, start/end
time, wall-clock and exit code. A run whose bench.json records exit code 0 is skipped unless --rerun. Runs go in
parallel (--jobs), each pinned to cores // jobs threads through OMP_NUM_THREADS so that parallel runs do not
oversubscribe the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from common.tracking import git_state  # noqa: E402


@dataclass
class Run:
    label: str  # name in tables and plots
    seed: int
    command: list[str]
    run_dir: Path


def load_suite(name: str) -> dict:
    path = REPO / "benchmarks" / "suites" / f"{name}.toml"
    if not path.exists():
        available = sorted(p.stem for p in path.parent.glob("*.toml"))
        raise SystemExit(f"unknown suite {name!r}; available: {available}")
    return tomllib.loads(path.read_text())


def expand(
    suite_name: str, suite: dict, seeds: list[int] | None, only: list[str] | None, output_root: Path
) -> list[Run]:
    """Every (run entry, seed) pair as a command line; entries may set label, script, python, flags, seeds."""
    runs = []
    for entry in suite["runs"]:
        label = entry.get("label", entry["algo"])
        if only and label not in only and entry["algo"] not in only:
            continue
        script = REPO / entry.get("script", f"algos/{entry['algo']}.py")
        python = str(REPO / entry["python"]) if "python" in entry else sys.executable
        if not Path(python).exists():  # a peer's own environment (e.g. .venv-trl) that this machine lacks
            print(f"skipping {label}: {python} does not exist (see {entry.get('script', '')}'s docstring to create it)")
            continue
        for seed in seeds or entry.get("seeds", suite["seeds"]):
            run_dir = output_root / suite_name / f"{label}__{seed}"
            prefix = list(suite.get("launcher", [python]))  # e.g. ["accelerate", "launch", "--num_processes", "8"]
            cmd = [
                *prefix,
                str(script),
                "--seed",
                str(seed),
                "--output-dir",
                str(run_dir.parent),
                "--run-name",
                run_dir.name,
            ]
            runs.append(Run(label, seed, cmd + list(suite.get("flags", [])) + list(entry.get("flags", [])), run_dir))
    # seed-major order: every entry's seed 1 first, so a partial suite is complete for one seed, and timing
    # comparisons (ours vs a peer) are interleaved in time rather than run in blocks
    return sorted(runs, key=lambda run: run.seed)


def done(run: Run) -> bool:
    record = run.run_dir / "bench.json"
    return record.exists() and json.loads(record.read_text()).get("exit_code") == 0


def execute(run: Run, threads: int, git: dict, final_eval: list[str], final_eval_flags: list[str]) -> dict:
    """Run one command to completion, logging its output to run_dir/stdout.log."""
    shutil.rmtree(run.run_dir, ignore_errors=True)  # a failed or --rerun attempt: start clean, never half-resume
    run.run_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled"),
    }
    start = time.time()
    with open(run.run_dir / "stdout.log", "w") as log:
        code = subprocess.run(run.command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    for dataset in final_eval if code == 0 else []:  # the final model on further held-out sets
        with open(run.run_dir / "final_eval.jsonl", "a") as out:
            code = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "common.evaluate",
                    "--model",
                    str(run.run_dir / "final"),
                    "--dataset",
                    dataset,
                    *final_eval_flags,
                ],
                stdout=out,
                env=env,
                cwd=REPO,
            ).returncode
    record = {
        "label": run.label,
        "seed": run.seed,
        "command": shlex.join(run.command),
        "threads": threads,
        **git,
        "start": start,
        "end": time.time(),
        "wall_s": time.time() - start,
        "exit_code": code,
    }
    (run.run_dir / "bench.json").write_text(json.dumps(record, indent=2))
    return record


def setup(suite: dict) -> None:
    """Run each [[setup]] command whose ``creates`` path (relative to the repo) is missing; stop if one fails."""
    for entry in suite.get("setup", []):
        if (REPO / entry["creates"]).exists():
            continue
        command = [sys.executable, *entry["command"]]
        print(f"setup: {shlex.join(command)}", flush=True)
        if subprocess.run(command, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode:
            raise SystemExit(f"setup command failed: {shlex.join(command)}")
        if not (REPO / entry["creates"]).exists():
            raise SystemExit(f"setup command did not create {entry['creates']}: {shlex.join(command)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", help="manifest name in benchmarks/suites/ (tiny, speed, gpu-small, gpu-reference)")
    parser.add_argument("--seeds", type=int, nargs="+", help="override the manifest's seeds")
    parser.add_argument("--jobs", type=int, help="parallel runs (default: the manifest's, else 1)")
    parser.add_argument("--only", nargs="+", help="run only these labels / algorithms")
    parser.add_argument("--rerun", action="store_true", help="run again even where a finished run exists")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    parser.add_argument("--output-root", default=str(REPO / "runs"), help="where suite folders are written")
    args = parser.parse_args()

    suite = load_suite(args.suite)
    runs = expand(args.suite, suite, args.seeds, args.only, Path(args.output_root))
    if args.dry_run:
        print("\n".join(shlex.join([sys.executable, *e["command"]]) for e in suite.get("setup", [])))
        print("\n".join(shlex.join(run.command) for run in runs))
        return
    setup(suite)
    todo = [r for r in runs if args.rerun or not done(r)]
    jobs = max(1, args.jobs or suite.get("jobs", 1))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    git = git_state()
    print(
        f"suite {args.suite}: {len(runs)} runs, {len(runs) - len(todo)} already done, {len(todo)} to run; "
        f"{jobs} at a time x {threads} threads; "
        f"commit {str(git['git_commit'])[:10]}{' (dirty)' if git['git_dirty'] else ''}"
    )
    failures = []
    with ThreadPoolExecutor(jobs) as pool, tqdm(total=len(todo), desc=args.suite, unit="run") as bar:
        futures = {
            pool.submit(execute, run, threads, git, suite.get("final_eval", []), suite.get("final_eval_flags", [])): run
            for run in todo
        }
        for future in as_completed(futures):
            record = future.result()
            status = (
                "ok"
                if record["exit_code"] == 0
                else f"FAILED (exit {record['exit_code']}, see {futures[future].run_dir}/stdout.log)"
            )
            bar.write(f"{record['label']} seed {record['seed']}: {status} in {record['wall_s']:.0f}s")
            bar.update(1)
            if record["exit_code"]:
                failures.append(record)
    if failures:
        raise SystemExit(f"{len(failures)} run(s) failed")


if __name__ == "__main__":
    main()
