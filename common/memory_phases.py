"""The planner's byte model of one update (``common/memory.py`` sums it into a plan): what autograd saves for the
backward pass, the log-prob head's chunk, bf16 autocast's weight casts, and the three moments of an optimiser step
that can hold its peak (``update_phases``).

Activations of one micro-batch are the bytes autograd saves for backward, counted with ``saved_tensors_hooks`` on
the project's own log-prob path (``benchmarks/activation_memory.py``, padded and packed; ``tests/test_memory.py``
holds the formula to the measurement). Per token and layer ``34h + 8i + 4·heads + 8 + 2T`` bytes under bf16 autocast
(``40h + 16i + 4·heads + 8 + 4T`` in fp32), h the hidden size, i the MLP width, T the width of the attention mask's
rows (sdpa converts the mask to the query dtype in every layer); plus ``12h + 8·head_dim + 12`` per token outside the
layers, and ``4h + 40`` per completion token (the head's gathered fp32 input and its indices). With gradient
checkpointing: each layer's input (4h), the boolean mask the layers keep for their recomputation (T bytes per
token), and one layer recomputed at a time in the backward pass. ``mask_len`` 0 is flash-attention's varlen path
(no mask; not measured: flash-attn does not run on the CPU).

Contract: pure arithmetic on a ``ModelShape`` and counts, in bytes; nothing here reads flags or a card.
"""

from __future__ import annotations

from common.logprobs import LOGPROB_CHUNK
from common.memory_shapes import ModelShape


def layer_bytes_per_token(shape: ModelShape, mask_len: int, bf16: bool) -> int:
    """Bytes one decoder layer saves for backward per token, under attention masks ``mask_len`` keys wide.

    Measured (``benchmarks/activation_memory.py``) for the sdpa attention the scripts use on CUDA:
    ``34h + 8i + 4·heads + 8 + 2T`` under bf16 autocast (fp32 residual and norms, bf16 casts of each projection's
    input, q/k/v with k and v expanded to every head, the MLP's three i-wide outputs), ``40h + 16i + 4·heads + 8 + 4T``
    in fp32. The T term (``mask_len``) is the attention mask, which sdpa converts to the query dtype in every layer:
    one row of T keys per token, so T x T per padded row of T tokens, and one N x N block-diagonal mask for a packed
    row of N tokens. ``mask_len`` 0: no mask (flash-attention's varlen path; assumed, not measured here).
    """
    h, i = shape.hidden, shape.intermediate
    if bf16:
        return 34 * h + 8 * i + 4 * shape.heads + 8 + 2 * mask_len
    return 40 * h + 16 * i + 4 * shape.heads + 8 + 4 * mask_len


def saved_bytes_per_token(shape: ModelShape, mask_len: int, bf16: bool, checkpointing: bool) -> int:
    """Bytes held for backward per token once the forward is done: every layer's share, plus ``12h + 8·head_dim +
    12`` outside the layers (the final norm and its output, rotary tables, token ids). With checkpointing each layer
    keeps only its fp32 input (4h), the rotary tables stay inside the checkpoints, and the boolean attention mask
    the layers were called with (``mask_len`` bytes per token, built once) is kept for their recomputation."""
    outside = 12 * shape.hidden + 12
    if checkpointing:
        return shape.layers * 4 * shape.hidden + outside + mask_len
    return shape.layers * layer_bytes_per_token(shape, mask_len, bf16) + outside + 8 * shape.head_dim


def head_input_bytes(shape: ModelShape, completion_tokens: int) -> int:
    """Bytes the log-prob path saves per completion token, checkpointing or not: the fp32 hidden state that predicts
    it, gathered for the chunked head (4h), and the int64 indices that take it there and back (40 packed, 32 padded;
    ``common/packing.py``'s layout). Measured with the layers' bytes (``benchmarks/activation_memory.py``)."""
    return completion_tokens * (4 * shape.hidden + 40)


def value_head_bytes(shape: ModelShape, tokens: int, completion_tokens: int, bf16: bool) -> int:
    """What a critic saves in place of ``head_input_bytes``: ppo.py's critic (``AutoModelForTokenClassification``,
    a hidden -> 1 value head, ``critic_values``) scores every position, not only the completion tokens, so it keeps
    its head's input and the final norm's tensors per token: 6h bytes under bf16 autocast, 8h in fp32, beyond
    ``saved_bytes_per_token``; plus 24 bytes of int64 indices per completion token (those that pick the values out).
    Measured with the layers' bytes on the critic's own path (``tests/test_memory.py`` holds it to the hooks)."""
    return tokens * (6 if bf16 else 8) * shape.hidden + 24 * completion_tokens


def saved_bytes(
    shape: ModelShape,
    tokens: int,
    mask_len: int,
    completion_tokens: int,
    bf16: bool,
    checkpointing: bool,
    value_head: bool = False,
) -> int:
    """Bytes held for backward once one micro-batch's forward is done: ``tokens`` positions (rows x padded length,
    or a packed row's tokens), ``completion_tokens`` of them scored by the head: the log-prob head, or with
    ``value_head`` a critic's scalar head (``value_head_bytes``)."""
    per_token = saved_bytes_per_token(shape, mask_len, bf16, checkpointing)
    if value_head:
        return tokens * per_token + value_head_bytes(shape, tokens, completion_tokens, bf16)
    return tokens * per_token + head_input_bytes(shape, completion_tokens)


def activation_bytes(
    shape: ModelShape,
    tokens: int,
    mask_len: int,
    completion_tokens: int,
    bf16: bool,
    checkpointing: bool,
    value_head: bool = False,
) -> int:
    """Peak activation bytes of one micro-batch: what the forward saves (``saved_bytes``), plus, with checkpointing,
    the one layer the backward pass recomputes at a time."""
    recomputed = tokens * (layer_bytes_per_token(shape, mask_len, bf16) + 8 * shape.head_dim) if checkpointing else 0
    return saved_bytes(shape, tokens, mask_len, completion_tokens, bf16, checkpointing, value_head) + recomputed


def logprob_head_bytes(shape: ModelShape, completion_tokens: int) -> float:
    """Peak of the chunked fp32 log-prob head: 4 buffers of chunk x vocab fp32 (logits, log-softmax, and their
    gradients in the backward pass; ``common/logprobs.py``), a chunk being ``LOGPROB_CHUNK`` completion tokens (or
    all of them, when fewer) whatever the number of rows."""
    return 4 * min(LOGPROB_CHUNK, completion_tokens) * shape.vocab * 4


def autocast_copy_bytes(params: int, layers: int, full_models: int, lora: bool, checkpointing: bool) -> float:
    """Bytes of bf16 weight casts under autocast: 2 per parameter of each fully trained model (autocast caches the
    cast of every trainable weight for the whole forward), and for a frozen LoRA base, whose casts are not cached,
    only saved for backward: 2 per parameter without checkpointing, one layer's with it."""
    frozen = (2 * params / layers if checkpointing else 2 * params) if lora else 0.0
    return full_models * 2 * params + frozen


def update_phases(
    resident: float,
    gradients: float,
    copies: float,
    saved: float,
    recomputed: float,
    head: float,
    head_gradient: float,
    transient: float = 0.0,
    adamw_temporary: bool = True,
) -> dict[str, float]:
    """Bytes at the three moments of an optimiser step that can hold its peak (measured phase by phase on an H100,
    ``benchmarks/gpu_check.py``'s learner rows):

    * ``forward``: the log-prob head's backward, which runs first: every saved activation is still held, the head's
      chunk buffers are live and only the LM head's weight gradient exists. Without checkpointing the autocast
      copies are held too (the graph keeps them); with it they go when the forward's autocast region ends, but they
      were held beside the growing saved inputs during the forward, so they are counted either way.
    * ``backward``: its end, every gradient allocated, and the embedding's gradient being added into the LM head's
      when they are tied (two more head-sized buffers); the saved activations (with checkpointing, the layers'
      inputs and one recomputed layer) are counted as if they outlived the gradients (an upper bound: they are freed
      as it goes).
    * ``step``: AdamW (``torch.optim.AdamW``, foreach on CUDA) allocates one temporary as large as the trained
      state's gradients (its ``_foreach_sqrt`` of the second moments) beside the gradients; the fused kernel the
      scripts now step with on CUDA (``common.learner_speed.fuse_adamw``; ``adamw_temporary`` False) updates in place.
      The H100 rows of benchmarks/results/gpu/ were measured with foreach.

    These are one trained model's moments. A script that trains two (ppo.py's critic, prime.py's PRM, each updated
    before the policy) steps each and frees its gradients (``zero_grad(set_to_none=True)``) before the next one's
    forward, so a plan takes the largest moment over both models' phases, never their sum; a critic has no log-prob
    head (``head`` and ``head_gradient`` 0).

    ``resident``: what stays throughout (weights, moments, frozen copies, a sleeping engine, CUDA's context);
    ``gradients``: the trained parameters' gradients; ``transient``: gathered FSDP units (forward and backward)."""
    return {
        "forward": resident + copies + saved + head + head_gradient + transient,
        "backward": resident + gradients + saved + recomputed + 2 * head_gradient + transient,
        "step": resident + (2 if adamw_temporary else 1) * gradients,
    }
