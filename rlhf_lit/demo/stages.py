"""The demo's stages: ``configs/demo/{sft,reward,ppo,dpo}.yaml`` run as ordinary ``rlhf-lit fit`` commands,
with every output under one folder, an optional other seed, and the deliberately over-optimised PPO run.

Two methods (``METHOD_STAGES``): ``ppo`` (SFT -> reward model -> PPO, the default) and ``dpo`` (SFT -> DPO on
the same kind of preference pairs the reward model trains on; no reward model, no RL)."""

from __future__ import annotations

import logging
import os
import re
import time

log = logging.getLogger("rlhf_lit")

__all__ = [
    "DEFAULT_OUT",
    "FAST_OVERRIDES",
    "METHODS",
    "METHOD_OUT",
    "METHOD_STAGES",
    "METHOD_TITLES",
    "OVEROPTIMIZED",
    "OVEROPTIMIZED_FAST_OVERRIDES",
    "OVEROPTIMIZED_OVERRIDES",
    "STAGES",
    "config_path",
    "run_stages",
    "stage_args",
]

DEFAULT_OUT = "checkpoints/demo"  # where configs/demo/*.yaml write
STAGES = ("sft", "reward", "ppo")  # the default method's stages (PPO)
# the stages of each method, in order; the last one trains the policy the report compares with SFT's
METHOD_STAGES = {"ppo": STAGES, "dpo": ("sft", "dpo")}
METHODS = tuple(METHOD_STAGES)
METHOD_TITLES = {"ppo": "SFT -> reward model -> PPO", "dpo": "SFT -> DPO"}
# where ``rlhf-lit demo --method <m>`` writes by default: apart, so one method's report never replaces the other's
METHOD_OUT = {"ppo": DEFAULT_OUT, "dpo": "checkpoints/demo_dpo"}


def config_path(name: str) -> str:
    """The config of a demo stage: ``configs/demo/<name>.yaml`` (relative to the repository root)."""
    return os.path.join("configs", "demo", f"{name}.yaml")


# The CI test's shortened pipeline: fewer SFT epochs, PPO iterations and DPO epochs, the same data and models.
FAST_OVERRIDES = {
    "sft": ["--trainer.max_epochs=6"],
    "reward": [],
    "ppo": ["--model.init_args.ppo.total_iterations=20"],
    "dpo": [],
}


def _reseeded_data_args(stage: str, seed: int) -> list[str]:
    """``--data`` overrides that give the stage config's ``demo:...`` data specs another ``seed=``."""
    from rlhf_lit.lightning_cli import parse_config

    data = parse_config([config_path(stage)])["data"]["init_args"]  # the config as fit reads it
    args = []
    for key in ("train_files", "val_files"):
        if data.get(key):
            specs = [re.sub(r"seed=\d+", f"seed={seed}", spec) for spec in data[key]]
            args.append(f"--data.init_args.{key}=[{','.join(specs)}]")
    return args


# The deliberately over-optimised run: the demo's PPO config without its KL penalty and at the learning rate
# the demo reward-hacked at before (1e-3), for 40 iterations in the shortened pipeline. The reward-hacking
# monitor (RewardHackingMonitor) should flag it; the report shows what it did to the gold score.
OVEROPTIMIZED = "ppo_no_kl"
OVEROPTIMIZED_OVERRIDES = [
    "--model.init_args.kl.kl_coef=0",
    "--model.init_args.kl.adaptive=false",
    "--model.init_args.optimizer.lr=1e-3",
]
OVEROPTIMIZED_FAST_OVERRIDES = ["--model.init_args.ppo.total_iterations=40"]


def stage_args(
    stage: str, out: str = DEFAULT_OUT, fast: bool = False, seed: int = 0, folder: str | None = None
) -> list[str]:
    """The ``rlhf-lit fit`` arguments of a demo stage, with every output under ``out/<folder>``.

    ``stage`` names the config (``configs/demo/<stage>.yaml``); ``folder`` (default: ``stage``) the output
    folder. ``seed`` != 0 changes everything random in the stage: ``seed_everything`` (initialisation,
    sampling, shuffles) and the seed of the generated data (other words, other demonstrations, other label
    noise).
    """
    folder = folder or stage
    args = ["fit", "--config", config_path(stage)]
    if seed != 0:
        args += [f"--seed_everything={seed}", *_reseeded_data_args(stage, seed)]
    if out != DEFAULT_OUT or folder != stage:
        root = os.path.join(out, folder)
        args += [
            f"--trainer.default_root_dir={root}",
            f"--trainer.logger.init_args.save_dir={root}",
            f"--model.init_args.export_dir={root}/hf",
        ]
        if stage != "sft":  # every later stage starts from the SFT export
            args.append(f"--model.init_args.backbone.name_or_path={out}/sft/hf")
        if stage == "ppo":
            args.append(f"--model.init_args.reward_model.path={out}/reward/hf")
    args += FAST_OVERRIDES[stage] if fast else []
    if folder == OVEROPTIMIZED:
        args += OVEROPTIMIZED_OVERRIDES + (OVEROPTIMIZED_FAST_OVERRIDES if fast else [])
    return args


def run_stages(
    out: str = DEFAULT_OUT,
    fast: bool = False,
    stages=STAGES,
    seed: int = 0,
    extra: dict | None = None,
    overoptimized: bool = False,
) -> dict[str, float]:
    """Run the demo stages in order, each as ``rlhf-lit fit --config configs/demo/<stage>.yaml``.

    Args:
        out: output folder (``<out>/<stage>/``).
        fast: the shortened stages of the CI test (``FAST_OVERRIDES``).
        stages: which stages to run.
        seed: the demo seed (see ``stage_args``).
        extra: more ``rlhf-lit fit`` arguments per stage name, e.g. ``{"ppo": ["--model.init_args..."]}``.
        overoptimized: also run PPO without its KL penalty into ``<out>/ppo_no_kl`` (``OVEROPTIMIZED``).

    Returns:
        Wall seconds per run.
    """
    from rlhf_lit.lightning_cli import cli_main

    runs = [(stage, stage) for stage in stages]
    if overoptimized:
        runs.append(("ppo", OVEROPTIMIZED))
    seconds = {}
    for stage, folder in runs:
        t0 = time.perf_counter()
        log.info("demo: %s (%s), seed %d", folder, config_path(stage), seed)
        # --overwrite: the demo rebuilds its outputs on every run (each export is still replaced whole)
        cli_main(
            stage_args(stage, out, fast, seed, folder) + list((extra or {}).get(stage, [])) + ["--overwrite"]
        )
        seconds[folder] = time.perf_counter() - t0
    return seconds
