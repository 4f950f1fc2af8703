"""The reward race's FLOP count (``bench/flops.py``): what each way of batching a step computes, by hand."""

from __future__ import annotations

import pytest

from bench.flops import rm_flops

# n_layer 1, d 2, d_ff 4: N_matmul = 1 * (4 * 2 * 2 + 2 * 2 * 4) = 32
MODEL = {"n_embd": 2, "n_inner": 4, "n_layer": 1}


def cost(n_seq: int, width: int) -> int:
    return n_seq * (6 * 32 * width + 12 * 1 * width * width * 2)


def pair(chosen: int, rejected: int) -> dict:
    return {"chosen_ids": [0] * chosen, "rejected_ids": [0] * rejected}


def test_one_step_padded_grouped_and_packed():
    pairs = [pair(3, 2), pair(1, 2)]  # one step of 4 sequences: lengths 1, 2, 2, 3
    padded = cost(4, 3)
    out = rm_flops(pairs, MODEL, batch_size=2)
    assert out["n_matmul_params"] == 32
    assert out["flops"] == out["flops_padded"] == padded
    # two groups of similar length: (1, 2) at width 2, (2, 3) at width 3
    assert rm_flops(pairs, MODEL, 2, length_groups=2)["flops"] == cost(2, 2) + cost(2, 3)
    # pack_layout: first-fit decreasing, capacity 3 (the longest): [3], [2, 1], [2] -> 3 bins of 3
    packed = rm_flops(pairs, MODEL, 2, packing=True)
    assert packed["flops"] == cost(3, 3) and packed["flops_padded"] == padded


def test_steps_add_up():
    pairs = [pair(3, 2), pair(1, 2), pair(4, 4)]  # batch_size 2: a step of 4 sequences, then one of 2
    assert rm_flops(pairs, MODEL, 2, packing=True)["flops"] == pytest.approx(cost(3, 3) + cost(2, 4))
