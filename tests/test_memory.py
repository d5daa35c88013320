"""The memory planner (common/memory.py): parameter counts and components against hand-derived numbers, the
activation formula against the bytes autograd really saves, --dry-run end to end, and the stop before loading."""

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import tyro
from conftest import REPO, load_algo

from common import memory
from common.memory import GB, MODEL_CONFIGS, model_shape, plan_memory

MATH_15B = str(MODEL_CONFIGS / "qwen2.5-math-1.5b")


def hand_count(h, i, layers, heads, kv, vocab, tied):
    """Qwen2 parameters by hand: embedding + layers x (attention + MLP + 2 norms) + final norm (+ untied head)."""
    head_dim = h // heads
    attention = (h * h + h) + 2 * (h * kv * head_dim + kv * head_dim) + h * h  # q, k, v with bias; o without
    mlp = 3 * h * i  # gate, up, down
    return vocab * h + layers * (attention + mlp + 2 * h) + h + (0 if tied else vocab * h)


@pytest.mark.parametrize(
    "folder, shape, billions",
    [
        ("qwen2.5-0.5b", (896, 4864, 24, 14, 2, 151936, True), 0.494),
        ("qwen2.5-1.5b", (1536, 8960, 28, 12, 2, 151936, True), 1.544),
        ("qwen2.5-math-1.5b", (1536, 8960, 28, 12, 2, 151936, True), 1.544),
        ("qwen2.5-7b", (3584, 18944, 28, 28, 4, 152064, False), 7.616),
    ],
)
def test_parameter_counts_match_the_hand_formula(folder, shape, billions):
    counted = model_shape(str(MODEL_CONFIGS / folder)).params
    assert counted == hand_count(*shape)
    assert counted / 1e9 == pytest.approx(billions, abs=0.001)


def grpo_args(*flags):
    return tyro.cli(load_algo("grpo").Args, args=["--learning-rate", "1e-6", *flags])


def components(plan):
    return {label.split(" (")[0]: b / GB for label, b in plan.components}


def test_trainer_state_reference_vllm_share_and_sleep():
    args = grpo_args("--max-new-tokens", "3000", "--prompts-per-step", "128", "--micro-batch-size", "8")
    plan = plan_memory(args, MATH_15B, 3512, world=1, card_gb=80.0, backend="vllm")
    parts = components(plan)
    p = 1_543_714_304
    # 16 bytes per parameter: 24.7 GB of trainer state for Qwen2.5-1.5B
    assert parts["weights"] + parts["gradients"] + parts["AdamW moments"] == pytest.approx(16 * p / GB)
    assert 16 * p / GB == pytest.approx(24.7, abs=0.05)
    assert parts["frozen reference"] == pytest.approx(4 * p / GB)  # grpo's default β = 0.04 loads it, in fp32
    assert parts["bf16 autocast weight copies"] == pytest.approx(2 * p / GB)
    assert parts["vLLM share"] == pytest.approx(0.35 * 80)
    # 1024 completion tokens x the vocabulary in fp32, 4 buffers: 2.5 GB, not one chunk per row
    assert parts["log-prob head chunk"] == pytest.approx(4 * 1024 * 151936 * 4 / GB)
    # without checkpointing, 8 rows of 3512 tokens at ~3.7 MB per token: far over the card
    assert parts["activations without checkpointing"] / (8 * 3512) * 1e3 == pytest.approx(3.69, abs=0.05)
    assert not plan.fits and not plan.needs_sharding and plan.fixes
    # sleep mode: the update sees only what an asleep engine keeps; sampling still sees the whole share
    asleep = plan_memory(
        dataclasses.replace(args, rollout=dataclasses.replace(args.rollout, enable_sleep_mode=True)),
        MATH_15B,
        3512,
        card_gb=80.0,
        backend="vllm",
    )
    assert plan.update_peak - asleep.update_peak == pytest.approx((0.35 * 80 - memory.VLLM_ASLEEP_GB) * GB)
    assert asleep.rollout_peak == plan.rollout_peak


def test_which_models_each_script_loads():
    no_kl = plan_memory(grpo_args("--kl-coef", "0"), MATH_15B, 1024, backend="vllm")
    assert components(no_kl)["frozen reference"] == 0
    ppo = tyro.cli(load_algo("ppo").Args, args=["--learning-rate", "1e-6"])
    prime = tyro.cli(load_algo("prime").Args, args=["--learning-rate", "1e-6"])
    assert memory.trained_models(ppo) == (2, False)  # policy + critic; ORZ's β = 0 loads no reference
    assert memory.trained_models(prime) == (2, True)  # policy + PRM, and always the reference
    p = model_shape(MATH_15B).params
    parts = components(plan_memory(prime, MATH_15B, 1024, backend="vllm"))
    # two models' weights and moments (24P), one model's gradients at a time (4P: each is freed after its step)
    assert parts["weights"] + parts["gradients"] + parts["AdamW moments"] == pytest.approx(28 * p / GB)
    # bf16 weights: 2 + 2 + 4 bytes per parameter; DDP adds its gradient buckets and divides nothing
    bf16 = components(plan_memory(grpo_args("--dtype", "bfloat16"), MATH_15B, 1024, world=8, backend="vllm"))
    assert bf16["weights"] + bf16["gradients"] + bf16["AdamW moments"] == pytest.approx(8 * p / GB)
    assert bf16["DDP gradient buckets"] == pytest.approx(2 * p / GB)


def test_lora_plans_a_frozen_base_fp32_adapters_and_no_reference():
    """Qwen2.5-Math-1.5B, rank 16 on every linear layer: adapters r x (in + out) per layer by hand (q: 1536 -> 1536,
    k and v: 1536 -> 256, o: 1536 -> 1536, gate and up: 1536 -> 8960, down: 8960 -> 1536, 28 layers, no LM head);
    a frozen base, 16 bytes per adapter parameter, no reference (the adapters disabled). Under bf16 autocast (the
    CUDA default) the base's decoder matmuls are held at 2 bytes (common.learner_speed.hold_frozen_linears_in_bf16), the
    embeddings, norms and head at 4; with --mixed-precision no all of it at 4."""
    h, kv, i, layers = 1536, 256, 8960, 28
    adapters = 16 * layers * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))
    assert memory.lora_params(MATH_15B, 16, ("all-linear",)) == adapters
    assert memory.lora_params(MATH_15B, 16, ("q_proj", "v_proj")) == 16 * layers * ((h + h) + (h + kv))
    p = model_shape(MATH_15B).params
    full = components(plan_memory(grpo_args(), MATH_15B, 1024, backend="vllm"))
    lora = components(plan_memory(grpo_args("--lora.rank", "16"), MATH_15B, 1024, backend="vllm"))
    matmuls = layers * (2 * h * h + 2 * h * kv + 3 * h * i)  # q, o; k, v; gate, up, down (no biases)
    assert lora["weights"] == pytest.approx((4 * p - 2 * matmuls + 4 * adapters) / GB)
    fp32 = components(plan_memory(grpo_args("--lora.rank", "16", "--mixed-precision", "no"), MATH_15B, 1024))
    assert fp32["weights"] == pytest.approx((4 * p + 4 * adapters) / GB)
    assert lora["bf16 autocast weight copies"] == 0  # the base is bf16 already: autocast casts none of it
    assert lora["gradients"] == pytest.approx(4 * adapters / GB)
    assert lora["AdamW moments"] == pytest.approx(8 * adapters / GB)
    assert lora["frozen reference"] == 0 and full["frozen reference"] == pytest.approx(4 * p / GB)
    ppo = tyro.cli(load_algo("ppo").Args, args=["--learning-rate", "1e-6", "--lora.rank", "16"])
    parts = components(plan_memory(ppo, MATH_15B, 1024, backend="vllm"))  # the critic stays fully trained
    critic = 4 * (p + 1537)  # its value head: h + 1
    assert parts["weights"] == pytest.approx((4 * p - 2 * matmuls + 4 * adapters + critic) / GB)
    assert parts["gradients"] == pytest.approx(4 * (p + 1537) / GB)  # the critic's, freed before the adapters
    # the one-GPU 7B command of docs/gpu.md: full fine-tuning needs sharding, LoRA rank 16 fits on 80 GB
    seven = str(MODEL_CONFIGS / "qwen2.5-math-7b")
    flags = ("--rollout.enable-sleep-mode", "--gradient-checkpointing", "--max-new-tokens", "3000")
    flags += ("--micro-batch-size", "4")
    assert plan_memory(grpo_args(*flags), seven, 3512, card_gb=80.0, backend="vllm").needs_sharding
    assert plan_memory(grpo_args(*flags, "--lora.rank", "16"), seven, 3512, card_gb=80.0, backend="vllm").fits


def test_fused_adamw_and_the_bf16x3_head_in_the_plan():
    """AdamW steps fused on CUDA: no temporary at the step (its phase is resident + one gradient copy, not two);
    --rollout.fp32-lm-head on keeps the bf16x3 head's two bf16 copies of the head weight: 4 x 151936 x 1536 bytes."""
    plan = plan_memory(grpo_args(), MATH_15B, 1024, backend="vllm")
    parts = components(plan)
    assert parts["AdamW step temporary"] == 0
    assert "bf16x3 LM head's bf16 weight parts" not in parts  # 'auto' is off on CUDA
    on = components(plan_memory(grpo_args("--rollout.fp32-lm-head", "on"), MATH_15B, 1024, backend="vllm"))
    assert on["bf16x3 LM head's bf16 weight parts"] == pytest.approx(4 * 151936 * 1536 / GB)
    step = memory.update_phases(10.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, adamw_temporary=False)["step"]
    assert step == 13.0 and memory.update_phases(10.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0)["step"] == 16.0


def test_seven_b_needs_sharding_and_small_models_fit():
    seven = plan_memory(grpo_args(), str(MODEL_CONFIGS / "qwen2.5-7b"), 1024, backend="vllm")
    assert seven.needs_sharding and "FSDP2" in seven.verdict and "FSDP2" in seven.fixes[0]
    small = plan_memory(grpo_args("--micro-batch-size", "4"), str(MODEL_CONFIGS / "qwen2.5-0.5b"), 1024)
    assert small.fits and small.verdict.startswith("fits on 80 GB")


def test_fsdp_divides_the_state_and_offload_moves_it_off_the_gpu():
    """--fsdp over 8 processes: weights, gradients, moments and the reference divide by 8 (no DDP buckets), the
    gathered units and the HF engine's gathered copy are counted; --fsdp-offload leaves none of the sharded state on
    the GPU; a colocated vLLM needs the whole model's bf16 weights on every GPU, which 32B-class models cannot have."""
    seven = str(MODEL_CONFIGS / "qwen2.5-7b")
    p = model_shape(seven).params
    ddp = components(plan_memory(grpo_args(), seven, 1024, world=8, backend="vllm"))
    fsdp = components(plan_memory(grpo_args("--fsdp"), seven, 1024, world=8, backend="vllm"))
    for part in ("gradients", "AdamW moments", "frozen reference"):
        assert fsdp[part] == pytest.approx(ddp[part] / 8)
    assert "DDP gradient buckets" not in fsdp and fsdp["FSDP gathered units"] > 0
    offload = components(plan_memory(grpo_args("--fsdp", "--fsdp-offload"), seven, 1024, world=8, backend="vllm"))
    assert offload["gradients"] == offload["AdamW moments"] == offload["frozen reference"] == 0
    hf = components(plan_memory(grpo_args("--fsdp"), seven, 1024, world=8, backend="hf"))
    assert hf["HF engine's gathered policy copy"] == pytest.approx(4 * p / GB)
    seven_plan = plan_memory(grpo_args("--fsdp", "--gradient-checkpointing", "--micro-batch-size", "4"), seven, 1024, 8)
    assert not seven_plan.needs_sharding and not seven_plan.no_colocation
    big = plan_memory(grpo_args("--fsdp", "--fsdp-offload"), str(MODEL_CONFIGS / "qwen2.5-32b"), 1024, 8, 80.0, "vllm")
    assert big.verdict.startswith("vLLM cannot colocate on 80 GB") and "tensor-parallel" in big.fixes[0]


# Rollout servers (--rollout.backend vllm-server), Qwen2.5-7B by hand: P = 7,615,616,512; 28 layers, 4 KV heads of
# 128; vocabulary 152064 x hidden 3584. A server GPU at tensor parallel 2 holds 2P / 2 = 7.62 GB of bf16 weights and
# 2 (K, V) x 28 x 4/2 heads x 128 x 2 bytes = 28,672 bytes of KV per token: 117,440,512 for a 4096-token sequence.
SEVEN_B = str(MODEL_CONFIGS / "qwen2.5-7b")
THIRTY_TWO_B = str(MODEL_CONFIGS / "qwen2.5-32b")


def server_args(*flags):
    return grpo_args("--rollout.backend", "vllm-server", "--rollout.server-urls", "http://127.0.0.1:8000", *flags)


def test_a_server_run_plans_no_engine_on_the_trainer_and_both_sides_by_hand():
    """Trainer GPUs: the colocated plan less vLLM's share, plus rank 0's weight push (vLLM's two 1 GiB packed NCCL
    buffers and, under --fsdp, the gathered embedding in fp32: 152064 x 3584 x 4 bytes). Server GPUs: 2P / T of
    weights and the KV cache in 0.9 x 80 GB (serve_rollout.py's share while the flag keeps its colocated 0.35)."""
    flags = ("--fsdp", "--gradient-checkpointing", "--micro-batch-tokens", "8192", "--rollout.server-tensor-parallel")
    args = server_args(*flags, "2")
    plan = plan_memory(args, SEVEN_B, 4096, world=4, card_gb=80.0, backend=None)  # resolved from --rollout.backend
    colocated = plan_memory(args, SEVEN_B, 4096, world=4, card_gb=80.0, backend="vllm")
    parts = components(plan)
    p = 7_615_616_512
    assert "vLLM share" not in parts and "HF engine KV cache" not in parts and plan.engine_share == 0
    assert parts["weights"] + parts["gradients"] + parts["AdamW moments"] == pytest.approx(16 * p / 4 / GB)
    push = 2 * 1024**3 + 152064 * 3584 * 4
    assert parts["weight push to the rollout servers"] == pytest.approx(push / GB)
    share = 0.35 * 80 * GB  # what the colocated plan adds while sampling and, awake, during the update
    assert plan.update_peak == pytest.approx(colocated.update_peak - share)
    assert plan.rollout_peak == pytest.approx(colocated.rollout_peak - share + push)
    server = plan.server
    assert server.tensor_parallel == 2 and server.utilization == 0.9 and server.share == pytest.approx(72 * GB)
    assert server.weights == pytest.approx(2 * p / 2)
    assert 2 * 28 * (4 // 2) * 128 * 2 * 4096 == 117_440_512
    assert server.kv_per_sequence == 117_440_512
    assert server.sequences == (72 * 10**9 - p - 10**9) // 117_440_512 == 539
    assert server.fits and plan.fits and plan.verdict.startswith("fits on 80 GB")
    text = memory.format_plan(plan)
    assert "rollout server GPUs (scripts/serve_rollout.py --tp 2)" in text and "539 sequences of 4096 tokens" in text
    assert "rollout servers: fits on 80 GB: 72.0 GB per GPU" in text
    assert text.splitlines()[-1] == f"planner: {plan.verdict}"  # the overall verdict stays the last line
    # another share: the flag, once changed, is the servers'; tensor parallel 8 > 4 KV heads: each GPU keeps one head
    other = plan_memory(server_args("--rollout.gpu-memory-utilization", "0.5"), SEVEN_B, 4096, 4, 80.0).server
    assert other.share == pytest.approx(40 * GB) and other.tensor_parallel == 1
    eight = plan_memory(server_args("--rollout.server-tensor-parallel", "8"), SEVEN_B, 4096, 4, 80.0).server
    assert eight.weights == pytest.approx(2 * p / 8) and eight.kv_per_sequence == 2 * 28 * 1 * 128 * 2 * 4096


def test_the_servers_default_share_is_serve_rollouts():
    """Left at its colocated default the flag plans the servers at scripts/serve_rollout.py's own default."""
    source = (REPO / "scripts" / "serve_rollout.py").read_text()
    assert f'"--gpu-memory-utilization", type=float, default={memory.SERVE_ROLLOUT_UTILIZATION}' in source
    assert memory.server_utilization(server_args()) == memory.SERVE_ROLLOUT_UTILIZATION == 0.9
    assert memory.server_utilization(server_args("--rollout.gpu-memory-utilization", "0.8")) == 0.8


def test_a_server_that_cannot_hold_its_weights_fails_the_plan_and_is_offered_more_tensor_parallelism():
    """Qwen2.5-32B in a 0.5 x 80 = 40 GB share: at T = 1 its 65.5 GB of bf16 weights do not fit, at T = 2 32.8 GB
    + 2 x 64 x 4 x 128 x 2 x 4096 = 0.5 GB of KV + 1 GB do. The trainer side fits (64 processes, --fsdp, fp32), so the
    plan fails on the servers alone; a live run stops only for its own GPUs (its servers are running already)."""
    flags = ["--fsdp", "--mixed-precision", "no", "--gradient-checkpointing", "--micro-batch-size", "1"]
    args = server_args(*flags, "--rollout.gpu-memory-utilization", "0.5", "--prompts-per-step", "64")
    plan = plan_memory(args, THIRTY_TWO_B, 4096, world=64, card_gb=80.0)
    p = model_shape(THIRTY_TWO_B).params
    assert plan.server.weights == pytest.approx(2 * p) and 2 * p / GB > 40
    assert plan.trainer_fits and not plan.server.fits and not plan.fits
    assert plan.verdict.startswith("does not fit on 80 GB") and plan.fixes == ["--rollout.server-tensor-parallel 2"]
    assert "rollout servers: does not fit on 80 GB" in memory.format_plan(plan)
    two = plan_memory(dataclasses.replace(args, rollout=dataclasses.replace(args.rollout, server_tensor_parallel=2)),
                      THIRTY_TWO_B, 4096, world=64, card_gb=80.0)  # fmt: skip
    assert two.server.needs == pytest.approx(p + 2 * 64 * 4 * 128 * 2 * 4096 + GB) and two.fits
    live = dataclasses.replace(args, model=THIRTY_TWO_B)
    memory.check_memory_plan(live, THIRTY_TWO_B, 4096, world=64, on_gpu=True)  # no SystemExit
    # a trainer that needs sharding is told so first, whatever its servers need
    one = plan_memory(server_args("--rollout.gpu-memory-utilization", "0.5"), THIRTY_TWO_B, 4096, 1, 80.0)
    assert one.needs_sharding and "FSDP2" in one.fixes[0]


def load_activation_benchmark():
    spec = importlib.util.spec_from_file_location("activation_memory", REPO / "benchmarks" / "activation_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# configs, lengths and modes the formula was not derived on (benchmarks/activation_memory.py's GRID was)
HELD_OUT = [
    ((80, 224, 2, 5, 1), 56, False, True),
    ((80, 224, 2, 5, 1), 56, True, True),
    ((160, 448, 3, 10, 2), 96, False, True),
    ((160, 448, 3, 10, 2), 96, False, False),
    ((160, 448, 3, 10, 2), 96, True, False),
    ((128, 512, 4, 4, 2), 72, False, True),
    ((128, 512, 4, 4, 2), 72, True, True),
    ((224, 608, 2, 7, 7), 40, False, False),
]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("config, seq, checkpointing, bf16", HELD_OUT)
def test_activation_formula_matches_the_bytes_autograd_saves(config, seq, checkpointing, bf16, packed):
    """The benchmark's batch: 2 rows of ``seq`` tokens, a quarter prompt, the first row left-padded by half its
    prompt. Padded: 2·seq positions under seq-wide masks; packed: the attended tokens in one row under one mask of
    their number squared; either way the completion tokens, 2·(seq - seq//4), feed the head."""
    bench = load_activation_benchmark()
    model, shape = bench.small_model(*config)
    measured, copies = bench.saved_bytes(model, 2, seq, checkpointing, bf16, packed)
    completion = 2 * (seq - seq // 4)
    attended = 2 * seq - (seq // 4) // 2
    tokens, mask_len = (attended, attended) if packed else (2 * seq, seq)
    formula = memory.saved_bytes(shape, tokens, mask_len, completion, bf16, checkpointing)
    assert formula == pytest.approx(measured, rel=0.10)
    if bf16 and not checkpointing:  # autocast bf16 weight copies: ~2 bytes per parameter, counted apart
        assert copies == pytest.approx(2 * shape.params, rel=0.10)


# Qwen2.5-Math-1.5B by hand: h 1536, i 8960, 28 layers, 12 heads of 128, vocab 151936. Per token under bf16
# autocast, T the mask's width: 28 x (34·1536 + 8·8960 + 4·12 + 8 + 2T) = 3,470,880 + 56T in the layers, plus
# 12·1536 + 12 + 8·128 = 19,468 outside them, plus 4·1536 + 40 = 6,184 per completion token.
def packed_args(*flags):
    return grpo_args("--max-new-tokens", "3000", "--prompts-per-step", "128", "--group-size", "8", *flags)


def test_packed_activations_follow_the_token_budget_not_rows_times_length():
    """--micro-batch-tokens 8192: one row of 8192 tokens under one 8192 x 8192 mask per layer, whatever
    --micro-batch-size says; padded, 8 rows of 3512 tokens cost 8 x 3512 tokens under 3512-wide masks."""
    packed = components(plan_memory(packed_args("--micro-batch-tokens", "8192"), MATH_15B, 3512, backend="vllm"))
    n = 8192
    by_hand = n * (3_470_880 + 56 * n + 19_468) + n * 6_184  # every packed token counted as a completion token
    assert by_hand == 32_401_686_528
    assert packed["activations without checkpointing"] == pytest.approx(by_hand / GB)
    rows = grpo_args("--max-new-tokens", "3000", "--micro-batch-tokens", "8192", "--micro-batch-size", "1")
    assert components(plan_memory(rows, MATH_15B, 3512, backend="vllm")) == packed  # rows do not count
    padded = components(plan_memory(packed_args("--micro-batch-size", "8"), MATH_15B, 3512, backend="vllm"))
    by_hand = 8 * 3512 * (3_470_880 + 56 * 3512 + 19_468) + 8 * 3000 * 6_184
    assert padded["activations without checkpointing"] == pytest.approx(by_hand / GB)  # 103.7 GB
    # a budget over the step's tokens is the step's tokens: 2 prompts x 2 samples x 3512 on one process
    small = grpo_args("--max-new-tokens", "3000", "--prompts-per-step", "2", "--group-size", "2")
    plan = plan_memory(dataclasses.replace(small, micro_batch_tokens=65536), MATH_15B, 3512, backend="vllm")
    assert "packed: 14048 tokens in one row" in " ".join(label for label, _ in plan.components)


def test_packed_mask_is_quadratic_in_the_budget_under_sdpa_and_absent_under_flash(monkeypatch):
    """sdpa: 28 layers x N x N x 2 bytes (bf16 mask) = 56 N² on top of flash-attention's varlen path, which has no
    mask; with checkpointing N² once more (the boolean mask kept for the recomputation) and 2N² for the one layer
    recomputed: 3N². The plan's activation line names the kernel it assumes."""

    def plan(n, attention):
        monkeypatch.setattr(
            memory, "planned_attention", lambda packed, half_precision=True: attention if packed else "sdpa"
        )
        return plan_memory(packed_args("--micro-batch-tokens", str(n)), MATH_15B, 3512, backend="vllm")

    for n in (4096, 8192):
        sdpa, flash = components(plan(n, "sdpa")), components(plan(n, "flash_attention_2"))
        assert (sdpa["activations without checkpointing"] - flash["activations without checkpointing"]) * GB == (
            pytest.approx(56 * n * n)
        )
        assert (
            sdpa["activations with --gradient-checkpointing"] - flash["activations with --gradient-checkpointing"]
        ) * (GB) == pytest.approx(3 * n * n)
        assert flash["activations without checkpointing"] * GB == pytest.approx(n * (3_470_880 + 19_468 + 6_184))
    assert 56 * 8192**2 == 4 * 56 * 4096**2  # doubling N quadruples the mask: 0.94 GB at 4096, 3.76 GB at 8192
    labels = [label for label, _ in plan(8192, "sdpa").components]
    assert "activations without checkpointing (packed: 8192 tokens in one row, sdpa, one 8192 x 8192 mask" in (
        " ".join(labels)
    )
    labels = [label for label, _ in plan(8192, "flash_attention_2").components]
    assert "(packed: 8192 tokens in one row, flash_attention_2, no mask)" in " ".join(labels)


def test_planned_attention_is_flash_only_for_packed_runs_with_flash_attn_installed(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else find_spec(name))
    assert memory.planned_attention(True) == memory.planned_attention(False) == "sdpa"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else None)
    assert memory.planned_attention(True) == "flash_attention_2" and memory.planned_attention(False) == "sdpa"


def test_head_chunk_counts_completion_tokens_whatever_the_rows():
    """One chunk of at most 1024 completion tokens x 151936 fp32 x 4 buffers = 2.49 GB, for 1 row, 8 rows or a
    packed row; only a micro-batch with fewer completion tokens than a chunk holds less (2 rows x 256 = 512)."""
    full = 4 * 1024 * 151936 * 4
    assert full == 2_489_319_424
    for flags in (["--micro-batch-size", "1"], ["--micro-batch-size", "8"], ["--micro-batch-tokens", "4096"]):
        head = components(plan_memory(packed_args(*flags), MATH_15B, 3512, backend="vllm"))["log-prob head chunk"]
        assert head * GB == pytest.approx(full)
    short = grpo_args("--max-new-tokens", "256", "--micro-batch-size", "2")
    head = components(plan_memory(short, MATH_15B, 768, backend="vllm"))["log-prob head chunk"]
    assert head * GB == pytest.approx(4 * 512 * 151936 * 4)


def test_fixes_offer_token_budgets_from_the_longest_sequence_up():
    """The flagship 1.5B command (8 rows of 512 + 3000 tokens, vLLM awake) does not fit; among the fixes is a token
    budget, a power of two at or above the longest sequence (3512: 4096, 8192, ...), and it fits as offered. A
    packed run over the card is offered smaller budgets, never one under the longest sequence."""
    args = packed_args("--micro-batch-size", "8")
    plan = plan_memory(args, MATH_15B, 3512, card_gb=80.0, backend="vllm")
    assert not plan.fits
    packing = [f for f in plan.fixes if "--micro-batch-tokens" in f]
    assert packing, plan.fixes
    budget = int(packing[0].split("--micro-batch-tokens ")[1].split()[0])
    assert budget in (4096, 8192, 16384, 32768)
    fixed = dataclasses.replace(args, micro_batch_tokens=budget)
    if "--rollout.enable-sleep-mode" in packing[0]:
        fixed = dataclasses.replace(fixed, rollout=dataclasses.replace(fixed.rollout, enable_sleep_mode=True))
    if "--gradient-checkpointing" in packing[0]:
        fixed = dataclasses.replace(fixed, gradient_checkpointing=True)
    assert plan_memory(fixed, MATH_15B, 3512, card_gb=80.0, backend="vllm").fits
    too_big = plan_memory(packed_args("--micro-batch-tokens", "65536"), MATH_15B, 3512, card_gb=80.0, backend="vllm")
    offered = [
        int(f.split("--micro-batch-tokens ")[1].split()[0]) for f in too_big.fixes if "--micro-batch-tokens" in f
    ]
    assert offered and all(3512 <= n < 65536 for n in offered), too_big.fixes
    assert not any("--micro-batch-size" in f for f in too_big.fixes)  # rows mean nothing to a packed run


def run_script(*flags):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "algos/grpo.py", *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def listing(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def test_dry_run_prints_every_component_and_a_verdict_from_a_config_only_folder(tmp_path):
    folder = tmp_path / "math-1.5b"  # a folder with only config.json: no tokenizer, no weights
    folder.mkdir()
    (folder / "config.json").write_text((MODEL_CONFIGS / "qwen2.5-math-1.5b" / "config.json").read_text())
    # the run folder the plan would use already holds a run: --dry-run neither refuses nor touches it
    existing = tmp_path / "runs" / "grpo__arith__1" / "checkpoints" / "step_000010"
    existing.mkdir(parents=True)
    (existing / "state.pt").write_bytes(b"a previous run's checkpoint")
    before = listing(tmp_path)
    flags = ["--learning-rate", "1e-6", "--max-new-tokens", "3000", "--prompts-per-step", "128"]
    flags += ["--output-dir", str(tmp_path / "runs")]
    result = run_script("--model", str(folder), *flags, "--micro-batch-size", "8", "--dry-run")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for part in ("weights", "gradients", "AdamW moments", "frozen reference", "bf16 autocast weight copies",
                 "activations without checkpointing", "activations with --gradient-checkpointing",
                 "log-prob head chunk", "vLLM share (0.35 x 80 GB)", "1.544 B parameters"):  # fmt: skip
        assert part in out, out
    assert "planner: does not fit on 80 GB" in out and "would fit with: --" in out
    assert listing(tmp_path) == before  # nothing created, claimed or written
    # a card too small for the trainer state alone: sharding, still before any weights load
    small = run_script("--model", str(folder), *flags, "--dry-run", "--dry-run-gpu-gb", "24")
    assert small.returncode == 0 and "needs FSDP2 sharding (--fsdp) on 24 GB" in small.stdout
    assert listing(tmp_path) == before


def test_dry_run_plans_a_known_hub_id_offline_and_names_the_folders_for_an_unknown_one(tmp_path):
    flags = ["--learning-rate", "1e-6", "--max-new-tokens", "3000", "--output-dir", str(tmp_path), "--dry-run"]
    known = run_script("--model", "Qwen/Qwen2.5-Math-1.5B", *flags)  # HF_HUB_OFFLINE=1: common/model_configs
    assert known.returncode == 0, known.stderr[-2000:]
    assert "1.544 B parameters" in known.stdout and "planner:" in known.stdout
    unknown = run_script("--model", "nobody/unknown-7b", *flags)
    assert unknown.returncode != 0 and "Traceback" not in unknown.stderr
    assert "--model nobody/unknown-7b: cannot read its config.json" in unknown.stderr
    assert "Qwen/Qwen2.5-Math-1.5B" in unknown.stderr  # the hub ids a local config exists for
    assert not any(tmp_path.iterdir())


def test_a_gpu_run_that_does_not_fit_stops_before_loading_unless_overridden():
    args = grpo_args("--model", MATH_15B, "--max-new-tokens", "3000", "--micro-batch-size", "8")
    with pytest.raises(SystemExit) as stop:
        memory.check_memory_plan(args, MATH_15B, 3512, world=1, on_gpu=True)
    assert "--gradient-checkpointing" in str(stop.value.code) and "--ignore-memory-plan" in str(stop.value.code)
    memory.check_memory_plan(dataclasses.replace(args, ignore_memory_plan=True), MATH_15B, 3512, 1, on_gpu=True)
    fits = grpo_args("--model", MATH_15B, "--max-new-tokens", "1000", "--micro-batch-size", "2")
    memory.check_memory_plan(fits, MATH_15B, 1512, world=1, on_gpu=True)


def test_cpu_runs_are_not_planned(monkeypatch):
    monkeypatch.setattr(memory, "plan_memory", lambda *a, **k: pytest.fail("a CPU run must not plan"))
    memory.check_memory_plan(grpo_args(), "tiny", 552, world=1, on_gpu=False)


def test_the_update_peaks_at_adamw_step_when_activations_are_small():
    """Qwen2.5-Math-1.5B, one row of 768 tokens with checkpointing, vLLM awake. With foreach AdamW (the H100
    measurement, benchmarks/results/gpu/: 20P at the step, 30.95 GB at 1.5B) the step is the peak, by hand 12P (fp32
    weights and moments) + 4P (the reference) + 4P (gradients) + 4P (foreach's temporary) + vLLM's 28 GB + 1 GB of
    CUDA context. The scripts' fused AdamW on CUDA drops the temporary: the step is 20P + 29 GB, and the larger
    moment is then the backward's end."""
    p = 1_543_714_304
    args = grpo_args("--micro-batch-size", "1", "--max-new-tokens", "256", "--gradient-checkpointing")
    plan = plan_memory(args, MATH_15B, 768, card_gb=80.0, backend="vllm")
    step = dict(plan.components)["AdamW step temporary (fused on CUDA: none)"]
    assert step == 0
    foreach = memory.update_phases(16 * p + 29e9, 4 * p, 0, 0, 0, 0, 0)["step"]
    assert foreach == pytest.approx(24 * p + 28e9 + 1e9)
    assert 20 * p + 29e9 < plan.update_peak < foreach
    # without the reference and with LoRA (rank 16, adapters only are trained): the frozen base, its decoder matmuls
    # in bf16 under autocast, and no autocast casts of it
    lora = plan_memory(
        grpo_args(
            "--lora.rank", "16", "--micro-batch-size", "1", "--max-new-tokens", "256", "--gradient-checkpointing"
        ),
        MATH_15B,
        768,
        card_gb=80.0,
        backend="vllm",
    )
    assert components(lora)["bf16 autocast weight copies"] == 0
    assert lora.update_peak < plan.update_peak - 18 * p


# ppo.py and prime.py train two models and step each one, freeing its gradients (zero_grad(set_to_none=True)), before
# the next one's update: the critic's or PRM's first, then the policy's. Their weights and AdamW moments stay; their
# gradients, AdamW's step temporary and autocast's casts never coexist. Qwen2.5-Math-1.5B by hand: P = 1,543,714,304,
# tied, so ppo's critic (a token classifier) keeps the embedding and adds a 1536 -> 1 value head with a bias.
P_15B = 1_543_714_304
CRITIC_15B = P_15B + 1536 + 1
ONE_SMALL_ROW = ("--micro-batch-size", "1", "--max-new-tokens", "256", "--gradient-checkpointing")


def script_args(script, *flags):
    return tyro.cli(load_algo(script).Args, args=["--learning-rate", "1e-6", *flags])


def test_ppo_and_prime_hold_one_models_gradients_at_a_time():
    """One row of 768 tokens with checkpointing, vLLM awake (28 GB) and 1 GB of CUDA context: the peak is an AdamW
    step, as for grpo above. ppo: both models' fp32 weights and moments (12P + 12Pc) and the larger model's gradients
    with foreach's temporary (8Pc): 78.4 GB, which fits 80 GB; summing both models' gradients and temporaries (40P)
    said 90.7 GB, and a GPU run stopped before loading. prime: the policy and the PRM (24P), the reference (4P) and
    one model's gradients and temporary (8P): 84.6 GB, not 96.9 GB (44P). Those were foreach figures; with the fused
    AdamW the scripts now step with on CUDA the temporary is gone, the steps fall to 12P + 12Pc + 4Pc and 32P, and the
    peak moves to the policy's forward (the planner: 74.3 GB for ppo, 80.5 GB for prime)."""
    p, pc = P_15B, CRITIC_15B
    ppo = plan_memory(script_args("ppo", *ONE_SMALL_ROW), MATH_15B, 768, card_gb=80.0, backend="vllm")
    parts = components(ppo)
    assert parts["weights"] == pytest.approx((4 * p + 4 * pc) / GB)
    assert parts["gradients"] == pytest.approx(4 * pc / GB) and parts["AdamW step temporary"] == 0
    assert parts["AdamW moments"] == pytest.approx(8 * (p + pc) / GB)
    assert parts["bf16 autocast weight copies"] == pytest.approx(2 * pc / GB)  # one model's casts, not 4P
    foreach = 12 * (p + pc) + 8 * pc + 28e9 + 1e9  # 78.40 GB
    assert 12 * (p + pc) + 4 * pc + 29e9 < ppo.update_peak < foreach and ppo.fits
    live = dataclasses.replace(script_args("ppo", *ONE_SMALL_ROW), model=MATH_15B)
    memory.check_memory_plan(live, MATH_15B, 768, world=1, on_gpu=True)  # no SystemExit: the run fits
    prime = plan_memory(script_args("prime", *ONE_SMALL_ROW), MATH_15B, 768, card_gb=80.0, backend="vllm")
    parts = components(prime)
    assert parts["weights"] + parts["gradients"] + parts["AdamW moments"] == pytest.approx(28 * p / GB)
    assert 24 * p + 4 * p + 4 * p + 29e9 < prime.update_peak < 24 * p + 4 * p + 8 * p + 29e9  # foreach: 84.57 GB


def test_the_critic_is_a_token_classifier_without_an_lm_head():
    """ppo.py's critic is AutoModelForTokenClassification with one label: Qwen2.5-7B (untied) drops its 152064 x 3584
    LM head and gains a 3584 -> 1 value head with a bias, 0.545B parameters fewer than the policy. `ppo.py --dry-run
    --model Qwen/Qwen2.5-7B` printed 60.9 GB of gradients (8P); the larger model's, the policy's, are 4P = 30.5 GB."""
    p = 7_615_616_512
    pc = p - 152064 * 3584 + 3584 + 1
    assert pc == 7_070_622_721
    plan = plan_memory(script_args("ppo"), SEVEN_B, 552, card_gb=80.0, backend="vllm")
    parts = components(plan)
    assert parts["weights"] == pytest.approx(4 * (p + pc) / GB)
    assert parts["gradients"] == pytest.approx(4 * p / GB) and f"{parts['gradients']:.1f}" == "30.5"
    assert parts["AdamW moments"] == pytest.approx(8 * (p + pc) / GB)


def test_a_lora_policys_critic_holds_the_larger_gradients():
    """LoRA rank 16 on the policy (Qwen2.5-Math-1.5B, adapters by hand as above): the critic stays fully trained, so
    its update is the peak: the frozen base (4P; its decoder matmuls M at 2 bytes under autocast: 4P - 2M), both
    models' weights and moments (3 x (4 adapters + 4Pc)), the critic's gradients (4Pc), vLLM and the context; with
    foreach AdamW its step's temporary (4Pc more) made the step the peak, fused it is the critic's forward."""
    h, kv, i, layers = 1536, 256, 8960, 28
    adapters = 16 * layers * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))
    p, pc = P_15B, CRITIC_15B
    plan = plan_memory(script_args("ppo", "--lora.rank", "16", *ONE_SMALL_ROW), MATH_15B, 768, 1, 80.0, "vllm")
    parts = components(plan)
    base = 4 * p - 2 * layers * (2 * h * h + 2 * h * kv + 3 * h * i)
    assert parts["weights"] == pytest.approx((base + 4 * adapters + 4 * pc) / GB)
    assert parts["gradients"] == pytest.approx(4 * pc / GB)
    step = 3 * (4 * adapters + 4 * pc) + base + 4 * pc + 28e9 + 1e9
    assert step < plan.update_peak < step + 4 * pc


def critic_saved_bytes(config, seq: int, checkpointing: bool, bf16: bool, packed: bool) -> int:
    """What ppo.py's ``critic_values`` saves for backward on the activation benchmark's batch, counted as the
    benchmark counts the log-prob path's: storages once, parameters and autocast's weight casts apart, a checkpointed
    layer's input and mask by a pre-hook, the final norm's output by a hook."""
    import torch
    from transformers import AutoModelForTokenClassification

    bench = load_activation_benchmark()
    model, _ = bench.small_model(*config)
    model.config.num_labels = 1
    critic = AutoModelForTokenClassification.from_config(model.config, attn_implementation="sdpa").train()
    if checkpointing:
        critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = {p.untyped_storage().data_ptr() for p in critic.parameters()}
    saved: dict[int, int] = {}

    def record(tensor):
        if tensor.untyped_storage().data_ptr() not in params:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()

    def pack(tensor):
        if not (tensor.dtype == torch.bfloat16 and type(tensor.grad_fn).__name__ == "TBackward0"):
            record(tensor)
        return tensor

    def layer_inputs(module, args, kwargs):
        record(args[0] if args else kwargs["hidden_states"])
        if checkpointing and isinstance(kwargs.get("attention_mask"), torch.Tensor):
            record(kwargs["attention_mask"])

    hooks = [layer.register_forward_pre_hook(layer_inputs, with_kwargs=True) for layer in critic.model.layers]
    hooks.append(critic.model.norm.register_forward_hook(lambda m, args, out: record(out)))
    input_ids, attention_mask, width = bench.batch(model.config.vocab_size, 2, seq)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            load_algo("ppo").critic_values(critic, input_ids, attention_mask, width, packed)
    for hook in hooks:
        hook.remove()
    return sum(saved.values())


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("config, seq, checkpointing, bf16", [HELD_OUT[k] for k in (1, 2, 4, 7)])
def test_critic_activation_formula_matches_the_bytes_autograd_saves(config, seq, checkpointing, bf16, packed):
    """The critic's layers save what the policy's do; its value head keeps its input at every position where the
    log-prob head gathers completion tokens only (``memory_phases.value_head_bytes``)."""
    measured = critic_saved_bytes(config, seq, checkpointing, bf16, packed)
    _, shape = load_activation_benchmark().small_model(*config)
    completion = 2 * (seq - seq // 4)
    attended = 2 * seq - (seq // 4) // 2
    tokens, mask_len = (attended, attended) if packed else (2 * seq, seq)
    formula = memory.saved_bytes(shape, tokens, mask_len, completion, bf16, checkpointing, value_head=True)
    assert formula == pytest.approx(measured, rel=0.10)
