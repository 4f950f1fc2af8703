"""The stage table: what a training stage is, in one place that every other part reads.

One :class:`StageSpec` per stage names its LightningModule and the data module it trains on (as import paths,
so reading the table imports nothing heavy), the checks that run on its config before anything loads, the
memory planner's phase for it, the label of its progress bar and the kind of export it writes. The CLI's checks
(:mod:`rlhf_lit.checks`: the stage/data pairing, the stage's own consistency rules, lengths), the planner
(:mod:`rlhf_lit.planner.settings`), the progress bar (:mod:`rlhf_lit.callbacks.progress`) and the "which stage
writes this folder" hints (:mod:`rlhf_lit.stage_outputs`) all look a stage up here.

A module class is matched by itself or by any of its base classes, so a user's subclass of ``SFTModule`` is the
SFT stage. A class that matches no stage is not one of ours: ``rlhf-lit fit`` still trains it (any
LightningModule works) but runs no stage checks; the planner refuses it with one line.

Adding a stage is one :func:`register_stage` call (here, for the package's own stages) plus its module.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from rlhf_lit.errors import ConfigError

__all__ = [
    "STAGES",
    "StageSpec",
    "class_paths",
    "data_kind",
    "find_stage",
    "find_stage_by_path",
    "import_path",
    "public_path",
    "register_stage",
    "stage_for",
]


@dataclass(frozen=True)
class StageSpec:
    """One training stage.

    Attributes:
        name: short lower-case name: the progress bar's label (``[sft] epoch 0``; see :attr:`variants`) and the key
            of this table.
        title: how messages name the stage ("the SFT stage").
        module: import path of the stage's LightningModule (``rlhf_lit.modules.sft.SFTModule``).
        data: import path of the data module it trains on; a config pairing the stage with another of the
            table's data modules is refused before loading.
        checks: import paths of functions ``check(init, data_init, trainer)`` (the parsed
            ``model.init_args``, ``data.init_args`` and ``trainer`` as dicts) that raise
            :class:`~rlhf_lit.errors.ConfigError` for settings of this stage that cannot work together.
        planner_phase: how the memory planner models a step of this stage (``sft``, ``reward``, ``ppo`` or
            ``dpo``), or None where the planner does not support the stage (``rlhf-lit plan`` refuses it with one line).
        export_kind: the ``kind`` its Hugging Face export records in ``rlhf_lit.json`` (``policy``,
            ``reward_model``).
        progress: what the progress bar counts: ``epochs``, or ``iterations`` (one rollout each).
        generates: the stage samples responses to prompts, so prompt length + ``sampling.max_new_tokens`` must
            fit the model's positions (otherwise ``data.max_length`` must).
        trains_on_pairs: the stage needs chosen/rejected pairs (unpaired preference rows are refused).
        variants: labels of the stage's named variants, ``(hyper-parameter, value, label)``: a module built with
            that value is shown as ``label`` (DPO with ``loss_type: kto`` is ``[kto]``).
    """

    name: str
    title: str
    module: str
    data: str
    checks: tuple[str, ...] = ()
    planner_phase: str | None = None
    export_kind: str = "policy"
    progress: str = "epochs"
    generates: bool = False
    trains_on_pairs: bool = False
    variants: tuple[tuple[str, str, str], ...] = ()

    def label(self, settings: dict[str, Any] | None = None) -> str:
        """The progress bar's label of a run of this stage whose module was built with ``settings`` (its
        hyper-parameters, e.g. ``{"loss_type": "kto"}``): its variant's label, or :attr:`name`."""
        for key, value, label in self.variants:
            if (settings or {}).get(key) == value:
                return label
        return self.name

    def run_checks(self, init: dict, data_init: dict, trainer: dict) -> None:
        """Run this stage's consistency checks (:attr:`checks`) on a parsed config."""
        for path in self.checks:
            import_path(path)(init, data_init, trainer)


#: Every stage, by :attr:`StageSpec.name`, in pipeline order. Extend with :func:`register_stage`.
STAGES: dict[str, StageSpec] = {}


def register_stage(spec: StageSpec) -> StageSpec:
    """Add (or replace) a stage in :data:`STAGES`; returns ``spec``.

    Raises:
        ValueError: if another stage already uses the same module class path.
    """
    for other in STAGES.values():
        if other.module == spec.module and other.name != spec.name:
            raise ValueError(f"stage {other.name!r} already uses {spec.module}")
    STAGES[spec.name] = spec
    return spec


register_stage(
    StageSpec(
        name="sft",
        title="SFT",
        module="rlhf_lit.modules.sft.SFTModule",
        data="rlhf_lit.data.sft.SFTDataModule",
        planner_phase="sft",
        export_kind="policy",
    )
)
register_stage(
    StageSpec(
        name="reward",
        title="reward",
        module="rlhf_lit.modules.reward.RewardModule",
        data="rlhf_lit.data.preference.PreferenceDataModule",
        planner_phase="reward",
        export_kind="reward_model",
        checks=("rlhf_lit.checks.check_reward_settings",),
        trains_on_pairs=True,
    )
)
register_stage(
    StageSpec(
        name="ppo",
        title="PPO",
        module="rlhf_lit.modules.ppo.PPOModule",
        data="rlhf_lit.data.prompts.PromptDataModule",
        checks=("rlhf_lit.checks.check_ppo_settings",),
        planner_phase="ppo",
        export_kind="policy",
        progress="iterations",
        generates=True,
    )
)
register_stage(
    StageSpec(
        name="dpo",
        title="DPO",
        module="rlhf_lit.modules.dpo.DPOModule",
        data="rlhf_lit.data.preference.PreferenceDataModule",
        planner_phase="dpo",
        export_kind="policy",
        # pairs or unpaired rows, by loss_type (KTO): checked after the data is read (checks.lengths)
        trains_on_pairs=False,
        variants=(("loss_type", "kto", "kto"),),
    )
)


# ------------------------------------------------------------------------------------------- look-ups
def import_path(path: str) -> Any:
    """The object at ``package.module.Name`` (imports the module)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def class_paths(cls: type) -> list[str]:
    """``module.QualName`` of ``cls`` and of each of its base classes, most derived first."""
    return [f"{k.__module__}.{k.__qualname__}" for k in getattr(cls, "__mro__", ())]


def _public_paths(path: str) -> set[str]:
    """A class path and its package re-export (``rlhf_lit.modules.sft.SFTModule`` -> also
    ``rlhf_lit.modules.SFTModule``), the two spellings a config may use."""
    module, _, name = path.rpartition(".")
    package = module.rpartition(".")[0]
    return {path, f"{package}.{name}"} if package else {path}


def public_path(path: str) -> str:
    """How a config spells the class at ``path``: its package's re-export (``rlhf_lit.data.sft.SFTDataModule``
    -> ``rlhf_lit.data.SFTDataModule``) when the package exports that same class, else ``path`` (imports both)."""
    module, _, name = path.rpartition(".")
    package = module.rpartition(".")[0]
    try:
        exported = getattr(importlib.import_module(package), name, None) if package else None
        if exported is not None and exported is import_path(path):
            return f"{package}.{name}"
    except (ImportError, AttributeError, ValueError):
        pass
    return path


def find_stage(cls: type | None) -> StageSpec | None:
    """The stage whose module is ``cls`` or one of its base classes (the most derived match); None if none."""
    for path in class_paths(cls) if cls is not None else ():
        for spec in STAGES.values():
            if path == spec.module:
                return spec
    return None


def find_stage_by_path(class_path: str | None) -> StageSpec | None:
    """The stage of a config's ``model.class_path`` string: by its spelling if it is a stage module's path (no
    import), else by importing the class and matching its bases; None if it is not a stage (or not importable).
    """
    if not class_path:
        return None
    for spec in STAGES.values():
        if class_path in _public_paths(spec.module):
            return spec
    try:
        cls = import_path(class_path)
    except (ImportError, AttributeError, ValueError):
        return None
    return find_stage(cls) if isinstance(cls, type) else None


def stage_for(cls_or_path: type | str, key: str = "model.class_path") -> StageSpec:
    """Like :func:`find_stage` / :func:`find_stage_by_path`, but a class that is no stage is a user error.

    Raises:
        ConfigError: naming ``key``, the class and the known stages' modules.
    """
    spec = find_stage_by_path(cls_or_path) if isinstance(cls_or_path, str) else find_stage(cls_or_path)
    if spec is None:
        name = (
            cls_or_path
            if isinstance(cls_or_path, str)
            else f"{cls_or_path.__module__}.{cls_or_path.__qualname__}"
        )
        known = ", ".join(f"{s.name} ({s.module.rsplit('.', 1)[-1]})" for s in STAGES.values())
        raise ConfigError(
            f"{key}: {name} is not an rlhf_lit stage module or a subclass of one; stages: {known}"
        )
    return spec


def data_kind(cls: type | None) -> str | None:
    """The table's data module class path that ``cls`` is or derives from; None for another data module."""
    known = {spec.data for spec in STAGES.values()}
    for path in class_paths(cls) if cls is not None else ():
        if path in known:
            return path
    return None
