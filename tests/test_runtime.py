"""Start-up checks that protect a GPU run: the context fits the model (vLLM refuses a longer one), and a GPU
install whose CUDA is unusable stops instead of training a hub model on the CPU."""

import dataclasses

import pytest
import torch
from conftest import load_algo

from common.data import TINY_MODEL_DIR
from common.runtime import check_device, context_budget

TINY_POSITIONS = 256  # common/tiny_model/config.json max_position_embeddings


def args(**overrides):
    grpo = load_algo("grpo")
    eval_overrides = {k[5:]: overrides.pop(k) for k in list(overrides) if k.startswith("eval_")}
    rollout_overrides = {k[8:]: overrides.pop(k) for k in list(overrides) if k.startswith("rollout_")}
    a = grpo.Args(**overrides)
    a.eval = dataclasses.replace(a.eval, **eval_overrides)
    a.rollout = dataclasses.replace(a.rollout, **rollout_overrides)
    return a


def test_context_stays_within_the_models_positions():
    # the defaults ask for 512 + 40 positions; the tiny model has 256: the prompt budget shrinks to what fits
    assert context_budget(args(), str(TINY_MODEL_DIR)) == (TINY_POSITIONS - 40, TINY_POSITIONS)
    assert context_budget(args(max_prompt_tokens=100), str(TINY_MODEL_DIR)) == (100, 140)
    # the evaluation budget counts too
    assert context_budget(args(eval_max_new_tokens=100), str(TINY_MODEL_DIR)) == (TINY_POSITIONS - 100, TINY_POSITIONS)


def test_a_budget_that_cannot_fit_names_the_flags():
    with pytest.raises(SystemExit, match="--max-new-tokens 300.*max_position_embeddings 256"):
        context_budget(args(max_new_tokens=300), str(TINY_MODEL_DIR))
    with pytest.raises(SystemExit, match="--eval.max-new-tokens 256"):
        context_budget(args(eval_max_new_tokens=256), str(TINY_MODEL_DIR))
    with pytest.raises(SystemExit, match="--rollout.max-model-len 300 exceeds the model's 256 positions"):
        context_budget(args(rollout_max_model_len=300), str(TINY_MODEL_DIR))


def test_unusable_cuda_stops_a_gpu_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_device(args()) is False  # a CPU install: the tiny default trains on the CPU
    assert check_device(args(model="Qwen/Qwen2.5-Math-1.5B")) is False  # a CPU torch build: the CPU is the choice
    with pytest.raises(SystemExit, match="--device cpu"):
        check_device(args(device="cuda"))
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # a CUDA build of torch on a machine whose driver is too old
    assert check_device(args()) is False  # the tiny model may still train on the CPU
    with pytest.raises(SystemExit, match="driver >= 580"):
        check_device(args(model="Qwen/Qwen2.5-Math-1.5B"))
    with pytest.raises(SystemExit, match="no usable CUDA device"):
        check_device(args(rollout_backend="vllm"))
    assert check_device(args(model="Qwen/Qwen2.5-Math-1.5B", device="cpu")) is False  # asked for explicitly
