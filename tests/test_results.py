"""Committed results name no machine: every path in benchmarks/results/ is relative (to the repo, or to the runs
folder when that lies outside it), and benchmarks/collect.py writes them so (benchmarks/reporting.py)."""

import csv
import json
import re
import shlex
from pathlib import Path, PurePosixPath, PureWindowsPath

import pytest
from conftest import REPO

from benchmarks import collect
from benchmarks.reporting import portable_command, portable_path

RESULTS = REPO / "benchmarks" / "results"
TEXT_SUFFIXES = {".csv", ".json", ".jsonl", ".md", ".txt", ".log", ".toml", ".yaml", ".yml", ".svg"}
BINARY_SUFFIXES = {".png"}  # every committed result is one or the other, so no new kind of text goes unscanned
# an absolute path into a home, scratch or system folder, or a Windows drive; not one inside a URL or a relative path
MACHINE_PATH = re.compile(r"(?<![\w.~/-])(?:/(?:work|home|root|tmp|Users|mnt|opt|private|var|scratch)/|[A-Za-z]:\\)")


def is_absolute(word: str) -> bool:
    return PurePosixPath(word).is_absolute() or PureWindowsPath(word).is_absolute()


def test_committed_results_hold_no_machine_path():
    every = [p for p in RESULTS.rglob("*") if p.is_file()]
    unknown = sorted(str(p.relative_to(REPO)) for p in every if p.suffix not in TEXT_SUFFIXES | BINARY_SUFFIXES)
    assert not unknown, f"results of no known kind (add the suffix to TEXT_SUFFIXES or BINARY_SUFFIXES): {unknown}"
    files = sorted(p for p in every if p.suffix in TEXT_SUFFIXES)
    assert len(files) >= 10, f"only {len(files)} text files under {RESULTS}: the scan would prove nothing"
    assert any(p.suffix == ".txt" for p in files)  # the GPU logs (features.txt, nvidia-smi.txt) are scanned too
    found = [
        f"{path.relative_to(REPO)}:{number}: ...{line[max(0, match.start() - 30) : match.start() + 60]}..."
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if (match := MACHINE_PATH.search(line))
    ]
    assert not found, "machine paths in committed results:\n" + "\n".join(found[:10])


def test_machine_path_pattern_on_hand_picked_lines():
    for line in ('"out": "/work/wt/benchmarks/results/floor.json"', "/root/.pyenv/bin/python x", "C:\\Users\\me\\r"):
        assert MACHINE_PATH.search(line), line
    for line in ("python algos/grpo.py --output-dir runs/tiny", "see https://example.org/tmp/x", "benchmarks/data/x"):
        assert not MACHINE_PATH.search(line), line


def test_committed_run_commands_are_relative_and_name_repo_files():
    tables = sorted(RESULTS.rglob("runs.csv"))  # nested results folders too
    assert tables
    for table in tables:
        with open(table, newline="") as f:
            rows = list(csv.DictReader(f))
        assert rows, table
        for row in rows:
            words = [w.partition("=")[2] if w.startswith("-") else w for w in shlex.split(row["command"])]
            assert not [w for w in words if is_absolute(w)], f"{table.relative_to(REPO)}: {row['command']}"
            scripts = [w for w in words if w.endswith(".py")]
            assert scripts and all((REPO / s).is_file() for s in scripts), f"{table.relative_to(REPO)}: {scripts}"


def test_portable_path_on_hand_picked_paths(tmp_path):
    repo, runs = tmp_path / "repo", tmp_path / "elsewhere" / "runs"
    assert portable_path(str(repo / "runs" / "tiny"), runs, repo) == "runs/tiny"  # in the repo: relative to it
    assert portable_path(str(repo / "algos" / "grpo.py"), None, repo) == "algos/grpo.py"
    assert portable_path(str(runs / "tiny" / "grpo__1"), runs, repo) == "tiny/grpo__1"  # else to the runs root
    assert portable_path("/usr/bin/python3", runs, repo) == "python3"  # else the name alone
    assert portable_path("C:\\Users\\me\\python.exe", runs, repo) == "python.exe"
    assert portable_path("runs/tiny", runs, repo) == "runs/tiny"  # already relative: unchanged
    (repo / "algos").mkdir(parents=True)
    (repo / "algos" / "grpo.py").write_text("")
    # a script of another checkout of the repo (a git worktree): the repo file it names, not its bare name
    assert portable_path("/tmp/wt/algos/grpo.py", runs, repo) == "algos/grpo.py"
    assert portable_path("/tmp/wt/algos/mine.py", runs, repo) == "mine.py"  # no such file here: the name alone
    command = f"/usr/bin/python3 {repo}/algos/grpo.py --seed 1 --model={repo}/final --output-dir {runs}/tiny"
    expected = "python3 algos/grpo.py --seed 1 --model=final --output-dir tiny"
    assert portable_command(command, runs, repo) == expected


@pytest.fixture
def finished_run(tmp_path) -> Path:
    """A finished run as benchmarks/run.py leaves it, in a runs folder outside the repo (tmp_path/runs/suite/...)."""
    run_dir = tmp_path / "runs" / "suite" / "grpo__1"
    run_dir.mkdir(parents=True)
    command = [
        "/usr/bin/python3",  # an interpreter outside the repo
        str(REPO / "algos" / "grpo.py"),
        "--seed",
        "1",
        "--output-dir",
        str(run_dir.parent),
        "--run-name",
        run_dir.name,
    ]
    bench = {"label": "grpo", "seed": 1, "command": shlex.join(command), "wall_s": 3.0, "exit_code": 0}
    (run_dir / "bench.json").write_text(json.dumps(bench))
    (run_dir / "config.json").write_text(
        json.dumps({"exp_name": "grpo", "dataset": "arith", "eval": {"n": 4, "k": [4]}})
    )
    rows = [
        {"step": 0, "eval/arith/mean@4": 0.25, "eval/arith/pass@4": 0.5},
        {"step": 1, "train/reward": 0.5, "time/step_s": 1.0, "time/tokens_per_s": 100.0, "time/elapsed_s": 1.0},
        {"step": 1, "eval/arith/mean@4": 0.5, "eval/arith/pass@4": 0.75},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_collector_writes_relative_run_paths(finished_run, tmp_path):
    run = collect.read_run(finished_run)
    assert run["final_mean"] == 0.5 and run["base_mean"] == 0.25  # the run was read, not skipped
    out = tmp_path / "out" / "runs.csv"
    out.parent.mkdir()
    collect.write_runs_csv([run], out)
    text = out.read_text()
    with open(out, newline="") as f:
        (row,) = list(csv.DictReader(f))
    # the script is in the repo: relative to it; the runs folder is outside it: relative to the runs root
    assert row["command"] == "python3 algos/grpo.py --seed 1 --output-dir suite --run-name grpo__1"
    assert str(tmp_path) not in text and str(REPO) not in text and not MACHINE_PATH.search(text)


def test_bench_blocks_are_rewritten_where_they_live(tmp_path, monkeypatch):
    """The tiny block lives in benchmarks/README.md (its links made relative to that folder), the claims block in
    README.md; a suite with no block anywhere rewrites nothing."""
    (tmp_path / "benchmarks").mkdir()
    top = "# top\n<!-- BENCH-CLAIMS-BEGIN -->\nold\n<!-- BENCH-CLAIMS-END -->\ntail\n"
    inner = "# bench\n<!-- BENCH-TINY-BEGIN -->\nold\n<!-- BENCH-TINY-END -->\n"
    (tmp_path / "README.md").write_text(top)
    (tmp_path / "benchmarks" / "README.md").write_text(inner)
    monkeypatch.setattr(collect, "REPO", tmp_path)
    row = "| [grpo](algos/grpo.py) | ![c](benchmarks/results/tiny/curves.png) |"
    assert collect.update_readme("tiny", row) == tmp_path / "benchmarks" / "README.md"
    assert (tmp_path / "benchmarks" / "README.md").read_text() == (
        "# bench\n<!-- BENCH-TINY-BEGIN -->\n| [grpo](../algos/grpo.py) | ![c](results/tiny/curves.png) |\n"
        "<!-- BENCH-TINY-END -->\n"
    )
    assert (tmp_path / "README.md").read_text() == top
    assert collect.update_readme("claims", row) == tmp_path / "README.md"
    assert (tmp_path / "README.md").read_text() == top.replace("\nold\n", f"\n{row}\n")
    assert collect.update_readme("speed", row) is None
