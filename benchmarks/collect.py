"""Collect a suite's logged runs into CSV, a markdown table and PNG learning curves.

    python benchmarks/collect.py tiny

Reads runs/<suite>/*/{metrics.jsonl,config.json,bench.json} and writes benchmarks/results/<suite>/:
    runs.csv       one row per run (every figure below comes from these rows)
    table.md       mean ± std over seeds per algorithm, with hardware and commit
    curves.png     held-out accuracy vs step and vs wall-clock, train reward, response length, entropy,
                   clip / mask fraction; all algorithms overlaid, shaded ± std over seeds
It also rewrites the block between <!-- BENCH-<SUITE>-BEGIN --> and <!-- BENCH-<SUITE>-END --> in README.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLIP_KEYS = ("train/clip_frac", "train/masked_frac", "train/capped_frac")  # whichever the algorithm logs


def read_run(run_dir: Path) -> dict | None:
    """One finished run's rows and summary figures, or None if it did not finish."""
    bench, metrics = run_dir / "bench.json", run_dir / "metrics.jsonl"
    if not bench.exists() or not metrics.exists():
        return None
    record = json.loads(bench.read_text())
    if record.get("exit_code") != 0:
        return None
    config = json.loads((run_dir / "config.json").read_text())
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    eval_rows = [r for r in rows if any(k.startswith("eval/") for k in r)]
    train_rows = [r for r in rows if "train/reward" in r]
    if not eval_rows or not train_rows:
        return None
    dataset = config.get("eval", {}).get("dataset") or config["dataset"]
    n, ks = config["eval"]["n"], config["eval"]["k"]
    prefix = f"eval/{dataset}/"

    def at(row: dict, key: str) -> float | None:
        return row.get(prefix + key)

    first, last = eval_rows[0], eval_rows[-1]
    return {
        "label": record["label"], "seed": record["seed"], "algo": config.get("exp_name", record["label"]),
        "dataset": dataset, "steps": train_rows[-1]["step"],
        "base_mean": at(first, f"mean@{n}") if first["step"] == 0 else None,
        "final_mean": at(last, f"mean@{n}"), "final_pass": at(last, f"pass@{max(ks)}"), "final_greedy": at(last, "greedy"),
        "response_len": at(last, "response_len"),
        "train_wall_s": train_rows[-1].get("time/elapsed_s"), "run_wall_s": record["wall_s"],
        "s_per_step": statistics.mean(r["time/step_s"] for r in train_rows),
        "gen_tok_s": statistics.mean(r["time/tokens_per_s"] for r in train_rows),
        "peak_mem_gb": max(r.get("memory/peak_rss_gb", 0.0) for r in train_rows),
        "n": n, "k": max(ks), "hardware": config.get("hardware", ""), "commit": str(record.get("git_commit") or "")[:10],
        "dirty": record.get("git_dirty"), "command": record["command"], "rows": rows, "eval_prefix": prefix,
    }


def mean_std(values: list[float | None], digits: int = 3) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(runs: list[dict], suite: str) -> str:
    by_label = defaultdict(list)
    for r in runs:
        by_label[r["label"]].append(r)
    n, k = runs[0]["n"], runs[0]["k"]
    lines = [
        f"| algorithm | base mean@{n} | final mean@{n} | final pass@{k} | final greedy | response len | steps | train wall-clock (s) | s/step | gen tok/s | peak RSS (GB) | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rs in by_label.items():
        lines.append(
            f"| [{label}]({'algos/' + rs[0]['algo'] + '.py' if (REPO / 'algos' / (rs[0]['algo'] + '.py')).exists() else 'benchmarks/peers/'}) "
            f"| {mean_std([r['base_mean'] for r in rs])} | **{mean_std([r['final_mean'] for r in rs])}** "
            f"| {mean_std([r['final_pass'] for r in rs])} | {mean_std([r['final_greedy'] for r in rs])} "
            f"| {mean_std([r['response_len'] for r in rs], 1)} | {rs[0]['steps']} | {mean_std([r['train_wall_s'] for r in rs], 0)} "
            f"| {mean_std([r['s_per_step'] for r in rs], 2)} | {mean_std([r['gen_tok_s'] for r in rs], 0)} "
            f"| {mean_std([r['peak_mem_gb'] for r in rs], 2)} | {len(rs)} |"
        )
    commits = sorted({r["commit"] + (" (dirty)" if r["dirty"] else "") for r in runs})
    lines += [
        "",
        f"Suite `{suite}`; held-out set `{runs[0]['dataset']}`; mean@{n} and pass@{k} from {n} samples per problem at the "
        f"suite's evaluation protocol (see each run's config.json); mean ± sample std over seeds. "
        f"Hardware: {runs[0]['hardware']}. Commit(s): {', '.join(commits)}. "
        f"Regenerate: `python benchmarks/run.py {suite} && python benchmarks/collect.py {suite}`.",
    ]
    return "\n".join(lines)


def series(rs: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float], list[float]]:
    """Mean and std over seeds of ``key`` at each step where every seed logged it."""
    per_seed = []
    for r in rs:  # eval rows carry no clock: take the train time logged at the same step (0 before training)
        clock = {row["step"]: row["time/elapsed_s"] for row in r["rows"] if "time/elapsed_s" in row}
        per_seed.append({row["step"]: (row[key], clock.get(row["step"], 0.0)) for row in r["rows"] if key in row})
    steps = sorted(set.intersection(*(set(s) for s in per_seed))) if per_seed else []
    xs, means, stds = [], [], []
    for step in steps:
        values = [s[step][0] for s in per_seed]
        xs.append(step if x == "step" else statistics.mean(s[step][1] for s in per_seed))
        means.append(statistics.mean(values))
        stds.append(statistics.stdev(values) if len(values) > 1 else 0.0)
    return xs, means, stds


def plot(runs: list[dict], out: Path, suite: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_label = defaultdict(list)
    for r in runs:
        by_label[r["label"]].append(r)
    n = runs[0]["n"]
    prefix = runs[0]["eval_prefix"]
    panels = [
        (f"{prefix}mean@{n}", "step", f"held-out mean@{n}"),
        (f"{prefix}mean@{n}", "time", f"held-out mean@{n} vs train wall-clock (s)"),
        ("train/reward", "step", "train reward"),
        ("train/response_len", "step", "response length (tokens)"),
        ("train/entropy", "step", "token entropy"),
        (None, "step", "clip / mask fraction"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    for ax, (key, x, title) in zip(axes.flat, panels):
        for i, (label, rs) in enumerate(by_label.items()):
            k = key or next((c for c in CLIP_KEYS if any(c in row for row in rs[0]["rows"])), None)
            if k is None:
                continue
            xs, means, stds = series(rs, k, x)
            if not xs:
                continue
            color = plt.cm.tab10(i % 10)
            ax.plot(xs, means, label=label, color=color, lw=1.6)
            ax.fill_between(xs, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)], color=color, alpha=0.15)
        ax.set_title(title)
        ax.set_xlabel("seconds" if x == "time" else "step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8, ncol=2)
    fig.suptitle(f"suite {suite}: mean ± std over seeds")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def update_readme(suite: str, text: str) -> bool:
    readme = REPO / "README.md"
    begin, end = f"<!-- BENCH-{suite.upper()}-BEGIN -->", f"<!-- BENCH-{suite.upper()}-END -->"
    content = readme.read_text()
    if begin not in content or end not in content:
        return False
    head, rest = content.split(begin, 1)
    readme.write_text(head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite")
    parser.add_argument("--runs-root", default=str(REPO / "runs"))
    args = parser.parse_args()
    run_dirs = sorted((Path(args.runs_root) / args.suite).glob("*"))
    runs = [r for r in (read_run(d) for d in run_dirs if d.is_dir()) if r is not None]
    if not runs:
        raise SystemExit(f"no finished runs under {Path(args.runs_root) / args.suite}; run `python benchmarks/run.py {args.suite}` first")
    out = REPO / "benchmarks" / "results" / args.suite
    out.mkdir(parents=True, exist_ok=True)
    fields = [k for k in runs[0] if k not in ("rows", "eval_prefix")]
    with open(out / "runs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: r[k] for k in fields} for r in runs)
    markdown = table(runs, args.suite)
    (out / "table.md").write_text(markdown + "\n")
    plot(runs, out / "curves.png", args.suite)
    readme_text = markdown + f"\n\n![learning curves](benchmarks/results/{args.suite}/curves.png)"
    updated = update_readme(args.suite, readme_text)
    print(markdown)
    print(f"\nwrote {out}/runs.csv, table.md, curves.png" + ("; updated README.md" if updated else ""))


if __name__ == "__main__":
    main()
