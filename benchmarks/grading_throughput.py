"""Math grading throughput: a fixed mix of 10,000 (completion, gold) answers through ``grade_math_batch``.

    python benchmarks/grading_throughput.py --make-mix   # (re)writes benchmarks/data/grading_mix.jsonl (seeded)
    python benchmarks/grading_throughput.py              # before (--before-ref) vs after (this work tree)

The mix (``--make-mix``, seed 0) is what a math RL run's rewards see, in shuffled order: integers (GSM8K-style, with
thousands separators, dollar signs, units, ``x = ...``), decimals, fractions (``\\frac``, ``\\dfrac``, ``a/b``,
unreduced), LaTeX expressions that need math-verify to see the equivalence (roots, multiples of pi, polynomials,
intervals, sets, tuples, matrices, degrees, complex numbers, choices), right and wrong in about equal numbers,
answers in ``\\boxed{}``, ``<answer>`` tags or an ``Answer:`` line; malformed answers (unbalanced braces, empty
boxes, no marker, garbage); and 13 pathological ones: deep nesting, 5,000 digits, very long strings, and four huge
integer powers (``9^{9^{9}}`` and the like) that really run into the 5 s timeout; the script reports which did.

A run grades the whole mix in batches of ``--batch-size`` (a training step's worth) with a warm pool (started, and
given a second to settle, before the clock starts; the start-up time is reported apart) and reports answers/s.
``before`` is ``common/verifiers.py`` at ``--before-ref`` (loaded from ``git show`` as a module of its own),
``after`` is the work tree's; their runs are interleaved (B A, A B, B A, ...) in one process so that machine load
falls on both alike. Writes ``benchmarks/results/grading_throughput.json``: per-run figures, medians, the ratio
after / before, how many answers the two disagree on, and which rows ``after`` killed on the deadline.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIX = REPO / "benchmarks" / "data" / "grading_mix.jsonl"
OUT = REPO / "benchmarks" / "results" / "grading_throughput.json"
FILLER = [
    "Let me work through this carefully.",
    "First, set up the equation from the problem statement.",
    "Substituting the known values gives a simpler expression.",
    "We can check this by plugging the value back in.",
    "Simplifying both sides, the terms cancel nicely.",
    "Hmm, wait, let me double-check the arithmetic.",
    "So the quantity we want follows directly.",
]

# ----------------------------------------------------------------------------------------------
# The mix
# ----------------------------------------------------------------------------------------------


def _wrap(rng: random.Random, answer: str) -> str:
    """A short reasoning-like completion that ends with ``answer`` in one of the usual markers."""
    body = " ".join(rng.sample(FILLER, rng.randint(1, 4)))
    style = rng.random()
    if style < 0.75:
        return f"{body} Therefore the answer is $\\boxed{{{answer}}}$."
    if style < 0.87:
        return f"<think>{body}</think> <answer>{answer}</answer>"
    return f"{body}\nAnswer: ${answer}$"


def _integer(rng: random.Random) -> tuple[str, str]:
    n = rng.choice([rng.randint(0, 100), rng.randint(0, 5000), rng.randint(1000, 2_000_000)])
    gold = f"{n:,}" if n >= 1000 and rng.random() < 0.2 else str(n)
    pred = n if rng.random() < 0.5 else n + rng.choice([-10, -1, 1, 2, 100])
    form = rng.random()
    if form < 0.6:
        text = str(pred)
    elif form < 0.7:
        text = f"{pred:,}"
    elif form < 0.78:
        text = f"{pred}.0"
    elif form < 0.84:
        text = f"\\${pred}"
    elif form < 0.9:
        text = f"x = {pred}"
    elif form < 0.95:
        text = f"{pred} \\text{{ apples}}"
    else:
        text = f"{pred}\\%"
    return text, gold


def _decimal(rng: random.Random) -> tuple[str, str]:
    value = Fraction(rng.randint(1, 999), rng.choice([4, 8, 10, 20, 100]))
    gold = f"{float(value):g}"
    pred = value if rng.random() < 0.5 else value + Fraction(rng.choice([-1, 1]), 100)
    form = rng.random()
    if form < 0.5:
        text = f"{float(pred):g}"
    elif form < 0.7:
        text = f"{float(pred):.3f}"
    elif form < 0.9:
        text = f"\\frac{{{pred.numerator}}}{{{pred.denominator}}}"
    else:
        text = f"{pred.numerator}/{pred.denominator}"
    return text, gold


def _fraction(rng: random.Random) -> tuple[str, str]:
    value = Fraction(rng.randint(1, 60), rng.randint(2, 60))
    if value.denominator == 1:
        value += Fraction(1, 7)
    gold = f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
    pred = value if rng.random() < 0.5 else value + Fraction(1, value.denominator + 1)
    k = rng.randint(2, 5)
    sign = "-" if rng.random() < 0.1 else ""
    gold = sign + gold
    form = rng.random()
    if form < 0.45:
        text = f"{sign}\\frac{{{pred.numerator}}}{{{pred.denominator}}}"
    elif form < 0.6:
        text = f"{sign}\\dfrac{{{pred.numerator}}}{{{pred.denominator}}}"
    elif form < 0.75:
        text = f"{sign}{pred.numerator}/{pred.denominator}"
    elif form < 0.9:
        text = f"{sign}\\frac{{{k * pred.numerator}}}{{{k * pred.denominator}}}"
    else:
        text = f"{sign}\\tfrac{{{pred.numerator}}}{{{pred.denominator}}}"
    return text, gold


def _expression(rng: random.Random) -> tuple[str, str]:
    a, b, c = rng.randint(2, 9), rng.randint(1, 9), rng.randint(1, 12)
    right = rng.random() < 0.5
    d = 0 if right else 1
    pairs = [
        (f"{a}\\sqrt{{2}}", f"\\sqrt{{{2 * a * a + d}}}"),
        (f"\\frac{{{b}\\pi}}{{{c}}}", f"\\frac{{{b + d}}}{{{c}}}\\pi"),
        (f"{b}\\pi", f"{b + d}\\pi"),
        (f"(x+{b})^2", f"x^2+{2 * b}x+{b * b + d}"),
        (f"x^2-{b * b}", f"(x-{b})(x+{b + d})"),
        (f"(-\\infty, {b})", f"x<{b + d}"),
        (f"[{b}, {b + c})", f"[{b}, {b + c + d})"),
        (f"\\{{{a}, {b}, {c}\\}}", f"\\{{{c}, {a}, {b + d}\\}}"),
        (f"({a}, {b})", f"({a},{b + d})"),
        (
            f"\\begin{{pmatrix}} {a} & {b} \\\\ {c} & 1 \\end{{pmatrix}}",
            f"\\begin{{pmatrix}} {a} & {b} \\\\ {c} & {1 + d} \\end{{pmatrix}}",
        ),
        (f"{10 * c}^\\circ", f"{10 * c + d}"),
        (f"{a}+{b}i", f"{b + d}i+{a}"),
        ("\\text{(C)}", "C" if right else "D"),
        (f"y = {a}x + {b}", f"y={a}x+{b + d}"),
        (f"{2**a}", f"2^{{{a + d}}}"),
        (f"{a}", f"\\log_2 {2 ** (a + d)}"),
        (f"\\frac{{\\sqrt{{3}}}}{{{a}}}", f"\\frac{{1}}{{{a}}}\\sqrt{{{3 + d}}}"),
        (f"{a}e^{{{b}}}", f"{a + d}e^{{{b}}}"),
    ]
    gold, text = rng.choice(pairs)
    return text, gold


def _malformed(rng: random.Random) -> tuple[str, str]:
    gold = str(rng.randint(1, 500))
    kind = rng.randrange(8)
    body = " ".join(rng.sample(FILLER, 2))
    if kind == 0:
        return f"{body} so $\\boxed{{\\frac{{{gold}}}{{2}}$", gold  # unbalanced: truncated box
    if kind == 1:
        return f"{body} \\boxed{{}}", gold
    if kind == 2:
        return f"{body} The answer is {gold}.", gold  # no marker
    if kind == 3:
        return f"{body} \\boxed{{???}}", gold
    if kind == 4:
        return f"{body} \\boxed{{\\frac{{}}{{}}}}", gold
    if kind == 5:
        return f"{body} \\boxed{{({gold}, }}", gold
    if kind == 6:
        return f"{body} \\boxed{{x^}}", gold
    return f"{body} <answer></answer>", gold


def _pathological() -> list[dict]:
    """Deep nesting, many digits, long strings (all well under 5 s), and four huge powers that hit the timeout."""
    items = [
        ("\\boxed{9^{9^{9}}}", "1", "timeout"),
        ("\\boxed{10^{10^{10}}}", "10", "timeout"),
        ("\\boxed{3^{3^{3^{3}}}}", "3", "timeout"),
        ("\\boxed{9^{9^{9^{9^{9}}}}}", "1", "timeout"),
        ("\\boxed{7^{7^{7}}}", "7", "huge power"),
        ("\\boxed{" + "\\frac{" * 200 + "}", "1", "nesting"),
        ("\\boxed{" + "\\sqrt{" * 50 + "2" + "}" * 50 + "}", "2", "nesting"),
        ("\\boxed{" + "(" * 10 + "1" + ")" * 10 + "}", "1", "nesting"),
        ("\\boxed{" + "7" * 5000 + "}", "7" * 5000, "digits"),
        ("\\boxed{" + "1+" * 1000 + "1}", "1001", "long"),
        ("x" * 50_000, "1", "long"),
        ("word " * 20_000 + "\\boxed{3}", "3", "long"),
        ("\\boxed{(x+y+1)^{30}}", "(1+x+y)^{30}", "long"),
    ]
    return [{"completion": c, "gold": g, "kind": "pathological", "note": n} for c, g, n in items]


def make_mix(path: Path, size: int = 10_000, seed: int = 0) -> None:
    rng = random.Random(seed)
    counts = {"integer": 3000, "decimal": 800, "fraction": 1200, "expression": 4000, "malformed": 987}
    makers = {"integer": _integer, "decimal": _decimal, "fraction": _fraction, "expression": _expression}
    rows = _pathological()
    for kind, n in counts.items():
        for _ in range(n):
            if kind == "malformed":
                completion, gold = _malformed(rng)
            else:
                answer, gold = makers[kind](rng)
                completion = _wrap(rng, answer)
            rows.append({"completion": completion, "gold": gold, "kind": kind})
    assert len(rows) == size, len(rows)
    rng.shuffle(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {path}")


# ----------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------


def _load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def _hardware() -> str:
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"CPU {cpu}, {os.cpu_count()} cores"


_OFFSET = [0]  # first row of the batch being graded
_TASK_ROWS: dict[int, list[int]] = {}  # batch offset -> the rows of its tasks sent to workers, in order
_TIMED_OUT: list[int] = []  # rows whose worker ``after`` killed on the deadline


def _count_deadline_kills() -> None:
    """Record each task that ``after``'s pool kills on its deadline (an instrument only; grading is unchanged)."""
    from common.math_grader import GraderPool

    retire = GraderPool._retire

    def counting_retire(pool, worker, replace=True):
        if worker.ready and worker.index is not None and time.monotonic() >= worker.deadline:
            _TIMED_OUT.append(_TASK_ROWS[_OFFSET[0]][worker.index])
        retire(pool, worker, replace)

    GraderPool._retire = counting_retire


def _grade_all(module, rows: list[dict], batch_size: int, timeout_s: float) -> tuple[list[bool], float, float]:
    """Start the pool (timed apart), then grade every row in batches; return (grades, seconds, start-up seconds)."""
    module.shutdown_pool()
    t0 = time.perf_counter()
    assert module.grade_math_batch(["\\boxed{0.5}"] * 4, ["\\frac{1}{2}"] * 4) == [True] * 4
    startup = time.perf_counter() - t0
    time.sleep(1.0)  # every worker up and idle before the clock starts
    grades: list[bool] = []
    t0 = time.perf_counter()
    for i in range(0, len(rows), batch_size):
        batch, _OFFSET[0] = rows[i : i + batch_size], i
        grades += module.grade_math_batch([r["completion"] for r in batch], [r["gold"] for r in batch], timeout_s)
    seconds = time.perf_counter() - t0
    module.shutdown_pool()
    return grades, seconds, startup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make-mix", action="store_true", help="write the mix and exit")
    parser.add_argument("--mix", type=Path, default=MIX)
    parser.add_argument("--before-ref", default="9b7cb25", help="git ref whose common/verifiers.py is 'before'")
    parser.add_argument("--runs", type=int, default=3, help="runs of each, interleaved")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.make_mix:
        make_mix(args.mix)
        return

    rows = [json.loads(line) for line in args.mix.read_text().splitlines()]
    sys.path.insert(0, str(REPO))
    from common import verifiers as after

    _count_deadline_kills()

    tmp = Path(tempfile.mkdtemp(prefix="grading_before_"))
    (tmp / "verifiers_before.py").write_text(_git("show", f"{args.before_ref}:common/verifiers.py") + "\n")
    modules = {"before": _load_module("verifiers_before", tmp / "verifiers_before.py"), "after": after}
    to_workers = [isinstance(after._prepare(r["completion"], r["gold"]), tuple) for r in rows]
    for i in range(0, len(rows), args.batch_size):
        _TASK_ROWS[i] = [j for j in range(i, min(i + args.batch_size, len(rows))) if to_workers[j]]
    load_start = os.getloadavg()

    runs, grades = [], {}
    for round_ in range(args.runs):
        for label in ("before", "after") if round_ % 2 == 0 else ("after", "before"):
            _TIMED_OUT.clear()
            got, seconds, startup = _grade_all(modules[label], rows, args.batch_size, args.timeout_s)
            grades.setdefault(label, got)
            run = {"label": label, "round": round_, "seconds": seconds, "answers_per_s": len(rows) / seconds}
            run |= {"pool_startup_s": startup, "correct": sum(got)}
            runs.append(run | ({"timed_out_rows": sorted(_TIMED_OUT)} if label == "after" else {}))
            print(f"round {round_} {label:6s} {seconds:6.2f} s  {len(rows) / seconds:7.1f} answers/s", flush=True)
    medians = {label: statistics.median(r["answers_per_s"] for r in runs if r["label"] == label) for label in modules}
    disagree = [i for i, (b, a) in enumerate(zip(grades["before"], grades["after"])) if a != b]

    timed_out = sorted({i for r in runs for i in r.get("timed_out_rows", [])})

    result = {
        "hardware": _hardware(),
        "python": platform.python_version(),
        "command": "python benchmarks/grading_throughput.py " + " ".join(sys.argv[1:]),
        "before": {"ref": args.before_ref, "commit": _git("rev-parse", args.before_ref)},
        "after": {
            "commit": _git("rev-parse", "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "common/verifiers.py", "common/math_grader.py")),
        },
        "mix": {
            "path": str(args.mix.relative_to(REPO)) if args.mix.is_relative_to(REPO) else str(args.mix),
            "sha256": hashlib.sha256(args.mix.read_bytes()).hexdigest(),
            "answers": len(rows),
            "kinds": {k: sum(r["kind"] == k for r in rows) for k in sorted({r["kind"] for r in rows})},
            "decided_in_parent": len(rows) - sum(to_workers),
            "sent_to_workers": sum(to_workers),
            "timed_out": [{"row": i, "note": rows[i].get("note", rows[i]["kind"])} for i in timed_out],
        },
        "batch_size": args.batch_size,
        "timeout_s": args.timeout_s,
        "num_workers": {"before": modules["before"].NUM_WORKERS, "after": after.NUM_WORKERS},
        "loadavg_1_5_15": {"start": load_start, "end": os.getloadavg()},
        "runs": runs,
        "median_answers_per_s": medians,
        "ratio_after_over_before": medians["after"] / medians["before"],
        "disagreements": {"count": len(disagree), "rows": disagree[:20]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_answers_per_s", "ratio_after_over_before", "disagreements")}))
    print(f"answers that hit the {args.timeout_s:g} s timeout (any after run): {len(timed_out)}; wrote {args.out}")


if __name__ == "__main__":
    main()
