"""masked_sum / masked_mean / masked_var / masked_whiten (docs/pitfalls.md: whitening)."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from rlhf_lit.functional import masked_mean, masked_sum, masked_var, masked_whiten


def close(actual, expected, atol=1e-6):
    assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


# pitfall: whitening: advantages of pitfall: GAE over padding with one padded slot
ADV = torch.tensor([0.395375, 0.5425, 0.35, 0.0])
ADV_MASK = torch.tensor([True, True, True, False])


def test_masked_sum_rows_and_all():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    close(masked_sum(values, mask), 3.0)  # 1 + 2
    close(masked_sum(values, mask, dim=-1), [3.0, 0.0])  # fully masked row -> 0


def test_masked_mean_b08():
    # (0.395375 + 0.5425 + 0.35) / 3 = 1.287875 / 3 = 0.429292; the pad would give 0.321969
    close(masked_mean(ADV, ADV_MASK), 0.429292)


def test_masked_mean_per_row_fully_masked_row_is_zero_not_nan():
    values = torch.tensor([[1.0, 2.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]], dtype=torch.bool)
    close(masked_mean(values, mask, dim=-1), [3.5, 0.0])  # (1 + 6) / 2; empty row -> 0
    close(masked_mean(values, torch.zeros_like(mask)), 0.0)


def test_padding_garbage_never_leaks():
    values = torch.tensor([1.0, 2.0, 3.0, float("nan"), float("inf")])
    mask = torch.tensor([1, 1, 1, 0, 0], dtype=torch.bool)
    close(masked_mean(values, mask), 2.0)
    close(masked_var(values, mask), 1.0)
    close(masked_whiten(values, mask), [-1.0, 0.0, 1.0, 0.0, 0.0], atol=1e-5)


def test_masked_mean_gradient_is_one_over_n_on_real_tokens():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    masked_mean(values, torch.tensor([1, 1, 1, 0])).backward()
    close(values.grad, [1 / 3, 1 / 3, 1 / 3, 0.0])


def test_masked_var_unbiased_and_population():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1, 1, 1, 0])
    # mean 2; squared deviations 1 + 0 + 1 = 2 -> 2/2 = 1 (unbiased), 2/3 (population)
    close(masked_var(values, mask), 1.0)
    close(masked_var(values, mask, unbiased=False), 2.0 / 3.0)
    close(masked_var(ADV, ADV_MASK), 0.0101268)  # pitfall: whitening


def test_masked_var_one_or_zero_tokens_is_zero():
    close(masked_var(torch.tensor([5.0, 7.0]), torch.tensor([1, 0])), 0.0)  # n = 1: not NaN
    close(masked_var(torch.tensor([5.0, 7.0]), torch.tensor([0, 0])), 0.0)  # n = 0


def test_masked_var_two_pass_survives_a_large_offset():
    # E[x^2] - E[x]^2 at 1e9 cancels catastrophically in float64; the two-pass variance stays exact
    values = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64) + 1e9
    close(masked_var(values, torch.ones(3, dtype=torch.bool)), 1.0, atol=1e-9)


def test_masked_whiten_b08_values():
    out = masked_whiten(ADV, ADV_MASK)
    close(out, [-0.337036, 1.124972, -0.787936, 0.0])  # (x - 0.429292) / sqrt(0.0101268)
    close(masked_whiten(ADV, ADV_MASK, unbiased=False), [-0.412783, 1.377803, -0.965020, 0.0])
    # scale only: x * rsqrt(var + eps), no centring and no adding the mean back
    close(masked_whiten(ADV, ADV_MASK, shift_mean=False), [3.928913, 5.390921, 3.478014, 0.0], atol=2e-6)


def test_masked_whiten_one_two_three():
    values, mask = torch.tensor([1.0, 2.0, 3.0, 50.0]), torch.tensor([1, 1, 1, 0])
    close(masked_whiten(values, mask), [-1.0, 0.0, 1.0, 0.0])  # var 1 (unbiased)
    close(masked_whiten(values, mask, unbiased=False), [-1.224745, 0.0, 1.224745, 0.0])  # 1/sqrt(2/3)


def test_masked_whiten_single_token_is_finite():
    values, mask = torch.tensor([5.0, 9.0]), torch.tensor([1, 0])
    close(masked_whiten(values, mask), [0.0, 0.0])  # scale 1 when n <= 1: 5 - 5 = 0
    close(masked_whiten(values, mask, shift_mean=False), [5.0, 0.0])  # unchanged
    close(masked_whiten(values, torch.tensor([0, 0])), [0.0, 0.0])  # no real token at all


def test_masked_whiten_property_mean_zero_var_one_and_affine_invariant():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, 7, generator=gen) > 0.3
    out = masked_whiten(values, mask, eps=0.0)
    close(masked_mean(out, mask), 0.0, atol=1e-12)
    close(masked_var(out, mask), 1.0, atol=1e-12)
    close(masked_whiten(3.0 * values - 7.0, mask, eps=0.0), out, atol=1e-12)


def test_no_in_place_edits_and_dtype_kept():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    before = values.clone()
    out = masked_whiten(values, torch.tensor([[1, 1, 1, 0]]))
    assert out.dtype == torch.bfloat16
    assert torch.equal(values, before)


def test_bad_mask_shape_and_distributed_with_dim_raise():
    with pytest.raises(ValueError, match="broadcast"):
        masked_mean(torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="dim=None"):
        masked_mean(torch.ones(2, 3), torch.ones(2, 3), dim=-1, distributed=True)


def test_distributed_flag_is_a_no_op_without_process_group():
    assert not dist.is_initialized()
    assert_close(masked_whiten(ADV, ADV_MASK, distributed=True), masked_whiten(ADV, ADV_MASK))


def _two_rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        # pitfall: whitening: rank 0 holds [1, 2], rank 1 holds [3] plus a padded slot
        values = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 99.0])][rank]
        mask = [torch.tensor([1, 1]), torch.tensor([1, 0])][rank]
        # empty shard: rank 1 has no real token at all
        values2 = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([8.0, 9.0, 10.0])][rank]
        mask2 = [torch.ones(3), torch.zeros(3)][rank]
        result = {
            "whiten": masked_whiten(values, mask, distributed=True),
            "local": masked_whiten(values, mask),
            "mean": masked_mean(values, mask, distributed=True),
            "var": masked_var(values, mask, distributed=True),
            "empty_shard": masked_whiten(values2, mask2, distributed=True),
        }
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_ranks_use_global_statistics(tmp_path):
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    # global tokens [1, 2, 3]: mean 2, unbiased var 1 -> [-1, 0] and [1, pad]
    close(r0["whiten"], [-1.0, 0.0])
    close(r1["whiten"], [1.0, 0.0])
    close(r0["mean"], 2.0)
    close(r1["var"], 1.0)
    # per-rank statistics would give [-0.7071, 0.7071] on rank 0 and 0 (n = 1) on rank 1
    close(r0["local"], [-1 / math.sqrt(2), 1 / math.sqrt(2)])
    close(r0["empty_shard"], [-1.0, 0.0, 1.0])
    close(r1["empty_shard"], [0.0, 0.0, 0.0])


def test_masked_weighted_mean_by_hand():
    from rlhf_lit.functional.masked import masked_weighted_mean

    values = torch.tensor([[1.0, 3.0], [5.0, 100.0]])
    mask = torch.tensor([[True, True], [True, False]])
    # weights 1 / length: (0.5 * 1 + 0.5 * 3 + 1 * 5) / (0.5 + 0.5 + 1) = 7 / 2 = 3.5; the token mean is 3
    weights = torch.tensor([[0.5, 0.5], [1.0, 7.0]])
    torch.testing.assert_close(masked_weighted_mean(values, mask, weights), torch.tensor(3.5))
    torch.testing.assert_close(masked_weighted_mean(values, mask), torch.tensor(3.0))
    # no real token with weight: 0, not nan
    assert float(masked_weighted_mean(values, torch.zeros_like(mask), weights)) == 0.0
