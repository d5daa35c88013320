"""Model shapes for the memory planner (``common/memory.py``), read from a ``config.json`` alone.

    shape = model_shape(local_config("Qwen/Qwen2.5-7B"))   # hidden, layers, heads, vocab, parameters: no weights
    lora_params(path, 16, ("all-linear",))                 # a LoRA's adapter parameters
    critic_params(path)                                    # ppo.py's critic: a value head in place of the LM head

Contract: every count comes from the model transformers builds from the config on the meta device (nothing is
allocated, nothing downloaded), so any architecture transformers knows is counted exactly and a tied embedding once.
``local_config`` maps the hub ids of ``LOCAL_CONFIGS`` to the folders of ``common/model_configs`` (config.json only),
which is how ``--dry-run`` plans a hub id offline. No byte counts here: those are ``common/memory_phases.py``'s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

MODEL_CONFIGS = Path(__file__).resolve().parent / "model_configs"
# hub ids whose architecture a folder of common/model_configs holds (config.json only: the planner needs no weights)
LOCAL_CONFIGS = {
    "Qwen/Qwen2.5-0.5B": "qwen2.5-0.5b",
    "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b-instruct",
    "Qwen/Qwen2.5-1.5B": "qwen2.5-1.5b",
    "Qwen/Qwen2.5-Math-1.5B": "qwen2.5-math-1.5b",
    "Qwen/Qwen2.5-7B": "qwen2.5-7b",
    "Qwen/Qwen2.5-Math-7B": "qwen2.5-math-7b",
    "PRIME-RL/Eurus-2-7B-SFT": "qwen2.5-math-7b",  # an SFT of Qwen2.5-Math-7B: the same shapes
    "Qwen/Qwen2.5-32B": "qwen2.5-32b",
    "Elliott/Qwen2.5-Math-7B-16k-think": "qwen2.5-math-7b-16k",  # Qwen2.5-Math-7B shapes, 16k positions
}


@dataclass(frozen=True)
class ModelShape:
    """What the planner reads from a ``config.json``."""

    params: int  # parameters of the causal LM (tied embeddings counted once)
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool


@functools.lru_cache(maxsize=32)
def meta_model(model_path: str) -> torch.nn.Module:
    """``model_path``'s causal LM built from its ``config.json`` on the meta device: every layer, nothing allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))


@functools.lru_cache(maxsize=32)
def model_shape(model_path: str) -> ModelShape:
    """The shape of ``model_path``'s model from its ``config.json`` alone (no weights, no tokenizer).

    Parameters are counted on a model built on the meta device (nothing allocated), so every architecture
    transformers knows is counted exactly; ``parameters()`` yields a tied embedding once.
    """
    model = meta_model(model_path)
    config = model.config
    text = config.get_text_config()
    heads = text.num_attention_heads
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()),
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        layers=text.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab=text.vocab_size,
        tied=bool(getattr(text, "tie_word_embeddings", False)),
    )


def local_config(model: str) -> str | None:
    """A local folder holding ``model``'s ``config.json``: ``model`` itself, or the folder of ``common/model_configs``
    that holds a hub id's architecture; None when there is none."""
    if (Path(model) / "config.json").is_file():
        return model
    folder = LOCAL_CONFIGS.get(model)
    return str(MODEL_CONFIGS / folder) if folder else None


@functools.lru_cache(maxsize=32)
def lora_params(model_path: str, rank: int, targets: tuple[str, ...]) -> int:
    """Parameters of rank-``rank`` adapters on ``model_path``'s linear layers named ``targets`` (last name part;
    'all-linear': every linear layer but the LM head, peft's rule): r x (in + out) per layer, counted on the meta
    device."""
    model = meta_model(model_path)
    head = model.get_output_embeddings()
    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        if targets == ("all-linear",) or name.rsplit(".", 1)[-1] in targets:
            total += rank * (module.in_features + module.out_features)
    return total


@functools.lru_cache(maxsize=32)
def critic_params(model_path: str) -> int:
    """Parameters of ppo.py's critic: ``AutoModelForTokenClassification`` with one label, built from
    ``model_path``'s config as ppo.py builds it, on the meta device. Its scalar head (hidden -> 1, with a bias)
    replaces the LM head, so an untied model's critic is vocab x hidden parameters smaller than the policy (0.545B
    at Qwen2.5-7B), while a tied one keeps its embedding and gains only the head's hidden + 1."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    with torch.device("meta"):
        critic = AutoModelForTokenClassification.from_config(AutoConfig.from_pretrained(model_path, num_labels=1))
    return sum(p.numel() for p in critic.parameters())


def decoder_matmul_params(shape: ModelShape) -> int:
    """Parameters of the decoder layers' matmul weights: L (2 H n_h d + 2 H n_kv d + 3 H I) (q and o, k and v,
    gate / up / down; biases and norms not counted): what a LoRA base holds in bf16 on CUDA."""
    attention = 2 * shape.hidden * shape.heads * shape.head_dim + 2 * shape.hidden * shape.kv_heads * shape.head_dim
    return shape.layers * (attention + 3 * shape.hidden * shape.intermediate)
