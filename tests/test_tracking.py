"""Checkpoints: atomic writes (a crash while saving leaves the last good checkpoint the one resumed), pruning, loading
plain data only (a tampered file cannot run code) with the RNG streams continuing exactly; logged metrics read back."""

import dataclasses
import os
import pickle
import random
import shlex

import numpy as np
import pytest
import torch

from common import tracking
from common.tracking import (
    Tracker,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
)


def test_old_checkpoints_are_pruned_to_keep_last(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"step": step}, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000004", "step_000005"]
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 5
    for step in range(6, 9):
        save_checkpoint(tmp_path, step, {"step": step}, keep_last=0)  # 0 keeps everything
    assert len(list((tmp_path / "checkpoints").glob("step_*"))) == 5


def test_a_crash_while_saving_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"step": 1, "w": torch.ones(3)}, keep_last=1)
    real_save = torch.save

    def dies_halfway(obj, path, *args, **kwargs):  # a partial file on disk, then the process "dies"
        with open(path, "wb") as f:
            f.write(b"\x80\x02partial")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(tracking.torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, {"step": 2, "w": torch.zeros(3)}, keep_last=1)
    monkeypatch.setattr(tracking.torch, "save", real_save)
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_000001"  # the half-written step 2 is not a checkpoint, and step 1 was not pruned
    state = load_checkpoint(latest)
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(3))
    # the next save succeeds over the leftover temporary folder
    save_checkpoint(tmp_path, 2, {"step": 2}, keep_last=1)
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 2


class Opaque:
    """An object that is not plain data: unpickling it imports and calls this module's class."""

    def __init__(self):
        self.value = 1


class RunsCommand:
    """Unpickles by calling ``os.system``: what a tampered checkpoint would carry."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.mark.parametrize("payload", ["os.system", "custom class"])
def test_a_checkpoint_carrying_code_is_refused_and_its_payload_never_runs(tmp_path, payload):
    marker = tmp_path / "payload_ran"
    extra = RunsCommand(f"touch {shlex.quote(str(marker))}") if payload == "os.system" else Opaque()
    save_checkpoint(tmp_path / "run", 1, {"step": 1, "model": {"w": torch.ones(2)}, "scheduler": {"x": extra}})
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        load_checkpoint(latest_checkpoint(tmp_path / "run"))
    assert not marker.exists()


def draws() -> tuple:
    return random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()


def test_a_checkpoint_round_trips_training_state_and_rng_streams(tmp_path):
    seed_everything(0)
    np.random.seed(0)
    np.random.standard_normal()  # the legacy Gaussian sampler now holds a cached second value: part of the state
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / 4)
    model(torch.ones(3)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    save_checkpoint(tmp_path, 1, state | {"rng": [rng_state()], "step": 1, "cursor": 8, "train_time": 2.5})
    expected = draws()
    seed_everything(1)  # every stream moves elsewhere; the checkpoint must bring each back
    np.random.seed(1)

    path = latest_checkpoint(tmp_path)
    torch.load(path / "state.pt", weights_only=True)  # plain data to any weights-only loader, not only ours
    saved = load_checkpoint(path)
    set_rng_state(saved["rng"][0])
    assert draws() == expected
    assert (saved["step"], saved["cursor"], saved["train_time"]) == (1, 8, 2.5)
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda s: (s + 1) / 4)
    fresh.load_state_dict(saved["model"])
    fresh_optimizer.load_state_dict(saved["optimizer"])
    fresh_scheduler.load_state_dict(saved["scheduler"])
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_scheduler.get_last_lr() == [0.1 * 2 / 4]  # one scheduler step: lambda(1) = 2/4 of the base lr
    assert int(fresh_optimizer.state_dict()["state"][0]["step"]) == 1


@dataclasses.dataclass
class Config:
    name: str = "t"


def test_logged_reads_back_one_steps_metrics(tmp_path):
    tracker = Tracker(tmp_path, Config(), track=False, project="p")
    tracker.log({"eval/a/mean@2": 0.25, "time/eval_s": 3.0}, step=0)
    tracker.log({"train/reward": 0.5}, step=1)
    tracker.log({"eval/a/mean@2": 0.75, "eval/a/pass@2": 1.0}, step=1)
    assert tracker.logged(0, "eval/") == {"eval/a/mean@2": 0.25}
    assert tracker.logged(1) == {"train/reward": 0.5, "eval/a/mean@2": 0.75, "eval/a/pass@2": 1.0}
    assert tracker.logged(2, "eval/") == {}
    assert Tracker(tmp_path, Config(), track=False, project="p", enabled=False).logged(0) == {}


def test_git_state_names_what_was_not_committed(tmp_path):
    """A record made from a dirty tree lists the uncommitted paths; a clean tree lists none."""
    import subprocess

    def git(*cmd):
        subprocess.run(["git", *cmd], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    clean = tracking.git_state(tmp_path)
    assert clean["git_dirty"] is False and clean["git_changes"] == [] and len(clean["git_commit"]) == 40
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "new.txt").write_text("")
    dirty = tracking.git_state(tmp_path)
    assert dirty["git_dirty"] is True and dirty["git_commit"] == clean["git_commit"]
    assert dirty["git_changes"] == [" M a.py", "?? new.txt"]
