"""What a rollout server's workers add to vLLM: the served model's signature, read by the trainer before training.

Loaded inside ``vllm serve``'s worker processes through ``--worker-extension-cls`` (``scripts/serve_rollout.py``
passes ``common.vllm_server_extension.RolloutWorkerExtension`` on GPUs and its CPU subclass
``common.vllm_shm_transport.ShmWorkerExtension`` on CPUs) and called over dev mode's ``/collective_rpc``, so the
trainer can refuse a server that serves another architecture, vocabulary or shape
(``common.vllm_server_checks.check_server``).
"""

from __future__ import annotations


class RolloutWorkerExtension:
    """Mixed into vLLM's worker class: ``self`` is the worker."""

    def rollout_model_signature(self) -> dict:
        """The served model's class name (vLLM names it as the HF architecture), vocabulary size (unpadded), hidden
        size and number of layers."""
        model = self.model_runner.get_model()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        vocab = getattr(embed, "org_vocab_size", None) or getattr(config, "vocab_size", None)
        return {
            "architecture": type(model).__name__,
            "vocab_size": int(vocab),
            "hidden_size": int(config.hidden_size),
            "num_hidden_layers": int(config.num_hidden_layers),
        }
