"""Property checks every policy loss must pass, and a two-rank stand-in, shared by the per-algorithm tests."""

import pytest
import torch


def as_floats(metrics: dict) -> dict:
    """Metrics read to Python floats: losses keep them as 0-dim tensors, and ``pytest.approx`` compares numbers."""
    return {key: float(value) for key, value in metrics.items()}


def assert_padding_changes_nothing(
    loss_fn, lp0: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, garbage: float = 50.0
):
    """Rewriting every padded position changes neither the loss, its metrics, nor the gradient, and padded
    positions get zero gradient. ``loss_fn(logprobs, old_logprobs, adv, mask, shift) -> (loss, metrics)``; ``shift``
    is what was added to the padded positions (zeros for the clean call), for any further per-token input."""
    lp_a = lp0.clone().requires_grad_()
    loss_a, metrics_a = loss_fn(lp_a, old, adv, mask, torch.zeros_like(lp0))
    loss_a.backward()
    shift = (1 - mask) * garbage
    lp_b = (lp0 + shift).requires_grad_()
    loss_b, metrics_b = loss_fn(lp_b, old - shift, adv, mask, shift)
    loss_b.backward()
    assert loss_a.item() == pytest.approx(loss_b.item(), abs=1e-6)
    assert as_floats(metrics_a) == pytest.approx(as_floats(metrics_b), abs=1e-6)
    assert torch.allclose(lp_a.grad, lp_b.grad)
    assert torch.all(lp_a.grad[mask == 0] == 0)


def assert_micro_batches_accumulate(whole_loss, part_loss, lp0: torch.Tensor, splits) -> torch.Tensor:
    """Micro-batch losses (``part_loss(logprobs, rows)``, each normalised by the mini-batch) accumulate to the
    gradient of the whole mini-batch's loss (``whole_loss(logprobs)``); returns that gradient."""
    whole = lp0.clone().requires_grad_()
    whole_loss(whole).backward()
    parts = lp0.clone().requires_grad_()
    for rows in splits:
        part_loss(parts, rows).backward()
    assert torch.allclose(whole.grad, parts.grad, atol=1e-7)
    return whole.grad


def random_batch(seed: int = 1, shape=(4, 6), old_noise: float = 0.3):
    """(logprobs, old_logprobs, advantages, mask) with every row holding at least one valid token."""
    torch.manual_seed(seed)
    lp0, adv = torch.randn(*shape), torch.randn(shape[0])
    old = lp0 + old_noise * torch.randn(*shape)
    mask = (torch.rand(*shape) > 0.3).long()
    mask[:, 0] = 1
    return lp0, old, adv, mask


def on_two_fake_ranks(fn, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``fn(x_half, mask_half, all_reduce)`` run by two threads standing in for two ranks, each holding half the
    rows and exchanging sums through a barrier-backed ``all_reduce``; returns both halves' outputs, concatenated."""
    import threading

    half = x.shape[0] // 2
    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def rank(r: int):
        def all_reduce(t):
            slots[r] = t.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total

        out[r] = fn(x[half * r : half * (r + 1)], mask[half * r : half * (r + 1)], all_reduce)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return torch.cat(out)
