"""Which stage writes a folder: the configs under ``configs/`` whose ``model.init_args.export_dir`` it is.

A PPO config names the SFT export as its base and the reward export as its reward model; before those stages
have run, the folders hold no model. The memory planner reads the producing stage's backbone from here, and
the CLI's checks (:mod:`rlhf_lit.checks`) say which stage to run first instead of letting a hub lookup fail.
Configs are read as YAML only (their ``export_dir`` and ``backbone``); nothing is instantiated.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from rlhf_lit.models.model_files import resolve_path

__all__ = ["configs_root_of", "holds_model", "not_written_yet", "producing_config", "stage_of"]

MODEL_FILES = ("config.json", "rlhf_lit.json")
_STAGES = {"SFTModule": "SFT", "RewardModule": "reward", "DPOModule": "DPO", "PPOModule": "PPO"}


def holds_model(path: str) -> bool:
    """True if the folder holds a model (a ``config.json``, or an rlhf_lit export's ``rlhf_lit.json``)."""
    return any(os.path.exists(os.path.join(path, f)) for f in MODEL_FILES)


def not_written_yet(name_or_path: str) -> bool:
    """A local path (an earlier stage's export) that holds no model yet; hub ids are not local paths."""
    path = resolve_path(name_or_path)
    looks_local = name_or_path.startswith((".", "/", "~", "checkpoints")) or os.path.isdir(path)
    return looks_local and not holds_model(path)


def configs_root_of(config_files: list[str] | None) -> list[Path]:
    """The ``configs/`` folders to search: the one above each given config file, then ``./configs``."""
    roots: list[Path] = []
    for file in config_files or []:
        root = Path(str(file)).resolve().parent
        while root.name and root.name != "configs" and root.parent != root:
            root = root.parent
        if root.name == "configs" and root not in roots:
            roots.append(root)
    if Path("configs").is_dir() and Path("configs").resolve() not in roots:
        roots.append(Path("configs").resolve())
    return roots


def producing_config(path: str, roots: list[Path] | Path) -> tuple[Path, dict] | None:
    """The first config under ``roots`` (sorted) whose ``model.init_args.export_dir`` is ``path``, and its
    YAML as a dict; None if no config writes it. Paths compare after ``normpath`` (both relative to the
    working directory, as the CLI reads them)."""
    for root in [roots] if isinstance(roots, Path) else roots:
        for candidate in sorted(root.rglob("*.yaml")):
            try:
                spec = yaml.safe_load(candidate.read_text()) or {}
            except yaml.YAMLError:
                continue
            init = ((spec.get("model") or {}) if isinstance(spec, dict) else {}).get("init_args") or {}
            export_dir = init.get("export_dir")
            if isinstance(export_dir, str) and os.path.normpath(export_dir) == os.path.normpath(path):
                return candidate, spec
    return None


def stage_of(spec: dict) -> str:
    """``SFT`` / ``reward`` / ``PPO`` for a config dict (by its model class), else the class name."""
    class_path = str((spec.get("model") or {}).get("class_path", ""))
    name = class_path.rsplit(".", 1)[-1]
    return _STAGES.get(name, name or "unknown")
