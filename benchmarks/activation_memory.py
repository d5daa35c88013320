"""Measure the activation memory the planner's formula stands for: the bytes autograd saves for backward.

    python benchmarks/activation_memory.py        # a grid of small random-weight Qwen2 configs, CPU, seconds

For each config the project's own log-prob path (``common.logprobs.token_logprobs`` with grad, model in train mode,
sdpa attention as on CUDA) runs under ``torch.autograd.graph.saved_tensors_hooks``; every saved tensor's storage is
counted once (by ``untyped_storage().data_ptr()``). Parameters are not activations; the bf16 copies autocast makes of
the weights (saved transposed for the matmuls' backward, ``TBackward0``) are reported apart, since the planner counts
them as ``bf16 autocast weight copies`` (~2 bytes per parameter), not per token. With gradient checkpointing the
checkpointed layers save nothing through the hooks; what they keep is their input, added here with a forward
pre-hook on each decoder layer (and the decoder's output, which the chunked head keeps for its recomputation).
The table compares the measurement with ``common.memory.saved_bytes_per_token`` (the planner's formula).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.logprobs import token_logprobs  # noqa: E402
from common.memory import ModelShape, saved_bytes_per_token  # noqa: E402


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


def saved_bytes(model, rows: int, seq: int, checkpointing: bool, bf16: bool) -> tuple[int, int]:
    """(activation bytes, autocast weight-copy bytes) that one ``token_logprobs`` forward saves for backward.

    Rows are ``seq`` tokens wide, a quarter of them prompt, the first row left-padded as the scripts' batches are.
    """
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (rows, seq), generator=generator)
    attention_mask = torch.ones(rows, seq, dtype=torch.long)
    prompt = seq // 4
    attention_mask[0, : prompt // 2] = 0
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

    hooks = [
        layer.register_forward_pre_hook(
            lambda m, args, kwargs: record(activations, args[0] if args else kwargs["hidden_states"]), with_kwargs=True
        )
        for layer in model.model.layers
    ]
    hooks.append(model.model.norm.register_forward_hook(lambda m, args, out: record(activations, out)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                token_logprobs(model, input_ids, attention_mask, seq - prompt, 1.0, with_entropy=True, fp32_head=False)
    finally:
        for hook in hooks:
            hook.remove()
    return sum(activations.values()), sum(copies.values())


# (hidden, intermediate, layers, heads, kv_heads): widths, depths and GQA ratios the formula must cover
GRID = [(64, 160, 1, 4, 2), (64, 160, 3, 4, 4), (128, 352, 2, 8, 2), (96, 256, 2, 6, 1), (192, 512, 2, 6, 3)]


def main() -> None:
    print(
        f"{'config (h, i, L, heads, kv)':<28} {'T':>4} {'ckpt':>5} {'dtype':>5} "
        f"{'measured':>10} {'formula':>10} {'err':>6}"
    )
    for hidden, intermediate, layers, heads, kv in GRID:
        model, shape = small_model(hidden, intermediate, layers, heads, kv)
        for seq in (48, 160):
            for checkpointing in (False, True):
                for bf16 in (True, False):
                    measured, _ = saved_bytes(model, 2, seq, checkpointing, bf16)
                    formula = 2 * seq * saved_bytes_per_token(shape, seq, bf16, checkpointing)
                    print(
                        f"{str((hidden, intermediate, layers, heads, kv)):<28} {seq:>4} {checkpointing!s:>5} "
                        f"{'bf16' if bf16 else 'fp32':>5} {measured:>10} {formula:>10.0f} "
                        f"{formula / measured - 1:>+6.1%}"
                    )


if __name__ == "__main__":
    main()
