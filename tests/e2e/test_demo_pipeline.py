"""The embedded default, shortened, on two seeds: SFT -> reward model -> PPO on the echo task.

What the method guarantees, not one CPU's trajectory: on every seed PPO beats the SFT policy on held-out
prompts by more than 3 standard errors of the difference, within its KL budget, and never raises the RM
score while the gold score falls (the reward-hacking guard). The same PPO config without its KL penalty is
run on one seed, and the reward-hacking monitor must flag it, in the log and in TensorBoard.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from rlhf_lit.demo import OVEROPTIMIZED, run_stages, write_report
from rlhf_lit.metrics import MONITOR_OVEROPTIMIZATION
from tests.conftest import REPO_ROOT
from tests.tiny_runs import one_thread, read_scalars

SEEDS = (0, 1)
# The shared fixture runs the whole shortened pipeline twice (~4 min on an idle 2-core machine); it is
# charged to the first test, so that test may take longer than the suite's default per-test timeout.
pytestmark = pytest.mark.timeout(3600)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    previous = os.getcwd()
    os.chdir(REPO_ROOT)  # the configs are relative to the repository root
    records = _Records()
    logging.getLogger("rlhf_lit").addHandler(records)
    try:
        runs = {}
        with one_thread():  # tiny models: one thread is faster, and immune to a busy second core
            for seed in SEEDS:
                out = str(tmp_path_factory.mktemp(f"demo_seed{seed}"))
                run_stages(out, fast=True, seed=seed, overoptimized=seed == SEEDS[0])
                runs[seed] = (out, write_report(out, n_prompts=256, seed=seed))
    finally:
        logging.getLogger("rlhf_lit").removeHandler(records)
        os.chdir(previous)
    return runs, records.messages


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_shortened_demo_improves_the_gold_score_on_every_seed(seed, demo_runs):
    runs, _ = demo_runs
    out, summary = runs[seed]
    assert json.load(open(f"{out}/report.json"))["gold_gain"] == summary["gold_gain"]
    for name in ("report.md", "frontier.png", "reliability.png"):
        assert (Path(out) / name).exists(), name
    # PPO beats SFT on held-out prompts by more than 3 standard errors, inside its KL budget
    assert summary["ppo"]["gold"][0] > summary["sft"]["gold"][0]
    assert summary["gold_gain_in_se"] > 3, summary
    assert summary["kl_under_target"], summary
    # the reward-hacking guard: the RM score must not rise while the gold score falls
    assert not (summary["ppo"]["rm_change"] > 0 and summary["ppo"]["gold_change"] < 0), summary
    assert summary["reward_hacking"] is False
    # the reward model learned the preference: better than chance against the gold scorer
    assert summary["reward_model"]["accuracy_gold"] > 0.6


@pytest.mark.e2e
@pytest.mark.slow
def test_the_monitor_flags_ppo_without_its_kl_penalty(demo_runs):
    runs, messages = demo_runs
    out, summary = runs[SEEDS[0]]
    flagged = summary[OVEROPTIMIZED]["monitor_flagged_iterations"]
    assert flagged, summary[OVEROPTIMIZED]
    # in the log: the one-line warning when the flag goes up
    assert any("possible reward over-optimisation" in m for m in messages), messages
    # in TensorBoard: monitor/overoptimization is 1 at the flagged iterations, 0 before them
    scalars = read_scalars(next(Path(out, OVEROPTIMIZED, "tb").glob("version_*")))
    series = dict(scalars[MONITOR_OVEROPTIMIZATION])
    assert {step for step, value in series.items() if value == 1.0} == set(flagged)
