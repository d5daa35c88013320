"""Per-token log-probs of completions under a model: the trainer's side of every algorithm.

    logprobs, entropy = token_logprobs(model, input_ids, attention_mask, completion_width, temperature, ...)

Rows are ``[left-padded prompt | right-padded completion]``, run padded or packed (``common/packing.py``); the result
is (B, completion_width), the log-prob of each completion token under softmax(logits / temperature) in fp32, with the
LM head optionally in fp32 as well (the sampler/trainer gap fix of MiniMax-M1 and ScaleRL). No (B, T, vocab) tensor
is ever kept.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.utils.checkpoint

from common.attention import VARLEN
from common.head_precision import head_logprobs, resolve_head
from common.packing import micro_batches, model_layout
from common.sharding import reshard
from common.weight_export import unwrap_model

LOGPROB_CHUNK = 1024  # completion tokens per LM-head + log-softmax chunk in token_logprobs (any number of rows)
# config fields (of the text config) through which an architecture post-processes its logits after the LM head
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")
# per model (the unwrapped module): whether its LM head alone reproduces its own last logits, with the head's hooks
# when checked. Checked on the model's first forward here (again if the head's hooks change): it is a property of
# the architecture, and the check is a device sync
_HEAD_REPRODUCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_width: int,
    temperature: float,
    with_entropy: bool = False,
    chunk_size: int = LOGPROB_CHUNK,
    fp32_head: bool | str = True,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (B, T) of each row's last ``completion_width`` tokens: fp32 log-softmax of logits / T.

    The trainer's side of every script (old, reference and current log-probs). The model runs once (through any
    DDP wrapper) and its final hidden states are taken from the decoder; the LM head and the log-softmax then run on
    the completion tokens only, ``chunk_size`` tokens at a time whatever the number of rows, and, when gradients are
    on, are recomputed per chunk in the backward pass, so no (B, T, vocab) tensor is kept: not the logits, not their
    log-softmax (in fp32, 2 x 4 bytes x B x T x vocab: ~40 GB for 8 x 4k tokens of a 152k vocabulary).

    ``packed``: the rows run as one flat padding-free sequence (``common.packing.model_layout``), else as padded rows
    cut to the columns some row attends to (a micro-batch of short rows pays for its own longest row). The result is
    the same (B, T) layout either way, 0 where a row has no completion token.
    ``fp32_head``: the LM head runs at fp32 accuracy (autocast off) even when the body runs under bf16 autocast:
    bf16x3 on tensor cores on CUDA (three bf16 GEMMs with fp32 output, ~1e-5 nats from fp64), a plain fp32 matmul
    elsewhere (``common.head_precision.resolve_head``); off, it runs in the caller's autocast dtype; a name of
    ``common.head_precision.PRECISIONS`` picks that precision (benchmarks). A bf16 head is the main source of the
    sampler/trainer log-prob gap (MiniMax-M1 §3.3, ScaleRL); the scripts set it from ``RolloutConfig.fp32_lm_head``,
    as vLLM's. The entropy comes from the same pass.
    Architectures that post-process logits (softcapping, logit scales: ``LOGIT_POSTPROCESSING``, or any model whose
    head alone does not reproduce its own last-position logits) use the model's own logits instead, and then keep
    them for the backward pass. ``with_entropy`` adds the detached per-token entropy of the same distribution.
    """
    inner = unwrap_model(model)
    # a varlen kernel (common/attention.py) runs padded rows as one packed row: causal, no mask, the same (B, T)
    packed = packed or getattr(inner.config, "_attn_implementation", None) == VARLEN
    layout = model_layout(input_ids, attention_mask, completion_width, packed)

    def from_own_logits() -> tuple[torch.Tensor, torch.Tensor | None]:  # the model's own (post-processed) logits
        columns, place = layout.source[1].unique(return_inverse=True)  # logits only where a completion token is next
        logits = model(**layout.inputs, logits_to_keep=columns).logits[layout.source[0], place]
        return _scattered(
            _chunked(_logprobs_from_logits, logits, layout.token_ids, temperature, with_entropy, chunk_size), layout
        )

    text_config = inner.config.get_text_config()
    if any(getattr(text_config, name, None) not in (None, 1, 1.0) for name in LOGIT_POSTPROCESSING):
        return from_own_logits()
    # the decoder's output (last_hidden_state), caught on the way through the full model's forward (and any wrapper's)
    hidden = []
    hook = inner.get_decoder().register_forward_hook(lambda module, args, output: hidden.append(output[0]))
    try:
        last_logits = model(**layout.inputs, logits_to_keep=1).logits
    finally:
        hook.remove()
    head = inner.get_output_embeddings()
    if not head_reproduces(inner, head, hidden[-1], last_logits):
        return from_own_logits()
    device_type = input_ids.device.type
    if fp32_head is True and not torch.is_autocast_enabled(device_type) and head.weight.dtype == torch.float32:
        precision = "fp32"  # an fp32 model outside autocast: its own head is fp32 already (the HF engine's as well)
    else:
        precision = resolve_head(fp32_head, device_type)
    head_fn = functools.partial(_logprobs_from_hidden, weight=head.weight, bias=head.bias, precision=precision)
    selected = hidden[-1][layout.source]  # (M, hidden): the positions that predict a completion token
    return _scattered(_chunked(head_fn, selected, layout.token_ids, temperature, with_entropy, chunk_size), layout)


def head_reproduces(
    inner: torch.nn.Module, head: torch.nn.Module, hidden: torch.Tensor, last_logits: torch.Tensor
) -> bool:
    """Whether ``head`` alone, on the decoder's output ``hidden``, reproduces the model's own last logits (else the
    model post-processes them): checked on the first call for ``inner`` and remembered (``_HEAD_REPRODUCES``), so the
    per-micro-batch forward pays no device sync for it."""
    # checked again if the head gains or loses a hook (a hook may post-process the logits)
    hooks = (id(head), tuple(head._forward_hooks), tuple(head._forward_pre_hooks))
    known = _HEAD_REPRODUCES.get(inner)
    if known is None or known[0] != hooks:
        with torch.no_grad():
            ours = torch.nn.functional.linear(hidden[:, -1:], head.weight, head.bias)
            same = ours.shape == last_logits.shape and torch.allclose(
                ours.float(), last_logits.float(), rtol=1e-2, atol=1e-2
            )
        known = _HEAD_REPRODUCES[inner] = (hooks, same)
    return known[1]


def token_logprobs_batched(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_width: int,
    temperature: float,
    micro_batch_size: int,
    fp32_head: bool | str = True,
    micro_batch_tokens: int = 0,
) -> torch.Tensor:
    """``token_logprobs`` over a whole batch without gradients (old, reference and PRM log-probs). Returns (B, T) in
    the input's row order.

    ``micro_batch_tokens`` 0: ``micro_batch_size`` rows per forward, rows of similar length together (each forward
    pays for its own longest row); otherwise packed forwards of at most that many tokens (``common.packing``; on
    several processes every rank runs the same number, so call it on every rank).
    An FSDP2-sharded model (``--fsdp``) keeps its root's parameters gathered after a forward (the LM head runs
    outside it); with no backward to free them they are freed here, so a reference model does not hold its
    embeddings and head in full, and an optimiser step cannot leave a stale gathered copy behind."""
    order = attention_mask.sum(-1).argsort(stable=True)
    packed = micro_batch_tokens > 0
    result = torch.zeros(input_ids.shape[0], completion_width, device=input_ids.device)
    for rows, _ in micro_batches(order, attention_mask, micro_batch_size, micro_batch_tokens):
        result[rows] = token_logprobs(
            model,
            input_ids[rows],
            attention_mask[rows],
            completion_width,
            temperature,
            fp32_head=fp32_head,
            packed=packed,
        )[0].float()
    reshard(model)
    return result


def _scattered(outputs: tuple[torch.Tensor, torch.Tensor | None], layout) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(M,) per-token log-probs (and entropies) back to the (B, T) layout, zeros where no completion token is."""
    return tuple(None if t is None else layout.scatter(t) for t in outputs)


def _chunked(
    fn, inputs: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply ``fn`` to ``chunk_size`` tokens (rows of ``inputs`` (M, ...) and ``targets`` (M,)) at a time, each chunk
    recomputed in the backward pass (with grad)."""
    recompute = torch.is_grad_enabled() and inputs.requires_grad
    parts = []
    for start in range(0, targets.shape[0], chunk_size):
        args = (inputs[start : start + chunk_size], targets[start : start + chunk_size], temperature, with_entropy)
        parts.append(torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args))
    if not parts:  # no completion token at all
        return inputs.new_zeros(0, dtype=torch.float32), (
            inputs.new_zeros(0, dtype=torch.float32) if with_entropy else None
        )
    token_lp = torch.cat([lp for lp, _ in parts])
    return token_lp, (torch.cat([ent for _, ent in parts]) if with_entropy else None)


def _logprobs_from_hidden(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    precision: str | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's log-probs (and entropy) from the decoder's output: the head at ``precision``
    (``common.head_precision``), or None: the model's own head in the caller's autocast dtype."""
    if precision is not None:
        return head_logprobs(hidden, weight, bias, targets, temperature, precision, with_entropy)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return _logprobs_from_logits(logits, targets, temperature, with_entropy)


def _logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1).detach() if with_entropy else None
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy
