"""The rollout client (common/rollout_client.py) inside the server engine, against the stub vLLM server of
test_server_engine.py on 127.0.0.1: a stream slower than --rollout.server-timeout-s succeeds, a silent one fails
naming its server, a cut stream is retried with the same body (seeds) and gives the same samples, a failed weight
push is never retried, a failed prefix-cache reset stops the run, and a loopback NCCL address for a server on
another machine is refused. Each test takes seconds."""

import re
import socket
import time
from collections import Counter

import pytest
import test_server_engine
from test_server_engine import TINY, StubServer, stub_sample

from common.engine_base import RolloutConfig
from common.rollout_client import check_rendezvous_address, is_local_host
from common.vllm_server import VLLMServerEngine

# test_server_engine.py's fixtures: the tiny model with its stub's stop id, and retries that wait milliseconds
quick_retries, tiny = test_server_engine.quick_retries, test_server_engine.tiny


@pytest.fixture
def stub(tiny):
    config = tiny[0].config
    server = StubServer(config.vocab_size, config.hidden_size, config.num_hidden_layers)
    yield server
    server.close()


def engine(stub: StubServer, tiny, **cfg) -> VLLMServerEngine:
    model, tokenizer = tiny
    eng = VLLMServerEngine(RolloutConfig(server_urls=stub.url, **cfg), model, tokenizer, TINY, 1, 256, True)
    eng.faults = []
    eng.on_fault = eng.faults.append
    return eng


def expected(prompts: list[list[int]], n: int, seeds: list[int], length: int) -> list[tuple[list[int], list[float]]]:
    return [stub_sample(p, s, j, length) for p, s in zip(prompts, seeds) for j in range(n)]


def samples(completions) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for c in completions]


def test_a_stream_slower_than_the_timeout_succeeds(stub, tiny):
    """2 s of generation, a chunk every 0.2 s, under a 0.5 s timeout: the timeout bounds silence, not the group."""
    eng = engine(stub, tiny, server_timeout_s=0.5)
    stub.length, stub.chunk_delay = 5, 0.2  # 2 samples x 5 tokens, one token a chunk
    start = time.monotonic()
    out = eng.generate([[5, 9]], 2, 8, 1.0, 1.0, [11])
    assert time.monotonic() - start >= 1.8
    assert samples(out) == expected([[5, 9]], 2, [11], 5)
    assert [c.finish_reason for c in out] == ["stop", "stop"] and stub.calls["/v1/completions"] == 1


def test_a_request_queued_behind_others_waits_while_its_server_produces(stub, tiny):
    """vLLM queues what its KV cache cannot hold: a request that sends nothing for 1.5 s, under a 0.5 s timeout,
    while the same server streams another group, is waiting its turn, not stalled."""
    eng = engine(stub, tiny, server_timeout_s=0.5)
    stub.length, stub.chunk_delay, stub.hold = 10, 0.1, {21: 1.5}
    out = eng.generate([[5, 20], [5, 21]], 2, 16, 1.0, 1.0, [1, 2])
    assert samples(out) == expected([[5, 20], [5, 21]], 2, [1, 2], 10)


def test_a_silent_server_fails_naming_its_url_and_is_not_retried(stub, tiny):
    eng = engine(stub, tiny, server_timeout_s=0.5)
    stub.stall_after = 1  # one token, then nothing
    start = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        eng.generate([[5, 9]], 2, 8, 1.0, 1.0, [11])
    message = str(stop.value)
    assert f"{stub.url}/v1/completions failed: the server sent nothing for" in message
    assert "--rollout.server-timeout-s 0.5" in message and "--resume" in message
    assert time.monotonic() - start < 5
    assert stub.calls["/v1/completions"] == 1 and eng.faults == [False]


def test_a_cut_stream_is_retried_with_the_same_body_and_gives_the_same_samples(stub, tiny, capsys):
    eng = engine(stub, tiny)
    prompts, seeds = [[5, 9], [5, 10]], [11, 12]
    undisturbed = samples(eng.generate(prompts, 3, 8, 1.0, 1.0, seeds))
    stub.bodies.clear()
    stub.drops, stub.drop_after = 1, 2  # the next stream is cut after two chunks, without its closing chunk
    assert samples(eng.generate(prompts, 3, 8, 1.0, 1.0, seeds)) == undisturbed == expected(prompts, 3, seeds, 3)
    # three requests: the cut one twice, byte for byte (its seed included), the other once
    assert sorted(Counter(stub.bodies).values()) == [1, 2]
    retried = next(body for body, count in Counter(stub.bodies).items() if count == 2)
    assert b'"stream": true' in retried and (b'"seed": 11' in retried or b'"seed": 12' in retried)
    log = capsys.readouterr().out
    assert re.search(rf"rollout server {re.escape(stub.url)}/v1/completions: attempt 1 of 4 failed \(.+\)", log)


def test_a_generation_failing_every_time_is_tried_retries_plus_one_times(stub, tiny, capsys):
    eng = engine(stub, tiny, server_retries=2)
    stub.broken = "/v1/completions"
    with pytest.raises(SystemExit, match=rf"(?s){re.escape(stub.url)}/v1/completions answered 500.*after 3 attempts"):
        eng.generate([[5, 9]], 2, 8, 1.0, 1.0, [11])
    assert stub.calls["/v1/completions"] == 3 and eng.faults == [False]
    retries = [line for line in capsys.readouterr().out.splitlines() if "/v1/completions: attempt" in line]
    assert [line.split(": attempt ")[1][:6] for line in retries] == ["1 of 3", "2 of 3"]  # one line each


@pytest.mark.parametrize("fault", ["broken", "cut"])
@pytest.mark.parametrize("route", ["/start_weight_update", "/update_weights", "/finish_weight_update"])
def test_a_failed_push_is_not_retried(stub, tiny, fault, route):
    """A weight route that answers 500, or drops the connection (a transient failure for a generation), is tried
    once: the push stops the run after checkpointing the updated step."""
    eng = engine(stub, tiny)
    before = stub.calls[route]
    setattr(stub, fault, route)
    with pytest.raises(SystemExit, match=rf"during the weight push: {re.escape(stub.url)}{route} "):
        eng.update_weights(tiny[0])
    assert stub.calls[route] - before == 1 and eng.faults == [True]


@pytest.mark.parametrize("answer", [{"success": False}, False])
def test_a_failed_prefix_cache_reset_stops_the_run(stub, tiny, answer):
    eng = engine(stub, tiny, server_retries=1)
    before = stub.calls["/reset_prefix_cache"]
    stub.reset_answer = answer
    with pytest.raises(SystemExit, match=rf"{re.escape(stub.url)} did not reset its prefix cache.*--resume"):
        eng.update_weights(tiny[0])
    assert stub.calls["/reset_prefix_cache"] - before == 2 and eng.faults == [True]  # asked again once, as vLLM allows


@pytest.mark.parametrize("answer", [{"success": True}, {}])
def test_a_prefix_cache_reset_that_succeeds_or_cannot_say_passes(stub, tiny, answer):
    """{} is an older vLLM's empty answer, which never checked."""
    stub.reset_answer = answer
    eng = engine(stub, tiny)
    eng.update_weights(tiny[0])
    assert stub.version == eng.version


def test_a_loopback_rendezvous_with_a_server_on_another_machine_is_refused():
    remote = "http://192.0.2.7:8000"  # TEST-NET-1 (RFC 5737): no machine's own address
    for loopback in ("127.0.0.1", "localhost", "::1"):
        with pytest.raises(SystemExit, match=r"192\.0\.2\.7:8000 is on another machine.*--rollout\.trainer-address"):
            check_rendezvous_address(["http://127.0.0.1:8000", remote], loopback)
    # a name that does not resolve here is not known to be this machine
    with pytest.raises(SystemExit, match="--rollout.trainer-address"):
        check_rendezvous_address(["http://gpu-node-7.invalid:8000"], "127.0.0.1")
    check_rendezvous_address([remote], "192.0.2.1")  # a routable address: the server can reach it


def test_a_loopback_rendezvous_with_servers_on_this_machine_is_accepted():
    local = ["http://127.0.0.1:8000", "http://localhost:8001", "http://[::1]:8002", f"http://{socket.gethostname()}:1"]
    check_rendezvous_address(local, "127.0.0.1")
    check_rendezvous_address([], "127.0.0.1")
    assert is_local_host(socket.gethostname()) and not is_local_host("192.0.2.7")
