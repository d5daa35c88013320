"""Integration: each algorithm script runs end to end on the tiny default as a subprocess, writes its run
folder, changes the weights, checkpoints, and resumes to exactly where an uninterrupted run would be."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, load_algo
from safetensors.torch import load_file
from test_docs import undocumented_keys

SCRIPTS = sorted(p.stem for p in (REPO / "algos").glob("*.py"))
SMALL = (
    "--prompts-per-step 4 --group-size 4 --max-new-tokens 24 --micro-batch-size 8 --eval.max-problems 8 "
    "--eval.n 2 --eval.k 1 2 --eval-every 2 --save-every 1"
).split()
REQUIRED_TRAIN_KEYS = {
    "train/reward",
    "train/accuracy",
    "train/response_len",
    "train/clip_frac",
    "train/entropy",
    "train/frac_zero_adv_groups",
    "time/rollout_s",
    "time/train_s",
    "time/tokens_per_s",
}


def run(script: str, out_dir, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, str(REPO / "algos" / f"{script}.py"), "--output-dir", str(out_dir), *SMALL, *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-3000:]}"
    return result


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


RESUME_IN_MAIN = {"grpo", "dapo", "ppo"}  # the rest run under -m slow (keeps the main suite in its budget)


@pytest.mark.parametrize(
    "script", [s if s in RESUME_IN_MAIN else pytest.param(s, marks=pytest.mark.slow) for s in SCRIPTS]
)
def test_script_trains_checkpoints_and_resumes(script, tmp_path):
    """At --max-lag 2 where the script supports it (maxrl and prime refuse it): steps 2 and 3 train on batches sampled
    one version earlier; step 3's batch was sampled ahead before the first run ended and comes from its checkpoint."""
    lag = [] if script in ("maxrl", "prime") else ["--max-lag", "2"]
    first = run(script, tmp_path, "--run-name", "r", "--total-steps", "2", *lag)
    assert "SUMMARY" in first.stdout
    run_dir = tmp_path / "r"
    assert (run_dir / "checkpoints" / "step_000002" / "state.pt").exists()
    resumed = run(script, tmp_path, "--run-name", "r", "--total-steps", "3", "--resume", *lag)
    assert "resumed from" in resumed.stdout + resumed.stderr

    rows = read_metrics(run_dir)
    train_rows = [r for r in rows if "train/reward" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    missing = REQUIRED_TRAIN_KEYS - train_rows[0].keys()
    assert not missing, missing
    assert all(v == v for r in train_rows for v in r.values() if isinstance(v, float)), "NaN in metrics"
    assert any("eval/arith/mean@2" in r for r in rows)
    if lag:
        lags = [r["train/lag_max"] for r in train_rows]
        assert lags == [0, 1, 1] if script != "dapo" else max(lags) <= 1, lags  # dapo: refills sampled now, lag 0
        # the mismatch is measured against the recomputed old policy, never against μ itself (cispo's ratio is
        # against μ under lag; measured against μ it would read exactly 0). Steps 2 and 3 trained on a batch a version
        # old; step 1's batch came from the trained weights at the trainer's precision (a gap of ~1e-6 or less)
        gaps = [r["train/log_ratio_abs_mean"] for r in train_rows]
        assert min(gaps[1:]) > 1e-4 and gaps[0] < 1e-4, gaps
    undocumented = undocumented_keys({key for row in rows for key in row})
    assert not undocumented, f"keys missing from docs/metrics.md: {sorted(undocumented)}"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["exp_name"] == script and "git_commit" in config
    assert (run_dir / "samples.jsonl").read_text().strip()

    # the weights moved away from the shipped model, and stayed finite
    base = load_file(REPO / "common" / "tiny_model" / "model.safetensors")
    trained = load_file(run_dir / "final" / "model.safetensors")
    assert max((trained[k] - base[k]).abs().max().item() for k in base) > 0
    assert all(torch.isfinite(v).all() for v in trained.values())


@pytest.mark.slow  # the main suite resumes exactly in test_reliability (SIGKILL), test_lora, test_reinforce
def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    """Same data order and sampling seeds: step 3 after a resume equals step 3 of a straight run."""
    run("grpo", tmp_path, "--run-name", "full", "--total-steps", "3", "--eval-every", "10")
    run("grpo", tmp_path, "--run-name", "split", "--total-steps", "2", "--eval-every", "10")
    run("grpo", tmp_path, "--run-name", "split", "--total-steps", "3", "--eval-every", "10", "--resume")
    full = [r for r in read_metrics(tmp_path / "full") if "train/reward" in r]
    split = [r for r in read_metrics(tmp_path / "split") if "train/reward" in r]
    assert [r["step"] for r in split] == [1, 2, 3]
    for key in ("train/reward", "train/response_len", "train/accuracy"):
        assert split[2][key] == full[2][key], key
    assert split[2]["train/loss"] == pytest.approx(full[2]["train/loss"], abs=1e-6)
    assert split[2]["train/grad_norm"] == pytest.approx(full[2]["train/grad_norm"], rel=1e-4)


@pytest.fixture(scope="module")
def help_texts() -> dict[str, str]:
    """Every script's ``--help`` from one interpreter (one torch import instead of twelve): script -> its output,
    ending in ``VLLM_IMPORTED`` where running that script had imported vllm."""
    code = "import sys, runpy\n" + "".join(
        f"print('\\x1e{name}', flush=True); sys.argv = ['{name}.py', '--help']\n"
        f"try:\n    runpy.run_path({str(REPO / 'algos' / (name + '.py'))!r}, run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('VLLM_IMPORTED' if 'vllm' in sys.modules else '', flush=True)\n"
        for name in SCRIPTS
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    chunks = result.stdout.split("\x1e")[1:]  # the ASCII record separator, which no help text holds
    return {chunk.split("\n", 1)[0]: chunk.split("\n", 1)[1] for chunk in chunks}


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_documents_every_flag_and_does_not_import_vllm(script, help_texts):
    text = help_texts[script]
    assert "VLLM_IMPORTED" not in text, "importing the script imported vllm"
    for flag in ("--learning-rate", "--kl-coef", "--rollout.backend", "--eval.n", "--resume"):
        assert flag in text, flag


def test_refuses_tiny_learning_rate_for_a_hub_model(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "algos" / "grpo.py"),
            "--model",
            "Qwen/Qwen2.5-Math-1.5B",
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode != 0 and "--learning-rate is required" in result.stderr


@pytest.mark.parametrize(
    "script", ["ppo", pytest.param("grpo", marks=pytest.mark.slow), pytest.param("prime", marks=pytest.mark.slow)]
)
def test_gradient_checkpointing_changes_memory_not_the_update(script, tmp_path):
    """--gradient-checkpointing (policy, and ppo's critic / prime's PRM) gives the same weights after a step (fp32)."""
    for name, flags in (("plain", []), ("ckpt", ["--gradient-checkpointing"])):
        run(
            script,
            tmp_path,
            "--run-name",
            name,
            "--total-steps",
            "1",
            "--eval-every",
            "10",
            "--mixed-precision",
            "no",
            *flags,
        )
    plain = load_file(tmp_path / "plain" / "final" / "model.safetensors")
    ckpt = load_file(tmp_path / "ckpt" / "final" / "model.safetensors")
    base = load_file(REPO / "common" / "tiny_model" / "model.safetensors")
    assert max((plain[k] - base[k]).abs().max().item() for k in base) > 1e-6
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], rtol=1e-4, atol=1e-7)


def test_gradient_checkpointing_flag_reaches_every_trained_model(tmp_path, monkeypatch):
    """ppo.py --gradient-checkpointing turns it on for the policy and for the critic (in-process, 1 step)."""
    from transformers import PreTrainedModel

    enabled, real = [], PreTrainedModel.gradient_checkpointing_enable

    def record(self, *args, **kwargs):
        enabled.append(type(self).__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_enable", record)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "ppo.py",
            "--output-dir",
            str(tmp_path),
            *SMALL,
            "--eval-every",
            "100",
            "--total-steps",
            "1",
            "--gradient-checkpointing",
        ],
    )
    load_algo("ppo").main()
    assert sorted(enabled) == ["Qwen2ForCausalLM", "Qwen2ForTokenClassification"]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed: code rewards refuse to start")
@pytest.mark.parametrize("script", [s if s == "grpo" else pytest.param(s, marks=pytest.mark.slow) for s in SCRIPTS])
def test_script_trains_on_the_code_task(script, tmp_path):
    """Every script trains on the tiny code task (grpo in the main suite, the others under -m slow): its programs
    graded by hidden tests in the sandbox (the rung in force recorded in config.json), code metrics logged for training
    and evaluation, the weights moved."""
    flags = "--model tiny-code --dataset code-expr --total-steps 1 --max-new-tokens 40 --eval.max-problems 4"
    if script == "opd":  # plumbing only: the shipped teacher speaks the arith tokenizer; the student is its own teacher
        flags += " --teacher tiny-code --reward-coef 1"
    run(script, tmp_path, "--run-name", "c", *flags.split())
    rows = read_metrics(tmp_path / "c")
    train = [r for r in rows if "train/reward" in r]
    assert len(train) == 1 and 0.0 <= train[0]["train/code/tests_passed_frac"] <= 1.0
    assert train[0].get("train/code/status_sandbox_error", 0.0) == 0.0
    assert any("eval/code-expr/code/all_pass" in r for r in rows)
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    assert config["sandbox_in_force"]["rung"].startswith("bwrap")
    base = load_file(REPO / "common" / "tiny_code_model" / "model.safetensors")
    trained = load_file(tmp_path / "c" / "final" / "model.safetensors")
    assert max((trained[k] - base[k]).abs().max().item() for k in base) > 0
