"""Guards on the duplicated plumbing: every script shares grpo.py's flags, exposes the functions the
design names, documents its delta, stays under the size cap (formatted lines), and imports without vLLM."""

import ast
import dataclasses
import subprocess
import sys

import pytest
import torch
from conftest import REPO, load_algo

SCRIPTS = sorted(p.stem for p in (REPO / "algos").glob("*.py"))

# What a fork may change in grpo.py's Args (README, "How to fork", lists both). Every other field of grpo.py's Args
# is shared plumbing: each script keeps it, with grpo.py's default.
ALGO_FIELDS = {"clip_eps", "kl_coef"}
"""grpo.py's own algorithm hyperparameters: a fork may drop, rename or re-default them."""
FORK_MAY_CHANGE_DEFAULT = {
    "total_steps",
    "group_size",
    "num_minibatches",
    "num_epochs",
    "learning_rate",
    "warmup_steps",
    "max_lag",
}
"""Shared flags a fork keeps but may default to its paper's value (say so in the field's docstring)."""
REQUIRED_FUNCTIONS = {
    "ppo": ["compute_gae", "value_loss", "policy_loss"],
    "prime": ["implicit_process_rewards", "prm_loss", "compute_advantages", "policy_loss"],
    "dapo": ["compute_advantages", "policy_loss", "overlong_penalty"],
}
PARENTS = {"grpo", "ppo"}  # the roots: every other script is a fork of one script, named in its docstring
PARENT = {"scalerl": "cispo"}  # forks of a fork (the default parent is grpo.py)
RATIO_MECHANISMS = {
    "gspo": "the sequence ratio and its clip",
    "cispo": "the capped importance weight",
    "dapo": "clip-higher",
    "dppo": "the trust region on the divergence to the rollout policy",
    "scalerl": "the capped importance weight on a lagged sampler",
    "entropy_cov": "KL-Cov's |log r| penalty on the top-covariance tokens (zero gradient at r = 1)",
}
"""Scripts whose named mechanism is a function of the ratio π_θ / π_old alone. At one optimiser step per rollout batch
from an up-to-date sampler every ratio is 1 (old = logprobs.detach(); dppo.py and scalerl.py take π_old from the
sampler, which then differs from π_θ by numerics only), so the mechanism does nothing and their defaults must take
off-policy steps. gspo.py at --num-minibatches 1 is grpo.py at --kl-coef 0 (test_gspo_at_ratio_one_is_grpo)."""


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
        if name in FORK_MAY_CHANGE_DEFAULT:
            continue
        assert default(mine[name]) == default(f), f"{script}.py: default of {name!r} differs from grpo.py"


def test_readme_states_the_fork_rules():
    """README's "How to fork" lists every field a fork may change and names the registries above, so a fork's author
    reads the rules there rather than in a failing test."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## How to fork\n", 1)[1].split("\n## ", 1)[0]
    missing = [f"`{name}`" for name in sorted(ALGO_FIELDS | FORK_MAY_CHANGE_DEFAULT) if f"`{name}`" not in section]
    assert not missing, f"README's 'How to fork' does not list {missing}"
    for name in ("ALGO_FIELDS", "FORK_MAY_CHANGE_DEFAULT", "PARENT", "RATIO_MECHANISMS", "# planner:", "ruff format"):
        assert name in section, f"README's 'How to fork' does not mention {name}"


def takes_off_policy_steps(defaults: dict) -> bool:
    """Whether a run takes an optimiser step with π_θ ≠ π_old: more than one step per rollout batch (epochs x
    mini-batches), or a sampler that lags the trainer (scalerl.py's ``max_lag``; 1 is on-policy)."""
    return defaults["num_epochs"] * defaults["num_minibatches"] > 1 or defaults.get("max_lag", 1) > 1


@pytest.mark.parametrize("script", sorted(RATIO_MECHANISMS))
def test_ratio_mechanisms_act_at_the_defaults(script):
    grpo_defaults = {name: default(f) for name, f in fields(load_algo("grpo")).items()}
    assert not takes_off_policy_steps(grpo_defaults)  # one step per batch: every ratio is 1
    mine = {name: default(f) for name, f in fields(load_algo(script)).items()}
    assert takes_off_policy_steps(mine), (
        f"{script}.py: {RATIO_MECHANISMS[script]} acts only through π_θ / π_old, which is 1 at one optimiser step per "
        "rollout batch; default num_minibatches (or num_epochs) above 1 (gspo.py: 4, GSPO §5.1)"
    )


def test_gspo_at_ratio_one_is_grpo():
    """Why RATIO_MECHANISMS exists: on-policy (old = logprobs.detach()) GSPO's gradient is GRPO's without KL."""
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(6, 9, generator=generator) - 1.0
    mask = (torch.rand(6, 9, generator=generator) > 0.3).float()
    mask[:, 0] = 1.0
    advantages = torch.randn(6, generator=generator)
    grads = []
    for script in ("grpo", "gspo"):
        logprobs = base.clone().requires_grad_()
        loss, _ = load_algo(script).policy_loss(logprobs, logprobs.detach(), advantages, mask, kl_coef=0.0)
        loss.backward()
        grads.append(logprobs.grad)
    torch.testing.assert_close(grads[1], grads[0])


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
    # non-grpo cap 540 (was 500): the issue-25 wave adds rollout correction, packing, LoRA and async flags to every
    # script, and the critic/PRM scripts (ppo.py, prime.py) were at 500 already; grpo.py keeps its 420
    cap = 420 if script == "grpo" else 540
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
    if "*logprob_args" in source:  # the shared positional arguments end with the head precision and token budget
        assert re.search(r"logprob_args = \([^)]*run\.fp32_head,\s*args\.micro_batch_tokens,?\s*\)", source)
    assert re.search(
        r"run = start_run\(args[,)]", source
    )  # start_run resolves --rollout.fp32-lm-head for the run's device


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_forward_follows_the_micro_batch_tokens_flag(script):
    """--micro-batch-tokens packs every forward of the run: a loop that still slices rows by --micro-batch-size, or
    a trained forward without ``packed=``, would silently run padded (and a packed bin's rows padded together)."""
    import re

    source = (REPO / "algos" / f"{script}.py").read_text()
    assert "for j in range(" not in source and "args.micro_batch_size]" not in source
    loops = re.findall(r"in micro_batches\((?:[^()]|\([^()]*\))*\)", source)
    assert loops and all("args.micro_batch_tokens" in loop or "*micro_batching" in loop for loop in loops), loops
    trained = [c for c in re.findall(r"token_logprobs\((?:[^()]|\([^()]*\))*\)", source) if "*logprob_args" not in c]
    assert trained and all("packed=args.micro_batch_tokens > 0" in call for call in trained), trained


@pytest.mark.parametrize("script", SCRIPTS)
def test_plumbing_comes_from_common(script):
    """Set-up and bookkeeping are one-line calls into common/, so a plumbing change is made in one place."""
    source = (REPO / "algos" / f"{script}.py").read_text()
    for call in (
        "start_run(args",
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
