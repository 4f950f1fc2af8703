"""The bench's GRPO comparison helpers (``bench/compare_grpo.py``, ``bench/grpo_trl.py``): which of our
sampling-backend variants run, how the sampling tokens/s are compared, and how TRL's sampled tokens are
counted (rows x decoding steps, as our side counts ``response_ids.numel()``). Pure functions, no model."""

from __future__ import annotations

import pytest

from tests.conftest import REPO_ROOT

if not (REPO_ROOT.parent / "shared" / "bench" / "workload.py").exists():
    pytest.skip("the shared bench workload (../shared/bench) is not beside the repository", allow_module_level=True)

from bench.compare_grpo import our_systems, sampling_entry  # noqa: E402
from bench.grpo_trl import completion_counts  # noqa: E402


def test_our_systems_maps_backends_to_systems_and_child_kinds():
    assert our_systems("hf") == [("rlhf_lit", "grpo")]
    assert our_systems("hf,static") == [("rlhf_lit", "grpo"), ("rlhf_lit[static]", "grpo-static")]
    assert our_systems(" static , hf,static") == [("rlhf_lit[static]", "grpo-static"), ("rlhf_lit", "grpo")]
    assert our_systems("hf,bf16copy") == [("rlhf_lit", "grpo"), ("rlhf_lit[bf16copy]", "grpo-bf16copy")]


@pytest.mark.parametrize("bad", ["static", "hf,vllm", ""])
def test_our_systems_needs_hf_and_known_backends(bad):
    with pytest.raises(ValueError, match="--grpo-backends"):
        our_systems(bad)


def _line(tokens_per_s):
    return {"metrics": {"gen_tokens_per_s": {"median": tokens_per_s, "min": tokens_per_s, "max": tokens_per_s}}}


def test_sampling_entry_takes_the_best_of_our_backends_over_hf():
    lines = {"trl": _line(80.0), "rlhf_lit": _line(100.0), "rlhf_lit[static]": _line(160.0)}
    entry = sampling_entry(lines, ["rlhf_lit", "rlhf_lit[static]"])
    # best = static: 160 / 100 = 1.6 >= 1.5; TRL's 80 is listed but never the best (not ours)
    assert entry["best"] == "rlhf_lit[static]"
    assert entry["best_vs_hf"] == pytest.approx(1.6)
    assert entry["met"] is True
    assert entry["tokens_per_s"] == {"trl": 80.0, "rlhf_lit": 100.0, "rlhf_lit[static]": 160.0}


def test_sampling_entry_when_hf_is_the_best_the_ratio_is_one_and_unmet():
    lines = {"trl": _line(300.0), "rlhf_lit": _line(100.0), "rlhf_lit[static]": _line(90.0)}
    entry = sampling_entry(lines, ["rlhf_lit", "rlhf_lit[static]"])
    assert (entry["best"], entry["best_vs_hf"], entry["met"]) == ("rlhf_lit", 1.0, False)


def test_completion_counts_are_rows_times_the_longest():
    # 4 completions of 3, 5, 2, 5 tokens: generate ran 5 steps over 4 rows = 20; mean (3+5+2+5)/4 = 3.75
    counts = completion_counts([[7, 8, 2], [1, 2, 3, 4, 5], [9, 2], [5, 5, 5, 5, 5]])
    assert counts == {"tokens": 20, "mean_len": 3.75}
