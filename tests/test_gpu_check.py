"""The GPU check kit cannot rot: its --smoke mode runs the same code on the CPU with tiny shapes (scripts on the tiny
model with a resume, the learner probe through the project's log-prob path, padded and packed, HF-engine generation)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from common.packing import model_layout


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_gpu_check_smoke(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2"}
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["env"]["smoke"] is True and data["env"]["torch"]
    by_section = {}
    for record in data["records"]:
        by_section.setdefault(record["section"], []).append(record)
    assert [r["script"] for r in by_section["scripts"]] == ["grpo", "ppo"]
    assert all(r["ok"] and r["steps"] == 3 for r in by_section["scripts"]), by_section["scripts"]
    learner = by_section["learner"]
    assert len(learner) == 6 and all(r["tokens_per_s"] > 0 and "error" not in r for r in learner)
    assert [r["layout"] for r in learner] == ["padded", "packed"] * 3  # each shape both ways, side by side
    assert [r["lora_rank"] for r in learner] == [0, 0, 0, 0, 8, 8]
    # the LoRA rows: the planner counts a frozen base (no gradients, no AdamW moments) below full fine-tuning's
    assert all(lora["planned_gb"] < full["planned_gb"] for lora, full in zip(learner[4:], learner[2:4]))
    assert all(r["tokens"] == 2 * 64 for r in learner)  # the same token count padded and packed
    assert all(r["planned_gb"] > 0 for r in learner)  # the memory planner's prediction beside each row
    assert by_section["generate"][0]["tokens_per_s"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "smoke run on the CPU" in table and "| grpo | True |" in table


@pytest.mark.parametrize("micro_batch, seq_len", [(1, 1024), (4, 4096), (2, 64), (3, 12)])
def test_packed_learner_rows_hold_the_padded_rows_token_counts(micro_batch, seq_len):
    gpu_check = load_gpu_check()
    generator = torch.Generator().manual_seed(0)
    batches = {
        layout: gpu_check.learner_batch(layout, micro_batch, seq_len, 97, generator, torch.device("cpu"))
        for layout in gpu_check.LAYOUTS
    }
    (ids, mask, width), (packed_ids, packed_mask, packed_width) = batches["padded"], batches["packed"]
    # padded: micro_batch rows of seq_len, the first min(512, seq_len // 4) tokens prompt (as before packing), and
    # one pad position, the last row's last, so that the model builds its attention mask as for the scripts' rows
    assert mask.shape == ids.shape == (micro_batch, seq_len) and width == seq_len - min(512, seq_len // 4)
    assert mask.flatten().tolist() == [1] * (micro_batch * seq_len - 1) + [0]
    # packed: the same tokens, as 2 x micro_batch sequences of 3/4 and 1/4 the length, the last a token short
    long, short = 3 * seq_len // 4, seq_len - 3 * seq_len // 4
    expected = [long] * micro_batch + [short] * (micro_batch - 1) + [short - 1]
    assert sorted(packed_mask.sum(-1).tolist()) == sorted(expected)
    assert int(packed_mask.sum()) == int(mask.sum()) == micro_batch * seq_len - 1
    # rows as the scripts lay them out: [left-padded prompt | right-padded completion], a prompt of >= 1 token
    prompt_width = packed_mask.shape[1] - packed_width
    for row, n in zip(packed_mask, packed_mask.sum(-1).tolist()):
        p = max(1, min(512, n // 4))
        assert row[:prompt_width].tolist() == [0] * (prompt_width - p) + [1] * p
        assert row[prompt_width:].tolist() == [1] * (n - p) + [0] * (packed_width - n + p)
    # what token_logprobs(..., packed=True) gives the model: one flat row of all the padded rows' tokens
    layout = model_layout(packed_ids, packed_mask, packed_width, packed=True)
    assert tuple(layout.inputs["input_ids"].shape) == (1, micro_batch * seq_len - 1)
    # padded: the rows as they are; one row alone loses its pad column (no row needs it), as a script's would
    padded_width = seq_len if micro_batch > 1 else seq_len - 1
    assert tuple(model_layout(ids, mask, width, packed=False).inputs["input_ids"].shape) == (micro_batch, padded_width)


def test_the_planner_holds_the_committed_h100_measurements():
    """benchmarks/results/gpu/results.json (one H100, 2026-11-24): every learner probe that ran peaked at 0.85 to
    1.02 of what the planner now plans for it, and every probe that ran out of memory is planned above the card."""
    gpu_check = load_gpu_check()
    results = json.loads((REPO / "benchmarks" / "results" / "gpu" / "results.json").read_text())
    card_gb = results["env"]["gpu_memory_gb"]
    rows = [r for r in results["records"] if r["section"] == "learner"]
    assert len(rows) >= 40 and sum("peak_gb" in r for r in rows) >= 30
    for r in rows:
        folder = gpu_check.CONFIGS / r["model"]
        planned = max(
            gpu_check.planned_gb(
                folder, r["micro_batch"], r["seq_len"], r["checkpointing"], True, r["layout"], "sdpa", r["lora_rank"]
            ).values()
        )
        where = f"{r['model']} {r['layout']} {r['micro_batch']} x {r['seq_len']}"
        where += f" checkpointing={r['checkpointing']} lora={r['lora_rank']}"
        if "peak_gb" in r:
            assert 0.85 <= r["peak_gb"] / planned <= 1.02, (
                f"{where}: measured {r['peak_gb']:.1f} GB, planned {planned:.1f}"
            )
        else:
            assert r["error"].startswith("OOM") and planned > card_gb, f"{where}: planned {planned:.1f} GB ran out"
