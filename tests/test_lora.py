"""LoRA (``--lora.rank``, common/lora.py) on the tiny model: at initialisation the policy and its reference (the
adapters disabled) give the base model's log-probs exactly; with non-zero B the adapters are live, and the merged
weights every engine receives reproduce the adapted policy; an update moves only adapter tensors; bad flags stop
with the names found. A grpo run: checkpoints hold the adapter (PEFT's format) and no frozen base, a resume is exact,
``final/`` is the merged model and ``final_adapter/`` loads onto the base with peft to the same weights, and two
processes (DDP and --fsdp) give the one-process update. The vLLM push of a LoRA policy: tests/test_vllm_*.py."""

from pathlib import Path

import pytest
import torch
from conftest import launch_script, load_algo, train_rows, update_gap, weights
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.logprobs import token_logprobs
from common.lora import AdapterDisabled, LoraConfig, apply_lora, check_lora
from common.weight_export import export_weights

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "common" / "tiny_model"
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def base_model(dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(TINY, dtype=dtype).eval()


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 279, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row
    return ids, mask


def logprobs(model):
    ids, mask = batch()
    with torch.no_grad():
        return token_logprobs(model, ids, mask, 12, 1.0)[0]


def perturbed_lora(rank=8, dtype=torch.float32):
    """A rank-``rank`` LoRA policy on the tiny model with random non-zero B (as after training)."""
    policy = apply_lora(base_model(dtype), LoraConfig(rank=rank)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    return policy


def test_at_initialisation_the_policy_and_its_reference_equal_the_base_exactly():
    base = logprobs(base_model())
    policy = apply_lora(base_model(), LoraConfig(rank=8))
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == set(LINEAR)  # all-linear: every linear layer of the decoder, not the LM head
    policy.eval()
    assert torch.equal(logprobs(policy), base)
    assert torch.equal(logprobs(AdapterDisabled(policy)), base)


def test_with_nonzero_b_the_adapters_are_live_and_the_merged_weights_reproduce_them():
    base = logprobs(base_model())
    policy = perturbed_lora()
    adapted = logprobs(policy)
    assert (adapted - base).abs().max() > 0.1  # the adapters enter the forward pass
    assert torch.equal(logprobs(AdapterDisabled(policy)), base)  # the reference: the base, exactly

    merged = base_model()
    names = dict(export_weights(policy))
    assert set(names) == {n for n, _ in merged.named_parameters()}  # the base model's own names, nothing else
    merged.load_state_dict(names, strict=False)
    merged.tie_weights()
    assert (logprobs(merged) - adapted).abs().max() < 2e-5  # what an engine samples = the adapted policy
    # and the merge is W + (α/r) B A, by hand for one layer
    layer = policy.base_model.model.model.layers[0].self_attn.q_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = layer.base_layer.weight + (32.0 / 8) * b @ a
    assert torch.allclose(names["model.layers.0.self_attn.q_proj.weight"], expected, atol=1e-7)


def test_one_step_changes_only_the_adapters():
    policy = perturbed_lora().train()
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.1)
    ids, mask = batch()
    lp, _ = token_logprobs(policy, ids, mask, 12, 1.0)
    (-lp.mean()).backward()
    optimizer.step()
    for name, param in policy.named_parameters():
        if ".lora_" in name:
            assert not torch.equal(param, before[name]), name
        else:
            assert torch.equal(param, before[name]), name  # bit-identical base (no weight decay on frozen tensors)


def test_bad_lora_flags_stop_with_a_message():
    with pytest.raises(SystemExit, match="--lora.rank -1: must be >= 0"):
        check_lora(LoraConfig(rank=-1))
    with pytest.raises(SystemExit, match="--lora.dropout 0.1 with --num-minibatches 4: the batch is used more"):
        check_lora(LoraConfig(rank=8, dropout=0.1), batch_reuse="--num-minibatches 4")
    with pytest.raises(SystemExit, match=r"compares .* with the sampler's \(--correction.mode token_truncate\)"):
        check_lora(LoraConfig(rank=8, dropout=0.1), sampler_comparison="--correction.mode token_truncate")
    check_lora(LoraConfig(rank=8, dropout=0.1))  # one use of each batch, no comparison with μ: allowed
    check_lora(LoraConfig(rank=8), "--num-minibatches 4", "--correction.mode token_truncate")  # no dropout: allowed
    with pytest.raises(SystemExit, match="Linear layers of this model: down_proj, gate_proj, k_proj, lm_head"):
        apply_lora(base_model(), LoraConfig(rank=8, target_modules=("qkv_proj",)))


class _Accepted(Exception):
    pass


def dropout_check(script: str, monkeypatch, *flags: str) -> str:
    """What ``algos/<script>.py --lora.rank 4 --lora.dropout 0.1 <flags>`` does at its flag checks: '' when its
    ``start_run`` accepts the flags (it reaches the process start, stubbed here: nothing loads or writes), else the
    refusal's message."""
    module = load_algo(script)

    def accepted(*args, **kwargs):
        raise _Accepted

    monkeypatch.setattr("common.runtime.Accelerator", accepted)
    monkeypatch.setattr("sys.argv", [f"{script}.py", "--lora.rank", "4", "--lora.dropout", "0.1", *flags])
    try:
        module.main()
    except _Accepted:
        return ""
    except SystemExit as exc:
        return str(exc)
    raise AssertionError(f"{script}: main returned without starting a run")


def test_lora_dropout_is_refused_where_a_batch_is_reused_or_the_loss_compares_with_the_sampler(monkeypatch):
    """Dropout makes each training forward draw its own masks: harmless only when every ratio the loss takes is
    between forwards with the same masks (one minibatch, one epoch, no comparison with the sampler's log-probs μ)."""
    assert dropout_check("grpo", monkeypatch) == ""  # one minibatch, one epoch, HF engine: the ratio is exactly 1
    assert dropout_check("cispo", monkeypatch, "--num-minibatches", "1") == ""
    # a reused batch: π_old and the update are forwards with different masks (dapo's 4 minibatches by default)
    assert "with --num-minibatches 4: the batch is used more than once" in dropout_check("dapo", monkeypatch)
    assert "with --num-minibatches 2" in dropout_check("cispo", monkeypatch)
    assert "with --num-epochs 2" in dropout_check("grpo", monkeypatch, "--num-epochs", "2")
    # a correction mode compares π_old with μ (the HF engine in eval mode: no dropout)
    refusal = dropout_check("grpo", monkeypatch, "--correction.mode", "token_truncate")
    assert "compares the trainer's log-probs with the sampler's (--correction.mode token_truncate)" in refusal
    # the script's own weight against μ, named as such (its correction mode resolves to none): scalerl at any lag,
    # dppo's trust region anchored to μ, cispo under lag
    for script, flags in [
        ("scalerl", ()),
        ("scalerl", ("--max-lag", "1")),
        ("dppo", ("--num-minibatches", "1")),
        ("cispo", ("--num-minibatches", "1", "--max-lag", "2")),
    ]:
        refusal = dropout_check(script, monkeypatch, *flags)
        assert "compares the trainer's log-probs with the sampler's" in refusal, (script, flags, refusal)
        assert "sampler's log-probs μ" in refusal and "token_truncate" not in refusal, (script, flags, refusal)


# --------------------------------------------------------------------------------------------------------- a run
FLAGS = (
    "--prompts-per-step 4 --group-size 4 --max-new-tokens 24 --micro-batch-size 8 --eval-every 100 "
    "--eval.max-problems 4 --eval.n 1 --eval.k 1 --save-every 1 --keep-checkpoints 0 --mixed-precision no "
    "--lora.rank 8 --learning-rate 1e-3"
).split()


def launch(tmp_path, name, nproc, *extra):
    return launch_script("grpo", ["--output-dir", str(tmp_path), "--run-name", name, *FLAGS, *extra], nproc)


def test_a_lora_run_checkpoints_the_adapter_and_resumes_exactly(tmp_path):
    from peft import PeftModel

    launch(tmp_path, "one", 1, "--total-steps", "3")
    one = tmp_path / "one"
    saved = weights(one, 1)
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)  # no frozen base in the checkpoint
    peft_files = sorted(p.name for p in (one / "checkpoints" / "step_000001" / "adapter").iterdir())
    assert peft_files == ["adapter_config.json", "adapter_model.safetensors"]

    # final/ is the merged model; final_adapter/ on the base, through peft, gives the same weights
    merged = load_file(one / "final" / "model.safetensors")
    assert set(merged) == set(load_file(TINY / "model.safetensors"))
    restored = PeftModel.from_pretrained(base_model(), one / "final_adapter").merge_and_unload()
    restored = restored.state_dict()
    for name, tensor in merged.items():
        assert torch.allclose(restored[name], tensor, atol=1e-6), name
    plain = AutoModelForCausalLM.from_pretrained(one / "final")  # what common.evaluate --model loads: no peft in it
    assert type(plain.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert torch.equal(plain.model.layers[0].mlp.down_proj.weight, merged["model.layers.0.mlp.down_proj.weight"])
    assert any(not torch.equal(merged[k], v) for k, v in load_file(TINY / "model.safetensors").items())

    # a resume from step 2 reproduces step 3
    launch(tmp_path, "split", 1, "--total-steps", "2")
    launch(tmp_path, "split", 1, "--total-steps", "3", "--resume")
    full, split = train_rows(one), train_rows(tmp_path / "split")
    assert [r["step"] for r in split] == [1, 2, 3]
    assert (split[2]["train/reward"], split[2]["train/response_len"]) == (
        full[2]["train/reward"],
        full[2]["train/response_len"],
    )
    assert split[2]["train/loss"] == pytest.approx(full[2]["train/loss"], abs=1e-6)
    assert torch.equal(
        load_file(tmp_path / "split" / "final" / "model.safetensors")["model.norm.weight"], merged["model.norm.weight"]
    )
    assert update_gap(weights(one, 1), weights(one, 3), weights(tmp_path / "split", 3)) < 1e-4


@pytest.mark.slow  # two-process equality without LoRA stays in the main suite (test_distributed, test_fsdp)
def test_two_lora_processes_match_one(tmp_path):
    """Two processes (DDP, then FSDP2) take the one-process step on the same global batch."""
    launch(tmp_path, "one", 1, "--total-steps", "2")
    one = tmp_path / "one"
    launch(tmp_path, "ddp", 2, "--total-steps", "2")
    launch(tmp_path, "fsdp", 2, "--total-steps", "2", "--fsdp")
    start = weights(one, 1)
    for name in ("ddp", "fsdp"):
        g = update_gap(start, weights(one, 2), weights(tmp_path / name, 2))
        print(f"LoRA grpo: {name} on 2 processes vs 1, relative L2 gap of step 2's adapter update {g:.1e}")
        assert g < 1e-3
