"""Observation tokens in the training batch (common/bookkeeping.py ``pack_rollout``): the model attends to them, the
loss never counts them. A tool loop's completion marks its appended tokens with ``Completion.observation_mask``."""

import pytest
import torch
from conftest import REPO, load_algo
from transformers import AutoModelForCausalLM

from common.bookkeeping import pack_rollout
from common.correction import CorrectionConfig, correction_weights
from common.engine_base import Completion
from common.logprobs import token_logprobs

PAD = 0
# one prompt, two samples: the first sampled 2 tokens, got a 2-token observation, sampled 2 more; the second is plain
PROMPT = [[5, 6, 7]]
TOOL = Completion(
    [11, 12, 31, 32, 13, 14], [-0.1, -0.2, -9.0, -9.0, -0.3, -0.4], "stop", observation_mask=[0, 0, 1, 1, 0, 0]
)
PLAIN = Completion([21, 22, 23], [-0.5, -0.6, -0.7], "stop")


def test_observations_are_attended_but_not_in_the_loss_mask_nor_the_sampler_logprobs():
    input_ids, attention, loss_mask, mu = pack_rollout(PROMPT, [TOOL, PLAIN], 2, PAD, torch.device("cpu"))
    assert input_ids.tolist() == [[5, 6, 7, 11, 12, 31, 32, 13, 14], [5, 6, 7, 21, 22, 23, PAD, PAD, PAD]]
    assert attention.tolist() == [[1] * 9, [1, 1, 1, 1, 1, 1, 0, 0, 0]]
    assert loss_mask.tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert torch.allclose(mu, torch.tensor([[-0.1, -0.2, 0, 0, -0.3, -0.4], [-0.5, -0.6, -0.7, 0, 0, 0]]))


def test_a_completion_without_observations_packs_as_before():
    """observation_mask None (every single-turn engine) and an all-zero mask give the same tensors, bit for bit."""
    zero = Completion(PLAIN.token_ids, PLAIN.logprobs, "stop", observation_mask=[0, 0, 0])
    for a, b in zip(pack_rollout(PROMPT, [PLAIN], 1, PAD, "cpu"), pack_rollout(PROMPT, [zero], 1, PAD, "cpu")):
        assert torch.equal(a, b)


def test_a_void_filtered_sample_is_attended_but_has_no_loss_token():
    """SimpleTIR's filter (Completion.excluded): the row keeps its ids and attention, loses every loss token; the other
    row is untouched; rollout_stats still counts its sampled length (4 of TOOL's 6 tokens were sampled)."""
    from common.bookkeeping import rollout_stats

    dropped = Completion(TOOL.token_ids, TOOL.logprobs, "stop", observation_mask=TOOL.observation_mask, excluded=True)
    input_ids, attention, loss_mask, mu = pack_rollout(PROMPT, [dropped, PLAIN], 2, PAD, "cpu")
    assert attention.tolist() == [[1] * 9, [1, 1, 1, 1, 1, 1, 0, 0, 0]]
    assert loss_mask.tolist() == [[0] * 6, [1, 1, 1, 0, 0, 0]] and mu[0].abs().sum() == 0
    stats = rollout_stats(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), loss_mask, [dropped, PLAIN], 2)
    assert stats["train/response_len"] == 3.5 and stats["train/response_len_correct"] == 4.0


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(REPO / "common" / "tiny_model", torch_dtype=torch.float32).eval()


def _logprobs(model, completions):
    input_ids, attention, loss_mask, mu = pack_rollout(PROMPT, completions, len(completions), PAD, "cpu")
    width = loss_mask.shape[1]
    logprobs, _ = token_logprobs(model, input_ids, attention, width, 1.0, fp32_head=True)
    return logprobs, loss_mask, mu


def test_the_logits_at_observation_positions_change_neither_the_loss_nor_the_gradient(tiny):
    grpo = load_algo("grpo")
    advantages = torch.tensor([1.0, -1.0])
    logprobs, loss_mask, mu = _logprobs(tiny, [TOOL, PLAIN])
    observation = (loss_mask == 0) & (torch.arange(loss_mask.shape[1]) < 6) & (torch.arange(2) == 0).unsqueeze(-1)
    assert observation.sum() == 2
    losses, grads = [], []
    for shift in (0.0, 3.0):  # any change of the log-probs (so of the logits) at the observation positions
        tiny.zero_grad()
        logprobs, _, _ = _logprobs(tiny, [TOOL, PLAIN])
        shifted = logprobs + shift * observation
        loss, _ = grpo.policy_loss(shifted, mu, advantages, loss_mask, kl_coef=0.0, num_sequences=2)
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in tiny.parameters() if p.grad is not None]))
    assert losses[0] == losses[1] and torch.equal(grads[0], grads[1])
    assert grads[0].abs().sum() > 0  # the loss does depend on the model


def test_the_model_sees_the_observation(tiny):
    """Removing the observation changes the log-probs of the sampled tokens after it (not those before it)."""
    with torch.no_grad():
        with_obs, _, _ = _logprobs(tiny, [TOOL])
        without = Completion([11, 12, 13, 14], [-0.1, -0.2, -0.3, -0.4], "stop")
        without_obs, _, _ = _logprobs(tiny, [without])
    assert torch.allclose(with_obs[0, :2], without_obs[0, :2], atol=1e-5)  # the same up to the matmul shapes
    assert not torch.allclose(with_obs[0, 4:6], without_obs[0, 2:4], atol=1e-4)


def test_observations_carry_no_correction_weight_and_stay_out_of_the_mismatch_metrics(tiny):
    with torch.no_grad():
        logprobs, loss_mask, mu = _logprobs(tiny, [TOOL, PLAIN])
    cfg = CorrectionConfig(mode="token_truncate", cap=2.0)
    weights, metrics = correction_weights(logprobs, mu, loss_mask, cfg)
    assert weights[0, 2:4].tolist() == [0.0, 0.0] and (weights[loss_mask == 1] > 0).all()
    # the metrics are those of the sampled tokens alone
    sampled = loss_mask == 1
    gap = (logprobs - mu)[sampled]
    assert metrics["log_ratio_abs_mean"] == pytest.approx(gap.abs().mean().item(), rel=1e-6)
    assert metrics["mismatch_kl_k1"] == pytest.approx((-gap).mean().item(), rel=1e-6)
