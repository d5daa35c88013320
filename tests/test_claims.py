"""The claims testbed: its tasks, the perturbed sampler, the ablation switches it contrasts, the pre-registered
test and the ScaleRL fit (benchmarks/claims.py), on hand-derived values."""

import math
import re
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, load_algo
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.claims import (
    describe_test,
    first_reach,
    fit_sigmoid,
    judge,
    judged_commits,
    noninferiority_margin,
    noninferiority_test,
    paired_test,
    reduce_run,
    sigmoid_curve,
)
from common.bookkeeping import pack_rollout, rollout_stats
from common.data import TINY_MODEL_DIR, format_prompt, load_problems
from common.logprobs import token_logprobs
from common.rollout import Completion, HFEngine


# ---------------------------------------------------------------------------------------------- tasks
def test_arith_pad_solutions_restate_the_total_0_to_6_times_and_box_the_answer():
    counts = []
    for p in load_problems("arith-pad", "train")[:2000]:
        steps = p["solution"].split(";")
        assert steps[-1] == f"\\boxed{{{p['answer']}}}"
        redundant = [s for s in steps[:-1] if re.fullmatch(r"(-?\d+)=\1", s)]
        assert all(s == f"{p['answer']}={p['answer']}" for s in redundant)
        assert len(steps) - 1 - len(redundant) == 2  # the two real steps of a 3-operand chain
        counts.append(len(redundant))
    assert set(counts) == set(range(7))  # every length from 0 to 6 restatements occurs


def test_arith_mix_draws_3_or_4_operands_and_never_trains_on_arith_hard_held_out():
    train = load_problems("arith-mix", "train")
    operands = [len(re.findall(r"\d+", p["prompt"])) for p in train]
    assert set(operands) == {3, 4} and 0.45 < operands.count(4) / len(operands) < 0.55
    held_out = {p["prompt"] for p in load_problems("arith-hard", "test")}
    assert held_out and not held_out & {p["prompt"] for p in train}
    for p in train[:500]:  # worked solutions stay right: the last step's result is the answer
        assert p["solution"].split(";")[-2].split("=")[-1] == p["answer"]


def test_arith_long_has_five_real_steps_and_arith_pad_long_restates_after_three():
    for p in load_problems("arith-long", "train")[:500]:
        assert len(re.findall(r"\d+", p["prompt"])) == 6
        steps = p["solution"].split(";")
        assert len(steps) == 6 and steps[-2].split("=")[-1] == p["answer"]
    for p in load_problems("arith-pad-long", "train")[:500]:
        real = [s for s in p["solution"].split(";")[:-1] if not re.fullmatch(r"(-?\d+)=\1", s)]
        assert len(real) == 3 and len(re.findall(r"\d+", p["prompt"])) == 4


def test_a_step_corrupted_demonstration_carries_the_wrong_total_to_the_end(monkeypatch):
    import importlib.util
    import random

    spec = importlib.util.spec_from_file_location("build_tiny_model", REPO / "scripts" / "build_tiny_model.py")
    build_tiny_model = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, build_tiny_model)  # its dataclass looks its module up there
    spec.loader.exec_module(build_tiny_model)
    corrupt_step = build_tiny_model.corrupt_step
    rng = random.Random(0)
    for p in load_problems("arith-pad-long", "train")[:300] + load_problems("arith-long", "train")[:300]:
        *steps, box = corrupt_step(p["solution"], rng).split(";")
        assert len(steps) == len(p["solution"].split(";")) - 1
        total, errors = None, []
        for step in steps:
            if match := re.fullmatch(r"(-?\d+)([+-])(\d+)=(-?\d+)", step):
                left, op, x, result = int(match[1]), match[2], int(match[3]), int(match[4])
                assert total is None or left == total, step  # each step starts from the total before it
                errors.append(result - (left + x if op == "+" else left - x))
                total = result
            else:  # a restatement carries the (wrong) running total
                assert step == f"{total}={total}"
        assert sorted(e != 0 for e in errors) == [False] * (len(errors) - 1) + [True]  # exactly one wrong step
        assert 1 <= max(abs(e) for e in errors) <= 3
        assert box == f"\\boxed{{{total}}}" and total != int(p["answer"])


def test_the_existing_tasks_are_unchanged_by_the_new_options():
    # 3 operands, no redundancy: the same problem stream as before the claims tasks existed
    assert load_problems("arith", "train")[0] == {
        "prompt": "6-6-0=?",
        "answer": "0",
        "solution": "6-6=0;0-0=0;\\boxed{0}",
    }
    assert all(len(re.findall(r"\d+", p["prompt"])) == 4 for p in load_problems("arith-hard", "train")[:500])


# ---------------------------------------------------------------------------------------------- perturbed sampler
@pytest.fixture(scope="module")
def tiny():
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    return AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR), tok


def sampler_trainer_gap(model, tok, noise: float) -> float:
    """Mean |log π_trainer - log π_sampler| over the sampled tokens, the quantity ``train/logprob_gap`` logs."""
    engine = HFEngine(model, tok, logit_noise=noise)
    prompt = [tok(format_prompt(q, "chat", tok))["input_ids"] for q in ("1+2-3=?", "9-9+9=?")]
    out = engine.generate(prompt, n=8, max_new_tokens=24, temperature=1.0, top_p=1.0, seed=5)
    input_ids, attention, completion_mask, sampler = pack_rollout(prompt, out, 8, tok.pad_token_id, "cpu")
    with torch.no_grad():
        trainer, _ = token_logprobs(model, input_ids, attention, completion_mask.shape[1], 1.0)
    return float(((trainer - sampler).abs() * completion_mask).sum() / completion_mask.sum())


def test_logit_noise_makes_the_sampler_disagree_with_the_trainer_and_zero_noise_does_not(tiny):
    model, tok = tiny
    exact, mild, strong = (sampler_trainer_gap(model, tok, s) for s in (0.0, 0.3, 1.0))
    assert exact < 1e-4  # the HF engine samples from the trained module itself
    assert 0.01 < mild < strong  # a perturbed sampler reports its own, different log-probs; more noise, larger gap


def test_zero_logit_noise_leaves_the_samples_unchanged(tiny):
    model, tok = tiny
    prompt = [tok(format_prompt("4+4+4=?", "chat", tok))["input_ids"]]
    plain = HFEngine(model, tok).generate(prompt, n=6, max_new_tokens=20, temperature=1.0, top_p=1.0, seed=3)
    zero = HFEngine(model, tok, logit_noise=0.0).generate(prompt, 6, 20, 1.0, 1.0, 3)
    noisy = HFEngine(model, tok, logit_noise=3.0).generate(prompt, 6, 20, 1.0, 1.0, 3)
    assert [c.token_ids for c in plain] == [c.token_ids for c in zero]
    assert [c.token_ids for c in plain] != [c.token_ids for c in noisy]


# ---------------------------------------------------------------------------------------------- ablation switches
def test_dppo_ratio_region_is_ppo_clip_as_a_mask():
    dppo = load_algo("dppo")
    mu = torch.log(torch.tensor([[0.4, 0.4, 0.001, 0.9]]))
    pi = torch.log(torch.tensor([[0.5, 0.3, 0.004, 0.7]]))  # ratios 1.25, 0.75, 4.0, 0.78
    up = dppo.trust_region_mask(pi, mu, torch.tensor([1.0]), delta=0.2, divergence="ratio")
    down = dppo.trust_region_mask(pi, mu, torch.tensor([-1.0]), delta=0.2, divergence="ratio")
    assert up.tolist() == [[True, False, True, False]]  # Â > 0 blocks ratios above 1.2
    assert down.tolist() == [[False, True, False, True]]  # Â < 0 blocks ratios below 0.8
    # the TV region lets the rare token (TV 0.003) through and blocks the frequent one that moved 0.2
    tv = dppo.trust_region_mask(pi, mu, torch.tensor([-1.0]), delta=0.15, divergence="binary_tv")
    assert tv.tolist() == [[False, False, False, True]]
    assert not dppo.trust_region_mask(pi, mu, torch.tensor([1.0]), delta=0.15, divergence="binary_tv")[0, 2]


def test_rollout_stats_splits_length_by_correctness():
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]])
    correct = torch.tensor([1.0, 0.0, 0.0, 1.0])
    completions = [Completion([1] * int(m.sum()), [0.0] * int(m.sum()), "stop") for m in mask]
    stats = rollout_stats(correct, correct, mask, completions, group_size=2)
    assert stats["train/response_len_correct"] == pytest.approx((2 + 1) / 2)
    assert stats["train/response_len_incorrect"] == pytest.approx((4 + 3) / 2)
    none_right = rollout_stats(correct * 0, correct * 0, mask, completions, group_size=2)
    assert none_right["train/response_len_correct"] == 0.0


# ---------------------------------------------------------------------------------------------- the pre-registered test
def test_paired_test_verdicts_on_hand_values():
    control = {1: 0.0, 2: 0.0, 3: 0.0}
    # diffs 1, 2, 3: mean 2, SE = 1 / sqrt(3) = 0.577 < 1: reproduced
    result = paired_test({1: 1.0, 2: 2.0, 3: 3.0}, control, "higher", min_effect=0.5)
    assert result["verdict"] == "reproduced"
    assert result["effect"] == pytest.approx(2.0) and result["se"] == pytest.approx(1 / math.sqrt(3))
    # the same numbers claimed "lower": mean -2, -2 + 2·0.577 < 0.5: not reproduced
    assert paired_test({1: 1.0, 2: 2.0, 3: 3.0}, control, "lower", min_effect=0.5)["verdict"] == "not reproduced"
    # diffs 1, -1, 0.5: mean 0.167, SE 0.601: neither beyond 2 SE nor excluding 0.5
    assert paired_test({1: 1.0, 2: -1.0, 3: 0.5}, control, "higher", min_effect=0.5)["verdict"] == "inconclusive"
    # pairing is by seed: an unmatched seed is dropped
    assert paired_test({1: 1.0, 2: 2.0, 9: 100.0}, control, "higher", 0.5)["n"] == 2


def test_noninferiority_margin_and_verdicts_on_hand_values():
    # the margin rule: min(0.02, gain / 4)
    assert noninferiority_margin([0.5, 0.5]) == pytest.approx(0.02)  # a quarter of 0.5 = 0.125: the cap holds
    assert noninferiority_margin([0.04, 0.06]) == pytest.approx(0.0125)  # a quarter of 0.05
    control = {1: 0.80, 2: 0.80, 3: 0.80}
    # diffs -0.01, 0, +0.01: mean 0, SE 0.01 / sqrt(3) = 0.00577; lower bound -0.0115 > -0.02: reproduced
    result = noninferiority_test({1: 0.79, 2: 0.80, 3: 0.81}, control, 0.02)
    assert result["verdict"] == "reproduced" and result["se"] == pytest.approx(0.01 / math.sqrt(3))
    # the same data against a margin of 0.01: lower bound -0.0115 < -0.01, upper +0.0115 > -0.01: inconclusive
    assert noninferiority_test({1: 0.79, 2: 0.80, 3: 0.81}, control, 0.01)["verdict"] == "inconclusive"
    # diffs -0.05, -0.06, -0.04: mean -0.05, SE 0.00577; upper bound -0.0385 < -0.02: not reproduced
    worse = noninferiority_test({1: 0.75, 2: 0.74, 3: 0.76}, control, 0.02)
    assert worse["verdict"] == "not reproduced" and worse["effect"] == pytest.approx(-0.05)
    # a better treatment is non-inferior too; a control that learned nothing gives no margin
    assert noninferiority_test({1: 0.9, 2: 0.91, 3: 0.92}, control, 0.02)["verdict"] == "reproduced"
    with pytest.raises(ValueError, match="margin must be > 0"):
        noninferiority_test({1: 0.9}, control, 0.0)


def test_a_noninferiority_claim_takes_its_margin_from_the_control_runs_and_a_failed_gate_is_not_testable():
    def run(label, seed, base, final, clip):
        rows = [{"step": 0, "acc": base}, {"step": 5, "clip": clip}, {"step": 10, "acc": final}]
        return {"label": label, "seed": seed, "rows": rows}

    # control gains 0.4 on every seed: margin min(0.02, 0.1) = 0.02; treatment 0.005 below on every seed
    runs = [run("a", s, 0.4, 0.8, 0.01) for s in (1, 2, 3)] + [run("b", s, 0.4, 0.795, 0.01) for s in (1, 2, 3)]
    claim = {"treatment": "b", "control": "a", "metric": "acc", "reduce": "final", "test": "noninferior"}
    result = judge(claim, runs)
    assert result["margin"] == pytest.approx(0.02) and result["verdict"] == "reproduced" and result["gate"] is None
    # a gate on a quantity one run never reaches: not testable, whatever the test says
    gated = claim | {"gate": {"metric": "clip", "reduce": "final", "min": 0.005}}
    assert judge(gated, runs)["verdict"] == "reproduced"
    runs[4]["rows"][1]["clip"] = 0.001
    assert judge(gated, runs)["verdict"] == "not testable here"
    # a gate on one arm reads that arm's runs only: the treatment's 0.001 fails it there and not on the control
    on_control = claim | {"gate": {"metric": "clip", "reduce": "final", "min": 0.005, "arm": "control"}}
    assert judge(on_control, runs)["verdict"] == "reproduced"
    on_treatment = claim | {"gate": {"metric": "clip", "reduce": "final", "min": 0.005, "arm": "treatment"}}
    assert judge(on_treatment, runs)["verdict"] == "not testable here"
    # an upper bound: wrong answers must stay common (accuracy at most 0.85), here in every run
    capped = claim | {"gate": {"metric": "acc", "reduce": "final", "max": 0.85}}
    assert judge(capped, runs)["verdict"] == "reproduced"
    assert judge(claim | {"gate": {"metric": "acc", "reduce": "final", "max": 0.797}}, runs)["verdict"] == (
        "not testable here"  # the control arm's 0.8 is above it
    )
    with pytest.raises(ValueError, match="needs a bound"):
        judge(claim | {"gate": {"metric": "acc", "reduce": "final"}}, runs)
    with pytest.raises(ValueError, match="gate arm"):
        judge(claim | {"gate": {"metric": "clip", "reduce": "final", "min": 0.005, "arm": "either"}}, runs)
    # control arms that barely learn shrink the margin to a quarter of their gain: 0.01 / 4
    small = [run("a", s, 0.79, 0.80, 0.01) for s in (1, 2, 3)] + [run("b", s, 0.79, 0.795, 0.01) for s in (1, 2, 3)]
    result = judge(claim, small)
    assert result["margin"] == pytest.approx(0.0025) and result["verdict"] == "not reproduced"


def test_reductions_and_judging_seeds():
    rows = [{"step": s, "m": float(s)} for s in range(1, 11)] + [{"step": 10, "e": 0.7}]
    assert reduce_run(rows, "m", "growth", {"early": [1, 2], "late": [9, 10]}) == pytest.approx(9.5 - 1.5)
    assert reduce_run(rows, "m", "mean", {"steps": [3, 5]}) == pytest.approx(4.0)
    assert reduce_run(rows, "e", "final", {}) == 0.7
    assert reduce_run(rows, "absent", "final", {}) is None
    with pytest.raises(ValueError, match="unknown reduce"):
        reduce_run(rows, "m", "median", {"id": "x"})
    runs = [
        {"label": arm, "seed": seed, "rows": [{"step": 1, "m": value + seed * 0.01}]}
        for arm, value in (("a", 1.0), ("b", 0.0))
        for seed in (1, 2, 3, 101)
    ]
    claim = {"treatment": "a", "control": "b", "metric": "m", "reduce": "final", "direction": "higher"}
    result = judge(claim | {"min_effect": 0.1, "seeds": [1, 2, 3]}, runs)
    assert result["n"] == 3 and sorted(result["treatment"]) == [1, 2, 3]  # the design seed 101 does not judge
    assert result["effect"] == pytest.approx(1.0) and result["verdict"] == "reproduced"


def test_first_reach_censors_at_the_budget_and_censoring_never_favours_the_claim():
    rows = [{"step": 0, "e": 0.3}, {"step": 10, "e": 0.55}, {"step": 20, "e": 0.61}, {"step": 30, "e": 0.58}]
    assert first_reach(rows, "e", 0.6) == (20, False)
    assert first_reach(rows + [{"step": 31, "loss": 1.0}], "e", 0.7) == (31, True)  # never: its last step
    assert first_reach(rows, "absent", 0.6) is None
    assert reduce_run(rows, "e", "first_reach", {"target": 0.3}) == 0  # the base model already there

    def run(label, seed, reach_step, last=100):
        rows = [{"step": s, "e": 0.9 if reach_step is not None and s >= reach_step else 0.1} for s in range(0, 101, 10)]
        return {"label": label, "seed": seed, "rows": rows[: last // 10 + 1]}

    claim = {"treatment": "t", "control": "c", "metric": "e", "reduce": "first_reach", "target": 0.5}
    claim |= {"direction": "lower", "min_effect": 10}
    # treatment reaches at 20, 30, 20; the control at 60, never (censored at 100), 50: d = 40, 70, 30 in its favour
    runs = [run("t", 1, 20), run("t", 2, 30), run("t", 3, 20), run("c", 1, 60), run("c", 2, None), run("c", 3, 50)]
    result = judge(claim, runs)
    assert result["diffs"] == [40, 70, 30] and result["censored"] == {"treatment": 0, "control": 1}
    assert result["verdict"] == "reproduced"
    # a censored treatment counts at its budget, behind every control that got there
    runs[0] = run("t", 1, None)
    assert judge(claim, runs)["diffs"][0] == 60 - 100


def test_first_reach_in_compute_counts_each_arms_own_terms_and_a_censored_treatment_never_wins():
    # every step: 20 sampled tokens (10 tok/s x 2 s) and 40 trained tokens (5 tok/s x 8 s); the treatment pays
    # 1 x 20 + 4 x 40 = 180 per step (a frozen teacher's forward on top of 3 for the update), the control 1 x 20 +
    # 3 x 40 = 140
    def run(label, seed, reach_step, last=4):
        rows = [{"step": 0, "e": 0.1}]
        for step in range(1, last + 1):
            rows.append({"step": step, "tps": 10.0, "rs": 2.0, "ttps": 5.0, "ts": 8.0})
            if step % 2 == 0:
                rows.append({"step": step, "e": 0.9 if reach_step is not None and step >= reach_step else 0.1})
        return {"label": label, "seed": seed, "rows": rows}

    terms = {"treatment": [[1, "tps", "rs"], [4, "ttps", "ts"]], "control": [[1, "tps", "rs"], [3, "ttps", "ts"]]}
    claim = {"treatment": "t", "control": "c", "metric": "e", "reduce": "first_reach", "target": 0.5}
    claim |= {"direction": "lower", "min_effect": 100, "compute": terms}
    assert reduce_run(run("t", 1, 2)["rows"], "e", "first_reach", claim, "treatment") == 2 * 180
    assert reduce_run(run("t", 1, 2)["rows"], "e", "first_reach", claim, "control") == 2 * 140
    # the treatment reaches at step 2 (360) on both seeds, the control at step 4 (560) and at step 2 (280)
    runs = [run("t", 1, 2), run("t", 2, 2), run("c", 1, 4), run("c", 2, 2)]
    result = judge(claim, runs)
    assert result["diffs"] == [560 - 360, 280 - 360] and result["censored"] == {"treatment": 0, "control": 0}
    # a treatment that never gets there counts at its total compute (4 x 180 = 720) ...
    runs[0] = run("t", 1, None)
    assert judge(claim, runs)["diffs"][0] == 560 - 720
    # ... and never earlier than its seed's control, even when its budget was smaller (2 steps: 360 < 560)
    runs[0] = run("t", 1, None, last=2)
    assert judge(claim, runs)["diffs"][0] == 0
    assert "compute spent until it first reaches 0.5" in describe_test(claim)
    assert "t: 1 x `tps` x `rs` + 4 x `ttps` x `ts`; c: 1 x `tps` x `rs` + 3 x `ttps` x `ts`" in describe_test(claim)


def test_a_list_of_gates_must_all_hold():
    def run(label, seed, ent, cov):
        rows = [{"step": s, "ent": ent(s), "cov": cov, "m": 1.0 if label == "a" else 0.0} for s in range(1, 61)]
        return {"label": label, "seed": seed, "rows": rows}

    claim = {"treatment": "a", "control": "b", "metric": "m", "reduce": "final", "direction": "higher"}
    claim |= {"min_effect": 0.1}
    # the control's entropy falls 0.08 -> 0.03 (growth -0.05), the treatment acts on 40 tokens a step
    runs = [run("a", s, lambda t: 0.08, 40.0) for s in (1, 2)] + [
        run("b", s, lambda t: 0.08 if t <= 10 else 0.03, 0.0) for s in (1, 2)
    ]
    falls = {"metric": "ent", "reduce": "growth", "early": [1, 10], "late": [31, 60], "max": -0.02, "arm": "control"}
    acts = {"metric": "cov", "reduce": "mean", "steps": [31, 60], "min": 4, "arm": "treatment"}
    assert judge(claim | {"gate": [falls, acts]}, runs)["verdict"] == "reproduced"
    assert judge(claim | {"gate": [falls, acts | {"min": 41}]}, runs)["verdict"] == "not testable here"
    assert judge(claim | {"gate": [falls | {"max": -0.06}, acts]}, runs)["verdict"] == "not testable here"
    words = describe_test(claim | {"gate": [falls, acts]})
    assert (
        "gate: `ent` (growth from steps 1-10 to 31-60) <= -0.02 in every b run and `cov` (mean over steps 31-60)"
        in (words)
    )


def test_an_unidentified_asymptote_fit_makes_the_claim_inconclusive():
    compute = np.geomspace(1e3, 1e6, 12)

    def run(label, seed, asymptote, c_mid=3e4):
        score = sigmoid_curve(compute, 0.3, asymptote, 1.5, c_mid)
        score = score + np.random.default_rng(seed).normal(0, 0.003, compute.shape)
        tokens = np.diff(np.concatenate([[0.0], compute]))  # tokens generated per step: the curve's compute
        rows = [{"step": 0, "e": 0.3}]
        for step, (n, y) in enumerate(zip(tokens, score), start=1):
            rows += [
                {"step": step, "time/tokens_per_s": float(n), "time/rollout_s": 1.0},
                {"step": step, "e": float(y)},
            ]
        return {"label": label, "seed": seed, "rows": rows}

    claim = {"treatment": "t", "control": "c", "metric": "e", "reduce": "asymptote", "direction": "higher"}
    claim |= {"min_effect": 0.02, "seeds": [1, 2, 3]}
    runs = [run("t", s, 0.8 + 0.01 * s) for s in (1, 2, 3)] + [run("c", s, 0.6) for s in (1, 2, 3)]
    assert reduce_run(runs[0]["rows"], "e", "asymptote", claim) == pytest.approx(0.81, abs=0.02)
    result = judge(claim, runs)
    assert result["verdict"] == "reproduced" and result["unidentified"] == 0
    assert result["effect"] == pytest.approx(0.22, abs=0.02)
    runs[5] = run("c", 3, 0.6, c_mid=1e8)  # the control's curve has not bent by the end of the run: A is a guess
    result = judge(claim, runs)
    assert result["unidentified"] == 1 and result["n"] == 2 and result["verdict"] == "inconclusive"
    # no pair left because every treatment fit failed: all runs ran, so the rule's inconclusive, not "not enough seeds"
    unbent = [run("t", s, 0.9, c_mid=1e8) for s in (1, 2, 3)] + runs[3:]
    result = judge(claim, unbent)
    assert result["unidentified"] == 4 and result["n"] == 0 and result["verdict"] == "inconclusive"
    # a seed whose runs are missing is not a failed fit: one pair of runs is too few to judge at all
    result = judge(claim, [runs[0], runs[3]])
    assert result["unidentified"] == 0 and result["verdict"] == "not enough seeds"


def test_each_row_names_the_commits_its_judging_runs_were_made_at():
    runs = [
        {"label": "t", "seed": 1, "commit": "2137fd1abc", "dirty": False},
        {"label": "c", "seed": 1, "commit": "7bcb06cdef", "dirty": True},
        {"label": "c", "seed": 101, "commit": "0000000000", "dirty": False},  # a design seed: not a judging run
        {"label": "other", "seed": 1, "commit": "1111111111", "dirty": False},
    ]
    claim = {"treatment": "t", "control": "c", "seeds": [1, 2]}
    assert judged_commits(claim, runs) == ["2137fd1", "7bcb06c+dirty"]


# ---------------------------------------------------------------------------------------------- ScaleRL fit
def test_sigmoid_fit_recovers_known_parameters():
    compute = np.geomspace(1e3, 1e6, 12)
    truth = sigmoid_curve(compute, 0.3, 0.85, 1.5, 3e4)
    noise = np.random.default_rng(0).normal(0, 0.005, compute.shape)
    fit = fit_sigmoid(list(compute), list(truth + noise), r0=0.3)
    assert fit["identified"], fit["why"]
    assert fit["A"] == pytest.approx(0.85, abs=0.02) and fit["B"] == pytest.approx(1.5, rel=0.25)
    assert fit["C_mid"] == pytest.approx(3e4, rel=0.25)


def test_sigmoid_fit_says_unidentified_when_the_curve_has_not_bent():
    compute = np.geomspace(1e3, 1e4, 8)  # all far below C_mid: a straight climb, the asymptote is not in the data
    truth = sigmoid_curve(compute, 0.3, 0.85, 1.0, 1e6)
    fit = fit_sigmoid(list(compute), list(truth + np.random.default_rng(1).normal(0, 0.002, 8)), r0=0.3)
    assert not fit["identified"]
    assert not fit_sigmoid([1.0, 2.0], [0.5, 0.6], r0=0.4)["identified"]  # too few points


# ---------------------------------------------------------------------------------------------- run.py setup
def test_suite_setup_runs_once_and_fails_loudly(tmp_path):
    from benchmarks import run as bench_run

    target = tmp_path / "built.txt"
    make = ["-c", f"import pathlib; pathlib.Path({str(target)!r}).write_text('x')"]
    bench_run.setup({"setup": [{"creates": str(target), "command": make}]})
    assert target.read_text() == "x"
    target.write_text("kept")
    bench_run.setup({"setup": [{"creates": str(target), "command": make}]})  # exists: not run again
    assert target.read_text() == "kept"
    with pytest.raises(SystemExit, match="did not create"):
        bench_run.setup({"setup": [{"creates": str(tmp_path / "never"), "command": ["-c", "pass"]}]})
    with pytest.raises(SystemExit, match="failed"):
        bench_run.setup({"setup": [{"creates": str(tmp_path / "never"), "command": ["-c", "raise SystemExit(3)"]}]})


def benchmark_imports() -> dict[str, set[str]]:
    """benchmarks/<module>.py -> the benchmarks modules it imports anywhere (function bodies included)."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    names = {p.stem for p in folder.glob("*.py")}
    graph = {}
    for path in folder.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                found |= {a.name for a in node.names} if parts == ["benchmarks"] else {parts[-1]}
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[-1] for a in node.names}
        graph[path.stem] = found & names - {path.stem}
    return graph


def test_benchmark_modules_import_one_way():
    """collect.py imports claims.py and reporting.py; neither imports collect.py, and no import chain comes back."""
    graph = benchmark_imports()
    assert {"claims", "reporting"} <= graph["collect"] and graph["claims"] == {"reporting"} and not graph["reporting"]

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(n == target or (n not in seen and reaches(n, target, seen | {n})) for n in graph[start])

    cycles = [m for m in graph if reaches(m, m, set())]
    assert not cycles, f"import cycles through {cycles}: {graph}"


def test_claims_section_writes_verdicts_json_and_plots(tmp_path):
    from benchmarks import collect

    def fake_run(label, seed, level):
        rows = [{"step": 0, "eval/t/mean@4": 0.3}]
        for step in range(1, 41):
            gain = level * (1 - math.exp(-step / 8))
            rows.append({"step": step, "m": level + 0.01 * seed, "time/tokens_per_s": 1000.0, "time/rollout_s": 0.1})
            if step % 4 == 0:
                rows.append({"step": step, "eval/t/mean@4": 0.3 + gain})
        return {"label": label, "seed": seed, "rows": rows, "eval_prefix": "eval/t/", "n": 4}

    runs = [fake_run("a", s, 0.5) for s in (1, 2, 3)] + [fake_run("b", s, 0.2) for s in (1, 2, 3)]
    claim = {"id": "x", "name": "X", "claim": "a beats b", "evidence": "e", "treatment": "a", "control": "b"}
    claims = [claim | {"metric": "m", "reduce": "mean", "steps": [1, 40], "direction": "higher", "min_effect": 0.1}]
    verdicts, fits_md = collect.claims_section(claims, runs, tmp_path)
    text = verdicts + fits_md
    assert "| **X**: a beats b |" in text and "**reproduced**" in text and "1 of 1 claims reproduced" in text
    assert "paired effect +0.300 ± 0.000 (SE), n = 3" in text
    assert (tmp_path / "claims.png").stat().st_size > 0 and (tmp_path / "fits.png").stat().st_size > 0
    fitted = [line for line in text.splitlines() if line.startswith("| a |")]
    assert fitted and "3/3" in fitted[0]  # a clean saturating curve is identified on every seed
