"""Checks of a parsed ``rlhf-lit`` config that run before any model loads (one :class:`ConfigError` line each).

The CLI calls :func:`check_ckpt_path` right after parsing and :func:`check_config` before it instantiates
anything, on the parsed config as plain dicts; :func:`check_data_fits_model` runs once the data is read.
The first problem found is raised, naming the config key as the user writes it
(``model.init_args.ppo.clip_range``) and what would fix it.

1. Value ranges (:data:`MODEL_RULES`, :data:`DATA_RULES`, :data:`TRAINER_RULES`): learning rates and
   coefficients, epochs, iterations and batch sizes, PPO's clip ranges, ``gamma``, ``gae_lambda``, KL
   settings, sampling, lengths. Non-finite numbers are refused everywhere a number is checked.
2. Consistency: the data module fits the stage; PPO's rollout / minibatch / micro-batch divisibility; an
   adaptive KL controller has a ``target_kl``; ``trainer.max_steps`` stops PPO at a whole iteration.
3. Inputs exist: data files, the backbone and reward-model folders (an export that an earlier stage has not
   written yet is named with the config that writes it), the checkpoint.
4. Lengths fit the model: ``max_length`` (PPO: prompt limit + ``max_new_tokens``) within the model's
   positions, read from its config without loading weights.
5. Outputs are writable: ``export_dir``, ``trainer.default_root_dir``, logger and checkpoint folders.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_lit.errors import ConfigError

__all__ = [
    "DATA_RULES",
    "MODEL_RULES",
    "TRAINER_RULES",
    "Range",
    "check_ckpt_path",
    "check_config",
    "check_data_fits_model",
    "model_positions",
]


@dataclass(frozen=True)
class Range:
    """An allowed range of a numeric setting: ``low``/``high`` bounds (open or closed), whole numbers only
    (``integer``), None allowed (``optional``), and single extra values allowed (``also``, e.g. -1)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    optional: bool = False
    also: tuple = ()

    def describe(self) -> str:
        kind = "a whole number" if self.integer else "a number"
        if self.low is not None and self.high is not None:
            text = f"{kind} in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        elif self.high is not None:
            text = f"{kind} {'<' if self.high_open else '<='} {self.high:g}"
        else:
            text = f"a finite {kind[2:]}"
        extras = [repr(v) for v in self.also] + (["null"] if self.optional else [])
        return text + (f" (or {' or '.join(extras)})" if extras else "")

    def allows(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if value in self.also and not isinstance(value, bool):
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.integer and value != int(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True


def _gt0(**kw) -> Range:
    return Range(low=0, low_open=True, **kw)


def _ge0(**kw) -> Range:
    return Range(low=0, **kw)


def _count(low: int = 1, **kw) -> Range:
    return Range(low=low, integer=True, **kw)


_OPTIMIZER = {
    "optimizer.lr": _gt0(),
    "optimizer.weight_decay": _ge0(),
    "optimizer.eps": _gt0(),
    "optimizer.betas.0": Range(low=0, high=1, high_open=True),
    "optimizer.betas.1": Range(low=0, high=1, high_open=True),
    "optimizer.warmup_steps": _count(0),
}


def _lora(prefix: str) -> dict[str, Range]:
    return {
        f"{prefix}.r": _count(1),
        f"{prefix}.alpha": _gt0(),
        f"{prefix}.dropout": Range(low=0, high=1, high_open=True),
    }


#: Ranges of the stage modules' settings, by module class name (a subclass gets its base's rules).
MODEL_RULES: dict[str, dict[str, Range]] = {
    "SFTModule": {**_OPTIMIZER, **_lora("backbone.lora")},
    "RewardModule": {
        **_OPTIMIZER,
        **_lora("backbone.lora"),
        "label_smoothing": Range(low=0, high=0.5, high_open=True),
        "beta_rm": _ge0(),
        "center_rewards_coef": _ge0(),
        "ece_bins": _count(1),
        "head_init_std": _gt0(optional=True),
        "length_groups": _count(1),
    },
    "PPOModule": {
        **_OPTIMIZER,
        **_lora("backbone.lora"),
        **_lora("critic.lora"),
        "ppo.ppo_epochs": _count(1),
        "ppo.ppo_minibatch_size": _count(1),
        "ppo.micro_batch_size": _count(1, optional=True),
        "ppo.gamma": Range(low=0, high=1, low_open=True),
        "ppo.gae_lambda": Range(low=0, high=1),
        "ppo.clip_range": _gt0(),
        "ppo.dual_clip": Range(low=1, low_open=True, optional=True),
        "ppo.value_clip_range": _gt0(optional=True),
        "ppo.vf_coef": _ge0(),
        "ppo.entropy_coef": _ge0(),
        "ppo.max_grad_norm": _gt0(optional=True),
        "ppo.total_iterations": _count(1, optional=True),
        "ppo.rollout_forward_batch_size": _count(1, optional=True),
        "ppo.logprob_chunk_size": _count(1, optional=True),
        "kl.kl_coef": _ge0(),
        "kl.target_kl": _gt0(optional=True),
        "kl.horizon": _count(1),
        "sampling.max_new_tokens": _count(1),
        "sampling.min_new_tokens": _count(0),
        "sampling.temperature": _gt0(),
        "sampling.top_k": _count(0),
        "sampling.top_p": Range(low=0, high=1, low_open=True),
        "reward.clip": _gt0(optional=True),
        "reward.missing_eos_penalty": Range(optional=True),
        "critic.lr": _gt0(optional=True),
        "ptx.coef": _ge0(),
        "ptx.batch_size": _count(1),
        "ptx.max_length": _count(2),
        "log_samples_every": _count(0),
    },
}

_DATA_COMMON = {
    "batch_size": _count(1),
    "val_batch_size": _count(1, optional=True),
    "num_workers": _count(0),
    "max_train_samples_per_file": _count(1, optional=True),
    "pad_to_multiple_of": _count(1, optional=True),
    "val_size": _ge0(),
}
_DATA_LENGTHS = {
    "max_length": _count(2),
    "max_prompt_length": _count(1, optional=True),
    "min_prompt_tokens": _count(0),
}

#: Ranges of the data modules' settings, by data module class name.
DATA_RULES: dict[str, dict[str, Range]] = {
    "SFTDataModule": {**_DATA_COMMON, **_DATA_LENGTHS},
    "PreferenceDataModule": {**_DATA_COMMON, **_DATA_LENGTHS},
    "PromptDataModule": {
        **_DATA_COMMON,
        "max_prompt_length": _count(1, optional=True),
        "pad_to_length": _count(1, optional=True),
    },
}

#: Ranges of the trainer settings that would otherwise train nothing (``max_epochs: 0``) without a word.
TRAINER_RULES: dict[str, Range] = {
    "max_epochs": _count(1, optional=True, also=(-1,)),
    "max_steps": _count(1, also=(-1,)),
    "accumulate_grad_batches": _count(1),
    "gradient_clip_val": _ge0(optional=True),
    "log_every_n_steps": _count(1, optional=True),
}

_STAGE_DATA = {
    "SFTModule": "SFTDataModule",
    "RewardModule": "PreferenceDataModule",
    "PPOModule": "PromptDataModule",
}


# ------------------------------------------------------------------------------------------- helpers
def _import(class_path: str | None) -> type | None:
    if not class_path:
        return None
    import importlib

    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _kind(cls: type | None, names) -> str | None:
    """The first of ``names`` that is ``cls``'s class name or a base class's name."""
    for klass in getattr(cls, "__mro__", ()):
        if klass.__name__ in names:
            return klass.__name__
    return None


def _get(tree: Any, dotted: str, default: Any = None) -> Any:
    """``tree["a"]["b"][0]`` for ``"a.b.0"``; ``default`` where a part is missing or None."""
    node = tree
    for part in dotted.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif (
            isinstance(node, (list, tuple))
            and part.lstrip("-").isdigit()
            and -len(node) <= int(part) < len(node)
        ):
            node = node[int(part)]
        else:
            return default
        if node is None:
            return default
    return node


def _check_ranges(tree: dict, rules: dict[str, Range], prefix: str) -> None:
    for key, rule in rules.items():
        parent, _, _ = key.rpartition(".")
        if parent and _get(tree, parent) is None:
            continue  # the whole section is unset: the module's defaults apply
        container = _get(tree, parent) if parent else tree
        last = key.rpartition(".")[2]
        if isinstance(container, dict) and last in container:
            value = container[last]
        elif isinstance(container, (list, tuple)) and last.isdigit() and int(last) < len(container):
            value = container[int(last)]
        else:
            continue
        if not rule.allows(value):
            raise ConfigError(f"{prefix}{key} must be {rule.describe()}, got {value!r}")


def _files(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


# ------------------------------------------------------------------------------------------- checkpoint
def check_ckpt_path(config: Any) -> None:
    """``ckpt_path`` (if given) is a checkpoint file of the config's model class.

    Also warns (one line) when a model setting of the config differs from the checkpoint's hyper-parameters,
    which LightningCLI uses to rebuild the model.

    Raises:
        ConfigError: if the file does not exist, is not a checkpoint, or was written by another module class.
    """
    subcommand = config.get("subcommand")
    if not subcommand:
        return
    sub = config[subcommand]
    ckpt_path = sub.get("ckpt_path")
    if not ckpt_path or ckpt_path in ("last", "best", "hpc", "registry"):
        return
    path = Path(str(ckpt_path)).expanduser()
    if not path.is_file():
        what = "is a folder, not a checkpoint file" if path.is_dir() else "does not exist"
        raise ConfigError(f"ckpt_path: {ckpt_path} {what} (resolved to {path.resolve()})")
    import torch

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user mistake
        raise ConfigError(
            f"ckpt_path: {ckpt_path} is not a readable checkpoint ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})"
        ) from None
    hparams = dict(checkpoint.get("hyper_parameters") or {}) if isinstance(checkpoint, dict) else {}
    model = sub.get("model")
    config_class = model.get("class_path") if model is not None else None
    saved_class = hparams.get("_class_path")
    if saved_class and config_class and saved_class.rsplit(".", 1)[-1] != config_class.rsplit(".", 1)[-1]:
        raise ConfigError(
            f"ckpt_path: {ckpt_path} was written by {saved_class.rsplit('.', 1)[-1]}, but the config's model is "
            f"{config_class.rsplit('.', 1)[-1]}; give the config of the stage that wrote the checkpoint"
        )
    if hparams and not saved_class and _kind(_import(config_class), MODEL_RULES):
        raise ConfigError(
            f"ckpt_path: {ckpt_path} stores its hyper-parameters without '_class_path' (written before rlhf_lit "
            "stored it), so LightningCLI cannot re-parse them; resume it in Python with Trainer.fit(..., "
            "ckpt_path=...), or add hyper_parameters['_class_path'] (the module's import path) to the file"
        )
    if saved_class and model is not None:
        init = model.get("init_args")
        init = init.as_dict() if hasattr(init, "as_dict") else dict(init or {})
        differ = [key for key, mine, theirs in _diff(init, hparams) if key.split(".")[0] in hparams]
        if differ:
            import logging

            shown = ", ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
            logging.getLogger("rlhf_lit").warning(
                "ckpt_path: the model is rebuilt with the checkpoint's settings; the config's %s %s not used",
                shown,
                "differs from it and is" if len(differ) == 1 else "differ from them and are",
            )


def _diff(mine: Any, theirs: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    if mine is None and isinstance(theirs, dict):
        return  # a section the config leaves unset: the module filled in its defaults
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in mine:
            if key in theirs and not key.startswith("_"):
                yield from _diff(mine[key], theirs[key], f"{prefix}{key}.")
        return
    if isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple)):
        mine, theirs = list(mine), list(theirs)
    if mine != theirs:
        yield prefix.rstrip("."), mine, theirs


# ------------------------------------------------------------------------------------------- the config
def check_config(config: dict, subcommand: str | None = None) -> None:
    """Check a parsed config (``{"model": {"class_path", "init_args"}, "data": ..., "trainer": ...}``).

    Raises:
        ConfigError: for the first problem found (see the module docstring for the list).
    """
    model = config.get("model") or {}
    data = config.get("data") or {}
    trainer = config.get("trainer") or {}
    init = model.get("init_args") or {}
    data_init = data.get("init_args") or {}
    model_cls, data_cls = _import(model.get("class_path")), _import(data.get("class_path"))
    stage = _kind(model_cls, MODEL_RULES)
    data_kind = _kind(data_cls, DATA_RULES)

    _check_ranges(trainer, TRAINER_RULES, "trainer.")
    if stage:
        _check_ranges(init, MODEL_RULES[stage], "model.init_args.")
    if data_kind:
        _check_ranges(data_init, DATA_RULES[data_kind], "data.init_args.")
        _check_data_settings(data_kind, data_init)
    if stage and data_kind and _STAGE_DATA[stage] != data_kind:
        raise ConfigError(
            f"data.class_path: {stage} trains on {_STAGE_DATA[stage]} data, but the config gives {data_kind}; "
            f"use rlhf_lit.data.{_STAGE_DATA[stage]}"
        )
    for key in ("backbone", "reward_model.backbone"):
        if isinstance(_get(init, key), dict):
            _check_backbone(f"model.init_args.{key}", _get(init, key))
    if stage == "PPOModule":
        _check_ppo(init, data_init, trainer)
    roots = _config_roots(config)
    _check_inputs(init, data_init, stage, roots)
    if stage:
        _check_lengths(stage, init, data_init)
    _check_outputs(init, trainer, subcommand)


def _check_backbone(key: str, backbone: dict) -> None:
    """What ``BackboneConfig`` would refuse when the model is built, said before (with the config key)."""
    from rlhf_lit.models.backbone import _DTYPES

    if (backbone.get("name_or_path") is None) == (backbone.get("tiny") is None):
        raise ConfigError(
            f"{key}: give exactly one of 'name_or_path' (a folder, hub id or pypi:<package>) and 'tiny'"
        )
    if backbone.get("dtype", "float32") not in _DTYPES:
        raise ConfigError(f"{key}.dtype must be one of {sorted(_DTYPES)}, got {backbone.get('dtype')!r}")
    tiny = backbone.get("tiny")
    if tiny is not None and not isinstance(tiny, dict):
        raise ConfigError(
            f"{key}.tiny must be a transformers config dict (e.g. {{model_type: gpt2, n_layer: 2}})"
        )


def _check_data_settings(kind: str, data: dict) -> None:
    train_files = _files(data.get("train_files"))
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


def _check_ppo(init: dict, data: dict, trainer: dict) -> None:
    p = "model.init_args."
    if _get(init, "backbone.lora") is None:
        raise ConfigError(
            f"{p}backbone.lora is not set: PPO trains LoRA adapters (the reference is the base with its adapters "
            "off); add e.g. lora: {r: 8, alpha: 16, target_modules: all-linear}"
        )
    reward_model = init.get("reward_model") or {}
    if (reward_model.get("path") is None) == (reward_model.get("backbone") is None):
        raise ConfigError(
            f"{p}reward_model: give exactly one of 'path' (a trained reward model) and 'backbone'"
        )
    if reward_model.get("backbone") is not None and reward_model.get("mode", "separate") != "separate":
        raise ConfigError(
            f"{p}reward_model.backbone builds a separate model; set reward_model.mode: separate"
        )
    if _get(init, "kl.adaptive") and _get(init, "kl.target_kl") is None:
        raise ConfigError(
            f"{p}kl.adaptive is true but kl.target_kl is not set; give the KL per response to aim at"
        )
    minibatch = _get(init, "ppo.ppo_minibatch_size", 4)
    micro = _get(init, "ppo.micro_batch_size") or minibatch
    rollout = data.get("batch_size", 8)
    if rollout % minibatch:
        raise ConfigError(
            f"data.init_args.batch_size ({rollout} prompts per rollout) must be a multiple of "
            f"{p}ppo.ppo_minibatch_size ({minibatch})"
        )
    if minibatch % micro:
        raise ConfigError(
            f"{p}ppo.ppo_minibatch_size ({minibatch}) must be a multiple of {p}ppo.micro_batch_size ({micro})"
        )
    if _get(init, "sampling.min_new_tokens", 0) > _get(init, "sampling.max_new_tokens", 48):
        raise ConfigError(
            f"{p}sampling.min_new_tokens ({_get(init, 'sampling.min_new_tokens')}) must be <= sampling.max_new_tokens "
            f"({_get(init, 'sampling.max_new_tokens')})"
        )
    if _get(init, "ptx.coef", 0) > 0 and not _files(_get(init, "ptx.train_files")):
        raise ConfigError(f"{p}ptx.coef > 0 needs ptx.train_files (SFT data for the pretraining-mix term)")
    max_steps = trainer.get("max_steps", -1)
    if isinstance(max_steps, int) and max_steps > 0:
        per_iteration = _get(init, "ppo.ppo_epochs", 4) * (rollout // minibatch)
        if max_steps % per_iteration:
            raise ConfigError(
                f"trainer.max_steps={max_steps} would stop PPO inside an iteration: one iteration makes {per_iteration} "
                f"optimizer steps (ppo.ppo_epochs x rollout / ppo_minibatch_size); set {p}ppo.total_iterations "
                f"for the run's length, or max_steps to a multiple of {per_iteration} to stop early and resume later"
            )


def _config_roots(config: dict) -> list[Path]:
    from rlhf_lit.stage_outputs import configs_root_of

    files = config.get("config") or []
    return configs_root_of([str(f) for f in (files if isinstance(files, list) else [files]) if f])


def _check_inputs(init: dict, data: dict, stage: str | None, roots: list[Path]) -> None:
    problems = []
    for key in ("backbone", "reward_model.backbone"):
        name = _get(init, f"{key}.name_or_path")
        if name:
            problems.append(
                _model_folder_problem(
                    f"model.init_args.{key}.name_or_path", name, roots, _get(init, f"{key}.gguf_file")
                )
            )
    path = _get(init, "reward_model.path")
    if path:
        problems.append(_model_folder_problem("model.init_args.reward_model.path", path, roots))
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError("; ".join(problems))
    for key, files in (
        ("data.init_args.train_files", data.get("train_files")),
        ("data.init_args.val_files", data.get("val_files")),
        ("model.init_args.ptx.train_files", _get(init, "ptx.train_files")),
    ):
        for index, spec in enumerate(_files(files)):
            _check_data_file(f"{key}[{index}]" if not isinstance(files, str) else key, spec)


def _model_folder_problem(key: str, name: str, roots: list[Path], gguf_file: str | None = None) -> str | None:
    from rlhf_lit.models.backbone import resolve_path
    from rlhf_lit.stage_outputs import holds_model, producing_config, stage_of

    try:
        path = resolve_path(name)
    except ValueError as err:  # pypi:<package> that is not installed
        return f"{key}: {err}"
    if gguf_file:
        file = os.path.join(path, gguf_file)
        return None if os.path.isfile(file) else f"{key}: no GGUF file {file}"
    if holds_model(path):
        return None
    found = producing_config(name, roots)
    if found is not None:
        config_file, spec = found
        try:
            shown = os.path.relpath(config_file)
        except ValueError:
            shown = str(config_file)
        return (
            f"{key}: {name} holds no model yet; it is written by the {stage_of(spec)} stage: "
            f"run rlhf-lit fit --config {shown} first"
        )
    if os.path.isdir(path):
        return f"{key}: {name} is not a model folder (no config.json or rlhf_lit.json in it)"
    if name.startswith(("/", ".", "~")) or name.count("/") >= 2:  # a hub id is "org/name"
        return f"{key}: no such model folder {name} (resolved to {Path(path).resolve()})"
    return None  # a hub id: loaded (or refused) by transformers


def _check_data_file(key: str, spec: str) -> None:
    from rlhf_lit.data.loading import is_hub_id, is_registered_source

    if is_hub_id(spec) or is_registered_source(spec):
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        raise ConfigError(f"{key}: {spec} is a folder; give a data file (.jsonl, .json, .parquet, .csv)")
    if not path.is_file():
        raise ConfigError(f"{key}: data file not found: {spec} (resolved to {path.resolve()})")


# ------------------------------------------------------------------------------------------- lengths
def model_positions(backbone: dict | Any) -> int | None:
    """The most positions (tokens) a backbone's model takes, read from its config (no weights); None if
    unknown (a hub id not cached offline, a GGUF file, or a config without a position limit)."""
    from dataclasses import asdict, is_dataclass

    from rlhf_lit.models.architecture import read_architecture
    from rlhf_lit.models.backbone import BackboneConfig

    spec = asdict(backbone) if is_dataclass(backbone) else dict(backbone or {})
    if spec.get("gguf_file"):
        return None  # reading a GGUF file's metadata takes seconds (its whole vocabulary); the load will tell
    try:
        config, _ = read_architecture(BackboneConfig(**{**spec, "lora": None}), None)
    except Exception:  # noqa: BLE001 - unknown here; the model load will say what is wrong
        return None
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _check_lengths(stage: str, init: dict, data: dict) -> None:
    backbone = init.get("backbone")
    if not backbone:
        return
    positions = model_positions(backbone)
    if positions is None:
        return
    if stage in ("SFTModule", "RewardModule"):
        max_length = data.get("max_length")
        if isinstance(max_length, int) and max_length > positions:
            raise ConfigError(
                f"data.init_args.max_length ({max_length}) exceeds the model's {positions} positions "
                f"(max_position_embeddings of model.init_args.backbone); set max_length <= {positions}"
            )
        return
    new_tokens = _get(init, "sampling.max_new_tokens", 48)
    limit = data.get("max_prompt_length") or data.get("pad_to_length")
    if limit is not None and limit + new_tokens > positions:
        raise ConfigError(
            f"data.init_args.max_prompt_length ({limit}) + model.init_args.sampling.max_new_tokens ({new_tokens}) "
            f"= {limit + new_tokens} tokens exceed the policy's {positions} positions; lower one of them"
        )
    ptx_length = _get(init, "ptx.max_length")
    if _get(init, "ptx.coef", 0) > 0 and ptx_length and ptx_length > positions:
        raise ConfigError(
            f"model.init_args.ptx.max_length ({ptx_length}) exceeds the policy's {positions} positions"
        )


def check_data_fits_model(model: Any, datamodule: Any) -> None:
    """After the data is read: a reward model gets pairs; PPO prompts without a length limit leave room for
    the response.

    Raises:
        ConfigError: if a RewardModule gets unpaired data, or the longest prompt plus
            ``sampling.max_new_tokens`` exceeds the policy's positions.
    """
    if getattr(datamodule, "unpaired", False) and _kind(type(model), ("RewardModule",)):
        raise ConfigError(
            "data: the preference files hold unpaired (KTO-style) completions, but RewardModule trains on pairs; "
            "set data.init_args.pair_unpaired: true to pair each desirable completion with the undesirable ones "
            "of the same prompt"
        )
    sampling = getattr(model, "sampling", None)
    backbone = getattr(model, "backbone_cfg", None)
    dataset = getattr(datamodule, "train_dataset", None)
    if (
        sampling is None
        or backbone is None
        or dataset is None
        or getattr(datamodule, "stage", "") != "prompt"
    ):
        return
    if getattr(datamodule, "max_prompt_length", None) is not None and datamodule.max_prompt_length < 1 << 30:
        return  # checked before loading (check_config)
    positions = model_positions(backbone)
    if positions is None:
        return
    splits = [dataset] + ([datamodule.val_dataset] if datamodule.val_dataset is not None else [])
    longest = max((len(e["prompt_ids"]) for split in splits for e in split.examples), default=0)
    if longest + sampling.max_new_tokens > positions:
        raise ConfigError(
            f"the longest prompt ({longest} tokens) + model.init_args.sampling.max_new_tokens "
            f"({sampling.max_new_tokens}) exceed the policy's {positions} positions; set "
            f"data.init_args.max_prompt_length <= {positions - sampling.max_new_tokens} (prompts are cut from the left)"
        )


# ------------------------------------------------------------------------------------------- outputs
def _output_dirs(init: dict, trainer: dict, subcommand: str | None) -> Iterator[tuple[str, str]]:
    if subcommand in (None, "fit") and init.get("export_dir"):
        yield "model.init_args.export_dir", init["export_dir"]
    if trainer.get("default_root_dir"):
        yield "trainer.default_root_dir", trainer["default_root_dir"]
    loggers = trainer.get("logger")
    loggers = loggers if isinstance(loggers, list) else [loggers]
    for i, logger in enumerate(loggers):
        save_dir = _get(logger, "init_args.save_dir") if isinstance(logger, dict) else None
        if save_dir:
            yield (
                ("trainer.logger" + (f"[{i}]" if len(loggers) > 1 else "") + ".init_args.save_dir"),
                save_dir,
            )
    callbacks = trainer.get("callbacks") or []
    for i, callback in enumerate(callbacks if isinstance(callbacks, list) else [callbacks]):
        if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("ModelCheckpoint"):
            dirpath = _get(callback, "init_args.dirpath")
            if dirpath:
                yield f"trainer.callbacks[{i}].init_args.dirpath", dirpath


def _check_outputs(init: dict, trainer: dict, subcommand: str | None) -> None:
    for key, value in _output_dirs(init, trainer, subcommand):
        problem = _not_writable(str(value))
        if problem:
            raise ConfigError(f"{key}: cannot write to {value}: {problem}")


def _not_writable(path: str) -> str | None:
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        return "it is a file, not a folder"
    probe = target
    while not probe.exists():
        if probe.parent == probe:
            return "no existing parent folder"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe.resolve()} is not writable" if probe != target else "the folder is not writable"
    return None
