"""The embedded default: SFT -> reward model -> PPO (or SFT -> DPO) on the echo task, offline, then a report.

``rlhf-lit demo`` runs ``configs/demo/{sft,reward,ppo}.yaml`` as ordinary ``rlhf-lit fit`` stages (each also
runs on its own) and then evaluates, on held-out prompts that no stage trained on:

* the SFT policy and the PPO policy: gold score and reward-model score (mean +- standard error), KL to the
  reference (the SFT policy), and a few sample responses;
* the reward model: accuracy against the noisy labels and against the gold scorer, ECE before and after
  temperature scaling, the reliability diagram;
* the PPO run: gold and RM score of each iteration's samples against their KL (the over-optimisation
  frontier of Gao et al. 2022).

``rlhf-lit demo --method dpo`` runs ``configs/demo/{sft,dpo}.yaml`` instead (DPO on the same kind of preference
pairs the reward model trains on; no reward model, no PPO, no over-optimised run) and reports the DPO policy
against the SFT policy the same way: gold score, KL to the SFT policy, the gain in standard errors, with
responses sampled as PPO's are and PPO's KL budget.

The gold scorer (``rlhf_lit.data.demo_task.gold_score``) is used here, for evaluation, and by
``GoldScoreCallback`` (which only logs); never by the reward model, PPO or DPO.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from rlhf_lit.demo.stages import (
    DEFAULT_OUT,
    FAST_OVERRIDES,
    METHOD_OUT,
    METHOD_STAGES,
    METHODS,
    OVEROPTIMIZED,
    OVEROPTIMIZED_FAST_OVERRIDES,
    OVEROPTIMIZED_OVERRIDES,
    STAGES,
    run_stages,
    stage_args,
)
from rlhf_lit.errors import ConfigError

log = logging.getLogger("rlhf_lit")

# imported on first use (PEP 562): ``rlhf-lit demo --help`` and its argument errors load no Lightning or model
_LAZY = {
    "GoldScoreCallback": "rlhf_lit.callbacks.gold_score",
    "PolicyEval": "rlhf_lit.demo.evaluate",
    "evaluate_policy": "rlhf_lit.demo.evaluate",
    "reward_model_accuracy": "rlhf_lit.demo.evaluate",
    "seeds_summary": "rlhf_lit.demo.report",
    "write_report": "rlhf_lit.demo.report",
    "write_seeds_report": "rlhf_lit.demo.report",
}

__all__ = [
    "DEFAULT_OUT",
    "FAST_OVERRIDES",
    "METHODS",
    "METHOD_STAGES",
    "OVEROPTIMIZED",
    "OVEROPTIMIZED_FAST_OVERRIDES",
    "OVEROPTIMIZED_OVERRIDES",
    "STAGES",
    "GoldScoreCallback",
    "PolicyEval",
    "evaluate_policy",
    "main",
    "reward_model_accuracy",
    "run_stages",
    "seeds_summary",
    "stage_args",
    "write_report",
    "write_seeds_report",
]


def main(args: list[str]) -> None:
    """``rlhf-lit demo [--method ppo|dpo] [--fast] [--seeds 0,1,2] [--report-only] [--no-overoptimized]
    [--out DIR]``."""
    import argparse

    class _Parser(argparse.ArgumentParser):
        # a usage mistake is one line and exit 2 through rlhf_lit.cli.main, not argparse's usage block
        def error(self, message: str):
            raise ConfigError(f"demo: {message} (rlhf-lit demo --help)")

    parser = _Parser(prog="rlhf-lit demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="ppo",
        help="ppo: SFT -> reward model -> PPO (default); dpo: SFT -> DPO on the same kind of preference pairs "
        "(configs/demo/dpo.yaml), reported against SFT on the same held-out prompts and gold scorer",
    )
    parser.add_argument("--fast", action="store_true", help="shortened stages (the CI test uses this)")
    parser.add_argument(
        "--seeds",
        default="0",
        help="comma-separated demo seeds, e.g. 0,1,2: the pipeline runs once per seed (into <out>/seed_<k> "
        "when there are several) and seeds.md reports each figure's mean and spread across seeds",
    )
    parser.add_argument("--report-only", action="store_true", help="only evaluate the existing exports")
    parser.add_argument(
        "--no-overoptimized",
        action="store_true",
        help="skip the deliberately over-optimised PPO run (kl_coef 0) that shows the reward-hacking monitor "
        "(--method ppo only)",
    )
    parser.add_argument(
        "--out",
        help="output folder of the stages and the report (default: "
        + ", ".join(f"{folder} for --method {m}" for m, folder in METHOD_OUT.items())
        + ")",
    )
    ns = parser.parse_args(args)
    try:
        seeds = [int(k) for k in ns.seeds.split(",") if k.strip()]
    except ValueError:
        parser.error(f"--seeds: expected comma-separated integers, got {ns.seeds!r}")
    if not seeds:
        parser.error("--seeds: give at least one seed")
    from rlhf_lit.demo.report import write_report, write_seeds_report

    summaries = []
    root = ns.out or METHOD_OUT[ns.method]
    for seed in seeds:
        out = root if len(seeds) == 1 else os.path.join(root, f"seed_{seed}")
        seconds = None
        if not ns.report_only:
            seconds = run_stages(
                out,
                fast=ns.fast,
                stages=METHOD_STAGES[ns.method],
                seed=seed,
                overoptimized=ns.method == "ppo" and not ns.no_overoptimized,
            )
        summary = write_report(out, seed=seed, stage_seconds=seconds, method=ns.method)
        summaries.append(summary)
        print(open(os.path.join(out, "report.md")).read())
        print(f"report: {os.path.join(out, 'report.md')}")
        if summary["gold_gain_in_se"] <= 3 or not summary["kl_under_target"]:
            log.warning(
                "seed %d: the %s policy did not beat the SFT policy by > 3 standard errors within the KL budget",
                seed,
                ns.method.upper(),
            )
    if len(seeds) > 1:
        write_seeds_report(root, summaries)
        print(open(os.path.join(root, "seeds.md")).read())
        print(f"across seeds: {os.path.join(root, 'seeds.md')}")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
