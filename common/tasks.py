"""The offline synthetic tasks: verifiable problems generated from a seed, no network needed.

``arith`` (the tiny default) is chain arithmetic such as ``4+7-2=?`` with the worked solution
``4+7=11;11-2=9;\\boxed{9}`` and the gold answer ``9``; ``arith-hard`` has one operand more than the shipped model's
warm start saw. Each task's held-out split is disjoint from its train split. ``common/data.py`` registers every
task here by name, scored with the exact-match verifier.

The claims testbed (``benchmarks/suites/claims.toml``) adds two variants built so a paper's mechanism can act:

* ``arith-pad``: the worked solutions restate the running total 0..``max_redundant`` times (``11=11;``) before the
  answer, so a policy warm-started on them (``scripts/build_tiny_model.py --task arith-pad``) chooses its length
  freely; the verifier reads only ``\\boxed{}`` (Dr. GRPO's length bias).
* ``arith-mix``: 3 or 4 operands at random, easy and hard prompts in one batch; its train split excludes
  ``arith-hard``'s held-out problems, the set it is evaluated on (MaxRL's pass@k at large k).
* ``arith-long``: 6 operands, a 5-step worked solution. Its warm start (``--corrupt step``) saw one intermediate
  result wrong in half the demonstrations, the later steps carried on from the wrong total, so a wrong answer
  comes from one token somewhere in the chain: per-token credit has something to find (the dense-credit claim).
* ``arith-pad-long``: ``arith-pad`` with 4 operands and the same step-corrupted warm start, so that wrong answers
  stay common late in training (Dr. GRPO's length claim, redesigned).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

Problem = dict[str, str]  # prompt, answer, solution: see common/data.py


# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ArithSpec:
    """Shape of the synthetic chain-arithmetic task."""

    n_terms: int = 3  # operands per problem (the most, with min_terms)
    max_operand: int = 9  # operands are drawn from 0..max_operand
    min_terms: int = 0  # > 0: each problem draws its operand count from min_terms..n_terms
    max_redundant: int = 0  # > 0: each solution restates the running total 0..max_redundant times (free length)
    exclude_test_of: tuple[str, ...] = ()  # tasks whose held-out prompts this task's train split leaves out


ARITH_SPECS = {
    "arith": ArithSpec(n_terms=3, max_operand=9),  # the tiny default: 1-digit operands
    "arith-hard": ArithSpec(
        n_terms=4, max_operand=9
    ),  # one operand more than the warm start saw: ~3% sampled accuracy (LUFFY demo)
    "arith-pad": ArithSpec(n_terms=3, max_operand=9, max_redundant=6),  # Dr. GRPO claim: length is the policy's choice
    "arith-mix": ArithSpec(n_terms=4, max_operand=9, min_terms=3, exclude_test_of=("arith-hard",)),  # MaxRL claim
    "arith-long": ArithSpec(n_terms=6, max_operand=9),  # dense-credit and asymptote claims: 5 steps, one can go wrong
    "arith-pad-long": ArithSpec(n_terms=4, max_operand=9, max_redundant=6),  # Dr. GRPO, redesigned: errors stay common
}
ARITH_TEST_SIZE = 200  # held-out problems per arith task
ARITH_TEST_SEED = 999
ARITH_TRAIN_SIZE = 20_000
ARITH_TRAIN_SEED = 0


def make_arith_problem(rng: random.Random, spec: ArithSpec) -> Problem:
    """One problem, e.g. prompt ``4+7-2=?``, answer ``9``, solution ``4+7=11;11-2=9;\\boxed{9}``.

    With ``spec.max_redundant`` the solution repeats the final total k times, k uniform in 0..max_redundant, e.g.
    ``4+7=11;11-2=9;9=9;9=9;\\boxed{9}``: the same answer at a length the policy is free to choose.
    """
    n_terms = rng.randint(spec.min_terms, spec.n_terms) if spec.min_terms else spec.n_terms
    operands = [rng.randint(0, spec.max_operand) for _ in range(n_terms)]
    ops = [rng.choice("+-") for _ in range(n_terms - 1)]
    prompt, total, steps = str(operands[0]), operands[0], []
    for op, x in zip(ops, operands[1:]):
        new_total = total + x if op == "+" else total - x
        steps.append(f"{total}{op}{x}={new_total}")
        prompt += f"{op}{x}"
        total = new_total
    if spec.max_redundant:
        steps += [f"{total}={total}"] * rng.randint(0, spec.max_redundant)
    solution = ";".join(steps) + f";\\boxed{{{total}}}"
    return {"prompt": prompt + "=?", "answer": str(total), "solution": solution}


def make_arith_problems(n: int, seed: int, spec: ArithSpec, exclude: set[str] | None = None) -> list[Problem]:
    """``n`` problems from a seeded stream, skipping any whose prompt is in ``exclude``."""
    rng, out = random.Random(seed), []
    exclude = exclude or set()
    while len(out) < n:
        p = make_arith_problem(rng, spec)
        if p["prompt"] not in exclude:
            out.append(p)
    return out


@functools.lru_cache(maxsize=None)
def _arith_split(name: str, split: str) -> tuple[Problem, ...]:
    """Generated once per process (about 0.2 s for the 20k train problems), then reused."""
    spec = ARITH_SPECS[name]
    test = make_arith_problems(ARITH_TEST_SIZE, ARITH_TEST_SEED, spec)
    if split == "test":
        return tuple(test)
    exclude = {p["prompt"] for p in test} | {
        p["prompt"] for other in spec.exclude_test_of for p in _arith_split(other, "test")
    }
    train = make_arith_problems(ARITH_TRAIN_SIZE, ARITH_TRAIN_SEED, spec, exclude=exclude)
    return tuple(train)


def load_arith(name: str, split: str) -> list[Problem]:
    if split not in ("train", "test"):
        raise ValueError(f"dataset {name!r} has splits 'train' and 'test', not {split!r}")
    return [dict(p) for p in _arith_split(name, split)]  # copies, so callers cannot corrupt the cache
