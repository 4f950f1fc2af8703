"""Packing math (rlhf_lit.functional.packing) on literal tensors, the arithmetic in the comments."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rlhf_lit.functional.packing import (
    first_fit_decreasing,
    pack,
    pack_layout,
    packed_labels,
    response_logps_packed,
    unpack,
)
from rlhf_lit.functional.preference import response_logps_from_hidden
from rlhf_lit.functional.sequence import position_ids_from_mask


def test_first_fit_decreasing_by_hand():
    # longest first: row 1 (5) opens bin 0 (room 1); row 3 (4) opens bin 1 (room 2);
    # row 0 (3) fits neither, opens bin 2 (room 3); row 2 (2) fits bin 1 (room 2)
    assert first_fit_decreasing([3, 5, 2, 4], 6) == [[1], [3, 2], [0]]
    # ties go by index; empty rows go nowhere; capacity 4 holds 2 + 2 and 1 + 1 + 1 + 1
    assert first_fit_decreasing([2, 0, 2, 1, 1, 1, 1], 4) == [[0, 2], [3, 4, 5, 6]]


def test_first_fit_decreasing_refuses_a_row_longer_than_a_bin():
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([3, 7], 6)
    with pytest.raises(ValueError, match="capacity"):
        first_fit_decreasing([], 0)


def test_no_bin_exceeds_the_capacity_and_every_row_is_placed_once():
    lengths = torch.randint(0, 20, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    bins = first_fit_decreasing(lengths, 20)
    assert all(sum(lengths[r] for r in rows) <= 20 for rows in bins)
    assert sorted(r for rows in bins for r in rows) == [i for i, n in enumerate(lengths) if n > 0]


# rows of 2, 3 and 1 real tokens, right and left padded, T = 4; ids 10.. real, 0 padding
IDS = torch.tensor([[10, 11, 0, 0], [0, 20, 21, 22], [30, 0, 0, 0]])
MASK = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 0, 0]])


def test_layout_packs_rows_into_bins_no_longer_than_the_longest_row():
    layout = pack_layout(MASK)
    # capacity 3 (row 1): bin 0 = [row 1], bin 1 = [row 0, row 2] (2 + 1 = 3)
    assert layout.shape == (3, 4)
    # flat sources b * 4 + t: row 1's columns 1..3 -> 5, 6, 7; row 0's 0, 1; row 2's 0 -> 8
    assert layout.source.tolist() == [[5, 6, 7], [0, 1, 8]]
    assert layout.valid.all()
    assert layout.position_ids.tolist() == [[0, 1, 2], [0, 1, 0]]
    assert layout.first.tolist() == [[True, False, False], [True, False, True]]
    assert pack(IDS, layout).tolist() == [[20, 21, 22], [10, 11, 30]]


def test_filler_counts_from_zero_and_takes_the_fill_value():
    # capacity 4: bin 0 = row 1 (3) + row 2 (1) = 4; bin 1 = row 0 (2) + 2 filler slots
    layout = pack_layout(MASK, capacity=4)
    assert pack(IDS, layout, fill=-1).tolist() == [[20, 21, 22, 30], [10, 11, -1, -1]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 0], [0, 1, 0, 1]]
    assert layout.valid.tolist() == [[True] * 4, [True, True, False, False]]


def test_position_ids_equal_those_of_the_padded_rows():
    layout = pack_layout(MASK, capacity=4)
    padded = position_ids_from_mask(MASK)
    assert torch.equal(pack(padded, layout)[layout.valid], layout.position_ids[layout.valid])


def test_unpack_inverts_pack_with_zeros_at_padding_and_passes_gradients():
    values = torch.arange(24, dtype=torch.float32).reshape(3, 4, 2).requires_grad_()
    layout = pack_layout(MASK, capacity=4)
    back = unpack(pack(values, layout), layout)
    expected = values.detach() * MASK.unsqueeze(-1)  # real tokens kept, padding 0
    assert torch.equal(back, expected)
    back.sum().backward()
    assert torch.equal(values.grad, MASK.unsqueeze(-1).expand(3, 4, 2).float())


def test_packed_labels_ignore_each_rows_first_token_and_the_filler():
    labels = torch.tensor([[-100, 11, -100, -100], [-100, 20, 21, 22], [30, -100, -100, -100]])
    layout = pack_layout(MASK, capacity=4)
    # bin 0: row 1 [20 -> -100 (first), 21, 22] + row 2 [30 -> -100 (first)]
    # bin 1: row 0 [-100, 11] + filler
    assert packed_labels(labels, layout).tolist() == [[-100, 21, 22, -100], [-100, 11, -100, -100]]


def test_a_batch_without_real_tokens_gives_one_filler_slot():
    layout = pack_layout(torch.zeros(2, 3, dtype=torch.long))
    assert layout.shape == (2, 3)
    assert layout.valid.tolist() == [[False]]
    assert torch.equal(unpack(torch.ones(1, 1, 5), layout), torch.zeros(2, 3, 5))


def test_packed_logps_equal_one_padded_forward_and_each_row_sees_only_itself():
    """A causal toy trunk (a running mean of embeddings, as in test_preference_losses' length-groups test),
    packed: the mean restarts where the position ids restart (a segment per row). Rows 0 and 3 (3 tokens each) share a bin of width 7 after rows 1 and 2 (7 each) take
    one bin apiece; the packed values and gradients equal the padded forward's, in row order. A trunk whose
    mean runs across the bin (attention leaking between rows) changes row 3, placed after row 0."""
    gen = torch.Generator().manual_seed(1)
    V, H = 13, 5
    emb = torch.randn(V, H, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, generator=gen, requires_grad=True)
    prompt_len, response_len = torch.tensor([2, 1, 3, 2]), torch.tensor([1, 6, 4, 1])  # lengths 3, 7, 7, 3
    T = 9
    ids = torch.randint(1, V, (4, T), generator=gen)
    mask = (torch.arange(T)[None] < (prompt_len + response_len)[:, None]).long()
    ids = ids * mask
    calls = []

    def padded_trunk(input_ids, attention_mask):
        x = emb[input_ids] * attention_mask[..., None]
        return x.cumsum(1) / torch.arange(1, input_ids.shape[1] + 1, dtype=x.dtype)[None, :, None]

    def packed_trunk(input_ids, position_ids, leak=False):
        calls.append((input_ids.tolist(), position_ids.tolist()))
        x = emb[input_ids]
        rows = []
        for b in range(input_ids.shape[0]):
            out = []
            for t in range(input_ids.shape[1]):
                start = 0 if leak else t - int(position_ids[b, t])  # the row's first token
                out.append(x[b, start : t + 1].mean(0))
            rows.append(torch.stack(out))
        return torch.stack(rows)

    def head(h):
        return h @ weight.T

    packed = response_logps_packed(packed_trunk, head, ids, mask, prompt_len, response_len)
    (bins, positions), = calls
    assert bins == [ids[1, :7].tolist(), ids[2, :7].tolist(), ids[0, :3].tolist() + ids[3, :3].tolist() + [0]]
    assert positions[2] == [0, 1, 2, 0, 1, 2, 0]  # restarting per row; the filler slot counts from 0
    padded = response_logps_from_hidden(padded_trunk(ids, mask), head, ids, prompt_len, response_len)
    assert_close(packed, padded, atol=1e-12, rtol=1e-12)
    for a, b in zip(
        torch.autograd.grad(packed.sum(), (emb, weight)), torch.autograd.grad(padded.sum(), (emb, weight))
    ):
        assert_close(a, b, atol=1e-12, rtol=1e-12)
    leaky = response_logps_packed(
        lambda i, p: packed_trunk(i, p, leak=True), head, ids, mask, prompt_len, response_len
    ).detach()
    assert_close(leaky[:3], padded.detach()[:3], atol=1e-12, rtol=1e-12)  # rows that open a bin
    assert abs(float(leaky[3] - padded[3])) > 1e-3
    with pytest.raises(ValueError, match="within the T columns"):
        response_logps_packed(packed_trunk, head, ids, mask, prompt_len, response_len + 3)
