"""``ckpt_path``: a checkpoint of the config's model class, and a warning for settings the checkpoint overrides."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlhf_lit.checks.rules import import_class
from rlhf_lit.errors import ConfigError

__all__ = ["RUN_CONTROL_SETTINGS", "check_ckpt_path", "last_checkpoint", "run_control_values"]

#: The module settings (``model.init_args.<key>``) that control a run, not its weights: where it writes, how
#: long it trains, how often it logs and checkpoints, where its vLLM server is. On resume (``--ckpt_path``) the config's value is used,
#: as Lightning uses the config's ``trainer`` settings (``max_steps``, ``max_epochs``, callbacks); every other
#: module setting (the model's shapes, the training math) is rebuilt from the checkpoint's hyper-parameters.
#: The value says why changing the setting makes the resumed run differ from an uninterrupted run of the
#: checkpoint's settings (None: it does not).
RUN_CONTROL_SETTINGS: dict[str, str | None] = {
    "export_dir": None,
    "export_mode": None,
    "reference_cache": None,
    "log_samples_every": None,
    "ppo.checkpoint_every": None,
    # where the vLLM server runs: a server restarted on another port after it died resumes the run
    "sampling.vllm.url": None,
    "sampling.vllm.timeout_s": None,
    "sampling.vllm.weights_dir": None,
    # where and with what resources the engine runs (server or in the training process): not what it samples
    "sampling.vllm.mode": None,
    "sampling.vllm.max_model_len": None,
    "sampling.vllm.gpu_memory_utilization": None,
    "sampling.vllm.kv_cache_mib": None,
    "ppo.total_iterations": "the learning-rate schedule is sized from it (unless optimizer.scheduler is "
    "constant), so the learning rates from here on differ from the checkpoint's run",
}


def check_ckpt_path(config: Any) -> None:
    """``ckpt_path`` (if given) is a checkpoint file of the config's model class.

    Also warns (one line) when a model setting of the config differs from the checkpoint's hyper-parameters,
    which LightningCLI uses to rebuild the model, and says (one line) which :data:`RUN_CONTROL_SETTINGS` the
    config changes and are used: a warning when a change makes the run differ from an exact resume, else info.

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
    if hparams and not saved_class and _is_stage(config_class):
        raise ConfigError(
            f"ckpt_path: {ckpt_path} stores its hyper-parameters without '_class_path' (written before rlhf_lit "
            "stored it), so LightningCLI cannot re-parse them; resume it in Python with Trainer.fit(..., "
            "ckpt_path=...), or add hyper_parameters['_class_path'] (the module's import path) to the file"
        )
    if saved_class and model is not None:
        init = model.get("init_args")
        init = init.as_dict() if hasattr(init, "as_dict") else dict(init or {})
        import logging

        changes = [(key, mine, theirs) for key, mine, theirs in _diff(init, hparams) if key.split(".")[0] in hparams]
        differ = [key for key, _, _ in changes if key not in RUN_CONTROL_SETTINGS]
        control = [(key, mine, theirs) for key, mine, theirs in changes if key in RUN_CONTROL_SETTINGS]
        if control:
            breaking = [f"{key}: {RUN_CONTROL_SETTINGS[key]}" for key, _, _ in control if RUN_CONTROL_SETTINGS[key]]
            logging.getLogger("rlhf_lit").log(
                logging.WARNING if breaking else logging.INFO,
                "ckpt_path: the config's %s %s used (where the run writes, how long it trains, how often it logs "
                "and checkpoints follow the config; the model's settings follow the checkpoint)%s",
                ", ".join(f"{key}={mine!r} (the checkpoint's {theirs!r})" for key, mine, theirs in control),
                "is" if len(control) == 1 else "are",
                "; not an exact resume: " + "; ".join(breaking) if breaking else "",
            )
        if differ:
            shown = ", ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
            logging.getLogger("rlhf_lit").warning(
                "ckpt_path: the model is rebuilt with the checkpoint's settings; the config's %s %s not used",
                shown,
                "differs from it and is" if len(differ) == 1 else "differ from them and are",
            )


def run_control_values(config: Any) -> dict[str, Any]:
    """The :data:`RUN_CONTROL_SETTINGS` a parsed subcommand config (a jsonargparse ``Namespace``) sets:
    ``{"model.init_args.<key>": value}`` for each key whose section is present."""
    values = {}
    for key in RUN_CONTROL_SETTINGS:
        full = f"model.init_args.{key}"
        try:
            values[full] = config[full]
        except (KeyError, TypeError, AttributeError):
            continue  # the module has no such setting, or the section is unset
    return values


def last_checkpoint(config: dict[str, Any]) -> str | None:
    """The file ``--ckpt_path last`` resumes from for a parsed ``fit`` / ``validate`` config (plain dicts): the
    newest ``last*.ckpt`` (by modification time, as Lightning picks among its candidates) in the config's
    checkpoint folders (``rlhf_lit.outputs.checkpoint_folders``); None when there is none."""
    import os

    from rlhf_lit.outputs import checkpoint_folders

    found = [
        os.path.join(folder, name)
        for folder in dict.fromkeys(checkpoint_folders(config))
        if os.path.isdir(folder)
        for name in os.listdir(folder)
        if name.startswith("last") and name.endswith(".ckpt")
    ]
    return max(found, key=os.path.getmtime) if found else None


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


def _is_stage(class_path: str | None) -> bool:
    from rlhf_lit.stages import find_stage

    return find_stage(import_class(class_path)) is not None
