"""Collect a suite's logged runs into CSV, a markdown table and PNG learning curves.

    python benchmarks/collect.py tiny

Reads runs/<suite>/*/{metrics.jsonl,config.json,bench.json} and writes benchmarks/results/<suite>/:
    runs.csv       one row per run (every figure below comes from these rows); its commands hold no absolute path
                   (benchmarks/reporting.py: relative to the repo, or to a runs root outside it)
    table.md       mean ± std over seeds per algorithm, with hardware and commit
    curves.png     held-out accuracy vs step and vs wall-clock, train reward, response length, entropy,
                   clip / mask fraction; all algorithms overlaid, shaded ± std over seeds
    scaling.png    (suites with grpo runs at several group sizes / token budgets) s/step against each
When a suite holds a peer (label trl_grpo[-X]) and our matching run (grpo[-X]) with the same seeds, table.md also
gets the per-seed ratio of seconds per step and of train wall-clock to reach the peer's final held-out accuracy.
A suite whose manifest has [[claims]] (the claims testbed) leads table.md with each claim's pre-registered test
and verdict (claims.png) and the ScaleRL compute fit of every run evaluated often enough (fits.png); see
benchmarks/claims.py. It also rewrites the block between <!-- BENCH-<SUITE>-BEGIN --> and <!-- BENCH-<SUITE>-END -->
in README.md and, for the tiny suite, every row of the table that a docs/*.md page quotes.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# one way: claims.py and reporting.py never import this module
from benchmarks.claims import claims_table, fits_table, plot_claims, plot_fits  # noqa: E402
from benchmarks.reporting import mean_std, portable_command, pyplot, series  # noqa: E402

CLIP_KEYS = ("train/clip_frac", "train/masked_frac", "train/capped_frac")  # whichever the algorithm logs


def read_run(run_dir: Path) -> dict | None:
    """One finished run's rows and summary figures, or None if it did not finish.

    ``run_dir`` is ``<runs root>/<suite>/<run>``. Its recorded command is stored with no absolute path
    (``reporting.portable_command``): paths in the repo relative to it, paths in the runs root relative to that."""
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
    right_len, wrong_len = sample_lengths(run_dir, train_rows[-1]["step"])
    return {
        "label": record["label"],
        "seed": record["seed"],
        "algo": config.get("exp_name", record["label"]),
        "dataset": dataset,
        "steps": train_rows[-1]["step"],
        "base_mean": at(first, f"mean@{n}") if first["step"] == 0 else None,
        "final_mean": at(last, f"mean@{n}"),
        "final_pass": at(last, f"pass@{max(ks)}"),
        "final_greedy": at(last, "greedy"),
        "response_len": at(last, "response_len"),
        "right_len_chars": right_len,
        "wrong_len_chars": wrong_len,
        "train_wall_s": train_rows[-1].get("time/elapsed_s"),
        "run_wall_s": record["wall_s"],
        "s_per_step": statistics.median(r["time/step_s"] for r in train_rows),  # median: robust to the warm-up step
        "rollout_s": median_of(train_rows, "time/rollout_s"),
        "logprob_s": median_of(train_rows, "time/old_logprobs_s"),
        "update_s": median_of(
            train_rows, "time/train_s", "time/critic_s", "time/prm_s"
        ),  # ppo's critic, prime's PRM updates count
        "group_size": config.get("group_size"),
        "max_new_tokens": config.get("max_new_tokens"),
        "gen_tok_s": statistics.mean(r["time/tokens_per_s"] for r in train_rows),
        "peak_mem_gb": max(r.get("memory/peak_rss_gb", 0.0) for r in train_rows),
        "n": n,
        "k": max(ks),
        "hardware": config.get("hardware", ""),
        "commit": str(record.get("git_commit") or "")[:10],
        "dirty": record.get("git_dirty"),
        "command": portable_command(record["command"], runs_root=run_dir.parent.parent),
        "rows": rows,
        "eval_prefix": prefix,
    }


def median_of(rows: list[dict], *keys: str) -> float | None:
    """Median over steps of the sum of ``keys`` (those a run logs); None if it logs none of them."""
    present = [k for k in keys if k in rows[-1]]
    return statistics.median(sum(r.get(k, 0.0) for k in present) for r in rows) if present else None


def sample_lengths(run_dir: Path, steps: int) -> tuple[float | None, float | None]:
    """Mean length (characters) of the logged training samples judged right / wrong, over the last third of
    steps.

    Each script logs a few samples per step (samples.jsonl); the length of wrong answers is what Dr. GRPO's
    length-bias claim is about. Judged with the tiny task's exact checker when the gold is an integer, else by
    reward > 0.
    """
    path = run_dir / "samples.jsonl"
    if not path.exists():
        return None, None
    from common.verifiers import grade_boxed_exact

    right, wrong = [], []
    for line in path.read_text().splitlines():
        sample = json.loads(line)
        if sample.get("step", 0) <= steps * 2 // 3 or "completion" not in sample:
            continue
        answer = str(sample.get("answer", ""))
        ok = (
            grade_boxed_exact(sample["completion"], answer)
            if answer.lstrip("-").isdigit()
            else sample.get("reward", 0) > 0
        )
        (right if ok else wrong).append(len(sample["completion"]))
    return (statistics.mean(right) if right else None), (statistics.mean(wrong) if wrong else None)


def table(runs: list[dict], suite: str) -> str:
    by_label = defaultdict(list)
    for r in runs:
        by_label[r["label"]].append(r)
    n = runs[0]["n"] if len({r["n"] for r in runs}) == 1 else "n"  # a suite may evaluate runs differently
    k = runs[0]["k"] if len({r["k"] for r in runs}) == 1 else "k"
    lines = [
        f"| algorithm | base mean@{n} | final mean@{n} | final pass@{k} | final greedy | response len "
        "| right / wrong sample len (chars) | steps | train wall-clock (s) | s/step "
        "| rollout / log-probs / update (s) | gen tok/s | peak RSS (GB) | seeds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rs in by_label.items():
        script = rs[0]["algo"] + ".py"
        link = "algos/" + script if (REPO / "algos" / script).exists() else "benchmarks/peers/"
        lines.append(
            f"| [{label}]({link}) "
            f"| {mean_std([r['base_mean'] for r in rs])} | **{mean_std([r['final_mean'] for r in rs])}** "
            f"| {mean_std([r['final_pass'] for r in rs])} | {mean_std([r['final_greedy'] for r in rs])} "
            f"| {mean_std([r['response_len'] for r in rs], 1)} "
            f"| {mean_std([r['right_len_chars'] for r in rs], 1)} / {mean_std([r['wrong_len_chars'] for r in rs], 1)} "
            f"| {rs[0]['steps']} | {mean_std([r['train_wall_s'] for r in rs], 0)} "
            f"| {mean_std([r['s_per_step'] for r in rs], 2)} "
            f"| {mean_std([r['rollout_s'] for r in rs], 2)} / {mean_std([r['logprob_s'] for r in rs], 2)} "
            f"/ {mean_std([r['update_s'] for r in rs], 2)} "
            f"| {mean_std([r['gen_tok_s'] for r in rs], 0)} "
            f"| {mean_std([r['peak_mem_gb'] for r in rs], 2)} | {len(rs)} |"
        )
    commits = sorted({r["commit"] + (" (dirty)" if r["dirty"] else "") for r in runs})
    datasets = ", ".join(f"`{d}`" for d in sorted({r["dataset"] for r in runs}))
    lines += [
        "",
        f"Suite `{suite}`; held-out set(s) {datasets}; mean@{n} and pass@{k} from {n} samples per problem "
        f"at the suite's evaluation protocol (see each run's config.json); mean ± sample std over seeds. "
        f"s/step and its parts are per-run medians over steps (evaluation excluded); train wall-clock sums every step. "
        f"Hardware: {runs[0]['hardware']}. Commit(s): {', '.join(commits)}. "
        f"Regenerate: `python benchmarks/run.py {suite} && python benchmarks/collect.py {suite}`.",
    ]
    return "\n".join(lines)


def time_to_reach(run: dict, target: float) -> float | None:
    """Train wall-clock (s) at the first evaluation where held-out mean@n reaches ``target`` (None if never)."""
    clock = {row["step"]: row["time/elapsed_s"] for row in run["rows"] if "time/elapsed_s" in row}
    key = f"{run['eval_prefix']}mean@{run['n']}"
    for row in run["rows"]:
        if key in row and row[key] >= target - 1e-9:
            return clock.get(row["step"], 0.0)
    return None


def peer_comparison(runs: list[dict]) -> str:
    """Ours vs peer, seed by seed: s/step ratio and train wall-clock to reach the peer's final accuracy."""
    by_key = {(r["label"], r["seed"]): r for r in runs}
    lines = []
    for peer_label in sorted({r["label"] for r in runs if r["label"].startswith("trl_")}):
        ours_label = peer_label.removeprefix("trl_")
        if not any(
            r["label"] == ours_label for r in runs
        ):  # a peer-only variant (e.g. trl_grpo-sdpa): compare with grpo
            ours_label = ours_label.split("-")[0]
        pairs = [
            (by_key[(ours_label, seed)], by_key[(peer_label, seed)])
            for (label, seed) in sorted(by_key)
            if label == peer_label and (ours_label, seed) in by_key
        ]
        if not pairs:
            continue
        step_ratios = [o["s_per_step"] / p["s_per_step"] for o, p in pairs]
        commits = sorted({r["commit"] for pair in pairs for r in pair})
        when = (
            "run interleaved in one invocation"
            if len(commits) == 1
            else f"ours and the peer run in separate invocations, commits {', '.join(commits)}"
        )
        # both sides timed to the FIRST evaluation at the peer's final accuracy
        # (the peer may have got there early)
        reach = [(time_to_reach(o, p["final_mean"]), time_to_reach(p, p["final_mean"])) for o, p in pairs]
        reach_ratios = [ours / peer for ours, peer in reach if ours is not None and peer]
        lines += [
            f"**{ours_label} vs {peer_label}** ({len(pairs)} seed pairs, {when}): "
            f"s/step {mean_std([o['s_per_step'] for o, _ in pairs], 3)} "
            f"vs {mean_std([p['s_per_step'] for _, p in pairs], 3)}, "
            f"ratio {mean_std(step_ratios, 2)} (per seed: {', '.join(f'{x:.2f}' for x in step_ratios)}); "
            f"final mean@{pairs[0][0]['n']} {mean_std([o['final_mean'] for o, _ in pairs])} "
            f"vs {mean_std([p['final_mean'] for _, p in pairs])}; "
            f"train wall-clock to reach the peer's final accuracy: ratio {mean_std(reach_ratios, 2)} "
            f"({len(reach_ratios)}/{len(pairs)} of our runs reached it).",
            "",
        ]
    return "\n".join(lines)


def scaling(runs: list[dict], out: Path) -> str:
    """s/step of grpo runs against group size (at the default token budget) and token budget (at the default G)."""
    rs = [r for r in runs if r["algo"] == "grpo" and r["label"].startswith("grpo") and "fp32" not in r["label"]]
    configs = defaultdict(list)
    for r in rs:
        configs[(r["group_size"], r["max_new_tokens"])].append(r)
    if len(configs) < 3:
        return ""
    lines = [
        "| group size | max new tokens | s/step | rollout (s) | update (s) | response len | gen tok/s | runs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (g, t), group in sorted(configs.items()):
        lines.append(
            f"| {g} | {t} | {mean_std([r['s_per_step'] for r in group], 2)} "
            f"| {mean_std([r['rollout_s'] for r in group], 2)} "
            f"| {mean_std([r['update_s'] for r in group], 2)} | {mean_std([r['response_len'] for r in group], 1)} "
            f"| {mean_std([r['gen_tok_s'] for r in group], 0)} | {len(group)} |"
        )
    plt = pyplot()

    default_g, default_t = 8, 40
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (name, vary, fixed) in zip(axes, (("group size", 0, default_t), ("max new tokens", 1, default_g))):
        points = sorted(
            (k[vary], statistics.mean(r["s_per_step"] for r in v)) for k, v in configs.items() if k[1 - vary] == fixed
        )
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-")
        ax.set_xlabel(name)
        ax.set_ylabel("s/step")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)  # from zero: single runs vary ±30%, a zoomed axis would turn noise into a trend
        ax.set_title(f"grpo.py s/step vs {name} ({'max new tokens' if vary == 0 else 'group size'} {fixed})")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return "\n".join(lines)


def plot(runs: list[dict], out: Path, suite: str) -> None:
    plt = pyplot()

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
            color = plt.cm.tab20(i % 20)
            ax.plot(xs, means, label=label, color=color, lw=1.6, ls="--" if label.startswith("trl_") else "-")
            ax.fill_between(
                xs, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)], color=color, alpha=0.15
            )
        ax.set_title(title)
        ax.set_xlabel("seconds" if x == "time" else "step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8, ncol=2)
    fig.suptitle(f"suite {suite}: mean ± std over seeds")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def relative_links(text: str, folder: str) -> str:
    """Markdown links written from the repo root (``](algos/...)``, ``](benchmarks/...)``) made relative to the page's
    ``folder`` (e.g. ``docs``: ``](../algos/...)``; ``benchmarks``: ``](results/...)``)."""

    def relative(match: re.Match) -> str:
        target = os.path.relpath(match[1], folder) + ("/" if match[1].endswith("/") else "")
        return f"]({target})"

    return re.sub(r"\]\(((?:algos|benchmarks)/[^)]*)\)", relative, text)


def update_readme(suite: str, text: str) -> Path | None:
    """Rewrite the ``<!-- BENCH-<SUITE>-BEGIN/END -->`` block of README.md or, where the block lives there,
    benchmarks/README.md (links made relative to that folder). Returns the file rewritten, None if neither has it."""
    begin, end = f"<!-- BENCH-{suite.upper()}-BEGIN -->", f"<!-- BENCH-{suite.upper()}-END -->"
    for readme in (REPO / "README.md", REPO / "benchmarks" / "README.md"):
        content = readme.read_text()
        if begin not in content or end not in content:
            continue
        if readme.parent != REPO:
            text = relative_links(text, readme.parent.name)
        head, rest = content.split(begin, 1)
        readme.write_text(head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])
        return readme
    return None


def update_docs(markdown: str) -> list[str]:
    """Rewrite every row of this table that a docs/*.md page quotes (same label, links made relative to docs/), so a
    page never shows figures older than the table. Returns the pages changed."""
    rows = {}
    for line in markdown.splitlines():
        if line.startswith("| ["):
            label = line[3 : line.index("]")]
            rows[label] = relative_links(line, "docs")
    changed = []
    for page in sorted((REPO / "docs").glob("*.md")):
        lines = page.read_text().splitlines()
        new = [rows.get(line[3 : line.find("]")], line) if line.startswith("| [") else line for line in lines]
        if new != lines:
            page.write_text("\n".join(new) + "\n")
            changed.append(page.name)
    return changed


def claims_section(claims: list[dict], runs: list[dict], out: Path) -> tuple[str, str]:
    """The claims table (pre-registered tests and verdicts) and the ScaleRL fits ('' if none), with their plots."""
    table_md, results = claims_table(claims, runs)
    plot_claims(claims, results, runs, out / "claims.png")
    reproduced = sum(r["verdict"] == "reproduced" for r in results)
    rules = []
    if any(c.get("test", "superior") == "superior" for c in claims):
        rules.append(
            "per seed, d = treatment - control in the claimed direction; reproduced if the mean of d exceeds 2 "
            "standard errors, not reproduced if mean + 2 SE is below the claim's smallest effect of interest, else "
            "inconclusive."
        )
    if any(c.get("test") == "noninferior" for c in claims):
        rules.append(
            ("Non-inferiority claims: d" if rules else "per seed, d") + " = treatment - control; reproduced if mean d "
            "- 2 SE > -margin, not reproduced if mean d + 2 SE < -margin, else inconclusive; margin = min(0.02, a "
            "quarter of the control arm's mean base-to-final gain)."
        )
    if any(c.get("gate") for c in claims):
        rules.append("A claim whose mechanism gate fails is not testable here.")
    text = (
        f"{table_md}\n\n{reproduced} of {len(claims)} claims reproduced. Test (fixed before the judging runs, "
        f"benchmarks/claims.py): {' '.join(rules)} Per-seed values: runs.csv and claims.json.\n\n![claims](claims.png)"
    )
    (out / "claims.json").write_text(json.dumps([{"id": c["id"], **r} for c, r in zip(claims, results)], indent=1))
    fit_md, fits = fits_table(runs)
    if not fit_md:
        return text, ""
    plot_fits(fits, out / "fits.png")
    return text, (
        "### Where each run is heading: ScaleRL's compute fit\n\n"
        "R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) fitted to each run's held-out mean@n against completion "
        "tokens generated (R0 = the step-0 score); mean ± std over the seeds whose fit is identified.\n\n"
        f"{fit_md}\n\n![fits](fits.png)"
    )


def write_runs_csv(runs: list[dict], path: Path) -> None:
    """One row per run (``read_run``'s summary fields, in its order; not the logged rows) to ``path``."""
    fields = [k for k in runs[0] if k not in ("rows", "eval_prefix")]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: r[k] for k in fields} for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite")
    parser.add_argument("--runs-root", default=str(REPO / "runs"))
    parser.add_argument(
        "--claims",
        nargs="+",
        help="judge only these claim ids of the manifest, over the runs present, into results/<suite>/<first id>/ "
        "(the suite's own table, runs.csv and README block stay as they are: for a claim added to a judged suite)",
    )
    args = parser.parse_args()
    run_dirs = sorted((Path(args.runs_root) / args.suite).glob("*"))
    runs = [r for r in (read_run(d) for d in run_dirs if d.is_dir()) if r is not None]
    if not runs:
        raise SystemExit(
            f"no finished runs under {Path(args.runs_root) / args.suite}; "
            f"run `python benchmarks/run.py {args.suite}` first"
        )
    out = REPO / "benchmarks" / "results" / args.suite / (args.claims[0] if args.claims else "")
    out.mkdir(parents=True, exist_ok=True)
    write_runs_csv(runs, out / "runs.csv")
    markdown = table(runs, args.suite)
    manifest = tomllib.loads((REPO / "benchmarks" / "suites" / f"{args.suite}.toml").read_text())
    if args.claims:
        unknown = set(args.claims) - {c["id"] for c in manifest.get("claims", [])}
        if unknown:
            raise SystemExit(f"--claims {' '.join(sorted(unknown))}: no such claim id in {args.suite}.toml")
        manifest["claims"] = [c for c in manifest["claims"] if c["id"] in args.claims]
    claims_md, fits_md = claims_section(manifest["claims"], runs, out) if manifest.get("claims") else ("", "")
    if claims_md:
        markdown = "\n\n".join(filter(None, (claims_md, fits_md, "## Every run", markdown)))
    comparison = peer_comparison(runs)
    if comparison:
        markdown += "\n\n" + comparison
    scaling_table = scaling(runs, out / "scaling.png")
    if scaling_table:
        markdown += "\n\n" + scaling_table + "\n\n![scaling](scaling.png)"
    (out / "table.md").write_text(markdown + "\n")
    plot(runs, out / "curves.png", args.suite)
    readme_text = claims_md or markdown  # a claims suite's README block is its verdicts
    for png in ("scaling.png", "claims.png", "fits.png"):
        readme_text = readme_text.replace(f"]({png})", f"](benchmarks/results/{args.suite}/{png})")
    if not claims_md:
        readme_text += f"\n\n![learning curves](benchmarks/results/{args.suite}/curves.png)"
    updated = not args.claims and update_readme(args.suite, readme_text)
    pages = (
        update_docs(markdown) if args.suite == "tiny" and not args.claims else []
    )  # the docs pages quote the tiny suite's rows
    print(markdown)
    where = f"; updated {updated.relative_to(REPO)}" if updated else ""
    print(f"\nwrote {out}/runs.csv, table.md, curves.png{where}")
    if pages:
        print("refreshed the quoted rows in docs/" + ", docs/".join(pages))


if __name__ == "__main__":
    main()
