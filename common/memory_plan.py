"""What the memory planner (``common/memory.py``) returns and prints: a trainer GPU's ``MemoryPlan``, a rollout
server GPU's ``ServerPlan`` (``plan_server``) and ``format_plan``, the table ``--dry-run`` prints.

Rollout servers (``scripts/serve_rollout.py``), per server GPU, judged against the trainer's card: vLLM takes
``gpu_memory_utilization`` x the card (``--rollout.gpu-memory-utilization``; left at its colocated default, 0.35, it
is planned at serve_rollout.py's default, ``SERVE_ROLLOUT_UTILIZATION`` = 0.9), holding the weights divided by the
tensor-parallel size T (``--rollout.server-tensor-parallel``, serve_rollout.py's ``--tp``; bf16 unless
``--rollout.vllm-dtype float32``) and a KV cache in the rest. A server fits when its weights / T, the KV cache of one
``max_model_len`` sequence (2 x layers x ceil(KV heads / T) x head_dim x 2 bytes x tokens: a KV head is replicated
when T exceeds them) and ``CUDA_OVERHEAD_GB`` (assumed: CUDA context, graphs, vLLM's profiling activations) fit in
that share. A plan's verdict requires both sides to fit; its GB per GPU are the trainer GPUs'.

Contract: bytes in, verdicts and text out; the unit is ``GB`` (1e9 bytes). The printed form is quoted by the docs'
``# planner:`` lines (``tests/test_docs.py`` re-plans them), so a change of wording here is a change of every quote.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.engine_base import RolloutConfig
from common.memory_shapes import ModelShape

GB = 1e9  # the planner's unit: decimal gigabytes
CUDA_OVERHEAD_GB = 1.0  # CUDA context, cuBLAS / NCCL workspaces, allocator slack
SERVE_ROLLOUT_UTILIZATION = 0.9  # scripts/serve_rollout.py's --gpu-memory-utilization default


@dataclass(frozen=True)
class ServerPlan:
    """One rollout server GPU (``--rollout.backend vllm-server``): vLLM's share of the card holds the weights / T and
    a KV cache; it fits when the weights, one ``max_model_len`` sequence's KV cache and ``CUDA_OVERHEAD_GB`` do."""

    tensor_parallel: int
    utilization: float
    card: float  # bytes
    weights: float  # bytes per GPU: the weights / tensor_parallel
    kv_per_sequence: float  # bytes per GPU of one max_model_len sequence's keys and values
    max_model_len: int

    @property
    def share(self) -> float:
        return self.utilization * self.card

    @property
    def needs(self) -> float:
        """The least the share must hold: the weights, one sequence's KV cache, context and workspaces."""
        return self.weights + self.kv_per_sequence + CUDA_OVERHEAD_GB * GB

    @property
    def sequences(self) -> int:
        """Max-length sequences the KV cache holds at once (vLLM fills the share's rest with KV blocks)."""
        return max(0, int((self.share - self.weights - CUDA_OVERHEAD_GB * GB) // self.kv_per_sequence))

    @property
    def fits(self) -> bool:
        return self.needs <= self.share

    @property
    def components(self) -> list[tuple[str, float]]:
        t, n = self.tensor_parallel, self.max_model_len
        kv = self.sequences * self.kv_per_sequence
        return [
            (f"weights / {t} (tensor parallel {t})", self.weights),
            (f"KV cache of one {n}-token sequence", self.kv_per_sequence),
            ("CUDA context, graphs and vLLM's activations (assumed)", CUDA_OVERHEAD_GB * GB),
            (f"KV cache the share holds: {self.sequences} sequences of {n} tokens at once", kv),
        ]

    @property
    def verdict(self) -> str:
        card, share = f"{self.card / GB:.0f} GB", f"{self.share / GB:.1f} GB per GPU"
        if self.fits:
            return f"fits on {card}: {share}"
        return f"does not fit on {card}: {self.needs / GB:.1f} GB needed in a share of {share}"


@dataclass
class MemoryPlan:
    """A per-GPU plan: components in bytes, the peak, the card, the verdict and the flags that would make it fit."""

    model: str
    params: int
    components: list[tuple[str, float]]  # (label, bytes), in the order printed
    rollout_peak: float  # bytes while the engine samples
    update_peak: float  # bytes during the update: the largest of its phases (``update_phases``)
    card: float  # bytes the plan is judged against
    trainer_state: float  # trained models' state plus frozen copies: what sharding would have to divide
    world: int = 1
    fixes: list[str] = field(default_factory=list)
    fsdp: bool = False  # the state is sharded over the processes (--fsdp)
    engine_weights: float = 0.0  # a colocated vLLM's bf16 weights (tensor parallel 1: the whole model per GPU)
    engine_share: float = 0.0  # the card's share vLLM takes (0 for the HF engine)
    no_colocation: bool = False  # no vLLM share holds its weights and leaves the trainer room (suggest_fixes)
    server: ServerPlan | None = None  # a rollout server's GPU (--rollout.backend vllm-server)

    @property
    def peak(self) -> float:
        return max(self.rollout_peak, self.update_peak)

    @property
    def trainer_fits(self) -> bool:
        """The trainer's GPUs alone (a colocated vLLM engine included)."""
        engine_holds_weights = not self.engine_share or self.engine_weights + GB <= self.engine_share
        return self.peak <= self.card and engine_holds_weights

    @property
    def fits(self) -> bool:
        """The trainer's GPUs and, with rollout servers, theirs."""
        return self.trainer_fits and (self.server is None or self.server.fits)

    @property
    def needs_sharding(self) -> bool:
        return not self.fsdp and self.trainer_state + CUDA_OVERHEAD_GB * GB > self.card

    @property
    def verdict(self) -> str:
        """One line, the form documented commands quote after ``# planner:``."""
        card, peak = f"{self.card / GB:.0f} GB", f"{self.peak / GB:.1f} GB per GPU"
        if self.fits:
            return f"fits on {card}: {peak}"
        if self.needs_sharding:
            return f"needs FSDP2 sharding (--fsdp) on {card}: {peak}"
        if self.no_colocation:
            return f"vLLM cannot colocate on {card}: {peak}"
        return f"does not fit on {card}: {peak}"


def server_utilization(args) -> float:
    """The rollout servers' share of their GPUs: ``--rollout.gpu-memory-utilization``, or serve_rollout.py's default
    (0.9) while that flag holds its colocated default (0.35), which no server started by serve_rollout.py uses."""
    util = args.rollout.gpu_memory_utilization
    return SERVE_ROLLOUT_UTILIZATION if util == RolloutConfig.gpu_memory_utilization else util


def plan_server(args, shape: ModelShape, max_model_len: int, card_gb: float) -> ServerPlan:
    """One rollout server GPU's plan: the weights (bf16, or fp32 under ``--rollout.vllm-dtype float32``) and the KV
    cache per GPU at ``--rollout.server-tensor-parallel`` T, for sequences of ``max_model_len`` tokens."""
    t = args.rollout.server_tensor_parallel
    wbytes = 4 if args.rollout.vllm_dtype == "float32" else 2
    kv_heads = -(-shape.kv_heads // t)  # each GPU holds ceil(kv_heads / T) heads: replicated when T exceeds them
    kv = 2 * shape.layers * kv_heads * shape.head_dim * wbytes * max_model_len
    return ServerPlan(t, server_utilization(args), card_gb * GB, wbytes * shape.params / t, kv, max_model_len)


def format_plan(plan: MemoryPlan) -> str:
    """The table ``--dry-run`` prints: one line per component in GB, the two phases, a rollout server GPU's lines and
    verdict (``--rollout.backend vllm-server``), the verdict, the fixes."""
    lines = [f"memory plan per GPU for {plan.model} ({plan.params / 1e9:.3f} B parameters)"]
    lines += [f"  {label:<72} {b / GB:8.1f} GB" for label, b in plan.components]
    lines.append(f"  {'peak while sampling':<72} {plan.rollout_peak / GB:8.1f} GB")
    lines.append(f"  {'peak during the update':<72} {plan.update_peak / GB:8.1f} GB")
    if plan.server is not None:
        server = plan.server
        lines.append(f"rollout server GPUs (scripts/serve_rollout.py --tp {server.tensor_parallel}), each:")
        lines += [f"  {label:<72} {b / GB:8.1f} GB" for label, b in server.components]
        share = f"vLLM share ({server.utilization:g} x {server.card / GB:g} GB)"
        lines.append(f"  {share:<72} {server.share / GB:8.1f} GB")
        lines.append(f"rollout servers: {server.verdict}")
    lines.append(f"planner: {plan.verdict}")
    lines += [f"  would fit with: {fix}" for fix in plan.fixes]
    return "\n".join(lines)
