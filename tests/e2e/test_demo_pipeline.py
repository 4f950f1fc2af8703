"""The embedded default, shortened: SFT -> reward model -> PPO on the echo task, and the gold score rises."""

from __future__ import annotations

import json

import pytest

from rlhf_lit.demo import run_stages, write_report


@pytest.mark.e2e
@pytest.mark.slow
def test_shortened_demo_pipeline_improves_the_gold_score(tmp_path, repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)  # the configs are relative to the repository root
    out = str(tmp_path / "demo")
    run_stages(out, fast=True)
    summary = write_report(out, n_prompts=256)
    assert json.load(open(f"{out}/report.json"))["gold_gain"] == summary["gold_gain"]
    for name in ("report.md", "frontier.png", "reliability.png"):
        assert (tmp_path / "demo" / name).exists(), name
    sft_gold, sft_se = summary["sft"]["gold"]
    ppo_gold, ppo_se = summary["ppo"]["gold"]
    # The PPO policy beats the SFT policy on held-out prompts, by more than 3 standard errors,
    # and stays inside its KL budget.
    assert ppo_gold > sft_gold
    assert summary["gold_gain_in_se"] > 3, summary
    assert summary["kl_under_target"], summary
    # The reward model learned the preference: better than chance against the gold scorer.
    assert summary["reward_model"]["accuracy_gold"] > 0.6
