"""Measure the activation memory the planner's formula stands for: the bytes autograd saves for backward.

    python benchmarks/activation_memory.py        # a grid of small random-weight Qwen2 configs, CPU, seconds

For each config the project's own log-prob path (``common.logprobs.token_logprobs`` with grad, model in train mode,
sdpa attention as on CUDA) runs under ``torch.autograd.graph.saved_tensors_hooks``, on padded rows and packed into
one row (``common/packing.py``: one block-diagonal mask); every saved tensor's storage is counted once (by
``untyped_storage().data_ptr()``). Parameters are not activations; the bf16 copies autocast makes of the weights
(saved transposed for the matmuls' backward, ``TBackward0``) are reported apart, since the planner counts them as
``bf16 autocast weight copies`` (~2 bytes per parameter), not per token. With gradient checkpointing the
checkpointed layers save nothing through the hooks; what they keep is their input and the attention mask they were
called with (held for the recomputation), added here with a forward pre-hook on each decoder layer, and the
decoder's output. The table compares the measurement with ``common.memory.saved_bytes`` (the planner's formula).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.logprobs import token_logprobs  # noqa: E402
from common.memory import ModelShape  # noqa: E402
from common.memory import saved_bytes as formula_bytes  # noqa: E402


def small_model(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int = 997):
    """A random-weight Qwen2 causal LM (tied embeddings, sdpa attention), in train mode, and its planner shape."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    shape = ModelShape(
        params=sum(p.numel() for p in model.parameters()),
        hidden=hidden,
        intermediate=intermediate,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=hidden // heads,
        vocab=vocab,
        tied=True,
    )
    return model, shape


def batch(vocab: int, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, completion width): rows ``seq`` tokens wide, a quarter of them prompt, the first
    row left-padded as the scripts' batches are."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    attention_mask = torch.ones(rows, seq, dtype=torch.long)
    prompt = seq // 4
    attention_mask[0, : prompt // 2] = 0
    return input_ids, attention_mask, seq - prompt


def saved_bytes(model, rows: int, seq: int, checkpointing: bool, bf16: bool, packed: bool = False) -> tuple[int, int]:
    """(activation bytes, autocast weight-copy bytes) that one ``token_logprobs`` forward saves for backward, on
    ``batch``'s rows, padded or packed into one row."""
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    input_ids, attention_mask, completion_width = batch(model.config.vocab_size, rows, seq)
    activations: dict[int, int] = {}
    copies: dict[int, int] = {}

    def record(store: dict[int, int], tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            store[storage.data_ptr()] = storage.nbytes()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        is_copy = tensor.dtype == torch.bfloat16 and type(tensor.grad_fn).__name__ == "TBackward0"
        record(copies if is_copy else activations, tensor)
        return tensor

    def layer_inputs(module, args, kwargs) -> None:  # what a checkpointed layer keeps for its recomputation
        record(activations, args[0] if args else kwargs["hidden_states"])
        if checkpointing and isinstance(kwargs.get("attention_mask"), torch.Tensor):
            record(activations, kwargs["attention_mask"])

    hooks = [layer.register_forward_pre_hook(layer_inputs, with_kwargs=True) for layer in model.model.layers]
    hooks.append(model.model.norm.register_forward_hook(lambda m, args, out: record(activations, out)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                token_logprobs(
                    model,
                    input_ids,
                    attention_mask,
                    completion_width,
                    1.0,
                    with_entropy=True,
                    fp32_head=False,
                    packed=packed,
                )
    finally:
        for hook in hooks:
            hook.remove()
    return sum(activations.values()), sum(copies.values())


# (hidden, intermediate, layers, heads, kv_heads): widths, depths and GQA ratios the formula must cover
GRID = [(64, 160, 1, 4, 2), (64, 160, 3, 4, 4), (128, 352, 2, 8, 2), (96, 256, 2, 6, 1), (192, 512, 2, 6, 3)]


def formula(shape: ModelShape, rows: int, seq: int, checkpointing: bool, bf16: bool, packed: bool) -> int:
    """The planner's bytes for ``batch``'s rows: rows x seq positions under a seq-wide mask, or the packed row's N
    tokens under one N x N mask; the completion tokens scored by the head either way."""
    _, attention_mask, completion_width = batch(shape.vocab, rows, seq)
    completion = int(attention_mask[:, -completion_width:].sum())
    tokens, mask_len = (int(attention_mask.sum()),) * 2 if packed else (rows * seq, seq)
    return formula_bytes(shape, tokens, mask_len, completion, bf16, checkpointing)


def main() -> None:
    print(
        f"{'config (h, i, L, heads, kv)':<28} {'T':>4} {'ckpt':>5} {'dtype':>5} {'layout':>6} "
        f"{'measured':>10} {'formula':>10} {'err':>6}"
    )
    for hidden, intermediate, layers, heads, kv in GRID:
        model, shape = small_model(hidden, intermediate, layers, heads, kv)
        for seq in (48, 160):
            for checkpointing in (False, True):
                for bf16 in (True, False):
                    for packed in (False, True):
                        measured, _ = saved_bytes(model, 2, seq, checkpointing, bf16, packed)
                        predicted = formula(shape, 2, seq, checkpointing, bf16, packed)
                        print(
                            f"{str((hidden, intermediate, layers, heads, kv)):<28} {seq:>4} {checkpointing!s:>5} "
                            f"{'bf16' if bf16 else 'fp32':>5} {'packed' if packed else 'padded':>6} {measured:>10} "
                            f"{predicted:>10} {predicted / measured - 1:>+6.1%}"
                        )


if __name__ == "__main__":
    main()
