"""Guards on the duplicated plumbing: every script shares grpo.py's flags, exposes the functions the
design names, documents its delta, stays under the size cap (formatted lines), and imports without vLLM."""

import ast
import dataclasses
import subprocess
import sys

import pytest
from conftest import REPO, load_algo

SCRIPTS = sorted(p.stem for p in (REPO / "algos").glob("*.py"))
ALGO_FIELDS = {"clip_eps", "kl_coef"}  # grpo's own algorithm hyperparameters; the rest is shared
REQUIRED_FUNCTIONS = {
    "ppo": ["compute_gae", "value_loss", "policy_loss"],
    "prime": ["implicit_process_rewards", "prm_loss", "compute_advantages", "policy_loss"],
    "dapo": ["compute_advantages", "policy_loss", "overlong_penalty"],
}
PARENTS = {"grpo", "ppo"}  # the roots: every other script is a fork of one script, named in its docstring
PARENT = {"scalerl": "cispo"}  # forks of a fork (the default parent is grpo.py)


def fields(module) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(module.Args)}


def default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@pytest.mark.parametrize("script", SCRIPTS)
def test_shared_flags_match_grpo(script):
    reference = fields(load_algo("grpo"))
    mine = fields(load_algo(script))
    for name, f in reference.items():
        if name in ALGO_FIELDS or name == "exp_name":
            continue
        assert name in mine, f"{script}.py lacks the shared flag {name!r}"
        if name in ("total_steps", "group_size", "num_minibatches", "num_epochs", "learning_rate", "warmup_steps"):
            continue  # algorithms may choose their paper's value for these (documented in their Args)
        assert default(mine[name]) == default(f), f"{script}.py: default of {name!r} differs from grpo.py"


@pytest.mark.parametrize("script", SCRIPTS)
def test_required_functions_and_docstring(script):
    module = load_algo(script)
    for fn in REQUIRED_FUNCTIONS.get(script, ["compute_advantages", "policy_loss"]):
        assert callable(getattr(module, fn, None)), f"{script}.py must define {fn}()"
    doc = module.__doc__ or ""
    assert "arXiv" in doc or "http" in doc, f"{script}.py docstring must cite its paper"
    if script not in PARENTS:
        parent = PARENT.get(script, "grpo")
        assert f"Relative to {parent}.py" in doc, (
            f"{script}.py docstring must list its delta ('Relative to {parent}.py')"
        )
    assert "vllm" not in sys.modules


def formatted_code_lines(path) -> list[str]:
    """The non-blank lines of ``path`` as ``ruff format`` (the repo's pyproject.toml) would write it."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(path), "-"],
        input=path.read_text(),
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    return [line for line in result.stdout.splitlines() if line.strip()]


@pytest.mark.parametrize("script", SCRIPTS)
def test_size_cap_on_formatted_code(script):
    """Caps count formatted, non-blank lines, so wide lines cannot get a script under them."""
    path = REPO / "algos" / f"{script}.py"
    lines = formatted_code_lines(path)
    cap = 420 if script == "grpo" else 500
    assert len(lines) <= cap, f"{script}.py has {len(lines)} non-blank formatted lines (cap {cap})"
    main = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    main_cap = 200 if script == "grpo" else 260
    assert main.end_lineno - main.lineno + 1 <= main_cap, f"{script}.py main() is over {main_cap} lines"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_logprob_call_follows_the_lm_head_flag(script):
    """The trainer's LM head precision must match the sampler's (--rollout.fp32-lm-head): a call that forgot the
    flag would score with the library default while vLLM samples with the other head."""
    import re

    source = (REPO / "algos" / f"{script}.py").read_text()
    calls = re.findall(r"token_logprobs(?:_batched)?\((?:[^()]|\([^()]*\))*\)", source)
    assert calls and all("fp32_head=run.fp32_head" in call or "*logprob_args" in call for call in calls), [
        c for c in calls if "fp32_head" not in c and "*logprob_args" not in c
    ]
    if "*logprob_args" in source:  # the shared positional arguments end with the run's head precision
        assert re.search(r"logprob_args = \([^)]*run\.fp32_head,?\s*\)", source)
    assert "run = start_run(args)" in source  # start_run resolves --rollout.fp32-lm-head for the run's device


@pytest.mark.parametrize("script", SCRIPTS)
def test_plumbing_comes_from_common(script):
    """Set-up and bookkeeping are one-line calls into common/, so a plumbing change is made once, not ten times."""
    source = (REPO / "algos" / f"{script}.py").read_text()
    for call in (
        "start_run(args)",
        "load_task(args)",
        "Bookkeeper(",
        "books.steps()",
        "books.log_step(",
        "books.end_step(",
    ):
        assert call in source, f"{script}.py does not call {call}"
    assert "books.finish(raw_model)" in source
    for inline_plumbing in ("Accelerator(", "save_checkpoint(", "signal.signal(", "Tracker(", "AutoTokenizer"):
        assert inline_plumbing not in source, f"{script}.py does {inline_plumbing} itself instead of through common/"
