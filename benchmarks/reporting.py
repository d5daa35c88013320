"""Helpers that benchmarks/collect.py and benchmarks/claims.py share: the tables' number format, per-step series over
seeds, the plotting back end, and the machine-independent paths that committed results store; and the provenance
head of the standalone benchmarks' results (rollout_server.py, async_rl.py, lora.py).

Imports run one way: collect.py imports claims.py and this module, claims.py imports this module, and this module
imports neither (the standard library only; matplotlib is imported when a figure is drawn).
"""

from __future__ import annotations

import json
import re
import shlex
import statistics
from pathlib import Path, PurePosixPath, PureWindowsPath

REPO = Path(__file__).resolve().parent.parent


def commit_label(git: dict) -> str:
    """A commit as the tables print it (``common.tracking.git_state()``'s dict): 10 hex digits, `` (dirty)`` when
    the tree had uncommitted changes."""
    return f"{str(git['git_commit'])[:10]}{' (dirty)' if git['git_dirty'] else ''}"


def write_results(out: Path, result: dict, title: str, setup: str = "") -> list[str]:
    """Write ``result`` (with ``hardware``, ``commit``, ``command`` and ``wall_clock_s``) to ``out/results.json`` and
    return the head of its ``table.md``: the title, the hardware, commit, ``setup`` and wall-clock, the command."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    facts = [result["hardware"], f"commit {result['commit']}", *([setup] if setup else [])]
    return [
        title,
        "",
        "; ".join([*facts, f"wall-clock {result['wall_clock_s']} s"]),
        "",
        f"Regenerate: `{result['command']}`",
        "",
    ]


def mean_std(values: list[float | None], digits: int = 3) -> str:
    """``mean ± sample std`` of the values that are not None, at ``digits`` decimals; the value alone if there is
    one, ``–`` if there is none."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def series(rs: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float], list[float]]:
    """Mean and std over seeds of ``key`` at each step where every seed logged it.

    ``rs`` are collected runs (each with its logged ``rows``); x is the step, or with ``x="time"`` the mean over
    seeds of the train wall-clock logged at that step (0 before training)."""
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


def pyplot():
    """matplotlib.pyplot on the file-only Agg back end (imported late: collecting a CSV needs no plotting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def portable_path(path: str, runs_root: Path | None = None, repo: Path = REPO) -> str:
    """``path`` as committed results store it: never absolute, so no file names the machine that wrote it.

    A relative path is returned unchanged. An absolute one under ``repo`` becomes relative to it
    (``/work/main/runs/tiny`` -> ``runs/tiny``); else, under ``runs_root`` (a runs folder outside the repo), relative
    to that; else, a file of another checkout of this repo (a git worktree: ``/tmp/wt/algos/grpo.py``), the repo
    file it names (``algos/grpo.py``: the run records its commit); else (an interpreter such as
    ``/usr/bin/python3``, a folder elsewhere) its last component only.
    """
    if not (PurePosixPath(path).is_absolute() or PureWindowsPath(path).is_absolute()):
        return path
    for root in (repo, runs_root):
        for base in {root, root.resolve()} if root is not None else ():
            try:
                return Path(path).relative_to(base).as_posix()
            except ValueError:
                continue
    parts = re.split(r"[\\/]", path.rstrip("\\/"))
    for start in range(1, len(parts) - 1):  # the longest tail of two or more components that is a file here
        if (repo / Path(*parts[start:])).is_file():
            return Path(*parts[start:]).as_posix()
    return parts[-1]


def portable_command(command: str, runs_root: Path | None = None, repo: Path = REPO) -> str:
    """``command`` (one shell line, as ``shlex.join`` writes it) with every argument that is an absolute path, and
    the value of every ``--flag=/absolute/path``, made relative by ``portable_path``; other arguments unchanged."""
    words = []
    for word in shlex.split(command):
        key, eq, value = word.partition("=") if word.startswith("-") else ("", "", word)
        words.append(key + eq + portable_path(value, runs_root, repo))
    return shlex.join(words)
