"""GSPO math against hand-derived values: the sequence ratio, its gradient, the clip, GSPO-token."""

import math

import pytest
import torch
from conftest import load_algo
from loss_checks import as_floats, assert_micro_batches_accumulate, assert_padding_changes_nothing, random_batch


@pytest.fixture(scope="module")
def gspo():
    return load_algo("gspo")


def test_defaults(gspo):
    args = gspo.Args()
    assert args.kl_coef == 0.0 and not args.gspo_token
    assert args.num_minibatches == 4  # §5.1: otherwise every s_i is exactly 1
    # the tiny default is wider than the paper's 3e-4 / 4e-4, which stay the function's defaults (GPU runs)
    assert args.clip_eps_low > 3e-4 and args.clip_eps_high > 4e-4
    assert "--clip-eps-low 3e-4 --clip-eps-high 4e-4" in gspo.__doc__


def test_sequence_ratio_is_the_geometric_mean_of_token_ratios(gspo):
    # token log-ratios 0.3, -0.1 (third token is padding): s = exp((0.3 - 0.1) / 2) = exp(0.1)
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    lp = (old + torch.tensor([[0.3, -0.1, 9.0]])).requires_grad_()
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = gspo.policy_loss(lp, old, torch.tensor([2.0]), mask, clip_eps_low=0.5, clip_eps_high=0.5)
    s = math.exp(0.1)
    assert metrics["ratio"] == pytest.approx(s, rel=1e-6)
    assert loss.item() == pytest.approx(-2.0 * s, rel=1e-6)  # -s·Â, one sequence
    loss.backward()
    # ds/dlogπ_t = s/|y|: each valid token gets -Â·s/2, padding nothing
    assert torch.allclose(lp.grad, torch.tensor([[-2.0 * s / 2, -2.0 * s / 2, 0.0]]), atol=1e-6)


def test_gradient_matches_autograd_of_the_written_objective(gspo):
    lp0, old, adv, mask = random_batch(seed=3, shape=(3, 5), old_noise=0.05)
    lp = lp0.clone().requires_grad_()
    gspo.policy_loss(lp, old, adv, mask, clip_eps_low=1.0, clip_eps_high=1.0)[0].backward()
    # reference: s_i = (Π_t π_θ/π_old)^(1/|y_i|) written as a product, loss = -(1/G) Σ_i s_i Â_i (nothing clipped)
    ref = lp0.clone().requires_grad_()
    m = mask.float()
    s = torch.prod(torch.where(m > 0, torch.exp(ref - old), torch.ones_like(ref)), -1) ** (1 / m.sum(-1))
    (-(s * adv).mean()).backward()
    assert torch.allclose(lp.grad, ref.grad, atol=1e-6)
    # and the closed form: -Â_i s_i / (G |y_i|) on every valid token
    closed = -(adv * s.detach() / m.sum(-1) / 3)[:, None] * m
    assert torch.allclose(lp.grad, closed, atol=1e-6)


@pytest.mark.parametrize(
    "adv, log_s, clipped",
    [
        (1.0, math.log(1 + 5e-4), True),  # above 1 + 4e-4 with Â > 0: no gradient
        (1.0, math.log(1 + 3e-4), False),  # inside (1 - 3e-4, 1 + 4e-4)
        (1.0, math.log(1 - 5e-4), False),  # below the range with Â > 0: min picks the unclipped term
        (-1.0, math.log(1 - 3.5e-4), True),  # below 1 - 3e-4 with Â < 0: no gradient
        (-1.0, math.log(1 - 2.5e-4), False),
        (-1.0, math.log(1 + 5e-4), False),
    ],
)
def test_clip_at_the_papers_range(gspo, adv, log_s, clipped):
    old = torch.tensor([[-1.0, -2.0]])
    lp = (old + log_s).requires_grad_()  # both tokens move by log_s, so s = exp(log_s)
    loss, metrics = gspo.policy_loss(lp, old, torch.tensor([adv]), torch.ones(1, 2))  # defaults: 3e-4 / 4e-4
    loss.backward()
    assert metrics["clip_frac"] == (1.0 if clipped else 0.0)
    if clipped:
        assert torch.all(lp.grad == 0)
        bound = 1 + 4e-4 if adv > 0 else 1 - 3e-4
        assert loss.item() == pytest.approx(-adv * bound, rel=1e-7)
    else:
        assert torch.allclose(lp.grad, torch.full((1, 2), -adv * math.exp(log_s) / 2), rtol=1e-6)


def test_one_clip_decision_per_sequence(gspo):
    # one token far off (ratio e^2 = 7.4) but the sequence mean small: GSPO does not clip it, GRPO would
    old = torch.zeros(1, 4) - 1.0
    lp = (old + torch.tensor([[2.0, -0.7, -0.65, -0.65]])).requires_grad_()  # mean log-ratio 0
    loss, metrics = gspo.policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 4))
    loss.backward()
    assert metrics["clip_frac"] == 0.0 and metrics["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(lp.grad, torch.full((1, 4), -0.25), atol=1e-6)


def test_gspo_token_equals_gspo_with_per_response_advantages(gspo):
    lp0, old, adv, mask = random_batch(seed=5, shape=(4, 6), old_noise=0.01)
    for eps in (1e-3, 1.0):  # some sequences clipped, then none
        seq = lp0.clone().requires_grad_()
        loss_seq, m_seq = gspo.policy_loss(seq, old, adv, mask, clip_eps_low=eps, clip_eps_high=eps)
        loss_seq.backward()
        tok = lp0.clone().requires_grad_()
        adv_t = adv[:, None].expand(-1, 6)  # the same advantage on every token
        loss_tok, m_tok = gspo.policy_loss(tok, old, adv_t, mask, clip_eps_low=eps, clip_eps_high=eps, token_level=True)
        loss_tok.backward()
        assert loss_seq.item() == pytest.approx(loss_tok.item(), abs=1e-7)
        assert torch.allclose(seq.grad, tok.grad, atol=1e-7)
        assert as_floats(m_seq) == pytest.approx(as_floats(m_tok))
    assert 0 < gspo.policy_loss(lp0, old, adv, mask, clip_eps_low=1e-3, clip_eps_high=1e-3)[1]["clip_frac"] < 1


def test_gspo_token_lets_the_advantage_vary_per_token(gspo):
    old = torch.tensor([[-1.0, -1.0]])
    lp = old.clone().requires_grad_()  # s = 1
    adv = torch.tensor([[1.0, -3.0]])
    loss, _ = gspo.policy_loss(lp, old, adv, torch.ones(1, 2), token_level=True)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-1.0 / 2, 3.0 / 2]]))  # -Â_{i,t}·s / |y_i|
    with pytest.raises(ValueError, match="token_level"):
        gspo.policy_loss(lp, old, adv, torch.ones(1, 2))


def test_on_policy_gradient_is_reinforce_with_sequence_mean(gspo):
    lp = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, metrics = gspo.policy_loss(lp, lp.detach(), adv, mask)
    loss.backward()
    expected = torch.tensor([[-2.0 / 2, -2.0 / 2, 0.0], [1.0 / 3, 1.0 / 3, 1.0 / 3]]) / 2  # as grpo.py on-policy
    assert torch.allclose(lp.grad, expected)
    assert metrics["ratio"] == 1.0 and metrics["clip_frac"] == 0.0


def test_padding_changes_nothing(gspo):
    torch.manual_seed(0)
    lp0 = torch.randn(3, 5)
    old, adv = lp0 + 0.001 * torch.randn(3, 5), torch.randn(3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert_padding_changes_nothing(lambda lp, o, a, m, shift: gspo.policy_loss(lp, o, a, m), lp0, old, adv, mask)


def test_micro_batches_accumulate_to_the_minibatch_gradient(gspo):
    lp0, old, adv, mask = random_batch(old_noise=0.001)
    assert_micro_batches_accumulate(
        lambda lp: gspo.policy_loss(lp, old, adv, mask)[0],
        lambda lp, rows: gspo.policy_loss(lp[rows], old[rows], adv[rows], mask[rows], num_sequences=4)[0],
        lp0,
        (slice(0, 1), slice(1, 4)),
    )


@pytest.mark.parametrize("token_level", [False, True])
def test_correction_weights_of_one_change_nothing(gspo, token_level):
    lp0, old, adv, mask = random_batch(seed=3, shape=(3, 4), old_noise=0.01)  # s_i near 1: some clip at 3e-4
    ref = lp0 + 0.5 * torch.randn(3, 4)
    out = []
    for weights in (None, torch.ones(3, 4)):
        lp = lp0.clone().requires_grad_()
        loss, metrics = gspo.policy_loss(
            lp, old, adv, mask, token_level=token_level, kl_coef=0.1, ref_logprobs=ref, is_weights=weights
        )
        loss.backward()
        out.append((loss, lp.grad, metrics))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1]) and out[0][2] == out[1][2]


def test_correction_weights_scale_the_sequence_loss_by_their_token_mean(gspo):
    lp = torch.tensor([[math.log(0.5), math.log(0.5)]], requires_grad=True)
    old, adv, mask = lp.detach().clone(), torch.tensor([1.0]), torch.ones(1, 2)  # on-policy: s = 1, ℓ = -1
    weights = torch.tensor([[2.0, 0.5]])
    loss, _ = gspo.policy_loss(lp, old, adv, mask, is_weights=weights)
    loss.backward()
    # every token carries ℓ = -s·Â = -1, times its weight: L = (2·(-1) + 0.5·(-1)) / 2 = -1.25 = ℓ·mean(w);
    # ∇ℓ = -s·Â·(1/|y|)·Σ_t ∇log π_t, times mean(w) = 1.25: each token -0.5·1.25 = -0.625
    assert loss.item() == pytest.approx(-1.25)
    assert torch.allclose(lp.grad, torch.tensor([[-0.625, -0.625]]))
    # GSPO-token: ℓ_t = -s_t·Â, ds_t/dlogp_t = s = 1: L the same -1.25, dL/dlogp_t = -w_t / 2 = [-1, -0.25]
    tok = lp.detach().clone().requires_grad_()
    loss, _ = gspo.policy_loss(tok, old, adv, mask, token_level=True, is_weights=weights)
    loss.backward()
    assert loss.item() == pytest.approx(-1.25)
    assert torch.allclose(tok.grad, torch.tensor([[-1.0, -0.25]]))
    # a sequence mode's weight, constant over y_i, is a plain factor on ℓ_i: here 3
    seq = lp.detach().clone().requires_grad_()
    loss, _ = gspo.policy_loss(seq, old, adv, mask, is_weights=torch.full((1, 2), 3.0))
    loss.backward()
    assert loss.item() == pytest.approx(-3.0) and torch.allclose(seq.grad, torch.tensor([[-1.5, -1.5]]))


def test_correction_weights_leave_the_kl_unweighted(gspo):
    lp = torch.tensor([[math.log(0.5), math.log(0.5)]], requires_grad=True)
    old, adv, mask = lp.detach().clone(), torch.tensor([1.0]), torch.ones(1, 2)
    ref = torch.zeros(1, 2)  # π_ref = 1: δ = log 2, k3 = 2 - log 2 - 1 on each token
    loss, _ = gspo.policy_loss(lp, old, adv, mask, kl_coef=0.1, ref_logprobs=ref, is_weights=torch.tensor([[2.0, 0.5]]))
    # -1.25 as above, + β·(token mean of k3) = 0.1·(1 - log 2) (weighted it would be 0.1·1.25·(1 - log 2))
    assert loss.item() == pytest.approx(-1.25 + 0.1 * (1 - math.log(2)))
