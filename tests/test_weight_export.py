"""The one weight-export path (common/weight_export.py): what every engine loads from the trainer's model.

* A plain model, wrapped or not, in its own dtype or cast to the engine's: the very pairs the engines sent before
  (names, dtypes, shapes, values), tied weights once.
* A LoRA policy: the base model's names with W + (α/r) B A, equal to the old merge for an fp32 base, checked by hand
  on a one-weight linear; a bf16 base is merged in fp32 and rounded once (the old merge rounded twice: a case where
  that moves the weight by an ulp).
* ``export_metadata`` declares the export's names, dtypes and shapes without merging (no matmul) or gathering, and
  the NCCL source a rollout server receives declares and sends the server's dtype (bf16: half the trainer's fp32).
* Under FSDP2 (two processes over gloo, this file as the worker): the export gathers to the unsharded export
  exactly, the metadata gathers nothing and declares global shapes, and the HF engine's unsharded copy holds the
  same weights; the reference pass (the policy with its adapters disabled) leaves no FSDP unit gathered.
"""

import abc
import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import REPO, free_port
from test_lora import base_model, perturbed_lora
from torch.overrides import TorchFunctionMode

from common.lora import AdapterDisabled, LoraConfig, apply_lora, is_lora
from common.weight_export import export_metadata, export_weights, unwrap_model

TINY = REPO / "common" / "tiny_model"
URL = "http://127.0.0.1:1"  # never contacted: the HTTP calls are stubbed


class Wrapped(torch.nn.Module):
    """Stands in for DDP / accelerate: the real model under ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module


# ------------------------------------------------------------------------------ the paths before this one, verbatim
def old_merged(policy):
    """``lora.MergedView.named_parameters`` (gone): B A rounded to the base's dtype, then added."""
    inner = policy.get_base_model()
    for name, param in inner.named_parameters():
        if ".lora_" in name:
            continue
        if ".base_layer." not in name:
            yield name, param.detach()
            continue
        owner, leaf = name.split(".base_layer.")
        layer = inner.get_submodule(owner)
        tensor = param.detach()
        if leaf == "weight" and "default" in layer.lora_A and not layer.merged:
            a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
            tensor = tensor + (b @ a).to(tensor.dtype) * layer.scaling["default"]
        yield f"{owner}.{leaf}", tensor


def old_export(model, dtype=None):
    """``vllm_engine._hf_named_weights(merged_view(model), dtype)``: what both vLLM engines sent before."""
    source = old_merged(model) if is_lora(model) else unwrap_model(model).named_parameters()
    for name, tensor in source:
        for part in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod."):
            name = name.replace(part, "")
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor


def assert_same_pairs(ours, theirs) -> None:
    ours, theirs = list(ours), list(theirs)
    assert [n for n, _ in ours] == [n for n, _ in theirs]
    for (name, a), (_, b) in zip(ours, theirs):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert torch.equal(a, b), name


def adapters(model) -> int:
    return sum(".lora_A." in name for name, _ in model.named_parameters())


class CountMatmuls(TorchFunctionMode):
    """Counts matrix products (a LoRA merge is one B @ A per adapted layer)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.matmul, torch.mm, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.Tensor.mm):
            self.n += 1
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------- export = old paths
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_plain_model_exports_the_pairs_the_engines_sent_before(dtype):
    model = base_model()
    ours = list(export_weights(Wrapped(Wrapped(model)), dtype))
    assert_same_pairs(ours, old_export(model, dtype))
    assert "lm_head.weight" not in dict(ours)  # tied: the embedding is sent once
    assert {t.dtype for _, t in ours} == {dtype or torch.float32}
    if dtype is None:  # nothing to gather, merge or cast: the parameter itself, no copy
        assert all(t.data_ptr() == p.data_ptr() for (_, t), (_, p) in zip(ours, model.named_parameters()))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_lora_policy_exports_the_old_merge_exactly_for_an_fp32_base(dtype):
    policy = perturbed_lora()
    ours = list(export_weights(Wrapped(policy), dtype))
    assert_same_pairs(ours, old_export(policy, dtype))
    assert {n for n, _ in ours} == {n for n, _ in base_model().named_parameters()}  # the base's names, no adapter


def test_the_hf_engines_copy_holds_the_export():
    """Under --fsdp the HF engine samples from a plain copy, refreshed by ``sharding.copy_weights`` (as
    ``common/rollout.py`` calls it, on the trainer's model)."""
    from common.sharding import copy_weights

    policy, target = perturbed_lora(), base_model()
    copy_weights(policy, target)
    assert_same_pairs(target.named_parameters(), export_weights(policy))


class OneWeight(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.proj = torch.nn.Linear(2, 2, bias=False, dtype=dtype)


def one_weight_lora(w, a, b, alpha: float, dtype=torch.float32):
    """A single linear layer with weight ``w`` and a rank-1 adapter ``a`` (1 x 2), ``b`` (2 x 1), α = ``alpha``."""
    policy = apply_lora(OneWeight(dtype), LoraConfig(rank=1, alpha=alpha, target_modules=("proj",)))
    layer = policy.get_base_model().proj
    with torch.no_grad():
        layer.base_layer.weight.copy_(torch.tensor(w))
        layer.lora_A["default"].weight.copy_(torch.tensor(a))
        layer.lora_B["default"].weight.copy_(torch.tensor(b))
    return policy


def test_a_tiny_linear_merges_to_w_plus_scale_b_a_by_hand():
    # W = [[1, 2], [3, 4]], A = [[1, -1]], B = [[0.5], [2]], α / r = 2:  B A = [[0.5, -0.5], [2, -2]]
    policy = one_weight_lora([[1.0, 2.0], [3.0, 4.0]], [[1.0, -1.0]], [[0.5], [2.0]], alpha=2.0)
    ((name, merged),) = export_weights(policy)
    assert name == "proj.weight" and torch.equal(merged, torch.tensor([[2.0, 1.0], [7.0, 0.0]]))
    assert [(m.name, m.dtype, m.shape) for m in export_metadata(policy)] == [("proj.weight", torch.float32, (2, 2))]


def test_a_bf16_base_is_merged_in_fp32_and_rounded_once():
    """W = 1 in bf16 (8 significant bits: its neighbours are 1 and 1 + 2^-7), B A = 2^-8 (1 + 2^-10), α / r = 1.
    Exactly, W + B A lies just above the midpoint 1 + 2^-8, so one rounding gives 1 + 2^-7. Rounding B A to bf16
    first gives 2^-8 exactly; the sum is then the midpoint, which rounds to even: 1. An ulp the trainer never had."""
    ba = 2.0**-8 * (1 + 2.0**-10)
    policy = one_weight_lora([[1.0, 0.0], [0.0, 0.0]], [[1.0, 0.0]], [[ba], [0.0]], alpha=1.0, dtype=torch.bfloat16)
    layer = policy.get_base_model().proj
    assert layer.lora_B["default"].weight.dtype == torch.float32 and layer.lora_B["default"].weight[0, 0] == ba
    once = torch.tensor(1.0 + 2.0**-7, dtype=torch.bfloat16)
    assert dict(old_merged(policy))["proj.weight"][0, 0] == 1.0  # the old merge: rounded twice, one ulp low
    assert dict(export_weights(policy))["proj.weight"][0, 0] == once
    assert dict(export_weights(policy, torch.float32))["proj.weight"][0, 0] == 1.0 + ba  # an fp32 engine: exact


# --------------------------------------------------------------------------------------------------------- metadata
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_metadata_declares_the_export_without_merging_or_gathering(lora, dtype, monkeypatch):
    model = Wrapped(perturbed_lora() if lora else base_model())
    gathers = []
    monkeypatch.setattr("common.weight_export._full", lambda t: gathers.append(t) or t.detach())
    with CountMatmuls() as matmuls:
        metas = export_metadata(model, dtype)
    assert matmuls.n == 0 and not gathers
    pairs = list(export_weights(model, dtype))
    assert [(m.name, m.dtype, m.shape) for m in metas] == [(n, t.dtype, tuple(t.shape)) for n, t in pairs]
    assert len(gathers) == len(pairs) + 2 * adapters(model)  # each tensor once, and A and B of each adapter


# ----------------------------------------------------------------------------------------- the rollout servers' side
def fake_vllm(monkeypatch) -> dict:
    """Stand-ins for the parts of vLLM's weight-transfer API (0.33) the NCCL push touches. The fake sender does what
    vLLM's does with a ``WeightSource``: reads ``metadata()`` (the receiver sizes its buffers from it), then iterates
    the source and checks every pair against it. Returns what it saw."""
    seen: dict = {}

    @dataclass(frozen=True)
    class ParamMeta:
        name: str
        dtype: torch.dtype
        shape: tuple

    class WeightSource(abc.ABC):
        @abc.abstractmethod
        def metadata(self): ...

        @abc.abstractmethod
        def __iter__(self): ...

    class ModuleSource(WeightSource):  # vLLM's, which the push used before
        def __init__(self, module):
            self.module = module

        def metadata(self):
            return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.module.named_parameters()]

        def __iter__(self):
            return ((n, p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in self.module.named_parameters())

    class Sender:
        def __init__(self, source):
            self.source = source

        def send_weights(self):
            with CountMatmuls() as matmuls:
                metas = self.source.metadata()
            pairs = list(self.source)
            assert [(m.name, m.dtype, tuple(m.shape)) for m in metas] == [
                (n, t.dtype, tuple(t.shape)) for n, t in pairs
            ]
            seen.update(metas=metas, pairs=pairs, metadata_matmuls=matmuls.n)

    class Factory:
        @staticmethod
        def trainer_init(init, client, source):
            assert isinstance(source, WeightSource)
            return Sender(source)

    class Client:
        def __init__(self, url, timeout=None):
            pass

    @dataclass
    class NCCLTrainerInitInfo:
        master_address: str
        master_port: int
        world_size: int
        rank: int

    parts = {
        "vllm": {},
        "vllm.distributed": {},
        "vllm.distributed.weight_transfer": {},
        "vllm.distributed.weight_transfer.base": dict(
            ParamMeta=ParamMeta, WeightSource=WeightSource, ModuleSource=ModuleSource
        ),
        "vllm.distributed.weight_transfer.clients": dict(HTTPVLLMWeightSyncClient=Client),
        "vllm.distributed.weight_transfer.factory": dict(WeightTransferTrainerFactory=Factory),
        "vllm.distributed.weight_transfer.nccl_engine": dict(NCCLTrainerInitInfo=NCCLTrainerInitInfo),
    }
    for name, attributes in parts.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)
    return seen


def server_engine(monkeypatch, backend: str, dtype: str = "torch.bfloat16"):
    """A ``VLLMServerEngine`` for one server at ``URL`` holding ``dtype``, without the start-up checks. The HTTP
    routes are stubbed: the server's world size, a prefix-cache reset that succeeds, and the version just pushed."""
    from common.vllm_server import VLLMServerEngine

    engine = object.__new__(VLLMServerEngine)
    answer = lambda *args, **kwargs: {"world_size": 1, "weight_version": engine.version}  # noqa: E731
    monkeypatch.setattr("common.vllm_server.http", answer)
    monkeypatch.setattr("common.vllm_server.reset_prefix_cache", lambda *args, **kwargs: None, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    engine.__dict__.update(
        urls=[URL],
        backends={URL: backend},
        infos={URL: {"model_config": {"dtype": dtype}}},
        nccl_senders={},
        rank=0,
        world=1,
        timeout=5.0,
        retries=0,
        trainer_address="127.0.0.1",
        nonce="test",
        pushes=0,
        on_fault=None,
    )
    return engine


@pytest.mark.parametrize("lora", [False, True])
def test_the_nccl_push_declares_and_sends_the_servers_dtype_without_merging_for_metadata(lora, monkeypatch):
    """The old source (vLLM's ModuleSource over the merged view) merged every adapted weight to read its shape, and
    declared and sent the trainer's fp32 to a bf16 server."""
    seen = fake_vllm(monkeypatch)
    model = perturbed_lora() if lora else base_model()
    server_engine(monkeypatch, "nccl").update_weights(model)
    assert seen["metadata_matmuls"] == 0
    assert {m.dtype for m in seen["metas"]} == {torch.bfloat16}
    assert_same_pairs(seen["pairs"], export_weights(model, torch.bfloat16))


def test_the_shared_memory_file_holds_the_export_in_the_servers_dtype(monkeypatch):
    policy = perturbed_lora()
    tensors = server_engine(monkeypatch, "shm")._gather_for_shm(policy)
    assert_same_pairs(tensors.items(), export_weights(policy, torch.bfloat16))
    policy.get_base_model().model.norm.weight.data.add_(1.0)  # the next step: the file's copy must not move
    assert not torch.equal(tensors["model.norm.weight"], policy.get_base_model().model.norm.weight.bfloat16())


# ---------------------------------------------------------------------------------------------------------- FSDP2
@pytest.fixture
def one_process_group():
    """A one-process gloo group in this process (FSDP2 needs one), torn down after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_reference_pass_leaves_the_sharded_policy_resharded(one_process_group):
    """``token_logprobs_batched`` reshards its model after the forward; the reference model of a LoRA policy is a
    view (``AdapterDisabled``) with no modules of its own, so the policy's root stayed gathered (its embeddings, norm
    and head in full on every rank) until the next training forward."""
    from torch.distributed.tensor import DTensor

    from common.logprobs import token_logprobs_batched
    from common.sharding import shard_model

    policy = shard_model(perturbed_lora(rank=4))
    gathered = lambda: sum(not isinstance(p, DTensor) for p in policy.parameters())  # noqa: E731
    assert gathered() == 0
    ids = torch.randint(3, 279, (2, 12), generator=torch.Generator().manual_seed(0))
    token_logprobs_batched(AdapterDisabled(policy), ids, torch.ones_like(ids), 6, 1.0, micro_batch_size=2)
    assert gathered() == 0


def test_under_fsdp_the_export_gathers_the_unsharded_weights_and_the_metadata_gathers_nothing(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    result = subprocess.run([*cmd, __file__, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report == {
            "sharded": True,  # the shards really are halves: local shapes differ from the global ones
            "metadata_gathers": 0,
            "metadata_matmuls": 0,
            "metadata_equals_unsharded": True,  # global shapes
            "export_gathers_each_tensor_once": True,
            "export_equals_unsharded": True,
            "hf_engine_copy_equals_unsharded": True,
        }, rank


def _fsdp_worker(out_dir: str) -> None:
    """Under torchrun: the same LoRA policy on every rank, exported unsharded, then sharded over two processes and
    exported again; writes this rank's findings."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from common.sharding import shard_model, unsharded_copy

    dist.init_process_group("gloo")
    policy = perturbed_lora(rank=4)
    reference, reference_metas = list(export_weights(policy)), export_metadata(policy)
    reference = [(n, t.clone()) for n, t in reference]
    shard_model(policy)
    gathers = []
    full_tensor = DTensor.full_tensor
    DTensor.full_tensor = lambda self, *a, **k: gathers.append(1) or full_tensor(self, *a, **k)
    with CountMatmuls() as matmuls:
        metas = export_metadata(policy)
    metadata_gathers = len(gathers)
    pairs = list(export_weights(policy))
    export_gathers = len(gathers) - metadata_gathers
    DTensor.full_tensor = full_tensor
    copy = dict(unsharded_copy(policy).named_parameters())
    same = lambda a, b: (
        [n for n, _ in a] == [n for n, _ in b] and all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))
    )  # noqa: E731
    report = {
        "sharded": any(p.to_local().shape != p.shape for p in policy.parameters() if isinstance(p, DTensor)),
        "metadata_gathers": metadata_gathers,
        "metadata_matmuls": matmuls.n,
        "metadata_equals_unsharded": metas == reference_metas,
        "export_gathers_each_tensor_once": export_gathers == len(pairs) + 2 * adapters(policy),  # and each A, B
        "export_equals_unsharded": same(pairs, reference),
        "hf_engine_copy_equals_unsharded": same(list(copy.items()), reference),
    }
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    _fsdp_worker(sys.argv[1])
