"""``rlhf_lit.checks``: every value rule, the consistency and path checks, lengths against the model's
positions, writable outputs, and the checkpoint checks -- each on a parsed tiny config, before any model."""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlhf_lit.checks import (
    DATA_RULES,
    TRAINER_RULES,
    Range,
    check_ckpt_path,
    check_config,
    check_data_fits_model,
    model_ranges,
)
from rlhf_lit.cli import RLHFCLI, cli_main
from rlhf_lit.errors import ConfigError
from rlhf_lit.stages import STAGES, import_path
from tests.tiny_runs import REPO_ROOT, in_repo_root

STAGE_CONFIGS = {
    "sft": "configs/sft/tiny.yaml",
    "reward": "configs/reward/tiny.yaml",
    "ppo": "configs/ppo/tiny.yaml",
    "dpo": "configs/dpo/tiny.yaml",
}
DATA_OF = {
    "SFTDataModule": "sft",
    "PreferenceDataModule": "reward",
    "PromptDataModule": "ppo",
}
_PARSED: dict[str, dict] = {}


def parsed(stage: str) -> dict:
    """The tiny config of a stage, parsed by the CLI into plain dicts (cached), as check_config sees it."""
    if stage not in _PARSED:
        captured = {}
        patch = pytest.MonkeyPatch()
        patch.setattr(RLHFCLI, "instantiate_classes", lambda self: None)
        patch.setattr(
            RLHFCLI, "before_instantiate_classes", lambda self: captured.update(c=self.config.as_dict())
        )
        try:
            with in_repo_root():
                cli_main(["--config", STAGE_CONFIGS[stage]], run=False)
        finally:
            patch.undo()
        _PARSED[stage] = captured["c"]
    return copy.deepcopy(_PARSED[stage])


def check(config: dict, subcommand: str | None = "fit") -> None:
    with in_repo_root():
        check_config(config, subcommand)


def _set(tree: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        if part.isdigit():
            tree = tree[int(part)]
            continue
        if tree.get(part) is None:
            tree[part] = {}
        tree = tree[part]
    last = parts[-1]
    if last.isdigit():
        tree[int(last)] = value
    else:
        tree[last] = value


def _bad_values(rule: Range) -> list:
    """Values a rule must refuse: just past each bound, a fraction for whole numbers, NaN and infinity."""
    bad = [math.nan, math.inf]
    if rule.low is not None:
        bad.append(rule.low if rule.low_open else rule.low - 1)
    if rule.high is not None:
        bad.append(rule.high if rule.high_open else rule.high + 1)
    if rule.integer:
        bad.append((rule.low or 0) + 1.5)
    if not rule.optional:
        bad.append(None)
    return [v for v in bad if v not in rule.also]


def _good_value(rule: Range):
    if rule.low is not None:
        return (
            rule.low + (1 if rule.integer or rule.high is None else (rule.high - rule.low) / 2)
            if rule.low_open or rule.integer
            else rule.low
        )
    return rule.high if rule.high is not None and not rule.high_open else 0


RULES = [
    ("model", stage, key, rule)
    for stage in STAGE_CONFIGS
    for key, rule in model_ranges(import_path(STAGES[stage].module), STAGES[stage]).items()
]
RULES += [
    ("data", DATA_OF[kind], key, rule) for kind, rules in DATA_RULES.items() for key, rule in rules.items()
]
RULES += [("trainer", stage, key, rule) for stage in STAGE_CONFIGS for key, rule in TRAINER_RULES.items()]


@pytest.mark.parametrize("where, stage, key, rule", RULES, ids=[f"{s}:{w}.{k}" for w, s, k, _ in RULES])
def test_every_value_rule_refuses_values_outside_its_range(where, stage, key, rule):
    prefix = {"model": "model.init_args.", "data": "data.init_args.", "trainer": "trainer."}[where]
    for value in _bad_values(rule):
        config = parsed(stage)
        section = config[where] if where == "trainer" else config[where]["init_args"]
        if key.startswith("optimizer.betas."):  # a tuple in the parsed config
            section["optimizer"]["betas"] = list(section["optimizer"]["betas"])
        _set(section, key, value)
        with pytest.raises(ConfigError) as info:
            check(config)
        finite = isinstance(value, float) and not math.isfinite(value)  # inf / nan: "a finite number ..."
        assert str(info.value).startswith(f"{prefix}{key} must be {rule.describe(finite)}, got {value!r}")
    config = parsed(stage)
    section = config[where] if where == "trainer" else config[where]["init_args"]
    if key.startswith("optimizer.betas."):
        section["optimizer"]["betas"] = list(section["optimizer"]["betas"])
    _set(section, key, _good_value(rule))
    try:  # a value inside the range passes this rule (it may break another one, e.g. a divisibility)
        check(config)
    except ConfigError as err:
        assert not str(err).startswith(f"{prefix}{key} must be"), err


def test_range_descriptions_and_extras():
    assert Range(low=0, low_open=True).describe() == "a number > 0"
    assert Range(low=0, high=1, low_open=True).describe() == "a number in (0, 1]"
    rule = Range(low=1, integer=True, also=(-1,))
    assert rule.describe() == "a whole number >= 1 (or -1)" and rule.allows(-1) and not rule.allows(0)
    assert not Range().allows(True) and Range(optional=True).allows(None)


def test_the_issues_nonsense_settings_are_refused():
    for stage, key, value, expected in [
        ("sft", "optimizer.lr", 0.0, "model.init_args.optimizer.lr must be a number > 0, got 0.0"),
        (
            "ppo",
            "ppo.ppo_epochs",
            0,
            "model.init_args.ppo.ppo_epochs must be a whole number >= 1, got 0",
        ),
        (
            "ppo",
            "kl.target_kl",
            -1.0,
            "model.init_args.kl.target_kl must be a number > 0 (or null), got -1.0",
        ),
        (
            "ppo",
            "ppo.clip_range",
            -0.5,
            "model.init_args.ppo.clip_range must be a number > 0, got -0.5",
        ),
    ]:
        config = parsed(stage)
        _set(config["model"]["init_args"], key, value)
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            check(config)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"model.init_args.backbone.lora": None}, "backbone.lora is not set: PPO trains LoRA adapters"),
        ({"model.init_args.reward_model.path": "x"}, "reward_model: give exactly one of 'path'"),
        (
            {"model.init_args.kl.adaptive": True, "model.init_args.kl.target_kl": None},
            "kl.adaptive is true but kl.target_kl is not set",
        ),
        (
            {"data.init_args.batch_size": 6},
            r"batch_size \(6 prompts per rollout\) must be a multiple of .*ppo_minibatch_size \(4\)",
        ),
        (
            {"model.init_args.ppo.micro_batch_size": 3},
            r"ppo_minibatch_size \(4\) must be a multiple of .*micro_batch_size \(3\)",
        ),
        (
            {"model.init_args.sampling.min_new_tokens": 30},
            r"min_new_tokens \(30\) must be <= sampling.max_new_tokens \(24\)",
        ),
        ({"model.init_args.ptx": {"coef": 0.5, "train_files": []}}, "ptx.coef > 0 needs ptx.train_files"),
        (
            {"trainer.max_steps": 10},
            r"trainer.max_steps=10 would stop PPO inside an iteration: one iteration makes 4 "
            r"optimizer steps.*ppo.total_iterations",
        ),
        ({"data.class_path": "rlhf_lit.data.SFTDataModule"}, "PPOModule trains on PromptDataModule data"),
        (
            {"data.init_args.max_prompt_length": 500},
            r"max_prompt_length \(500\) \+ .*max_new_tokens \(24\) = 524 "
            r"tokens exceed the policy's 512 positions",
        ),
        ({"data.init_args.train_files": []}, "train_files is empty"),
        ({"data.init_args.pad_to_length": 64}, r"max_prompt_length \(96\) must be <= pad_to_length \(64\)"),
    ],
    ids=[
        "no_lora",
        "two_reward_models",
        "adaptive_without_target",
        "rollout",
        "micro",
        "min_new_tokens",
        "ptx",
        "max_steps",
        "stage_data",
        "positions",
        "no_train_files",
        "pad_to_length",
    ],
)
def test_ppo_consistency_checks(changes, expected):
    refused(changes, expected)


def refused(changes: dict, expected: str, prefix: str = "", stage: str = "ppo") -> None:
    """The stage's tiny config with ``changes`` (dotted keys, each under ``prefix``) is refused by the checks
    with a message matching ``expected``."""
    config = parsed(stage)
    for key, value in changes.items():
        _set(config, prefix + key, value)
    with pytest.raises(ConfigError, match=expected):
        check(config)


def test_max_steps_of_whole_iterations_is_accepted():
    config = parsed("ppo")
    config["trainer"]["max_steps"] = 12  # 3 iterations of 2 epochs x 2 minibatches
    check(config)


@pytest.mark.parametrize(
    "stage, changes, expected",
    [
        (
            "sft",
            {"data.init_args.max_length": 600},
            r"max_length \(600\) exceeds the model's 512 positions",
        ),
        (
            "sft",
            {"model.init_args.backbone.name_or_path": "gpt2"},
            "model.init_args.backbone: give exactly one of 'name_or_path'",
        ),
        ("reward", {"model.init_args.backbone.dtype": "float8"}, "backbone.dtype must be one of"),
        (
            "reward",
            {"data.init_args.val_size": 2.5},
            "val_size must be a fraction in .0, 1. or a whole row count",
        ),
        (
            "reward",
            {"data.init_args.min_prompt_tokens": 384},
            r"min_prompt_tokens \(384\) must be < max_length \(384\)",
        ),
        (
            "reward",
            {"data.class_path": "rlhf_lit.data.SFTDataModule"},
            "RewardModule trains on PreferenceDataModule",
        ),
        (
            "reward",
            {"model.init_args.packing": True, "model.init_args.length_groups": 2},
            "packing: true and length_groups > 1 both cut padding",
        ),
        (
            "reward",
            {
                "model.init_args.packing": True,
                "model.init_args.backbone.tiny": {"model_type": "bert", "num_hidden_layers": 1},
            },
            r"model.init_args.packing: packing: true needs a causal-LM backbone.*\(bert backbone\)",
        ),
    ],
)
def test_sft_and_reward_checks(stage, changes, expected):
    config = parsed(stage)
    for key, value in changes.items():
        _set(config, key, value)
    with pytest.raises(ConfigError, match=expected):
        check(config)


def test_missing_inputs_are_named(tmp_path):
    config = parsed("sft")
    config["data"]["init_args"]["train_files"] = ["../shared/data/sft/nope.jsonl"]
    with pytest.raises(
        ConfigError,
        match=r"data.init_args.train_files\[0\]: data file not found: ../shared/data/sft/nope.jsonl",
    ):
        check(config)
    config["data"]["init_args"]["train_files"] = [str(tmp_path)]
    with pytest.raises(ConfigError, match=r"train_files\[0\]: .* is a folder; give a data file"):
        check(config)
    config = parsed("sft")
    config["model"]["init_args"]["backbone"] = {
        **config["model"]["init_args"]["backbone"],
        "tiny": None,
        "name_or_path": str(tmp_path / "no_model"),
    }
    with pytest.raises(ConfigError, match="backbone.name_or_path: no such model folder"):
        check(config)
    (tmp_path / "empty_dir").mkdir()
    config["model"]["init_args"]["backbone"]["name_or_path"] = str(tmp_path / "empty_dir")
    with pytest.raises(ConfigError, match="is not a model folder"):
        check(config)
    config["model"]["init_args"]["backbone"]["name_or_path"] = "no-such-org/no-such-model"
    # a hub id that is not cached, offline (the tests run with HF_HUB_OFFLINE=1): one line at once, no retries
    with pytest.raises(ConfigError, match="no-such-org/no-such-model is not a local folder and not in the Hugging"):
        check(config)


def test_a_hub_dataset_offline_is_one_line_before_loading_unless_cached(tmp_path, monkeypatch):
    """Offline (the tests run with HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1) a dataset id that is in neither
    cache is refused by the checks, before ``datasets`` is asked (which would fail only after its own
    attempts); one in the hub cache passes on to ``datasets``."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    config = parsed("sft")
    config["data"]["init_args"]["train_files"] = ["../shared/data/sft/self_instruct_seed_tasks.jsonl", "an-org/a-set"]
    with pytest.raises(ConfigError) as info:
        check(config)
    assert str(info.value) == (
        "data.init_args.train_files[1]: 'an-org/a-set' is not a local file and not in the Hugging Face cache, "
        "and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set (offline); give a data file (.jsonl, .json, .parquet, "
        ".csv), or download the dataset first"
    )
    (tmp_path / "datasets--an-org--a-set").mkdir()  # as huggingface_hub names a cached dataset repo
    config["data"]["init_args"]["train_files"][1] = "an-org/a-set:test"  # a split suffix names the same id
    check(config)


def test_a_hub_model_and_a_hub_dataset_get_the_same_three_answers(monkeypatch):
    """One helper serves both hub checks: not cached and offline, no such repository, the hub unreachable; the
    metadata request (``info``) is the injected collaborator, asked once with a 5 s timeout."""
    from huggingface_hub.errors import RepositoryNotFoundError

    from rlhf_lit.checks.paths import _hub_problem

    class NotFound(RepositoryNotFoundError):
        def __init__(self) -> None:
            Exception.__init__(self, "404")

    asked = []

    def info(outcome):
        def ask(**kwargs):
            asked.append(kwargs)
            if outcome is not None:
                raise outcome
        return ask

    model = ("k", "org/m", "model", "local folder", "give a model folder")
    dataset = ("k", "'org/d'", "dataset", "local file", "give a data file")
    assert _hub_problem(*model, True, ["HF_HUB_OFFLINE"], info(TimeoutError())) is None  # cached: not asked
    assert _hub_problem(*dataset, False, ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"], info(None)) == (
        "k: 'org/d' is not a local file and not in the Hugging Face cache, and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE "
        "is set (offline); give a data file, or download the dataset first"
    )
    assert asked == []  # offline: only the caches count
    assert _hub_problem(*model, False, [], info(NotFound())) == (
        "k: org/m: no such model on the Hugging Face hub (or it is private), and no such local folder"
    )
    assert _hub_problem(*dataset, False, [], info(ConnectionError())) == (
        "k: cannot fetch 'org/d' from the Hugging Face hub (ConnectionError); it is not a local file or cached; "
        "give a data file, or download it while online"
    )
    assert _hub_problem(*model, False, [], info(None)) is None  # the hub has it
    assert asked == [{"timeout": 5}] * 3


def test_an_export_an_earlier_stage_writes_is_named_with_that_stage_and_config(tmp_path, monkeypatch):
    configs = tmp_path / "configs"
    (configs / "sft").mkdir(parents=True)
    (configs / "ppo").mkdir()
    (configs / "sft" / "mine.yaml").write_text(
        "model:\n  class_path: rlhf_lit.modules.SFTModule\n  init_args:\n    export_dir: out/sft/hf\n"
    )
    (configs / "ppo" / "mine.yaml").write_text("model: {class_path: rlhf_lit.modules.PPOModule}\n")
    config = parsed("ppo")
    config["model"]["init_args"]["backbone"].update(tiny=None, name_or_path="out/sft/hf")
    config["config"] = [str(configs / "ppo" / "mine.yaml")]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        check_config(config, "fit")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "model.init_args.backbone.name_or_path: out/sft/hf holds no model yet; it is written by "
        "the SFT stage: run rlhf-lit fit --config configs/sft/mine.yaml first"
    )


def test_outputs_must_be_writable(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for key, value, expected in [
        ("model.init_args.export_dir", str(blocker / "hf"), "a_file is a file, not a folder"),
        ("model.init_args.export_dir", str(blocker), "it is a file, not a folder"),
        ("trainer.default_root_dir", str(blocker / "runs"), "a_file is a file, not a folder"),
        ("trainer.logger.init_args.save_dir", str(blocker / "tb"), "a_file is a file, not a folder"),
    ]:
        config = parsed("reward")
        _set(config, key, value)
        with pytest.raises(ConfigError, match=f"{key.replace('.', '[.]')}: cannot write to .*{expected}"):
            check(config)
    config = parsed("reward")
    config["trainer"]["callbacks"] = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(blocker / "ck")},
        }
    ]
    with pytest.raises(ConfigError, match=r"trainer.callbacks\[0\].init_args.dirpath: cannot write"):
        check(config)
    config = parsed("reward")
    config["model"]["init_args"]["export_dir"] = str(blocker / "hf")
    check(config, "validate")  # validate writes no export


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_output_under_a_folder_refusing_new_folders_is_refused(tmp_path):
    """/proc takes no new folder, even from root (for whom os.access says writable): a folder is tried."""
    config = parsed("reward")
    config["model"]["init_args"]["export_dir"] = "/proc/no_such_folder/hf"
    with pytest.raises(
        ConfigError,
        match=r"^model[.]init_args[.]export_dir: cannot write to /proc/no_such_folder/hf: /proc refuses new "
        r"folders \(No such file or directory\)$",
    ):
        check(config)
    config["model"]["init_args"]["export_dir"] = str(tmp_path / "a" / "hf")
    check(config)  # a writable parent: the trial folder is made and removed
    assert os.listdir(tmp_path) == []


def test_validate_without_a_validation_split_is_refused():
    config = parsed("ppo")  # PPO's prompts hold no validation split by default (val_size 0)
    assert config["data"]["init_args"]["val_size"] == 0 and not config["data"]["init_args"]["val_files"]
    check(config, "fit")  # fit does not need one
    with pytest.raises(ConfigError, match=r"^validate: nothing to validate: the data holds no validation split "):
        check(config, "validate")
    config["data"]["init_args"]["val_size"] = 2
    check(config, "validate")
    config["data"]["init_args"].update(val_size=0, val_files=["../shared/data/sft/self_instruct_seed_tasks.jsonl"])
    check(config, "validate")
    config["trainer"]["limit_val_batches"] = 0
    with pytest.raises(ConfigError, match=r"^validate: nothing to validate: trainer[.]limit_val_batches is 0"):
        check(config, "validate")


def test_prompts_without_a_length_limit_are_checked_once_read():
    model = SimpleNamespace(
        sampling=SimpleNamespace(max_new_tokens=24),
        backbone_cfg={"tiny": {"model_type": "gpt2", "n_positions": 64}, "tokenizer": "byte"},
    )
    examples = [{"prompt_ids": [5] * 50}, {"prompt_ids": [5] * 10}]
    data = SimpleNamespace(
        stage="prompt",
        max_prompt_length=1 << 30,
        train_dataset=SimpleNamespace(examples=examples),
        val_dataset=None,
    )
    with pytest.raises(
        ConfigError,
        match=r"the longest prompt \(50 tokens\) \+ .*max_new_tokens \(24\) exceed the "
        r"policy's 64 positions; set data.init_args.max_prompt_length <= 40",
    ):
        check_data_fits_model(model, data)
    examples.pop(0)
    check_data_fits_model(model, data)


def test_unpaired_data_is_refused_for_the_pairwise_reward_model():
    from rlhf_lit.modules import RewardModule

    model = RewardModule.__new__(RewardModule)
    with pytest.raises(
        ConfigError, match="RewardModule trains on pairs; set data.init_args.pair_unpaired: true"
    ):
        check_data_fits_model(model, SimpleNamespace(unpaired=True, stage="preference"))


def _ckpt(tmp_path: Path, hparams: dict) -> str:
    path = tmp_path / "x.ckpt"
    torch.save({"hyper_parameters": hparams, "state_dict": {}}, path)
    return str(path)


def _cli_config(ckpt: str, class_path: str = "rlhf_lit.modules.RewardModule", init_args: dict | None = None):
    from jsonargparse import Namespace

    model = Namespace(class_path=class_path, init_args=Namespace(**(init_args or {})))
    return Namespace(subcommand="fit", fit=Namespace(ckpt_path=ckpt, model=model))


def test_ckpt_path_checks(tmp_path, caplog):
    with pytest.raises(ConfigError, match="ckpt_path: .*nope.ckpt does not exist"):
        check_ckpt_path(_cli_config(str(tmp_path / "nope.ckpt")))
    with pytest.raises(ConfigError, match="is a folder, not a checkpoint file"):
        check_ckpt_path(_cli_config(str(tmp_path)))
    (tmp_path / "junk.ckpt").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="is not a readable checkpoint"):
        check_ckpt_path(_cli_config(str(tmp_path / "junk.ckpt")))
    old = _ckpt(tmp_path, {"ece_bins": 10})  # hyper-parameters saved before _class_path was stored
    with pytest.raises(ConfigError, match="stores its hyper-parameters without '_class_path'"):
        check_ckpt_path(_cli_config(old))
    ckpt = _ckpt(tmp_path, {"_class_path": "rlhf_lit.modules.reward.RewardModule", "ece_bins": 10})
    with pytest.raises(ConfigError, match="was written by RewardModule, but the config's model is PPOModule"):
        check_ckpt_path(_cli_config(ckpt, "rlhf_lit.modules.PPOModule"))
    with caplog.at_level("WARNING", logger="rlhf_lit"):
        check_ckpt_path(_cli_config(ckpt, init_args={"ece_bins": 15}))
    assert (
        "the model is rebuilt with the checkpoint's settings; the config's ece_bins differs from it and is not used"
        in caplog.text
    )


def test_all_shipped_configs_pass_the_value_checks():
    """Every stage config under configs/ is within the rules (model folders of earlier stages and hub ids,
    which the tests, offline, have not cached, aside)."""
    captured = {}
    for path in sorted((REPO_ROOT / "configs").rglob("*.yaml")):
        if "trainer" in path.parts:
            continue
        patch = pytest.MonkeyPatch()
        patch.setattr(RLHFCLI, "instantiate_classes", lambda self: None)
        patch.setattr(
            RLHFCLI, "before_instantiate_classes", lambda self: captured.update(c=self.config.as_dict())
        )
        patch.setattr("rlhf_lit.checks.paths._model_folder_problem", lambda *a, **k: None)
        patch.setattr("rlhf_lit.checks.paths._hub_dataset_problem", lambda *a, **k: None)
        try:
            with in_repo_root():
                cli_main(["--config", str(path.relative_to(REPO_ROOT))], run=False)
                check_config(captured["c"], "fit")
        finally:
            patch.undo()


@pytest.mark.parametrize(
    "changes, expected",
    [
        (
            {"model.init_args.ppo.advantage_estimator": "grpo"},
            r"advantage_estimator=grpo compares the responses to one prompt: set .*num_samples_per_prompt >= 2 \(it is 1\)",
        ),
        (
            {
                "model.init_args.ppo.advantage_estimator": "rloo",
                "model.init_args.sampling.num_samples_per_prompt": 1,
            },
            r"num_samples_per_prompt >= 2",
        ),
        (
            {
                "model.init_args.ppo.advantage_estimator": "grpo",
                "model.init_args.sampling.num_samples_per_prompt": 3,
                "model.init_args.ppo.ppo_minibatch_size": 16,
            },
            r"batch_size \(8 prompts per rollout\) x sampling.num_samples_per_prompt \(3\) must be a multiple of "
            r".*ppo_minibatch_size \(16\)",
        ),
        (
            {
                "model.init_args.ppo.advantage_estimator": "reinforce_pp",
                "model.init_args.critic.init_from_reward": True,
            },
            r"critic.init_from_reward is set, but ppo.advantage_estimator=reinforce_pp builds no critic",
        ),
        ({"model.init_args.sampling.num_samples_per_prompt": 0}, r"num_samples_per_prompt"),
    ],
    ids=[
        "grpo_one_sample",
        "rloo_one_sample",
        "group_rollout",
        "critic_free_init_from_reward",
        "zero_samples",
    ],
)
def test_group_estimator_checks(changes, expected):
    config = parsed("ppo")
    for key, value in changes.items():
        _set(config, key, value)
    with pytest.raises(ConfigError, match=expected):
        check(config)


def test_group_estimator_with_enough_samples_passes_the_checks():
    config = parsed("ppo")
    _set(config, "model.init_args.ppo.advantage_estimator", "grpo")
    _set(config, "model.init_args.sampling.num_samples_per_prompt", 2)
    check(config)


def test_an_inf_or_nan_value_is_told_the_number_must_be_finite():
    # "must be a number > 0, got inf" would read as a contradiction (inf > 0)
    from rlhf_lit.rl.generation import SamplingConfig

    with pytest.raises(ConfigError, match=r"^sampling\.temperature must be a finite number > 0, got inf$"):
        SamplingConfig(temperature=float("inf"))
    with pytest.raises(ConfigError, match=r"^sampling\.top_p must be a finite number in \(0, 1\], got nan$"):
        SamplingConfig(top_p=float("nan"))
    with pytest.raises(ConfigError, match=r"^sampling\.top_p must be a number in \(0, 1\], got 2\.0$"):
        SamplingConfig(top_p=2.0)
    assert Range(low=1, integer=True).describe(finite=True) == "a finite whole number >= 1"
