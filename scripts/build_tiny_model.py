"""Rebuild the shipped tiny offline models in ``common/tiny_model/``, ``common/tiny_code_model/`` and
``common/tiny_tool_model/`` (no network, ~2 min each on 2 idle CPU cores; the tool model's 1000 steps ~10 min).

1. Tokenizer: a byte-level BPE trained locally on the task's text, in exactly the Qwen2 layout (NFC
   normaliser, Qwen split regex, ByteLevel) because transformers 5.x reloads any ``qwen2`` tokenizer as
   ``Qwen2Tokenizer`` from vocab + merges; a differently built tokenizer would reload silently broken.
2. Model: ``Qwen2ForCausalLM`` (hidden 128, 4 layers, 4 heads, tied embeddings, ~1.1M parameters).
3. Warm start: supervised training on worked solutions of the ``arith`` task in which the final
   ``\\boxed{}`` answer is corrupted by ±1..3 in half of the examples ("noisy demonstrations"). The model
   learns the arithmetic, and also learns to copy a wrong final answer about half the time: its sampled
   accuracy lands in the RL regime, and a verifiable reward can fix the habit quickly. Held-out problems
   are never corrupted.
   For a code task (``code-expr``) the demonstrations are programs, and a corrupted one has one operator, variable,
   constant or max/min of its printed expression swapped, so that it fails at least one hidden test.
   For the tool task (``arith-tool``) nothing is corrupted: a demonstration calls the calculator (``--tool-call-prob``;
   a share ``--tool-malformed-prob`` of the calls is malformed and refused) or answers directly, which the model cannot
   do in its head. Each segment is encoded on its own as the tool loop encodes it, and the calculator's output fence is
   left out of the loss, as the scripts' loss mask leaves observations out. The build then measures the warm start
   through the tool loop (``measure_tool_warm_start``) and writes the figures into the model card.

    python scripts/build_tiny_model.py                       # the shipped default
    python scripts/build_tiny_model.py --task code-expr      # common/tiny_code_model
    python scripts/build_tiny_model.py --task arith-tool --sft-steps 1000   # common/tiny_tool_model
    python scripts/build_tiny_model.py --task arith-tool --measure-only   # re-measure the shipped tool model
    python scripts/build_tiny_model.py --hidden 64 --layers 2 --sft-steps 0 --out /tmp/untrained64
"""

from __future__ import annotations

import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.data import (  # noqa: E402
    TINY_CODE_MODEL_DIR,
    TINY_MODEL_DIR,
    TINY_TOOL_MODEL_DIR,
    format_prompt,
    load_problems,
)
from common.tasks import (  # noqa: E402
    ARITH_SPECS,
    CODE_SPECS,
    TOOL_ARITH_SPECS,
    TOOL_DEMONSTRATIONS,
    corrupt_code_solution,
    sample_tool_demonstration,
    tool_arith_segments,
)

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Args:
    out: str = ""
    """output folder (model, tokenizer, generation config); '' = the shipped one: common/tiny_model, or
    common/tiny_code_model for a code task, common/tiny_tool_model for the tool task"""
    task: str = "arith"
    """synthetic task whose worked solutions are the SFT data"""
    seed: int = 0
    """seed for weights, data and noise"""
    hidden: int = 128
    """hidden size"""
    layers: int = 4
    """transformer layers"""
    sft_steps: int = 400
    """supervised warm-start steps (0 leaves the model untrained, for plumbing tests)"""
    batch_size: int = 64
    """SFT batch size"""
    lr: float = 1e-3
    """SFT learning rate (AdamW, 50 warmup steps, then constant)"""
    wrong_answer_prob: float = 0.5
    """fraction of SFT demonstrations that are corrupted by ±1..3 (see ``corrupt``)"""
    corrupt: Literal["answer", "step"] = "answer"
    """what a corrupted demonstration gets wrong: the final boxed answer, or one intermediate result (the later
    steps carry on from the wrong total); for a code task 'answer' is the program's output (one token of the
    printed expression swapped)"""
    bpe_merges: int | None = None
    """BPE merges learned on top of the 256 byte symbols (None = the task's: 24 for arith, 96 for a code task, whose
    boilerplate ``a,b=map(int,input().split())`` then takes a few tokens, 48 for the tool task's fences)"""
    tool_call_prob: float = 0.4
    """tool task: fraction of SFT demonstrations that call the calculator (the rest answer directly)"""
    tool_malformed_prob: float = 0.15
    """tool task: fraction of those calls written malformed (``347x29``: an error observation, then a guess)"""
    measure_only: bool = False
    """tool task: measure the warm start already in --out (or the shipped folder) through the tool loop; no build"""


def build_tokenizer(texts: list[str], num_merges: int) -> PreTrainedTokenizerFast:
    """A Qwen2-layout byte-level BPE trained on ``texts``; each digit stays its own token (Qwen regex)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + len(specials) + num_merges,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        chat_template=CHATML,
        model_max_length=256,
    )


def corrupt(solution: str, answer: str, rng: random.Random) -> str:
    """Replace the boxed answer with answer ± 1..3."""
    wrong = int(answer) + rng.choice([-3, -2, -1, 1, 2, 3])
    return solution.replace(f"\\boxed{{{answer}}}", f"\\boxed{{{wrong}}}")


STEP = re.compile(r"^(-?\d+)([+-])(\d+)=(-?\d+)$")  # "11-2=9"; a restatement "9=9" does not match


def corrupt_step(solution: str, rng: random.Random) -> str:
    """One intermediate result off by ±1..3, every later step (restatements and the box too) carried on from it.

    ``4+7=11;11-2=9;\\boxed{9}`` may become ``4+7=13;13-2=11;\\boxed{11}``.
    """
    *steps, box = solution.split(";")
    parsed = [STEP.match(s) for s in steps]
    wrong_at = rng.choice([i for i, m in enumerate(parsed) if m])
    out, total = [], None
    for i, match in enumerate(parsed):
        if match is None:  # a restatement of the running total
            out.append(f"{total}={total}")
            continue
        left, op, x = (int(match.group(1)) if total is None else total), match.group(2), int(match.group(3))
        total = left + x if op == "+" else left - x
        if i == wrong_at:
            total += rng.choice([-3, -2, -1, 1, 2, 3])
        out.append(f"{left}{op}{x}={total}")
    assert box.startswith("\\boxed{"), f"unexpected solution tail {box!r}"
    return ";".join(out) + f";\\boxed{{{total}}}"


def main() -> None:
    args = tyro.cli(Args)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rng = random.Random(args.seed)
    code_task, tool_task = args.task in CODE_SPECS, args.task in TOOL_ARITH_SPECS
    if code_task and args.corrupt != "answer":
        raise SystemExit(f"--corrupt {args.corrupt}: a code task's demonstrations are corrupted by 'answer' only")
    if tool_task and args.corrupt != "answer":
        raise SystemExit(f"--corrupt {args.corrupt}: the tool task's demonstrations are not corrupted")
    if args.measure_only and not tool_task:
        raise SystemExit("--measure-only measures a tool task's warm start (--task arith-tool)")
    out = Path(args.out or (TINY_CODE_MODEL_DIR if code_task else TINY_TOOL_MODEL_DIR if tool_task else TINY_MODEL_DIR))
    if args.measure_only:
        tokenizer, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
        print(format_tool_figures(measure_tool_warm_start(model, tokenizer, args.task)))
        return
    train = load_problems(args.task, "train")
    test = load_problems(args.task, "test")

    # tokenizer: train, save, and reload through AutoTokenizer to prove the round trip
    corpus = [f"user\n{p['prompt']}assistant\n{p['solution']}" for p in train[:5000]]
    if tool_task:  # every kind of demonstration, so the merges cover the output fence and the direct answer too
        corpus = [
            f"user\n{p['prompt']}assistant\n" + "".join(t for t, _ in tool_arith_segments(p, kind))
            for p, kind in zip(train[:5000], TOOL_DEMONSTRATIONS * 5000)
        ]
    merges = args.bpe_merges if args.bpe_merges is not None else (96 if code_task else 48 if tool_task else 24)
    build_tokenizer(corpus, merges).save_pretrained(out)
    config = Qwen2Config(
        vocab_size=256 + 3 + merges,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    config.save_pretrained(out)  # AutoTokenizer dispatches on config.json's model_type: save it first
    tokenizer = AutoTokenizer.from_pretrained(out)
    for p in test[:50] + train[:50]:
        text = format_prompt(p["prompt"], "chat", tokenizer) + p["solution"]
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text, f"tokenizer round trip failed on {text!r}"
    config.vocab_size = len(tokenizer)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    model = AutoModelForCausalLM.from_config(config)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)}")

    # warm start: SFT on noisy demonstrations, loss on completion tokens only
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50))
    model.train()
    start = time.time()

    def demonstration(p: dict) -> str:  # the worked solution, corrupted with probability wrong_answer_prob
        if rng.random() >= args.wrong_answer_prob:
            return p["solution"]
        if code_task:
            return corrupt_code_solution(p, rng)
        return (
            corrupt(p["solution"], p["answer"], rng) if args.corrupt == "answer" else corrupt_step(p["solution"], rng)
        )

    def encode_target(p: dict) -> tuple[list[int], list[int]]:
        """The demonstration's ids and its loss mask (0 on a tool observation), EOS at the end."""
        if not tool_task:
            ids = tokenizer(demonstration(p) + tokenizer.eos_token)["input_ids"]
            return ids, [1] * len(ids)
        # each segment encoded on its own, as the tool loop encodes a sampled turn and the observation it appends
        ids, mask = [], []
        segments = sample_tool_demonstration(p, rng, args.tool_call_prob, args.tool_malformed_prob)
        for text, observation in segments + [(tokenizer.eos_token, False)]:
            seg = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += seg
            mask += [0 if observation else 1] * len(seg)
        return ids, mask

    for step in range(args.sft_steps):
        batch = rng.sample(train, args.batch_size)
        prompts = [format_prompt(p["prompt"], "chat", tokenizer) for p in batch]
        prompt_ids = [tokenizer(x)["input_ids"] for x in prompts]
        target_ids, loss_masks = zip(*(encode_target(p) for p in batch))
        width = max(len(a) + len(b) for a, b in zip(prompt_ids, target_ids))
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (a, b, m) in enumerate(zip(prompt_ids, target_ids, loss_masks)):  # right padding for SFT
            input_ids[i, : len(a) + len(b)] = torch.tensor(a + b)
            labels[i, len(a) : len(a) + len(b)] = torch.tensor([t if keep else -100 for t, keep in zip(b, m)])
            attention[i, : len(a) + len(b)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % 50 == 0 or step == args.sft_steps - 1:
            print(f"sft step {step:4d}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)

    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if tool_task:
        figures = measure_tool_warm_start(model, tokenizer, args.task)
        print(format_tool_figures(figures))
        write_tool_readme(out, args, model, tokenizer, figures)
        print(f"saved to {out} after {time.time() - start:.0f}s of SFT and measuring")
        return
    if code_task:
        write_code_readme(out, args, model, tokenizer)
        print(f"saved to {out} after {time.time() - start:.0f}s of SFT")
        return
    spec = ARITH_SPECS[args.task]
    (out / "README.md").write_text(
        f"# tiny offline model\n\nBuilt by `python scripts/build_tiny_model.py` (seed {args.seed}): "
        f"Qwen2 architecture, hidden {args.hidden}, {args.layers} layers, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, "
        f"byte-level BPE vocab {len(tokenizer)}.\nWarm start: {args.sft_steps} SFT steps x batch {args.batch_size} on "
        f"`{args.task}` worked solutions ({spec.n_terms} operands in 0..{spec.max_operand}), with the "
        f"{'final answer' if args.corrupt == 'answer' else 'one intermediate result'} corrupted by ±1..3 in "
        f"{args.wrong_answer_prob:.0%} of the demonstrations.\n"
    )
    print(f"saved to {out} after {time.time() - start:.0f}s of SFT")


def command_flags(args: Args) -> str:
    """The flags of the exact build command: every one that differs from its default (``--out`` aside)."""
    defaults = Args()
    return "".join(
        f" --{name.replace('_', '-')} {value}"
        for name, value in vars(args).items()
        if name != "out" and value != getattr(defaults, name)
    )


def measure_tool_warm_start(model, tokenizer, task: str, n: int = 4, max_new_tokens: int = 40, seed: int = 0) -> dict:
    """The tool task's warm start on its held-out split, through the tool loop the scripts run
    (``generate_with_tools`` on the HF engine, ``--tools.format python --tools.tool calculator``, the scripts' default
    40 sampled tokens): ``n`` samples per problem at temperature 1 and one greedy, scored by the task's exact-match
    verifier. Returns the accuracies overall, given a call, given a call that ran without error and given no call,
    the call rate, the per-call error rate, and the greedy accuracy and call rate."""
    from common.rollout import HFEngine
    from common.tool_loop import ToolConfig, generate_with_tools, tool_metrics
    from common.verifiers import exact_reward

    problems = load_problems(task, "test")
    prompts = [tokenizer(format_prompt(p["prompt"], "chat", tokenizer))["input_ids"] for p in problems]
    engine, cfg = HFEngine(model, tokenizer), ToolConfig(format="python", tool="calculator")
    figures: dict = {"problems": len(problems), "n": n, "max_new_tokens": max_new_tokens, "seed": seed}
    for kind, samples, temperature in (("sampled", n, 1.0), ("greedy", 1, 0.0)):
        completions, stats = generate_with_tools(
            engine, tokenizer, prompts, samples, max_new_tokens, temperature, 1.0, seed, (), cfg, context_len=256
        )
        golds = [p["answer"] for p in problems for _ in range(samples)]
        correct = [
            exact_reward(tokenizer.decode(c.token_ids, skip_special_tokens=True), gold).correct
            for c, gold in zip(completions, golds)
        ]
        called = [s.calls > 0 for s in stats]
        clean = [s.calls > 0 and s.errors == 0 for s in stats]

        def share(flags: list[bool], where: list[bool]) -> float | None:
            picked = [f for f, w in zip(flags, where) if w]
            return sum(picked) / len(picked) if picked else None

        metrics = tool_metrics(stats)
        figures[kind] = {
            "accuracy": sum(correct) / len(correct),
            "call_rate": metrics["tools/call_rate"],
            "error_rate": metrics["tools/error_rate"],
            "accuracy_given_call": share(correct, called),
            "accuracy_given_clean_call": share(correct, clean),
            "accuracy_given_no_call": share(correct, [not c for c in called]),
            "samples": len(correct),
            "calls": sum(s.calls for s in stats),
        }
    return figures


def format_tool_figures(figures: dict) -> str:
    """The measured warm start as markdown table rows (one per pass)."""
    pct = lambda x: "n/a" if x is None else f"{x:.1%}"  # noqa: E731
    rows = [
        "| pass | accuracy | call rate | accuracy given a call | given an error-free call | given no call | "
        "tool error rate (per call) |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in ("sampled", "greedy"):
        f = figures[kind]
        label = f"temperature 1, {figures['n']} per problem" if kind == "sampled" else "greedy, 1 per problem"
        rows.append(
            f"| {label} ({f['samples']} samples) | {pct(f['accuracy'])} | {pct(f['call_rate'])} | "
            f"{pct(f['accuracy_given_call'])} | {pct(f['accuracy_given_clean_call'])} | "
            f"{pct(f['accuracy_given_no_call'])} | {pct(f['error_rate'])} |"
        )
    return "\n".join(rows)


def write_tool_readme(out: Path, args: Args, model, tokenizer, figures: dict) -> None:
    """The tool model's card: the exact command, the model, the warm start and its measured figures."""
    spec = TOOL_ARITH_SPECS[args.task]
    (out / "README.md").write_text(
        f"# tiny offline tool model\n\nBuilt by `python scripts/build_tiny_model.py{command_flags(args)}` "
        f"(seed {args.seed}): Qwen2 architecture, hidden {args.hidden}, {args.layers} layers, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, byte-level BPE vocab {len(tokenizer)}.\n"
        f"Warm start: {args.sft_steps} SFT steps x batch {args.batch_size} on `{args.task}` products "
        f"({spec.min_left}..{spec.max_left} times {spec.min_right}..{spec.max_right}). "
        f"{args.tool_call_prob:.0%} of the demonstrations call the calculator in a python block "
        f"(`347*29`, then the output fence the tool loop appends, then `\\boxed{{10063}}`), and "
        f"{args.tool_malformed_prob:.0%} of those calls are malformed (`347x29`: the calculator answers "
        f"`Error: invalid expression`, then the true answer as a guess); the rest answer `\\boxed{{10063}}` directly. "
        f"Each segment is encoded on its own, as the tool loop encodes it; the output fences are left out of the "
        f"loss.\nUse it as `--model tiny-tool --dataset {args.task} --tools.format python --tools.tool calculator`."
        f"\n\n## Measured warm start\n\nHeld-out split ({figures['problems']} problems), through the tool loop "
        f"(`generate_with_tools` on the HF engine, calculator, {figures['max_new_tokens']} sampled tokens, seed "
        f"{figures['seed']}), exact match; `python scripts/build_tiny_model.py --task {args.task} --measure-only` "
        f"measures it again:\n\n{format_tool_figures(figures)}\n"
    )


def write_code_readme(out: Path, args: Args, model, tokenizer) -> None:
    """The model card: the exact command (every flag that differs from its default), the model, the warm start."""
    spec = CODE_SPECS[args.task]
    flags = command_flags(args)
    (out / "README.md").write_text(
        f"# tiny offline code model\n\nBuilt by `python scripts/build_tiny_model.py{flags}` "
        f"(seed {args.seed}): Qwen2 architecture, hidden "
        f"{args.hidden}, {args.layers} layers, {sum(p.numel() for p in model.parameters()):,} parameters, byte-level "
        f"BPE vocab {len(tokenizer)}.\nWarm start: {args.sft_steps} SFT steps x batch {args.batch_size} on "
        f"`{args.task}` programs (read 2..{spec.max_vars} integers, print an expression of them; "
        f"{spec.num_tests} hidden stdin/stdout tests each), with one token of the printed expression swapped "
        f"(an operator, variable, constant or max/min; the program then fails at least one hidden test) in "
        f"{args.wrong_answer_prob:.0%} of the demonstrations.\nUse it as `--model tiny-code` with "
        f"`--dataset {args.task}`.\n"
    )


if __name__ == "__main__":
    main()
