"""Padding-free attention for packed rows without the flash-attn package: PyTorch's own varlen kernel, registered as
a transformers attention implementation (issue 41 part 2).

    name = register_varlen()                          # 'varlen', usable as load_model's attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    layout = model_layout(ids, mask, width, packed=True)   # its inputs carry cu_seq_lens_q/k and max_length_q/k

Why: a packed micro-batch under sdpa builds one N x N block-diagonal mask per forward, and sdpa with any mask runs
without causal skipping and with K/V repeated for grouped-query heads (issue 41 measured attention at 51% of a packed
1.5B step on an H100). ``torch.nn.attention.varlen.varlen_attn`` (CUDA: FlashAttention-2 kernels inside libtorch)
takes the flat (tokens, heads, head_dim) layout and the cumulative sequence lengths, as the flash-attn package's
varlen path does, with no mask at all. Transformers' alternative, ``flex_attention``, builds a block mask from the
restarting ``position_ids`` (``masking_utils.find_packed_sequence_indices``): no N x N tensor either, but its kernel
compiles on first use; the scripts' choice between them is ``common.packing.CUDA_ATTENTION``, set by measurement
(benchmarks/mfu_check.py).

Registration (transformers 5.19): ``AttentionInterface.register`` for the forward, and an entry of
``ALL_MASK_ATTENTION_FUNCTIONS`` under the same name, since ``create_causal_mask`` looks the mask builder up by the
implementation's name. The mask builder returns None for a scoring pass (no padding mask, no cache: the packed rows,
whose sequences the kernel separates by ``cu_seq_lens``) and sdpa's mask otherwise; the forward runs sdpa on any call
without ``cu_seq_lens_q`` (the HF engine's decode with a KV cache and padded prompts runs on the same module). The
kernel: ``varlen_attn`` on CUDA; elsewhere a per-sequence causal sdpa stand-in (``per_sequence_attention``), which
runs the same wiring on the CPU (tests/test_attention.py) and is exact, not fast.

``varlen_attn``'s signature moved between torch releases (2.13: ``window_size=(-1, 0)`` for causal and
``enable_gqa``; earlier: ``is_causal``): ``_varlen_kwargs`` reads it once. FlashAttention takes bf16/fp16 only: an
fp32 call (autocast off) computes in bf16 and returns fp32.
"""

from __future__ import annotations

import functools
import inspect

import torch

VARLEN = "varlen"  # the implementation name (load_model's attn_implementation, config._attn_implementation)
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def varlen_kwargs(lengths: torch.Tensor, longest: int) -> dict:
    """The model kwargs that tell a varlen kernel where each packed sequence starts: int32 cumulative lengths
    (0, l_1, l_1 + l_2, ...) of ``lengths`` (S,), on their device (no host sync), and ``longest``, a bound on the
    longest (the kernel sizes its grid by it), for queries and keys alike: transformers' names, as its
    flash-attention path takes them."""
    cumulative = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return {"cu_seq_lens_q": cumulative, "cu_seq_lens_k": cumulative, "max_length_q": longest, "max_length_k": longest}


def per_sequence_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """The varlen kernel's stand-in off CUDA: (N, H, D) queries over (N, H_kv, D) keys and values, each sequence of
    ``cu_seq`` attending causally within itself (sdpa per sequence, K/V heads repeated for grouped queries)."""
    groups = query.shape[1] // key.shape[1]
    out = []
    bounds = cu_seq.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:  # an empty sequence
            continue
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # (heads, length, D)
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        out.append(
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1)
        )
    return torch.cat(out) if out else query.new_zeros(query.shape)


@functools.cache
def _varlen_kwargs() -> dict:
    """The keyword arguments that make this torch's ``varlen_attn`` causal and grouped-query aware."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    kwargs["_scale"] = "scale" in params  # whether the scale can be passed (else the kernel's 1/sqrt(d), the same)
    return kwargs


def _cuda_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    kwargs = dict(_varlen_kwargs())
    if kwargs.pop("_scale"):
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - query.shape[-1] ** -0.5) > 1e-6:
        raise ValueError(f"this torch's varlen_attn takes no scale, and the model's ({scale}) is not 1/sqrt(d)")
    if "enable_gqa" not in kwargs and key.shape[1] != query.shape[1]:  # an older kernel: repeat the K/V heads
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    dtype = query.dtype
    if dtype not in (torch.bfloat16, torch.float16):  # FlashAttention computes in half precision only
        query, key, value = (t.to(torch.bfloat16) for t in (query, key, value))
    out = varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)
    return out.to(dtype)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: (1, H, N, D) packed queries (keys (1, H_kv, N, D)) -> (1, N, H, D),
    through the varlen kernel when the call carries ``cu_seq_lens_q``, else sdpa with the mask it was built."""
    cu_seq_q = kwargs.get("cu_seq_lens_q")
    if cu_seq_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1 or dropout:
        raise ValueError("varlen attention takes one packed row (batch 1) and no attention dropout")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (N, heads, D)
    if q.is_cuda:
        cu_seq_k = kwargs.get("cu_seq_lens_k", cu_seq_q)
        max_q, max_k = kwargs["max_length_q"], kwargs.get("max_length_k", kwargs["max_length_q"])
        out = _cuda_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scaling)
    else:
        out = per_sequence_attention(q, k, v, cu_seq_q, scaling)
    return out.unsqueeze(0), None


def varlen_mask(**kwargs):
    """The mask builder for the 'varlen' name: none for a scoring pass (no padding mask, no cache: the kernel
    separates the packed sequences itself), sdpa's mask for anything else (decoding, padded rows)."""
    from transformers.masking_utils import sdpa_mask

    scoring = kwargs.get("attention_mask") is None and not kwargs.get("q_offset") and not kwargs.get("kv_offset")
    if scoring and kwargs.get("q_length") == kwargs.get("kv_length"):
        return None
    return sdpa_mask(**kwargs)


def register_varlen() -> str:
    """Register 'varlen' with transformers (forward and mask builder; idempotent) and return the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, varlen_mask)
    return VARLEN
