"""Run directory, metrics, samples, optional wandb, and atomic checkpoints.

    runs/<run_name>/
        config.json          every argument, the git commit and dirty flag, versions, hardware
        metrics.jsonl        one JSON object per logged step ({"step": k, "train/reward": ..., ...})
        samples.jsonl        a few prompts and completions per step
        checkpoints/step_000010/state.pt   model, optimiser, scheduler, RNG, data cursor, step
        final/               the trained model in Hugging Face format (loadable by from_pretrained)

Checkpoints are written to a temporary folder and renamed into place, so a crash while saving never
corrupts the last good one; they hold tensors and plain values only, and are loaded without unpickling anything else
(a tampered file cannot run code). With ``--track`` the same keys go to wandb (``WANDB_MODE=offline`` works).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import platform
import random
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import torch


def git_state(root: Path | None = None) -> dict[str, object]:
    """The repository's commit, whether the work tree has uncommitted changes, and which (``git status --porcelain``
    lines, at most 40), so that a record made from a dirty tree says what was not committed. ``root``: the
    checkout (default: this project's)."""
    root = root or Path(__file__).resolve().parent.parent

    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=10).stdout.rstrip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    changes = [line for line in run("git", "status", "--porcelain").splitlines() if line.strip()]
    return {
        "git_commit": run("git", "rev-parse", "HEAD") or None,
        "git_dirty": bool(changes),
        "git_changes": changes[:40] + ([f"... and {len(changes) - 40} more"] if len(changes) > 40 else []),
    }


def hardware() -> str:
    """A one-line description of the machine (GPU name or CPU model and core count)."""
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


class Tracker:
    """Writes ``metrics.jsonl`` / ``samples.jsonl`` under the run dir and mirrors metrics to wandb.

    Only the main process should create one with ``enabled=True``; other ranks get a silent tracker.
    """

    def __init__(self, run_dir: Path, config: object, track: bool, project: str, enabled: bool = True):
        self.run_dir, self.enabled, self.wandb = Path(run_dir), enabled, None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        record = {**dataclasses.asdict(config), **git_state(), "hardware": hardware(), "torch": torch.__version__}
        from common.sandbox import configured  # the isolation rung in force, when this run grades programs

        if (sandbox := configured()) is not None:
            record["sandbox_in_force"] = sandbox.describe()
        (self.run_dir / "config.json").write_text(json.dumps(record, indent=2, default=str))
        if track:
            import wandb

            self.wandb = wandb.init(
                project=project,
                name=self.run_dir.name,
                config=record,
                dir=str(self.run_dir),
                resume="allow",
                id=self.run_dir.name,
            )

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Append one metrics row (floats only) for ``step``."""
        if not self.enabled:
            return
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def log_samples(self, rows: list[dict], step: int) -> None:
        """Append a few prompt / completion / reward rows for ``step``."""
        if not self.enabled:
            return
        with open(self.run_dir / "samples.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")

    def truncate_after(self, step: int) -> None:
        """On resume, drop logged rows past the checkpoint's step so the files read as one run."""
        if not self.enabled:
            return
        for name in ("metrics.jsonl", "samples.jsonl"):
            path = self.run_dir / name
            if path.exists():
                kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
                path.write_text("".join(line + "\n" for line in kept))

    def logged(self, step: int, prefix: str = "") -> dict[str, float]:
        """The metrics ``metrics.jsonl`` holds for ``step`` whose names start with ``prefix``, merged over that step's
        rows (a later row wins a name logged twice); {} when none, or on a process whose tracker is disabled."""
        path = self.run_dir / "metrics.jsonl"
        if not self.enabled or not path.exists():
            return {}
        merged = {}
        for line in path.read_text().splitlines():
            row = json.loads(line) if line else {}
            if row.get("step") == step:
                merged |= {k: v for k, v in row.items() if k.startswith(prefix) and k not in ("step", "time")}
        return merged

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


# ----------------------------------------------------------------------------------------------
# RNG state
# ----------------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """Seed Python, torch (CPU and CUDA)."""
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every global RNG stream a run or a library may draw from (Python, NumPy, torch CPU and CUDA), as tensors and
    plain values only, so that a checkpoint holding it loads with ``torch.load(weights_only=True)``."""
    numpy_state = np.random.get_state(legacy=False)  # nested dicts of plain values around one uint32 key array
    numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` saved (a state without a NumPy entry leaves NumPy's alone)."""
    random.setstate(state["python"])
    if "numpy" in state:
        numpy_state = {**state["numpy"]}
        numpy_state["state"] = {**numpy_state["state"], "key": np.asarray(numpy_state["state"]["key"], dtype=np.uint32)}
        np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------
def save_checkpoint(run_dir: Path, step: int, state: dict, keep_last: int = 2, also=None) -> Path:
    """Atomically write ``state`` (a dict of state_dicts and plain values) as ``checkpoints/step_<step>``.

    ``state`` must hold only tensors and plain Python values (dicts, lists, tuples, numbers, strings, None):
    ``load_checkpoint`` refuses anything else.

    ``also(folder)``, when given, writes more files into the checkpoint folder before it is renamed.

    The state is written into a temporary folder which is then renamed, so the previous checkpoint stays
    intact if the process dies mid-write. Older checkpoints beyond ``keep_last`` are deleted (0 keeps all).
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step_{step:06d}", root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    if also is not None:
        also(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    if keep_last > 0:
        for old in sorted(root.glob("step_*"))[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder under ``run_dir``, or None."""
    done = sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if (p / "state.pt").exists())
    return done[-1] if done else None


def load_checkpoint(path: Path) -> dict:
    """Load a checkpoint written by ``save_checkpoint`` onto the CPU, memory-mapped (processes of one node that load
    the same checkpoint share its pages).

    Only tensors and plain values are unpickled (``weights_only=True``): a file that names any other class or
    function, which unpickling would call, is refused with ``pickle.UnpicklingError`` and nothing of it runs."""
    file = Path(path) / "state.pt"
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:  # torch's own message suggests weights_only=False: not for this file
        raise pickle.UnpicklingError(
            f"refusing to load {file}: it is damaged or holds objects other than tensors and plain values, which "
            "unpickling could run as code (the cause below names what was refused)"
        ) from err
