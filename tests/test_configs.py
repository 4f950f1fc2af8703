"""Every YAML under ``configs/`` parses with the CLI; every ``tiny.yaml`` trains; ``--help`` shows docstrings.

Parsing alone checks every key against the signatures (LightningCLI rejects unknown keys) without
instantiating anything, so configs of big models are checked without loading, or downloading, a model.
A trainer preset (a YAML that names no model class, e.g. ``configs/trainer/cpu.yaml``; it may set model keys
such as ``backbone.load_in_4bit``) is stacked after ``configs/sft/tiny.yaml``, the way it is meant to be used.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from rlhf_lit.cli import RLHFCLI, cli_main
from rlhf_lit.errors import ConfigError
from tests.tiny_runs import CONFIGS_DIR, REPO_ROOT, in_repo_root, run_tiny, tiny_configs

ALL_CONFIGS = sorted(p.relative_to(REPO_ROOT) for p in CONFIGS_DIR.rglob("*.yaml"))
BASE_FOR_PRESETS = Path("configs/sft/tiny.yaml")


def _parse_only(monkeypatch, configs: list[Path]):
    """Build the CLI on ``configs`` (stacked in order): parse and check the values (``rlhf_lit.checks``),
    instantiate nothing. Model folders that earlier stages write (the demo's exports) need not exist, nor hub
    datasets be cached (the tests run offline)."""
    monkeypatch.setattr(RLHFCLI, "instantiate_classes", lambda self: None)
    monkeypatch.setattr("rlhf_lit.checks.paths._model_folder_problem", lambda *args, **kwargs: None)
    monkeypatch.setattr("rlhf_lit.checks.paths._hub_dataset_problem", lambda *args, **kwargs: None)
    args = [arg for config in configs for arg in ("--config", str(config))]
    with in_repo_root():
        return cli_main(args, run=False)


def test_there_are_configs_for_every_stage():
    stages = {p.parts[1] for p in ALL_CONFIGS}
    assert {"sft", "reward", "ppo"} <= stages
    assert {p.parts[1] for p in tiny_configs()} >= {"sft", "reward", "ppo"}


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=str)
def test_config_parses_with_valid_keys(config, monkeypatch):
    spec = yaml.safe_load((REPO_ROOT / config).read_text())
    assert isinstance(spec, dict) and spec, f"{config} is empty"
    # a preset (configs/trainer/*) names no model class; it may still set model keys, merged when stacked last
    is_stage = "class_path" in (spec.get("model") or {})
    stack = [config] if is_stage else [BASE_FOR_PRESETS, config]
    cli = _parse_only(monkeypatch, stack)
    model = cli.config["model"]
    assert model["class_path"].startswith("rlhf_lit.modules.")
    if is_stage:
        assert model["class_path"].endswith(spec["model"]["class_path"].rsplit(".", 1)[-1])
        assert cli.config["data"]["class_path"].startswith("rlhf_lit.data.")


@pytest.mark.parametrize(
    "path, key",
    [(("model", "init_args"), "label_smoothin"), (("model", "init_args", "backbone"), "n_layers")],
    ids=["module_arg", "backbone_field"],
)
def test_an_unknown_key_is_rejected(path, key, tmp_path, monkeypatch):
    """The parse check can fail: a misspelled key raises one error naming it (``rlhf-lit`` prints it, exit 2)."""
    spec = yaml.safe_load((REPO_ROOT / "configs/reward/tiny.yaml").read_text())
    section = spec
    for part in path:
        section = section[part]
    section[key] = 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=f"unknown key model.init_args.*{key}"):
        _parse_only(monkeypatch, [bad])


@pytest.mark.parametrize("config", tiny_configs(), ids=str)
def test_tiny_config_fits_on_cpu_with_outputs_in_tmp(config, tmp_path_factory):
    run = run_tiny(config, tmp_path_factory)
    trainer = run.cli.trainer
    assert trainer.state.finished and not trainer.interrupted
    spec = yaml.safe_load((REPO_ROOT / config).read_text())
    if "ppo" in spec["model"]["init_args"]:
        assert run.cli.model.iteration == 2  # each PPO iteration takes several optimizer steps
    else:
        assert trainer.global_step == 2
    assert run.log_dir.is_relative_to(run.root)
    assert trainer.default_root_dir == str(run.root)
    assert list(run.log_dir.glob("events.out.tfevents.*"))
    if "export_dir" in spec["model"]["init_args"]:
        assert (run.export_dir / "rlhf_lit.json").is_file()
        assert (run.export_dir / "tokenizer.json").is_file()


def test_ppo_max_config_turns_every_ppo_max_switch_on_and_runs(tmp_path_factory):
    """``configs/ppo/ppo_max.yaml`` (named by ``rlhf_lit/rl/settings.py``): every PPO-Max switch of
    Zheng et al. 2023 is on, and the config trains (2 iterations, with its PTX term) and exports."""
    run = run_tiny("configs/ppo/ppo_max.yaml", tmp_path_factory)
    h = run.cli.model.hparams
    assert h.reward["normalize"] and h.reward["clip"] is not None  # score normalisation and clipping
    assert h.kl["kl_coef"] > 0  # token-level KL penalty
    assert h.critic["init_from_reward"]  # critic from the reward model
    assert h.ppo["whiten_advantages"] and h.ppo["value_clip_range"] and h.ppo["max_grad_norm"]
    assert h.ptx["coef"] > 0 and h.ptx["train_files"]  # pretraining loss
    assert run.cli.trainer.state.finished and run.cli.model.iteration == 2
    assert all(entry["ppo/ptx_loss"] > 0 for entry in run.cli.model.history)
    assert (run.export_dir / "model.safetensors").is_file()


def _normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_fit_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit_info, in_repo_root():
        cli_main(["fit", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--config" in out and "--trainer.max_steps" in out and "--model" in out


def test_data_help_shows_the_shared_loader_arguments_in_each_data_module_s_words(capsys):
    """The loader arguments are documented once (``data.base.loader_args_doc``) and stay flat config keys."""
    for data_class, phrase in (
        ("rlhf_lit.data.SFTDataModule", "examples per training batch."),
        ("rlhf_lit.data.PreferenceDataModule", "pairs per training batch."),
        ("rlhf_lit.data.PromptDataModule", "prompts per training batch, i.e. per rollout (per rank)."),
    ):
        with pytest.raises(SystemExit), in_repo_root():
            cli_main(["fit", "--data.help", data_class])
        out = _normalized(capsys.readouterr().out)
        assert "--data.batch_size" in out and "--data.num_workers" in out and "--data.train_files" in out
        assert phrase in out and "DataLoader worker processes." in out


def test_model_help_shows_the_docstring_of_each_argument(capsys):
    with pytest.raises(SystemExit) as exit_info, in_repo_root():
        cli_main(["fit", "--model.help", "rlhf_lit.modules.RewardModule"])
    assert exit_info.value.code == 0
    out = _normalized(capsys.readouterr().out)
    # text from RewardModule's Args: section (needs the docstring-parser package)
    assert "--model.label_smoothing" in out
    assert "eps in the conservative smoothed loss; 0 disables it." in out
    assert "weight of mean((r_chosen + r_rejected)^2); 0 disables it." in out
    # and from the nested BackboneConfig dataclass
    assert "hold the base weights in 4-bit NF4" in out
