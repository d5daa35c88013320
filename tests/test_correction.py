"""Rollout correction (common/correction.py) on hand-derived numbers: every mode's weights and metrics, padding,
the sampler == trainer identity, detached weights, and resolve_correction's choices and refusals.

The batch: trainer (π_old) and sampler (μ) probabilities of the sampled tokens, ratio ρ = π_old / μ, 5 real tokens:

    row 0: π_old = (0.5, 0.2, 0.3), μ = (0.2, 0.5, 0.3)    ρ = (2.5, 0.4, 1.0)    Π ρ = 1    geometric mean 1
    row 1: π_old = (0.8, 0.5, pad), μ = (0.5, 0.2, pad)    ρ = (1.6, 2.5, -)      Π ρ = 4    geometric mean 2

The padded slot holds a ratio of 18 (0.9 / 0.05): any leak of padding into a weight or a metric shows.
log ρ = (ln 2.5, -ln 2.5, 0, ln 1.6, ln 2.5); Σ log ρ = ln(2.5 · 0.4 · 1 · 1.6 · 2.5) = ln 4.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.correction import (
    DEFAULT_CAPS,
    MODES,
    CorrectionConfig,
    correction_weights,
    resolve_correction,
)
from common.engine_base import RolloutConfig

TRAINER_P = [[0.5, 0.2, 0.3], [0.8, 0.5, 0.9]]
SAMPLER_P = [[0.2, 0.5, 0.3], [0.5, 0.2, 0.05]]
MASK = [[1, 1, 1], [1, 1, 0]]
REL = 1e-5  # float32 log-probs

# the four mismatch metrics, over the 5 real tokens, whatever the mode
K1 = -math.log(4) / 5  # mean(log μ - log π_old) = -(Σ log ρ) / 5 = -0.2772589
K3 = ((1.5 - 0.6 + 0.0 + 0.6 + 1.5) - math.log(4)) / 5  # mean(ρ - 1 - log ρ) = (3 - ln 4) / 5 = 0.3227411
ABS_MEAN = (3 * math.log(2.5) + math.log(1.6)) / 5  # = ln(2.5³ · 1.6) / 5 = 2 ln 5 / 5 = 0.6437752
ABS_MAX = math.log(2.5)  # 0.9162907

# mode -> (weights (B,T), is_ess, is_clipped_frac), at the mode's default caps
EXPECTED = {
    # min(ρ, 2): (2, 0.4, 1 | 1.6, 2); 2 of 5 tokens above 2; Σw = 7, Σw² = 4 + 0.16 + 1 + 2.56 + 4 = 11.72
    "token_truncate": ([[2.0, 0.4, 1.0], [1.6, 2.0, 0.0]], 7.0**2 / (5 * 11.72), 2 / 5),
    # ρ kept inside IcePop's [0.5, 5], else 0: only 0.4 is out; Σw = 2.5 + 1 + 1.6 + 2.5 = 7.6,
    # Σw² = 6.25 + 1 + 2.56 + 6.25 = 16.06
    "token_mask": ([[2.5, 0.0, 1.0], [1.6, 2.5, 0.0]], 7.6**2 / (5 * 16.06), 1 / 5),
    # one weight per sequence: min(Π ρ, 3) = (1, 3) on each sequence's tokens; ESS over 2 sequences: 4² / (2 · 10)
    "sequence_truncate": ([[1.0, 1.0, 1.0], [3.0, 3.0, 0.0]], 4.0**2 / (2 * 10.0), 1 / 2),
    # Π ρ kept inside [0, 3], else 0: (1, 0); ESS 1² / (2 · 1)
    "sequence_mask": ([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], 1.0 / 2, 1 / 2),
    # min(geometric mean, 1.01) = (1, 1.01); ESS 2.01² / (2 · (1 + 1.0201))
    "geometric_truncate": ([[1.0, 1.0, 1.0], [1.01, 1.01, 0.0]], 2.01**2 / (2 * 2.0201), 1 / 2),
    # 1 when the geometric mean is inside [0.99, 1.01], else 0 (a rejection, not a reweighting): (1, 0)
    "geometric_mask": ([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], 1.0 / 2, 1 / 2),
}


def batch(trainer_p=TRAINER_P, sampler_p=SAMPLER_P, mask=MASK):
    return torch.tensor(trainer_p).log(), torch.tensor(sampler_p).log(), torch.tensor(mask)


def resolved(mode: str, **caps) -> CorrectionConfig:
    """An explicit mode at its default caps (or ``caps``); the rollout does not matter for an explicit mode."""
    return resolve_correction(CorrectionConfig(mode=mode, **caps), RolloutConfig(backend="hf"))


def test_expected_table_covers_every_mode():
    assert set(EXPECTED) | {"none"} == set(MODES)
    assert set(DEFAULT_CAPS) == set(EXPECTED)


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_weights_and_metrics_match_hand_derived_values(mode):
    weights, metrics = correction_weights(*batch(), resolved(mode))
    expected_weights, ess, clipped = EXPECTED[mode]
    torch.testing.assert_close(weights, torch.tensor(expected_weights), rtol=REL, atol=REL)
    assert metrics["is_ess"] == pytest.approx(ess, rel=REL)
    assert metrics["is_clipped_frac"] == pytest.approx(clipped, rel=REL)
    assert metrics["mismatch_kl_k1"] == pytest.approx(K1, rel=REL)
    assert metrics["mismatch_kl_k3"] == pytest.approx(K3, rel=REL)
    assert metrics["log_ratio_abs_mean"] == pytest.approx(ABS_MEAN, rel=REL)
    assert metrics["log_ratio_abs_max"] == pytest.approx(ABS_MAX, rel=REL)


def test_none_returns_no_weights_and_the_mismatch_metrics_only():
    weights, metrics = correction_weights(*batch(), resolved("none"))
    assert weights is None
    assert set(metrics) == {"mismatch_kl_k1", "mismatch_kl_k3", "log_ratio_abs_mean", "log_ratio_abs_max"}
    assert metrics["mismatch_kl_k1"] == pytest.approx(K1, rel=REL)
    assert metrics["mismatch_kl_k3"] == pytest.approx(K3, rel=REL)


def test_an_explicit_cap_and_window_replace_the_defaults():
    # token_truncate at C = 3: nothing clipped, w = ρ on the real tokens
    weights, metrics = correction_weights(*batch(), resolved("token_truncate", cap=3.0))
    torch.testing.assert_close(weights, torch.tensor([[2.5, 0.4, 1.0], [1.6, 2.5, 0.0]]), rtol=REL, atol=REL)
    assert metrics["is_clipped_frac"] == 0.0
    # sequence_mask with the window [0.5, 5]: both products (1 and 4) inside, each keeps its own ratio
    weights, metrics = correction_weights(*batch(), resolved("sequence_mask", cap=5.0, cap_low=0.5))
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0, 1.0], [4.0, 4.0, 0.0]]), rtol=REL, atol=REL)
    assert metrics["is_ess"] == pytest.approx(5.0**2 / (2 * 17.0), rel=REL)  # (1 + 4)² / (2 · (1 + 16))
    # token_mask with the window [0.3, 3]: every real token inside, w = ρ
    weights, _ = correction_weights(*batch(), resolved("token_mask", cap=3.0, cap_low=0.3))
    torch.testing.assert_close(weights, torch.tensor([[2.5, 0.4, 1.0], [1.6, 2.5, 0.0]]), rtol=REL, atol=REL)


@pytest.mark.parametrize("mode", MODES)
def test_padding_changes_nothing(mode):
    """A padded column and a fully padded row, both holding wild log-probs, leave weights and metrics as they were."""
    cfg = resolved(mode)
    weights, metrics = correction_weights(*batch(), cfg)
    trainer_p = [row + [0.99] for row in TRAINER_P] + [[0.9, 0.9, 0.9, 0.9]]
    sampler_p = [row + [0.001] for row in SAMPLER_P] + [[0.01, 0.01, 0.01, 0.01]]
    mask = [row + [0] for row in MASK] + [[0, 0, 0, 0]]
    padded_weights, padded_metrics = correction_weights(*batch(trainer_p, sampler_p, mask), cfg)
    assert padded_metrics.keys() == metrics.keys()
    for key, value in metrics.items():
        assert float(padded_metrics[key]) == pytest.approx(float(value), rel=1e-6, abs=1e-7), key
    if weights is None:
        assert padded_weights is None
        return
    assert padded_weights.shape == (3, 4)
    torch.testing.assert_close(padded_weights[:2, :3], weights, rtol=1e-6, atol=1e-7)
    assert torch.equal(padded_weights[2], torch.zeros(4)) and torch.equal(padded_weights[:, 3], torch.zeros(3))


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_sampler_equal_to_trainer_is_the_identity(mode):
    """μ = π_old: every weight is exactly 1 on a real token and 0 on padding, and a loss and its gradient are
    bit-for-bit those without the weights."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11)
    tokens = torch.randint(0, 11, (3, 6))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]])
    advantages = torch.tensor([0.7, -1.2, 0.3]).unsqueeze(-1)

    def loss_and_grad(weights):
        leaf = logits.clone().requires_grad_(True)
        logp = leaf.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        w = torch.ones_like(logp) if weights is None else weights
        loss = -(w * advantages * logp * mask).sum()
        loss.backward()
        return loss.detach(), leaf.grad

    old = logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    weights, metrics = correction_weights(old, old.clone(), mask, resolved(mode))
    assert torch.equal(weights, mask.float())
    assert metrics["is_ess"] == 1.0 and metrics["is_clipped_frac"] == 0.0
    assert metrics["mismatch_kl_k1"] == 0.0 and metrics["mismatch_kl_k3"] == 0.0
    assert metrics["log_ratio_abs_mean"] == 0.0 and metrics["log_ratio_abs_max"] == 0.0
    loss, grad = loss_and_grad(weights)
    plain_loss, plain_grad = loss_and_grad(None)
    assert torch.equal(loss, plain_loss)
    assert torch.equal(grad, plain_grad)


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_weights_are_detached(mode):
    trainer, sampler, mask = batch()
    trainer = trainer.clone().requires_grad_(True)
    sampler = sampler.clone().requires_grad_(True)
    weights, _ = correction_weights(trainer, sampler, mask, resolved(mode))
    assert not weights.requires_grad and weights.grad_fn is None


def test_auto_must_be_resolved_first():
    with pytest.raises(ValueError, match="resolve"):
        correction_weights(*batch(), CorrectionConfig())


# ---------------------------------------------------------------------------------------------------------------
# resolve_correction
@pytest.mark.parametrize(
    "rollout, expected",
    [
        (RolloutConfig(backend="vllm"), "token_truncate"),  # another program samples
        (RolloutConfig(backend="vllm-server"), "token_truncate"),  # another program, in another process
        (RolloutConfig(backend="hf", logit_noise=0.5), "token_truncate"),  # a perturbed sampler
        (RolloutConfig(backend="hf"), "none"),  # the trained module samples
    ],
)
def test_auto_resolves_by_the_sampler(rollout, expected):
    cfg = resolve_correction(CorrectionConfig(), rollout)
    assert cfg.mode == expected
    assert (cfg.cap, cfg.cap_low) == ((2.0, 0.0) if expected == "token_truncate" else (0.0, 0.0))


@pytest.mark.parametrize("available, expected", [(True, "token_truncate"), (False, "none")])
def test_auto_backend_follows_vllm_availability(monkeypatch, available, expected):
    import common.rollout

    monkeypatch.setattr(common.rollout, "vllm_available", lambda: available)
    assert resolve_correction(CorrectionConfig(), RolloutConfig(backend="auto")).mode == expected


def test_auto_is_none_for_a_script_with_its_own_correction():
    cfg = resolve_correction(CorrectionConfig(), RolloutConfig(backend="vllm"), own_correction="its ratio is vs μ")
    assert (cfg.mode, cfg.cap, cfg.cap_low) == ("none", 0.0, 0.0)
    assert resolve_correction(CorrectionConfig(mode="none"), RolloutConfig(backend="vllm"), "own").mode == "none"


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_explicit_modes_take_their_default_caps(mode):
    cfg = resolved(mode)
    assert (cfg.mode, cfg.cap, cfg.cap_low) == (mode, *DEFAULT_CAPS[mode])


@pytest.mark.parametrize(
    "config, own, flag",
    [
        (CorrectionConfig(mode="token_truncate", cap=0.8), "", "--correction.cap"),  # a cap below 1
        (CorrectionConfig(mode="sequence_mask", cap=0.5), "", "--correction.cap"),
        (CorrectionConfig(mode="token_mask", cap=2.0, cap_low=1.2), "", "--correction.cap-low"),  # window above 1
        (CorrectionConfig(mode="geometric_mask", cap_low=1.0), "", "--correction.cap-low"),  # C_low = 1: not below 1
        (CorrectionConfig(mode="token_truncate", cap_low=0.5), "", "--correction.cap-low"),  # C_low on a truncation
        (CorrectionConfig(mode="geometric_truncate", cap_low=0.9), "", "--correction.cap-low"),
        (CorrectionConfig(mode="token_truncate"), "its ratio is vs μ", "--correction.mode"),  # script corrects itself
        (CorrectionConfig(mode="geometric_mask"), "its ratio is vs μ", "--correction.mode"),
    ],
)
def test_bad_settings_stop_naming_the_flag(config, own, flag):
    with pytest.raises(SystemExit) as stop:
        resolve_correction(config, RolloutConfig(backend="vllm"), own_correction=own)
    assert str(stop.value).startswith(flag + " "), str(stop.value)


# ---------------------------------------------------------------------------------------------------------------
# what the mismatch metrics measure under lag
def test_cispo_under_lag_measures_the_lag_in_its_mismatch_metrics(tmp_path, monkeypatch):
    """cispo --max-lag 2 takes its IS weight against μ, yet its mismatch metrics compare μ with the recomputed π_old,
    as every script's do: step 2's batch was sampled by version 0 and is trained by version 1, so its metrics measure
    that lag (docs/correction.md, "Objective under lag"), while step 1's (lag 0, fp32) hold the numerics alone."""
    import json
    import sys

    from conftest import load_algo
    from test_scripts import SMALL

    cispo = load_algo("cispo")
    calls, real_weights = [], cispo.correction_weights

    def weights(trainer, sampler, mask, cfg):
        calls.append({"trainer": trainer.clone(), "sampler": sampler.clone(), "mask": mask.bool().clone()})
        return real_weights(trainer, sampler, mask, cfg)

    monkeypatch.setattr(cispo, "correction_weights", weights)
    flags = ["--total-steps", "2", "--max-lag", "2", "--eval-every", "100", "--mixed-precision", "no"]
    monkeypatch.setattr(sys, "argv", ["cispo.py", "--output-dir", str(tmp_path), "--run-name", "lag", *SMALL, *flags])
    cispo.main()

    rows = [json.loads(line) for line in (tmp_path / "lag" / "metrics.jsonl").read_text().splitlines() if line]
    logged = {row["step"]: row for row in rows if "train/mismatch_kl_k3" in row}
    # measured: lag 0, fp32 numerics only: |log ρ| 3.6e-8 on average, 9.8e-7 at most; lag 1: 1.4e-3 on average,
    # mismatch_kl_k1 8.4e-4 (the old docs said these keys read 0 under lag)
    assert logged[1]["train/log_ratio_abs_max"] < 1e-5
    assert logged[2]["train/log_ratio_abs_mean"] > 1e-4 and logged[2]["train/mismatch_kl_k3"] > 0
    last = calls[-1]  # step 2's last micro-batch: the trainer's side is the recomputed π_old, not μ
    assert (last["trainer"] - last["sampler"])[last["mask"]].abs().max() > 1e-3
