"""The engine contract (common/engine_base.py ``Engine``): every engine provides each member the rollout schedule,
the Bookkeeper and the scripts use, so nothing is duck-typed; and every script makes its one rollout-correction call
on the same log-probs, in the same argument order (common/correction.py ``correction_weights``)."""

import ast
import inspect

import pytest
from conftest import REPO

from common.engine_base import Engine, InProcessEngine
from common.rollout import HFEngine
from common.vllm_engine import VLLMEngine
from common.vllm_server import VLLMServerEngine

SCRIPTS = sorted(p.stem for p in (REPO / "algos").glob("*.py"))
ENGINES = [HFEngine, VLLMEngine, VLLMServerEngine]
# what the schedule (common/async_rollout.py), the Bookkeeper and the scripts use; the Protocol must declare them all
USED = {"overlaps", "on_fault", "version", "generate", "sample_local", "all_ranks", "update_weights", "sleep", "wake"}
# scripts whose loss takes π_old from the sampler (μ): their correction call only logs the mismatch, on the untouched
# policy's first minibatch, with the trainer's current log-probs standing for π_old (docs/correction.md)
METRICS_ONLY = {"dppo", "scalerl", "opd"}


def protocol_members() -> set[str]:
    names = set(vars(Engine)) | set(Engine.__annotations__)
    return {n for n in names if not n.startswith("_")}


def test_the_protocol_declares_everything_the_schedule_uses():
    assert protocol_members() == USED
    source = (REPO / "common" / "async_rollout.py").read_text()
    used_by_schedule = {n for n in USED if f"engine.{n}" in source}
    assert used_by_schedule >= {"overlaps", "version", "generate", "sample_local", "all_ranks", "update_weights"}


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.__name__)
def test_every_engine_implements_every_member(engine):
    missing = [n for n in sorted(USED) if not hasattr(engine, n) and n not in _instance_attributes(engine)]
    assert not missing, f"{engine.__name__} lacks {missing}"
    assert isinstance(engine.overlaps, bool)
    assert engine.overlaps == (engine is VLLMServerEngine)  # only servers generate off the trainer's process


def _instance_attributes(cls) -> set[str]:
    """Names the class's methods assign on ``self`` (annotated or not)."""
    tree = ast.parse(inspect.getsource(cls))
    targets = [t for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets]
    targets += [n.target for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)]
    return {
        t.attr
        for t in targets
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def test_an_in_process_engine_samples_locally_as_it_generates():
    class Recorder(InProcessEngine):
        def generate(self, *args):
            self.args = args
            return ["sampled"]

    engine = Recorder()
    assert engine.sample_local([[1]], 2, 3, 1.0, 0.9, [7], ("x",), version="ignored") == ["sampled"]
    assert engine.args == ([[1]], 2, 3, 1.0, 0.9, [7], ("x",))
    assert engine.all_ranks(lambda: 5, "sampling", after_update=False) == 5
    with pytest.raises(ZeroDivisionError):  # a failure is an ordinary exception on the rank where it happens
        engine.all_ranks(lambda: 1 / 0, "sampling", after_update=False)


def _correction_calls(tree: ast.AST) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "correction_weights"
    ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_corrects_pi_old_against_mu_once(script):
    """One call per script, inside the micro-batch loop: (π_old of the rows, μ = rollout_logprobs of the same rows,
    their mask, args.correction). π_old is ``old`` = ``logprobs.detach() if on_policy else old_logprobs[rows]``
    (METRICS_ONLY: ``logprobs.detach()`` on the untouched policy)."""
    tree = ast.parse((REPO / "algos" / f"{script}.py").read_text())
    calls = _correction_calls(tree)
    assert len(calls) == 1, f"{script}: {len(calls)} correction_weights calls"
    call = calls[0]
    old, mu, mask, cfg = (ast.unparse(a) for a in call.args)
    assert mu == "rollout_logprobs[rows]" and cfg == "args.correction", (mu, cfg)
    assert "[rows]" in mask + _binding(tree, mask, call.lineno), f"{script}: the mask {mask} is not the rows' own"
    if script in METRICS_ONLY:
        assert old == "logprobs.detach()"
        return
    assert (
        old == "old" and _binding(tree, "old", call.lineno) == "logprobs.detach() if on_policy else old_logprobs[rows]"
    )


def _binding(tree: ast.AST, name: str, before_line: int) -> str:
    """The value last assigned to ``name`` above ``before_line`` ("" when none): what reaches a call there."""
    assigns = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        and n.lineno < before_line
        and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
    ]
    return ast.unparse(max(assigns, key=lambda n: n.lineno).value) if assigns else ""
