"""Micro-batches under a token budget, and how a micro-batch's rows are laid out for the model.

    for rows, sync in micro_batches(mb_rows, attention_mask, args.micro_batch_size, args.micro_batch_tokens): ...
    layout = model_layout(input_ids[rows], attention_mask[rows], completion_width, packed=True)
    hidden = model(**layout.inputs) ...; per_token = layout.scatter(f(hidden[layout.source]))

Rows are ``[left-padded prompt | right-padded completion]`` (``bookkeeping.pack_rollout``). Two ways to batch them:

* **padded** (``--micro-batch-size N``, ``--micro-batch-tokens 0``): N rows per forward, each as long as the
  micro-batch's longest row; compute and memory follow rows x longest row.
* **packed** (``--micro-batch-tokens N``): the sequences of a minibatch go into bins of at most N tokens (prompt and
  completion, padding dropped) by first-fit decreasing; each bin is one flat row whose ``position_ids`` restart at 0
  for every sequence, passed with ``attention_mask=None`` and ``use_cache=False``. transformers 5.19 then builds a
  block-diagonal causal mask from the restarts (``masking_utils.find_packed_sequence_indices``) for eager, sdpa and
  flex attention, and flash-attention takes the varlen path; no token attends across a sequence boundary.

Either way the per-sequence (B, T) layout comes back (``Layout.scatter``), so no loss changes and no normaliser
depends on how sequences were packed. Attention implementations that ignore ``position_ids`` restarts (a model whose
attention takes only a 4D mask, or any custom one) cannot pack: ``PACKABLE_ATTENTION`` lists those that can.

Several processes: FSDP2 issues collectives in every forward and backward, so every rank must run the same number of
micro-batches. ``micro_batches`` all-reduces the largest bin count and splits the heaviest bins of the ranks with
fewer until they match (verl's ``rearrange_micro_batches`` does the same with balanced partitions).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.attention import varlen_kwargs

# attention implementations (transformers' ``_attn_implementation``) that separate packed sequences by their
# restarting position_ids: eager/sdpa/flex through masking_utils' packed-sequence mask, flash-attention through varlen
PACKABLE_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


# The kernel CUDA runs use without the flash-attn package, to be chosen by measurement (benchmarks/mfu_check.py's
# attention=varlen / attention=flex variants, issue 41 part 2): 'varlen' (common/attention.py: PyTorch's
# FlashAttention-2 varlen kernel; padded micro-batches then run packed too, a causal kernel with no mask), or
# 'flex_attention' (transformers' document block mask; packed micro-batches only), or 'sdpa' (a dense mask). Not
# measured on a GPU yet: 'sdpa', the choice every committed GPU figure was measured with.
CUDA_ATTENTION = "sdpa"
# implementations that take packed rows with no N x N mask (the planner counts no mask term for them)
MASKLESS_ATTENTION = ("flash_attention_2", "flash_attention_3", "varlen", "flex_attention")


def attention_implementation(
    device_type: str, packed: bool, half_precision: bool = True, cuda_attention: str | None = None
) -> str:
    """The trainer's attention kernel. CPU: eager (sdpa's bf16 backward is several times slower there). CUDA: sdpa,
    except packed micro-batches computed in bf16 (``half_precision``: autocast or bf16 weights; flash-attention
    rejects fp32) with the flash-attn package installed, which take flash-attention's varlen path (no N x N mask);
    without it, ``cuda_attention`` (default ``CUDA_ATTENTION``): 'varlen' for bf16 runs, padded or packed (the
    padded rows run packed, ``common.logprobs``), 'flex_attention' for packed runs; packed under sdpa or eager
    builds a dense block-diagonal N x N mask, which the planner counts.

    The choice is the whole module's (``load_model``'s ``attn_implementation``), so the HF engine decodes on
    flash-attention too: it runs its forwards under the trainer's autocast (``common.rollout.decode_autocast``, bf16
    autocast on an fp32 flash-attention module when none is given), never in fp32, which flash-attn rejects; on
    'varlen', a decode (padding mask, KV cache) runs sdpa (``common.attention``)."""
    if device_type != "cuda":
        return "eager"
    if packed and half_precision and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    kernel = cuda_attention or CUDA_ATTENTION
    if kernel == "varlen" and half_precision:
        return kernel
    return kernel if kernel == "flex_attention" and packed else "sdpa"


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` in bins of at most ``budget`` total: longest first, each into the first bin it fits.

    Deterministic (ties keep index order); a length over ``budget`` is a ValueError naming it."""
    too_long = [i for i, n in enumerate(lengths) if n > budget]
    if too_long:
        raise ValueError(f"sequence {too_long[0]} has {lengths[too_long[0]]} tokens, over the budget of {budget}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def split_to_count(bins: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """``bins`` split until there are ``count`` of them: the heaviest bin of two or more sequences is halved by
    alternating its sequences (longest first), so each half stays within the budget and the loads even out.

    ValueError when fewer sequences than ``count`` exist (each bin needs one)."""
    if count > len(lengths):
        raise ValueError(f"cannot make {count} micro-batches from {len(lengths)} sequences")
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        heaviest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        ordered = sorted(heaviest, key=lambda i: -lengths[i])
        bins.remove(heaviest)
        bins += [ordered[0::2], ordered[1::2]]
    return bins


def micro_batches(
    rows: torch.Tensor, attention_mask: torch.Tensor, micro_batch_size: int, micro_batch_tokens: int = 0
) -> list[tuple[torch.Tensor, bool]]:
    """``(rows of one forward/backward, sync)`` pairs covering ``rows`` (a minibatch's row indices) once each.

    ``micro_batch_tokens`` 0: consecutive slices of ``micro_batch_size`` rows, in the given order (sort by length
    first so that similar lengths share a micro-batch). Otherwise: first-fit-decreasing bins of at most
    ``micro_batch_tokens`` tokens (``attention_mask`` counts each row's prompt and completion tokens), and as many
    bins on every process as on the one that needs the most (an all-reduce when torch.distributed is initialised:
    call it on every rank). ``sync`` is True on the last pair: its backward is where DDP all-reduces gradients.
    """
    if micro_batch_tokens <= 0:
        parts = list(rows.split(micro_batch_size))
    else:
        lengths = attention_mask[rows].sum(-1).tolist()
        bins = first_fit_decreasing(lengths, micro_batch_tokens)
        count = len(bins)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            counts = torch.tensor([count], device=attention_mask.device)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
            count = int(counts.item())
        bins = split_to_count(bins, lengths, count)
        parts = [rows[torch.tensor(b, device=rows.device)] for b in bins]
    return [(part, i == len(parts) - 1) for i, part in enumerate(parts)]


@dataclass
class Layout:
    """A micro-batch as the model sees it, and the way back to per-sequence (B, T) tensors.

    ``inputs``: keyword arguments for the model's forward. ``source``: (row, column) in the model's output of the
    position just before each completion token (the one that predicts it), M positions in all. ``target``: the same
    M tokens' (row, column) in the (B, T) result; ``token_ids``: their ids (M,)."""

    inputs: dict
    source: tuple[torch.Tensor, torch.Tensor]
    target: tuple[torch.Tensor, torch.Tensor]
    token_ids: torch.Tensor
    shape: tuple[int, int]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(M, ...) values of the completion tokens -> (B, T, ...), zeros elsewhere (differentiable)."""
        out = values.new_zeros(self.shape + tuple(values.shape[1:]))
        return out.index_put(self.target, values)


def model_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int, packed: bool) -> Layout:
    """How to run ``[left-padded prompt | right-padded completion]`` rows (B, P + W) through a causal LM.

    ``packed`` False: the rows themselves, cut to the columns some row attends to, with ``position_ids`` from the
    attention mask (left padding shifts nothing). True: one flat row (1, Σ tokens), padding dropped, positions
    restarting at each sequence, ``attention_mask=None`` (transformers detects packing only without a mask and
    without a cache). Completion tokens are those in the last ``completion_width`` columns that are attended.
    """
    batch, width = input_ids.shape
    prompt_width = width - completion_width
    mask = attention_mask.bool()
    rows, cols = mask[:, prompt_width:].nonzero(as_tuple=True)  # completion tokens, row-major
    token_ids = input_ids[:, prompt_width:][rows, cols]
    target = (rows, cols)
    if packed:
        flat_index = mask.flatten().cumsum(0).view(batch, width) - 1  # each kept token's place in the flat row
        positions = (mask.cumsum(-1) - 1)[mask]  # restart at 0 in every sequence
        inputs = {
            "input_ids": input_ids[mask].unsqueeze(0),
            "position_ids": positions.unsqueeze(0),
            "attention_mask": None,
            # where each sequence starts, for a varlen kernel (common/attention.py; flash-attention takes the same
            # names); the row width bounds the longest sequence without a host sync. Other kernels ignore them.
            **varlen_kwargs(mask.sum(-1), width),
        }
        before = flat_index[:, prompt_width:][rows, cols] - 1
        source = (torch.zeros_like(before), before)
    else:
        used = mask.any(0).nonzero().squeeze(-1)
        first, last = used[[0, -1]].tolist() if used.numel() else (prompt_width - 1, prompt_width)  # one host read
        start, end = min(first, prompt_width - 1), max(last + 1, prompt_width + 1)
        ids, kept_mask = input_ids[:, start:end], attention_mask[:, start:end]
        inputs = {
            "input_ids": ids,
            "attention_mask": kept_mask,
            "position_ids": (kept_mask.cumsum(-1) - 1).clamp(min=0),
        }
        source = (rows, cols + prompt_width - start - 1)
    inputs["use_cache"] = False  # a scoring pass: no KV cache (and with one, packed sequences would see each other)
    return Layout(inputs=inputs, source=source, target=target, token_ids=token_ids, shape=(batch, completion_width))
