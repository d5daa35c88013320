"""Learning: a short default GRPO run must raise held-out sampled accuracy clearly above the shipped model.

Measured on a 2-core CPU (seed 1): mean@4 on the 200 held-out problems went 0.375 -> 0.805 after 20 steps
and 0.863 after 30 (runs/grpo__arith__1). The threshold below (+0.20 after 20 steps) leaves room for
seed noise (the standard error of one evaluation is about 0.017) while failing on a sign or
normalisation bug, which leaves accuracy flat or collapses it.
"""

import json

from test_scripts import read_metrics, run


def test_grpo_default_raises_heldout_accuracy(tmp_path):
    run(
        "grpo",
        tmp_path,
        "--run-name",
        "learn",
        "--total-steps",
        "20",
        "--eval-every",
        "20",
        "--prompts-per-step",
        "16",
        "--group-size",
        "8",
        "--max-new-tokens",
        "40",
        "--micro-batch-size",
        "64",
        "--eval.max-problems",
        "200",
        "--eval.n",
        "4",
        "--eval.k",
        "1",
        "4",
    )
    evals = [r for r in read_metrics(tmp_path / "learn") if "eval/arith/mean@4" in r]
    start, end = evals[0]["eval/arith/mean@4"], evals[-1]["eval/arith/mean@4"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 20
    assert 0.2 < start < 0.6, f"the shipped model should start in the RL regime, got {start}"
    assert end >= start + 0.20, f"held-out mean@4 {start:.3f} -> {end:.3f}: GRPO did not learn"
    print(json.dumps({"start": start, "end": end}))
