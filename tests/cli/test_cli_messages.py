"""jsonargparse's error trees condensed to one line (``rlhf_lit.cli_messages``).

The literal messages below are what jsonargparse 4.53 printed under Lightning 2.6.6; the last tests parse
real bad configs, so a change of jsonargparse's layout fails here loudly rather than degrading the CLI.
"""

from __future__ import annotations

import pytest
import yaml

from rlhf_lit.cli import RLHFCLI, cli_main
from rlhf_lit.cli_messages import condense, did_you_mean
from rlhf_lit.errors import ConfigError
from tests.tiny_runs import REPO_ROOT, in_repo_root

NESTED_UNKNOWN = """Parser key "model":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'lightning.pytorch.core.module.LightningModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'rlhf_lit.modules.PPOModule':
        Parser key "kl":
          Does not validate against any of the Union subtypes
          Subtypes: [<class 'rlhf_lit.rl.settings.KLConfig'>, <class 'NoneType'>]
          Errors:
            - Problem with given class_path 'rlhf_lit.rl.settings.KLConfig':
                Option 'kl_coeff' is not accepted
            - Expected a <class 'NoneType'>
          Given value type: <class 'jsonargparse._util.NestedArg'>
          Given value: NestedArg(key='kl_coeff', val='0.1')
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>
  Given value: NestedArg(key='kl.kl_coeff', val='0.1')"""

WRONG_TYPE = """Parser key "model":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'lightning.pytorch.core.module.LightningModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'rlhf_lit.modules.PPOModule':
        Parser key "optimizer":
          Does not validate against any of the Union subtypes
          Subtypes: [<class 'rlhf_lit.modules.common.OptimizerConfig'>, <class 'NoneType'>]
          Errors:
            - Problem with given class_path 'rlhf_lit.modules.common.OptimizerConfig':
                Parser key "name":
                  Expected a typing.Literal['adamw', 'adamw_8bit', 'paged_adamw_8bit']. Got value: sgd
            - Expected a <class 'NoneType'>
          Given value type: <class 'jsonargparse._util.NestedArg'>
          Given value: NestedArg(key='name', val='sgd')
    - Expected a <class 'NoneType'>"""

GROUP_OPTION = """Parser key "model":
  Does not validate against any of the Union subtypes
  Errors:
    - Problem with given class_path 'rlhf_lit.modules.RewardModule':
        Group 'backbone' does not accept option 'tokenize'
    - Expected a <class 'NoneType'>"""


TINY_NULL = """Parser key "model":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'lightning.pytorch.core.module.LightningModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'rlhf_lit.modules.SFTModule':
        Parser key "backbone.tiny":
          Does not validate against any of the Union subtypes
          Subtypes: [dict[str, typing.Any], <class 'NoneType'>]
          Errors:
            - Expected a <class 'dict'>
            - Expected a <class 'NoneType'>
          Given value type: <class 'str'>
          Given value: None
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>
  Given value: NestedArg(key='backbone.tiny', val=None)"""

LORA_NULL = """Parser key "model":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'lightning.pytorch.core.module.LightningModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'rlhf_lit.modules.SFTModule':
        Parser key "backbone.lora":

          - Expected a path but None either not accessible or invalid
          - Does not validate against any of the Union subtypes
          Subtypes: [<class 'rlhf_lit.models.backbone.LoraSettings'>, <class 'NoneType'>]
          Errors:
            - Expected a dot import path string: None
            - Expected a <class 'NoneType'>
          Given value type: <class 'str'>
          Given value: None
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>
  Given value: NestedArg(key='backbone.lora', val=None)"""

NULL_ADVICE = (
    "model.init_args.backbone.{key}=null: on the command line a nested key's null reaches the parser as the text "
    "'None' (jsonargparse); write {key}: null in a --config file, or give the whole section: "
    "--model.init_args.backbone='{{...}}'"
)


def test_a_nested_null_from_the_command_line_is_one_line_saying_how_to_give_it():
    assert condense(TINY_NULL) == NULL_ADVICE.format(key="tiny")
    assert condense(LORA_NULL) == NULL_ADVICE.format(key="lora")  # every line under its key is noise
    other = TINY_NULL.replace("Given value: None", "Given value: abc").replace("val=None", "val='abc'")
    assert (
        condense(other) == "model.init_args.backbone.tiny: expected a mapping ({key: value, ...}), got 'abc'"
    )


def test_did_you_mean():
    assert did_you_mean("kl_coeff", ["kl_coef", "estimator", "target_kl"]) == " (did you mean 'kl_coef'?)"
    assert did_you_mean("--trainer.max_step", ["--trainer.max_steps", "--trainer.max_epochs"]).startswith(
        " (did you mean '--trainer.max_steps'? abbreviations are not accepted"
    )
    assert did_you_mean("zzz", ["kl_coef"]) == ""


def test_condense_names_the_full_key_and_the_closest_accepted_one():
    assert condense(NESTED_UNKNOWN).startswith(
        "unknown key model.init_args.kl.kl_coeff (did you mean 'kl_coef'?)"
    )
    assert condense(WRONG_TYPE) == (
        "model.init_args.optimizer.name: expected one of 'adamw', 'adamw_8bit', 'paged_adamw_8bit', got 'sgd'"
    )
    assert condense(GROUP_OPTION).startswith(
        "unknown key model.init_args.backbone.tokenize (did you mean 'tokenizer'?)"
    )
    options = ["--trainer.max_steps", "--trainer.max_epochs", "--seed_everything"]
    assert condense("unrecognized arguments: --trainer.max_step=5", options).startswith(
        "unknown option --trainer.max_step (did you mean '--trainer.max_steps'? abbreviations are not accepted)"
    )
    assert condense("Option 'trainr.max_epochs' is not accepted", ["--trainer.max_epochs"]).startswith(
        "unknown key trainr.max_epochs (did you mean 'trainer.max_epochs'?)"
    )
    assert condense("something new\nand more") == "something new"  # unknown layouts: the first line


def _parse(monkeypatch, args):
    monkeypatch.setattr(RLHFCLI, "instantiate_classes", lambda self: None)
    monkeypatch.setattr(RLHFCLI, "before_instantiate_classes", lambda self: None)
    monkeypatch.setattr(RLHFCLI, "_run_subcommand", lambda self, subcommand: None)
    with in_repo_root():
        return cli_main(args)


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--model.init_args.kl.kl_coeff=0.1"],
            "unknown key model.init_args.kl.kl_coeff (did you mean 'kl_coef'?)",
        ),
        (["--trainer.max_step=5"], "unknown option --trainer.max_step (did you mean '--trainer.max_steps'?"),
        (["--model.init_args.ppo.ppo_epochs=abc"], "model.init_args.ppo.ppo_epochs: expected int, got 'abc'"),
        (
            ["--data.init_args.batch_siz=3"],
            "unknown key data.init_args.batch_siz (did you mean 'batch_size'?)",
        ),
        # a key in the wrong section: the closest name in every section (kl_coef 0.93 vs ppo's own vf_coef
        # 0.67, difflib ratios 2 * 7 / 15 and 2 * 5 / 15), named in full
        (
            ["--model.init_args.ppo.kl_coeff=0.1"],
            "unknown key model.init_args.ppo.kl_coeff (did you mean 'model.init_args.kl.kl_coef'?)",
        ),
        (
            ["--model.init_args.clip_range=0.1"],
            "unknown key model.init_args.clip_range (did you mean 'model.init_args.ppo.clip_range'?)",
        ),
        # nan / inf: the key's declared range (rlhf_lit.ranges, checks.rules), as the value checks word it
        (
            ["--model.init_args.optimizer.lr=nan"],
            "model.init_args.optimizer.lr must be a finite number > 0, got nan",
        ),
        (
            ["--model.init_args.ppo.gamma=-inf"],
            "model.init_args.ppo.gamma must be a finite number in (0, 1], got -inf",
        ),
        (
            ["--trainer.gradient_clip_val=inf"],
            "trainer.gradient_clip_val must be a finite number >= 0 (or null), got inf",
        ),
        (
            ["--data.init_args.batch_size=NaN"],
            "data.init_args.batch_size must be a finite whole number >= 1, got NaN",
        ),
        (["--model.init_args.backbone.tiny=null"], NULL_ADVICE.format(key="tiny")),
        (["--model.init_args.backbone.tiny=5"], "model.init_args.backbone.tiny: expected a mapping"),
        # a bool given a word: a class's bool key, and a top-level bool | None (the Union's types named)
        (
            ["--model.init_args.sampling.merge_adapter=maybe"],
            "model.init_args.sampling.merge_adapter: expected bool, got 'maybe'",
        ),
        (
            ["--trainer.enable_checkpointing=maybe"],
            "trainer.enable_checkpointing: expected bool or null, got 'maybe'",
        ),
        # an optional choice (Literal | None): the choices, null, and the value given
        (
            ["--model.init_args.sampling.copy_dtype=bf16"],
            "model.init_args.sampling.copy_dtype: expected one of 'float32', 'bfloat16', 'float16' or null, "
            "got 'bf16'",
        ),
    ],
    ids=[
        "nested_key",
        "abbreviation",
        "type",
        "data_key",
        "other_section",
        "no_section",
        "nan",
        "minus_inf",
        "inf_in_a_union",
        "nan_int",
        "nested_null",
        "not_a_mapping",
        "bool_in_a_class",
        "bool_or_null",
        "choice_or_null",
    ],
)
def test_real_parse_errors_condense_to_one_line(monkeypatch, args, expected):
    with pytest.raises(ConfigError) as info:
        _parse(monkeypatch, ["fit", "--config", "configs/ppo/tiny.yaml", *args])
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)
    if expected.endswith(("nan", "inf", "NaN", "'{...}'")):  # the whole line
        assert str(info.value) == expected


def test_a_misspelled_yaml_key_is_named_with_its_section(monkeypatch, tmp_path):
    spec = yaml.safe_load((REPO_ROOT / "configs/ppo/tiny.yaml").read_text())
    spec["model"]["init_args"]["reward_model"]["backbone"]["tokenize"] = "byte"
    spec["trainr"] = {"max_epochs": 1}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(spec))
    with pytest.raises(
        ConfigError,
        match=r"unknown key (trainr\.max_epochs \(did you mean 'trainer\.max_epochs'|"
        r"model\.init_args\.reward_model\.backbone\.tokenize \(did you mean 'tokenizer')",
    ):
        _parse(monkeypatch, ["fit", "--config", str(bad)])


def test_abbreviations_would_be_accepted_without_allow_abbrev_false(monkeypatch):
    """Why the CLI passes ``allow_abbrev=False``: argparse's default takes a unique prefix as the option."""
    from rlhf_lit import lightning_cli as cli  # the parser settings moved there from rlhf_lit.cli

    monkeypatch.setattr(cli, "_PARSER_KWARGS", {"exit_on_error": False})
    parsed = _parse(monkeypatch, ["fit", "--config", "configs/ppo/tiny.yaml", "--trainer.max_step=5"])
    assert parsed.config.fit.trainer.max_steps == 5
