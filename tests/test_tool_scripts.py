"""Integration: the tool loop inside the scripts (``--tools.*``, common/tool_loop.py through common/async_rollout.py).

With tools enabled and no call made, a run equals the single-turn run bit for bit: the same rollouts, metrics and
weights (the equivalence the tool loop promises: turn 1 is the single-turn request, with the tool stop strings)."""

import torch
from safetensors.torch import load_file
from test_docs import undocumented_keys
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
