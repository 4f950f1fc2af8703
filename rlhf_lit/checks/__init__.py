"""Checks of a parsed ``rlhf-lit`` config that run before any model loads (one :class:`ConfigError` line each).

Modules: ``rules`` (value ranges), ``checkpoint`` (``ckpt_path``), ``paths`` (inputs and outputs), ``lengths``
(against the model's positions); this module runs them in order. ``hardware`` holds warnings, not errors (a
setting that runs, but slowly, on this machine), which the CLI prints itself. The CLI calls
:func:`check_ckpt_path` right after parsing and :func:`check_config` before it instantiates anything, on the
parsed config as plain dicts
(``rlhf-lit plan`` runs :func:`check_settings`: 1, 2 and 4 below, which need no input to exist);
:func:`check_data_fits_model` runs once the data is read.
The first problem found is raised, naming the config key as the user writes it
(``model.init_args.ppo.clip_range``) and what would fix it.

1. Value ranges (:func:`model_ranges`, :data:`DATA_RULES`, :data:`TRAINER_RULES`): learning rates and
   coefficients, epochs, iterations and batch sizes, PPO's clip ranges, ``gamma``, ``gae_lambda``, KL
   settings, sampling, lengths. Non-finite numbers are refused everywhere a number is checked.
2. Consistency: the data module fits the stage (the stage table, :mod:`rlhf_lit.stages`); PPO's rollout / minibatch / micro-batch divisibility; an
   adaptive KL controller has a ``target_kl``; ``trainer.max_steps`` stops PPO at a whole iteration.
3. Inputs exist: data files, the backbone and reward-model folders (an export that an earlier stage has not
   written yet is named with the config that writes it), the checkpoint.
4. Lengths fit the model: ``max_length`` (PPO: prompt limit + ``max_new_tokens``) within the model's
   positions, read from its config without loading weights.
5. Outputs are writable: ``export_dir``, ``trainer.default_root_dir``, logger and checkpoint folders.
"""

from __future__ import annotations

from rlhf_lit.checks.checkpoint import check_ckpt_path
from rlhf_lit.checks.lengths import check_data_fits_model, check_lengths, model_config, model_positions
from rlhf_lit.checks.paths import check_inputs, check_outputs, config_roots
from rlhf_lit.checks.rules import (
    DATA_RULES,
    MODEL_RULES,
    TRAINER_RULES,
    Range,
    check_ranges,
    file_list,
    get,
    import_class,
    model_ranges,
)
from rlhf_lit.errors import ConfigError
from rlhf_lit.stages import data_kind, find_stage, public_path

__all__ = [
    "DATA_RULES",
    "MODEL_RULES",
    "TRAINER_RULES",
    "Range",
    "check_ckpt_path",
    "check_config",
    "check_settings",
    "check_data_fits_model",
    "check_ppo_settings",
    "check_reward_settings",
    "model_positions",
    "model_ranges",
]


# ------------------------------------------------------------------------------------------- the config
def check_config(config: dict, subcommand: str | None = None) -> None:
    """Check a parsed config (``{"model": {"class_path", "init_args"}, "data": ..., "trainer": ...}``): the
    settings (:func:`check_settings`), then the inputs exist and the outputs are writable.

    Raises:
        ConfigError: for the first problem found (see the module docstring for the list).
    """
    init, data_init, stage = check_settings(config)
    trainer = config.get("trainer") or {}
    check_inputs(init, data_init, stage, config_roots(config))
    check_outputs(init, trainer, subcommand)
    if subcommand == "validate":
        _check_something_to_validate(data_init, trainer)


def check_settings(config: dict) -> tuple[dict, dict, object]:
    """The checks that need no input or output to exist (what ``rlhf-lit plan`` runs too, on configs whose
    inputs an earlier stage may not have written yet): value ranges, the stage/data pairing, the backbone
    sections, the stage's consistency rules, and the lengths against the model's positions (when its config
    can be read now). Returns ``(model init_args, data init_args, stage or None)``.

    Raises:
        ConfigError: for the first problem found.
    """
    model = config.get("model") or {}
    data = config.get("data") or {}
    trainer = config.get("trainer") or {}
    init = model.get("init_args") or {}
    data_init = data.get("init_args") or {}
    model_cls, data_cls = import_class(model.get("class_path")), import_class(data.get("class_path"))
    stage = find_stage(model_cls)  # None: not one of the stage table's modules (no stage checks)
    data_path = data_kind(data_cls)
    data_name = data_path.rsplit(".", 1)[-1] if data_path else None

    check_ranges(trainer, TRAINER_RULES, "trainer.")
    if stage:
        check_ranges(init, model_ranges(model_cls, stage), "model.init_args.")
    if data_name:
        check_ranges(data_init, DATA_RULES.get(data_name, {}), "data.init_args.")
        _check_data_settings(data_name, data_init)
    if stage and data_path and stage.data != data_path:
        wanted = stage.data.rsplit(".", 1)[-1]
        raise ConfigError(
            f"data.class_path: {model_cls.__name__} trains on {wanted} data (the {stage.title} stage), but the "
            f"config gives {data_name}; use {public_path(stage.data)}"
        )
    for key in ("backbone", "reward_model.backbone"):
        if isinstance(get(init, key), dict):
            _check_backbone(f"model.init_args.{key}", get(init, key))
    if stage:
        stage.run_checks(init, data_init, trainer)
        check_lengths(stage, init, data_init)  # a folder that does not exist yet has no positions to check
    return init, data_init, stage


def _check_something_to_validate(data: dict, trainer: dict) -> None:
    """``validate`` with no validation split (PPO's prompts hold none by default) or no validation batch
    would run nothing and exit 0 in silence."""
    if trainer.get("limit_val_batches") == 0:
        raise ConfigError(
            "validate: nothing to validate: trainer.limit_val_batches is 0; give it a number of batches > 0 "
            "(or 1.0 for all)"
        )
    if not data.get("val_files") and data.get("val_size", 1) == 0:
        raise ConfigError(
            "validate: nothing to validate: the data holds no validation split (data.init_args.val_size is 0 "
            "and no data.init_args.val_files); set data.init_args.val_size (held out of each train file, e.g. "
            "--data.init_args.val_size=32) or data.init_args.val_files"
        )


def check_ppo_settings(init: dict, data: dict, trainer: dict) -> None:
    """The PPO stage's consistency checks (the stage table's ``checks`` entry for ``ppo``)."""
    _check_ppo(init, data, trainer)


def check_reward_settings(init: dict, data: dict, trainer: dict) -> None:
    """The reward stage's consistency checks (the stage table's ``checks`` entry for ``reward``): ``packing:
    true`` with ``length_groups > 1``, or on an encoder backbone (read from its config, no weights)."""
    from rlhf_lit.models.trunk import is_encoder_config
    from rlhf_lit.modules.reward import PACKING_ON_ENCODER, PACKING_WITH_LENGTH_GROUPS

    if init.get("packing") is not True:  # None: packed where it can be (RewardModule)
        return
    if (init.get("length_groups") or 1) > 1:
        raise ConfigError(f"model.init_args: {PACKING_WITH_LENGTH_GROUPS}")
    backbone = init.get("backbone")
    config = model_config(backbone) if isinstance(backbone, dict) else None
    if config is not None and is_encoder_config(config):
        raise ConfigError(f"model.init_args.packing: {PACKING_ON_ENCODER} ({config.model_type} backbone)")


def _check_backbone(key: str, backbone: dict) -> None:
    """What ``BackboneConfig`` would refuse when the model is built, said before (with the config key)."""
    from rlhf_lit.models.backbone_settings import DTYPES

    if (backbone.get("name_or_path") is None) == (backbone.get("tiny") is None):
        raise ConfigError(
            f"{key}: give exactly one of 'name_or_path' (a folder, hub id or pypi:<package>) and 'tiny'"
        )
    if backbone.get("dtype", "float32") not in DTYPES:
        raise ConfigError(f"{key}.dtype must be one of {sorted(DTYPES)}, got {backbone.get('dtype')!r}")
    tiny = backbone.get("tiny")
    if tiny is not None and not isinstance(tiny, dict):
        raise ConfigError(
            f"{key}.tiny must be a transformers config dict (e.g. {{model_type: gpt2, n_layer: 2}})"
        )


def _check_data_settings(kind: str, data: dict) -> None:
    train_files = file_list(data.get("train_files"))
    if not train_files:
        raise ConfigError("data.init_args.train_files is empty; give at least one data file or hub id")
    val_size = data.get("val_size")
    if isinstance(val_size, (int, float)) and val_size >= 1 and val_size != int(val_size):
        raise ConfigError(
            f"data.init_args.val_size must be a fraction in [0, 1) or a whole row count, got {val_size!r}"
        )
    if kind != "PromptDataModule":
        max_length, min_prompt = data.get("max_length"), data.get("min_prompt_tokens")
        if isinstance(max_length, int) and isinstance(min_prompt, int) and min_prompt >= max_length:
            raise ConfigError(
                f"data.init_args.min_prompt_tokens ({min_prompt}) must be < max_length ({max_length})"
            )
    else:
        limit, pad = data.get("max_prompt_length"), data.get("pad_to_length")
        if limit is not None and pad is not None and limit > pad:
            raise ConfigError(f"data.init_args.max_prompt_length ({limit}) must be <= pad_to_length ({pad})")


def _check_reward_entry(where: str, entry: dict) -> None:
    """One reward source: a reward model (exactly one of path / backbone) or an importable function."""
    from rlhf_lit.rewards import load_function

    if (entry.get("function") is None) == (entry.get("model") is None):
        raise ConfigError(f"{where[:-1]}: give exactly one of 'function' (module:function) and 'model'")
    if entry.get("function") is not None:
        try:
            load_function(entry["function"])
        except ValueError as err:
            raise ConfigError(f"{where}function: {err}") from None
        return
    model = entry["model"]
    if (model.get("path") is None) == (model.get("backbone") is None):
        raise ConfigError(f"{where[:-1]}: give exactly one of 'path' (a trained reward model) and 'backbone'")
    if model.get("backbone") is not None and model.get("mode", "separate") != "separate":
        raise ConfigError(f"{where}backbone builds a separate model; set reward_model.mode: separate")


def _check_pg_family(init: dict, n: int) -> None:
    """The policy-gradient family's rules (docs/policy_gradient.md): settings that need another one."""
    from rlhf_lit.rl.checks import check_dynamic_sampling, check_objective_options, check_overlong
    from rlhf_lit.rl.generation import SamplingConfig

    p = "model.init_args."
    check_dynamic_sampling(
        bool(get(init, "ppo.dynamic_sampling")), get(init, "ppo.dynamic_sampling_max_rounds") or 0, n, p
    )
    check_objective_options(
        get(init, "ppo.policy_loss", "ppo"),
        get(init, "ppo.dual_clip"),
        get(init, "ppo.tis_cap"),
        get(init, "ppo.tis_level"),
        get(init, "ppo.tis_mode"),
        p,
    )
    check_overlong(
        get(init, "reward.overlong_buffer"),
        get(init, "reward.overlong_penalty"),
        get(init, "sampling.max_new_tokens", SamplingConfig.max_new_tokens),
        p,
    )


def _check_stop_tokens(init: dict) -> None:
    """``ppo.mask_truncated_completions`` and ``reward.missing_eos_penalty`` need a stop token: refused here
    when the config alone rules every one out (the module's own check, ``check_stop_tokens``, with what
    ``may_stop`` can tell before the tokenizer is read; the tokenizer's EOS is checked when the module is
    built)."""
    from rlhf_lit.rl.checks import check_stop_tokens
    from rlhf_lit.rl.generation import SamplingConfig, may_stop

    has_stop = may_stop(
        get(init, "sampling.stop_at_eos", SamplingConfig.stop_at_eos),
        get(init, "sampling.stop_token_ids"),
        get(init, "sampling.stop_strings"),
    )
    mask_truncated = bool(get(init, "ppo.mask_truncated_completions"))
    check_stop_tokens(get(init, "reward.missing_eos_penalty"), mask_truncated, has_stop, "model.init_args.")


def _check_ppo(init: dict, data: dict, trainer: dict) -> None:
    """PPO's consistency rules; a setting the config leaves unset takes the module's default (its dataclass's)."""
    import inspect

    from rlhf_lit.data import PromptDataModule
    from rlhf_lit.rl.algorithms import get_algorithm
    from rlhf_lit.rl.generation import SamplingConfig
    from rlhf_lit.rl.settings import PPOConfig, PTXConfig

    p = "model.init_args."
    if get(init, "backbone.lora") is None:
        raise ConfigError(
            f"{p}backbone.lora is not set: PPO trains LoRA adapters (the reference is the base with its adapters "
            "off); add e.g. lora: {r: 8, alpha: 16, target_modules: all-linear}"
        )
    reward_model = init.get("reward_model") or {}
    entries = reward_model if isinstance(reward_model, list) else [{"model": reward_model}]
    for i, entry in enumerate(entries):
        where = f"{p}reward_model[{i}]." if isinstance(reward_model, list) else f"{p}reward_model."
        _check_reward_entry(where, entry)
    if get(init, "kl.adaptive") and get(init, "kl.target_kl") is None:
        raise ConfigError(
            f"{p}kl.adaptive is true but kl.target_kl is not set; give the KL per response to aim at"
        )
    minibatch = get(init, "ppo.ppo_minibatch_size", PPOConfig.ppo_minibatch_size)
    micro = get(init, "ppo.micro_batch_size") or minibatch
    prompts = data.get("batch_size", inspect.signature(PromptDataModule).parameters["batch_size"].default)
    n = get(init, "sampling.num_samples_per_prompt", SamplingConfig.num_samples_per_prompt)
    estimator = get(init, "ppo.advantage_estimator", PPOConfig.advantage_estimator)
    algorithm = get_algorithm(estimator)  # the registry: ConfigError naming the registered ones
    if algorithm.needs_groups and n < 2:
        raise ConfigError(
            f"{p}ppo.advantage_estimator={estimator} compares the responses to one prompt: set "
            f"{p}sampling.num_samples_per_prompt >= 2 (it is {n})"
        )
    _check_pg_family(init, n)
    _check_stop_tokens(init)
    if not algorithm.needs_critic and get(init, "critic.init_from_reward"):
        raise ConfigError(
            f"{p}critic.init_from_reward is set, but ppo.advantage_estimator={estimator} builds no critic"
        )
    rollout = prompts * n
    if rollout % minibatch:
        per = f" x sampling.num_samples_per_prompt ({n})" if n > 1 else ""
        raise ConfigError(
            f"data.init_args.batch_size ({prompts} prompts per rollout){per} must be a multiple of "
            f"{p}ppo.ppo_minibatch_size ({minibatch})"
        )
    if minibatch % micro:
        raise ConfigError(
            f"{p}ppo.ppo_minibatch_size ({minibatch}) must be a multiple of {p}ppo.micro_batch_size ({micro})"
        )
    if get(init, "sampling.min_new_tokens", SamplingConfig.min_new_tokens) > get(
        init, "sampling.max_new_tokens", SamplingConfig.max_new_tokens
    ):
        raise ConfigError(
            f"{p}sampling.min_new_tokens ({get(init, 'sampling.min_new_tokens')}) must be <= sampling.max_new_tokens "
            f"({get(init, 'sampling.max_new_tokens')})"
        )
    if get(init, "ptx.coef", PTXConfig.coef) > 0 and not file_list(get(init, "ptx.train_files")):
        raise ConfigError(f"{p}ptx.coef > 0 needs ptx.train_files (SFT data for the pretraining-mix term)")
    max_steps = trainer.get("max_steps", -1)
    if isinstance(max_steps, int) and max_steps > 0:
        per_iteration = get(init, "ppo.ppo_epochs", PPOConfig.ppo_epochs) * (rollout // minibatch)
        if max_steps % per_iteration:
            raise ConfigError(
                f"trainer.max_steps={max_steps} would stop PPO inside an iteration: one iteration makes {per_iteration} "
                f"optimizer steps (ppo.ppo_epochs x rollout / ppo_minibatch_size); set {p}ppo.total_iterations "
                f"for the run's length, or max_steps to a multiple of {per_iteration} to stop early and resume later"
            )
