"""The ``configs/**/tiny.yaml`` runs, through the CLI, for a few steps, with every output in a tmp folder.

Several test modules assert facts about the same runs (the config test, the SFT and reward module tests,
the metric-name test), so each config runs at most once per pytest session (``run_tiny`` caches it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from tests.conftest import REPO_ROOT

CONFIGS_DIR = REPO_ROOT / "configs"
# Lightning's own scalars, not ours: the epoch counter, LearningRateMonitor's lr-*, the hparams placeholder.
LIGHTNING_SCALARS = ("epoch", "hp_metric")


def tiny_configs() -> list[Path]:
    """Every ``tiny.yaml`` under ``configs/``, relative to the repository root."""
    return sorted(p.relative_to(REPO_ROOT) for p in CONFIGS_DIR.rglob("tiny.yaml"))


@contextmanager
def in_repo_root() -> Iterator[None]:
    """Run with CWD = the repository root (configs name data as ``../shared/data/...``), argv cleared."""
    previous, argv = os.getcwd(), sys.argv
    os.chdir(REPO_ROOT)
    sys.argv = argv[:1]  # LightningCLI warns when it is given args and sees pytest's command line too
    try:
        yield
    finally:
        os.chdir(previous)
        sys.argv = argv


@contextmanager
def one_thread() -> Iterator[None]:
    """Train with one intra-op thread. On the shared 2-core machine, two OpenMP threads competing with
    other processes run a tiny model's step 10-20x slower than one thread (0.95 s vs 0.056 s measured)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def tiny_overrides(config: Path, root: Path) -> list[str]:
    """CLI arguments that send every output of ``config`` under ``root`` and cut the run to 2 steps.

    SFT and reward configs: 2 training batches then one validation batch (so val metrics are written).
    PPO configs: 2 iterations (each is several optimizer steps).
    """
    spec = yaml.safe_load((REPO_ROOT / config).read_text())
    trainer = spec.get("trainer") or {}
    init_args = (spec.get("model") or {}).get("init_args") or {}
    args = [f"--trainer.default_root_dir={root}"]
    logger = trainer.get("logger")
    if isinstance(logger, dict) and "save_dir" in (logger.get("init_args") or {}):
        args.append(f"--trainer.logger.init_args.save_dir={root}")
    if "export_dir" in init_args:
        args.append(f"--model.init_args.export_dir={root / 'hf'}")
    if "ppo" in init_args:
        args.append("--model.init_args.ppo.total_iterations=2")
    else:
        args += [
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
            "--trainer.log_every_n_steps=1",
        ]
    return args


@dataclass
class TinyRun:
    """A finished ``fit`` of one tiny config: the CLI object and where it wrote."""

    config: Path
    root: Path
    cli: object
    export_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.export_dir = self.root / "hf"

    @property
    def log_dir(self) -> Path:
        return Path(self.cli.trainer.logger.log_dir)

    def scalars(self) -> dict[str, list[tuple[int, float]]]:
        return read_scalars(self.log_dir)


_RUNS: dict[str, TinyRun] = {}


def run_tiny(config: str | Path, tmp_path_factory) -> TinyRun:
    """``rlhf-lit fit --config <config>`` with ``tiny_overrides``, once per session."""
    from rlhf_lit.cli import cli_main

    key = str(config)
    if key not in _RUNS:
        root = tmp_path_factory.mktemp(Path(config).parent.name + "_tiny")
        with in_repo_root(), one_thread():
            cli = cli_main(["fit", "--config", key, *tiny_overrides(Path(config), root)])
        _RUNS[key] = TinyRun(Path(config), root, cli)
    return _RUNS[key]


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TensorBoard event files in ``log_dir``: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(Path(log_dir).glob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file in {log_dir}"
    out: dict[str, list[tuple[int, float]]] = {}
    for path in files:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def is_lightning_scalar(name: str) -> bool:
    return name in LIGHTNING_SCALARS or name.startswith("lr-")
