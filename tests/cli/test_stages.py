"""The stage table (``rlhf_lit.stages``): a stage registered from this file alone is seen by every reader -- the
progress bar, the planner, the "which stage writes this folder" hint, the data pairing and range checks -- and
a class that is no stage is an error in the planner, never silently SFT. Also the range notation
(``rlhf_lit.ranges``) shared by the dataclasses and the checks."""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
import pytest

from rlhf_lit.callbacks.progress import _label
from rlhf_lit.checks import check_config, model_ranges
from rlhf_lit.errors import ConfigError
from rlhf_lit.planner.settings import _stage as planner_phase
from rlhf_lit.ranges import Range, check_field_ranges, parse_range, ranged
from rlhf_lit.stage_outputs import stage_of
from rlhf_lit.stages import (
    STAGES,
    StageSpec,
    find_stage,
    find_stage_by_path,
    public_path,
    register_stage,
    stage_for,
)

HERE = __name__  # "tests.cli.test_stages": the import path of the classes below


@dataclass
class ToySettings:
    """A settings dataclass with declared ranges (what a new stage's module takes)."""

    strength: float = ranged(0.5, "(0, 1]")
    rounds: int = ranged(2, "int >= 1")


class ToyModule(L.LightningModule):
    """A throwaway stage module: it is a stage only through the descriptor the tests register."""

    def __init__(self, toy: ToySettings | None = None) -> None:
        super().__init__()
        self.toy = toy or ToySettings()


class MyToyModule(ToyModule):
    """A user's subclass of the stage module."""


@pytest.fixture
def toy_stage():
    """Register the toy stage (pairs with the preference data module) and remove it afterwards."""
    spec = register_stage(
        StageSpec(
            name="toy",
            title="Toy",
            module=f"{HERE}.ToyModule",
            data="rlhf_lit.data.preference.PreferenceDataModule",
            planner_phase=None,
            export_kind="policy",
        )
    )
    try:
        yield spec
    finally:
        STAGES.pop("toy")


def _config(model_class: str, data_class: str = "rlhf_lit.data.SFTDataModule", **init) -> dict:
    return {
        "model": {"class_path": model_class, "init_args": dict(init)},
        "data": {"class_path": data_class, "init_args": {"train_files": ["rows.jsonl"]}},
        "trainer": {},
    }


def test_a_registered_stage_is_seen_by_every_reader(toy_stage):
    assert find_stage(ToyModule) is toy_stage and find_stage(MyToyModule) is toy_stage  # by class or subclass
    assert find_stage_by_path(f"{HERE}.MyToyModule") is toy_stage
    assert _label(MyToyModule()) == "toy"  # the progress bar: "[toy] epoch 0"
    assert stage_of({"model": {"class_path": f"{HERE}.MyToyModule"}}) == "Toy"  # "written by the Toy stage"
    with pytest.raises(
        ConfigError, match=r"^plan: the planner does not support the Toy stage \(MyToyModule\)"
    ):
        planner_phase(f"{HERE}.MyToyModule")
    # the data pairing: the toy stage trains on preference data, so SFT data is refused before loading
    with pytest.raises(ConfigError) as info:
        check_config(_config(f"{HERE}.MyToyModule"))
    assert str(info.value) == (
        "data.class_path: MyToyModule trains on PreferenceDataModule data (the Toy stage), but the config gives "
        "SFTDataModule; use rlhf_lit.data.PreferenceDataModule"  # the path configs write, not .preference's
    )
    # the ranges its settings dataclass declares are checked, with the key as the user writes it
    assert set(model_ranges(MyToyModule, toy_stage)) == {"toy.strength", "toy.rounds"}
    config = _config(f"{HERE}.MyToyModule", "rlhf_lit.data.PreferenceDataModule", toy={"strength": 0.0})
    with pytest.raises(
        ConfigError, match=r"^model\.init_args\.toy\.strength must be a number in \(0, 1\], got 0\.0"
    ):
        check_config(config)


def test_public_path_is_the_package_export_configs_write():
    assert public_path("rlhf_lit.data.sft.SFTDataModule") == "rlhf_lit.data.SFTDataModule"
    assert public_path("rlhf_lit.modules.dpo.DPOModule") == "rlhf_lit.modules.DPOModule"
    assert public_path(f"{HERE}.ToyModule") == f"{HERE}.ToyModule"  # tests.cli exports no ToyModule
    assert public_path("no_such_package.Thing") == "no_such_package.Thing"


def test_a_stage_with_a_planner_phase_is_planned_as_that_phase(toy_stage):
    register_stage(StageSpec(**{**toy_stage.__dict__, "planner_phase": "reward"}))
    assert planner_phase(f"{HERE}.MyToyModule") == "reward"


def test_the_package_stages_and_an_unknown_class():
    assert [s.name for s in STAGES.values()][:3] == ["sft", "reward", "ppo"]
    assert planner_phase("rlhf_lit.modules.PPOModule") == "ppo"  # the re-exported spelling, no import needed
    assert find_stage_by_path("rlhf_lit.modules.reward.RewardModule").export_kind == "reward_model"
    assert find_stage(ToyModule) is None  # not registered here
    with pytest.raises(ConfigError) as info:
        planner_phase(f"{HERE}.ToyModule")  # never silently SFT
    assert str(info.value).startswith(f"model.class_path: {HERE}.ToyModule is not an rlhf_lit stage module")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="is not an rlhf_lit stage module"):
        stage_for(L.LightningModule)


def test_two_stages_cannot_claim_one_module():
    with pytest.raises(ValueError, match="stage 'sft' already uses"):
        register_stage(StageSpec(name="sft2", title="x", module=STAGES["sft"].module, data="x.Y"))
    assert "sft2" not in STAGES


def test_importing_the_table_imports_no_stage_module():
    import subprocess
    import sys

    code = "import sys, rlhf_lit.stages; print(sorted(m for m in sys.modules if m.startswith(('rlhf_lit.modules', 'torch', 'lightning'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.parametrize(
    "text, expected",
    [
        ("(0, 1]", Range(low=0, high=1, low_open=True)),
        ("[0, 0.5)", Range(low=0, high=0.5, high_open=True)),
        ("> 0 or null", Range(low=0, low_open=True, optional=True)),
        ("int >= 1 or -1", Range(low=1, integer=True, also=(-1,))),
        ("<= 2", Range(high=2)),
        ("any", Range()),
    ],
)
def test_range_notation(text, expected):
    assert parse_range(text) == expected


def test_range_notation_refuses_a_typo():
    with pytest.raises(ValueError, match="not a range"):
        parse_range("between 0 and 1")


def test_field_ranges_refuse_a_value_built_in_python():
    check_field_ranges(ToySettings())  # the defaults are inside
    with pytest.raises(ConfigError, match=r"^toy\.rounds must be a whole number >= 1, got 0$"):
        check_field_ranges(ToySettings(rounds=0), prefix="toy.")
    with pytest.raises(ConfigError, match=r"strength must be a finite number in \(0, 1\], got nan"):
        check_field_ranges(ToySettings(strength=float("nan")))


@pytest.mark.parametrize(
    ("cls_name", "key", "bad", "expected"),
    [
        ("PPOConfig", "ppo.gamma", 0.0, "a number in (0, 1]"),
        ("PPOConfig", "ppo.ppo_epochs", 0, "a whole number >= 1"),
        ("PPOConfig", "ppo.dual_clip", 1.0, "a number > 1 (or null)"),
        ("KLConfig", "kl.kl_coef", -0.1, "a number >= 0"),
        ("RewardShapingConfig", "reward.clip", 0.0, "a number > 0 (or null)"),
        ("CriticConfig", "critic.lr", 0.0, "a number > 0 (or null)"),
        ("PTXConfig", "ptx.max_length", 1, "a whole number >= 2"),
        ("MonitorConfig", "monitor.window", 2, "a whole number >= 3"),
    ],
)
def test_ppo_settings_declare_their_ranges_once_for_python_and_the_cli(cls_name, key, bad, expected):
    """The PPO settings' ranges live on their dataclasses: building one in Python and the CLI's check of a
    parsed config give the same message (the CLI finds the range through PPOModule's ``__init__``)."""
    from rlhf_lit.modules.ppo import PPOModule
    from rlhf_lit.rl import settings as ppo_config

    field = key.split(".", 1)[1]
    message = f"{key} must be {expected}, got {bad!r}"
    with pytest.raises(ConfigError) as built:
        getattr(ppo_config, cls_name)(**{field: bad})
    assert str(built.value) == message
    rule = model_ranges(PPOModule, find_stage("ppo"))[key]
    assert not rule.allows(bad) and rule.describe() == expected


@pytest.mark.parametrize(
    ("stage", "key", "bad", "expected"),
    [
        ("dpo", "beta", 0.0, "a number > 0"),
        ("dpo", "nll_coef", -1.0, "a number >= 0"),
        ("dpo", "label_smoothing", 0.5, "a number in [0, 0.5)"),
        ("reward", "length_groups", 0, "a whole number >= 1"),
        ("reward", "freeze_layers", -1, "a whole number >= 0"),
        ("reward", "beta_rm", -0.5, "a number >= 0"),
        ("ppo", "log_samples_every", -1, "a whole number >= 0"),
    ],
)
def test_plain_arguments_declare_their_ranges_once_for_python_and_the_cli(stage, key, bad, expected):
    """A stage module's plain ``__init__`` arguments have their ranges on the class (``ARG_RANGES``): building the
    module in Python refuses a value outside (one line, before any model loads) with the range the CLI's check
    reads for ``model.init_args.<key>``."""
    from rlhf_lit.models import BackboneConfig, LoraSettings, RewardModelConfig
    from rlhf_lit.stages import STAGES, import_path

    cls = import_path(STAGES[stage].module)
    backbone = BackboneConfig(tiny={"model_type": "gpt2"}, tokenizer="byte", lora=LoraSettings(r=2))
    kwargs = {"backbone": backbone, key: bad}
    if stage == "ppo":
        kwargs["reward_model"] = RewardModelConfig(backbone=backbone)
    with pytest.raises(ConfigError) as built:
        cls(**kwargs)
    assert str(built.value) == f"{key} must be {expected}, got {bad!r}"
    rule = model_ranges(cls, find_stage(stage))[key]
    assert rule is cls.ARG_RANGES[key] and rule.describe() == expected
