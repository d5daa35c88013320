"""Judge a suite's pre-registered claims, and fit ScaleRL's saturating curve to each run.

Used by ``benchmarks/collect.py`` for a manifest with ``[[claims]]`` entries (``benchmarks/suites/claims.toml``).
Each claim names two run labels (``treatment``, ``control``), a logged ``metric``, how a run's rows reduce to one
number (``reduce``), the claimed ``direction`` and the smallest effect of interest (``min_effect``). The test is
the same for every claim and fixed here before any judging run:

    per seed s     d_s = sign · (treatment_s - control_s)        sign = +1 for direction "higher", -1 for "lower"
    effect         d = mean_s d_s,  SE = std_s d_s / sqrt(n)     paired by seed (same data order and sampling seeds)
    reproduced     d > 2 SE                                      the claimed direction, beyond 2 standard errors
    not reproduced d + 2 SE < min_effect                         the data exclude an effect of the smallest size
    inconclusive   otherwise                                     (a wrong-direction effect counts as not reproduced)

An *equivalence* claim ("B costs nothing against A": ``test = "noninferior"``) uses a non-inferiority test instead,
its margin fixed by one rule before any design run (``noninferiority_margin``), so that it cannot be chosen to pass:

    margin         min(0.02, gain / 4)                           gain: the control arm's mean base-to-final gain of
                                                                 the metric (final minus step-0 value, per seed)
    reproduced     d - 2 SE > -margin                            the data exclude a loss as large as the margin
    not reproduced d + 2 SE < -margin                            the data exclude a loss smaller than the margin
    inconclusive   otherwise

A mechanism gate (``gate = {metric, reduce, min and/or max, arm}``, optional) names a quantity that must lie within
its bounds in every run of the gated arms (``arm``: "both", the default, "treatment" or "control") for the mechanism
to have acted (e.g. the share of tokens the symmetric clip binds on, in the control arm; a training accuracy low
enough that wrong answers stay common); a claim whose gate fails is judged "not testable here", never "not
reproduced".

Reductions of one run's rows (``steps = [lo, hi]`` bounds the steps used, inclusive):

    final    the metric's value in the last row that logs it (evaluation metrics: the final evaluation)
    mean     mean of the metric over the rows in ``steps``
    growth   mean over ``late`` minus mean over ``early`` (two step windows)
    first_reach  the first step whose value reaches ``target`` (a held-out accuracy; with equal samples per step in
             both arms, steps count samples). A run that never reaches it is censored at its last step, its
             budget. Censoring never favours the claim: a censored treatment counts no earlier than the control
             of its seed, and a censored control counts earlier than it would have (the table gives how many
             runs of each arm were censored). With ``compute = {treatment = [[w, a, b], ...], control = [...]}``
             the value is instead the compute spent through that step, summed over steps 1..t of sum_k
             w_k * a_k * b_k per step (each term a product of two logged metrics, e.g. a token count as
             ``time/tokens_per_s`` x ``time/rollout_s``), each arm with its own terms (``compute_used``)
    asymptote    A of the compute fit below, per run; a run whose fit is not identified has no value, and a claim
             with any such run among its judging seeds is inconclusive, never a win

Compute-performance fit (ScaleRL, Khatri et al. 2025, arXiv 2510.13786, eq. 1): the held-out curve against
training compute C (completion tokens generated, summed over steps) is fitted by

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)

with R0 the step-0 evaluation (fixed, as the paper fixes it), and A (asymptote), B (scaling exponent) and C_mid
(compute at half the gain) free, by ``scipy.optimize.curve_fit``. A fit is reported as identified only when it
converges with a finite covariance, the standard error of A is below 0.05, that of B below half of B, and C_mid
is within the compute the run observed (past its end the curve has not bent yet and A is a guess).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from benchmarks.reporting import mean_std, pyplot, series  # shared with collect.py, which imports this module

FIT_MIN_POINTS = 6  # evaluations after step 0 needed to attempt a fit (3 free parameters)


# ------------------------------------------------------------------------------------------------- reductions
def reduce_run(rows: list[dict], metric: str, reduce: str, claim: dict, arm: str | None = None) -> float | None:
    """One run's number for ``metric`` (None when the run never logs it in the window); ``arm`` picks the claim's
    per-arm compute terms for ``first_reach`` in compute."""

    def window(lo_hi: list[int]) -> list[float]:
        lo, hi = lo_hi
        return [r[metric] for r in rows if metric in r and lo <= r["step"] <= hi]

    if reduce == "final":
        values = [r[metric] for r in rows if metric in r]
        return values[-1] if values else None
    if reduce == "mean":
        values = window(claim.get("steps", [0, 10**9]))
        return statistics.mean(values) if values else None
    if reduce == "growth":
        early, late = window(claim["early"]), window(claim["late"])
        return statistics.mean(late) - statistics.mean(early) if early and late else None
    if reduce == "first_reach":
        reached = first_reach(rows, metric, claim["target"])
        if reached is None or "compute" not in claim:
            return None if reached is None else reached[0]
        return compute_used(rows, claim["compute"][arm], reached[0])
    if reduce == "asymptote":
        compute, score, r0 = compute_curve(rows, metric)
        fit = fit_sigmoid(compute, score, r0) if r0 is not None else {"identified": False}
        return fit["A"] if fit["identified"] else None
    raise ValueError(
        f"claim {claim.get('id')!r}: unknown reduce {reduce!r}; use final, mean, growth, first_reach or asymptote"
    )


def first_reach(rows: list[dict], metric: str, target: float) -> tuple[int, bool] | None:
    """(the first step whose ``metric`` is >= ``target``, False), or (the run's last step, True) when it never gets
    there (censored at its budget); None if the run never logs the metric."""
    values = [(r["step"], r[metric]) for r in rows if metric in r]
    if not values:
        return None
    hit = next((step for step, value in values if value >= target), None)
    return (hit, False) if hit is not None else (max(r["step"] for r in rows if "step" in r), True)


def compute_used(rows: list[dict], terms: list[list], step: int) -> float:
    """Compute spent in steps 1..``step``: per step sum_k w_k * a_k * b_k over ``terms`` = [[w, a, b], ...] (a and b
    logged metrics); a step that logs a term's metrics counts once, however many rows it has."""
    per_step = {}
    for row in rows:
        if 0 < row.get("step", 0) <= step and all(a in row and b in row for _, a, b in terms):
            per_step[row["step"]] = sum(w * row[a] * row[b] for w, a, b in terms)
    return sum(per_step.values())


MIN_PAIRS = 2  # seeds with both arms' values: a standard error needs two


def paired_test(treatment: dict[int, float], control: dict[int, float], direction: str, min_effect: float) -> dict:
    """The pre-registered test on per-seed values (seed -> value) of the two arms; see the module docstring."""
    if direction not in ("higher", "lower"):
        raise ValueError(f"direction must be 'higher' or 'lower', not {direction!r}")
    sign = 1.0 if direction == "higher" else -1.0
    seeds = sorted(set(treatment) & set(control))
    diffs = [sign * (treatment[s] - control[s]) for s in seeds]
    out = {"n": len(seeds), "seeds": seeds, "diffs": diffs, "effect": None, "se": None, "verdict": "inconclusive"}
    if len(diffs) < MIN_PAIRS:
        out["verdict"] = "not enough seeds"
        return out
    effect, se = statistics.mean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
    out |= {"effect": effect, "se": se}
    if effect > 2 * se:
        out["verdict"] = "reproduced"
    elif effect + 2 * se < min_effect:
        out["verdict"] = "not reproduced"
    return out


NONINFERIORITY_MARGIN_CAP = 0.02  # held-out mean@n: the largest loss an equivalence claim may tolerate
NONINFERIORITY_GAIN_SHARE = 0.25  # ... and never more than a quarter of what the control arm learns


def noninferiority_margin(control_gains: list[float]) -> float:
    """The pre-registered margin: min(0.02, a quarter of the control arm's mean base-to-final gain)."""
    if not control_gains:
        raise ValueError("the non-inferiority margin needs the control arm's base-to-final gains")
    return min(NONINFERIORITY_MARGIN_CAP, NONINFERIORITY_GAIN_SHARE * statistics.mean(control_gains))


def noninferiority_test(treatment: dict[int, float], control: dict[int, float], margin: float) -> dict:
    """Per seed d = treatment - control (higher is better); see the module docstring. ``margin`` > 0."""
    if margin <= 0:
        raise ValueError(f"a non-inferiority margin must be > 0, got {margin} (the control arm did not learn)")
    seeds = sorted(set(treatment) & set(control))
    diffs = [treatment[s] - control[s] for s in seeds]
    out = {"n": len(seeds), "seeds": seeds, "diffs": diffs, "effect": None, "se": None, "verdict": "inconclusive"}
    out["margin"] = margin
    if len(diffs) < MIN_PAIRS:
        out["verdict"] = "not enough seeds"
        return out
    effect, se = statistics.mean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
    out |= {"effect": effect, "se": se}
    if effect - 2 * se > -margin:
        out["verdict"] = "reproduced"
    elif effect + 2 * se < -margin:
        out["verdict"] = "not reproduced"
    return out


def gates(claim: dict) -> list[dict]:
    """The claim's mechanism gates: ``gate`` is one table or a list of them, all of which must hold."""
    gate = claim.get("gate")
    return [] if not gate else [gate] if isinstance(gate, dict) else list(gate)


def gate_passes(claim: dict, runs: list[dict]) -> bool | None:
    """Whether every run of the gated arms (``gate.arm``: both, the default, or one) reaches each of the claim's
    mechanism gates (None: the claim has no gate)."""
    if not gates(claim):
        return None
    return all(one_gate_passes(claim, gate, runs) for gate in gates(claim))


def one_gate_passes(claim: dict, gate: dict, runs: list[dict]) -> bool:
    """Whether every run of one gate's arms lies within its bounds."""
    arm = gate.get("arm", "both")
    if arm not in ("both", "treatment", "control"):
        raise ValueError(f"claim {claim.get('id')!r}: gate arm must be both, treatment or control, not {arm!r}")
    labels = (claim["treatment"], claim["control"]) if arm == "both" else (claim[arm],)
    arms = [r for r in runs if r["label"] in labels]
    seeds = set(claim.get("seeds", []))
    arms = [r for r in arms if not seeds or r["seed"] in seeds]
    if "min" not in gate and "max" not in gate:
        raise ValueError(f"claim {claim.get('id')!r}: a gate needs a bound, min or max")
    values = [reduce_run(r["rows"], gate["metric"], gate["reduce"], gate) for r in arms]
    return bool(values) and all(
        v is not None and v >= gate.get("min", -math.inf) and v <= gate.get("max", math.inf) for v in values
    )


def judge(claim: dict, runs: list[dict]) -> dict:
    """Apply one claim's test to the collected runs (each with label, seed, rows)."""
    arms = {}
    for arm in ("treatment", "control"):
        arms[arm] = {
            r["seed"]: value
            for r in runs
            if r["label"] == claim[arm]
            and (value := reduce_run(r["rows"], claim["metric"], claim["reduce"], claim, arm)) is not None
        }
    seeds = set(claim.get("seeds", []))
    if seeds:  # only the judging seeds count
        arms = {arm: {s: v for s, v in values.items() if s in seeds} for arm, values in arms.items()}
    if claim["reduce"] == "first_reach":  # a censored treatment never counts earlier than its seed's control
        for r in runs:
            if r["label"] == claim["treatment"] and r["seed"] in arms["treatment"] and r["seed"] in arms["control"]:
                if first_reach(r["rows"], claim["metric"], claim["target"])[1]:
                    arms["treatment"][r["seed"]] = max(arms["treatment"][r["seed"]], arms["control"][r["seed"]])
    if claim.get("test", "superior") == "noninferior":
        gains = [
            reduce_run(r["rows"], claim["metric"], "final", claim) - base
            for r in runs
            if r["label"] == claim["control"]
            and r["seed"] in arms["control"]
            and (base := next((row[claim["metric"]] for row in r["rows"] if claim["metric"] in row), None)) is not None
        ]
        result = noninferiority_test(arms["treatment"], arms["control"], noninferiority_margin(gains))
    else:
        result = paired_test(arms["treatment"], arms["control"], claim["direction"], claim["min_effect"])
    if claim["reduce"] == "asymptote":  # an unidentified fit drops out of the pairs: say so, and never call it a win
        ran = {arm: {r["seed"] for r in runs if r["label"] == claim[arm]} for arm in ("treatment", "control")}
        ran = {arm: seeds_ran & seeds if seeds else seeds_ran for arm, seeds_ran in ran.items()}
        result["unidentified"] = sum(s not in arms[arm] for arm in ran for s in ran[arm])
        # too few pairs because fits failed (not because runs are missing) is the registered rule's inconclusive
        if result["unidentified"] and len(ran["treatment"] & ran["control"]) >= MIN_PAIRS:
            result["verdict"] = "inconclusive"
    if claim["reduce"] == "first_reach":
        result["censored"] = {
            arm: sum(
                first_reach(r["rows"], claim["metric"], claim["target"])[1]
                for r in runs
                if r["label"] == claim[arm] and r["seed"] in arms[arm]
            )
            for arm in ("treatment", "control")
        }
    gate = gate_passes(claim, runs)
    if gate is False:
        result["verdict"] = "not testable here"
    return result | {"treatment": arms["treatment"], "control": arms["control"], "gate": gate}


def describe_test(claim: dict) -> str:
    """The pre-registered test in words, from the claim's fields (so the table cannot drift from what was applied)."""
    how = {
        "final": "at the final evaluation",
        "mean": f"mean over steps {claim.get('steps', ['first', 'last'])[0]}-{claim.get('steps', [0, 'last'])[1]}",
        "growth": (
            f"growth: mean over steps {claim.get('late', ['?', '?'])[0]}-{claim.get('late', ['?', '?'])[1]} minus "
            f"mean over steps {claim.get('early', ['?', '?'])[0]}-{claim.get('early', ['?', '?'])[1]}"
        ),
        "first_reach": (
            f"first step at which it reaches {claim.get('target')} (never: censored at the last step)"
            if "compute" not in claim
            else f"compute spent until it first reaches {claim.get('target')} (never: censored at the run's "
            f"total), {compute_words(claim)}"
        ),
        "asymptote": "the asymptote A of each run's compute fit (any unidentified fit: inconclusive)",
    }[claim["reduce"]]
    seeds = ", ".join(map(str, claim.get("seeds", []))) or "all"
    described = []
    for one in gates(claim):
        arm = one.get("arm", "both")
        where = "every run" if arm == "both" else f"every {claim[arm]} run"
        span = f" over steps {one['steps'][0]}-{one['steps'][1]}" if "steps" in one else ""
        if one["reduce"] == "growth":
            span = f" from steps {one['early'][0]}-{one['early'][1]} to {one['late'][0]}-{one['late'][1]}"
        bounds = " and ".join(f"{op} {one[k]}" for k, op in (("min", ">="), ("max", "<=")) if k in one)
        described.append(f"`{one['metric']}` ({one['reduce']}{span}) {bounds} in {where}")
    gate = f"; gate: {' and '.join(described)}" if described else ""
    if claim.get("test", "superior") == "noninferior":
        return (
            f"`{claim['metric']}`, {how}; {claim['treatment']} not worse than {claim['control']} by the margin "
            f"min({NONINFERIORITY_MARGIN_CAP}, {NONINFERIORITY_GAIN_SHARE:g} x {claim['control']}'s gain), paired "
            f"by seed; seeds {seeds}{gate}"
        )
    relation = ">" if claim["direction"] == "higher" else "<"
    return (
        f"`{claim['metric']}`, {how}; {claim['treatment']} {relation} {claim['control']}, paired by seed; "
        f"smallest effect of interest {claim['min_effect']}; seeds {seeds}{gate}"
    )


def compute_words(claim: dict) -> str:
    """The claim's per-arm compute terms in words: 'treatment: 1 x a x b + 3 x c x d; control: ...'."""
    return "; ".join(
        f"{claim[arm]}: " + " + ".join(f"{w:g} x `{a}` x `{b}`" for w, a, b in claim["compute"][arm])
        for arm in ("treatment", "control")
    )


def judged_commits(claim: dict, runs: list[dict]) -> list[str]:
    """The commits the claim's judging runs were made at (a regeneration at new code re-judges the row openly)."""
    seeds = set(claim.get("seeds", []))
    return sorted(
        {
            r["commit"][:7] + ("+dirty" if r.get("dirty") else "")
            for r in runs
            if r.get("commit")
            and r["label"] in (claim["treatment"], claim["control"])
            and (not seeds or r["seed"] in seeds)
        }
    )


def claims_table(claims: list[dict], runs: list[dict]) -> tuple[str, list[dict]]:
    """The markdown table (one row per claim) and each claim's judged result."""
    lines = [
        "| claim | the paper's evidence | pre-registered test | our measurement (mean ± std over seeds) | verdict |",
        "|---|---|---|---|---|",
    ]
    results = []
    for claim in claims:
        result = judge(claim, runs)
        results.append(result)
        digits = claim.get("digits", 3)
        effect = (
            f"{result['effect']:+.{digits}f} ± {result['se']:.{digits}f} (SE)" if result["effect"] is not None else "–"
        )
        measured = (
            f"{claim['treatment']}: {mean_std(list(result['treatment'].values()), digits)}; "
            f"{claim['control']}: {mean_std(list(result['control'].values()), digits)}; "
            f"paired effect {effect}, n = {result['n']}"
            + (f"; margin {result['margin']:.{digits}f}" if "margin" in result else "")
            + (
                f"; censored runs {result['censored']['treatment']} / {result['censored']['control']}"
                if "censored" in result
                else ""
            )
            + (f"; unidentified fits {result['unidentified']}" if result.get("unidentified") else "")
            + (f"; runs at {', '.join(commits)}" if (commits := judged_commits(claim, runs)) else "")
            + ("; gate failed" if result["gate"] is False else "")
        )
        lines.append(
            f"| **{claim['name']}**: {claim['claim']} | {claim['evidence']} | {describe_test(claim)} | {measured} "
            f"| **{result['verdict']}** |"
        )
    return "\n".join(lines), results


# ------------------------------------------------------------------------------------------------- ScaleRL fit
def sigmoid_curve(compute, r0: float, asymptote: float, exponent: float, c_mid: float):
    """R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), elementwise over a numpy array of C > 0."""
    return r0 + (asymptote - r0) / (1.0 + (c_mid / compute) ** exponent)


def compute_curve(rows: list[dict], eval_key: str) -> tuple[list[float], list[float], float | None]:
    """(compute, held-out score) at each evaluation after step 0, and the step-0 score R0.

    Compute at step t is the completion tokens generated in steps 1..t (``time/tokens_per_s × time/rollout_s``,
    every sampling round included).
    """
    tokens, total = {0: 0.0}, 0.0
    for row in rows:
        if "time/tokens_per_s" in row and "time/rollout_s" in row:
            total += row["time/tokens_per_s"] * row["time/rollout_s"]
            tokens[row["step"]] = total
    r0 = next((row[eval_key] for row in rows if eval_key in row and row["step"] == 0), None)
    points = [(tokens[row["step"]], row[eval_key]) for row in rows if eval_key in row and row["step"] > 0]
    points = [(c, y) for c, y in points if c > 0]
    return [c for c, _ in points], [y for _, y in points], r0


def fit_sigmoid(compute: list[float], score: list[float], r0: float) -> dict:
    """Fit A, B, C_mid with R0 fixed; ``identified`` says whether the data pin A and B (module docstring)."""
    import numpy as np
    from scipy.optimize import curve_fit

    out = {"identified": False, "A": None, "B": None, "C_mid": None, "why": ""}
    if len(compute) < FIT_MIN_POINTS:
        out["why"] = f"{len(compute)} evaluations (< {FIT_MIN_POINTS})"
        return out
    c, y = np.asarray(compute, dtype=float), np.asarray(score, dtype=float)
    scale = float(np.median(c))  # fit in units of the median compute: well-conditioned C_mid

    def model(x, asymptote, exponent, c_mid):
        return sigmoid_curve(x, r0, asymptote, exponent, c_mid)

    try:
        params, cov = curve_fit(
            model,
            c / scale,
            y,
            p0=(float(y[-1]), 1.0, float(np.median(c / scale))),
            bounds=([0.0, 0.05, 1e-4], [1.0, 20.0, 1e4]),
            maxfev=20000,
        )
    except (RuntimeError, ValueError) as error:
        out["why"] = f"no convergence ({error.__class__.__name__})"
        return out
    errors = np.sqrt(np.diag(cov)) if np.all(np.isfinite(cov)) else np.full(3, np.inf)
    asymptote, exponent, c_mid = (float(p) for p in params)
    out |= {"A": asymptote, "B": exponent, "C_mid": c_mid * scale, "se_A": float(errors[0]), "se_B": float(errors[1])}
    if not np.all(np.isfinite(errors)):
        out["why"] = "infinite covariance"
    elif errors[0] >= 0.05:
        out["why"] = f"SE(A) {errors[0]:.3f} >= 0.05"
    elif errors[1] >= 0.5 * exponent:
        out["why"] = f"SE(B) {errors[1]:.2f} >= B/2"
    elif c_mid * scale > c.max():
        out["why"] = "C_mid beyond the observed compute"
    else:
        out["identified"] = True
    return out


def fits_table(runs: list[dict]) -> tuple[str, dict[str, list[dict]]]:
    """A, B per label over seeds (identified fits only), for every run evaluated often enough."""
    fits = defaultdict(list)
    for r in runs:
        key = f"{r['eval_prefix']}mean@{r['n']}"
        compute, score, r0 = compute_curve(r["rows"], key)
        if r0 is None or len(compute) < FIT_MIN_POINTS:
            continue
        fit = fit_sigmoid(compute, score, r0)
        fits[r["label"]].append(fit | {"seed": r["seed"], "R0": r0, "compute": compute, "score": score})
    lines = [
        "| run label | R0 (step 0) | asymptote A | exponent B | C_mid (tokens) | identified | why not (first) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, fs in fits.items():
        ok = [f for f in fs if f["identified"]]
        reasons = [f["why"] for f in fs if not f["identified"]]
        lines.append(
            f"| {label} | {mean_std([f['R0'] for f in fs], 3)} | {mean_std([f['A'] for f in ok], 3)} "
            f"| {mean_std([f['B'] for f in ok], 2)} | {mean_std([f['C_mid'] for f in ok], 0)} "
            f"| {len(ok)}/{len(fs)} | {reasons[0] if reasons else ''} |"
        )
    return ("\n".join(lines) if fits else ""), fits


# ------------------------------------------------------------------------------------------------- plots
def plot_claims(claims: list[dict], results: list[dict], runs: list[dict], out) -> None:
    """One panel per claim: the metric's key for both arms over steps (mean ± std over the judging seeds)."""
    plt = pyplot()
    cols = 3
    rows_n = -(-len(claims) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.4 * cols, 3.9 * rows_n), squeeze=False)
    for ax, claim, result in zip(axes.flat, claims, results):
        xs = []
        for arm, color in (("treatment", "tab:red"), ("control", "tab:blue")):
            rs = [r for r in runs if r["label"] == claim[arm] and r["seed"] in result[arm]]
            if not rs:
                continue
            xs, means, stds = series(rs, claim["metric"])
            ax.plot(xs, means, color=color, label=f"{claim[arm]} ({len(rs)} seeds)", marker="." if len(xs) < 15 else "")
            ax.fill_between(
                xs, [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)], color=color, alpha=0.15
            )
        for key in ("steps", "early", "late"):
            if key in claim:
                ax.axvspan(claim[key][0], min(claim[key][1], max(xs) if xs else 0), color="grey", alpha=0.08)
        ax.set_title(f"{claim['name']}: {result['verdict']}", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(claim["metric"], fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_grid(
        plt,
        fig,
        axes,
        len(claims),
        "claims testbed: each claim's metric, treatment vs control (grey: the pre-registered window)",
        out,
    )


def plot_fits(fits: dict[str, list[dict]], out) -> None:
    """Held-out score against compute with each identified fit, one panel per label."""
    import numpy as np

    plt = pyplot()
    labels = list(fits)
    if not labels:
        return
    cols = min(4, len(labels))
    rows_n = -(-len(labels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.3 * rows_n), squeeze=False)
    for ax, label in zip(axes.flat, labels):
        for i, f in enumerate(fits[label]):
            color = plt.cm.tab10(i % 10)
            ax.plot(f["compute"], f["score"], ".", color=color, alpha=0.7)
            if f["identified"]:
                grid = np.linspace(min(f["compute"]), max(f["compute"]), 100)
                ax.plot(grid, sigmoid_curve(grid, f["R0"], f["A"], f["B"], f["C_mid"]), color=color, lw=1)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("completion tokens generated")
        ax.grid(alpha=0.3)
    save_grid(
        plt,
        fig,
        axes,
        len(labels),
        "held-out mean@n vs compute; lines: identified fits R(C) = R0 + (A-R0)/(1+(C_mid/C)^B)",
        out,
    )


def save_grid(plt, fig, axes, used: int, title: str, out) -> None:
    """Blank the panels past the first ``used``, title the figure and write it to ``out``."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
