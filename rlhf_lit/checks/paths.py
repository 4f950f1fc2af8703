"""Inputs exist (models, data files) and outputs are writable (export, log and checkpoint folders)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from rlhf_lit.checks.rules import file_list, get
from rlhf_lit.errors import ConfigError

__all__ = ["check_inputs", "check_outputs", "config_roots"]


def config_roots(config: dict) -> list[Path]:
    from rlhf_lit.stage_outputs import configs_root_of

    files = config.get("config") or []
    return configs_root_of([str(f) for f in (files if isinstance(files, list) else [files]) if f])


def check_inputs(init: dict, data: dict, stage: object, roots: list[Path]) -> None:
    problems = []
    for key in ("backbone", "reward_model.backbone"):
        name = get(init, f"{key}.name_or_path")
        if name:
            problems.append(
                _model_folder_problem(
                    f"model.init_args.{key}.name_or_path", name, roots, get(init, f"{key}.gguf_file")
                )
            )
    path = get(init, "reward_model.path")
    if path:
        problems.append(_model_folder_problem("model.init_args.reward_model.path", path, roots))
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError("; ".join(problems))
    for key, files in (
        ("data.init_args.train_files", data.get("train_files")),
        ("data.init_args.val_files", data.get("val_files")),
        ("model.init_args.ptx.train_files", get(init, "ptx.train_files")),
    ):
        for index, spec in enumerate(file_list(files)):
            _check_data_file(f"{key}[{index}]" if not isinstance(files, str) else key, spec)


def _model_folder_problem(key: str, name: str, roots: list[Path], gguf_file: str | None = None) -> str | None:
    from rlhf_lit.models.model_files import resolve_path
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


def _output_dirs(init: dict, trainer: dict, subcommand: str | None) -> Iterator[tuple[str, str]]:
    if subcommand in (None, "fit") and init.get("export_dir"):
        yield "model.init_args.export_dir", init["export_dir"]
    if trainer.get("default_root_dir"):
        yield "trainer.default_root_dir", trainer["default_root_dir"]
    loggers = trainer.get("logger")
    loggers = loggers if isinstance(loggers, list) else [loggers]
    for i, logger in enumerate(loggers):
        save_dir = get(logger, "init_args.save_dir") if isinstance(logger, dict) else None
        if save_dir:
            yield (
                ("trainer.logger" + (f"[{i}]" if len(loggers) > 1 else "") + ".init_args.save_dir"),
                save_dir,
            )
    callbacks = trainer.get("callbacks") or []
    for i, callback in enumerate(callbacks if isinstance(callbacks, list) else [callbacks]):
        if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("ModelCheckpoint"):
            dirpath = get(callback, "init_args.dirpath")
            if dirpath:
                yield f"trainer.callbacks[{i}].init_args.dirpath", dirpath


def check_outputs(init: dict, trainer: dict, subcommand: str | None) -> None:
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
