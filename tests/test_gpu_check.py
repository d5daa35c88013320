"""The GPU check kit cannot rot: its --smoke mode runs the same code on the CPU with tiny shapes (scripts on the tiny
model with a resume, the learner probe through the project's log-prob path, HF-engine generation)."""

import json
import os
import subprocess
import sys

from conftest import REPO


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
    assert len(learner) == 2 and all(r["tokens_per_s"] > 0 and "error" not in r for r in learner)
    assert all(r["planned_gb"] > 0 for r in learner)  # the memory planner's prediction beside each row
    assert by_section["generate"][0]["tokens_per_s"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "smoke run on the CPU" in table and "| grpo | True |" in table
