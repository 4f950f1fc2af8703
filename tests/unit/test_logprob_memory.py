"""Selective log-probs and entropies: exact gradients, and no second (B, R, V) tensor (docs/pitfalls.md: vocabulary memory).

The memory checks count every tensor storage created inside the call (``tests/memory_tracker.py``; on a GPU
``torch.cuda.max_memory_allocated`` counts the same allocations). The bound is the issue's: extra peak memory
under 10% of one float32 (B, T, V) tensor, at the sampling temperature every PPO config uses (0.7).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_lit.functional.losses import entropy_from_logits
from rlhf_lit.functional.sequence import chunk_views, gather_logprobs
from tests.memory_tracker import TensorMemoryTracker

B, P, R, V = 8, 16, 112, 4096
FULL_BTV = B * (P + R) * V * 4  # bytes of one float32 (B, T, V) tensor: 16 MiB


def _naive_logprobs(logits, tokens, t):
    return torch.log_softmax(logits / t, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _naive_entropy(logits, t):
    return torch.distributions.Categorical(logits=logits / t).entropy()


def _inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, R, V, generator=gen) * 3).to(dtype)
    tokens = torch.randint(0, V, (B, R), generator=gen)
    return logits, tokens


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_values_and_gradients_equal_the_plain_log_softmax(temperature, chunk_size):
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(3, 6, 11, dtype=torch.float64, generator=gen) * 2
    full[0, 1, 4] = float("-inf")  # a token of probability 0 (e.g. a masked logit)
    tokens = torch.randint(0, 11, (3, 5), generator=gen)
    tokens[0, 1] = 2
    weights = torch.randn(3, 5, dtype=torch.float64, generator=gen)
    for fn, naive in (
        (
            lambda x: gather_logprobs(x, tokens, temperature, chunk_size),
            lambda x: _naive_logprobs(x, tokens, temperature),
        ),
        (lambda x: entropy_from_logits(x, temperature, chunk_size), lambda x: _naive_entropy(x, temperature)),
    ):
        ours_in = full.clone().requires_grad_()
        # the plain formulas give NaN gradients at a -inf logit (0 * inf); -1e4 has probability 0 too
        ref_in = full.nan_to_num(neginf=-1e4).requires_grad_()
        ours = fn(ours_in[:, :-1])  # a non-contiguous slice, as sft_nll passes
        ref = naive(ref_in[:, :-1])
        assert_close(ours, ref, atol=1e-12, rtol=1e-12)
        (ours * weights).sum().backward()
        (ref * weights).sum().backward()
        assert torch.isfinite(ours_in.grad).all()
        assert_close(ours_in.grad, ref_in.grad, atol=1e-12, rtol=1e-12)


def test_pieces_of_a_few_positions_equal_the_plain_log_softmax():
    # V = 4096: pieces of 16 positions (2^16 logits), so rows are cut inside (41 = 16 + 16 + 9)
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(2, 42, 4096, dtype=torch.float64, generator=gen) * 3
    full[1, 20, :100] = float("-inf")
    tokens = torch.randint(100, 4096, (2, 41), generator=gen)
    assert len(chunk_views(full[:, :-1].shape, None)) == 6
    weights = torch.randn(2, 41, dtype=torch.float64, generator=gen)
    for fn, naive in (
        (lambda x: gather_logprobs(x, tokens, 0.7), lambda x: _naive_logprobs(x, tokens, 0.7)),
        (lambda x: entropy_from_logits(x, 0.7), lambda x: _naive_entropy(x, 0.7)),
    ):
        ours_in = full.clone().requires_grad_()
        ref_in = full.nan_to_num(neginf=-1e4).requires_grad_()
        ours, ref = fn(ours_in[:, :-1]), naive(ref_in[:, :-1])
        assert_close(ours, ref, atol=1e-10, rtol=1e-10)
        (ours * weights).sum().backward()
        (ref * weights).sum().backward()
        assert_close(ours_in.grad, ref_in.grad, atol=1e-10, rtol=1e-10)


def test_gradcheck_both_functions():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3), generator=gen)
    assert torch.autograd.gradcheck(lambda x: gather_logprobs(x, tokens, 0.7), (x,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 0.7), (x,))


def test_default_pieces_tile_the_positions_exactly_once():
    for shape in [(8, 112, 4096), (3, 5, 7), (1, 1, 2), (70, 1, 3), (2, 200, 50_000), (4, 48, 128_256)]:
        b, r, v = shape
        seen = torch.zeros(b, r, dtype=torch.long)
        pieces = chunk_views(torch.Size(shape), None)
        for rows, cols in pieces:
            seen[rows, cols] += 1
        assert torch.equal(seen, torch.ones_like(seen)), shape
        # ceil(B R / 32) positions, at least 2^16 logits, at most 2^22 logits (or one position)
        biggest = max((rows.stop - rows.start) * (cols.stop - cols.start) for rows, cols in pieces)
        assert biggest <= max(math.ceil(b * r / 32), math.ceil(2**16 / v)), shape
        assert biggest * v <= max(2**22, v), shape
    # (8, 112, 4096): ceil(896 / 32) = 28 positions per piece, 32 pieces
    assert len(chunk_views(torch.Size((8, 112, 4096)), None)) == 32
    # (3, 5, 7): at least 2^16 logits per piece -> everything in one piece
    assert chunk_views(torch.Size((3, 5, 7)), None) == [(slice(0, 3), slice(0, 5))]
    # explicit rows per piece, as before
    assert chunk_views(torch.Size((5, 4, 3)), 2) == [
        (slice(0, 2), slice(0, 4)),
        (slice(2, 4), slice(0, 4)),
        (slice(4, 5), slice(0, 4)),
    ]


def _peak(fn, ignore) -> int:
    with TensorMemoryTracker(ignore=ignore) as tracker:
        out = fn()
        del out
    return tracker.peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_grad_extra_peak_is_under_a_tenth_of_one_btv_tensor_at_t07(dtype):
    logits, tokens = _inputs(dtype)
    with torch.no_grad():
        lp_peak = _peak(lambda: gather_logprobs(logits, tokens, temperature=0.7), [logits, tokens])
        ent_peak = _peak(lambda: entropy_from_logits(logits, temperature=0.7), [logits])
        naive_peak = _peak(lambda: _naive_logprobs(logits.float(), tokens, 0.7), [logits, tokens])
    assert lp_peak < 0.1 * FULL_BTV, lp_peak
    assert ent_peak < 0.1 * FULL_BTV, ent_peak
    # the tracker sees the plain path's two extra (B, R, V) float32 tensors (logits / T, log_softmax)
    assert naive_peak >= 2 * B * R * V * 4


def test_training_forward_keeps_no_second_btv_tensor_and_backward_only_the_gradient():
    logits, tokens = _inputs()
    logits.requires_grad_()
    weights = torch.randn(B, R)
    one_brv = B * R * V * 4
    with TensorMemoryTracker(ignore=[logits, tokens, weights]) as tracker:
        logprobs = gather_logprobs(logits, tokens, temperature=0.7)
        forward_peak = tracker.peak
        grad = torch.autograd.grad((logprobs * weights).sum(), logits)[0]
        backward_peak = tracker.peak
    assert forward_peak < 0.1 * FULL_BTV, forward_peak  # nothing (B, R, V)-sized saved for backward
    assert backward_peak < one_brv + 0.1 * FULL_BTV, backward_peak  # the logits' gradient, and pieces
    assert_close(grad, torch.autograd.grad((_naive_logprobs(logits, tokens, 0.7) * weights).sum(), logits)[0])

    del grad
    with TensorMemoryTracker(ignore=[logits, tokens, weights]) as tracker:
        logprobs = gather_logprobs(logits, tokens, temperature=0.7)
        entropy = entropy_from_logits(logits, temperature=0.7)
        forward_peak = tracker.peak
        loss = (logprobs * weights).sum() - 0.01 * entropy.sum()
        grad = torch.autograd.grad(loss, logits)[0]
        backward_peak = tracker.peak
    assert forward_peak < 0.1 * FULL_BTV, forward_peak
    # each function's backward makes one gradient of the logits, and autograd adds the two (a third)
    assert backward_peak < 3 * one_brv + 0.1 * FULL_BTV, backward_peak
    expected = torch.autograd.grad(
        (_naive_logprobs(logits, tokens, 0.7) * weights).sum() - 0.01 * _naive_entropy(logits, 0.7).sum(),
        logits,
    )[0]
    assert_close(grad, expected, atol=1e-5, rtol=1e-4)
