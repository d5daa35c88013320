"""pass@k against brute-force enumeration, mean@n, and the evaluation loop on a scripted engine."""

import itertools
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.data import TINY_MODEL_DIR, load_problems
from common.evaluate import EvalConfig, evaluate, pass_at_k, run_token_budget, score_groups
from common.rollout import Completion, HFEngine


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_equals_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            outcomes = [True] * c + [False] * (n - c)
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_score_groups():
    scores = score_groups([True, False, False, False, True, True, False, False], n=4, ks=(1, 2))
    assert scores["mean@4"] == pytest.approx(3 / 8)
    assert scores["pass@1"] == pytest.approx(3 / 8)
    assert scores["pass@2"] == pytest.approx((0.5 + (1 - 1 / 6)) / 2)  # 1 - C(3,2)/C(4,2), 1 - C(2,2)/C(4,2)
    with pytest.raises(ValueError, match="groups of n=4"):
        score_groups([True] * 6, n=4, ks=(1,))


class ScriptedEngine:
    """Answers problem i correctly on the first ``right[i]`` of its n samples; greedy is always right."""

    def __init__(self, tokenizer, answers, right):
        self.tok, self.answers, self.right = tokenizer, answers, right

    def generate(self, prompt_ids, n, max_new_tokens, temperature, top_p, seed, stop=()):
        out = []
        for i in range(len(prompt_ids)):
            for j in range(n):
                ok = temperature == 0 or j < self.right[i]
                text = f"\\boxed{{{self.answers[i] if ok else 'x'}}}"
                ids = self.tok(text)["input_ids"] + ([self.tok.eos_token_id] if j % 2 == 0 else [])
                out.append(Completion(ids, [0.0] * len(ids), "stop" if j % 2 == 0 else "length"))
        return out


def test_evaluate_scores_what_the_engine_returns():
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    problems = [{"prompt": f"{i}+0=?", "answer": str(i), "solution": ""} for i in range(3)]
    engine = ScriptedEngine(tok, ["0", "1", "2"], right=[4, 1, 0])
    cfg = EvalConfig(n=4, k=(1, 4), max_new_tokens=8)
    m = evaluate(engine, tok, problems, "exact", "chat", cfg, seed=0, name="toy")
    assert m["eval/toy/mean@4"] == pytest.approx(5 / 12)
    assert m["eval/toy/pass@4"] == pytest.approx(2 / 3)
    assert m["eval/toy/greedy"] == 1.0
    assert m["eval/toy/truncation_rate"] == 0.5


def test_evaluate_sharded_over_processes_equals_one_process():
    """Each rank generates its contiguous share with the seeds it has in a one-process run; gathered, the metrics
    are the one-process metrics (the real HF engine on the tiny model, sampled and greedy passes)."""
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR), tok)
    problems = load_problems("arith", "test")[:10]
    cfg = EvalConfig(n=3, k=(1, 3), max_new_tokens=30)
    one = evaluate(engine, tok, problems, "exact", "chat", cfg, seed=5, name="arith")

    seen, later_ranks = [], []  # prompts each rank generated for; rank 1's results, handed to rank 0's gather
    recording = SimpleNamespace(
        generate=lambda prompt_ids, *a, **k: seen.append(prompt_ids) or engine.generate(prompt_ids, *a, **k)
    )
    evaluate(
        recording,
        tok,
        problems,
        "exact",
        "chat",
        cfg,
        5,
        "arith",
        rank=1,
        world=2,
        gather=lambda r: later_ranks.append(r) or r,
    )
    calls = iter(later_ranks)
    two = evaluate(
        recording, tok, problems, "exact", "chat", cfg, 5, "arith", rank=0, world=2, gather=lambda r: r + next(calls)
    )
    assert [len(p) for p in seen] == [5, 5, 5, 5]  # each rank: half the problems, sampled then greedy
    assert seen[0] != seen[2]  # ranks 1 and 0 saw different halves
    assert two == one
    assert 0 < one["eval/arith/mean@3"] < 1


def test_evaluate_names_a_prompt_over_the_budget():
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    problems = [{"prompt": "1+1=?", "answer": "2"}, {"prompt": "1+1=? " * 40, "answer": "2"}]
    with pytest.raises(ValueError, match="toy problem 1: its prompt of .* tokens exceeds the prompt budget of 30"):
        evaluate(
            ScriptedEngine(tok, ["2", "2"], [1, 1]),
            tok,
            problems,
            "exact",
            "chat",
            EvalConfig(n=1, k=(1,), max_new_tokens=8),
            0,
            "toy",
            max_prompt_tokens=30,
        )


def test_evaluate_cli_on_the_shipped_model():
    cmd = [
        sys.executable,
        "-m",
        "common.evaluate",
        "--dataset",
        "arith",
        "--eval.n",
        "2",
        "--eval.k",
        "1",
        "2",
        "--eval.max-problems",
        "10",
    ]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert 0.0 <= record["eval/arith/mean@2"] <= record["eval/arith/pass@2"] <= 1.0
    assert record["protocol"]["n"] == 2


def test_the_cli_reproduces_the_training_time_evaluation_of_a_run(tmp_path):
    # one protocol: evaluating runs/<name>/final from the command line, with no --eval.max-new-tokens and no seed,
    # gives the numbers the run logged at its last evaluation (same token budget, read from the run's config.json)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    protocol = ["--eval.n", "2", "--eval.k", "1", "2", "--eval.max-problems", "12"]
    train = [sys.executable, str(REPO / "algos" / "grpo.py"), "--output-dir", str(tmp_path), "--run-name", "r"]
    train += ["--total-steps", "2", "--prompts-per-step", "4", "--max-new-tokens", "32", "--save-every", "0"]
    trained = subprocess.run(train + protocol, capture_output=True, text=True, timeout=300, env=env)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "eval protocol: arith (first 12 problems)" in trained.stdout and "max_new_tokens 32" in trained.stdout
    logged = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    last_eval = [row for row in logged if "eval/arith/mean@2" in row][-1]
    cli = [sys.executable, "-m", "common.evaluate", "--model", str(tmp_path / "r" / "final"), *protocol]
    result = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "max_new_tokens 32, seed 12345" in result.stderr
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["protocol"]["max_new_tokens"] == 32
    for key in ("mean@2", "pass@2", "greedy", "response_len"):
        assert record[f"eval/arith/{key}"] == last_eval[f"eval/arith/{key}"], key


def test_without_a_run_folder_the_cli_budget_is_the_scripts_default(grpo):
    assert run_token_budget(str(REPO / "common" / "tiny_model")) == grpo.Args().max_new_tokens


def test_the_cli_names_an_unknown_template_or_dataset_before_loading_weights():
    for flag, value in (("--eval.template", "nosuch"), ("--dataset", "gsm9k")):
        cmd = [sys.executable, "-m", "common.evaluate", flag, value]
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-1500:]
        assert f"{flag}: unknown" in result.stderr and "Loading weights" not in result.stderr
