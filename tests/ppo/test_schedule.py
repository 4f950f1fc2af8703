"""The minibatch schedule of a PPO epoch: one global permutation, each rank its own rows of each minibatch."""

from __future__ import annotations

import itertools

import torch

from rlhf_lit.rl.schedule import epoch_schedule


def _rows(schedule):
    return [rows.tolist() for rows, _ in schedule]


def test_two_ranks_take_their_rows_of_each_global_minibatch():
    # W = 2 ranks x B = 4 rows; global row g is local row g // 2 of rank g % 2 (the sampler deals round-robin)
    order = torch.tensor([3, 0, 2, 1, 7, 6, 5, 4])
    # global minibatches (2 per rank -> 4 rows): [3, 0, 2, 1] and [7, 6, 5, 4]
    rank0 = epoch_schedule(order, 2, 0, minibatch_size=2, micro_batch_size=1)
    rank1 = epoch_schedule(order, 2, 1, minibatch_size=2, micro_batch_size=1)
    assert _rows(rank0) == [[0, 1], [3, 2]]  # global 0, 2 then 6, 4
    assert _rows(rank1) == [[1, 0], [3, 2]]  # global 3, 1 then 7, 5
    assert [n for _, n in rank0] == [n for _, n in rank1] == [2, 2]


def test_uneven_shares_run_the_same_number_of_micro_batches_on_every_rank():
    # the first global minibatch holds only rank 0's rows, the second only rank 1's
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    rank0 = epoch_schedule(order, 2, 0, minibatch_size=2, micro_batch_size=2)
    rank1 = epoch_schedule(order, 2, 1, minibatch_size=2, micro_batch_size=2)
    assert _rows(rank0) == [[0, 1, 2, 3], []] and _rows(rank1) == [[], [0, 1, 2, 3]]
    assert [n for _, n in rank0] == [n for _, n in rank1] == [2, 2]  # ceil(4 / 2) for the fuller rank


def test_one_rank_is_the_plain_shuffled_minibatches():
    order = torch.tensor([5, 1, 4, 0, 3, 2])
    schedule = epoch_schedule(order, 1, 0, minibatch_size=4, micro_batch_size=3)
    assert _rows(schedule) == [[5, 1, 4, 0], [3, 2]] and [n for _, n in schedule] == [2, 1]


def test_property_every_global_row_is_used_once_per_epoch_and_minibatches_match_one_rank():
    gen = torch.Generator().manual_seed(0)
    for world_size, batch, minibatch in itertools.product([1, 2, 3, 4], [4, 6], [1, 2]):
        if batch % minibatch:
            continue
        order = torch.randperm(world_size * batch, generator=gen)
        one_rank = [set(r) for r in _rows(epoch_schedule(order, 1, 0, minibatch * world_size, 1))]
        per_rank = [epoch_schedule(order, world_size, r, minibatch, 2) for r in range(world_size)]
        for k, global_rows in enumerate(one_rank):
            union = [row * world_size + r for r in range(world_size) for row in per_rank[r][k][0].tolist()]
            assert len(union) == len(set(union)) and set(union) == global_rows
            assert len({sched[k][1] for sched in per_rank}) == 1  # the same micro-batch count everywhere
