"""PPO's outputs are callbacks the module attaches from its settings: the export and curves with
``export_dir``, the sample table with ``log_samples_every``, the monitor with ``monitor.enabled``; each is
switched off by its setting, and a user's own instance in ``trainer.callbacks`` is kept instead."""

from __future__ import annotations

import os

from rlhf_lit.callbacks import HFExport, PPOCurves, RewardHackingMonitor, RolloutSamples
from rlhf_lit.rl.settings import MonitorConfig
from tests.ppo.helpers import make_data, make_module, make_trainer


def _types(trainer, cls):
    return [c for c in trainer.callbacks if isinstance(c, cls)]


def test_export_dir_writes_the_export_and_the_curves(tmp_path):
    export = tmp_path / "hf"
    module = make_module(export_dir=str(export), log_samples_every=5)
    trainer = make_trainer(tmp_path)
    trainer.fit(module, datamodule=make_data(module))
    assert {"config.json", "rlhf_lit.json", "ppo_curves.png", "score_kl_frontier.png"} <= set(
        os.listdir(export)
    )
    assert len(_types(trainer, HFExport)) == len(_types(trainer, PPOCurves)) == 1
    assert _types(trainer, RolloutSamples)[0].every == 5


def test_each_output_switches_off_and_a_configured_one_wins(tmp_path):
    module = make_module(export_dir=None, log_samples_every=0, monitor=MonitorConfig(enabled=False))
    trainer = make_trainer(tmp_path)
    trainer.fit(module, datamodule=make_data(module))
    for cls in (HFExport, PPOCurves, RolloutSamples, RewardHackingMonitor):
        assert not _types(trainer, cls), cls
    assert not (tmp_path / "score_kl_frontier.png").exists()

    mine = RolloutSamples(every=0)
    module = make_module(log_samples_every=10)
    trainer = make_trainer(tmp_path / "mine", callbacks=[mine])
    trainer.fit(module, datamodule=make_data(module))
    assert _types(trainer, RolloutSamples) == [mine]


def test_the_monitor_writes_no_frontier_into_the_working_directory_without_an_output_folder(
    tmp_path, monkeypatch
):
    """No export_dir and no logger (a bench or a quick run): the frontier PNG goes nowhere, not into the
    current directory (trainer.default_root_dir's default)."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    module = make_module(export_dir=None, log_samples_every=0)
    trainer = make_trainer(tmp_path / "run", logger=False, default_root_dir=None)
    trainer.fit(module, datamodule=make_data(module))
    assert _types(trainer, RewardHackingMonitor)
    assert not os.listdir(work)
