"""Each data-parallel rank samples from its own random stream, and takes its own back on resume (``rlhf_lit.rng``).

The two-process check (``tests/distributed``, scenario ``sample_apart``) runs it under DDP; these tests run the
same functions in one process, playing each rank in turn.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_lit.rng import get_rng_state, rank_seed, set_rng_state, start_rank_stream


def _draws(n: int = 8) -> list[int]:
    return torch.randint(0, 2**31 - 1, (n,)).tolist()


def _rank_draws(seed: int, rank: int, world_size: int, saved=None, per_rank=None) -> list[int]:
    """What rank ``rank`` draws after ``seed_everything(seed)`` and the start of training."""
    torch.manual_seed(seed)
    start_rank_stream(saved, per_rank, rank, world_size)
    return _draws()


def test_rank_seed_keeps_rank_0s_seed_and_gives_every_other_rank_its_own():
    assert rank_seed(1234, 0) == 1234
    seeds = [rank_seed(1234, r) for r in range(64)]
    assert len(set(seeds)) == 64  # no two ranks of 64 share a seed
    assert seeds == [rank_seed(1234, r) for r in range(64)]  # a pure function: a rerun draws the same
    assert rank_seed(1235, 1) != rank_seed(1234, 1)
    with pytest.raises(ValueError, match="rank must be >= 0"):
        rank_seed(1234, -1)


def test_a_fresh_run_draws_apart_on_every_rank_and_rank_0_as_one_process_does():
    torch.manual_seed(7)
    one_process = _draws()
    ranks = [_rank_draws(7, r, 4) for r in range(4)]
    assert ranks[0] == one_process  # rank 0 (and a 1-process run) keeps the run's stream
    assert len({tuple(d) for d in ranks}) == 4  # without the reseed all four would equal one_process
    assert ranks == [_rank_draws(7, r, 4) for r in range(4)]  # and it is repeatable


def test_a_resumed_rank_takes_back_its_own_saved_states():
    per_rank = []
    for r in range(2):  # each rank saves where it is after some sampling
        torch.manual_seed(3)
        start_rank_stream(None, None, r, 2)
        _draws(5)
        per_rank.append(get_rng_state())
    expected = []
    for r in range(2):  # what each would draw next, uninterrupted
        set_rng_state(per_rank[r])
        expected.append(_draws())
    assert expected[0] != expected[1]
    for r in range(2):  # resumed: seeded again by seed_everything, then the checkpoint's states applied
        assert _rank_draws(3, r, 2, saved=per_rank[0], per_rank=per_rank) == expected[r]


def test_a_checkpoint_without_per_rank_states_or_from_another_world_size_still_draws_apart():
    torch.manual_seed(11)
    _draws(3)
    saved = get_rng_state()
    set_rng_state(saved)
    rank_0_next = _draws()
    two_ranks = [get_rng_state(), get_rng_state()]  # saved by a 2-rank run, resumed on 3 ranks
    for per_rank in (None, two_ranks):
        resumed = [_rank_draws(99, r, 3, saved=saved, per_rank=per_rank) for r in range(3)]
        assert resumed[0] == rank_0_next  # rank 0 continues the saved stream
        assert len({tuple(d) for d in resumed}) == 3


def test_rank_and_world_of_a_trainer_and_of_no_trainer():
    """One helper says which rank this process is and how many there are (validation's seed, the update's
    minibatch split, the loss's unit weighting, the non-finite check read it); no trainer is one process."""
    from types import SimpleNamespace

    from rlhf_lit.parallel import rank_and_world

    assert rank_and_world(None) == (0, 1)
    assert rank_and_world(SimpleNamespace(global_rank=3, world_size=4)) == (3, 4)
