"""position ids, last real index, selective log-probs, stop-token masks (docs/pitfalls.md: score token, sampling temperature, left padding, vocabulary memory)."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_lit.functional import (
    gather_logprobs,
    last_real_index,
    position_ids_from_mask,
    stop_mask,
    trim_left_padding,
    truncate_after_stop,
)
from rlhf_lit.functional.sequence import pad_cat


def close(actual, expected, atol=1e-6):
    assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


# ---------------------------------------------------------------- position ids (pitfall: left padding)


def test_position_ids_left_and_right_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]])
    # cumsum - 1 = [-1,-1,0,1,2,3,4] -> clamp -> [0,0,0,1,2,3,4]; right padding repeats the last
    expected = torch.tensor([[0, 0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 3, 3, 3]])
    assert torch.equal(position_ids_from_mask(mask), expected)
    assert position_ids_from_mask(mask.bool()).dtype == torch.long


def test_position_ids_real_tokens_match_unpadded_run():
    unpadded = position_ids_from_mask(torch.ones(1, 5))
    padded = position_ids_from_mask(torch.tensor([[0, 0, 1, 1, 1, 1, 1]]))
    assert torch.equal(padded[:, 2:], unpadded)


def test_trim_left_padding_drops_only_columns_padded_in_every_row():
    # prompt block P = 4 (left padded), then a 2-token response block
    ids = torch.tensor([[0, 0, 7, 8, 5, 6], [0, 0, 0, 9, 4, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0]])
    out_ids, out_mask, p = trim_left_padding(ids, mask, 4)
    assert p == 2  # columns 0 and 1 are padding in both rows; column 2 is real in row 0
    assert torch.equal(out_ids, torch.tensor([[7, 8, 5, 6], [0, 9, 4, 0]]))
    assert torch.equal(out_mask, torch.tensor([[1, 1, 1, 1], [0, 1, 1, 0]]))
    # the positions of the real tokens are unchanged by the cut (pitfall: left padding)
    kept = mask[:, 2:].bool()
    assert torch.equal(position_ids_from_mask(out_mask)[kept], position_ids_from_mask(mask)[:, 2:][kept])
    # nothing to drop: the same tensors back
    same = trim_left_padding(ids[:, 2:], mask[:, 2:], 2)
    assert same[0] is not None and torch.equal(same[0], out_ids) and same[2] == 2
    # at least one prompt column stays, even if the prompt block were all padding
    assert trim_left_padding(ids, torch.tensor([[0, 0, 0, 0, 1, 1]]).expand(2, 6), 4)[2] == 1


def test_pad_cat_pads_each_piece_to_the_widest_on_its_side():
    a = torch.tensor([[1, 2, 3]])
    b = torch.tensor([[4], [5]])
    # responses: columns added after a piece's own; prompts: before
    assert pad_cat([a, b], 0).tolist() == [[1, 2, 3], [4, 0, 0], [5, 0, 0]]
    assert pad_cat([b, a], 9, "left").tolist() == [[9, 9, 4], [9, 9, 5], [1, 2, 3]]
    masks = pad_cat([torch.tensor([[True]]), torch.tensor([[True, False]])], False)
    assert masks.dtype == torch.bool and masks.tolist() == [[True, False], [True, False]]
    # weights padded with 1.0; trailing dims kept: (1, 1, 2) and (1, 2, 2) -> (2, 2, 2)
    w = pad_cat([torch.full((1, 1, 2), 0.5), torch.zeros(1, 2, 2)], 1.0)
    assert w.tolist() == [[[0.5, 0.5], [1.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]]]
    same = torch.tensor([[1, 2]])
    out = pad_cat([same], 0)
    assert torch.equal(out, same) and out.data_ptr() != same.data_ptr()  # a new tensor, the input untouched
    with pytest.raises(ValueError, match="side"):
        pad_cat([a], 0, "top")
    with pytest.raises(ValueError, match="pads dim 1"):
        pad_cat([torch.tensor([1, 2])], 0)
    with pytest.raises(ValueError, match="at least one"):
        pad_cat([], 0)


# ---------------------------------------------------------------- last real index (pitfall: score token)


def test_last_real_index_b04_left_and_right_padding():
    # pad == eos == 2: ids [5,6,2,7,8,2,2,2] / [2,2,5,6,2,7,8,2]; only the mask is used
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]])
    assert last_real_index(mask).tolist() == [5, 7]  # sum(mask) - 1 would give 5 for both


def test_last_real_index_one_token_and_interior_gap():
    mask = torch.tensor([[1, 0, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    assert last_real_index(mask).tolist() == [0, 2]


def test_last_real_index_empty_row_raises_naming_row():
    with pytest.raises(ValueError, match=r"row\(s\) \[1\]"):
        last_real_index(torch.tensor([[1, 1], [0, 0]]))


# ---------------------------------------------------------------- selective log-probs (pitfall: sampling temperature, vocabulary memory)


def test_gather_logprobs_temperature_b10():
    logits = torch.tensor([[[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]]])  # (B=1, R=2, V=3)
    tokens = torch.tensor([[0, 2]])
    # T=1: logsumexp = ln(e^2 + e + 1) = ln(11.107338) = 2.407606 -> [2 - 2.407606, 0 - 2.407606]
    close(gather_logprobs(logits, tokens), [[-0.407606, -2.407606]])
    # T=0.7: logits/T = [2.857143, 1.428571, 0]; lse = ln(17.4117 + 4.1722 + 1) = 3.117261
    lp_t = gather_logprobs(logits, tokens, temperature=0.7)
    close(lp_t, [[-0.260118, -3.117261]])
    # old and new at the same T: ratio exactly 1; the bug (T=1 vs T=0.7) gives exp(-0.147488)
    assert torch.equal(torch.exp(lp_t - gather_logprobs(logits, tokens, temperature=0.7)), torch.ones(1, 2))
    close(torch.exp(gather_logprobs(logits, tokens)[0, 0] - lp_t[0, 0]), 0.862873)


def test_gather_logprobs_equals_log_softmax_b21():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen) * 3
    tokens = torch.randint(0, 11, (2, 5), generator=gen)
    naive = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert_close(gather_logprobs(logits, tokens), naive, atol=1e-6, rtol=0)
    naive_t = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert_close(gather_logprobs(logits, tokens, temperature=0.7), naive_t, atol=1e-6, rtol=0)
    # chunking over batch rows changes nothing
    assert_close(gather_logprobs(logits, tokens, chunk_size=1), gather_logprobs(logits, tokens))


def test_gather_logprobs_bf16_computes_in_fp32_and_is_differentiable():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 7, generator=gen).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, 7, (3, 4), generator=gen)
    out = gather_logprobs(logits, tokens, chunk_size=2)
    assert out.dtype == torch.float32
    assert_close(out, gather_logprobs(logits.detach().float(), tokens))
    out.sum().backward()
    # d logp / d logits = onehot - softmax: sums to 0 over the vocabulary
    close(logits.grad.float().sum(-1), torch.zeros(3, 4), atol=2e-2)


def test_gather_logprobs_errors():
    with pytest.raises(ValueError, match="temperature"):
        gather_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="tokens"):
        gather_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))


def test_gather_logprobs_uniform_is_minus_log_v():
    close(gather_logprobs(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 3]])), [[-math.log(4)] * 3])


# ---------------------------------------------------------------- stop-token masks


def test_stop_mask_includes_first_stop_and_nothing_after():
    ids = torch.tensor(
        [
            [5, 6, 2, 7, 8],  # stop at 2: keep it, drop the rest
            [2, 2, 2, 2, 2],  # stop as the first token: a one-token response
            [5, 6, 7, 8, 9],  # no stop: ran to max_new_tokens, all real
        ]
    )
    mask, has_stop = stop_mask(ids, stop_token_ids=2)
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert has_stop.tolist() == [True, True, False]


def test_stop_mask_pad_equal_to_eos_keeps_the_real_eos():
    ids = torch.tensor([[7, 8, 2, 2, 2]])  # pad == eos == 2
    mask, _ = stop_mask(ids, 2, pad_token_id=2)
    assert mask.int().tolist() == [[1, 1, 1, 0, 0]]  # ids != pad would give [1, 1, 0, 0, 0]


def test_stop_mask_several_stop_ids():
    mask, has_stop = stop_mask(torch.tensor([[5, 3, 2, 7], [5, 6, 2, 3]]), [2, 3])
    assert mask.int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert has_stop.tolist() == [True, True]


def test_stop_mask_property_real_tokens_form_a_prefix():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6, (20, 12), generator=gen)
    mask, has_stop = stop_mask(ids, torch.tensor([0]))
    assert torch.all(mask[:, :-1] >= mask[:, 1:])  # once False, stays False
    assert torch.all(mask[:, 0])  # the first generated token is always real
    assert torch.equal(~has_stop, mask.all(-1) & (ids[:, -1] != 0))
    with pytest.raises(ValueError, match="empty"):
        stop_mask(ids, [])


def test_truncate_after_stop_is_out_of_place():
    ids = torch.tensor([[5, 2, 7, 8], [5, 6, 7, 8]])
    before = ids.clone()
    out, mask, has_stop = truncate_after_stop(ids, stop_token_ids=2, pad_token_id=0)
    assert out.tolist() == [[5, 2, 0, 0], [5, 6, 7, 8]]
    assert mask.int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert has_stop.tolist() == [True, False]
    assert torch.equal(ids, before)


def test_response_positions_are_the_ones_before_each_response_token():
    """T = 5, P = 3: the outputs at positions 2 and 3 predict response tokens 3 and 4 (docs/layout.md)."""
    from rlhf_lit.functional.sequence import response_positions

    outputs = torch.arange(10.0).reshape(1, 5, 2)  # (B=1, T=5, 2)
    torch.testing.assert_close(response_positions(outputs, 3), torch.tensor([[[4.0, 5.0], [6.0, 7.0]]]))
    assert response_positions(outputs, 1).shape == (1, 4, 2)  # a one-token prompt
    for bad in (0, 5):
        with pytest.raises(ValueError, match="prompt_len must be in"):
            response_positions(outputs, bad)
