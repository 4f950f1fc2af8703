"""``experiments/constraint_proof.py`` (the real-prompt proof of GRPO / PPO with a verifiable constraint): its
pieces by hand, and its whole wiring (prompt files, one fit, before / after evaluation, report) on a tiny
model in seconds."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest

from tests.conftest import REPO_ROOT

SCRIPTS = REPO_ROOT / "experiments"


def _load(name: str):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def proof():
    return _load("constraint_proof")


@pytest.fixture(scope="module")
def ev():
    return _load("constraint_eval")


def test_rows_carry_the_limit_in_the_prompt_and_in_the_constraints_field(proof):
    rows = proof.constraint_rows(["Why is the sky blue?", "Name a prime.", "Hi"], [10, 20])
    assert [r["constraints"] for r in rows] == [{"max_words": 10}, {"max_words": 20}, {"max_words": 10}]
    assert rows[1]["prompt"] == "Name a prime.\n\nAnswer in at most 20 words."
    train, heldout = proof.split_rows(rows * 4, 5, seed=0)
    assert len(train) == 7 and len(heldout) == 5
    assert proof.split_rows(rows * 4, 5, seed=0) == (train, heldout)  # seeded
    with pytest.raises(ValueError, match="--heldout"):
        proof.split_rows(rows, 3, seed=0)


def test_a_response_passes_only_when_it_ended_within_the_word_limit(ev):
    assert ev.passes("one two three", True, 3)
    assert not ev.passes("one two three four", True, 3)
    assert not ev.passes("one two", False, 3)  # cut at max_new_tokens: no answer within the limit
    assert ev.passes("", True, 3)


def test_summary_compares_against_three_standard_errors_and_the_kl_budget(ev, tmp_path):
    config = {"model": {"init_args": {"ppo": {"advantage_estimator": "grpo"}, "kl": {"target_kl": 1.0}}}}
    before = dict(pass_rate=0.5, pass_rate_se=0.03, per_prompt_pass=[0.5, 0.5])
    after = dict(pass_rate=0.7, pass_rate_se=0.04, kl=1.5, per_prompt_pass=[1.0, 0.5])
    s = ev.run_summary(config, tmp_path, 60.0, before, after)
    assert s["rise"] == pytest.approx(0.2) and s["rise_se"] == pytest.approx(0.05)
    assert s["rise_in_se"] == pytest.approx(4.0) and s["rise_above_3se"]
    assert s["kl_under_budget"] is False and s["fit_minutes"] == 1.0
    assert s["paired_rise_se"] == pytest.approx(math.sqrt(0.125 / 2))  # diffs [0.5, 0]


def test_the_whole_proof_runs_on_a_tiny_model(proof, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(f"Question number {i}?") + "\n" for i in range(6)))
    out = tmp_path / "proof"
    report = proof.main(
        [
            "--out",
            str(out),
            "--prompts",
            str(prompts),
            "--runs",
            "grpo",
            "--heldout",
            "2",
            "--samples",
            "1",
            "--eval-batch",
            "2",
            "--config",
            f"grpo={REPO_ROOT / 'configs/ppo/tiny_grpo.yaml'}",
            "--set",
            "model.init_args.ppo.total_iterations=1",
            "--set",
            "model.init_args.sampling.max_new_tokens=8",
        ]
    )
    assert [len(open(out / "prompts" / f).readlines()) for f in ("train.jsonl", "heldout.jsonl")] == [4, 2]
    assert report["before"]["kl"] == 0.0 and report["before"]["n"] == 2
    run = report["runs"]["grpo"]
    assert run["estimator"] == "grpo" and run["after"]["n"] == 2
    assert 0.0 <= run["after"]["pass_rate"] <= 1.0 and math.isfinite(run["after"]["kl"])
    assert len(run["history"]) == 1  # one iteration, read back from the CSV log
    assert (out / "grpo" / "hf" / "adapter" / "adapter_config.json").is_file()
    assert json.loads((out / "report.json").read_text())["runs"]["grpo"]["rise"] == pytest.approx(run["rise"])
    assert (out / "curves.png").stat().st_size > 0 and "| grpo |" in (out / "report.md").read_text()
