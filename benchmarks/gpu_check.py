"""One command that checks the GPU path on a GPU: the scripts on CUDA, then measured memory and throughput.

    python benchmarks/gpu_check.py              # on a CUDA machine (~10 minutes on one H100), no network
    python benchmarks/gpu_check.py --smoke      # the same code on the CPU with tiny shapes (CI, under 2 minutes)

Sections, each written to disk as soon as it is measured (a cut-off run keeps what it measured):
  scripts   every algos/*.py for 5 steps on the shipped tiny model (HF engine, default precision), then a resume
            to step 6: exit code, finite metrics, weights moved, a checkpoint, the resume message, peak GPU memory
  learner   random-weight Qwen2.5 shapes from common/model_configs/ (no download): a forward + backward through
            the project's own log-prob path (common.logprobs.token_logprobs, chunked head at the real vocabulary in
            the precision the scripts use on this device (``use_fp32_head``: bf16 on CUDA by default), bf16
            autocast over fp32 weights as the scripts train) and an AdamW step, over micro-batch size x sequence
            length x gradient checkpointing: peak memory, learner tokens/s, MFU on prime-rl's convention and
            hardware FLOP utilisation with recomputation (``learner_flops``, docs/gpu.md "MFU: the convention");
            each shape twice at the same token count: padded (micro-batch rows, --micro-batch-size) and packed
            (--micro-batch-tokens: 2 x micro-batch sequences of 3/4 and 1/4 the length in one flat row,
            token_logprobs(packed=True), with the kernel a script would pick: flash-attention's varlen path when
            flash-attn is installed, else sdpa through a dense block-diagonal mask); then the 7B shape with
            LoRA rank 16 on every linear layer of a frozen base (--lora.rank 16, the one-GPU 7B plan of docs/gpu.md)
  generate  HFEngine decode tokens/s on the 0.5B shape
Beside every learner row, the memory planner's prediction for the same shape and the measured/predicted ratio.

Outputs (``--out``, default benchmarks/results/gpu/, or runs/gpu_check_smoke/ with --smoke): results.json (device,
driver, torch, transformers and CUDA versions, date, commit, MFU convention, every record) and results.md (the same
as tables).
The machine needs this repo's requirements except vLLM: `bash scripts/gpu_check_wheels.sh` downloads the wheels an
offline GPU machine lacks and prints the one command that installs them there and runs this check.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.logprobs import token_logprobs  # noqa: E402
from common.memory_shapes import ModelShape  # noqa: E402
from common.packing import attention_implementation  # noqa: E402
from common.rollout import HFEngine, RolloutConfig, use_fp32_head  # noqa: E402

CONFIGS = REPO / "common" / "model_configs"
MFU_CONVENTION = (
    "prime-rl (src/prime_rl/trainer/perf.py): 6 x matmul params per token (4 x + 6 x adapters for a frozen LoRA "
    "base), LM head on every token, attention 12 L heads head_dim per (query, key) pair of a sequence, no causal "
    "discount, no recompute credit; hfu: the FLOPs this code path executes, recomputation included (docs/gpu.md)"
)


def peak_bf16_flops(device: str) -> float | None:
    """Dense bf16 peak FLOP/s of ``device`` (its name), as prime-rl's ``_get_peak_flops`` (after torchtitan's); None
    for a device not listed (MFU is left out)."""
    if "A100" in device:
        return 312e12
    if any(name in device for name in ("H100", "H200", "GH100", "GH200")):
        return 835e12 if "NVL" in device else 756e12 if "PCIe" in device else 989e12
    return None


def learner_flops(
    shape: ModelShape,
    sequence_lengths: list[int],
    head_tokens: int | None = None,
    lora_params: int = 0,
    checkpointing: bool = False,
) -> dict[str, int]:
    """FLOPs of one forward + backward over sequences of ``sequence_lengths`` tokens, two ways (docs/gpu.md, "MFU:
    the convention"):

    ``model``: prime-rl's convention (``PerfCounter``), the one MFU targets are quoted in. Matmul weights only:
    P = layers x (q, k, v, o, gate, up, down) + vocab x hidden (the head, counted once and on every token, tied or
    not; no embedding, norm or bias). 6 P per token (forward 2, backward 4); a frozen LoRA base 4 P (no weight
    gradients) + 6 per adapter parameter. Attention: 12 x layers x heads x head_dim per (query, key) pair, with
    sum(s^2) pairs over the sequences: no causal discount, whatever a kernel computes. No recomputation.
    ``hardware``: what this project's code path executes in those matmuls. The head runs only on ``head_tokens``
    (the positions that predict a completion token; default all) and is recomputed per chunk in the backward:
    2 + 4 + 2 = 8 x vocab x hidden per scored token (6 under LoRA: no weight gradient for the frozen head). With
    ``checkpointing`` every decoder layer's forward runs twice: + 2 P_layers (and + 2 per adapter parameter) per
    token and + 4 x layers x heads x head_dim per attention pair. Not counted either way: elementwise work (norms,
    RoPE, SwiGLU, softmax), a kernel's own recomputation (flash-attention's backward), the pairs a dense mask
    computes outside the sequences (packed rows under sdpa), the one-position head call of the model's forward.
    """
    layers, hidden = shape.layers, shape.hidden
    q_o = 2 * hidden * shape.heads * shape.head_dim
    k_v = 2 * hidden * shape.kv_heads * shape.head_dim
    body = layers * (q_o + k_v + 3 * hidden * shape.intermediate)  # matmul weights of the decoder layers
    head = shape.vocab * hidden
    tokens = sum(sequence_lengths)
    pairs = sum(s * s for s in sequence_lengths)
    scored = tokens if head_tokens is None else head_tokens
    per_pair = 4 * layers * shape.heads * shape.head_dim  # QK^T and PV: 2 FLOPs per multiply-add over head_dim each
    attention = 3 * per_pair * pairs  # forward + backward (twice the forward)
    if lora_params:
        model = 4 * (body + head) * tokens + 6 * lora_params * tokens + attention
        hardware = 4 * body * tokens + 6 * lora_params * tokens + attention + 6 * head * scored
    else:
        model = 6 * (body + head) * tokens + attention
        hardware = 6 * body * tokens + attention + 8 * head * scored
    if checkpointing:
        hardware += 2 * (body + lora_params) * tokens + per_pair * pairs
    return {"model": model, "hardware": hardware}


def utilisation(flops: dict[str, int], seconds: float, peak_flops: float) -> dict[str, float]:
    """``mfu`` and ``hfu``: ``learner_flops``' model and hardware FLOPs over ``seconds`` x the device's peak."""
    return {"mfu": flops["model"] / seconds / peak_flops, "hfu": flops["hardware"] / seconds / peak_flops}


def probe_flops(
    config_dir: Path,
    layout: str,
    micro_batch: int,
    seq_len: int,
    checkpointing: bool,
    lora: int = 0,
    lengths: list[int] | None = None,
    prompts: list[int] | None = None,
) -> dict[str, int]:
    """``learner_flops`` of one learner probe: its sequences (``sequence_lengths``, or ``lengths``) and their
    completion tokens (the sequence less its prompt: ``prompt_lengths``, or ``prompts``)."""
    from common import memory

    lengths = lengths or sequence_lengths(layout, micro_batch, seq_len)
    prompts = prompts or prompt_lengths(layout, micro_batch, seq_len)
    adapters = memory.lora_params(str(config_dir), lora, ("all-linear",)) if lora else 0
    completion = sum(n - p for n, p in zip(lengths, prompts))
    return learner_flops(memory.model_shape(str(config_dir)), lengths, completion, adapters, checkpointing)


SMOKE_CONFIG = {  # a tiny Qwen2 shape for the CPU smoke run
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}


class Report:
    """Records appended one at a time, rewritten to results.json and results.md after each one."""

    def __init__(self, out: Path, smoke: bool):
        self.out, self.records = out, []
        out.mkdir(parents=True, exist_ok=True)
        self.env = environment(smoke)

    def add(self, section: str, **record) -> None:
        self.records.append({"section": section, **record})
        (self.out / "results.json").write_text(json.dumps({"env": self.env, "records": self.records}, indent=1))
        (self.out / "results.md").write_text(markdown(self.env, self.records))
        shown = {k: v for k, v in record.items() if k not in ("error",)}
        print(
            f"[{section}] "
            + json.dumps(shown, default=str)
            + (f"  ERROR {record['error']}" if "error" in record else "")
        )


def environment(smoke: bool) -> dict:
    cuda = torch.cuda.is_available()
    driver = ""
    if cuda:
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            driver = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            driver = "unknown"
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "gpu_memory_gb": torch.cuda.get_device_properties(0).total_memory / 1e9 if cuda else None,
        "driver": driver,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # a copy of the tree (a GPU machine's) names the commit it holds in GPU_CHECK_COMMIT
        "commit": os.environ.get("GPU_CHECK_COMMIT") or commit.stdout.strip() or "unknown",
        "smoke": smoke,
        "mfu_convention": MFU_CONVENTION,
    }


def markdown(env: dict, records: list[dict]) -> str:
    lines = [
        "# GPU check",
        "",
        f"Device: {env['device']}; driver {env['driver'] or '–'}; torch {env['torch']}; "
        f"transformers {env.get('transformers', '–')}; CUDA {env['cuda']}; "
        f"Python {env['python']}; {env['date']}; commit {env['commit']}"
        + ("; **smoke run on the CPU: no GPU figure here**" if env["smoke"] else ""),
        "",
        "Regenerate: `python benchmarks/gpu_check.py` (see its docstring).",
    ]
    if env.get("mfu_convention"):
        lines += ["", f"MFU convention: {env['mfu_convention']}."]
    tables = {
        "scripts": ("script", "ok", "steps", "wall_s", "s_per_step", "peak_gpu_gb", "error"),
        "learner": (
            "model",
            "params_b",
            "layout",
            "micro_batch",
            "seq_len",
            "sequences",
            "tokens",
            "attention",
            "head",
            "checkpointing",
            "lora_rank",
            "start_gb",
            "forward_end_gb",
            "backward_peak_gb",
            "step_peak_gb",
            "peak_gb",
            "planned_gb",
            "ratio",
            "tokens_per_s",
            "mfu",
            "hfu",
            "mfu_old_convention",
            "error",
        ),
        "generate": ("model", "prompts", "samples", "new_tokens", "tokens_per_s", "error"),
    }
    for section, columns in tables.items():
        rows = [r for r in records if r["section"] == section]
        if not rows:
            continue
        columns = [c for c in columns if any(c in r for r in rows)]  # a column no row has is left out
        lines += ["", f"## {section}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for r in rows:
            lines.append("| " + " | ".join(cell(r.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value).replace("|", "/").replace("\n", " ")[:120]


# ----------------------------------------------------------------------------------------------
# 1. every script on the tiny model
# ----------------------------------------------------------------------------------------------
def check_scripts(report: Report, scripts: list[str], steps: int, workdir: Path) -> None:
    from safetensors.torch import load_file

    base = load_file(REPO / "common" / "tiny_model" / "model.safetensors")
    small = (
        "--prompts-per-step 8 --group-size 4 --max-new-tokens 32 --eval.max-problems 16 --eval.n 2 --eval.k 1 2 "
        f"--eval-every 100 --save-every {steps}"
    ).split()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    for script in scripts:
        t0 = time.time()
        cmd = [sys.executable, str(REPO / "algos" / f"{script}.py"), "--output-dir", str(workdir), "--run-name", script]
        cmd += ["--rollout.backend", "hf", *small]
        first = subprocess.run([*cmd, "--total-steps", str(steps)], capture_output=True, text=True, env=env)
        resumed = None
        if first.returncode == 0:
            resumed = subprocess.run(
                [*cmd, "--total-steps", str(steps + 1), "--resume"], capture_output=True, text=True, env=env
            )
        run_dir = workdir / script
        problems = []
        if first.returncode != 0:
            problems.append(f"exit {first.returncode}: {first.stderr.strip()[-400:]}")
        elif resumed.returncode != 0:
            problems.append(f"resume exit {resumed.returncode}: {resumed.stderr.strip()[-400:]}")
        elif "resumed from" not in resumed.stdout + resumed.stderr:
            problems.append("the resume did not load the checkpoint")
        rows, train = [], []
        if (run_dir / "metrics.jsonl").exists():
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            train = [r for r in rows if "train/reward" in r]
        if not problems:
            if [r["step"] for r in train] != list(range(1, steps + 2)):
                problems.append(f"logged steps {[r['step'] for r in train]}")
            if any(isinstance(v, float) and not math.isfinite(v) for r in rows for v in r.values()):
                problems.append("non-finite metric")
            if not list((run_dir / "checkpoints").glob("step_*")):
                problems.append("no checkpoint")
            trained = load_file(run_dir / "final" / "model.safetensors")
            if not any((trained[k].float() - base[k].float()).abs().max() > 0 for k in base):
                problems.append("weights did not move")
            if not all(torch.isfinite(v).all() for v in trained.values()):
                problems.append("non-finite weights")
        step_times = sorted(r["time/step_s"] for r in train if "time/step_s" in r)
        report.add(
            "scripts",
            script=script,
            ok=not problems,
            steps=len(train),
            wall_s=round(time.time() - t0, 1),
            s_per_step=step_times[len(step_times) // 2] if step_times else None,
            peak_gpu_gb=max((r.get("memory/peak_gpu_gb", 0.0) for r in train), default=None) or None,
            **({"error": "; ".join(problems)} if problems else {}),
        )


# ----------------------------------------------------------------------------------------------
# 2. learner memory and throughput on Qwen2.5 shapes
# ----------------------------------------------------------------------------------------------
def load_config(name: str, smoke: bool, workdir: Path) -> tuple[object, Path]:
    """(config, folder holding its config.json): common/model_configs/<name>, or the smoke shape written to workdir."""
    from transformers import AutoConfig

    folder = CONFIGS / name
    if smoke:
        folder = workdir / "smoke_config"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(SMOKE_CONFIG))
    return AutoConfig.from_pretrained(folder), folder


LAYOUTS = ("padded", "packed")  # each learner shape runs both ways, at the same token count


def sequence_lengths(layout: str, micro_batch: int, seq_len: int) -> list[int]:
    """The sequences of one learner micro-batch, ``micro_batch`` x ``seq_len`` - 1 tokens either way. The missing
    token leaves the padded rows one pad position, so that the model builds its attention mask as it does for the
    scripts' rows (with no padding anywhere it would skip the mask). padded: ``micro_batch`` rows of ``seq_len``
    positions, the last sequence a token short. packed: the same tokens as sequences of unequal length, as a
    long-tailed batch packs them (``--micro-batch-tokens``): ``micro_batch`` of 3/4 ``seq_len`` and ``micro_batch``
    of the rest, the last a token short."""
    if layout == "padded":
        return [seq_len] * (micro_batch - 1) + [seq_len - 1]
    long = 3 * seq_len // 4
    return [long] * micro_batch + [seq_len - long] * (micro_batch - 1) + [seq_len - long - 1]


def prompt_tokens(length: int) -> int:
    """A sequence's prompt: a quarter of it, at least 1 token (the one that predicts the first completion token) and
    at most 512; the rest is completion (scored by the head)."""
    return max(1, min(512, length // 4))


def prompt_lengths(layout: str, micro_batch: int, seq_len: int) -> list[int]:
    """Each sequence's prompt (``prompt_tokens``); padded: a full row's for every row, so that the short sequence's
    pad is the last row's last position."""
    lengths = sequence_lengths(layout, micro_batch, seq_len)
    return [prompt_tokens(seq_len if layout == "padded" else n) for n in lengths]


def learner_batch(
    layout: str, micro_batch: int, seq_len: int, vocab: int, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, completion_width) of one learner micro-batch, rows laid out as the scripts lay
    them out (``[left-padded prompt | right-padded completion]``, ``common.bookkeeping.pack_rollout``); packed rows
    go to ``token_logprobs(..., packed=True)``, which runs them as one flat row of all their tokens."""
    lengths = sequence_lengths(layout, micro_batch, seq_len)
    prompts = prompt_lengths(layout, micro_batch, seq_len)
    prompt_width, completion_width = max(prompts), max(n - p for n, p in zip(lengths, prompts))
    if layout == "padded":
        completion_width = seq_len - prompt_width
    input_ids = torch.randint(
        0, vocab, (len(lengths), prompt_width + completion_width), generator=generator, device=device
    )
    attention_mask = torch.zeros_like(input_ids)
    for row, (n, p) in enumerate(zip(lengths, prompts)):
        attention_mask[row, prompt_width - p : prompt_width - p + n] = 1
    return input_ids, attention_mask, completion_width


def planned_gb(
    config_dir: Path,
    micro_batch: int,
    seq_len: int,
    checkpointing: bool,
    bf16: bool,
    layout: str = "padded",
    attention: str = "sdpa",
    lora: int = 0,
) -> dict[str, float]:
    """The memory planner's prediction for this learner probe by phase (``memory.update_phases``, in GB), from its
    own component formulas (common/memory.py): fp32 weights and AdamW moments resident, the gradients, the bf16
    autocast copies (2 bytes), the saved activations of one micro-batch and the chunked fp32 log-prob head. CUDA's
    context and vLLM are not in the probe, so they are not in the prediction either. Padded rows: a
    ``seq_len``-wide mask row per token; packed: one flat row, under sdpa a (tokens x tokens) block-diagonal mask,
    under flash-attention's varlen path none. ``lora``: the rank of adapters on every linear layer (``--lora.rank``),
    the base frozen."""
    from common import memory

    shape = memory.model_shape(str(config_dir))
    lengths = sequence_lengths(layout, micro_batch, seq_len)
    prompts = prompt_lengths(layout, micro_batch, seq_len)
    tokens, completion_tokens = sum(lengths), sum(n - q for n, q in zip(lengths, prompts))
    if layout == "padded":
        tokens, mask_len = micro_batch * seq_len, seq_len  # rows of seq_len positions, pads included
    else:
        mask_len = 0 if attention.startswith("flash_attention") else tokens
    p = shape.params
    trained = 4 * (memory.lora_params(str(config_dir), lora, ("all-linear",)) if lora else p)
    resident = 3 * trained + (4 * p if lora else 0)  # weights and AdamW moments; LoRA: the frozen fp32 base too
    copies = memory.autocast_copy_bytes(p, shape.layers, 0 if lora else 1, bool(lora), checkpointing) if bf16 else 0.0
    saved = memory.saved_bytes(shape, tokens, mask_len, completion_tokens, bf16, checkpointing)
    active = memory.activation_bytes(shape, tokens, mask_len, completion_tokens, bf16, checkpointing)
    phases = memory.update_phases(
        resident,
        trained,
        copies,
        saved,
        active - saved,
        memory.logprob_head_bytes(shape, completion_tokens),
        0.0 if lora else shape.vocab * shape.hidden * 4,
    )
    return {phase: b / 1e9 for phase, b in phases.items()}


class PhaseMemory:
    """CUDA memory of one training step by phase, in GB: what is allocated when it starts (``start_gb``: weights and
    AdamW moments), the peak and the end of the forward pass (``forward_peak_gb``, ``forward_end_gb``: the saved
    activations), the backward pass's peak and the optimizer step's peak. Empty off CUDA."""

    def __init__(self, device: torch.device):
        self.cuda, self.gb = device.type == "cuda", {}
        if self.cuda:
            torch.cuda.synchronize()
            self.gb["start_gb"] = torch.cuda.memory_allocated() / 1e9
            torch.cuda.reset_peak_memory_stats()

    def mark(self, phase: str) -> None:
        if not self.cuda:
            return
        torch.cuda.synchronize()
        self.gb[f"{phase}_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        if phase == "forward":
            self.gb["forward_end_gb"] = torch.cuda.memory_allocated() / 1e9
        torch.cuda.reset_peak_memory_stats()


def check_learner(
    report: Report, names: list[str], grid: list[tuple[int, int, bool]], smoke: bool, workdir: Path, lora: int = 0
) -> None:
    """Forward + backward + AdamW on random weights of each shape; ``lora`` > 0: rank-``lora`` adapters on every
    linear layer of a frozen base (``common/lora.py``, as ``--lora.rank``)."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak_flops = peak_bf16_flops(report.env["device"])
    fp32_head = use_fp32_head(RolloutConfig(), device)  # the scripts' default head on this device (trainer = sampler)
    for name in names:
        config, folder = load_config(name, smoke, workdir)
        for (micro_batch, seq_len, checkpointing), layout in itertools.product(grid, LAYOUTS):
            # the kernel a script's run would use (packed on CUDA: flash-attention's varlen path when flash-attn is
            # installed); the CPU smoke run keeps sdpa, the CUDA default, for both
            attention = attention_implementation(device.type, layout == "packed") if device.type == "cuda" else "sdpa"
            record = {
                "model": name,
                "layout": layout,
                "micro_batch": micro_batch,
                "seq_len": seq_len,
                "sequences": len(sequence_lengths(layout, micro_batch, seq_len)),
                "tokens": micro_batch * seq_len,
                "attention": attention,
                "head": "fp32" if fp32_head else "bf16",
                "checkpointing": checkpointing,
                "lora_rank": lora,
            }
            planned = planned_gb(folder, micro_batch, seq_len, checkpointing, True, layout, attention, lora)
            record["planned_gb"] = max(planned.values())
            record.update({f"planned_{phase}_gb": gb for phase, gb in planned.items()})
            model = optimizer = None
            try:
                with device:  # random weights built on the device: a 7B init on the host would take minutes
                    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
                params = sum(p.numel() for p in model.parameters())
                record["params_b"] = params / 1e9
                if checkpointing:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                if lora:
                    from common.lora import LoraConfig, apply_lora

                    model = apply_lora(model, LoraConfig(rank=lora))
                model.train()
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
                generator = torch.Generator(device=device).manual_seed(0)
                input_ids, attention_mask, completion = learner_batch(
                    layout, micro_batch, seq_len, config.vocab_size, generator, device
                )
                completion_mask = attention_mask[:, -completion:]
                times, phases, peak = [], {}, 0.0
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                for _ in range(3):  # the first step allocates AdamW's moments; time the later ones
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.time()
                    phase = PhaseMemory(device)
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        logprobs, _ = token_logprobs(
                            model,
                            input_ids,
                            attention_mask,
                            completion,
                            1.0,
                            fp32_head=fp32_head,
                            packed=layout == "packed",
                        )
                    loss = -(logprobs * completion_mask).sum() / completion_mask.sum()
                    phase.mark("forward")
                    loss.backward()
                    phase.mark("backward")
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.time() - t0)
                    optimizer.step()
                    phase.mark("step")
                    optimizer.zero_grad(set_to_none=True)
                    phases = phase.gb  # the last step's: AdamW's moments exist throughout it
                    peak = max([peak, *(v for k, v in phase.gb.items() if k.endswith("_peak_gb"))])
                if device.type == "cuda":
                    record["peak_gb"] = peak  # over all three steps and their phases
                    record.update(phases)
                seconds = min(times[1:])
                tokens = int(attention_mask.sum())
                record["tokens_per_s"] = tokens / seconds
                flops = probe_flops(folder, layout, micro_batch, seq_len, checkpointing, lora)
                record["model_tflop"], record["hardware_tflop"] = flops["model"] / 1e12, flops["hardware"] / 1e12
                if peak_flops:
                    record.update(utilisation(flops, seconds, peak_flops))
                if record.get("peak_gb") and record["planned_gb"]:
                    record["ratio"] = record["peak_gb"] / record["planned_gb"]
            except torch.OutOfMemoryError as exc:  # a measurement too: the planner should say it does not fit
                record["error"] = "OOM: " + str(exc).split("\n")[0][:200]
            finally:
                del model, optimizer
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            report.add("learner", **record)


def check_generation(report: Report, name: str, smoke: bool, workdir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config, _ = load_config(name, smoke, workdir)
    prompts, samples, new_tokens = (4, 2, 16) if smoke else (16, 8, 256)
    record = {"model": name, "prompts": prompts, "samples": samples, "new_tokens": new_tokens}
    try:
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        model.generation_config.eos_token_id = config.vocab_size - 1  # random weights: a stop that rarely comes
        tokenizer = AutoTokenizer.from_pretrained(REPO / "common" / "tiny_model")  # only its pad id is used
        tokenizer.pad_token_id = 0
        engine = HFEngine(model, tokenizer)
        generator = torch.Generator().manual_seed(0)
        prompt_ids = torch.randint(1, config.vocab_size - 1, (prompts, 128), generator=generator).tolist()
        engine.generate(prompt_ids[:1], 1, 4, 1.0, 1.0, seed=0)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.time()
        completions = engine.generate(prompt_ids, samples, new_tokens, 1.0, 1.0, seed=1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        record["tokens_per_s"] = sum(len(c.token_ids) for c in completions) / (time.time() - t0)
    except torch.OutOfMemoryError as exc:
        record["error"] = "OOM: " + str(exc).split("\n")[0][:200]
    report.add("generate", **record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, two scripts (what CI runs)")
    parser.add_argument("--out", default="", help="output folder (default benchmarks/results/gpu, or runs/ for smoke)")
    parser.add_argument("--sections", nargs="+", default=["scripts", "learner", "generate"])
    parser.add_argument("--scripts", nargs="+", default=[], help="the scripts section's algos (default: all of them)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --smoke for the CPU check")
    out = Path(args.out or (REPO / ("runs/gpu_check_smoke" if args.smoke else "benchmarks/results/gpu")))
    report = Report(out, args.smoke)
    print(f"gpu_check: {report.env['device']}, torch {report.env['torch']}, CUDA {report.env['cuda']} -> {out}")
    if "scripts" in args.sections:
        scripts = args.scripts or (
            ["grpo", "ppo"] if args.smoke else sorted(p.stem for p in (REPO / "algos").glob("*.py"))
        )
        with tempfile.TemporaryDirectory() as workdir:
            check_scripts(report, scripts, steps=2 if args.smoke else 5, workdir=Path(workdir))
    with tempfile.TemporaryDirectory() as workdir:
        if "learner" in args.sections:
            if args.smoke:
                check_learner(report, ["smoke"], [(2, 64, False), (2, 64, True)], True, Path(workdir))
                check_learner(report, ["smoke"], [(2, 64, True)], True, Path(workdir), lora=8)
            else:
                grid = [(mb, seq, ckpt) for mb in (1, 4) for seq in (1024, 4096) for ckpt in (False, True)]
                check_learner(report, ["qwen2.5-0.5b", "qwen2.5-1.5b"], grid, False, Path(workdir))
                check_learner(report, ["qwen2.5-7b"], [(1, 1024, True), (1, 4096, True)], False, Path(workdir))
                # the one-GPU 7B LoRA plan (docs/gpu.md): rank 16 on every linear layer, gradient checkpointing
                check_learner(
                    report, ["qwen2.5-7b"], [(1, 1024, False), (1, 4096, True)], False, Path(workdir), lora=16
                )
                check_learner(
                    report, ["qwen2.5-1.5b"], [(4, 1024, False), (4, 1024, True)], False, Path(workdir), lora=16
                )
        if "generate" in args.sections:
            check_generation(report, "smoke" if args.smoke else "qwen2.5-0.5b", args.smoke, Path(workdir))
    failed = [r for r in report.records if r["section"] == "scripts" and not r["ok"]]
    print(f"wrote {out}/results.json and results.md; {len(failed)} script check(s) failed")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
