"""The LM head's matmul at a chosen precision, on tensor cores where a GPU has them, with bf16 gradients.

    logits = head_logits(hidden, weight, "bf16x3")   # (M, vocab) fp32 logits of hidden (M, H) under weight (V, H)
    logprobs, entropy = head_logprobs(hidden, weight, None, targets, 1.0, "bf16x3", with_entropy=True)

Why (issue 41; MiniMax-M1 §3.3 traced its sampler/trainer log-prob gap to the head): a bf16 head rounds the logits,
an fp32 one runs on CUDA cores at ~55 TFLOP/s against ~990 for bf16 on an H100. The precisions, with the mean
|log-prob error| against fp64 measured at the Qwen2.5-1.5B head's shape (issue 41) and, in brackets, at the small
shape of tests/test_head_precision.py on this CPU:

    fp32            fp32 operands and accumulation (CUDA cores)                          1.2e-6   [1.6e-6]
    bf16x3          hi + lo bf16 split of both operands, three bf16 GEMMs, fp32 output   1.0e-5   [1.1e-5]
    tf32            TF32 operands (10-bit mantissa), fp32 accumulation (CPU: emulated)   6.6e-4   [8.8e-4]
    bf16-fp32-out   bf16 operands, fp32 accumulation and output (vLLM's fp32 head)       5.5e-3   [7.5e-3]
    bf16            bf16 operands and bf16 logits (the CUDA default today)               1.3e-2   [1.6e-2]

bf16x3: x = hi + lo with hi = bf16(x), lo = bf16(x - hi), so each operand keeps 16 mantissa bits; the product is
hi·hi + hi·lo + lo·hi, each a bf16 GEMM accumulated in fp32; the dropped lo·lo term is ~2^-16 of it.
bf16-fp32-out and bf16x3 are a custom ``autograd.Function``: ``torch.mm(a, b, out_dtype=torch.float32)``
(``aten::mm.dtype``) has no derivative and no CPU kernel (torch 2.13), so the forward calls it on CUDA and, as a
stand-in elsewhere, ``a.float() @ b.float()`` on the bf16-rounded operands (bf16 x bf16 products are exact in fp32:
the same numbers up to accumulation order). The backward runs in bf16: the incoming fp32 gradient is rounded to bf16
and both gradients are bf16 GEMMs against the hi parts (autograd casts them to the inputs' dtypes).

Autocast is off inside: each precision is exactly what its name says, whatever the caller's autocast. The weight's
bf16 parts are computed once per weight version (``weight._version``: an optimiser step bumps it) and reused by every
chunk of a forward pass and by its recomputation: one (bf16x3: two) extra V x H bf16 copies held, ~0.47 GB each for
Qwen2.5-1.5B's head.

Wired into ``common.logprobs.token_logprobs`` and the HF engine's decode (``common/rollout.py``) through
``resolve_head``: ``--rollout.fp32-lm-head`` on (``use_fp32_head``) is ``FP32_HEAD[device type]``, bf16x3 on CUDA
(tensor cores, within ~1e-5 nats of fp64) and a true fp32 matmul elsewhere (the CPU: exact, and the tiny default's
metrics unchanged); off is the model's own head in the caller's autocast dtype (bf16 logits on CUDA). The CUDA
default stays off on both sides (the trainer's head matches what the sampler computes; vLLM's fp32 head on CUDA is
bf16-fp32-out, ``torch.mm(bf16, bf16, out_dtype=float32)``: docs/correction.md, "Which LM head").
"""

from __future__ import annotations

import contextlib
import weakref

import torch

PRECISIONS = ("fp32", "bf16x3", "tf32", "bf16-fp32-out", "bf16")
# the precision of an fp32 head (--rollout.fp32-lm-head on) by device type: tensor cores on CUDA, a real fp32 matmul
# elsewhere (any other device type: fp32)
FP32_HEAD = {"cuda": "bf16x3"}
_parts_cache: dict = {}  # the last weight's bf16 parts: {"weight": weakref, "version": int, "split": bool, "parts"}


def resolve_head(fp32_head: bool | str, device_type: str) -> str | None:
    """The head's precision for a ``fp32_head`` setting on ``device_type``: True is ``FP32_HEAD``'s (bf16x3 on CUDA,
    fp32 elsewhere), a name of ``PRECISIONS`` is itself, False is None (the model's own head in the caller's
    autocast dtype)."""
    if fp32_head is False:
        return None
    if fp32_head is True:
        return FP32_HEAD.get(device_type, "fp32")
    if fp32_head not in PRECISIONS:
        raise ValueError(f"unknown head precision {fp32_head!r}; one of {PRECISIONS}")
    return fp32_head


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(M, K) @ (K, N) of bf16 operands with fp32 accumulation and an fp32 result: tensor cores on CUDA
    (``aten::mm.dtype``), else the exact-product stand-in ``a.float() @ b.float()``."""
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) in bf16 with hi + lo = x to ~16 mantissa bits: hi = bf16(x), lo = bf16(x - hi)."""
    hi = x.to(torch.bfloat16)
    return hi, (x.float() - hi.float()).to(torch.bfloat16)


def weight_parts(weight: torch.Tensor, split: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight's bf16 (hi, lo) parts (lo None unless ``split``), cached for the weight's current version."""
    cached = _parts_cache
    hit = cached and cached["weight"]() is weight and (cached["version"], cached["split"]) == (weight._version, split)
    if not hit:  # one weight at a time (a weak reference: a freed weight, even at the same address, never hits)
        cached.clear()
        with torch.no_grad():
            parts = split_bf16(weight.detach()) if split else (weight.detach().to(torch.bfloat16), None)
        cached.update(weight=weakref.ref(weight), version=weight._version, split=split, parts=parts)
    return cached["parts"]


class Bf16HeadMatmul(torch.autograd.Function):
    """hidden (M, H) @ weight (V, H)^T in bf16 GEMMs with fp32 output (``split``: bf16x3), bf16 gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, w_hi, w_lo, split):
        h_hi, h_lo = split_bf16(hidden) if split else (hidden.to(torch.bfloat16), None)
        logits = mm_fp32_out(h_hi, w_hi.t())
        if split:  # hi·lo + lo·hi; lo·lo (~2^-16 of the product) is dropped
            logits = logits + mm_fp32_out(h_hi, w_lo.t()) + mm_fp32_out(h_lo, w_hi.t())
        ctx.save_for_backward(h_hi, w_hi)
        return logits

    @staticmethod
    def backward(ctx, grad):
        h_hi, w_hi = ctx.saved_tensors
        g = grad.to(torch.bfloat16)
        grad_hidden = g @ w_hi if ctx.needs_input_grad[0] else None
        grad_weight = g.t() @ h_hi if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to TF32's 10 mantissa bits (to nearest, ties to even): the operands TF32 tensor cores see.
    Differentiable as the identity (the rounding's own derivative is zero almost everywhere)."""
    with torch.no_grad():
        bits = x.detach().float().contiguous().view(torch.int32)
        rounded = ((bits + ((bits >> 13) & 1) + 0xFFF) & ~0x1FFF).view(torch.float32)
    return x.float() + (rounded - x.detach().float())


@contextlib.contextmanager
def _tf32_matmuls():
    """CUDA fp32 matmuls on TF32 tensor cores for the duration (the global setting restored afterwards)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
        before, matmul.fp32_precision = matmul.fp32_precision, "tf32"
        try:
            yield
        finally:
            matmul.fp32_precision = before
    else:
        before, matmul.allow_tf32 = matmul.allow_tf32, True
        try:
            yield
        finally:
            matmul.allow_tf32 = before


def head_logits(
    hidden: torch.Tensor, weight: torch.Tensor, precision: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits (M, V) of ``hidden`` (M, H) under the head ``weight`` (V, H) at ``precision`` (``PRECISIONS``): fp32,
    except 'bf16', whose logits are bf16 as autocast would leave them."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown head precision {precision!r}; one of {PRECISIONS}")
    with torch.autocast(hidden.device.type, enabled=False):
        if precision in ("bf16-fp32-out", "bf16x3"):
            split = precision == "bf16x3"
            w_hi, w_lo = weight_parts(weight, split)
            logits = Bf16HeadMatmul.apply(hidden, weight, w_hi, w_lo, split)
        elif precision == "bf16":
            logits = torch.nn.functional.linear(hidden.to(torch.bfloat16), weight.to(torch.bfloat16))
        elif precision == "tf32" and hidden.device.type != "cuda":  # no TF32 here: its operand rounding, then fp32
            logits = torch.nn.functional.linear(round_tf32(hidden), round_tf32(weight))
        else:  # the bias inside the matmul, as the head's own fp32 path always did (bit for bit)
            with _tf32_matmuls() if precision == "tf32" else contextlib.nullcontext():
                return torch.nn.functional.linear(
                    hidden.float(), weight.float(), None if bias is None else bias.float()
                )
        return logits if bias is None else logits + bias.to(logits.dtype)


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    precision: str,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (M,) of ``targets`` under softmax(logits / temperature) in fp32, logits from
    ``head_logits``; ``with_entropy``: the detached entropy (M,) of the same distribution, from the same pass."""
    logprobs = torch.log_softmax(head_logits(hidden, weight, precision, bias).float() / temperature, dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1).detach() if with_entropy else None
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy
