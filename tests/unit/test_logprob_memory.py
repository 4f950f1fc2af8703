"""Selective log-probs and entropies: exact gradients, and no second (B, R, V) tensor (docs/pitfalls.md: vocabulary memory).

The memory checks count every tensor storage created inside the call (``tests/memory_tracker.py``; on a GPU
``torch.cuda.max_memory_allocated`` counts the same allocations) and hold the bounds the docstrings state:
extra peak under 4% (log-probs) and 7% (entropy) of one float32 (B, R, V) tensor with the default pieces,
under no_grad, in the training forward and in the backward beyond the logits' gradient; with one row per
piece, one piece alive for log-probs and two for entropy (the old code kept the previous piece's temporaries
while making the next: two and three).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rlhf_lit.functional.losses import entropy_from_logits
from rlhf_lit.functional.sequence import chunk_views, gather_logprobs
from tests.memory_tracker import TensorMemoryTracker

B, R, V = 8, 112, 4096
ONE_BRV = B * R * V * 4  # bytes of one float32 (B, R, V) tensor: 14 MiB
# the bounds of gather_logprobs' and entropy_from_logits' docstrings, as fractions of one float32 (B, R, V)
# tensor of 8 MiB or more (B * R >= 32, V >= 1024)
LOGPROB_BOUND, ENTROPY_BOUND = 0.04, 0.07


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
    shapes = [(8, 112, 4096), (3, 5, 7), (1, 1, 2), (70, 1, 3), (2, 200, 50_000), (4, 48, 128_256)]
    shapes += [(1, 48, 50_257), (1, 33, 65_536), (8, 256, 1024), (5, 7, 60_000)]
    for shape in shapes:
        b, r, v = shape
        seen = torch.zeros(b, r, dtype=torch.long)
        pieces = chunk_views(torch.Size(shape), None)
        for rows, cols in pieces:
            seen[rows, cols] += 1
        assert torch.equal(seen, torch.ones_like(seen)), shape
        # B R // 32 positions, at least 2^16 // V, at most 2^22 logits (or one position)
        biggest = max((rows.stop - rows.start) * (cols.stop - cols.start) for rows, cols in pieces)
        assert biggest <= max(b * r // 32, 2**16 // v, 1), shape
        assert biggest * v <= max(2**22, v), shape
        if b * r * v >= 2**21 and b * r >= 32:  # 8 MiB of float32 and 32 positions: a piece is at most 1/32
            assert 32 * biggest <= b * r, shape
    # (1, 48, 50257): 48 // 32 = 1 position per piece, 2.1% (rounding up gave 2, 4.2%: over the 4% bound)
    assert len(chunk_views(torch.Size((1, 48, 50_257)), None)) == 48
    # (8, 112, 4096): 896 // 32 = 28 positions per piece, 32 pieces
    assert len(chunk_views(torch.Size((8, 112, 4096)), None)) == 32
    # (3, 5, 7): at least 2^16 logits per piece -> everything in one piece
    assert chunk_views(torch.Size((3, 5, 7)), None) == [(slice(0, 3), slice(0, 5))]
    # explicit rows per piece, as before
    assert chunk_views(torch.Size((5, 4, 3)), 2) == [
        (slice(0, 2), slice(0, 4)),
        (slice(2, 4), slice(0, 4)),
        (slice(4, 5), slice(0, 4)),
    ]


def _extra_peaks(fn, logits: torch.Tensor, others: list[torch.Tensor]) -> tuple[int, int, int]:
    """Bytes ``fn(logits)`` makes at its peak: under no_grad, in the training forward, and in the backward
    beyond the logits' gradient itself (each pass counted by its own tracker)."""
    with torch.no_grad(), TensorMemoryTracker(ignore=[logits, *others]) as tracker:
        out = fn(logits)
        del out
    no_grad = tracker.peak
    x = logits.detach().requires_grad_()
    with TensorMemoryTracker(ignore=[x, *others]) as tracker:
        out = fn(x)
    forward = tracker.peak
    loss = (out * torch.linspace(-1.0, 1.0, out.numel()).view_as(out)).sum()
    with TensorMemoryTracker(ignore=[x, *others]) as tracker:
        (grad,) = torch.autograd.grad(loss, x)
    return no_grad, forward, tracker.peak - grad.untyped_storage().nbytes()


def _logits_and_tokens(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=gen) * 3).to(dtype)
    return logits, torch.randint(0, shape[-1], shape[:-1], generator=gen)


@pytest.mark.parametrize(
    "shape, dtype, temperature",
    [
        ((B, R, V), torch.float32, 0.7),  # logits / T is the piece's first temporary
        ((B, R, V), torch.float32, 1.0),  # the piece is a view; logits - max is the first temporary
        ((B, R, V), torch.bfloat16, 0.7),  # upcast per piece
        ((1, 48, 50_257), torch.float32, 0.7),  # GPT-2's vocabulary, one row: 48 pieces of one position
        ((8, 256, 1024), torch.float32, 1.0),  # the smallest documented case: 8 MiB, V = 1024
    ],
)
def test_default_pieces_extra_peak_is_under_the_documented_bounds(shape, dtype, temperature):
    logits, tokens = _logits_and_tokens(shape, dtype)
    one_brv = logits.numel() * 4
    lp = _extra_peaks(lambda x: gather_logprobs(x, tokens, temperature), logits, [tokens])
    ent = _extra_peaks(lambda x: entropy_from_logits(x, temperature), logits, [])
    for name, peak in zip(("no_grad", "forward", "backward beyond the gradient"), lp):
        assert peak < LOGPROB_BOUND * one_brv, f"log-probs {name}: {peak / one_brv:.2%} of (B, R, V)"
    for name, peak in zip(("no_grad", "forward", "backward beyond the gradient"), ent):
        assert peak < ENTROPY_BOUND * one_brv, f"entropy {name}: {peak / one_brv:.2%} of (B, R, V)"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_one_row_pieces_keep_one_piece_alive_for_logprobs_and_two_for_entropy(temperature):
    # B = 8 pieces of one row; a piece is one float32 (1, R, V) tensor, 1/8 of the whole (1.75 MiB). The
    # entropy needs z and exp(z) of a piece at once (sum_v e_v z_v); the half piece is room for the (B, R)
    # results and the per-position sums, far smaller.
    logits, tokens = _logits_and_tokens((B, R, V), torch.float32)
    piece = R * V * 4
    lp = _extra_peaks(lambda x: gather_logprobs(x, tokens, temperature, chunk_size=1), logits, [tokens])
    ent = _extra_peaks(lambda x: entropy_from_logits(x, temperature, chunk_size=1), logits, [])
    for name, peak in zip(("no_grad", "forward", "backward beyond the gradient"), lp):
        assert peak < 1.5 * piece, f"log-probs {name}: {peak / piece:.2f} pieces"
    for name, peak in zip(("no_grad", "forward", "backward beyond the gradient"), ent):
        assert peak < 2.5 * piece, f"entropy {name}: {peak / piece:.2f} pieces"


def test_the_tracker_sees_the_plain_paths_full_size_tensors():
    # the plain path makes two float32 (B, R, V) tensors (logits / T, log_softmax): the checks above can fail
    logits, tokens = _logits_and_tokens((B, R, V), torch.float32)
    plain = _extra_peaks(lambda x: _naive_logprobs(x, tokens, 0.7), logits, [tokens])
    assert plain[0] >= 2 * ONE_BRV, plain


def test_logprobs_and_entropy_together_keep_no_second_btv_tensor_and_backward_only_the_gradients():
    logits, tokens = _inputs()
    logits.requires_grad_()
    weights = torch.randn(B, R)
    with TensorMemoryTracker(ignore=[logits, tokens, weights]) as tracker:
        logprobs = gather_logprobs(logits, tokens, temperature=0.7)
        entropy = entropy_from_logits(logits, temperature=0.7)
        forward_peak = tracker.peak
        loss = (logprobs * weights).sum() - 0.01 * entropy.sum()
        grad = torch.autograd.grad(loss, logits)[0]
        backward_peak = tracker.peak
    # entropy's two pieces while the log-probs' (B, R) results wait for the backward
    assert forward_peak < ENTROPY_BOUND * ONE_BRV, forward_peak
    # each function's backward makes one gradient of the logits, and autograd adds the two (a third)
    assert backward_peak < 3 * ONE_BRV + ENTROPY_BOUND * ONE_BRV, backward_peak
    expected = torch.autograd.grad(
        (_naive_logprobs(logits, tokens, 0.7) * weights).sum() - 0.01 * _naive_entropy(logits, 0.7).sum(),
        logits,
    )[0]
    assert_close(grad, expected, atol=1e-5, rtol=1e-4)
