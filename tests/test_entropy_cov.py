"""Clip-Cov / KL-Cov (algos/entropy_cov.py) against hand-derived values: the token covariance, which tokens each
variant acts on, what it does to their gradients, the aggregation, and the script end to end."""

import json
import math
import os
import subprocess
import sys
import threading

import pytest
import torch
from conftest import REPO, launch_script, load_algo
from loss_checks import assert_padding_changes_nothing


@pytest.fixture(scope="module")
def cov():
    return load_algo("entropy_cov")


# A hand example used below: two sequences, the second padded after two tokens.
#   valid tokens t0..t4 = (0,0) (0,1) (0,2) (1,0) (1,1); A = [2, 2, 2, -2, -2], mean 0.4
#   log π_old = [-0.1, -2.0, -0.5, -0.2, -3.0], mean -1.16
#   C = (A - 0.4)(log π - (-1.16)) = [1.6·1.06, 1.6·(-0.84), 1.6·0.66, -2.4·0.96, -2.4·(-1.84)]
#     = [1.696, -1.344, 1.056, -2.304, 4.416]
ADV = torch.tensor([2.0, -2.0])
OLD = torch.tensor([[-0.1, -2.0, -0.5], [-0.2, -3.0, -7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
C_HAND = [1.696, -1.344, 1.056, -2.304, 4.416]
POSITIONS = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]


def one_process(local):
    return local, 0


def hand_choice(cov, variant, ratio, generator=None):
    return cov.covariance_choice(ADV, OLD, MASK, one_process, variant, ratio, 1.0, 5.0, generator)


def test_defaults_and_the_paper_values_in_the_gpu_command(cov):
    args = cov.Args()
    assert args.cov_variant == "kl-cov" and args.kl_cov_coef == 1.0 and args.kl_coef == 0.0
    assert (args.clip_cov_lb, args.clip_cov_ub, args.clip_eps) == (1.0, 5.0, 1.0)
    assert args.num_minibatches > 1  # KL-Cov's |log r| has zero gradient at r = 1
    # the tiny default is scaled (2e-4 of ~580 tokens floors to 1 token); the GPU command keeps the paper's
    assert args.kl_cov_ratio == args.clip_cov_ratio == 2e-2
    assert "--kl-cov-ratio 2e-3" in cov.__doc__ and "--clip-cov-ratio 2e-4" in cov.__doc__


def test_advantages_hand_values(cov):
    adv = cov.compute_advantages(torch.tensor([1.0, 0, 0, 0, 1.0, 1.0, 1.0, 1.0]), group_size=4)
    assert torch.allclose(adv[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4))


def test_token_covariance_hand_values(cov):
    # A = [1, 1, -1, -1] (mean 0), log π = [-0.5, -1.5, -1, -3] (mean -1.5): C = [1·1, 1·0, -1·0.5, -1·(-1.5)]
    c = cov.token_covariance(torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.tensor([-0.5, -1.5, -1.0, -3.0]))
    assert torch.allclose(c, torch.tensor([1.0, 0.0, -0.5, 1.5]))
    # the means are over tokens, so the padded slot of the hand example is left out
    acted, counts = hand_choice(cov, "kl-cov", 0.2)
    assert counts["tokens"] == 5 and counts["cov"] == pytest.approx(sum(C_HAND), abs=1e-5)


def test_k_is_max_of_int_ratio_times_tokens_and_one(cov):
    c = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.0, 4.0, 0.2, 1.0, -3.0, 0.9])
    assert cov.select_tokens(c, "kl-cov", 2e-4).nonzero().flatten().tolist() == [5]  # int(0.002) = 0 -> 1 token
    assert cov.select_tokens(c, "kl-cov", 0.25).nonzero().flatten().tolist() == [1, 5]  # int(2.5) = 2
    assert cov.select_tokens(c, "kl-cov", 0.35).nonzero().flatten().tolist() == [1, 3, 5]  # int(3.5) = 3
    assert cov.select_tokens(c, "kl-cov", 2.0).all()  # k capped at N
    assert not cov.select_tokens(torch.zeros(0), "kl-cov", 0.5).any()


def test_kl_cov_acts_on_exactly_the_top_k_covariance_tokens(cov):
    # k = int(0.4·5) = 2: the two largest of C_HAND are t4 (4.416, an unlikely token with Â < 0) and t0 (1.696)
    acted, counts = hand_choice(cov, "kl-cov", 0.4)
    assert [p for p in POSITIONS if acted[p]] == [(0, 0), (1, 1)] and counts["acted"] == 2
    # the policy moved: log r = δ. Per token ℓ = -A·e^δ + |δ|·[acted]; dℓ/dlog π = -A·e^δ + sign(δ)·[acted]; mean / 5
    delta = torch.tensor([[0.1, -0.2, 0.3], [-0.1, 0.2, 0.0]])
    lp = (OLD + delta).requires_grad_()
    loss, metrics = cov.policy_loss(lp, OLD, ADV, MASK, acted=acted, variant="kl-cov", kl_cov_coef=1.0)
    loss.backward()
    a = [2.0, 2.0, 2.0, -2.0, -2.0]
    d = [0.1, -0.2, 0.3, -0.1, 0.2]
    penalty = [1.0, 0.0, 0.0, 0.0, 1.0]  # sign(δ)·[acted]: t0 δ > 0, t4 δ > 0
    expected = [(-a[i] * math.exp(d[i]) + penalty[i]) / 5 for i in range(5)]
    assert [lp.grad[p].item() for p in POSITIONS] == pytest.approx(expected, rel=1e-5)
    assert lp.grad[1, 2] == 0.0  # padding
    loss_hand = sum(-a[i] * math.exp(d[i]) + abs(d[i]) * penalty[i] for i in range(5)) / 5
    assert loss.item() == pytest.approx(loss_hand, rel=1e-5)
    assert metrics["clip_frac"] == 0.0  # KL-Cov has no clip and drops no token


def test_kl_cov_penalty_pulls_back_toward_pi_old_from_either_side(cov):
    old = torch.tensor([[math.log(0.5)]])
    for new_p, sign in ((0.6, 1.0), (0.4, -1.0)):  # r = 1.2 and 0.8, A = +1, β = 1: -r + sign(log r)
        lp = torch.tensor([[math.log(new_p)]], requires_grad=True)
        acted = torch.ones(1, 1, dtype=torch.bool)
        cov.policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 1), acted=acted, kl_cov_coef=1.0)[0].backward()
        assert lp.grad.item() == pytest.approx(-new_p / 0.5 + sign, rel=1e-6)
    lp = torch.tensor([[math.log(0.6)]], requires_grad=True)  # β = 0.1 (verl's config default) scales the pull
    cov.policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 1), acted=acted, kl_cov_coef=0.1)[0].backward()
    assert lp.grad.item() == pytest.approx(-1.2 + 0.1, rel=1e-6)


def test_at_ratio_one_kl_cov_is_reinforce_and_clip_cov_still_drops(cov):
    """Why the defaults take several optimiser steps: on-policy (old = logprobs.detach()) KL-Cov's |log r| has zero
    gradient (torch's abs'(0) = 0), so its gradient is the token-mean REINFORCE -A/N. Clip-Cov still zeroes its
    tokens."""
    acted = torch.zeros(2, 3, dtype=torch.bool)
    acted[0, 0] = acted[1, 1] = True
    for variant in ("kl-cov", "clip-cov"):
        lp = OLD.clone().requires_grad_()
        cov.policy_loss(lp, lp.detach(), ADV, MASK, acted=acted, variant=variant)[0].backward()
        expected = -ADV[:, None] * MASK / 5
        if variant == "clip-cov":
            expected = expected * ~acted
        assert torch.allclose(lp.grad, expected)


def test_clip_cov_draws_from_the_band_and_drops_exactly_those_gradients(cov):
    # band 1 < C < 5 holds t0 (1.696), t2 (1.056), t4 (4.416); k = int(0.4·5) = 2 of them per draw
    band = {(0, 0), (0, 2), (1, 1)}
    delta = torch.tensor([[0.1, -0.2, 0.3], [-0.1, 0.2, 0.0]])
    plain = (OLD + delta).requires_grad_()
    cov.policy_loss(plain, OLD, ADV, MASK, variant="clip-cov", clip_eps=1.0)[0].backward()
    # ε = 1 clips nothing here (r in [0.8, 1.4]): every valid token's gradient is -A·r / 5
    r = torch.exp(delta)
    assert torch.allclose(plain.grad, -ADV[:, None] * r * MASK / 5)
    seen = set()
    for seed in range(12):
        acted, counts = hand_choice(cov, "clip-cov", 0.4, torch.Generator().manual_seed(seed))
        chosen = {p for p in POSITIONS if acted[p]}
        assert len(chosen) == 2 and chosen <= band and counts["band"] == 3 and counts["acted"] == 2
        seen |= chosen
        lp = (OLD + delta).requires_grad_()
        loss, metrics = cov.policy_loss(lp, OLD, ADV, MASK, acted=acted, variant="clip-cov", clip_eps=1.0)
        loss.backward()
        for p in POSITIONS:  # zero exactly at the drawn tokens, untouched everywhere else
            assert lp.grad[p].item() == (0.0 if p in chosen else plain.grad[p].item())
        assert metrics["clip_frac"] == pytest.approx(2 / 5)
        # the same seed draws the same tokens (a resume re-seeds from (seed, step, epoch, mini-batch))
        again, _ = hand_choice(cov, "clip-cov", 0.4, torch.Generator().manual_seed(seed))
        assert torch.equal(acted, again)
    assert seen == band  # every band token is drawn by some seed, no other ever
    acted, _ = hand_choice(cov, "clip-cov", 0.9, torch.Generator().manual_seed(0))  # k = 4 > 3 in the band: all 3
    assert {p for p in POSITIONS if acted[p]} == band


def test_clip_cov_keeps_the_ppo_clip_at_epsilon(cov):
    old = torch.tensor([[math.log(0.2)]])
    for new_p, adv, eps, grad in (
        (0.5, 1.0, 1.0, 0.0),  # r = 2.5 > 1 + ε with Â > 0: clipped
        (0.3, 1.0, 1.0, -1.5),  # r = 1.5 inside [0, 2]
        (0.3, 1.0, 0.2, 0.0),  # the same r outside [0.8, 1.2]
        (0.1, -1.0, 0.2, 0.0),  # r = 0.5 < 0.8 with Â < 0: clipped
        (0.1, -1.0, 1.0, 0.5),  # ... but inside [0, 2]
    ):
        lp = torch.tensor([[math.log(new_p)]], requires_grad=True)
        loss, metrics = cov.policy_loss(
            lp, old, torch.tensor([adv]), torch.ones(1, 1), variant="clip-cov", clip_eps=eps
        )
        loss.backward()
        assert lp.grad.item() == pytest.approx(grad, abs=1e-6)
        assert metrics["clip_frac"] == (1.0 if grad == 0.0 else 0.0)


def test_aggregation_is_the_token_mean_over_the_minibatch(cov):
    # on-policy, log π = -1: ℓ = -A·1 per token; rows of 1 and 3 tokens: (−a − 3b) / 4
    a, b = 0.7, -0.4
    lp = torch.full((2, 4), -1.0, requires_grad=True)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    for variant in ("kl-cov", "clip-cov"):
        loss, _ = cov.policy_loss(lp, lp.detach(), torch.tensor([a, b]), mask, variant=variant)
        assert loss.item() == pytest.approx(-(a + 3 * b) / 4)


@pytest.mark.parametrize("variant", ["kl-cov", "clip-cov"])
def test_padding_changes_nothing(cov, variant):
    torch.manual_seed(0)
    lp0 = torch.randn(3, 5)
    old, adv = lp0 + 0.5 * torch.randn(3, 5), torch.randn(3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    acted = torch.tensor([[1, 0, 1, 0, 0], [0, 1, 0, 0, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    assert_padding_changes_nothing(
        lambda lp, o, a, m, shift: cov.policy_loss(lp, o, a, m, acted=acted, variant=variant), lp0, old, adv, mask
    )


@pytest.mark.parametrize("variant", ["kl-cov", "clip-cov"])
def test_micro_batches_accumulate_to_the_minibatch_gradient(cov, variant):
    g = torch.Generator().manual_seed(1)
    lp0, adv = torch.randn(6, 7, generator=g), torch.randn(6, generator=g)
    old = lp0 + 0.3 * torch.randn(6, 7, generator=g)
    mask = (torch.rand(6, 7, generator=g) > 0.4).long()
    mask[:, 0] = 1
    acted = (torch.rand(6, 7, generator=g) > 0.7) & mask.bool()
    whole = lp0.clone().requires_grad_()
    cov.policy_loss(whole, old, adv, mask, acted=acted, variant=variant)[0].backward()
    parts = lp0.clone().requires_grad_()
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        cov.policy_loss(
            parts[rows], old[rows], adv[rows], mask[rows], acted=acted[rows], variant=variant, num_tokens=mask.sum()
        )[0].backward()
    assert torch.allclose(whole.grad, parts.grad, atol=1e-7)


def test_the_choice_spans_every_process(cov):
    """Two threads standing in for two processes, each with half the rows, gather their tokens: each gets its own
    rows' share of the one-process choice, so the process count changes neither the covariance nor the tokens."""
    g = torch.Generator().manual_seed(4)
    adv, lp = torch.randn(6, generator=g), torch.randn(6, 5, generator=g) - 1.0
    mask = (torch.rand(6, 5, generator=g) > 0.3).long()
    mask[:, 0] = 1
    for variant, ratio in (("kl-cov", 0.1), ("clip-cov", 0.1)):
        whole, whole_counts = cov.covariance_choice(
            adv, lp, mask, one_process, variant, ratio, 0.1, 5.0, torch.Generator().manual_seed(7)
        )
        barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

        def rank(r, variant=variant, ratio=ratio):
            def gather(local):
                slots[r] = local
                barrier.wait()
                return torch.cat(slots), 0 if r == 0 else slots[0].shape[0]

            rows = slice(3 * r, 3 * r + 3)
            out[r] = cov.covariance_choice(
                adv[rows], lp[rows], mask[rows], gather, variant, ratio, 0.1, 5.0, torch.Generator().manual_seed(7)
            )

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert whole.any() and torch.equal(torch.cat([out[0][0], out[1][0]]), whole), variant
        assert out[0][1] == out[1][1] == whole_counts


def test_correction_weights_multiply_the_penalty_too_not_the_kl(cov):
    old = torch.tensor([[math.log(0.5), math.log(0.5)]])
    lp = torch.tensor([[math.log(0.6), math.log(0.4)]], requires_grad=True)  # r = [1.2, 0.8]
    acted = torch.tensor([[True, False]])
    weights, ref = torch.tensor([[2.0, 0.5]]), torch.zeros(1, 2)
    loss, _ = cov.policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2), acted=acted, is_weights=weights)
    loss.backward()
    # dℓ/dlog π = w·(-A·r + sign(log r)·[acted]) / 2 = [2·(-1.2 + 1), 0.5·(-0.8)] / 2
    assert torch.allclose(lp.grad, torch.tensor([[-0.2, -0.2]]), atol=1e-6)
    kl_loss, metrics = cov.policy_loss(
        lp, old, torch.tensor([1.0]), torch.ones(1, 2), acted=acted, is_weights=weights, kl_coef=0.1, ref_logprobs=ref
    )
    k3 = [math.exp(-math.log(p)) + math.log(p) - 1 for p in (0.6, 0.4)]  # π_ref = 1: δ = -log π
    assert kl_loss.item() - loss.item() == pytest.approx(0.1 * sum(k3) / 2, rel=1e-5)  # unweighted
    assert metrics["kl"] == pytest.approx(sum(k3) / 2, rel=1e-5)


# ------------------------------------------------------------------------------------------------ end to end
SMALL = (
    "--prompts-per-step 4 --group-size 4 --max-new-tokens 24 --micro-batch-size 8 --eval.max-problems 8 "
    "--eval.n 2 --eval.k 1 2 --eval-every 10 --save-every 1"
).split()


def run(out_dir, *flags):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, str(REPO / "algos" / "entropy_cov.py"), "--output-dir", str(out_dir), *SMALL, *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (out_dir / flags[1] / "metrics.jsonl").read_text().splitlines()]


def test_clip_cov_runs_end_to_end_and_logs_what_it_acted_on(tmp_path):
    rows = [
        r
        for r in run(tmp_path, "--run-name", "c", "--total-steps", "2", "--cov-variant", "clip-cov")
        if "train/loss" in r
    ]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # 16 sequences in 4 mini-batches of 4: every mini-batch acts on at least 1 token (fewer only if its band
        # were empty), at most 2% of its tokens rounded down, or 1
        assert 1 <= r["train/cov_tokens"] and 0 < r["train/cov_frac"] < 0.1
        assert 0 < r["train/cov_band_frac"] <= 1 and r["train/clip_frac"] > 0 and r["train/entropy"] > 0
        assert r["train/cov_frac"] <= r["train/cov_band_frac"]


@pytest.mark.slow
def test_clip_cov_resume_reproduces_the_draw(tmp_path):
    flags = ["--cov-variant", "clip-cov"]
    full = run(tmp_path, "--run-name", "full", "--total-steps", "3", *flags)
    run(tmp_path, "--run-name", "split", "--total-steps", "2", *flags)
    split = run(tmp_path, "--run-name", "split", "--total-steps", "3", "--resume", *flags)
    a, b = ([r for r in rows if r.get("step") == 3 and "train/loss" in r][0] for rows in (full, split))
    for key in ("train/reward", "train/cov_tokens", "train/cov_band_frac", "train/clip_frac"):
        assert a[key] == b[key], key
    assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)


@pytest.mark.slow
def test_two_processes_choose_the_same_tokens_as_one(tmp_path):
    """One mini-batch, two epochs: the second epoch's KL-Cov penalty acts (r ≠ 1) on the top-k of the whole batch,
    which must be the same tokens on 1 and 2 processes. Measured: updates 5.4e-6 apart; with each process choosing
    among its own tokens (k of each half) 6.2e-2 apart, and half the tokens per process."""
    flags = (
        "--prompts-per-step 4 --group-size 4 --max-new-tokens 24 --micro-batch-size 8 --total-steps 2 --eval-every 100 "
        "--eval.max-problems 4 --eval.n 1 --eval.k 1 --save-every 1 --mixed-precision no --num-minibatches 1 "
        "--num-epochs 2 --kl-cov-ratio 0.05"
    ).split()
    from safetensors.torch import load_file

    deltas, counts = [], []
    base = load_file(REPO / "common" / "tiny_model" / "model.safetensors")
    for name, nproc in (("one", 1), ("two", 2)):
        launch_script("entropy_cov", ["--output-dir", str(tmp_path), "--run-name", name, *flags], nproc)
        w = load_file(tmp_path / name / "final" / "model.safetensors")
        deltas.append(torch.cat([(w[k] - base[k]).flatten() for k in base]))
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        counts.append([r["train/cov_tokens"] for r in rows if "train/cov_tokens" in r])
    assert counts[0] == counts[1]
    rel = ((deltas[0] - deltas[1]).norm() / deltas[0].norm()).item()
    assert deltas[0].abs().max() > 1e-5 and rel < 1e-3, rel
