"""Running score statistics (Chan et al. merge) and PPO-max score normalisation / clipping."""

import io
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from rlhf_lit.rl.reward_norm import RunningMeanStd, normalize_scores


def close(actual, expected, atol=1e-6):
    assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


def test_running_stats_hand_numbers():
    rms = RunningMeanStd()
    rms.update(torch.tensor([1.0, 2.0, 3.0]))
    assert (rms.count, rms.mean, rms.var) == (3, 2.0, pytest.approx(2 / 3))  # (1 + 0 + 1) / 3
    rms.update(torch.tensor([[4.0], [5.0]]))  # any shape is flattened
    # merged over [1, 2, 3, 4, 5]: mean 3, population var (4 + 1 + 0 + 1 + 4) / 5 = 2
    assert rms.count == 5
    assert rms.mean == pytest.approx(3.0, abs=1e-12)
    assert rms.std == pytest.approx(math.sqrt(2.0), abs=1e-12)


def test_running_stats_defaults_and_empty_update():
    rms = RunningMeanStd()
    assert (rms.count, rms.mean, rms.std) == (0, 0.0, 1.0)
    rms.update(torch.zeros(0))
    assert rms.count == 0
    rms.update(torch.tensor([4.0]))  # one score: var 0
    assert (rms.count, rms.mean, rms.std) == (1, 4.0, 0.0)
    with pytest.raises(ValueError, match="inf or nan"):
        rms.update(torch.tensor([1.0, float("nan")]))


def test_property_merged_batches_equal_one_big_batch():
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=gen, dtype=torch.float64) * 4 + 100 for n in (1, 7, 30, 2, 60)]
    rms = RunningMeanStd()
    for batch in batches:
        rms.update(batch)
    everything = torch.cat(batches)
    assert rms.count == everything.numel()
    assert rms.mean == pytest.approx(float(everything.mean()), rel=1e-12)
    assert rms.var == pytest.approx(float(everything.var(unbiased=False)), rel=1e-10)


def test_state_dict_round_trip_is_exact():
    rms = RunningMeanStd()
    rms.update(torch.tensor([0.1, 0.7, -2.3]))
    buffer = io.BytesIO()
    torch.save(rms.state_dict(), buffer)
    buffer.seek(0)
    restored = RunningMeanStd()
    restored.load_state_dict(torch.load(buffer))
    assert restored.state_dict() == rms.state_dict()
    assert all(type(v) in (int, float) for v in restored.state_dict().values())


def make_running(values):
    rms = RunningMeanStd()
    rms.update(torch.tensor(values))
    return rms


def test_normalize_scores_hand_numbers():
    rms = make_running([1.0, 2.0, 3.0, 4.0, 5.0])  # mean 3, std sqrt 2
    scores = torch.tensor([1.0, 3.0, 5.0])
    close(normalize_scores(scores, rms, clip=None), [-1.414214, 0.0, 1.414214])  # (x - 3) / 1.414214
    close(normalize_scores(scores, rms, clip=1.0), [-1.0, 0.0, 1.0])
    close(normalize_scores(scores, rms, clip=None, shift_mean=False), [0.707107, 2.121320, 3.535534])
    close(normalize_scores(torch.tensor([-9.0, 0.5, 9.0]), None, clip=5.0), [-5.0, 0.5, 5.0])  # clip only


def test_normalize_scores_is_pure_and_validates_clip():
    rms = make_running([1.0, 2.0])
    scores = torch.tensor([1.0, 2.0])
    before, state = scores.clone(), rms.state_dict()
    out = normalize_scores(scores, rms, clip=3.0)
    assert torch.equal(scores, before) and rms.state_dict() == state and out is not scores
    close(normalize_scores(scores, RunningMeanStd(), clip=None), [1.0, 2.0])  # no statistics yet
    with pytest.raises(ValueError, match="clip"):
        normalize_scores(scores, rms, clip=0.0)


def test_normalize_scores_property_monotone():
    rms = make_running([0.0, 10.0, 3.0])
    scores = torch.linspace(-20, 20, 41)
    out = normalize_scores(scores, rms, clip=None)
    assert torch.all(out[1:] > out[:-1])


def _two_rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        rms = RunningMeanStd(distributed=True)
        rms.update([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0])][rank])
        torch.save(rms.state_dict(), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_ranks_share_global_statistics(tmp_path):
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        state = torch.load(tmp_path / f"rank{rank}.pt")
        assert state["count"] == 5
        assert state["mean"] == pytest.approx(3.0, abs=1e-12)
        assert state["m2"] == pytest.approx(10.0, abs=1e-12)  # 5 * population var 2


def test_clipping_never_turns_a_non_finite_score_into_the_best_reward():
    # clamp(+inf, -5, 5) = +5 would be the best possible reward; NaN would spread to every advantage
    with pytest.raises(ValueError, match=r"index \[1, 2\].*best reward"):
        normalize_scores(torch.tensor([0.5, float("inf"), float("nan")]), None, clip=5.0)
    with pytest.raises(ValueError, match=r"index \[0\]"):
        normalize_scores(torch.tensor([float("-inf"), 1.0]), RunningMeanStd(), clip=None)
    assert_close(
        normalize_scores(torch.tensor([7.0, -7.0, 1.0]), None, clip=5.0), torch.tensor([5.0, -5.0, 1.0])
    )
