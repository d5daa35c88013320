"""The docs stay honest: every script in algos/ has a page in docs/ (linked from docs/README.md and the README's
table), every command quoted in the README, the docs, the scripts' docstrings and the benchmark manifests parses
against the script's flags (a renamed flag fails here, not for a user), every GPU command carries the memory
planner's verdict, every metric key a script can log is defined in docs/metrics.md, and no prose counts the scripts.

No training here: the integration test (tests/test_scripts.py) checks the keys of real runs with
``undocumented_keys``."""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
import tyro
from conftest import REPO, load_algo

from common.data import SHIPPED_MODELS

SCRIPTS = sorted(p.stem for p in (REPO / "algos").glob("*.py"))
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
METRICS_DOC = REPO / "docs" / "metrics.md"


# ---------------------------------------------------------------------------------------------------------------
# metric keys
def documented_patterns(text: str | None = None) -> list[re.Pattern]:
    """The keys docs/metrics.md defines: the backticked first cell of each table row, as full-match regexes.

    ``<n>`` and ``<k>`` match a number; any other ``<placeholder>`` (e.g. ``<dataset>``) matches any non-empty text,
    slashes included (a ``jsonl:<path>`` dataset's name has them).
    """
    text = METRICS_DOC.read_text() if text is None else text
    patterns = []
    for key in re.findall(r"^\|\s*`([^`]+)`\s*\|", text, flags=re.M):
        parts = re.split(r"(<[^<>]+>)", key)
        regex = "".join((r"\d+" if p in ("<n>", "<k>") else ".+") if p.startswith("<") else re.escape(p) for p in parts)
        patterns.append(re.compile(regex))
    return patterns


def undocumented_keys(keys, text: str | None = None) -> set[str]:
    """The keys in ``keys`` that no entry of docs/metrics.md (or of ``text``) defines."""
    patterns = documented_patterns(text)
    return {k for k in keys if not any(p.fullmatch(k) for p in patterns)}


def test_metric_matcher_accepts_documented_and_rejects_undocumented_keys():
    doc = "| key | definition |\n|---|---|\n| `train/reward` | r |\n| `eval/<dataset>/pass@<k>` | p |\n"
    keys = {"train/reward", "eval/math500/pass@16", "eval/jsonl:data/x.jsonl/pass@1", "eval/arith/pass@k"}
    assert undocumented_keys(keys | {"train/made_up"}, doc) == {"eval/arith/pass@k", "train/made_up"}
    assert undocumented_keys({"train/reward_extra", "xtrain/reward"}, doc) == {"train/reward_extra", "xtrain/reward"}
    # the real page: the common keys are there, an invented one is not
    assert undocumented_keys({"step", "train/reward", "eval/math500/mean@16", "time/rollout_s"}) == set()
    assert undocumented_keys({"train/not_a_metric"}) == {"train/not_a_metric"}


def logged_keys_in_source(path: Path) -> set[str]:
    """Metric keys a script or common module can write, read from its source (conditional ones included).

    String literals that start with ``train/``, ``time/`` or ``memory/``, plus the bare names that become
    ``train/<name>``: keys of a ``metrics[...]`` / ``loss_stats[...]`` assignment, of ``update_stats.setdefault``
    and of a returned ``{"name": ...}`` metrics dict.
    """
    source = path.read_text()
    keys = set(re.findall(r"""["']((?:train|time|memory)/[A-Za-z0-9_@]+)["']""", source))
    bare = re.findall(r"""(?:metrics|loss_stats)\[["']([A-Za-z0-9_]+)["']\]\s*=""", source)
    bare += re.findall(r"""update_stats\.setdefault\(["']([A-Za-z0-9_]+)["']""", source)
    bare += re.findall(r"""return loss, \{["']([A-Za-z0-9_]+)["']""", source)
    bare += re.findall(r"""metrics = \{["']([A-Za-z0-9_]+)["']:.*["']([A-Za-z0-9_]+)["']:""", source)
    flat = {b for item in bare for b in ((item,) if isinstance(item, str) else item)}
    return keys | {f"train/{b}" for b in flat}


@pytest.mark.parametrize("path", [*(f"algos/{s}.py" for s in SCRIPTS), "common/bookkeeping.py"])
def test_every_key_in_the_source_is_documented(path):
    keys = logged_keys_in_source(REPO / path)
    assert "train/reward" in keys or path.startswith("algos/"), "the key scan found nothing: update the regexes"
    missing = undocumented_keys(keys)
    assert not missing, f"{path} logs keys docs/metrics.md does not define: {sorted(missing)}"


# ---------------------------------------------------------------------------------------------------------------
# a page per script
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_has_a_page(script):
    page = REPO / "docs" / f"{script}.md"
    assert page.exists(), f"algos/{script}.py has no docs/{script}.md"
    assert f"{script}.py" in page.read_text(), f"docs/{script}.md never names algos/{script}.py"


def test_every_script_is_in_the_readme_table_and_the_docs_index():
    readme = (REPO / "README.md").read_text()
    index = (REPO / "docs" / "README.md").read_text()
    for script in SCRIPTS:
        assert f"[`{script}.py`](algos/{script}.py)" in readme, f"README's Algorithms table has no row for {script}.py"
        assert f"[{script}.md]({script}.md)" in index, f"docs/README.md's index does not link {script}.md"


# ---------------------------------------------------------------------------------------------------------------
# no count of the scripts in prose: it goes stale with the next fork (the generated BENCH blocks are rewritten)
NUMBER = r"(?:\d+|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen|twenty)"
SCRIPT_COUNT = re.compile(rf"\b{NUMBER} (?:[\w.-]+ )?(?:scripts|algorithms|relatives)\b", flags=re.I)


def script_counts(text: str) -> list[str]:
    """Counts of scripts or algorithms in ``text`` outside its ``<!-- BENCH-...-BEGIN/END -->`` blocks."""
    prose = re.sub(r"<!-- BENCH-([A-Z0-9-]+)-BEGIN -->.*?<!-- BENCH-\1-END -->", "", text, flags=re.S)
    return [m.group(0) for m in SCRIPT_COUNT.finditer(prose)]


def test_count_matcher_finds_counts_of_scripts_only():
    text = (
        "GRPO and eleven relatives. All twelve scripts learn; all 12 scripts; ten GPU scripts. 5 of 9 claims, 3 seeds."
    )
    assert script_counts(text) == ["eleven relatives", "twelve scripts", "12 scripts", "ten GPU scripts"]
    bench = "<!-- BENCH-TINY-BEGIN -->\nall twelve scripts\n<!-- BENCH-TINY-END -->\nEvery script learns."
    assert script_counts(bench) == []


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_prose_names_no_count_of_scripts(path):
    counts = script_counts(path.read_text())
    assert not counts, f"{path.relative_to(REPO)} counts the scripts ({counts}): say 'every script' or 'its relatives'"


# ---------------------------------------------------------------------------------------------------------------
# quoted commands parse against the scripts' flags
def fenced_commands(text: str) -> list[str]:
    """Command lines of the fenced bash/sh blocks of a markdown text, backslash continuations joined."""
    commands = []
    for block in re.findall(r"^```(?:bash|sh|shell|console)\s*\n(.*?)^```", text, flags=re.M | re.S):
        commands += [line.strip() for line in re.sub(r"\\\n", " ", block).splitlines() if line.strip()]
    return commands


def docstring_commands(path: Path) -> list[str]:
    """Indented ``python algos/...`` / ``accelerate launch ...`` lines of a script's module docstring, joined, each
    after the ``# planner: ...`` line that annotates it, if any (``annotated_commands`` pairs them)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    joined = re.sub(r"\\\n\s*", " ", doc)
    return [line.strip() for line in joined.splitlines() if re.match(r"\s+(python |accelerate |# planner:)", line)]


def load_evaluate():
    from common.evaluate import EvalArgs

    return EvalArgs


def target_and_flags(tokens: list[str]):
    """(dataclass to parse with, flags) for a tokenised command, or None when it runs nothing we parse."""
    if tokens[:3] == ["python", "-m", "common.evaluate"]:
        return load_evaluate(), tokens[3:]
    if tokens[:1] == ["python"] or tokens[:2] == ["accelerate", "launch"]:
        for i, token in enumerate(tokens):
            match = re.fullmatch(r"(?:.*/)?algos/(\w+)\.py", token)
            if match:
                return load_algo(match.group(1)).Args, tokens[i + 1 :]
    return None


def check_parses(command: str, where: str) -> bool:
    """Parse one command's flags with tyro; False (skipped) when it holds a <placeholder> or runs no script."""
    tokens = shlex.split(command, comments=True)
    if not tokens or re.search(r"<[^<>]+>", shlex.join(tokens)):
        return False
    found = target_and_flags(tokens)
    if found is None:
        return False
    args_type, flags = found
    try:
        tyro.cli(args_type, args=flags)
    except SystemExit as exit_:
        pytest.fail(f"{where}: `{command}` does not parse against the script's flags (exit {exit_.code})")
    return True


def test_commands_in_readme_and_docs_parse():
    parsed = 0
    for path in DOC_FILES:
        for command in fenced_commands(path.read_text()):
            parsed += check_parses(command, str(path.relative_to(REPO)))
    assert parsed >= 3, f"only {parsed} commands found in README.md and docs/: is the extractor broken?"


@pytest.mark.parametrize("script", SCRIPTS)
def test_commands_in_script_docstrings_parse(script):
    path = REPO / "algos" / f"{script}.py"
    commands = docstring_commands(path)
    assert any(check_parses(c, f"algos/{script}.py docstring") for c in commands), "no runnable command quoted"


def test_command_parser_rejects_a_renamed_flag():
    with pytest.raises(pytest.fail.Exception):
        check_parses("python algos/grpo.py --learning-rate 1e-6 --not-a-flag 3", "test")
    assert check_parses("python algos/grpo.py --learning-rate 1e-6 --eval.k 1 4  # a comment", "test")
    assert not check_parses("accelerate launch algos/grpo.py <the flags above>", "test")
    joined = fenced_commands("```bash\npython algos/grpo.py \\\n    --seed 2  # two\n```\n")
    assert [c.split() for c in joined] == [["python", "algos/grpo.py", "--seed", "2", "#", "two"]]


def load_bench_runner():
    spec = importlib.util.spec_from_file_location("bench_run", REPO / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while the class is built
    spec.loader.exec_module(module)
    return module


SUITES = sorted(p.stem for p in (REPO / "benchmarks" / "suites").glob("*.toml"))


@pytest.mark.parametrize("suite", SUITES)
def test_benchmark_suite_flags_parse(suite, tmp_path):
    """Every run of a manifest, composed as benchmarks/run.py composes it, parses against its script's flags."""
    bench = load_bench_runner()
    manifest = bench.load_suite(suite)
    for run in bench.expand(suite, manifest, None, None, tmp_path):
        found = target_and_flags(["python", *run.command[1:]] if run.command[0] != "accelerate" else run.command)
        if found is None:  # a peer codebase's script (benchmarks/peers/), not ours
            continue
        args_type, flags = found
        try:
            tyro.cli(args_type, args=flags)
        except SystemExit:
            pytest.fail(f"suites/{suite}.toml, run {run.label}: flags do not parse: {shlex.join(flags)}")
    if manifest.get("final_eval"):
        eval_args = load_evaluate()
        for dataset in manifest["final_eval"]:
            flags = ["--model", "m", "--dataset", dataset, *manifest.get("final_eval_flags", [])]
            try:
                tyro.cli(eval_args, args=flags)
            except SystemExit:
                pytest.fail(f"suites/{suite}.toml final_eval_flags do not parse for common.evaluate: {flags}")


# ---------------------------------------------------------------------------------------------------------------
# every GPU command carries the memory planner's verdict for the hardware it names
PLANNER_LINE = re.compile(
    r"# planner: (?:(?P<verdict>fits|does not fit|needs FSDP2 sharding \(--fsdp\)|vLLM cannot colocate) "
    r"on (?P<card>\d+) GB: "
    r"(?P<gb>[\d.]+) GB per GPU(?: \(fits with [^()]+\))?|not planned \(no local config for (?P<model>\S+)\))"
)


def annotated_commands(lines: list[str]) -> list[tuple[str | None, str]]:
    """(the ``# planner: ...`` line right above a command or None, the command) for every command line."""
    pairs, note = [], None
    for line in lines:
        if line.startswith("# planner:"):
            note = line
        elif not line.startswith("#"):
            pairs.append((note, line))
            note = None
    return pairs


def processes(tokens: list[str]) -> int:
    """Processes an ``accelerate launch`` command starts: --num_processes (which overrides the config file's
    wherever it stands), else its --config_file's, else 1."""
    if tokens[:2] != ["accelerate", "launch"]:
        return 1
    flags = dict(zip(tokens, tokens[1:]))
    if "--num_processes" in flags:
        return int(flags["--num_processes"])
    if "--config_file" in flags:
        match = re.search(r"^num_processes:\s*(\d+)", (REPO / flags["--config_file"]).read_text(), flags=re.M)
        return int(match.group(1)) if match else 1
    return 1


def test_processes_take_num_processes_over_the_config_files_wherever_it_stands():
    config = "accelerate launch --config_file scripts/accelerate/multi_node.yaml"
    assert processes(shlex.split(f"{config} --machine_rank 0 algos/dapo.py")) == 16
    assert processes(shlex.split(f"{config} --num_machines 8 --num_processes 64 algos/dapo.py")) == 64
    assert (
        processes(shlex.split("accelerate launch --num_processes 4 --config_file scripts/accelerate/fsdp2.yaml")) == 4
    )
    assert processes(shlex.split("python algos/grpo.py --fsdp")) == 1


def gpu_run(command: str):
    """(Args, processes) of a command that trains on a GPU (not a shipped tiny model, not --device cpu), else None."""
    tokens = shlex.split(command, comments=True)
    if not tokens or re.search(r"<[^<>]+>", shlex.join(tokens)):
        return None
    found = target_and_flags(tokens)
    if found is None or found[0].__module__ == "common.evaluate":
        return None
    args = tyro.cli(found[0], args=found[1])
    return (args, processes(tokens)) if args.model not in SHIPPED_MODELS and args.device != "cpu" else None


def check_planner_note(note: str | None, command: str, where: str) -> bool:
    """Fail unless a GPU command's ``# planner:`` note states what the planner says for it; False for non-GPU ones."""
    from common.memory import local_config, plan_memory
    from common.runtime import context_budget

    run = gpu_run(command)
    if run is None:
        return False
    args, world = run
    match = PLANNER_LINE.fullmatch(note or "")
    assert match, f"{where}: GPU command without a valid '# planner: ...' line above it: `{command[:100]}`"
    folder = local_config(args.model)
    if match["model"]:
        assert match["model"] == args.model and folder is None, f"{where}: {args.model} has a local config: plan it"
        return True
    assert folder, f"{where}: no common/model_configs folder for {args.model}: add one or say 'not planned'"
    _, max_model_len = context_budget(args, folder)
    plan = plan_memory(args, folder, max_model_len, world, float(match["card"]), backend=None)
    stated = f"{match['verdict']} on {match['card']} GB: {match['gb']} GB per GPU"
    assert plan.verdict.split(":")[0] == stated.split(":")[0], f"{where}: `{command[:90]}`: planner says {plan.verdict}"
    assert abs(plan.peak / 1e9 - float(match["gb"])) <= max(1.0, 0.03 * plan.peak / 1e9), (
        f"{where}: `{command[:90]}`: stated {match['gb']} GB, planner says {plan.verdict}"
    )
    return True


def test_gpu_commands_in_readme_and_docs_carry_the_planner_verdict():
    checked = sum(
        check_planner_note(note, command, str(path.relative_to(REPO)))
        for path in DOC_FILES
        for note, command in annotated_commands(fenced_commands(path.read_text()))
    )
    assert checked >= 10, f"only {checked} GPU commands found in README.md and docs/"


@pytest.mark.parametrize("script", SCRIPTS)
def test_gpu_commands_in_script_docstrings_carry_the_planner_verdict(script):
    for note, command in annotated_commands(docstring_commands(REPO / "algos" / f"{script}.py")):
        check_planner_note(note, command, f"algos/{script}.py docstring")


@pytest.mark.parametrize("suite", [s for s in SUITES if s.startswith("gpu-")])
def test_gpu_suite_runs_carry_the_planner_verdict(suite, tmp_path):
    """Each ``[[runs]]`` entry of a GPU manifest holds a ``# planner: ...`` comment for its composed command."""
    bench = load_bench_runner()
    manifest = bench.load_suite(suite)
    text = (REPO / "benchmarks" / "suites" / f"{suite}.toml").read_text()
    notes = [PLANNER_LINE.search(entry) for entry in text.split("[[runs]]")[1:]]
    assert len(notes) == len(manifest["runs"])
    labels = [entry.get("label", entry["algo"]) for entry in manifest["runs"]]
    for run in bench.expand(suite, manifest, None, None, tmp_path):
        note = notes[labels.index(run.label)]
        command = shlex.join(run.command if run.command[0] == "accelerate" else ["python", *run.command[1:]])
        check_planner_note(note and note.group(0), command, f"suites/{suite}.toml, run {run.label}")


def test_readme_stays_short():
    """The front page stays at 250 lines or fewer: long tables live in benchmarks/README.md and docs/."""
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines (at most 250): move a table to benchmarks/README.md or docs/"
