"""Integration: the tool loop inside the scripts (``--tools.*``, common/tool_loop.py through common/async_rollout.py).

With tools enabled and no call made, a run equals the single-turn run bit for bit: the same rollouts, metrics and
weights (the equivalence the tool loop promises: turn 1 is the single-turn request, with the tool stop strings)."""

import signal

import pytest
import torch
from safetensors.torch import load_file
from test_docs import undocumented_keys
from test_reliability import start, wait_for_step
from test_scripts import read_metrics, run

TOOLS = ["--tools.format", "python", "--tools.tool", "calculator"]


def test_tools_on_without_a_call_equal_the_single_turn_run(tmp_path):
    """grpo on arith, 5 steps: the tiny arith model never writes a python block, so with the calculator loop on every
    sample ends on turn 1, and everything but the tools/* metrics and timings equals the run without tools."""
    flags = ["--total-steps", "5", "--eval-every", "5", "--save-every", "5"]
    run("grpo", tmp_path, "--run-name", "single", *flags)
    run("grpo", tmp_path, "--run-name", "tools", *flags, *TOOLS)
    single, tools = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "tools")
    assert len(single) == len(tools) > 5
    for a, b in zip(single, tools):
        calls = {k: v for k, v in b.items() if k.startswith(("tools/", "eval/arith/tools/"))}
        if "train/reward" in b:  # a training step: the loop ran and made no call (the case under test)
            assert calls["tools/calls_per_sample"] == 0 and calls["tools/turns"] == 1
        timing = lambda row: {k: v for k, v in row.items() if k != "time" and not k.startswith(("time/", "memory/"))}
        assert timing(a) == {k: v for k, v in timing(b).items() if k not in calls}
    for name in ("samples.jsonl",):
        assert (tmp_path / "single" / name).read_text() == (tmp_path / "tools" / name).read_text()
    assert not undocumented_keys({k for row in tools for k in row})
    wa, wb = (load_file(tmp_path / name / "final" / "model.safetensors") for name in ("single", "tools"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


TOOL_TASK = ["--model", "tiny-tool", "--dataset", "arith-tool", *TOOLS, "--max-new-tokens", "40"]


@pytest.mark.slow  # the vLLM tier runs the same check against a rollout server (tests/test_vllm_tools.py)
def test_the_tool_task_sigkilled_at_lag_2_resumes_to_the_uninterrupted_run(tmp_path):
    """grpo on the tiny tool task (the warm start calls the calculator in about a third of its samples) at
    --max-lag 2: the checkpoint holds a batch of multi-turn samples sampled ahead by older weights (observation masks,
    tool stats); killed with no chance to clean up, the resumed run reproduces the uninterrupted one."""
    flags = [*TOOL_TASK, "--total-steps", "3", "--eval-every", "10", "--max-lag", "2"]
    run("grpo", tmp_path, "--run-name", "full", *flags)
    proc = start(tmp_path, "--run-name", "killed", *flags)
    wait_for_step(tmp_path / "killed", 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run("grpo", tmp_path, "--run-name", "killed", *flags, "--resume")
    full, resumed = ([r for r in read_metrics(tmp_path / n) if "train/reward" in r] for n in ("full", "killed"))
    assert [r["step"] for r in resumed] == [1, 2, 3] and [r["train/lag_max"] for r in resumed] == [0, 1, 1]
    assert min(r["tools/call_rate"] for r in full) > 0 and min(r["tools/obs_tokens"] for r in full) > 0
    keys = ("train/reward", "train/response_len", "tools/call_rate", "tools/obs_tokens", "tools/error_rate")
    assert [[r[k] for k in keys] for r in full] == [[r[k] for k in keys] for r in resumed]
    assert [r["train/loss"] for r in full] == pytest.approx([r["train/loss"] for r in resumed], abs=1e-6)
    assert not undocumented_keys({k for row in read_metrics(tmp_path / "full") for k in row})
