"""Held-out evaluation: mean@n, unbiased pass@k, response length and truncation rate.

The evaluation protocol (template, temperature, top_p, max new tokens, n, k, problem count) is the
``EvalConfig`` below and nowhere else; every script embeds it as ``--eval.*`` flags and writes it into
``config.json``, so every result states how it was measured.

    python -m common.evaluate --model runs/grpo__arith__1/final --dataset arith --eval.n 8 --eval.k 1 8

pass@k uses the unbiased estimator of Chen et al. 2021 (Codex, eq. 1): with n samples of which c are
correct, pass@k = 1 - C(n-c, k) / C(n, k), averaged over problems. mean@n is the mean correctness of the
n samples (pass@1 estimated from n samples). "greedy" is one temperature-0 sample per problem.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from tqdm.auto import tqdm

from common.rollout import RolloutConfig, prompt_seeds
from common.tool_loop import ToolConfig, gathered_tool_metrics, generate_with_tools

EVAL_SEED = 12345  # the sampling seed of every held-out evaluation, during training and from the command line
TRAINING_MAX_NEW_TOKENS = 40  # the scripts' --max-new-tokens default: the token budget when nothing else sets one


@dataclass
class EvalConfig:
    """The evaluation protocol (``--eval.*`` flags)."""

    dataset: str = ""
    """held-out dataset ('' = the training dataset's held-out split)"""
    template: str = ""
    """prompt template ('' = the dataset's default)"""
    n: int = 4
    """samples per problem for mean@n and pass@k"""
    k: tuple[int, ...] = (1, 4)
    """k values for pass@k (each <= n)"""
    temperature: float = 1.0
    """sampling temperature of the n samples"""
    top_p: float = 1.0
    """nucleus sampling threshold of the n samples"""
    max_new_tokens: int = 0
    """token budget per completion (0 = the training run's --max-new-tokens)"""
    max_problems: int = 200
    """evaluate on at most this many problems (0 = all), always the first ones, so runs compare"""
    greedy: bool = True
    """also score one greedy (temperature 0) completion per problem"""


def describe_protocol(cfg: EvalConfig, name: str, template: str, seed: int) -> str:
    """One line stating how ``name`` is evaluated, printed by training runs and by ``python -m common.evaluate``."""
    greedy = " + 1 greedy" if cfg.greedy else ""
    problems = f"first {cfg.max_problems} problems" if cfg.max_problems else "all problems"
    return (
        f"eval protocol: {name} ({problems}), template {template}, n {cfg.n}{greedy}, pass@k k {list(cfg.k)}, "
        f"temperature {cfg.temperature}, top_p {cfg.top_p}, max_new_tokens {cfg.max_new_tokens}, seed {seed}"
    )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i), stable for large n
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def score_groups(correct: list[bool], n: int, ks: tuple[int, ...]) -> dict[str, float]:
    """mean@n and pass@k from a flat correctness list grouped n per problem."""
    if len(correct) % n:
        raise ValueError(f"{len(correct)} results do not split into groups of n={n}")
    groups = [correct[i : i + n] for i in range(0, len(correct), n)]
    out = {f"mean@{n}": sum(correct) / len(correct)}
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(g), k) for g in groups) / len(groups)
    return out


def evaluate(
    engine,
    tokenizer,
    problems: list[dict],
    reward_fn: str,
    template: str,
    cfg: EvalConfig,
    seed: int,
    name: str,
    stop: tuple[str, ...] = (),
    max_prompt_tokens: int | None = None,
    rank: int = 0,
    world: int = 1,
    gather: Callable[[list], list] | None = None,
    tools: ToolConfig | None = None,
    context_len: int = 0,
) -> dict[str, float]:
    """Generate on ``problems`` with ``engine`` and return ``eval/<name>/...`` metrics.

    ``reward_fn`` names the verifier (a key of ``common.verifiers.REWARD_FNS``) that decides correctness; ``stop``
    holds the template's stop strings. A prompt over ``max_prompt_tokens`` is an error naming it.

    Sharded over processes: process ``rank`` of ``world`` generates and grades its contiguous share of the problems,
    with the per-problem seeds it would have in a one-process run (so the samples do not depend on ``world``), and
    ``gather`` (a list from every process, concatenated in rank order) brings the results together; every process
    returns the metrics of the whole set.

    ``tools`` (``--tools.*``): sample through the tool loop (``common/tool_loop.py``), as training does, with
    ``context_len`` the engine's context; the sampled pass also logs the loop's ``tools/*`` metrics under
    ``eval/<name>/``. None, or format 'none': single-turn samples.
    """
    from common.data import format_prompt
    from common.verifiers import compute_rewards, drain_reward_stats

    if cfg.max_problems:
        problems = problems[: cfg.max_problems]
    if cfg.max_new_tokens <= 0:
        raise ValueError("evaluate: cfg.max_new_tokens must be resolved to a positive budget by the caller")
    if any(k > cfg.n for k in cfg.k):
        raise ValueError(f"--eval.k {cfg.k}: every k must be <= --eval.n {cfg.n}")
    seeds = prompt_seeds(seed, len(problems))
    lo, hi = rank * len(problems) // world, (rank + 1) * len(problems) // world
    problems, seeds = problems[lo:hi], seeds[lo:hi]
    prompt_ids = [tokenizer(format_prompt(p["prompt"], template, tokenizer))["input_ids"] for p in problems]
    for i, ids in enumerate(prompt_ids):
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            raise ValueError(
                f"{name} problem {lo + i}: its prompt of {len(ids)} tokens exceeds the prompt budget of "
                f"{max_prompt_tokens} (--max-prompt-tokens, capped by the model's positions minus the token budget)"
            )
    metrics: dict[str, float] = {}
    passes = [("sampled", cfg.n, cfg.temperature)] + ([("greedy", 1, 0.0)] if cfg.greedy else [])
    for kind, n, temperature in tqdm(passes, desc=f"eval {name}", leave=False, disable=None):
        completions, tool_stats = generate_with_tools(
            engine,
            tokenizer,
            prompt_ids,
            n,
            cfg.max_new_tokens,
            temperature,
            cfg.top_p,
            seeds,
            stop,
            tools,
            context_len=context_len,
        )
        if kind == "sampled" and tools is not None and tools.format != "none":
            metrics.update(
                {f"eval/{name}/{key}": value for key, value in gathered_tool_metrics(tool_stats, gather).items()}
            )
        texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        golds = [p["answer"] for p in problems for _ in range(n)]
        results = [
            (r.correct, len(c.token_ids), c.finish_reason == "length")
            for r, c in zip(compute_rewards(reward_fn, texts, golds), completions)
        ]
        code_stats = drain_reward_stats()  # this pass's verifier metrics (code rewards), not the next train step's
        if kind == "sampled":
            metrics.update({f"eval/{name}/{key}": value for key, value in code_stats.items()})
        if gather is not None:
            results = gather(results)
        correct = [r[0] for r in results]
        if kind == "greedy":
            metrics[f"eval/{name}/greedy"] = sum(correct) / len(correct)
            continue
        metrics.update({f"eval/{name}/{key}": value for key, value in score_groups(correct, n, cfg.k).items()})
        metrics[f"eval/{name}/response_len"] = sum(r[1] for r in results) / len(results)
        metrics[f"eval/{name}/truncation_rate"] = sum(r[2] for r in results) / len(results)
    return metrics


@dataclass
class EvalArgs:
    """Evaluate a saved model (``python -m common.evaluate``)."""

    model: str = "tiny"
    """model folder or hub id ('tiny' = the shipped offline model)"""
    dataset: str = "arith"
    """dataset name (see common/data.py) or jsonl:<path>"""
    split: str = ""
    """split to evaluate ('' = the dataset's held-out split)"""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """the evaluation protocol (--eval.max-new-tokens 0 = the run's --max-new-tokens from the config.json beside the
    model folder, as in runs/<name>/final, else the scripts' default of 40: the training-time protocol either way)"""
    seed: int = EVAL_SEED
    """sampling seed (the one training-time evaluation uses)"""
    device: str = "auto"
    """'auto', 'cpu' or 'cuda'"""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """generation engine ('auto' = vLLM on a CUDA machine with vllm installed, else Hugging Face)"""
    tools: ToolConfig = field(default_factory=ToolConfig)
    """tool-integrated sampling, as the run trained with (--tools.format python --tools.tool calculator, ...)"""


def run_token_budget(model_path: str) -> int:
    """The ``max_new_tokens`` a model folder was trained with: read from the run's ``config.json`` one level up
    (``runs/<name>/final`` beside ``runs/<name>/config.json``), else ``TRAINING_MAX_NEW_TOKENS``."""
    import json
    from pathlib import Path

    run_config = Path(model_path).parent / "config.json"
    try:
        recorded = json.loads(run_config.read_text())
        return int(recorded.get("eval", {}).get("max_new_tokens") or recorded["max_new_tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return TRAINING_MAX_NEW_TOKENS


def main() -> None:
    import dataclasses
    import json
    import sys

    import torch
    import tyro
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.data import STOP_STRINGS, check_template, dataset_info, format_prompt, load_problems, resolve_model_path
    from common.rollout import make_engine

    args = tyro.cli(EvalArgs)
    info = dataset_info(args.dataset)  # names are checked before any weights load
    template = args.eval.template or info.default_template
    check_template(template, "--eval.template")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    path = resolve_model_path(args.model)
    args.eval = dataclasses.replace(args.eval, max_new_tokens=args.eval.max_new_tokens or run_token_budget(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).to(device)
    problems = load_problems(args.dataset, args.split or info.eval_split)
    if args.eval.max_problems:
        problems = problems[: args.eval.max_problems]
    longest_prompt = max(len(tokenizer(format_prompt(p["prompt"], template, tokenizer))["input_ids"]) for p in problems)
    max_model_len = longest_prompt + args.eval.max_new_tokens
    limit = getattr(model.config, "max_position_embeddings", None)
    if args.tools.format != "none":  # observations take positions too; a sample reaching the context ends "length"
        args.tools.check()
        max_model_len = min(longest_prompt + args.tools.total_budget(args.eval.max_new_tokens), limit or 1 << 62)
    if limit is not None and max_model_len > limit:
        raise SystemExit(
            f"the longest prompt ({longest_prompt} tokens) + --eval.max-new-tokens {args.eval.max_new_tokens} exceeds "
            f"the model's {limit} positions (max_position_embeddings)"
        )
    engine = make_engine(args.rollout, model, tokenizer, path, args.seed, max_model_len=max_model_len)
    stop = STOP_STRINGS.get(template, ())
    print(describe_protocol(args.eval, args.dataset, template, args.seed), file=sys.stderr)
    metrics = evaluate(
        engine,
        tokenizer,
        problems,
        info.reward_fn,
        template,
        args.eval,
        args.seed,
        args.dataset,
        stop,
        tools=args.tools,
        context_len=max_model_len,
    )
    print(
        json.dumps({"model": args.model, "dataset": args.dataset, "protocol": vars(args.eval), **metrics}, default=list)
    )


if __name__ == "__main__":
    main()
