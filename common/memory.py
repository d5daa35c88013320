"""The memory planner: what a run needs per GPU, judged before any weights load (``--dry-run``).

    plan = plan_memory(args, model_path, max_model_len, world=1, card_gb=80.0)
    print(format_plan(plan))          # one line per component, in GB (1e9 bytes), then the verdict

Everything is counted from the model's ``config.json`` (``AutoConfig``; parameters counted on the meta device, tied
embeddings once) and the run's flags. Per GPU, with P parameters per model:

* trainer state of each trained model (the policy; PPO's critic, PRIME's PRM): fp32 weights 4P, gradients 4P,
  AdamW moments 8P (16P; with ``--dtype bfloat16`` 2P + 2P + 4P). Under DDP (N > 1 processes) each rank holds a
  replica, nothing divides, and DDP's gradient buckets add another copy of the gradients. Under ``--fsdp``
  (``common/sharding.py``) the state and the frozen reference divide by N, and each rank gathers the units it
  computes: the root (embeddings, head, final norm; kept from the forward to the backward) and about two decoder
  layers at a time, weights and their unsharded gradients; ``--fsdp-offload`` keeps the sharded weights, gradients
  and AdamW moments in host memory.
* a frozen reference: 4P (2P in bf16); loaded when ``kl_coef > 0``, and always by prime.py.
* LoRA (``--lora.rank r``, ``common/lora.py``): the policy's base is frozen, in the trainer's weight dtype (4P, 2P
  with ``--dtype bfloat16``), with no gradients or AdamW state; its adapters, A = r x in and B = out x r per adapted
  linear layer, train in fp32 (16 bytes per adapter parameter). No reference loads: it is the policy with its
  adapters disabled. A critic or PRM stays fully trained. Activations are planned as without LoRA (the adapters'
  own, r values per token and layer, are not counted).
* bf16 autocast weight copies: ~2P per trained model (autocast caches the bf16 cast of every weight a matmul uses;
  the autograd graph holds them until the backward pass). A frozen LoRA base's casts are not cached, only saved for
  backward: 2P without checkpointing, one layer's with it. On by default on CUDA (``--mixed-precision auto``).
* the rollout engine: vLLM takes ``gpu_memory_utilization`` x the card (its bf16 weights and KV cache). With tensor
  parallelism 1 (the only layout built) every GPU's engine holds the whole model's bf16 weights (2P, sharded or not):
  when no share leaves the trainer room for them (32B-class models), the verdict says vLLM cannot colocate. With
  ``--rollout.enable-sleep-mode`` it sleeps during the update (level 1: weights offloaded to host memory, KV cache
  freed; ``common/vllm_engine.py``); what stays on the GPU (CUDA graphs, workspaces) is assumed to be
  ``VLLM_ASLEEP_GB``, not measured. The HF engine instead decodes on the trainer's own weights and holds a KV cache
  for the rows it decodes at once (``--rollout.hf-max-batch``), in the trainer's weight dtype; under ``--fsdp`` it
  samples from a gathered copy (a full replica per rank). Rollout servers (``--rollout.backend vllm-server``) hold
  their own GPUs: the trainer's hold no engine, only, while the weights are pushed, vLLM's two 1 GiB packed NCCL
  buffers on rank 0 (``NCCL_PUSH_BYTES``) and under ``--fsdp`` the one gathered tensor being sent (at most the
  embedding). The servers' GPUs are planned apart (``plan_server``, below).
* activations of one micro-batch: the bytes autograd saves for backward, counted with ``saved_tensors_hooks`` on the
  project's own log-prob path (``benchmarks/activation_memory.py``, padded and packed; ``tests/test_memory.py`` holds
  the formula to the measurement). Per token and layer ``34h + 8i + 4·heads + 8 + 2T`` bytes under bf16 autocast
  (``40h + 16i + 4·heads + 8 + 4T`` in fp32), h the hidden size, i the MLP width, T the width of the attention
  mask's rows (sdpa converts the mask to the query dtype in every layer); plus ``12h + 8·head_dim + 12`` per token
  outside the layers, and ``4h + 40`` per completion token (the head's gathered fp32 input and its indices). With
  ``--gradient-checkpointing``: each layer's input (4h), the boolean mask the layers keep for their recomputation
  (T bytes per token), and one layer recomputed at a time in the backward pass. Padded (``--micro-batch-size``):
  rows x the worst-case padded length (``max_model_len`` = prompt budget + token budget), T that length. Packed
  (``--micro-batch-tokens N``): N tokens in one flat row (all N counted as completion tokens); under sdpa one N x N
  block-diagonal mask per layer (T = N, so the mask term grows as N²), under flash-attention's varlen path none
  (T = 0; not measured: flash-attn does not run on the CPU). The kernel is the one a CUDA run would pick
  (``common.packing.attention_implementation``): flash_attention_2 for packed runs when flash-attn is importable on
  the planning machine, else sdpa.
* the log-prob head's chunk (``common/logprobs.py``): ``LOGPROB_CHUNK`` completion tokens (or all of them, when
  fewer) x vocab fp32 logits and their log-softmax, and in the backward pass their two gradients: 4 such buffers at
  the peak, whatever the number of rows, padded or packed.
* AdamW's step: ``torch.optim.AdamW`` (foreach, the CUDA default) allocates one temporary as large as the trained
  state's gradients while they are allocated.
* ``CUDA_OVERHEAD_GB`` for the CUDA context, cuBLAS/NCCL workspaces and allocator slack.

The peak is the larger of the rollout phase (engine awake; no gradients, activations or autocast copies) and the
update phase, whose own peak is the largest of its three moments (``update_phases``: the head's backward, the
backward's end, AdamW's step), as measured phase by phase on an H100 (``benchmarks/gpu_check.py``; 0.86 to 1.01 of
the plan over its 38 learner probes, benchmarks/results/gpu/). A plan does not fit when its peak exceeds the card.
Nothing algorithmic lives here.

Rollout servers (``scripts/serve_rollout.py``), per server GPU, judged against the same card: vLLM takes
``gpu_memory_utilization`` x the card (``--rollout.gpu-memory-utilization``; left at its colocated default, 0.35, it
is planned at serve_rollout.py's default, ``SERVE_ROLLOUT_UTILIZATION`` = 0.9), holding the weights divided by the
tensor-parallel size T (``--rollout.server-tensor-parallel``, serve_rollout.py's ``--tp``; bf16 unless
``--rollout.vllm-dtype float32``) and a KV cache in the rest. A server fits when its weights / T, the KV cache of one
``max_model_len`` sequence (2 x layers x ceil(KV heads / T) x head_dim x 2 bytes x tokens: a KV head is replicated
when T exceeds them) and ``CUDA_OVERHEAD_GB`` (assumed: CUDA context, graphs, vLLM's profiling activations) fit in
that share. The plan's verdict requires both sides to fit; its GB per GPU are the trainer GPUs'.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.engine_base import RolloutConfig
from common.logprobs import LOGPROB_CHUNK
from common.packing import attention_implementation

GB = 1e9  # the planner's unit: decimal gigabytes
DEFAULT_GPU_GB = 80.0  # the card a plan is judged against when no GPU is seen and --dry-run-gpu-gb is 0
VLLM_ASLEEP_GB = 2.0  # assumed: what a level-1-asleep vLLM engine keeps on the GPU (CUDA graphs, workspaces)
CUDA_OVERHEAD_GB = 1.0  # CUDA context, cuBLAS / NCCL workspaces, allocator slack
SERVE_ROLLOUT_UTILIZATION = 0.9  # scripts/serve_rollout.py's --gpu-memory-utilization default
NCCL_PUSH_BYTES = 2 * 1024**3  # vLLM's packed NCCL weight broadcast: 2 buffers of 1 GiB on the sending trainer rank
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


def saved_bytes(
    shape: ModelShape, tokens: int, mask_len: int, completion_tokens: int, bf16: bool, checkpointing: bool
) -> int:
    """Bytes held for backward once one micro-batch's forward is done: ``tokens`` positions (rows x padded length,
    or a packed row's tokens), ``completion_tokens`` of them scored by the head."""
    per_token = saved_bytes_per_token(shape, mask_len, bf16, checkpointing)
    return tokens * per_token + head_input_bytes(shape, completion_tokens)


def activation_bytes(
    shape: ModelShape, tokens: int, mask_len: int, completion_tokens: int, bf16: bool, checkpointing: bool
) -> int:
    """Peak activation bytes of one micro-batch: what the forward saves (``saved_bytes``), plus, with checkpointing,
    the one layer the backward pass recomputes at a time."""
    recomputed = tokens * (layer_bytes_per_token(shape, mask_len, bf16) + 8 * shape.head_dim) if checkpointing else 0
    return saved_bytes(shape, tokens, mask_len, completion_tokens, bf16, checkpointing) + recomputed


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
      state's gradients (its ``_foreach_sqrt`` of the second moments) beside the gradients.

    ``resident``: what stays throughout (weights, moments, frozen copies, a sleeping engine, CUDA's context);
    ``gradients``: the trained parameters' gradients; ``transient``: gathered FSDP units (forward and backward)."""
    return {
        "forward": resident + copies + saved + head + head_gradient + transient,
        "backward": resident + gradients + saved + recomputed + 2 * head_gradient + transient,
        "step": resident + 2 * gradients,
    }


def longest_sequence(args, max_model_len: int) -> int:
    """The longest training sequence: prompt budget + ``--max-new-tokens`` (``max_model_len`` holds the larger of
    the training and evaluation token budgets; ``common.runtime.context_budget``)."""
    budget = max(args.max_new_tokens, args.eval.max_new_tokens)
    return max_model_len - budget + args.max_new_tokens


def planned_attention(packed: bool, half_precision: bool = True) -> str:
    """The attention kernel a CUDA run would use (``common.packing.attention_implementation``): flash_attention_2
    for packed bf16 micro-batches when the flash-attn package is importable on the planning machine, else sdpa."""
    return attention_implementation("cuda", packed=packed, half_precision=half_precision)


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


def trained_models(args) -> tuple[int, bool]:
    """(number of trained copies of the base model, whether a frozen reference loads), read from a script's Args:
    a critic (``critic_learning_rate``, ppo.py) or an implicit PRM (``prm_learning_rate``, prime.py, which always
    loads the reference) is a trained copy; the others load a reference only when ``kl_coef > 0``."""
    critic = hasattr(args, "critic_learning_rate")
    prm = hasattr(args, "prm_learning_rate")
    return 1 + critic + prm, prm or getattr(args, "kl_coef", 0.0) > 0


def resolve_backend(args, on_gpu: bool) -> str:
    """The rollout engine the planned run builds. 'auto': on a CUDA machine, vLLM where vllm is installed
    (requirements-gpu.txt), else the HF engine; planned from a machine without a GPU (``--dry-run`` on a laptop),
    the GPU install's vLLM. 'vllm-server' and the others as given."""
    if args.rollout.backend != "auto":
        return args.rollout.backend
    return "vllm" if not on_gpu or importlib.util.find_spec("vllm") is not None else "hf"


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


def plan_memory(
    args,
    model_path: str,
    max_model_len: int,
    world: int = 1,
    card_gb: float = DEFAULT_GPU_GB,
    backend: str | None = None,
    with_fixes: bool = True,
) -> MemoryPlan:
    """The per-GPU plan of a run of ``args`` (a script's Args) on ``world`` processes, judged against ``card_gb``.

    ``max_model_len`` is the run's padded length (``context_budget``: prompt budget + token budget);
    ``backend`` the rollout engine ('vllm', 'vllm-server' or 'hf'; None resolves ``--rollout.backend``);
    'vllm-server' adds the plan of a server GPU (``plan_server``), judged against the same card.
    """
    shape = model_shape(model_path)
    backend = backend or resolve_backend(args, torch.cuda.is_available())
    p, card = shape.params, card_gb * GB
    bf16_weights = args.dtype == "bfloat16"
    autocast = args.mixed_precision != "no" and not bf16_weights
    wbytes = 2 if bf16_weights else 4
    n_trained, has_ref = trained_models(args)
    lora = getattr(args, "lora", None)
    adapters = lora_params(model_path, lora.rank, tuple(lora.target_modules)) if lora and lora.rank > 0 else 0
    n_full = n_trained - (1 if adapters else 0)  # LoRA: the policy's base is frozen (a critic or PRM stays full)
    has_ref = has_ref and not adapters  # LoRA: the reference is the policy with its adapters disabled
    rank_rows = args.prompts_per_step // world * args.group_size  # the sequences one process trains on per step
    packed = args.micro_batch_tokens > 0
    attention = planned_attention(packed, half_precision=autocast or bf16_weights)
    if packed:  # one flat row of at most N tokens; under sdpa one N x N block-diagonal mask per layer
        tokens = min(args.micro_batch_tokens, rank_rows * max_model_len)
        mask_len = 0 if attention.startswith("flash_attention") else tokens
        completion_tokens = tokens  # at most: a bin's tokens, prompts included
        mask = f"one {tokens} x {tokens} mask per layer" if mask_len else "no mask"
        micro = f"packed: {tokens} tokens in one row, {attention}, {mask}"
    else:  # rows at the worst-case padded length, each with a max_model_len-wide mask row per token
        rows = min(args.micro_batch_size, rank_rows)
        tokens, mask_len = rows * max_model_len, max_model_len
        completion_tokens = rows * min(args.max_new_tokens, max_model_len)
        micro = f"{rows} rows x {max_model_len} tokens, {attention}"
    fsdp = getattr(args, "fsdp", False) and world > 1
    shards = world if fsdp else 1  # the trainer state and the reference divide by the processes under --fsdp
    on_gpu = 0.0 if fsdp and args.fsdp_offload else 1.0  # --fsdp-offload: the sharded state in host memory
    where = (f", sharded over {world}" + ("" if on_gpu else ", in host memory (--fsdp-offload)")) if fsdp else ""
    # one byte-per-parameter unit of the trained parameters' state (LoRA: the adapters, kept in fp32)
    state = (n_full * wbytes * p + 4 * adapters) / shards * on_gpu
    frozen = (wbytes * p if adapters else 0.0) / shards * on_gpu  # LoRA: the policy's frozen base
    what = (
        f"{n_trained} trained model(s), {wbytes} B/param"
        if not adapters
        else (
            (f"{n_full} fully trained model(s) + " if n_full else "")
            + f"LoRA adapters ({adapters / 1e6:.1f}M params, fp32) on a frozen {wbytes} B/param base"
        )
    )
    components = [
        (f"weights ({what}{where})", state + frozen),
        ("gradients", state),
        ("AdamW moments", 2 * state),
    ]
    buckets = n_full * wbytes * p + 4 * adapters if world > 1 and not fsdp else 0.0
    if buckets:
        components.append((f"DDP gradient buckets ({world} processes, each a replica)", buckets))
    components.append(("frozen reference", wbytes * p / shards * on_gpu if has_ref else 0.0))
    gathered_units = 0.0
    if fsdp:  # gathered units: the root kept from forward to backward, ~2 layers (prefetch); weights and gradients
        root = shape.vocab * shape.hidden * (1 if shape.tied else 2) + shape.hidden
        gathered_units = 2 * wbytes * (root + 2 * (p - root) / shape.layers)
        components.append(("FSDP gathered units (root + 2 layers, weights and gradients)", gathered_units))
    trainer_state = sum(b for _, b in components)
    components.append(("AdamW step temporary (foreach, one gradient-sized buffer)", state))
    ckpt = args.gradient_checkpointing
    copies = autocast_copy_bytes(p, shape.layers, n_full, bool(adapters), ckpt) if autocast else 0.0
    components.append(("bf16 autocast weight copies", copies))
    bf16_act = autocast or bf16_weights
    act = activation_bytes(shape, tokens, mask_len, completion_tokens, bf16_act, False)
    act_ckpt = activation_bytes(shape, tokens, mask_len, completion_tokens, bf16_act, True)
    components.append((f"activations without checkpointing ({micro})", act))
    components.append(("activations with --gradient-checkpointing", act_ckpt))
    head = logprob_head_bytes(shape, completion_tokens)
    chunk = min(LOGPROB_CHUNK, completion_tokens)
    components.append((f"log-prob head chunk ({chunk} tokens x {shape.vocab} fp32 x 4)", head))
    saved = saved_bytes(shape, tokens, mask_len, completion_tokens, bf16_act, ckpt)
    head_gradient = 0.0 if adapters else shape.vocab * shape.hidden * wbytes / shards  # the LM head's weight
    engine_weights = engine_share = 0.0
    if backend == "vllm":
        share = engine_share = args.rollout.gpu_memory_utilization * card
        engine_weights = 2 * p  # tensor parallel 1: the whole model's bf16 weights in every GPU's engine
        asleep = min(share, VLLM_ASLEEP_GB * GB) if args.rollout.enable_sleep_mode else share
        components.append((f"vLLM share ({args.rollout.gpu_memory_utilization:g} x {card_gb:g} GB)", share))
        if args.rollout.enable_sleep_mode:
            components.append(("vLLM asleep during the update (assumed)", asleep))
        rollout_engine, update_engine = share, asleep
    elif backend == "vllm-server":  # the servers hold their own GPUs; the trainer's only send them the weights
        gathered = shape.vocab * shape.hidden * wbytes if fsdp else 0.0  # full_tensor() of the largest: the embedding
        what = "2 x 1 GiB NCCL buffers" + (" + the largest gathered tensor" if fsdp else "")
        components.append((f"weight push to the rollout servers (rank 0: {what})", NCCL_PUSH_BYTES + gathered))
        rollout_engine, update_engine = NCCL_PUSH_BYTES + gathered, 0.0
    else:
        decoded = min(max(1, args.rollout.hf_max_batch // args.group_size), args.prompts_per_step // world)
        kv = decoded * args.group_size * max_model_len * shape.layers * 2 * shape.kv_heads * shape.head_dim * wbytes
        components.append((f"HF engine KV cache ({decoded * args.group_size} rows)", kv))
        sampler = 0.0  # --max-lag samples ahead from the live weights (common/async_rollout.py): no weight copy
        if fsdp:  # the HF engine samples from a gathered, unsharded copy of the policy on each rank
            components.append(("HF engine's gathered policy copy (--fsdp)", wbytes * p))
            sampler += wbytes * p
        rollout_engine, update_engine = kv + sampler, sampler
    overhead = CUDA_OVERHEAD_GB * GB
    components.append(("CUDA context and workspaces", overhead))
    resident = 3 * state + frozen + (wbytes * p if has_ref else 0.0) / shards * on_gpu + overhead
    rollout_peak = resident + rollout_engine
    phases = update_phases(
        resident + buckets + update_engine,
        state,
        copies,
        saved,
        act_ckpt - saved if ckpt else 0.0,
        head,
        head_gradient,
        gathered_units,
    )
    update_peak = max(phases.values())
    plan = MemoryPlan(
        model=model_path,
        params=p,
        components=components,
        rollout_peak=rollout_peak,
        update_peak=update_peak,
        card=card,
        trainer_state=trainer_state,
        world=world,
        fsdp=fsdp,
        engine_weights=engine_weights,
        engine_share=engine_share,
        server=plan_server(args, shape, max_model_len, card_gb) if backend == "vllm-server" else None,
    )
    if with_fixes and not plan.fits:
        plan.fixes = suggest_fixes(args, model_path, max_model_len, world, card_gb, backend, plan)
    return plan


def suggest_fixes(args, model_path, max_model_len, world, card_gb, backend, plan: MemoryPlan) -> list[str]:
    """Flag sets that make a failing plan fit (fewest changes first, packing first, then the largest micro-batch,
    ``--fsdp`` last when several processes run unsharded), or sharding. Packing's token budgets
    (``--micro-batch-tokens``) are the smallest power of two that holds the longest sequence (prompt budget +
    ``--max-new-tokens``) and its doublings; a packed run is offered smaller budgets, down to the longest sequence.
    A rollout server that does not fit is offered the smallest larger tensor-parallel size that does (up to 8, one
    node), appended to each of the trainer's flag sets."""
    if plan.needs_sharding or plan.server is None or plan.server.fits:
        return trainer_fixes(args, model_path, max_model_len, world, card_gb, backend, plan)
    shape = model_shape(model_path)
    larger = [t for t in (2, 4, 8) if t > plan.server.tensor_parallel]
    fit = [t for t in larger if plan_server(_with(args, server_tensor_parallel=t), shape, max_model_len, card_gb).fits]
    if not fit:
        return [
            f"a rollout server cannot hold the weights and one {max_model_len}-token sequence's KV cache at tensor "
            f"parallel up to 8 in a {plan.server.utilization:g} x {card_gb:g} GB share: a larger GPU"
        ]
    server_fix = _flag("server_tensor_parallel", fit[0])
    if plan.trainer_fits:
        return [server_fix]
    fixes = trainer_fixes(args, model_path, max_model_len, world, card_gb, backend, plan)
    return [f"{fix} {server_fix}" if fix.startswith("--") else fix for fix in fixes]


def trainer_fixes(args, model_path, max_model_len, world, card_gb, backend, plan: MemoryPlan) -> list[str]:
    """``suggest_fixes`` for the trainer's GPUs (a colocated engine included): flag sets under which they fit."""
    if plan.needs_sharding:
        return [
            f"trainer state alone ({plan.trainer_state / GB:.1f} GB per GPU) exceeds the card: FSDP2 sharding "
            "(--fsdp over several processes), a larger GPU, or a smaller model"
        ]
    halvings = lambda n, low: [n >> k for k in range(n.bit_length()) if n >> k >= low]  # noqa: E731
    if backend == "vllm":
        engine = [{}] if args.rollout.enable_sleep_mode else [{}, {"enable_sleep_mode": True}]
    else:
        engine = [{}] + [{"hf_max_batch": n} for n in halvings(args.rollout.hf_max_batch, args.group_size)[1:]]
    ckpt = [{}] if args.gradient_checkpointing else [{}, {"gradient_checkpointing": True}]
    # token budgets that hold the longest sequence: powers of two from the smallest that does, up to the first that
    # holds every token one process trains on per step (at most 64 x the longest); a packed run's rows no longer
    # count, so it is offered smaller budgets, never --micro-batch-size
    longest = longest_sequence(args, max_model_len)
    if args.micro_batch_tokens > 0:
        micro = [{}] + [{"micro_batch_tokens": n} for n in halvings(args.micro_batch_tokens, longest)[1:]]
    else:
        micro = [{}] + [{"micro_batch_size": n} for n in halvings(args.micro_batch_size, 1)[1:]]
        rank_tokens = args.prompts_per_step // world * args.group_size * max_model_len
        budget = 1 << (longest - 1).bit_length()
        while budget < 2 * rank_tokens and budget <= 64 * longest:
            micro.append({"micro_batch_tokens": budget})
            budget *= 2
    # several processes without --fsdp: sharding over them is a fix too (tried after the single-process knobs)
    shard = [{}, {"fsdp": True}] if world > 1 and not plan.fsdp else [{}]
    candidates = [s | e | c | m for s in shard for e in engine for c in ckpt for m in micro if s | e | c | m]
    # fewest changes first; among them packing (the recommended GPU setting), the largest micro-batch first
    candidates.sort(
        key=lambda ch: (
            len(ch),
            "micro_batch_tokens" not in ch,
            -ch.get("micro_batch_tokens", args.micro_batch_tokens),
            -ch.get("micro_batch_size", args.micro_batch_size),
        )
    )
    found: list[dict] = []
    for changes in candidates:
        if any(f.items() <= changes.items() or set(f) == set(changes) for f in found):
            continue  # a simpler (or same-flag) set already fits
        trial = plan_memory(_with(args, **changes), model_path, max_model_len, world, card_gb, backend, False)
        if trial.trainer_fits:
            found.append(changes)
        if len(found) == 3:
            break
    fixes = [" ".join(_flag(k, v) for k, v in f.items()) for f in found]
    if backend == "vllm" and plan.engine_weights + GB > plan.engine_share:  # the engine cannot hold its weights
        for util in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
            if plan.engine_weights + GB <= util * card_gb * GB:
                trial = _with(args, gpu_memory_utilization=util)
                if plan_memory(trial, model_path, max_model_len, world, card_gb, backend, False).fits:
                    return [_flag("gpu_memory_utilization", util)]
        plan.no_colocation = True
        return [
            f"a colocated vLLM engine (tensor parallel 1) holds the whole model's bf16 weights on every GPU "
            f"({plan.engine_weights / GB:.1f} GB), and no share of the card leaves the trainer room: this needs a "
            "tensor-parallel or separate rollout engine, which the scripts do not build"
        ]
    if backend == "vllm":  # a smaller engine: its bf16 weights plus a GB of KV cache must still fit in it
        low = (2 * plan.params + GB) / (card_gb * GB)
        for util in (0.3, 0.25, 0.2, 0.15, 0.1):
            if low <= util < args.rollout.gpu_memory_utilization:
                trial = _with(args, gpu_memory_utilization=util)
                if plan_memory(trial, model_path, max_model_len, world, card_gb, backend, False).fits:
                    fixes.append(_flag("gpu_memory_utilization", util))
                    break
    return fixes or [
        "a larger GPU (no combination of micro-batch size or tokens, checkpointing and engine settings fits)"
    ]


ROLLOUT_FIELDS = ("enable_sleep_mode", "gpu_memory_utilization", "hf_max_batch", "server_tensor_parallel")


def _flag(name: str, value) -> str:
    flag = ("--rollout." if name in ROLLOUT_FIELDS else "--") + name.replace("_", "-")
    return flag if value is True else f"{flag} {value}"


def _with(args, **changes):
    """A copy of ``args`` with some fields (rollout ones included) replaced."""
    rollout = {k: changes.pop(k) for k in ROLLOUT_FIELDS if k in changes}
    return dataclasses.replace(args, rollout=dataclasses.replace(args.rollout, **rollout), **changes)


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


def gpu_gb(args) -> float:
    """The card a plan is judged against: ``--dry-run-gpu-gb``, else the GPU seen, else ``DEFAULT_GPU_GB``."""
    if args.dry_run_gpu_gb > 0:
        return args.dry_run_gpu_gb
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[1] / GB
    return DEFAULT_GPU_GB


def check_memory_plan(args, model_path: str, max_model_len: int, world: int, on_gpu: bool, print_fn=print) -> None:
    """``--dry-run``: print the plan and exit 0. A CUDA run whose plan does not fit stops here, before any weights
    load, naming the flags that would make it fit (``--ignore-memory-plan`` lets it go on); with rollout servers only
    its own GPUs can stop it (the servers are running already, whatever their plan says). CPU runs are not planned
    (host memory is not what this guards) and cost nothing here."""
    if not args.dry_run and not on_gpu:
        return
    backend = resolve_backend(args, torch.cuda.is_available())
    plan = plan_memory(args, model_path, max_model_len, world, gpu_gb(args), backend)
    if args.dry_run:
        print_fn(format_plan(plan))
        raise SystemExit(0)
    if not (plan.trainer_fits if plan.server else plan.fits) and not args.ignore_memory_plan:
        raise SystemExit(
            format_plan(plan) + "\nthe plan does not fit this GPU: change the flags above, or pass "
            "--ignore-memory-plan to run anyway"
        )
