"""Run every algorithm script at two commits on the same machine and compare their metrics, key by key.

    python scripts/compare_commits.py --base 9b7cb25             # base commit vs the work tree, all scripts
    python scripts/compare_commits.py --base 9b7cb25 --only grpo ppo --steps 5

Used to check that a refactor changes no behaviour. The base commit is checked out into a temporary
``git worktree``; the other side is this checkout's work tree as it is (uncommitted changes included). Each
script runs as a subprocess with the same flags on both sides: fixed threads (``--threads``, default 2),
``--mixed-precision no``, seed 1, ``--total-steps`` steps. Runs on this CPU are deterministic, so every
key of every ``metrics.jsonl`` row must be bit-identical; keys under ``time/`` and ``memory/`` (and the row's wall
``time``) are skipped. The exit code is the number of scripts that differ (0 = identical everywhere). Base runs
are cached under ``runs/compare/<commit>-<steps>-<threads>-<flags>/`` so repeated checks against the same base with
the same flags only rerun the work tree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIPPED_PREFIXES = ("time/", "memory/")


def run_script(checkout: Path, script: str, out_dir: Path, steps: int, threads: int, extra: list[str]) -> Path:
    """Run ``algos/<script>.py`` of ``checkout`` for ``steps`` steps into ``out_dir/<script>``; return the run dir."""
    run_dir = out_dir / script
    if (run_dir / "metrics.jsonl").exists() and (run_dir / "final").exists():
        return run_dir  # cached
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": str(threads),
        "PYTHONHASHSEED": "0",
    }
    cmd = [sys.executable, str(checkout / "algos" / f"{script}.py"), "--output-dir", str(out_dir), "--run-name", script]
    cmd += ["--seed", "1", "--total-steps", str(steps), "--mixed-precision", "no", *extra]
    result = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    return run_dir


def metric_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [{k: v for k, v in row.items() if k != "time" and not k.startswith(SKIPPED_PREFIXES)} for row in rows]


def compare(base_rows: list[dict], head_rows: list[dict], new_keys_ok: bool = False) -> list[str]:
    """Every difference between two runs' metric rows, as readable lines (empty = identical). ``new_keys_ok``: a key
    logged only at head (a new metric) is not a difference; every key both sides log must still be identical."""
    problems = []
    if len(base_rows) != len(head_rows):
        problems.append(f"{len(base_rows)} metric rows at base, {len(head_rows)} at head")
    for base, head in zip(base_rows, head_rows):
        step = base.get("step")
        for key in sorted(base.keys() | head.keys()):
            if key not in head:
                problems.append(f"step {step}: {key} only at base")
            elif key not in base:
                if not new_keys_ok:
                    problems.append(f"step {step}: {key} only at head")
            elif base[key] != head[key]:
                problems.append(f"step {step}: {key} {base[key]!r} (base) != {head[key]!r} (head)")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="commit to compare the work tree against")
    parser.add_argument("--only", nargs="*", help="scripts to run (default: every algos/*.py present at both sides)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per run")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every run (OMP_NUM_THREADS)")
    parser.add_argument("--new-keys-ok", action="store_true", help="keys logged only at head are not differences")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further flags for every script")
    args = parser.parse_args()

    commit = subprocess.run(["git", "rev-parse", args.base], cwd=REPO, capture_output=True, text=True, check=True)
    commit = commit.stdout.strip()
    # the base runs are cached per commit, steps, threads and --extra flags (different flags: different runs)
    flags = hashlib.sha256(" ".join(args.extra).encode()).hexdigest()[:8] if args.extra else "default"
    cache = REPO / "runs" / "compare" / f"{commit[:12]}-{args.steps}steps-{args.threads}threads-{flags}"
    head_out = Path(tempfile.mkdtemp(prefix="compare-head-"))
    worktree = Path(tempfile.mkdtemp(prefix="compare-base-")) / "tree"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(worktree), commit], cwd=REPO, check=True, capture_output=True
    )
    try:
        base_scripts = {p.stem for p in (worktree / "algos").glob("*.py")}
        head_scripts = {p.stem for p in (REPO / "algos").glob("*.py")}
        scripts = args.only or sorted(base_scripts & head_scripts)
        differing = 0
        for script in scripts:
            base_dir = run_script(worktree, script, cache, args.steps, args.threads, args.extra)
            head_dir = run_script(REPO, script, head_out, args.steps, args.threads, args.extra)
            problems = compare(metric_rows(base_dir), metric_rows(head_dir), args.new_keys_ok)
            new_keys = sorted(
                {k for row in metric_rows(head_dir) for k in row} - {k for row in metric_rows(base_dir) for k in row}
            )
            keys = sum(len(row) - 1 for row in metric_rows(base_dir))
            print(
                f"{script:8s} {'identical' if not problems else f'{len(problems)} differences'} "
                f"({keys} values compared)"
            )
            for line in problems[:20]:
                print("    " + line)
            if new_keys:
                print(f"    new at head{' (not compared)' if args.new_keys_ok else ''}: {', '.join(new_keys)}")
            differing += bool(problems)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, capture_output=True)
        shutil.rmtree(head_out, ignore_errors=True)
    print(f"{len(scripts) - differing}/{len(scripts)} scripts identical to {commit[:12]} over {args.steps} steps")
    sys.exit(differing)


if __name__ == "__main__":
    main()
