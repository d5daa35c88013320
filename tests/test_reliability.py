"""Faults: a killed run resumes to exactly the uninterrupted run (and reports its own step-0 evaluation); SIGTERM
checkpoints; non-finite losses never reach the optimiser; bad flags fail before training with a message that names
the problem."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, load_algo
from safetensors.torch import load_file
from test_scripts import SMALL, read_metrics, run

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "2"}


def start(out_dir, *flags):
    cmd = [sys.executable, str(REPO / "algos" / "grpo.py"), "--output-dir", str(out_dir), *SMALL, *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def wait_for_step(run_dir, step, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and any(
            json.loads(line)["step"] >= step and "train/reward" in line
            for line in path.read_text().splitlines()
            if line
        ):
            return
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    raise TimeoutError(f"step {step} not reached")


@pytest.mark.parametrize("max_lag", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_sigkill_then_resume_reproduces_the_uninterrupted_run(tmp_path, max_lag):
    """At --max-lag 3 the checkpoint holds the batches sampled ahead by older weights, which a resume cannot
    regenerate: it must take them from the checkpoint to reproduce the run."""
    flags = ["--total-steps", "4", "--eval-every", "10", "--max-lag", str(max_lag)]
    run("grpo", tmp_path, "--run-name", "full", *flags)
    proc = start(tmp_path, "--run-name", "killed", *flags)
    wait_for_step(tmp_path / "killed", 2, proc)
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: at most the steps since the last checkpoint are lost
    proc.wait()
    run("grpo", tmp_path, "--run-name", "killed", *flags, "--resume")
    full = [r for r in read_metrics(tmp_path / "full") if "train/reward" in r]
    resumed = [r for r in read_metrics(tmp_path / "killed") if "train/reward" in r]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    # batch s (logged as step s + 1) is sampled by version max(0, s - max_lag + 1): lag min(s, max_lag - 1)
    assert [r["train/lag_max"] for r in resumed] == [min(s, max_lag - 1) for s in range(4)]
    for a, b in zip(full, resumed):
        for key in ("train/reward", "train/accuracy", "train/response_len"):
            assert a[key] == b[key], (a["step"], key)
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
    final_a = load_file(tmp_path / "full" / "final" / "model.safetensors")
    final_b = load_file(tmp_path / "killed" / "final" / "model.safetensors")
    assert max((final_a[k] - final_b[k]).abs().max().item() for k in final_a) < 1e-5


def test_sigterm_writes_a_checkpoint_and_exits(tmp_path):
    proc = start(tmp_path, "--run-name", "term", "--total-steps", "50", "--save-every", "100", "--eval-every", "100")
    wait_for_step(tmp_path / "term", 1, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "checkpoint saved" in err
    saved = sorted((tmp_path / "term" / "checkpoints").glob("step_*"))
    assert saved and int(saved[-1].name.split("_")[1]) >= 1  # save_every 100 would never have saved


def run_in_process(module, monkeypatch, tmp_path, *flags):
    argv = ["grpo.py", "--output-dir", str(tmp_path), *SMALL, "--eval-every", "100", *flags]
    monkeypatch.setattr(sys, "argv", argv)
    module.main()


def test_nonfinite_loss_never_reaches_the_weights(tmp_path, monkeypatch):
    grpo = load_algo("grpo")
    real_loss, calls = grpo.policy_loss, {"n": 0}

    def poisoned(*args, **kwargs):  # NaN on every micro-batch of the second optimiser step
        calls["n"] += 1
        loss, metrics = real_loss(*args, **kwargs)
        return (loss * float("nan"), metrics) if calls["n"] in (2,) else (loss, metrics)

    monkeypatch.setattr(grpo, "policy_loss", poisoned)
    run_in_process(grpo, monkeypatch, tmp_path, "--run-name", "nan", "--total-steps", "3", "--micro-batch-size", "16")
    rows = [r for r in read_metrics(tmp_path / "nan") if "train/reward" in r]
    assert [r["train/skipped_updates"] for r in rows] == [0.0, 1.0, 0.0]
    weights = load_file(tmp_path / "nan" / "final" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in weights.values())


def test_consecutive_nonfinite_steps_abort_with_a_message(tmp_path, monkeypatch):
    grpo = load_algo("grpo")
    monkeypatch.setattr(grpo, "policy_loss", lambda *a, **k: (a[0].sum() * float("inf"), {}))
    with pytest.raises(SystemExit, match="consecutive updates with a non-finite loss"):
        run_in_process(
            grpo,
            monkeypatch,
            tmp_path,
            "--run-name",
            "inf",
            "--total-steps",
            "5",
            "--max-bad-steps",
            "2",
            "--micro-batch-size",
            "16",
        )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dataset", "gsm9k"], "unknown dataset 'gsm9k'"),
        (["--template", "chatml"], "unknown template 'chatml'"),
        (["--model", "./no/such/model", "--learning-rate", "1e-6"], "no such local path"),
        (["--prompts-per-step", "6", "--group-size", "4", "--num-minibatches", "5"], "--num-minibatches 5"),
        (["--group-size", "1"], "group_size"),
        (["--temperature", "0"], "training rollouts need 0 < temperature <= 2"),
    ],
)
def test_bad_flags_fail_with_a_clear_message(tmp_path, monkeypatch, capsys, flags, message):
    """In process, to save a torch import per case (tests/test_data.py runs the CLI itself on a bad flag): main()
    stops with an exit or a validation error (which the CLI prints before exiting 1) that names the problem."""
    grpo = load_algo("grpo")
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--output-dir", str(tmp_path), "--total-steps", "1", *flags])
    with pytest.raises((SystemExit, ValueError, FileNotFoundError)) as stopped:
        grpo.main()
    assert not (isinstance(stopped.value, SystemExit) and stopped.value.code in (0, None)), "a clean exit"
    captured = capsys.readouterr()
    assert message in f"{stopped.value}{captured.err}{captured.out}", captured.err[-1500:]
    assert not list(tmp_path.glob("*/checkpoints/step_*")), "training must not have started"


def constant_rewards(value: float):
    """A verifier stand-in that scores every completion the same: every group is all-right or all-wrong."""
    from common.verifiers import RewardOutput

    return lambda name, texts, golds: [RewardOutput(value, value > 0) for _ in texts]


def final_weights_are_finite(run_dir) -> bool:
    weights = load_file(run_dir / "final" / "model.safetensors")
    return all(torch.isfinite(v).all() for v in weights.values())


def test_all_equal_rewards_give_zero_advantages_and_a_finite_step(tmp_path, monkeypatch):
    grpo = load_algo("grpo")
    monkeypatch.setattr(grpo, "compute_rewards", constant_rewards(0.0))
    run_in_process(grpo, monkeypatch, tmp_path, "--run-name", "flat", "--total-steps", "2")
    rows = [r for r in read_metrics(tmp_path / "flat") if "train/reward" in r]
    assert [r["train/frac_zero_adv_groups"] for r in rows] == [1.0, 1.0]
    assert all(math.isfinite(r["train/loss"]) and r["train/skipped_updates"] == 0.0 for r in rows)
    assert final_weights_are_finite(tmp_path / "flat")


def test_dapo_stops_with_a_message_when_every_group_is_filtered(tmp_path, monkeypatch):
    dapo = load_algo("dapo")
    monkeypatch.setattr(dapo, "compute_rewards", constant_rewards(1.0))
    with pytest.raises(SystemExit, match="dynamic sampling kept no group with mixed correctness in 2 rounds"):
        run_in_process(
            dapo, monkeypatch, tmp_path, "--run-name", "filtered", "--total-steps", "2", "--max-sampling-rounds", "2"
        )
    assert not list((tmp_path / "filtered").glob("checkpoints/step_*")), "no update may have happened"


def test_prime_refills_with_rejected_groups_when_every_group_is_filtered(tmp_path, monkeypatch):
    prime = load_algo("prime")
    monkeypatch.setattr(prime, "compute_rewards", constant_rewards(1.0))
    run_in_process(
        prime, monkeypatch, tmp_path, "--run-name", "refill", "--total-steps", "1", "--filter-max-rounds", "2"
    )
    rows = [r for r in read_metrics(tmp_path / "refill") if "train/reward" in r]
    assert len(rows) == 1 and rows[0]["train/reward"] == 1.0 and math.isfinite(rows[0]["train/loss"])
    assert final_weights_are_finite(tmp_path / "refill")


def test_empty_and_truncated_completions(tmp_path, monkeypatch):
    """Half the samples are EOS only (empty text), the other half hit the token limit without EOS."""
    grpo = load_algo("grpo")
    real_make_engine = grpo.make_engine

    def make_engine(*args, **kwargs):
        engine = real_make_engine(*args, **kwargs)
        real_generate = engine.generate

        def generate(prompt_ids, n, max_new_tokens, *rest, **kw):
            out = real_generate(prompt_ids, n, max_new_tokens, *rest, **kw)
            if n == 4:  # training rollouts only (evaluation uses n = 2 here)
                for i, c in enumerate(out):
                    if i % 2 == 0:
                        c.token_ids, c.logprobs, c.finish_reason = [engine.stop_ids[0]], [-1.0], "stop"
                    else:
                        c.token_ids, c.logprobs, c.finish_reason = (
                            [5] * max_new_tokens,
                            [-1.0] * max_new_tokens,
                            "length",
                        )
            return out

        engine.generate = generate
        return engine

    monkeypatch.setattr(grpo, "make_engine", make_engine)
    run_in_process(grpo, monkeypatch, tmp_path, "--run-name", "edge", "--total-steps", "2")
    rows = [r for r in read_metrics(tmp_path / "edge") if "train/reward" in r]
    assert [r["train/truncation_rate"] for r in rows] == [0.5, 0.5]
    assert all(
        r["train/reward"] == 0.0 and math.isfinite(r["train/loss"]) and r["train/skipped_updates"] == 0.0 for r in rows
    )
    assert final_weights_are_finite(tmp_path / "edge")


def test_resumed_run_reports_its_step_zero_evaluation_as_eval_start(tmp_path, monkeypatch, capsys):
    grpo, key = load_algo("grpo"), "eval/arith/mean@2"
    run_in_process(grpo, monkeypatch, tmp_path, "--run-name", "r", "--total-steps", "1")  # checkpoint at step 1
    metrics = tmp_path / "r" / "metrics.jsonl"
    rows = read_metrics(tmp_path / "r")
    evals = [r for r in rows if key in r]
    assert [r["step"] for r in evals] == [0, 1] and 0.123 not in [r[key] for r in evals]
    # a value no evaluation produced: the summary can show it only by reading the step-0 row back, not by evaluating
    # again or by taking a later row
    evals[0][key] = 0.123
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    run_in_process(grpo, monkeypatch, tmp_path, "--run-name", "r", "--total-steps", "2", "--resume")
    out = capsys.readouterr().out
    assert "resumed from" in out
    summary = json.loads(next(line for line in out.splitlines() if line.startswith("SUMMARY "))[len("SUMMARY ") :])
    step_zero = [r[key] for r in read_metrics(tmp_path / "r") if r["step"] == 0 and key in r]
    assert step_zero == [0.123] and summary["eval_start"] == 0.123
    assert summary["steps"] == 2 and summary["eval_end"] is not None


def test_statistics_kept_on_the_device_read_back_exactly_as_item_did():
    """The update loop keeps its statistics as 0-dim tensors and sums its micro-batch losses in float64 on the
    device; what reaches the log must be bit-for-bit what per-micro-batch ``.item()`` calls and Python sums gave."""
    from common.bookkeeping import read_to_host

    losses = [torch.tensor(0.1, dtype=torch.float32), torch.tensor(1e-8, dtype=torch.float32), torch.tensor(3.3)]
    on_device = 0.0
    for loss in losses:
        on_device += loss.double()
    as_before = 0.0
    for loss in losses:
        as_before += loss.item()
    third = torch.tensor(1.0, dtype=torch.float32) / 3  # float32 1/3, whose double is not Python's 1/3
    stats = {"loss": [on_device, 2.5], "ratio": [third], "skipped_updates": [1.0]}
    read_stats, read_metrics = read_to_host(stats, {"train/kl": third.double() / 7, "train/lr": 1e-4, "note": "x"})
    assert read_stats == {"loss": [as_before, 2.5], "ratio": [third.item()], "skipped_updates": [1.0]}
    assert all(type(v) is float for values in read_stats.values() for v in values)
    assert read_metrics == {"train/kl": third.item() / 7, "train/lr": 1e-4, "note": "x"}
    assert third.item() != 1 / 3 and read_stats["ratio"][0] != 1 / 3  # the check can tell float32 from double
    assert read_to_host({"a": [1.0]}, {"b": 2.0}) == ({"a": [1.0]}, {"b": 2.0})  # nothing on the device: unchanged
