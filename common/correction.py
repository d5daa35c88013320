"""Rollout correction: importance weights for the gap between the sampler and the trainer.

The rollout engine (vLLM in bf16, its own kernels; or a deliberately perturbed sampler) draws tokens from μ, while the
trainer's loss assumes they came from π_old, the trainer's own policy before the update. The per-token ratio
ρ_t = π_old(y_t) / μ(y_t) measures the gap; the weight w built from it multiplies the policy-gradient term of each
script's loss (never the KL term, the entropy, or a critic's value loss), so the gradient is that of samples from
π_old (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"; IcePop, Ring-1T).

    args.correction = resolve_correction(args.correction, args.rollout)       # once, at start-up ('auto' resolved)
    is_weights, stats = correction_weights(old_logprobs, rollout_logprobs, mask, args.correction)   # per micro-batch
    loss, _ = policy_loss(..., is_weights=is_weights)                          # the script multiplies its pg term

Modes (``--correction.mode``), with the names the other frameworks use (TRL >= 1.6, verl 0.6.1-0.7, OpenRLHF):

| mode | weight w | TRL ``vllm_importance_sampling_mode`` | verl ``algorithm.rollout_correction`` | OpenRLHF |
|---|---|---|---|---|
| ``token_truncate`` | min(ρ_t, C) | ``token_truncate`` | ``rollout_is: token`` (Token-TIS) | ``tis`` (two-sided) |
| ``token_mask`` | ρ_t in [C_low, C], else 0 | ``token_mask`` | ``rollout_is``+``rollout_rs``: ``token`` | ``icepop`` |
| ``sequence_truncate`` | min(Π ρ_t, C) | ``sequence_truncate`` | ``rollout_is: sequence`` (Seq-TIS) | |
| ``sequence_mask`` | Π ρ_t in [C_low, C], else 0 | ``sequence_mask`` | ``rollout_is``+``rollout_rs``: ``sequence`` | |
| ``geometric_truncate`` | min(exp(mean_t log ρ_t), C) | | | |
| ``geometric_mask`` | 1 in [C_low, C], else 0 (a rejection) | | ``rollout_rs: geometric`` (Geo-RS) | |

A sequence mode puts its one weight on every token of the sequence. A mask mode keeps ρ inside the window, as TRL's
MIS and IcePop do; verl's ``rollout_rs`` alone, and SkyRL's masks, keep 1 (verl's Seq-MIS preset pairs it with
``rollout_is`` at the same level). OpenRLHF's ``tis`` also clamps from below (window [0.5, 5] by default); its
``seq-mask-tis`` masks on the geometric mean but weights each kept token by its own unclamped ρ_t (no mode here).
C is ``--correction.cap`` (TRL ``vllm_importance_sampling_clip_max``, named ``vllm_importance_sampling_cap`` before
1.6; verl ``rollout_is_threshold`` / ``rollout_rs_threshold``), C_low is ``--correction.cap-low`` (TRL
``vllm_importance_sampling_clip_min``; verl ``rollout_rs_threshold_lower``, unset = 1/C; IcePop's α). verl's main
branch after 0.7 renames the rejection levels ``token_k1`` / ``seq_sum_k1`` / ``seq_mean_k1`` and takes the window
as ``rollout_rs_threshold: "C_low_C"``. OpenRLHF's flags: ``--algo.advantage.is_correction_type`` and
``--algo.advantage.is_correction_threshold LOW HIGH`` (0.10.2 on; ``--vllm_is_correction_type`` and
``--vllm_is_truncated_threshold`` in 0.10.0-0.10.1). The geometric mean of the token ratios is length-free: SkyRL
recommends rejecting sequences outside [0.99, 1.01] (``geo_mask_low`` / ``geo_mask_high``); verl's Geo-RS presets use
[1/1.001, 1.001].

All log-prob tensors are detached, shape (B, T), with ``mask`` 1 on generated tokens. The weights are detached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, get_args

import torch

from common.engine_base import RolloutConfig

Mode = Literal[
    "auto",
    "none",
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "geometric_truncate",
    "geometric_mask",
]
MODES = tuple(m for m in get_args(Mode) if m != "auto")  # the concrete modes 'auto' resolves to
# the cap C and lower bound C_low each mode takes when --correction.cap / --correction.cap-low are left at 0
DEFAULT_CAPS = {
    "token_truncate": (2.0, 0.0),  # TIS (Yao et al. 2025) at verl rollout_is_threshold, SkyRL token_tis_ratio_clip_high
    "token_mask": (5.0, 0.5),  # IcePop's window [0.5, 5] (TRL's IcePop test, OpenRLHF's default)
    "sequence_truncate": (3.0, 0.0),  # TRL's vllm_importance_sampling_clip_max (verl's Seq-TIS 2, SkyRL's 5)
    "sequence_mask": (3.0, 0.0),  # TRL's default mode and C_max, no C_min (one-sided)
    "geometric_truncate": (1.01, 0.0),  # no framework's; SkyRL's geometric upper edge
    "geometric_mask": (1.01, 0.99),  # SkyRL's recommended window (verl's Geo-RS presets: 1.001, 1/1.001)
}
AUTO_MODE = "token_truncate"  # what 'auto' selects when the sampler differs from the trainer (see CorrectionConfig)


@dataclass
class CorrectionConfig:
    """Rollout correction (``--correction.*`` flags): importance weights π_old / μ on the policy-gradient term.

    'auto' selects token-level truncated IS with C = 2 (Yao et al. 2025; verl's rollout_is_threshold and its
    decoupled_token_is preset) when the sampler is not the
    trained module (the vLLM engine, or ``--rollout.logit-noise`` > 0), and none with the HF engine, which samples
    from the very module being trained. Token truncation is chosen over TRL's default (sequence mask, cap 3) because
    it never drops a whole sequence: the product of thousands of token ratios in a long reasoning trace leaves the
    window often, under bf16 alone.
    """

    mode: Mode = "auto"
    """weight of each token's policy-gradient term ('auto' = token_truncate when the sampler differs, else none)"""
    cap: float = 0.0
    """C, the upper cap (truncate) or upper edge of the window (mask) of the ratio (0 = the mode's default)"""
    cap_low: float = 0.0
    """C_low, the lower edge of a mask window (0 = the mode's default: 0.5 token, none sequence, 0.99 geometric)"""


def sampler_differs(rollout: RolloutConfig) -> bool:
    """Whether the sampler is a different program from the trained module: vLLM (colocated or a server), or a perturbed
    HF sampler."""
    from common.rollout import vllm_available

    backend = rollout.backend if rollout.backend != "auto" else ("vllm" if vllm_available() else "hf")
    return backend in ("vllm", "vllm-server") or rollout.logit_noise > 0


def resolve_correction(
    cfg: CorrectionConfig, rollout: RolloutConfig, own_correction: str = "", max_lag: int = 1
) -> CorrectionConfig:
    """``cfg`` with 'auto' and its zero caps resolved; bad settings stop with a message naming the flag.

    ``max_lag`` > 1 (asynchronous RL, ``common/async_rollout.py``): the sampler is an older policy version, so 'auto'
    is on with any engine.

    ``own_correction``: non-empty when the script's loss already divides by the sampler's probabilities (its reason,
    e.g. DPPO's trust region anchored to μ): 'auto' resolves to none and any other mode is refused.
    """
    mode = cfg.mode
    if own_correction and mode not in ("auto", "none"):
        raise SystemExit(f"--correction.mode {mode}: not for this script, {own_correction}; use none (or auto)")
    if mode == "auto":
        mode = AUTO_MODE if (sampler_differs(rollout) or max_lag > 1) and not own_correction else "none"
    if mode == "none":
        return replace(cfg, mode="none", cap=0.0, cap_low=0.0)
    default_cap, default_low = DEFAULT_CAPS[mode]
    cap, cap_low = cfg.cap or default_cap, cfg.cap_low or default_low
    if cap < 1.0:
        raise SystemExit(f"--correction.cap {cap}: a cap below 1 would down-weight tokens the sampler got right")
    if mode.endswith("_truncate") and cfg.cap_low:
        raise SystemExit(f"--correction.cap-low applies to the mask modes, not {mode}")
    if mode.endswith("_mask") and not cap_low < 1.0 <= cap:
        raise SystemExit(
            f"--correction.cap-low {cap_low} / --correction.cap {cap}: the mask window [C_low, C] must contain 1 "
            "(a ratio of 1, sampler equal to trainer, must never be masked)"
        )
    return replace(cfg, mode=mode, cap=cap, cap_low=cap_low)


def correction_weights(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, cfg: CorrectionConfig
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """``(weights, metrics)``: the detached (B, T) weights of ``cfg.mode`` (None for 'none') and the mismatch metrics.

    ``trainer_logprobs`` are π_old's log-probs of the sampled tokens (the detached current ones when the batch is used
    once), ``sampler_logprobs`` μ's as the engine returned them. ``cfg`` must be resolved (``resolve_correction``).
    Metrics, over the tokens of ``mask``: ``mismatch_kl_k1`` = mean(log μ - log π_old) and ``mismatch_kl_k3`` =
    mean(ρ - 1 - log ρ), two estimators of KL(μ || π_old); ``log_ratio_abs_mean`` / ``_max``; with a mode,
    ``is_ess`` = (Σw)² / (n Σw²) over the n tokens (or sequences) weighted, in [0, 1], and ``is_clipped_frac``, the
    fraction of tokens (or sequences) truncated or masked.
    """
    if cfg.mode == "auto":
        raise ValueError("correction_weights: resolve 'auto' first (resolve_correction)")
    mask = mask.float()
    tokens = mask.sum().clamp(min=1)
    log_ratio = ((trainer_logprobs - sampler_logprobs) * mask).detach().float()
    # the statistics stay on the device (``_read``): a micro-batch never waits to report them
    sums = {
        "mismatch_kl_k1": (-log_ratio * mask).sum(),
        "mismatch_kl_k3": ((torch.expm1(log_ratio) - log_ratio) * mask).sum(),
        "log_ratio_abs_mean": (log_ratio.abs() * mask).sum(),
    }
    # the largest |log ratio| over the mask's tokens (0 without any: log_ratio is 0 off the mask)
    largest = torch.where(mask.bool(), log_ratio.abs(), 0.0).amax() if mask.numel() else mask.new_zeros(())
    if cfg.mode == "none":
        return None, _read(sums, tokens, largest)
    level, kind = cfg.mode.split("_")
    if level == "token":
        units, unit_mask = log_ratio, mask  # one weight per token
    else:  # one weight per sequence, from the sum (product of ratios) or the mean (geometric mean) of its log-ratios
        units = log_ratio.sum(-1) if level == "sequence" else log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
        unit_mask = (mask.sum(-1) > 0).float()
    ratio = torch.exp(units.clamp(max=math.log(1e6)))  # a product of many ratios can overflow; any cap is far below
    if kind == "truncate":
        weight, clipped = ratio.clamp(max=cfg.cap), ratio > cfg.cap
    else:
        inside = (ratio >= cfg.cap_low) & (ratio <= cfg.cap)
        weight = torch.where(inside, torch.ones_like(ratio) if level == "geometric" else ratio, torch.zeros_like(ratio))
        clipped = ~inside
    weight = weight * unit_mask
    count = unit_mask.sum().clamp(min=1)
    extra = {
        "is_ess": weight.sum() ** 2 / (count * (weight**2).sum()).clamp(min=1e-30),
        "is_clipped_frac": (clipped.float() * unit_mask).sum() / count,
    }
    weights = weight if level == "token" else weight.unsqueeze(-1) * mask
    return weights.detach(), _read(sums, tokens, largest, extra)


def _read(
    sums: dict[str, torch.Tensor], tokens: torch.Tensor, largest: torch.Tensor, extra: dict | None = None
) -> dict[str, torch.Tensor]:
    """The metrics as 0-dim float64 tensors on the device, read to the host once a step with the other statistics
    (``common.bookkeeping.read_to_host``): each sum / the token count (in float64, so exactly the Python division of
    the two ``.item()`` values), the largest |log ratio| as ``log_ratio_abs_max``, and ``extra`` as they are."""
    extra = extra or {}
    values = torch.stack([*sums.values(), tokens, largest, *extra.values()]).double()
    count = values[len(sums)]
    metrics = {name: values[i] / count for i, name in enumerate(sums)}
    metrics["log_ratio_abs_max"] = values[len(sums) + 1]
    return metrics | dict(zip(extra, values[len(sums) + 2 :]))
