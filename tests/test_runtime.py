"""Start-up checks that protect a GPU run: the context fits the model (vLLM refuses a longer one), and a GPU
install whose CUDA is unusable stops instead of training a hub model on the CPU."""

import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import load_algo

from common.data import TINY_MODEL_DIR
from common.run_checks import check_device, check_in_flight, check_sampling_flags
from common.runtime import (
    context_budget,
    describe_processes,
    load_config,
    load_model,
)

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


def tiny_run(model_path=str(TINY_MODEL_DIR)):
    """The fields of a ``Run`` that ``load_model`` reads, for the tiny model on the CPU."""
    return SimpleNamespace(
        model_path=model_path,
        dtype=torch.float32,
        attn_implementation="eager",
        device=torch.device("cpu"),
        fsdp=False,
        checkpointing_policy="full",
        compile_layers=False,
        bf16_autocast=False,
        seed=0,
    )


def bytes_saved_for_backward(model) -> int:
    """Bytes autograd saves for backward in one forward of a 2 x 24-token batch (each storage counted once)."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids).logits.sum().backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def test_gradient_checkpointing_really_recomputes_the_layers():
    # transformers checkpoints a decoder layer only when `gradient_checkpointing and training`: a model left in the
    # eval mode from_pretrained returns saves every layer's activations, exactly as without the flag
    plain = load_model(tiny_run())
    checkpointed = load_model(tiny_run(), gradient_checkpointing=True)
    assert plain.training and checkpointed.training
    assert not load_model(tiny_run(), frozen=True).training
    full, recomputed = bytes_saved_for_backward(plain), bytes_saved_for_backward(checkpointed)
    # 4 layers: only each layer's input (and the head's) stays; the layers' internals (attention, the SwiGLU MLP)
    # are recomputed, which is most of the bytes
    assert recomputed < 0.5 * full, (recomputed, full)


def test_trained_models_have_no_dropout_even_in_train_mode(tmp_path):
    # a copy of the tiny model whose config asks for heavy attention dropout: in train mode its forward would be
    # random, and every ratio, old log-prob and sampler gap would carry that noise
    for f in TINY_MODEL_DIR.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    model = load_model(tiny_run(str(tmp_path)))
    assert model.training and model.config.attention_dropout == 0.0
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


def test_sampling_flags_that_would_skew_the_log_probs_stop_at_start():
    check_sampling_flags(args())
    check_sampling_flags(args(temperature=2.0))
    for bad in (0.0, -1.0, 2.5):
        with pytest.raises(SystemExit, match=f"--temperature {bad}: .*vLLM rejects"):
            check_sampling_flags(args(temperature=bad))
    with pytest.raises(SystemExit, match="--top-p 0.9: training samples at top_p 1"):
        check_sampling_flags(args(top_p=0.9))
    check_sampling_flags(args(eval_top_p=0.7))  # evaluation may use a nucleus


def test_the_start_up_line_says_what_it_means():
    cpu = torch.device("cpu")
    assert describe_processes(1, "NO", False, False, cpu) == "1 process, not distributed, bf16 autocast off, device cpu"
    two = describe_processes(2, "MULTI_CPU", False, True, cpu)
    assert two == "2 processes, data-parallel (DDP) over gloo (MULTI_CPU), bf16 autocast on, device cpu"
    assert "FSDP2-sharded over NCCL" in describe_processes(8, "MULTI_GPU", True, True, torch.device("cuda", 0))


def test_an_unreadable_config_names_the_local_folders(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit, match="--model nobody/no-such-model: cannot read its config.json.*Qwen/Qwen2.5-7B"):
        load_config("nobody/no-such-model")


def test_in_flight_updates_need_batches_ahead_of_the_trainer():
    def flags(in_flight, max_lag=None):
        fields = {"rollout": SimpleNamespace(in_flight=in_flight)}
        return SimpleNamespace(**fields, **({} if max_lag is None else {"max_lag": max_lag}))

    check_in_flight(flags(True, 2))
    check_in_flight(flags(False, 1))
    for refused in (flags(True, 1), flags(True)):  # --max-lag 1, and a script without --max-lag
        with pytest.raises(SystemExit, match=r"--rollout.in-flight needs --max-lag >= 2 \(this run: 1\)"):
            check_in_flight(refused)
