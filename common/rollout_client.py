"""The HTTP client of the vLLM server engine (``common/vllm_server.py``): plain requests, streamed generations with a
progress timeout and bounded retries, and the check of the NCCL rendezvous address. Standard library only.

    answer = http(url, "/weight_info", timeout=600, retries=3)        # GET; POST when given a payload
    progress = ServerProgress()                                       # one per engine: the servers' liveness
    choices = stream_completion(url, payload, 600, 3, progress)       # /v1/completions' choices, streamed
    reset_prefix_cache(url, 600, 3)                                   # after a push; raises unless it succeeded
    check_rendezvous_address(["http://10.0.0.9:8000"], "127.0.0.1")   # SystemExit naming --rollout.trainer-address

* **A progress timeout, not a deadline.** A group of long traces can take longer than any fixed timeout (DAPO's
  20,480 new tokens at 20-40 tokens/s is 500-1,000 s), so generations are streamed (``"stream": true``, server-sent
  events ``data: {...}`` closed by ``data: [DONE]``) and a request fails only when its *server* has sent nothing on
  any of this engine's streams for ``timeout_s`` seconds. Liveness is per server, not per request: vLLM queues the
  requests that do not fit its KV cache, and a queued request sends nothing until it is scheduled, while the server
  keeps producing tokens for the others.
* **Bounded retries, same body.** A generation whose connection is refused or reset, whose stream ends before
  ``[DONE]``, or that answers 5xx is sent again, byte for byte (the same seeds: the same samples), after a backoff,
  at most ``retries`` times, each retry logged on one line. A server that stalls is a fault, not retried. The
  weight-update routes are never retried: their callers pass ``retries=0`` (the default), as a push that half
  happened cannot be told apart from one that did not.
* **The rendezvous address.** A server on another machine given a loopback address for the NCCL store would connect
  to itself and the trainer would block until the store times out; ``check_rendezvous_address`` refuses that at
  start-up.
"""

from __future__ import annotations

import ipaddress
import json
import queue
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from http import client as http_client  # as a name: `http` is this module's request function
from typing import Any

RETRY_BACKOFF_S = 1.0  # the first retry's wait, doubled at each further one (tests shorten it)
RETRY_BACKOFF_MAX_S = 30.0


class RolloutServerError(RuntimeError):
    """A rollout server failed mid-run (no answer, a timeout, an error status, a wrong weight version)."""


class TransientServerError(RolloutServerError):
    """A failure that a second try of the same request may not meet: a refused or reset connection, a stream cut
    short, a 5xx answer."""


def _transient_reason(error: BaseException) -> str | None:
    """Why ``error`` is worth a retry ('connection reset', 'answered 503', ...), or None when it is not (a timeout:
    the server stalled; a 4xx: the request is wrong; a name that does not resolve: the URL is wrong)."""
    if isinstance(error, urllib.error.HTTPError):
        return f"answered {error.code}" if error.code >= 500 else None
    if isinstance(error, urllib.error.URLError):
        error = error.reason if isinstance(error.reason, BaseException) else error
    if isinstance(error, (ConnectionError, http_client.IncompleteRead, http_client.BadStatusLine)):
        return f"{type(error).__name__}: {error}"
    return None


def _backoff(attempt: int) -> float:
    return min(RETRY_BACKOFF_MAX_S, RETRY_BACKOFF_S * 2**attempt)


def _log_retry(url: str, attempt: int, retries: int, reason: str, wait: float) -> None:
    reason = " ".join(reason.split())[:300]  # one line, however the server worded its error page
    print(
        f"rollout server {url}: attempt {attempt + 1} of {retries + 1} failed ({reason}); the same request again "
        f"in {wait:.1f} s",
        flush=True,
    )


def http(url: str, path: str, payload: dict | None = None, timeout: float = 30.0, retries: int = 0) -> Any:
    """GET (no payload) or POST JSON to ``url + path``; the decoded JSON answer ({} when empty). ``retries``: how many
    more times a transient failure (``TransientServerError``) is tried again, with backoff; 0 for any route that
    changes the server's state in a way a retry could repeat (the weight routes). Raises RolloutServerError naming
    the URL on any failure."""
    data = None if payload is None else json.dumps(payload).encode()
    for attempt in range(retries + 1):
        request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                body = response.read()
            return json.loads(body) if body.strip() else {}
        except (urllib.error.URLError, OSError, http_client.HTTPException) as error:
            if isinstance(error, urllib.error.HTTPError):
                detail = error.read().decode(errors="replace")[:500]
                message = f"{url}{path} answered {error.code}: {detail}"
            else:
                message = f"{url}{path} failed: {getattr(error, 'reason', None) or error!r}"
            reason = _transient_reason(error)
            if reason is None or attempt == retries:
                kind = TransientServerError if reason else RolloutServerError
                raise kind(message + (f" (after {attempt + 1} attempts)" if attempt else "")) from error
            _log_retry(url + path, attempt, retries, reason, _backoff(attempt))
            time.sleep(_backoff(attempt))
    raise AssertionError("unreachable")


def reset_prefix_cache(url: str, timeout: float, retries: int = 0, reset_running: bool = False) -> None:
    """POST ``/reset_prefix_cache`` to ``url`` after a weight push, or raise RolloutServerError. vLLM (0.32 on) answers
    ``{"success": false}`` while requests still hold KV blocks (its scheduler's ``reset_prefix_cache``) and says a
    caller may try again: asked up to ``retries`` more times, with backoff. An empty answer (older vLLM, which does
    not check) is taken as done. ``reset_running`` (in-flight pushes): the scheduler first preempts every running
    request back to its waiting queue (``reset_running_requests=true``), so that their KV is recomputed from their
    tokens with the new weights when they are scheduled again."""
    path = "/reset_prefix_cache?reset_running_requests=true" if reset_running else "/reset_prefix_cache"
    for attempt in range(retries + 1):
        answer = http(url, path, {}, timeout)
        failed = answer is False or (isinstance(answer, dict) and answer.get("success", True) is False)
        if not failed:
            return
        if attempt < retries:
            time.sleep(_backoff(attempt))
    raise RolloutServerError(
        f"{url} did not reset its prefix cache after the weight push (answered {answer!r}, {retries + 1} times): "
        "requests there still hold KV blocks, and prompts would reuse KV computed with the old weights"
    )


class ServerProgress:
    """When each server last sent this engine anything (a byte of any stream): a request waits as long as its server
    keeps producing, for this request or for others. Thread-safe; one per engine."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def beat(self, url: str) -> None:
        with self._lock:
            self._last[url] = time.monotonic()

    def idle_s(self, url: str, since: float) -> float:
        """Seconds since ``url`` last sent anything, counted from ``since`` at the earliest (a request's start)."""
        with self._lock:
            return time.monotonic() - max(since, self._last.get(url, since))


def stream_completion(
    url: str,
    payload: dict,
    timeout_s: float,
    retries: int = 0,
    progress: ServerProgress | None = None,
    tag: Callable[[], int] | None = None,
) -> list[dict]:
    """POST ``payload`` to ``url``'s ``/v1/completions`` as a stream; the choices merged from its chunks, in the shape
    of vLLM's non-streaming answer (``index``, ``token_ids``, ``logprobs.token_logprobs``, ``finish_reason``,
    ``stop_reason``; ``token_ids`` or ``logprobs`` None when a chunk lacked them). Transient failures are retried
    with the same body; a server silent for ``timeout_s`` raises RolloutServerError naming the URL. ``tag``
    (in-flight pushes): called as each chunk arrives; its value is recorded for each of the chunk's tokens in the
    choice's ``token_versions``."""
    body = json.dumps({**payload, "stream": True}).encode()  # one body for every attempt: the same seeds
    progress = ServerProgress() if progress is None else progress
    for attempt in range(retries + 1):
        try:
            return _stream_once(url, body, timeout_s, progress, tag)
        except TransientServerError as error:
            if attempt == retries:
                raise TransientServerError(f"{error} (after {attempt + 1} attempts)" if attempt else str(error))
            _log_retry(f"{url}/v1/completions", attempt, retries, str(error), _backoff(attempt))
            time.sleep(_backoff(attempt))
    raise AssertionError("unreachable")


def _stream_once(
    url: str, body: bytes, timeout_s: float, progress: ServerProgress, tag: Callable[[], int] | None = None
) -> list[dict]:
    """One streamed request. A reader thread does the blocking reads and queues the lines; this thread waits on the
    queue and checks the server's progress, so a read never has to time out (a timed-out socket file cannot be read
    again) and a stall is cut by shutting the socket down under the reader."""
    parts = urllib.parse.urlsplit(url)
    route = f"{url}/v1/completions"
    connection_class = http_client.HTTPSConnection if parts.scheme == "https" else http_client.HTTPConnection
    connection = connection_class(parts.hostname, parts.port, timeout=timeout_s)  # the connect's own timeout
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            connection.connect()
            connection.sock.settimeout(None)  # the progress check below bounds every wait, not the socket
            headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
            connection.request("POST", parts.path.rstrip("/") + "/v1/completions", body, headers)
            response = connection.getresponse()
            if response.status != 200:
                detail = response.read().decode(errors="replace")[:500]
                lines.put(("status", response.status, detail))
                return
            for line in response:
                lines.put(("line", line))
            lines.put(("eof",))
        except Exception as error:  # noqa: BLE001 - every failure goes to the waiting thread, which classifies it
            lines.put(("error", error))
        finally:
            connection.close()

    threading.Thread(target=read, daemon=True, name=f"stream {route}").start()
    started, poll = time.monotonic(), max(0.01, min(1.0, timeout_s / 5))
    choices: dict[int, dict] = {}
    try:
        while True:
            try:
                item = lines.get(timeout=poll)
            except queue.Empty:
                if (idle := progress.idle_s(url, started)) >= timeout_s:
                    raise RolloutServerError(
                        f"{route} failed: the server sent nothing for {idle:.1f} s (--rollout.server-timeout-s "
                        f"{timeout_s:g}) while this request waited"
                    ) from None
                continue
            progress.beat(url)
            if item[0] == "status":
                kind = TransientServerError if item[1] >= 500 else RolloutServerError
                raise kind(f"{route} answered {item[1]}: {item[2]}")
            if item[0] == "error":
                reason = _transient_reason(item[1])
                kind = TransientServerError if reason else RolloutServerError
                raise kind(f"{route} failed: {reason or f'{type(item[1]).__name__}: {item[1]}'}") from item[1]
            if item[0] == "eof":
                raise TransientServerError(f"{route} failed: the stream ended before [DONE]")
            if _merge_event(route, item[1], choices, None if tag is None else tag()):
                return [choices[i] for i in sorted(choices)]
    finally:
        sock = connection.sock  # the reader may close it meanwhile: read it once
        if sock is not None:  # wakes the reader if it is still blocked (a stall, an error event)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _merge_event(route: str, raw: bytes, choices: dict[int, dict], version: int | None = None) -> bool:
    """Fold one line of the event stream into ``choices``; True at ``data: [DONE]``. vLLM's chunks carry the new
    tokens of one choice each (``completion_stream_generator``): their ids, their log-probs, and on the last one the
    finish and stop reasons. An error event (``{"error": {..., "code": N}}``) raises, transient when N >= 500.
    ``version`` (not None): recorded for each of the chunk's tokens in the choice's ``token_versions``."""
    line = raw.decode(errors="replace").strip()
    if not line.startswith("data:"):
        return False  # the blank line between events, or a comment
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return True
    event = json.loads(data)
    if "error" in event:
        error = event["error"] if isinstance(event["error"], dict) else {"message": event["error"]}
        code = int(error.get("code") or 500)
        kind = TransientServerError if code >= 500 else RolloutServerError
        raise kind(f"{route} answered {code} mid-stream: {error.get('message', error)}")
    for chunk in event.get("choices") or ():
        merged = choices.setdefault(
            chunk["index"],
            {
                "index": chunk["index"],
                "token_ids": [],
                "logprobs": {"token_logprobs": []},
                "finish_reason": None,
                "stop_reason": None,
            },
        )
        ids, logprobs = chunk.get("token_ids"), (chunk.get("logprobs") or {}).get("token_logprobs")
        if ids is None or merged["token_ids"] is None:
            merged["token_ids"] = None  # without return_token_ids: the caller names the setting
        else:
            merged["token_ids"].extend(ids)
            if version is not None:
                merged.setdefault("token_versions", []).extend([version] * len(ids))
        if (ids and logprobs is None) or merged["logprobs"] is None:
            merged["logprobs"] = None
        else:
            merged["logprobs"]["token_logprobs"].extend(logprobs or ())
        for key in ("finish_reason", "stop_reason"):
            if chunk.get(key) is not None:
                merged[key] = chunk[key]
    return False


# ------------------------------------------------------------------------------------------- rendezvous address
def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP addresses ``host`` (a name or a literal) resolves to; [] when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return []
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


def _is_this_machine(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``address`` is one of this machine's own: only those can be bound to."""
    if address.is_loopback:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(address), 0))
        return True
    except OSError:
        return False


def is_local_host(host: str) -> bool:
    """Whether ``host`` is this machine: a loopback name or address, or an address of one of its interfaces. A name
    that does not resolve is not known to be local."""
    found = _addresses(host)
    return bool(found) and all(_is_this_machine(address) for address in found)


def is_loopback(host: str) -> bool:
    """Whether ``host`` resolves to a loopback address (``localhost``, ``127.0.0.1``, and the ``127.0.1.1`` that
    Debian's /etc/hosts gives a machine's own name)."""
    return any(address.is_loopback for address in _addresses(host))


def check_rendezvous_address(urls: Sequence[str], address: str, flag: str = "--rollout.trainer-address") -> None:
    """SystemExit naming ``flag`` when a server in ``urls`` runs on another machine and ``address`` (where servers
    reach the trainer's NCCL store) is a loopback one: that server would connect to its own loopback."""
    if not is_loopback(address):
        return
    if remote := [url for url in urls if not is_local_host(urllib.parse.urlsplit(url).hostname or "")]:
        raise SystemExit(
            f"rollout server {remote[0]} is on another machine, but the trainer would give it the loopback address "
            f"{address!r} for NCCL weight transfer (from {flag} or $MASTER_ADDR): it would wait on itself. Pass "
            f"{flag} with an address of this machine that the server can reach (e.g. its private network address)"
        )
