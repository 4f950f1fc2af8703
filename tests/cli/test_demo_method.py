"""``rlhf-lit demo --method {ppo,dpo}``: which stages each method runs, how the DPO stage is wired to the SFT
export, and how DPO reports are summarised across seeds (no run; the e2e tests run the pipelines)."""

from __future__ import annotations

import pytest

from rlhf_lit.demo.report import seeds_summary
from rlhf_lit.demo.stages import DEFAULT_OUT, METHOD_OUT, METHOD_STAGES, STAGES, stage_args
from tests.cli.helpers import run_cli
from tests.tiny_runs import in_repo_root


def test_each_method_runs_sft_first_and_ppo_keeps_its_stages():
    assert METHOD_STAGES["ppo"] == STAGES == ("sft", "reward", "ppo")
    assert METHOD_STAGES["dpo"] == ("sft", "dpo")
    # by default each method writes its own folder, so one report never replaces the other's
    assert METHOD_OUT == {"ppo": DEFAULT_OUT, "dpo": "checkpoints/demo_dpo"}


def test_the_dpo_stage_starts_from_the_sft_export_and_reseeds_its_pairs():
    with in_repo_root():
        args = stage_args("dpo", out="/runs/x", seed=3)
    assert args[:3] == ["fit", "--config", "configs/demo/dpo.yaml"]
    assert "--model.init_args.backbone.name_or_path=/runs/x/sft/hf" in args
    assert "--model.init_args.export_dir=/runs/x/dpo/hf" in args
    assert "--seed_everything=3" in args
    data = [a for a in args if a.startswith("--data.init_args.train_files=")]
    assert data == ["--data.init_args.train_files=[demo:preference?n=4000&seed=3&split=train]"], args
    assert not any("reward_model" in a for a in args)  # DPO has no reward model


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--method", "grpo"], "rlhf-lit: error: demo: argument --method: invalid choice: 'grpo'"),
        (["--seeds", "0,x"], "rlhf-lit: error: demo: --seeds: expected comma-separated integers, got '0,x'"),
        (["--bogus"], "rlhf-lit: error: demo: unrecognized arguments: --bogus"),
    ],
)
def test_a_demo_usage_mistake_is_one_error_line_through_the_console_script(args, expected):
    """Not argparse's usage block and its own ``rlhf-lit demo: error:`` line: the one line every subcommand
    prints for a user mistake, exit 2, before anything runs."""
    done = run_cli("demo", *args, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), done.stderr
    assert lines[0].endswith("(rlhf-lit demo --help)")


def _dpo_summary(seed: int, sft_gold: float, dpo_gold: float, gain_in_se: float, kl: float) -> dict:
    return {
        "method": "dpo",
        "seed": seed,
        "sft": {"gold": [sft_gold, 0.03], "kl": [0.0, 0.0]},
        "dpo": {"gold": [dpo_gold, 0.03], "kl": [kl, 0.1], "gold_change": dpo_gold - sft_gold},
        "gold_gain": dpo_gold - sft_gold,
        "gold_gain_in_se": gain_in_se,
        "kl_under_target": kl < 4.0,
        "reward_hacking": None,
    }


def test_dpo_seeds_summary_names_dpo_and_leaves_out_reward_model_figures():
    summary = seeds_summary([_dpo_summary(0, 0.5, 0.7, 4.0, 1.0), _dpo_summary(1, 0.6, 0.7, 2.0, 1.0)])
    assert summary["method"] == "dpo"
    # gains 0.2 and 0.1: mean 0.15, sample SD sqrt(((0.05)^2 + (0.05)^2) / 1) = 0.0707
    gain = summary["figures"]["gold gain (DPO - SFT)"]
    assert gain["mean"] == pytest.approx(0.15) and gain["std"] == pytest.approx(0.0707107, abs=1e-6)
    assert "DPO gold score" in summary["figures"] and "PPO gold score" not in summary["figures"]
    assert not any("RM" in label for label in summary["figures"])
    assert summary["every_seed_gains_over_3_se_within_kl_budget"] is False  # seed 1: 2.0 SE
    assert summary["any_reward_hacking"] is None  # no reward model to hack


def test_seeds_of_different_methods_are_not_summarised_together():
    ppo = {**_dpo_summary(1, 0.5, 0.7, 4.0, 1.0), "method": "ppo"}
    with pytest.raises(ValueError, match="different methods"):
        seeds_summary([_dpo_summary(0, 0.5, 0.7, 4.0, 1.0), ppo])
