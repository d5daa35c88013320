"""In-flight weight updates (``--rollout.in-flight``, common/async_rollout.py): the push does not wait for the
generation in flight, every token keeps the version that sampled it, a sample's lag counts from the version at which
its generation started (admission: at most k - 1), and a checkpoint keeps every finished group while the groups still
generating are submitted again on resume. Checked against a fake server engine whose samples wait for given versions;
the real servers: tests/test_vllm_inflight.py (vLLM tier)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from test_async_rollout import Books as LagBooks

from common.async_rollout import LaggedRollouts
from common.engine_base import Completion, RolloutConfig
from common.rollout import make_engine
from common.rollout_client import _merge_event

# the version each prompt's samples wait for before their second (last) token: prompt 4 is the long tail
TARGET = {4: 2, 5: 1}


class Books(LagBooks):
    """test_async_rollout's stand-in for Bookkeeper; prompt i = [its target version, 100 + i]."""

    def prompts_at(self, indices):
        return [{"i": i} for i in indices], [[TARGET.get(i, 0), 100 + i] for i in indices]


class InFlightEngine:
    """A server engine whose sample takes its first token at the version it starts, then waits (on its own thread,
    as the real engine's streams do) until the servers serve its prompt's target version, and takes its second
    token there. A push that waited for the generation in flight would never come: the wait times out instead."""

    overlaps, in_flight, on_fault = True, True, None

    def __init__(self, token_version=0):
        self.pushes, self.token_version, self.cond = 0, token_version, threading.Condition()
        self.started = 0  # prompts whose samples took their first token

    @property
    def version(self):
        return f"run-{self.pushes}"

    def sample_local(
        self,
        prompt_ids,
        n,
        max_new_tokens,
        temperature,
        top_p,
        seeds,
        stop=(),
        version=None,
        on_group=None,
        seeded=True,
    ):
        self.seeded = seeded

        def one(i):
            with self.cond:
                first = self.token_version
                self.started += 1
                if not self.cond.wait_for(lambda: self.token_version >= prompt_ids[i][0], timeout=10):
                    raise TimeoutError("no push came while the sample waited: the push waited for it")
                last = self.token_version
            group = [Completion([first, last], [-0.25, -0.5], "stop", token_versions=[first, last]) for _ in range(n)]
            on_group(i, group)
            return group

        with ThreadPoolExecutor(max_workers=len(prompt_ids)) as pool:
            return [c for g in pool.map(one, range(len(prompt_ids))) for c in g]

    def update_weights_in_flight(self, model, version):
        with self.cond:
            self.pushes += 1
            self.token_version = version
            self.cond.notify_all()

    def all_ranks(self, fn, what, after_update):
        return fn()


def schedule(books, engine, max_lag=3):
    def sample(step):
        problems, prompt_ids = books.next_prompts()
        return problems, prompt_ids, rollouts.request(prompt_ids, 2, 8, 1.0, 1.0, [7 * step, 7 * step + 1])

    rollouts = LaggedRollouts(books, engine, sample, max_lag)
    return rollouts


def step_log(rollouts, step, first_step=0):
    _, prompt_ids, completions = rollouts.take(step)
    stats = rollouts.stats
    row = {
        "prompts": [p[-1] for p in prompt_ids],
        "tokens": [c.token_ids for c in completions],
        "started": [c.version for c in completions],
        "lag": stats["train/lag"],
        "lag_max": stats["train/lag_max"],
        "token_lag": (stats["train/token_lag_min"], stats["train/token_lag_max"], stats["train/token_lag_mean"]),
    }
    deadline = time.time() + 10  # the push comes once every requested prompt has taken its first token, as a real
    while rollouts.engine.started < 2 * (rollouts.next_step - first_step):  # step's training gives them time to
        assert time.time() < deadline
        time.sleep(0.001)
    rollouts.update_weights(None)
    return row


def checkpoint_after_step_0():
    """``(books, checkpoint)`` of a k = 3 run after step 0's push, once prompt 5's group of batch 2 has finished
    (prompt 4's waits for version 2); the abandoned run's waiting sample is then let end."""
    books, engine = Books(), InFlightEngine()
    rollouts = schedule(books, engine)
    step_log(rollouts, 0)
    deadline = time.time() + 10
    while rollouts.queue[1].request.groups[1] is None:  # prompt 5's group finishes on its thread after the push
        assert time.time() < deadline
        time.sleep(0.01)
    saved = rollouts.state_dict()
    engine.update_weights_in_flight(None, 2)
    return books, saved


def test_pushes_do_not_wait_and_every_token_keeps_its_version():
    """k = 3. Batch 2 (prompts 4 and 5, requested from version 0 at step 0's top) spans two pushes: prompt 4's samples
    take tokens at versions 0 and 2, prompt 5's at 0 and 1. By hand, with lag = step - version:
    step 0: tokens [0, 0], lag 0; step 1: [0, 0], lag 1, token lags 1; step 2: sample lag 2, token lags
    (2, 0, 2, 0, 2, 1, 2, 1): min 0, max 2, mean 1.25; step 3 (from version 1): lag 2, token lags 2."""
    books, engine = Books(), InFlightEngine()
    rollouts = schedule(books, engine)
    rows = [step_log(rollouts, step) for step in range(4)]
    assert [r["prompts"] for r in rows] == [[100, 101], [102, 103], [104, 105], [106, 107]]
    assert rows[0]["tokens"] == [[0, 0]] * 4 and rows[0]["lag_max"] == 0 and rows[0]["token_lag"] == (0, 0, 0)
    assert rows[1]["tokens"] == [[0, 0]] * 4 and rows[1]["lag"] == 1 and rows[1]["token_lag"] == (1, 1, 1)
    assert rows[2]["tokens"] == [[0, 2], [0, 2], [0, 1], [0, 1]] and rows[2]["started"] == [0] * 4
    assert (rows[2]["lag"], rows[2]["lag_max"], rows[2]["token_lag"]) == (2, 2, (0, 2, 1.25))
    assert rows[3]["tokens"] == [[1, 1]] * 4 and rows[3]["lag_max"] == 2 and rows[3]["token_lag"] == (2, 2, 2)
    assert engine.pushes == 4 and engine.seeded is False  # a push may preempt them: sent unseeded
    assert "time/weight_push_s" in rollouts.stats and "time/generation_overlap_s" in rollouts.stats


def test_a_checkpoint_keeps_finished_groups_and_resubmits_the_ones_in_flight():
    """After step 0's push (version 1), batch 1 has finished, and of batch 2 prompt 5's group (tokens at versions 0
    and 1) but not prompt 4's (it waits for version 2). The checkpoint holds both finished groups exactly, with
    their per-token versions and log-probs, and None for prompt 4's; a resume (version 1) submits prompt 4 again
    from its prompt, now starting at version 1: at step 2 its samples are [1, 2] (lag 1), prompt 5's the kept
    [0, 1] (lag 2): train/lag 1.5, token lags (1, 0, 1, 0, 2, 1, 2, 1): min 0, max 2, mean 1."""
    books, saved = checkpoint_after_step_0()
    assert [(b["step"], b["version"]) for b in saved["batches"]] == [(1, 0), (2, 0)] and saved["cursor"] is None
    first, second = saved["batches"]
    assert first["groups"] == [[([0, 0], [-0.25, -0.5], "stop", None, None, False, [0, 0])] * 2] * 2
    assert second["groups"][0] is None
    assert second["groups"][1] == [([0, 1], [-0.25, -0.5], "stop", None, None, False, [0, 1])] * 2
    assert second["group_versions"] == [0, 0] and second["seeds"] == [14, 15] and second["indices"] == [4, 5]
    assert second["settings"] == [2, 8, 1.0, 1.0, []]

    resumed_books, resumed_engine = Books(), InFlightEngine()
    resumed_books.cursor = books.cursor
    resumed = schedule(resumed_books, resumed_engine)
    resumed.load_state_dict(saved)
    assert resumed.queue[1].request.pending and resumed.next_step == 3
    one = step_log(resumed, 1, first_step=3)
    assert one["tokens"] == [[0, 0]] * 4 and one["started"] == [0] * 4
    two = step_log(resumed, 2, first_step=3)
    assert two["tokens"] == [[1, 2], [1, 2], [0, 1], [0, 1]] and two["started"] == [1, 1, 0, 0]
    assert (two["lag"], two["lag_max"], two["token_lag"]) == (1.5, 2, (0, 2, 1.0))
    assert resumed_books.cursor == books.cursor + 4  # batches 3 and 4 drawn by the resumed run; none twice


def test_a_checkpoint_with_groups_in_flight_needs_the_flag_to_resume():
    books, engine = Books(), InFlightEngine()
    rollouts = schedule(books, engine)
    step_log(rollouts, 0)
    saved = rollouts.state_dict()
    engine.update_weights_in_flight(None, 2)
    fixed = LaggedRollouts(Books(), SimpleNamespace(overlaps=True), None, 3)
    with pytest.raises(SystemExit, match="--rollout.in-flight"):
        fixed.load_state_dict(saved)


def test_the_flag_is_refused_with_engines_that_generate_in_process():
    for backend in ("hf", "vllm"):
        with pytest.raises(SystemExit, match="--rollout.in-flight .* needs --rollout.backend vllm-server"):
            make_engine(RolloutConfig(backend=backend, in_flight=True), None, None, "", 0, 64)


def test_streamed_tokens_are_tagged_with_the_version_current_when_they_arrive():
    choices = {}
    chunk = b'data: {"choices": [{"index": 0, "token_ids": [%d, %d], "logprobs": {"token_logprobs": [-1.0, -2.0]}}]}'
    assert not _merge_event("r", chunk % (5, 6), choices, 3)
    assert not _merge_event("r", chunk % (7, 8), choices, 4)
    assert choices[0]["token_ids"] == [5, 6, 7, 8] and choices[0]["token_versions"] == [3, 3, 4, 4]
    untagged = {}
    _merge_event("r", chunk % (5, 6), untagged)
    assert "token_versions" not in untagged[0]  # the default (fixed-lag) path's choices are unchanged


class FailingEngine(InFlightEngine):
    """Every request fails, as when the servers died after a resume."""

    def sample_local(self, *args, **kwargs):
        raise RuntimeError("server gone")


def test_a_restored_batch_whose_resubmission_fails_stays_pending_and_the_cursor_rewinds_past_it():
    """Resumed from the checkpoint of the test above, on servers that then fail: batch 2 (restored, prompt 4's group
    resubmitted) fails, and so does batch 3, the first the resumed run drew. The next checkpoint keeps batch 2 as it
    was (prompt 5's finished group, prompt 4's still to generate) and rewinds the cursor to batch 3's prompts; it
    must not rewind to the restored batch's placeholder cursor (-1), which would draw the data from the start."""
    books, saved = checkpoint_after_step_0()

    resumed_books = Books()
    resumed_books.cursor = books.cursor
    resumed = schedule(resumed_books, FailingEngine(token_version=1))
    resumed.load_state_dict(saved)
    resumed.take(1)  # batch 1 was finished; batch 2's prompt 4 and the new batch 3 are submitted, and fail
    deadline = time.time() + 10
    while not all(b.request.future.done() for b in resumed.queue):
        assert time.time() < deadline
        time.sleep(0.01)
    again = resumed.state_dict()
    assert again["cursor"] == books.cursor  # batch 3's prompts, drawn first by the resumed run
    assert [b["step"] for b in again["batches"]] == [2]
    kept = again["batches"][0]
    assert kept["groups"][0] is None and kept["groups"][1] == saved["batches"][1]["groups"][1]
    assert kept["indices"] == [4, 5] and kept["group_versions"] == [1, 0]


def test_lag_stats_of_the_samples_a_script_keeps_include_their_token_lags():
    """dapo logs the lags of the groups it keeps (``lag_stats`` on its own samples): in flight, the token lags come
    with them. A sample started at version 1 with tokens at versions 1 and 3, and a refill sampled at version 3
    (tokens at 3), trained at step 3: sample lags 2 and 0; token lags 2, 0, 0: min 0, max 2, mean 2/3."""
    rollouts = schedule(Books(), InFlightEngine())
    kept = Completion([1, 2], [-0.1, -0.2], "stop", token_versions=[1, 3])
    refill = Completion([3], [-0.3], "stop", token_versions=[3])
    kept.version, refill.version = 1, 3
    stats = rollouts.lag_stats(3, [kept, refill])
    assert (stats["train/lag"], stats["train/lag_max"]) == (1.0, 2.0)
    assert (stats["train/token_lag_min"], stats["train/token_lag_max"]) == (0.0, 2.0)
    assert stats["train/token_lag_mean"] == pytest.approx(2 / 3)


def test_generation_overlap_counts_concurrent_requests_once():
    """Training from t = 10 to 20; requests generating over [11, 15] and [12, 14], one from 18 still running, and one
    queued behind them: the servers generated during [11, 15] and [18, 20] of it, 6 s (a sum per request would give
    4 + 2 + 2 = 8, and counting the queued one as started, 10)."""
    from concurrent.futures import Future

    from common.async_rollout import Batch, Request

    rollouts = schedule(Books(), InFlightEngine())
    done, running = Future(), Future()
    done.set_result([])
    queued = Future()  # its thread has not started: no start time yet
    spans = [(11.0, 15.0, done), (12.0, 14.0, done), (18.0, 0.0, running), (0.0, 0.0, queued)]
    rollouts.queue = [
        Batch(s, 0, [], [], [], Request(version=0, future=f, start=a, end=b)) for s, (a, b, f) in enumerate(spans)
    ]
    rollouts.train_start, rollouts.taken = 10.0, Request(version=0, start=8.0, end=9.0)
    rollouts.push_in_flight(None, 20.0)
    assert rollouts.stats["time/generation_overlap_s"] == pytest.approx(6.0)
