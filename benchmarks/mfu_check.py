"""The learner's MFU on one GPU, variant by variant (issue 41): every variant in one process, one prepared call.

    python benchmarks/mfu_check.py                   # on a CUDA machine: every variant on both target rows (~4 min)
    python benchmarks/mfu_check.py --smoke           # the same code on the CPU with a tiny shape (CI, seconds)
    python benchmarks/mfu_check.py --variants before baseline head=bf16x3 attention=varlen,compile=layers --rows 1.5b

Each row is the learner step of ``python algos/grpo.py``, on random weights of a Qwen2.5 shape from
common/model_configs/ (no download). The step is a forward through ``common.logprobs.token_logprobs`` (with entropy,
under bf16 autocast over fp32 weights), a GRPO-style surrogate loss and its ``.item()``, the backward,
``clip_grad_norm_`` and an AdamW step. The two rows are the issue's targets:
  1.5b   qwen2.5-1.5b, full fine-tuning, one micro-batch of 4 x 4096 tokens, gradient checkpointing
  7b     qwen2.5-7b, LoRA rank 16 on every linear layer of a frozen base, 1 x 4096 tokens, gradient checkpointing
The same rows come from ``gpu_check.sequence_lengths`` / ``learner_batch``: padded rows with one pad position, the
way the scripts lay them out.

Variants. ``baseline`` is the scripts' settings on this device; ``before`` the settings before issue 41 (foreach
AdamW, a fp32 LoRA base). Every other variant is ``key=value[,key=value]`` changes to the baseline, each through
the code in ``common/`` the scripts run:
  head=fp32|bf16|bf16-fp32-out|bf16x3|tf32   the LM head's precision (``token_logprobs(fp32_head=...)``,
                                            common/head_precision.py; the scripts: fp32 on the CPU, bf16 on CUDA,
                                            bf16x3 on CUDA with --rollout.fp32-lm-head on)
  optimizer=default|fused|foreach           AdamW (default: the scripts', ``Run.prepare``'s ``fuse_adamw``: fused
                                            on CUDA)
  layout=padded|packed                      packed: one flat row, ``token_logprobs(packed=True)``
  attention=auto|sdpa|eager|flex|varlen     the attention kernel (auto: the scripts' choice for the layout,
                                            ``common.packing.attention_implementation``; varlen: common/attention.py,
                                            padded rows then run packed; flex: transformers' flex_attention)
  lora-base=fp32|bf16                       the frozen LoRA base's matmuls (bf16: ``hold_frozen_linears_in_bf16``,
                                            the scripts' on CUDA)
  checkpointing=full|op|every-2|off         ``common.learner_speed.enable_checkpointing``'s policies, or none
  compile=off|layers                        ``common.learner_speed.compile_layers`` (the smoke run: dynamo's eager
                                            backend, the same graph capture without inductor's compile time)
On the CPU flex attention has no backward: its smoke variant times the forward alone (status "ok (forward only)"),
on the first row only (each compiles for ~20 s on a CPU).
Each head variant also records the head's share of ``train/logprob_gap`` against each vLLM head (``head_gap``: mean
|log-prob difference| over the row's completion tokens between this head and vLLM's bf16 head, 'off', and its fp32
head, bf16-fp32-out, 'on', on the same decoder output), the pairing table of docs/gpu.md in numbers.

Per variant: step seconds (forward + backward + clip + AdamW, median of ``--steps``), tokens/s, MFU on prime-rl's
convention and HFU with recomputation (``gpu_check.learner_flops``, docs/gpu.md "MFU: the convention"), the gap to
40% MFU, and peak memory. One more step runs under ``torch.profiler``, its time grouped by kernel category: head
(any op on a vocab-sized dimension), attention, GEMM, elementwise (norms, RoPE, SwiGLU, casts, ...), optimiser
(clip and AdamW), other. Results go to ``--out`` (default benchmarks/results/gpu/mfu/, or runs/mfu_check_smoke/
with --smoke) as results.json and results.md, rewritten after each variant, so a cut-off run keeps what it
measured. A time budget (``--budget-s``, shared out evenly between the rows) stops starting new variants in time
for the device call's limit; the variants are listed most telling first. The
smoke run times one step per variant with no warm-up and profiles each row's first variant only (the profiler's
start-up is seconds on a CPU).

On an offline GPU machine: ``bash scripts/gpu_check_wheels.sh`` here, plus the transformers 5.19 wheel, as for
gpu_check (docs/gpu.md, "The GPU check").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import gpu_check  # noqa: E402
from common.attention import register_varlen  # noqa: E402
from common.head_precision import PRECISIONS  # noqa: E402
from common.learner_speed import compile_layers, enable_checkpointing, fuse_adamw, hold_frozen_linears_in_bf16  # noqa: E402
from common.logprobs import token_logprobs  # noqa: E402
from common.packing import attention_implementation  # noqa: E402
from common.rollout import RolloutConfig, use_fp32_head  # noqa: E402

TARGET_MFU = 0.40
# the target rows: (model config, micro-batch, sequence length, checkpointing, LoRA rank)
ROWS = {"1.5b": ("qwen2.5-1.5b", 4, 4096, True, 0), "7b": ("qwen2.5-7b", 1, 4096, True, 16)}
SMOKE_ROWS = {"smoke": ("smoke", 2, 64, True, 0), "smoke-lora": ("smoke", 1, 64, True, 8)}
DEFAULT_VARIANTS = [  # the most telling first: a time budget cuts the list's tail
    "before",
    "baseline",
    "attention=varlen",
    "compile=layers",
    "attention=varlen,compile=layers",
    "checkpointing=op",
    "checkpointing=every-2",
    "attention=varlen,compile=layers,checkpointing=op",
    "head=bf16x3",
    "head=bf16-fp32-out",
    "head=fp32",
    "head=tf32",
    "layout=packed",
    "layout=packed,attention=varlen",
    "layout=packed,attention=flex",
    "optimizer=foreach",
    "lora-base=fp32",
    "checkpointing=off",
    "optimizer=fused",
]
CHOICES = {
    "head": PRECISIONS,
    "optimizer": ("default", "fused", "foreach"),
    "layout": ("padded", "packed"),
    "attention": ("auto", "sdpa", "eager", "flex", "varlen"),
    "lora-base": ("fp32", "bf16"),
    "checkpointing": ("full", "op", "every-2", "off"),
    "compile": ("off", "layers"),
}
ATTENTION_NAMES = {"flex": "flex_attention", "varlen": "varlen"}
CATEGORIES = ("head", "attention", "gemm", "elementwise", "optimiser", "other")
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::_addmm_activation", "aten::bmm", "aten::baddbmm", "aten::mm.dtype"}
ATTENTION_WORDS = ("attention", "sdpa", "flash", "varlen", "flex")


def parse_variant(text: str, device: torch.device) -> dict[str, str]:
    """``baseline``, ``before`` or ``key=value[,key=value]`` -> the full settings: the scripts' own on ``device``,
    changed."""
    cuda = device.type == "cuda"
    settings = {
        "head": "fp32" if use_fp32_head(RolloutConfig(), device) else "bf16",
        "optimizer": "default",
        "layout": "padded",
        "attention": "auto",  # the scripts' kernel for the layout (common.packing.attention_implementation)
        "lora-base": "bf16" if cuda else "fp32",  # load_model's: bf16 under autocast on CUDA
        "checkpointing": "full",
        "compile": "off",
    }
    if text == "baseline":
        return settings
    if text == "before":  # the learner before issue 41: foreach AdamW, an fp32 LoRA base
        return settings | {"optimizer": "foreach", "lora-base": "fp32"}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key not in CHOICES or value not in CHOICES[key]:
            raise SystemExit(f"variant {text!r}: {part!r} is not one of {CHOICES}")
        settings[key] = value
    return settings


def forward_only(settings: dict[str, str], device: torch.device) -> bool:
    """Flex attention has no backward on the CPU: its variants there time the forward alone."""
    return device.type != "cuda" and settings["attention"] == "flex"


def categorise(name: str, shapes: list, vocab: int, in_optimiser: bool) -> str:
    """The kernel category of one profiled op (by its name and input shapes)."""
    lower = name.lower()
    if in_optimiser or "adam" in lower or "_foreach_" in lower or "clip_grad" in lower:
        return "optimiser"
    if not name.startswith("aten::"):
        return "other"
    if "embedding" not in lower and any(vocab in shape for shape in shapes if isinstance(shape, list)):
        return "head"
    if any(word in lower for word in ATTENTION_WORDS) or name in ("aten::bmm", "aten::baddbmm"):
        return "attention"
    if name in ("aten::softmax", "aten::_softmax") and any(len(s) == 4 for s in shapes if isinstance(s, list)):
        return "attention"  # eager attention's probabilities (batch, heads, queries, keys)
    if name in GEMM_OPS:
        return "gemm"
    return "elementwise"


def profile_split(profiles: list[tuple[object, bool]], vocab: int, cuda: bool) -> dict[str, float]:
    """Milliseconds per category of one profiled step: each op's self time on the device (CUDA: the kernels it
    launched; kernels no op claims go to 'other') or on the CPU."""
    split = dict.fromkeys(CATEGORIES, 0.0)
    for prof, in_optimiser in profiles:
        claimed = kernels = 0.0
        for event in prof.key_averages(group_by_input_shape=True):
            on_device = str(getattr(event, "device_type", "")).endswith("CUDA")
            own = getattr(event, "self_device_time_total", None)
            if own is None:
                own = getattr(event, "self_cuda_time_total", 0.0)
            if cuda and on_device:  # a kernel's own entry: counted through the op that launched it
                kernels += own
                continue
            us = own if cuda else event.self_cpu_time_total
            claimed += us
            split[categorise(event.key, event.input_shapes or [], vocab, in_optimiser)] += us
        if cuda:
            split["optimiser" if in_optimiser else "other"] += max(0.0, kernels - claimed)
    return {k: v / 1e3 for k, v in split.items()}


class Results:
    """Variant records, rewritten to results.json and results.md after each."""

    def __init__(self, out: Path, env: dict):
        self.out, self.env, self.records = out, env, []
        out.mkdir(parents=True, exist_ok=True)

    def add(self, record: dict) -> None:
        self.records.append(record)
        (self.out / "results.json").write_text(json.dumps({"env": self.env, "records": self.records}, indent=1))
        (self.out / "results.md").write_text(self.markdown())
        shown = {k: v for k, v in record.items() if k not in ("profile_ms", "settings")}
        print("[mfu] " + json.dumps(shown, default=str), flush=True)

    def markdown(self) -> str:
        env = self.env
        lines = [
            "# Learner MFU by variant (issue 41)",
            "",
            f"Device: {env['device']}; torch {env['torch']}; transformers {env['transformers']}; CUDA {env['cuda']}; "
            f"{env['date']}; commit {env['commit']}; the scripts' head here: {env['scripts_head']}"
            + ("; **smoke run on the CPU: no GPU figure here**" if env["smoke"] else ""),
            "",
            "Regenerate: `python benchmarks/mfu_check.py` (see its docstring). MFU: prime-rl's convention; HFU: with "
            "recomputation (docs/gpu.md, 'MFU: the convention'). Profile: share of one profiled step's time.",
            "",
            "| row | variant | status | tokens/s | step s | MFU | HFU | to 40% | peak GB | "
            + " | ".join(CATEGORIES)
            + " |",
            "|" + "---|" * (9 + len(CATEGORIES)),
        ]
        for r in self.records:
            profile = r.get("profile_ms") or {}
            total = sum(profile.values()) or None
            shares = [f"{100 * profile[c] / total:.0f}%" if total else "–" for c in CATEGORIES]
            cells = [r["row"], r["variant"], r["status"]]
            cells += [
                gpu_check.cell(r.get(k)) for k in ("tokens_per_s", "step_s", "mfu", "hfu", "to_target", "peak_gb")
            ]
            lines.append("| " + " | ".join(cells + shares) + " |")
        return "\n".join(lines) + "\n"


def build_model(config, settings: dict[str, str], checkpointing: bool, lora: int, attention: str, device):
    """Random fp32 weights of ``config`` on ``device``, as ``load_model`` builds the scripts' policy: checkpointing
    by ``enable_checkpointing``'s policy (when the row checkpoints), LoRA adapters on every linear layer of a frozen
    base (held in bf16 with lora-base=bf16), each decoder layer compiled with compile=layers."""
    from transformers import AutoModelForCausalLM

    if attention == "varlen":
        register_varlen()
    with device:  # built on the device: a 7B init on the host would take minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
    if checkpointing and settings["checkpointing"] != "off":
        enable_checkpointing(model, settings["checkpointing"])
    if lora:
        from common.lora import LoraConfig, apply_lora

        model = apply_lora(model, LoraConfig(rank=lora))
        if settings["lora-base"] == "bf16":
            hold_frozen_linears_in_bf16(model)
    model.train()
    if settings["compile"] == "layers":
        # the smoke run captures the same graphs without inductor's minutes of compilation on a CPU
        compile_layers(model, backend="inductor" if device.type == "cuda" else "eager")
    return model


def head_setting(settings: dict[str, str]) -> bool | str:
    """``token_logprobs``' ``fp32_head`` for the variant's head: bf16 is the model's own head (fp32_head False, the
    scripts' CUDA default), any other precision by name."""
    return False if settings["head"] == "bf16" else settings["head"]


def forward_backward(model, batch, settings: dict[str, str], device: torch.device) -> None:
    """grpo.py's update on one micro-batch: the forward with entropy, a surrogate loss (ratio x advantage), the
    backward and the loss's ``.item()`` (the scripts sync on every micro-batch's loss)."""
    input_ids, attention_mask, width, advantages = batch
    mask = attention_mask[:, -width:]
    backward = not forward_only(settings, device)
    with torch.set_grad_enabled(backward), torch.autocast(device.type, dtype=torch.bfloat16):
        logprobs, _entropy = token_logprobs(
            model,
            input_ids,
            attention_mask,
            width,
            1.0,
            with_entropy=True,
            fp32_head=head_setting(settings),
            packed=settings["layout"] == "packed",
        )
    loss = -(torch.exp(logprobs - logprobs.detach()) * advantages[:, None] * mask).sum() / mask.sum()
    if backward:
        loss.backward()
    loss.item()


def head_gap(model, batch, settings: dict[str, str], device: torch.device) -> dict[str, float]:
    """Mean |log-prob difference| over the completion tokens between this variant's head and vLLM's two heads
    (bf16 logits: --rollout.fp32-lm-head off; bf16-fp32-out: on) on the same decoder output, no gradients."""
    input_ids, attention_mask, width, _ = batch
    mask = attention_mask[:, -width:].bool()
    results = {}
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        ours, _ = token_logprobs(model, input_ids, attention_mask, width, 1.0, fp32_head=head_setting(settings))
        for name, vllm in (("vllm_off", False), ("vllm_on", "bf16-fp32-out")):
            theirs, _ = token_logprobs(model, input_ids, attention_mask, width, 1.0, fp32_head=vllm)
            results[name] = (ours - theirs).abs()[mask].float().mean().item()
    return results


def optimiser_step(model, optimizer) -> None:
    """grpo.py's step after the micro-batches: clip the gradient norm (and read it), AdamW, clear the gradients."""
    float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def learner_step(model, optimizer, batch, settings: dict[str, str], device: torch.device) -> None:
    forward_backward(model, batch, settings, device)
    if not forward_only(settings, device):
        optimiser_step(model, optimizer)


def make_optimizer(model, settings: dict[str, str]) -> torch.optim.Optimizer:
    """The scripts' AdamW (defaults, then ``Run.prepare``'s ``fuse_adamw``), or a forced implementation."""
    params = [p for p in model.parameters() if p.requires_grad]
    if settings["optimizer"] == "foreach":
        return torch.optim.AdamW(params, lr=1e-7, foreach=True)
    optimizer = torch.optim.AdamW(params, lr=1e-7)
    # fused: on CUDA as the scripts do; asked for explicitly, on the CPU's fused kernel as well
    fuse_adamw(optimizer, ("cuda", "cpu") if settings["optimizer"] == "fused" else ("cuda",))
    return optimizer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(
    results: Results,
    row: str,
    spec: tuple,
    variants: list[str],
    args,
    device: torch.device,
    workdir: Path,
    started: float,
    budget_s: float,
) -> None:
    """Every variant of one row, the model built once (variants that change it: rebuilt)."""
    name, micro_batch, seq_len, checkpointing, lora = spec
    config, folder = gpu_check.load_config(name, args.smoke, workdir)
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else gpu_check.peak_bf16_flops(results.env["device"])
    model, built_for = None, None
    for variant in variants:
        settings = parse_variant(variant, device)
        record = {"row": row, "model": name, "micro_batch": micro_batch, "seq_len": seq_len, "lora_rank": lora}
        record |= {"variant": variant, "settings": settings}
        if args.smoke and settings["attention"] == "flex" and row != next(iter(SMOKE_ROWS)):
            results.add(record | {"status": "skipped: smoke compiles flex on the first row only"})
            continue
        if time.time() - started > budget_s:
            results.add(record | {"status": "skipped: time budget"})
            continue
        ckpt = settings["checkpointing"] != "off" and checkpointing
        attention = ATTENTION_NAMES.get(settings["attention"], settings["attention"])
        if attention == "auto":
            attention = attention_implementation(device.type, settings["layout"] == "packed")
        record["attention"] = attention
        key = (attention, ckpt, settings["checkpointing"], settings["lora-base"], settings["compile"])
        optimizer = None
        try:
            if built_for != key:
                model = built_for = None  # a failed build leaves no stale model behind
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                model, built_for = build_model(config, settings, ckpt, lora, attention, device), key
            optimizer = make_optimizer(model, settings)
            record["optimizer_impl"] = "fused" if optimizer.param_groups[0]["fused"] else "foreach/default"
            generator = torch.Generator(device=device).manual_seed(0)
            ids, attention_mask, width = gpu_check.learner_batch(
                settings["layout"], micro_batch, seq_len, config.vocab_size, generator, device
            )
            advantages = torch.randn(ids.shape[0], generator=generator, device=device)
            batch = (ids, attention_mask, width, advantages)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            for _ in range(args.warmup):  # AdamW's moments allocated, kernels chosen
                learner_step(model, optimizer, batch, settings, device)
            times = []
            for _ in range(args.steps):
                synchronize(device)
                t0 = time.perf_counter()
                learner_step(model, optimizer, batch, settings, device)
                synchronize(device)
                times.append(time.perf_counter() - t0)
            seconds = statistics.median(times)
            lengths = [int(n) for n in attention_mask.sum(-1).tolist()]
            prompts = gpu_check.prompt_lengths(settings["layout"], micro_batch, seq_len)
            # HFU counts full recomputation only: the selective policies' partial recompute is not credited
            full_recompute = ckpt and settings["checkpointing"] == "full"
            flops = gpu_check.probe_flops(
                folder, settings["layout"], micro_batch, seq_len, full_recompute, lora, lengths, prompts
            )
            status = "ok (forward only)" if forward_only(settings, device) else "ok"
            record |= {"status": status, "step_s": seconds, "tokens_per_s": sum(lengths) / seconds}
            record |= {"model_tflop": flops["model"] / 1e12, "hardware_tflop": flops["hardware"] / 1e12}
            if peak_flops:
                record |= gpu_check.utilisation(flops, seconds, peak_flops)
                record["to_target"] = TARGET_MFU - record["mfu"]
            if device.type == "cuda":
                record["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            if variant == "baseline" or "head=" in variant:
                record["head_gap"] = head_gap(model, batch, settings, device)
            if args.profile == "all" or (
                args.profile == "first" and not any("profile_ms" in r for r in results.records if r["row"] == row)
            ):
                record["profile_ms"] = profiled_step(model, optimizer, batch, settings, device, config.vocab_size)
        except torch.OutOfMemoryError as exc:
            record |= {"status": "error", "error": "OOM: " + str(exc).split("\n")[0][:200]}
        except Exception as exc:  # one variant's failure is a result; the others still run
            record |= {"status": "error", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        finally:
            del optimizer
        results.add(record)


def profiled_step(model, optimizer, batch, settings, device: torch.device, vocab: int) -> dict[str, float]:
    """One more learner step under torch.profiler: the forward + backward and the optimiser apart."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities, record_shapes=True) as body:
        forward_backward(model, batch, settings, device)
        synchronize(device)
    profiles = [(body, False)]
    if not forward_only(settings, device):
        with profile(activities=activities, record_shapes=True) as step:
            optimiser_step(model, optimizer)
            synchronize(device)
        profiles.append((step, True))
    return profile_split(profiles, vocab, device.type == "cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny shape, every variant (what CI runs)")
    parser.add_argument("--rows", nargs="+", default=[], help=f"rows to run (default all: {', '.join(ROWS)})")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="baseline or key=value[,key=value]")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per variant (default 3; 1 with --smoke)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no variant after this many seconds")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="device peak (default: from its name)")
    parser.add_argument("--warmup", type=int, default=-1, help="untimed steps first (default 1; 0 with --smoke)")
    parser.add_argument(
        "--profile", choices=("all", "first", "none"), default="", help="profiled variants (default all; first: smoke)"
    )
    parser.add_argument("--out", default="", help="output folder (default benchmarks/results/gpu/mfu)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --smoke for the CPU check")
    args.steps = args.steps or (1 if args.smoke else 3)
    args.warmup = args.warmup if args.warmup >= 0 else (0 if args.smoke else 1)
    args.profile = args.profile or ("first" if args.smoke else "all")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    rows = SMOKE_ROWS if args.smoke else ROWS
    unknown = [r for r in args.rows if r not in rows]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; rows: {list(rows)}")
    for variant in args.variants:
        parse_variant(variant, device)  # refuse a typo before any model is built
    out = Path(args.out or (REPO / ("runs/mfu_check_smoke" if args.smoke else "benchmarks/results/gpu/mfu")))
    env = gpu_check.environment(args.smoke)
    env |= {"scripts_head": "fp32" if use_fp32_head(RolloutConfig(), device) else "bf16", "target_mfu": TARGET_MFU}
    results = Results(out, env)
    print(f"mfu_check: {env['device']}, torch {env['torch']}, transformers {env['transformers']} -> {out}")
    started = time.time()
    chosen = args.rows or list(rows)
    with tempfile.TemporaryDirectory() as workdir:
        for i, row in enumerate(chosen):  # each row may start variants until its share of the budget is spent
            budget = args.budget_s * (i + 1) / len(chosen)
            measure(results, row, rows[row], args.variants, args, device, Path(workdir), started, budget)
    ran = [r for r in results.records if r["status"].startswith("ok")]
    failed = [r for r in results.records if r["status"] == "error"]
    print(f"wrote {out}/results.json and results.md: {len(ran)} measured, {len(failed)} failed")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
