"""FSDP2 (``--fsdp``) on the CPU over gloo, two processes (torchrun): sharded training gives the same update as one
unsharded process on the same global batch (grpo; ppo with its critic sharded; prime with its PRM sharded), each
rank holds half the parameter and optimiser-state bytes, a resume from a checkpoint written under FSDP continues
the run exactly (on two processes, and on one without --fsdp), the HF engine samples from the updated weights, and
bf16 autocast keeps the sharded update within a measured distance of the unsharded one.

This file is also the two-process worker of ``test_shards_hold_half_of_every_byte`` (run under torchrun)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port, launch_script, train_rows, update_gap, weights
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "common" / "tiny_model"
FLAGS = (
    "--prompts-per-step 4 --group-size 4 --max-new-tokens 24 --micro-batch-size 8 --eval-every 100 "
    "--eval.max-problems 4 --eval.n 1 --eval.k 1 --kl-coef 0.04 --save-every 1 --keep-checkpoints 0"
).split()
SCRIPT_FLAGS = {"grpo": [], "ppo": ["--critic-num-minibatches", "1"], "prime": []}
# measured (2 cores, gloo): relative L2 gap of the update, sharded vs one process, 6e-6 (grpo), 7e-6 (ppo), 9e-6
# (prime): float summation order in the reduce-scatter. A real mismatch (a gradient not averaged over the ranks,
# a shard left out, a stale root) gives 0.1-1.
FP32_TOL = 1e-3
# measured under bf16 autocast, 2 steps: --fsdp vs DDP on the same 2 processes 0 (bit-identical: the same per-rank
# micro-batches, and a sum of two gradients does not depend on its order); vs one process 1.4e-2, as DDP vs one
# process (1.5e-2, tests/test_distributed.py): bf16 rounds differently in differently composed micro-batches.
BF16_VS_DDP_TOL = 1e-4
BF16_VS_ONE_TOL = 3e-2


def launch(tmp_path, name, nproc, algo="grpo", extra=()):
    args = ["--output-dir", str(tmp_path), "--run-name", name, *FLAGS, *SCRIPT_FLAGS[algo], *extra]
    result = launch_script(algo, args, nproc, timeout=600)
    layout = "not distributed" if nproc == 1 else "FSDP2-sharded" if "--fsdp" in extra else "data-parallel (DDP)"
    assert layout in result.stdout and f"{nproc} process" in result.stdout
    return result


def assert_same_steps(rows_a: list[dict], rows_b: list[dict]) -> None:
    """The same samples (rewards, lengths) and, within float summation order, the same update statistics."""
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for a, b in zip(rows_a, rows_b):
        assert (a["train/reward"], a["train/response_len"]) == (b["train/reward"], b["train/response_len"]), a["step"]
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-3), a["step"]


def test_grpo_sharded_matches_one_process_and_resumes(tmp_path):
    """The done-when check at test size: 2 steps under --fsdp on two processes against one unsharded process (fp32),
    then a resume of that FSDP checkpoint to step 3, on two processes with --fsdp and on one process without it, both
    reproducing the uninterrupted run's step 3 (step 2's and 3's samples come from the engine's refreshed copy)."""
    fp32 = ["--mixed-precision", "no"]
    launch(tmp_path, "one", 1, extra=[*fp32, "--total-steps", "3"])
    launch(tmp_path, "fsdp", 2, extra=[*fp32, "--total-steps", "2", "--fsdp"])
    base = load_file(TINY / "model.safetensors")
    one, fsdp = tmp_path / "one", tmp_path / "fsdp"
    gap = update_gap(base, weights(one, 2), weights(fsdp))
    print(f"grpo: --fsdp on 2 processes vs 1 process, relative L2 gap of the 2-step update {gap:.1e}")
    assert gap < FP32_TOL
    assert update_gap(base, weights(fsdp, 2), weights(fsdp)) == 0.0  # final/ holds the checkpoint's gathered weights
    assert_same_steps(train_rows(one)[:2], train_rows(fsdp))
    shutil.copytree(fsdp, tmp_path / "fsdp_on_one")
    launch(tmp_path, "fsdp", 2, extra=[*fp32, "--total-steps", "3", "--fsdp", "--resume"])
    resumed = launch(tmp_path, "fsdp_on_one", 1, extra=[*fp32, "--total-steps", "3", "--resume"])
    assert "checkpointed on 2" in resumed.stdout  # per-process RNG restarts; samples use per-prompt seeds
    for name in ("fsdp", "fsdp_on_one"):
        assert_same_steps(train_rows(one), train_rows(tmp_path / name))
        gap = update_gap(base, weights(one), weights(tmp_path / name))
        print(f"grpo: resumed {name} vs uninterrupted 1 process, relative L2 gap of the 3-step update {gap:.1e}")
        assert gap < FP32_TOL


@pytest.mark.slow  # the main suite shards grpo (above); the critic and the PRM only here
@pytest.mark.parametrize("algo", ["ppo", "prime"])
def test_critic_and_prm_sharded_match_one_process(tmp_path, algo):
    """ppo shards its critic and prime its implicit PRM: both models' updates match one unsharded process (fp32)."""
    extra = ["--mixed-precision", "no", "--total-steps", "2"]
    launch(tmp_path, "one", 1, algo, extra)
    launch(tmp_path, "fsdp", 2, algo, [*extra, "--fsdp"])
    base = load_file(TINY / "model.safetensors")
    one, fsdp = tmp_path / "one", tmp_path / "fsdp"
    gaps = {"policy": update_gap(base, weights(one), weights(fsdp))}
    if algo == "ppo":
        critic_one, critic_fsdp = (load_file(d / "final_critic" / "model.safetensors") for d in (one, fsdp))
        critic_base = {k: base.get(k, torch.zeros_like(v)) for k, v in critic_one.items()}  # score head starts at 0
        gaps["critic"] = update_gap(critic_base, critic_one, critic_fsdp)
    else:
        gaps["prm"] = update_gap(base, weights(one, 2, "prm"), weights(fsdp, 2, "prm"))
    print(f"{algo}: --fsdp on 2 processes vs 1 process, relative L2 gaps of the updates", gaps)
    assert all(g < FP32_TOL for g in gaps.values()), gaps
    assert_same_steps(train_rows(one), train_rows(fsdp))


@pytest.mark.slow
def test_bf16_autocast_sharded_update_stays_close(tmp_path):
    """Under bf16 autocast (fp32 master weights, fp32 reductions) the sharded update against the unsharded ones: DDP
    on the same two processes (the same per-rank micro-batches: what sharding itself changes) and one process (whose
    micro-batches hold other rows, so bf16 rounds differently)."""
    extra = ["--mixed-precision", "bf16", "--total-steps", "2"]
    launch(tmp_path, "one", 1, extra=extra)
    launch(tmp_path, "ddp", 2, extra=extra)
    launch(tmp_path, "fsdp", 2, extra=[*extra, "--fsdp"])
    base, fsdp = load_file(TINY / "model.safetensors"), weights(tmp_path / "fsdp")
    vs_ddp, vs_one = (update_gap(base, weights(tmp_path / name), fsdp) for name in ("ddp", "one"))
    print(f"grpo bf16: relative L2 gap of the 2-step update, --fsdp vs DDP {vs_ddp:.1e}, vs 1 process {vs_one:.1e}")
    assert vs_ddp < BF16_VS_DDP_TOL and vs_one < BF16_VS_ONE_TOL
    assert_same_steps(train_rows(tmp_path / "ddp"), train_rows(tmp_path / "fsdp"))


def test_shards_hold_half_of_every_byte(tmp_path):
    """Each of two ranks holds about half of the parameter and AdamW-state bytes (counted from its local shards)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    result = subprocess.run([*cmd, __file__, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    shares = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    print("per-rank shares of the full model's bytes:", shares)
    for share in shares:
        assert 0.45 < share["params"] < 0.55 and 0.45 < share["optimizer"] < 0.55
    assert sum(s["params_bytes"] for s in shares) == shares[0]["full_params_bytes"]


def _worker(out_dir: str) -> None:
    """Under torchrun: shard the tiny model, take an AdamW step, and write this rank's byte shares."""
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from transformers import AutoModelForCausalLM

    from common.sharding import shard_model

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = shard_model(AutoModelForCausalLM.from_pretrained(TINY, attn_implementation="eager"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.sum().backward()
    optimizer.step()
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    params = sum(local(p).numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
    opt_local = sum(local(v).numel() * v.element_size() for v in moments)
    opt_full = sum(v.numel() * v.element_size() for v in moments)
    share = {"params": params / full, "optimizer": opt_local / opt_full, "params_bytes": params}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(share | {"full_params_bytes": full}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])


def test_gather_and_restore_keep_the_schedulers_own_state():
    """A learning-rate scheduler has an ``optimizer`` attribute too: it must be saved as a scheduler (its step count),
    not as its optimiser, or a resume restarts the warm-up."""
    from transformers import AutoModelForCausalLM

    from common.data import TINY_MODEL_DIR
    from common.sharding import gather_state, restore_state

    def build():
        model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
        return {"model": model, "optimizer": optimizer, "scheduler": scheduler}

    state = build()
    ids = torch.arange(12).view(2, 6)
    for _ in range(3):
        state["model"](input_ids=ids, labels=ids).loss.backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state["scheduler"].step()
    saved = gather_state(state)
    assert saved["scheduler"]["last_epoch"] == 3
    fresh = build()
    restore_state(fresh, saved)
    assert fresh["scheduler"].last_epoch == 3
    assert fresh["optimizer"].param_groups[0]["lr"] == pytest.approx(state["optimizer"].param_groups[0]["lr"])
    fresh["scheduler"].step()
    state["scheduler"].step()
    assert fresh["optimizer"].param_groups[0]["lr"] == pytest.approx(state["optimizer"].param_groups[0]["lr"])


@pytest.mark.slow  # packing on one process and sharding without it stay in the main suite
def test_packed_micro_batches_on_two_processes_match_one(tmp_path):
    """--micro-batch-tokens over ranks: ppo (policy, reference, critic) packed into bins of 100 tokens, one process
    against two under DDP and under --fsdp (fp32). The ranks' sequences need different numbers of bins, so each
    pads its count to the largest (a rank that ran fewer forwards would leave the other waiting at an FSDP2
    collective: the short --dist-timeout-minutes turns such a hang into a failure)."""
    extra = [
        *("--mixed-precision", "no", "--total-steps", "2", "--dist-timeout-minutes", "3"),
        *("--max-prompt-tokens", "64", "--micro-batch-tokens", "100"),
    ]
    launch(tmp_path, "one", 1, "ppo", extra)
    launch(tmp_path, "ddp", 2, "ppo", extra)
    launch(tmp_path, "fsdp", 2, "ppo", [*extra, "--fsdp"])
    base = load_file(TINY / "model.safetensors")
    for name in ("ddp", "fsdp"):
        gap = update_gap(base, weights(tmp_path / "one"), weights(tmp_path / name))
        print(f"ppo packed: {name} on 2 processes vs 1 process, relative L2 gap of the 2-step update {gap:.1e}")
        assert gap < FP32_TOL
        assert_same_steps(train_rows(tmp_path / "one"), train_rows(tmp_path / name))
