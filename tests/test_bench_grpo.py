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
    assert our_systems("hf,vllm") == [("rlhf_lit", "grpo"), ("rlhf_lit[vllm]", "grpo-vllm")]


@pytest.mark.parametrize("bad", ["static", "hf,sglang", "vllm", ""])
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


def _record(case, phase, trl, ours, grad=0.0, differs=None, rescaled=None):
    from bench.grpo_first_step import TOL

    rec = dict(case=case, phase=phase, trl_loss=trl, ours_loss=ours, abs_diff=abs(trl - ours), grad_max_abs_diff=grad,
               differs=differs, token_ratio_range=[1.0, 1.0], seq_ratio_range=[1.0, 1.0], clipfrac=0.0)
    if rescaled is not None:
        rec["abs_diff_rescaled"] = rescaled
    rec["agrees"] = (rec["abs_diff"] <= TOL and grad <= TOL) if differs is None else None
    return rec


def test_grpo_loss_table_verdicts():
    from bench.grpo_first_step import PHASES, markdown

    records = []
    for case, kw in (
        ("same", dict(trl=-0.5, ours=-0.5 + 5e-8)),  # 5e-8 <= 1e-5 in every phase: pass
        ("loss off", dict(trl=-0.5, ours=-0.5 + 2e-5)),  # 2e-5 > 1e-5: FAIL
        ("grad off", dict(trl=-0.5, ours=-0.5, grad=3e-5)),  # equal losses, gradients 3e-5 apart: FAIL
        ("normaliser", dict(trl=-0.5, ours=-0.52, differs="why", rescaled=4e-8)),
        ("definition", dict(trl=-0.5, ours=-0.52, differs="why")),
    ):
        records += [_record(case, p, **kw) for p in PHASES]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in markdown({"details": {"records": records}}).splitlines()}
    assert rows["same"].endswith("| pass |")
    assert rows["loss off"].endswith("| FAIL |") and rows["grad off"].endswith("| FAIL |")
    assert rows["normaliser"].endswith("| differs (normaliser); rescaled diff <= 4.0e-08 |")
    assert rows["definition"].endswith("| differs (definition) |")
    # both losses are shown: TRL's, then ours
    assert "-0.50000000 / -0.52000000 | 2.0e-02" in rows["definition"]


def test_grpo_loss_cases_map_trl_options_to_ours():
    from bench.grpo_first_step import cases

    same = [c for c in cases() if c["differs"] is None]
    agg = {"grpo": "seq_mean_token_mean", "bnpo": "token_mean", "dr_grpo": "token_sum_norm"}
    assert {c["trl"]["loss_type"] for c in same} == set(agg)  # dapo and cispo differ by their normaliser
    for c in same:
        t, o = c["trl"], c["ours"]
        assert o["loss_aggregation"] == agg[t["loss_type"]]
        assert o["clip_range"] == t["epsilon"] and o["clip_range_high"] == t["epsilon_high"]
        assert o["kl_coef"] == t["beta"] and not t["use_bias_correction_kl"]
        assert o["dual_clip"] == t["delta"] and o["top_entropy_quantile"] == t["top_entropy_quantile"]


def test_tree_peak_rss_counts_every_descendant():
    """``bench.common.tree_peak_rss_mb`` (the vLLM server's processes in the GRPO race): a process and the child
    it started, which touched 64 MB, are both listed, each with its own peak."""
    import os
    import signal
    import subprocess
    import sys

    from bench.common import tree_peak_rss_mb

    grandchild = "import time; b = bytearray(64 * 2**20); print('ready', flush=True); time.sleep(60)"
    child = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {grandchild!r}], "
             "stdout=subprocess.PIPE, text=True); print(p.stdout.readline(), end='', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    peaks = {}
    try:
        assert proc.stdout.readline().strip() == "ready"
        peaks = tree_peak_rss_mb(proc.pid)
    finally:
        for key in list(peaks)[1:]:  # the grandchild
            os.kill(int(key.split()[0]), signal.SIGKILL)
        proc.kill()
        proc.wait()
    assert len(peaks) == 2, peaks
    parent, descendant = peaks
    assert parent.startswith(f"{proc.pid} ") and not descendant.startswith(f"{proc.pid} ")
    assert peaks[descendant] > 64 > peaks[parent], peaks
