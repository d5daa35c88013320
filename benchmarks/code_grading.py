"""Code grading throughput: seconds per training step to grade 128 completions x 10 stdin/stdout tests.

    python benchmarks/code_grading.py            # writes benchmarks/results/code_grading.json

Three ways to grade the same batch, timed in one invocation, interleaved over ``--repeats`` rounds so that machine
load falls on all alike:

* ``sandboxed``: ``compute_rewards("code", ...)``, the trainer's path: one bwrap sandbox per completion running all
  its tests (a forked child per case), on the sandbox's worker pool (one worker per core);
* ``subprocess_per_test``: one plain ``python -I`` subprocess per test (no isolation at all), on the same number of
  threads: what a naive grader pays in interpreter start-ups;
* the sandbox's own start-up: a no-op ``run_python``, and a plain ``python -I -c pass``, one at a time.

The batch is the tiny code task's first 128 held-out problems, each with its canonical program, or with a program
that fails most tests for every second one (so the wrong path is timed too). Figures: medians over rounds, the
ratio sandboxed / subprocess-per-test, hardware, commit, the rung in force.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from common.code_reward import extract_program, load_tests, stdout_matches  # noqa: E402
from common.data import load_problems  # noqa: E402
from common.sandbox import base_python, get_sandbox, run_python  # noqa: E402
from common.verifiers import compute_rewards, drain_reward_stats  # noqa: E402


def batch(n: int) -> tuple[list[str], list[str]]:
    problems = load_problems("code-expr", "test")[:n]
    texts, golds = [], []
    for i, p in enumerate(problems):
        text = p["solution"]
        if i % 2:  # a wrong program: the last operator flipped
            program = extract_program(text)
            text = "```python\n" + program.replace("print(", "print(-1+", 1) + "```"
        texts.append(text)
        golds.append(p["answer"])
    return texts, golds


def subprocess_per_test(texts: list[str], golds: list[str], workers: int) -> list[bool]:
    exe, _ = base_python()

    def one(program: str, stdin: str, expected: str) -> bool:
        done = subprocess.run([exe, "-I", "-c", program], input=stdin, capture_output=True, text=True, timeout=10)
        return done.returncode == 0 and stdout_matches(done.stdout, expected)

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        jobs = []
        for text, gold in zip(texts, golds):
            tests, program = load_tests(gold), extract_program(text)
            jobs.append([pool.submit(one, program, i, o) for i, o in zip(tests["inputs"], tests["outputs"])])
        return [all(f.result() for f in fs) for fs in jobs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "code_grading.json"))
    args = parser.parse_args()
    texts, golds = batch(args.completions)
    sandbox = get_sandbox()
    workers = sandbox.describe()["workers"]
    tests_per = len(load_tests(golds[0])["inputs"])
    times: dict[str, list[float]] = {"sandboxed_s": [], "subprocess_per_test_s": []}
    agree = True
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        sandboxed = [o.correct for o in compute_rewards("code", texts, golds)]
        times["sandboxed_s"].append(time.perf_counter() - t0)
        drain_reward_stats()
        t0 = time.perf_counter()
        plain = subprocess_per_test(texts, golds, workers)
        times["subprocess_per_test_s"].append(time.perf_counter() - t0)
        agree &= sandboxed == plain
    starts = {"sandbox_noop_s": [], "plain_python_noop_s": []}
    exe, _ = base_python()
    for _ in range(20):
        t0 = time.perf_counter()
        run_python("pass")
        starts["sandbox_noop_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        subprocess.run([exe, "-I", "-c", "pass"], check=True)
        starts["plain_python_noop_s"].append(time.perf_counter() - t0)
    medians = {k: statistics.median(v) for k, v in (times | starts).items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    result = {
        "command": "python benchmarks/code_grading.py",
        "completions": args.completions,
        "tests_per_completion": tests_per,
        "correct_in_batch": sum(sandboxed),
        "graders_agree": agree,
        "medians": medians,
        "ratio_sandboxed_over_subprocess_per_test": medians["sandboxed_s"] / medians["subprocess_per_test_s"],
        "runs": times | starts,
        "sandbox": sandbox.describe(),
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "commit": commit.stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: round(v, 4) for k, v in medians.items()}), "agree", agree)


if __name__ == "__main__":
    main()
