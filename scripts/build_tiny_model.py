"""Rebuild the shipped tiny offline models in ``common/tiny_model/`` and ``common/tiny_code_model/`` (no network,
~2 min each on 2 CPU cores).

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

    python scripts/build_tiny_model.py                       # the shipped default
    python scripts/build_tiny_model.py --task code-expr      # common/tiny_code_model
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
from common.data import TINY_CODE_MODEL_DIR, TINY_MODEL_DIR, format_prompt, load_problems  # noqa: E402
from common.tasks import ARITH_SPECS, CODE_SPECS, corrupt_code_solution  # noqa: E402

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
    common/tiny_code_model for a code task"""
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
    boilerplate ``a,b=map(int,input().split())`` then takes a few tokens)"""


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
    code_task = args.task in CODE_SPECS
    if code_task and args.corrupt != "answer":
        raise SystemExit(f"--corrupt {args.corrupt}: a code task's demonstrations are corrupted by 'answer' only")
    out = Path(args.out or (TINY_CODE_MODEL_DIR if code_task else TINY_MODEL_DIR))
    train = load_problems(args.task, "train")
    test = load_problems(args.task, "test")

    # tokenizer: train, save, and reload through AutoTokenizer to prove the round trip
    corpus = [f"user\n{p['prompt']}assistant\n{p['solution']}" for p in train[:5000]]
    merges = args.bpe_merges if args.bpe_merges is not None else (96 if code_task else 24)
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

    for step in range(args.sft_steps):
        batch = rng.sample(train, args.batch_size)
        prompts = [format_prompt(p["prompt"], "chat", tokenizer) for p in batch]
        targets = [demonstration(p) + tokenizer.eos_token for p in batch]
        prompt_ids = [tokenizer(x)["input_ids"] for x in prompts]
        target_ids = [tokenizer(x)["input_ids"] for x in targets]
        width = max(len(a) + len(b) for a, b in zip(prompt_ids, target_ids))
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (a, b) in enumerate(zip(prompt_ids, target_ids)):  # right padding for SFT
            input_ids[i, : len(a) + len(b)] = torch.tensor(a + b)
            labels[i, len(a) : len(a) + len(b)] = torch.tensor(b)
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


def write_code_readme(out: Path, args: Args, model, tokenizer) -> None:
    """The model card: the exact command (every flag that differs from its default), the model, the warm start."""
    spec, defaults = CODE_SPECS[args.task], Args()
    flags = "".join(
        f" --{name.replace('_', '-')} {value}"
        for name, value in vars(args).items()
        if name != "out" and value != getattr(defaults, name)
    )
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
