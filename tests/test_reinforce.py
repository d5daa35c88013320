"""REINFORCE / REINFORCE++ math against hand-derived values, the EMA baseline across a resume, and the planner's view.

Hand derivations are in the comments; nothing here is copied from the code under test."""

import math

import pytest
import torch
from conftest import load_algo
from loss_checks import assert_micro_batches_accumulate, assert_padding_changes_nothing, on_two_fake_ranks, random_batch
from test_scripts import read_metrics, run


@pytest.fixture(scope="module")
def rf():
    return load_algo("reinforce")


# ---------------------------------------------------------------- the EMA baseline and its state
def test_ema_hand_values(rf):
    # α = 0.9; batch means 0.5, 1.0, 0.0. b_1 = 0.5 (no earlier batch: its own mean), then b_2 = 0.5,
    # b_3 = 0.9·0.5 + 0.1·1.0 = 0.55, b_4 = 0.9·0.55 + 0.1·0.0 = 0.495
    ema = rf.RewardEMA(0.9)
    seen = []
    for mean in (0.5, 1.0, 0.0):
        seen.append(ema.baseline(mean))
        ema.update(mean)
    seen.append(ema.baseline(123.0))  # from now on the batch's own mean plays no part
    assert seen == pytest.approx([0.5, 0.5, 0.55, 0.495])


def test_ema_state_survives_a_checkpoint(rf):
    # two batches, saved and loaded into a fresh EMA, then the third: b_3 = 0.9·0.2 + 0.1·0.6 = 0.24 on both sides
    ema = rf.RewardEMA(0.9)
    for mean in (0.2, 0.6):
        ema.update(mean)
    restored = rf.RewardEMA(0.9)
    restored.load_state_dict(torch.load(_roundtrip(ema.state_dict()), weights_only=False))
    assert restored.baseline(0.9) == pytest.approx(0.24) == ema.baseline(0.9)
    fresh = rf.RewardEMA(0.9)  # what a resume without the state would subtract: the new batch's own mean
    assert fresh.baseline(0.9) == 0.9


def _roundtrip(obj):
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return buffer


# ---------------------------------------------------------------- ema, batch and rpp advantages
def test_ema_and_batch_advantages_hand_values(rf):
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    # ema: one number off every score, no std division
    adv = rf.compute_advantages(scores, group_size=4, baseline="ema", baseline_value=0.25)
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, 0.75, 0.75, -0.25, -0.25, -0.25]))
    # batch: the batch's mean 3/8 off every score, across groups (a group of equal scores still gets A != 0)
    adv = rf.compute_advantages(scores, group_size=4, baseline="batch")
    assert torch.allclose(adv, scores - 0.375)
    with pytest.raises(ValueError, match="EMA"):
        rf.compute_advantages(scores, group_size=4, baseline="ema")
    with pytest.raises(ValueError, match="groups of 3"):
        rf.compute_advantages(scores, group_size=3, baseline="batch")


def test_batch_mean_spans_processes(rf):
    # two ranks of 4 rows: the baseline is the mean of all 8 scores (0.5), not each rank's own (0.75 and 0.25)
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    mask = torch.ones(8, 1)
    out = on_two_fake_ranks(lambda x, m, ar: rf.compute_advantages(x, 2, "batch", all_reduce=ar), scores, mask)
    assert torch.allclose(out, scores - 0.5)


def test_rpp_baseline_hand_values(rf):
    # G = 2; scores [1, 0 | 1, 1]; lengths 2, 1, 1, 1 (T = 2). Group means 0.5 and 1 -> centred [0.5, -0.5, 0, 0],
    # on the tokens [0.5, 0.5 | -0.5 | 0 | 0]: mean 0.1, squared deviations .16 .16 .36 .01 .01 = 0.70,
    # Bessel variance 0.70 / 4 = 0.175 (population 0.14 would differ), std 0.41833
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 0]])
    adv = rf.compute_advantages(scores, group_size=2, baseline="rpp", mask=mask)
    std = math.sqrt(0.175 + 1e-8)
    expected = torch.tensor([[0.4, 0.4], [-0.6, 0.0], [-0.1, 0.0], [-0.1, 0.0]]) / std
    expected[1:, 1] = 0.0  # padding stays 0
    assert torch.allclose(adv, expected, atol=1e-5)


def test_rpp_whitening_spans_processes(rf):
    torch.manual_seed(0)
    scores, mask = torch.rand(8), (torch.rand(8, 5) > 0.4).long()
    mask[:, 0] = 1
    whole = rf.compute_advantages(scores, 2, "rpp", mask=mask)
    out = on_two_fake_ranks(lambda x, m, ar: rf.compute_advantages(x, 2, "rpp", mask=m, all_reduce=ar), scores, mask)
    assert torch.allclose(out, whole, atol=1e-6)
    assert not torch.allclose(out[:4], rf.compute_advantages(scores[:4], 2, "rpp", mask=mask[:4]), atol=1e-3)


# ---------------------------------------------------------------- REINFORCE++: k1 in the reward, returns, whitening
def test_rpp_kl_returns_on_a_one_by_three_example(rf):
    # R = 1; log π_old = [-1, -0.5, -2], log π_ref = [-1.5, -0.5, -1] -> k1 = [0.5, 0, -1]; β = 0.1:
    # r = [-0.05, 0, -0.1·(-1) + 1] = [-0.05, 0, 1.1]
    mask = torch.ones(1, 3)
    old, ref = torch.tensor([[-1.0, -0.5, -2.0]]), torch.tensor([[-1.5, -0.5, -1.0]])
    r = rf.token_rewards(torch.tensor([1.0]), mask, kl_coef=0.1, old_logprobs=old, ref_logprobs=ref)
    assert torch.allclose(r, torch.tensor([[-0.05, 0.0, 1.1]]))
    # γ = 1: G = [-0.05 + 0 + 1.1, 0 + 1.1, 1.1] = [1.05, 1.1, 1.1]
    returns = rf.discounted_returns(r, mask, gamma=1.0)
    assert torch.allclose(returns, torch.tensor([[1.05, 1.1, 1.1]]))
    # γ = 0.5: G_3 = 1.1, G_2 = 0.5·1.1 = 0.55, G_1 = -0.05 + 0.5·0.55 = 0.225
    assert torch.allclose(rf.discounted_returns(r, mask, gamma=0.5), torch.tensor([[0.225, 0.55, 1.1]]))
    # whitened (γ = 1): mean 1.08333, deviations [-1/30, 1/60, 1/60], Bessel variance (1/900 + 2/3600) / 2 = 1/1200,
    # so [-1/30, 1/60, 1/60]·sqrt(1200) = [-2/√3, 1/√3, 1/√3]
    adv = rf.masked_whiten(returns, mask)
    s3 = math.sqrt(3)
    assert torch.allclose(adv, torch.tensor([[-2 / s3, 1 / s3, 1 / s3]]), rtol=1e-4)


def test_returns_do_not_leak_across_padding(rf):
    # row 0 has 2 tokens (reward 1 on its second); garbage in the padded position changes nothing
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    r = rf.token_rewards(torch.tensor([1.0, 0.5]), mask)
    assert torch.equal(r, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.5]]))
    dirty = r + torch.tensor([[0.0, 0.0, 9.0], [0.0, 0.0, 0.0]])
    returns = rf.discounted_returns(dirty, mask, gamma=0.9)
    assert torch.allclose(returns, torch.tensor([[0.9, 1.0, 0.0], [0.405, 0.45, 0.5]]))


def test_kl_coef_needs_both_logprobs(rf):
    with pytest.raises(ValueError, match="old_logprobs and ref_logprobs"):
        rf.token_rewards(torch.ones(1), torch.ones(1, 2), kl_coef=0.1)


# ---------------------------------------------------------------- the loss
def _on_policy(values):
    lp = torch.tensor(values, requires_grad=True)
    return lp, lp.detach().clone()


def test_sample_average_is_per_sequence_token_mean(rf):
    # per-token losses [a] and [b, b, b] (on-policy the per-token loss is -A): sample average (a + b)/2
    a, b = 0.7, -0.4
    lp, old = _on_policy([[-1.0, 0, 0, 0], [-1.0, -1.0, -1.0, 0]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    loss, _ = rf.policy_loss(lp, old, torch.tensor([-a, -b]), mask)
    assert loss.item() == pytest.approx((a + b) / 2)
    # token average (rpp, rpp-kl): (a + 3b)/4
    loss, _ = rf.policy_loss(lp, old, torch.tensor([-a, -b]), mask, clip_eps=0.2, aggregation="token")
    assert loss.item() == pytest.approx((a + 3 * b) / 4)


def test_on_policy_gradient_is_reinforce(rf):
    lp, old = _on_policy([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, metrics = rf.policy_loss(lp, old, adv, mask)
    loss.backward()
    expected = torch.tensor([[-2.0 / 2, -2.0 / 2, 0.0], [1.0 / 3, 1.0 / 3, 1.0 / 3]]) / 2  # -A / |o_i| / B
    assert torch.allclose(lp.grad, expected)
    assert metrics == {"clip_frac": 0.0, "ratio": 1.0}


@pytest.mark.parametrize("adv, ratio", [(1.0, 1.3), (-1.0, 0.7), (1.0, 0.7), (-1.0, 1.3)])
def test_ema_and_batch_do_not_clip(rf, adv, ratio):
    # no clip: d/dlogp of -A·r is -A·r everywhere, even where PPO would have cut the gradient
    old = torch.tensor([[-1.0]])
    lp = (old + math.log(ratio)).requires_grad_()
    loss, metrics = rf.policy_loss(lp, old, torch.tensor([adv]), torch.ones(1, 1))
    loss.backward()
    assert lp.grad.item() == pytest.approx(-adv * ratio, rel=1e-5)
    assert metrics["clip_frac"] == 0.0


@pytest.mark.parametrize(
    "adv, ratio, has_grad",
    [(1.0, 1.3, False), (1.0, 1.1, True), (1.0, 0.7, True), (-1.0, 0.7, False), (-1.0, 0.9, True), (-1.0, 1.3, True)],
)
def test_rpp_clips_where_ppo_says(rf, adv, ratio, has_grad):
    old = torch.tensor([[-1.0]])
    lp = (old + math.log(ratio)).requires_grad_()
    loss, metrics = rf.policy_loss(lp, old, torch.tensor([[adv]]), torch.ones(1, 1), clip_eps=0.2, aggregation="token")
    loss.backward()
    assert (lp.grad.abs().item() > 0) == has_grad
    assert metrics["clip_frac"] == (0.0 if has_grad else 1.0)


@pytest.mark.parametrize("aggregation", ["sample", "token"])
def test_padding_changes_nothing(rf, aggregation):
    torch.manual_seed(0)
    lp0 = torch.randn(3, 5)
    old, adv = lp0 + 0.1 * torch.randn(3, 5), torch.randn(3, 5)
    clip = 0.2 if aggregation == "token" else None
    loss = lambda lp, o, a, m, shift: rf.policy_loss(lp, o, a, m, clip_eps=clip, aggregation=aggregation)
    assert_padding_changes_nothing(
        loss, lp0, old, adv, torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    )


@pytest.mark.parametrize("aggregation", ["sample", "token"])
def test_micro_batches_accumulate(rf, aggregation):
    lp0, old, adv, mask = random_batch(seed=3, shape=(4, 6))
    adv = adv.unsqueeze(-1) * torch.linspace(0.5, 1.5, 6)  # token-level advantages, as rpp and rpp-kl give
    clip = 0.2 if aggregation == "token" else None
    norm = {"num_sequences": 4, "num_tokens": float(mask.sum())}

    def whole(lp):
        return rf.policy_loss(lp, old, adv, mask, clip_eps=clip, aggregation=aggregation)[0]

    def part(lp, rows):
        return rf.policy_loss(lp[rows], old[rows], adv[rows], mask[rows], clip, aggregation, **norm)[0]

    assert_micro_batches_accumulate(whole, part, lp0, [[0, 1], [2, 3]])


def test_correction_weights_multiply_every_term(rf):
    # on-policy, weights w: each token's gradient is -A·w/|o_i|/B
    lp, old = _on_policy([[-1.0, -2.0]])
    w = torch.tensor([[0.5, 2.0]])
    loss, _ = rf.policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2), is_weights=w)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-0.25, -1.0]]))


# ---------------------------------------------------------------- flags and the memory planner
def test_kl_defaults_per_baseline_and_the_reference_the_planner_counts(rf):
    from common.memory import trained_models

    assert rf.Args().kl_coef == 0.0 and rf.Args(baseline="rpp").kl_coef == 0.0
    assert rf.Args(baseline="rpp-kl").kl_coef == 0.001  # verl's algorithm.kl_ctrl.kl_coef
    assert rf.Args(baseline="rpp-kl", kl_coef=0.0).kl_coef == 0.0  # an explicit 0 stays
    assert trained_models(rf.Args()) == (1, False)  # the default loads no reference model
    assert trained_models(rf.Args(baseline="rpp-kl")) == (1, True)


# ---------------------------------------------------------------- end to end
def test_ema_baseline_resumes_exactly(tmp_path):
    """The default (--baseline ema) for 3 steps straight, and for 2 then --resume to 3: step 3 subtracts the same
    b = 0.9·r_1 + 0.1·r_2 (r_s the logged mean reward; b_1 = r_1 and the EMA starts at r_1), so its loss matches."""
    run("reinforce", tmp_path, "--run-name", "full", "--total-steps", "3", "--eval-every", "10")
    run("reinforce", tmp_path, "--run-name", "split", "--total-steps", "2", "--eval-every", "10")
    resumed = run("reinforce", tmp_path, "--run-name", "split", "--total-steps", "3", "--eval-every", "10", "--resume")
    assert "resumed from" in resumed.stdout + resumed.stderr
    full = [r for r in read_metrics(tmp_path / "full") if "train/reward" in r]
    split = [r for r in read_metrics(tmp_path / "split") if "train/reward" in r]
    assert [r["step"] for r in split] == [1, 2, 3]
    r1, r2 = full[0]["train/reward"], full[1]["train/reward"]
    assert [r["train/baseline"] for r in full] == pytest.approx([r1, r1, 0.9 * r1 + 0.1 * r2])
    assert split[2]["train/baseline"] == pytest.approx(full[2]["train/baseline"], abs=1e-9)
    assert split[2]["train/reward"] == full[2]["train/reward"]
    assert split[2]["train/loss"] == pytest.approx(full[2]["train/loss"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("baseline", ["rpp-kl", "rpp", "batch"])
def test_other_baselines_train_checkpoint_and_resume(tmp_path, baseline):
    """rpp-kl loads the reference and logs its k1 (and a sampler lagging one version); every baseline resumes."""
    flags = ["--baseline", baseline, "--run-name", "r", "--max-lag", "2"]
    run("reinforce", tmp_path, *flags, "--total-steps", "2")
    run("reinforce", tmp_path, *flags, "--total-steps", "3", "--resume")
    train = [r for r in read_metrics(tmp_path / "r") if "train/reward" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(("train/kl" in r) == (baseline == "rpp-kl") for r in train)
    assert all(("train/baseline" in r) == (baseline == "batch") for r in train)
    if baseline == "rpp-kl":  # π_old starts as π_ref: the KL is 0 at step 1 and leaves it once the policy moves
        assert train[0]["train/kl"] == pytest.approx(0.0, abs=1e-5) and abs(train[2]["train/kl_seq"]) > 0


def test_rpp_kl_packed_step_equals_the_padded_step(tmp_path, monkeypatch):
    """--baseline rpp-kl (reference and old log-probs, whitened token returns, a token-mean normaliser, the clip over
    2 mini-batches): one step packed (--micro-batch-tokens) and padded gives the same loss and gradients."""
    from test_packing import LOSS_ATOL, PACKED, run_once

    padded = run_once("reinforce", tmp_path / "padded", monkeypatch, ["--baseline", "rpp-kl"])
    packed = run_once("reinforce", tmp_path / "packed", monkeypatch, ["--baseline", "rpp-kl", *PACKED])
    assert padded["metrics"]["train/reward"] == packed["metrics"]["train/reward"]
    assert "train/kl" in padded["metrics"]
    loss_a, loss_b = padded["metrics"]["train/loss"], packed["metrics"]["train/loss"]
    assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=LOSS_ATOL)
    assert len(padded["grads"]) == len(packed["grads"]) == 2 and all(g.norm() > 0 for g in padded["grads"])
    gaps = [((b - a).norm() / a.norm()).item() for a, b in zip(padded["grads"], packed["grads"])]
    assert max(gaps) <= 1e-5, gaps


@pytest.mark.slow
@pytest.mark.parametrize("baseline", ["ema", "rpp-kl"])
def test_two_processes_match_one(tmp_path, baseline):
    """The batch mean, the EMA, the whitening statistics and the token-mean normaliser span both processes: 2 steps on
    two processes update the weights as one process does (relative L2 gap of the updates below 1e-3)."""
    from conftest import REPO, launch_script
    from safetensors.torch import load_file
    from test_distributed import FLAGS

    flags = [*FLAGS, "--baseline", baseline, "--kl-coef", "0.001" if baseline == "rpp-kl" else "0"]
    for name, nproc in (("one", 1), ("two", 2)):
        launch_script("reinforce", ["--output-dir", str(tmp_path), "--run-name", name, *flags], nproc)
    base = load_file(REPO / "common" / "tiny_model" / "model.safetensors")
    d1, d2 = (
        torch.cat([(w[k] - base[k]).flatten() for k in base])
        for w in (load_file(tmp_path / n / "final" / "model.safetensors") for n in ("one", "two"))
    )
    assert d1.abs().max() > 1e-5
    assert ((d1 - d2).norm() / d1.norm()).item() < 1e-3
    train = [[r for r in read_metrics(tmp_path / n) if "train/reward" in r] for n in ("one", "two")]
    if baseline == "ema":  # the EMA is of the whole batch's mean on both: the same b at step 2
        assert train[0][1]["train/baseline"] == pytest.approx(train[1][1]["train/baseline"])
