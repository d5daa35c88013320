"""Checkpoints: atomic writes (a crash while saving leaves the last good checkpoint the one resumed) and pruning."""

import pytest
import torch

from common import tracking
from common.tracking import latest_checkpoint, load_checkpoint, save_checkpoint


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
