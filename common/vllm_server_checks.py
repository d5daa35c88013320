"""The checks a trainer makes of its rollout servers before training (``--rollout.backend vllm-server``,
``common/vllm_server.py``): the URLs parse, each server answers, and each serves this model with this run's settings
(architecture, vocabulary, shape, logprobs mode, head dtype, dtype, context length, a weight-transfer backend). Every
refusal is a SystemExit that names the URL and the command that starts a matching server.

    urls = parse_urls(cfg.server_urls)
    info = check_server(url, model, model_path, max_model_len, fp32_head, cfg.vllm_dtype)   # per URL, at start-up
"""

from __future__ import annotations

import torch

from common.logprobs import unwrap_model
from common.rollout_client import RolloutServerError, http


def parse_urls(urls: str) -> list[str]:
    """``'http://a:8000, http://b:8000/'`` -> ``['http://a:8000', 'http://b:8000']``; empty is a ValueError."""
    parsed = [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]
    if not parsed:
        raise ValueError("--rollout.backend vllm-server needs --rollout.server-urls URL[,URL...]")
    for url in parsed:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--rollout.server-urls: {url!r} is not an http(s) URL")
    return parsed


def how_to_start(
    model_path: str, url: str, max_model_len: int = 0, fp32_head: bool = False, dtype: str = "auto"
) -> str:
    port = url.rsplit(":", 1)[-1].split("/")[0] if url.count(":") > 1 else "8000"
    flags = f" --max-model-len {max_model_len}" if max_model_len else ""
    flags += " --fp32-lm-head" if fp32_head else ""
    flags += f" --dtype {dtype}" if dtype != "auto" else ""
    return f"start one with: python scripts/serve_rollout.py --model {model_path} --port {port}{flags}"


def served_model_name(url: str) -> str:
    """The name the server serves its model under (``/v1/models``); SystemExit naming the URL when it has none."""
    try:
        return http(url, "/v1/models")["data"][0]["id"]
    except (RolloutServerError, KeyError, IndexError, TypeError) as error:
        raise SystemExit(f"rollout server {url} lists no model at /v1/models ({error})") from None


def check_server(
    url: str, model: torch.nn.Module, model_path: str, max_model_len: int, fp32_head: bool, dtype: str = "auto"
) -> dict:
    """Stop (SystemExit naming ``url``) unless the server answers and serves this model with this run's settings.
    Returns its ``/server_info`` model config (a dict)."""
    try:
        http(url, "/health", timeout=10)
    except RolloutServerError as error:
        hint = how_to_start(model_path, url, max_model_len, fp32_head, dtype)
        raise SystemExit(f"rollout server {url} is not reachable ({error}); {hint}") from None
    try:
        info = http(url, "/server_info?config_format=json", timeout=30)["vllm_config"]
    except RolloutServerError as error:
        raise SystemExit(
            f"rollout server {url} has no /server_info ({error}): start it with VLLM_SERVER_DEV_MODE=1, which mounts "
            f"the weight-update routes too; {how_to_start(model_path, url)}"
        ) from None
    served = info["model_config"]
    try:
        signature = http(url, "/collective_rpc", {"method": "rollout_model_signature"}, timeout=60)["results"][0]
    except (RolloutServerError, KeyError, IndexError, TypeError) as error:
        raise SystemExit(
            f"rollout server {url} cannot say which model it serves ({error}): start it with "
            f"scripts/serve_rollout.py, which loads common/vllm_server_extension.py; {how_to_start(model_path, url)}"
        ) from None
    config = unwrap_model(model).config
    text = config.get_text_config()
    expected = {
        "architecture": ((config.architectures or [type(unwrap_model(model)).__name__])[0], signature["architecture"]),
        "vocabulary size": (text.vocab_size, signature["vocab_size"]),
        "hidden size": (text.hidden_size, signature["hidden_size"]),
        "layers": (text.num_hidden_layers, signature["num_hidden_layers"]),
        "logprobs mode (--logprobs-mode)": ("processed_logprobs", served.get("logprobs_mode")),
        "LM head dtype (--rollout.fp32-lm-head; the server's --hf-overrides head_dtype)": (
            "float32" if fp32_head else "model",
            (served.get("hf_overrides") or {}).get("head_dtype", "model"),
        ),
    }
    if dtype != "auto":
        expected["dtype (--rollout.vllm-dtype)"] = (f"torch.{dtype}", str(served.get("dtype")))
    wrong = [
        f"{name}: trainer {ours!r}, server {theirs!r}" for name, (ours, theirs) in expected.items() if ours != theirs
    ]
    if (served.get("max_model_len") or 0) < max_model_len:
        wrong.append(f"context length: the run needs {max_model_len}, the server has {served.get('max_model_len')}")
    if not (info.get("weight_transfer_config") or {}).get("backend"):
        wrong.append("weight transfer: the server has no --weight-transfer-config")
    if wrong:
        raise SystemExit(
            f"rollout server {url} does not match this run ({'; '.join(wrong)}); restart it with the run's settings: "
            f"{how_to_start(model_path, url, max_model_len, fp32_head, dtype)}"
        )
    return info
