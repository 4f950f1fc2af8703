"""The allowed ranges of numeric settings, and the helpers that read a parsed config as dicts.

A stage module's ranges (:func:`model_ranges`) are those declared on the fields of its settings dataclasses
(:mod:`rlhf_lit.ranges`: ``optimizer.lr``, ``backbone.lora.r``, ``ppo.gamma``, ``kl.kl_coef``, ...), found by
walking the module's ``__init__`` annotations, the module class's ``ARG_RANGES`` (its plain ``__init__``
arguments, which its ``__init__`` checks with the same declarations) and :data:`MODEL_RULES` for the optimizer's
tuple items.
"""

from __future__ import annotations

from typing import Any

from rlhf_lit.errors import ConfigError
from rlhf_lit.ranges import Range, dataclass_ranges

__all__ = [
    "DATA_RULES",
    "MODEL_RULES",
    "TRAINER_RULES",
    "PLAN_RULES",
    "Range",
    "check_ranges",
    "file_list",
    "get",
    "import_class",
    "model_ranges",
    "range_of",
]


def _gt0(**kw) -> Range:
    return Range(low=0, low_open=True, **kw)


def _ge0(**kw) -> Range:
    return Range(low=0, **kw)


def _count(low: int = 1, **kw) -> Range:
    return Range(low=low, integer=True, **kw)


# lr, weight_decay, eps, warmup_steps: declared on OptimizerConfig; a tuple's items are checked here
_OPTIMIZER = {
    "optimizer.betas.0": Range(low=0, high=1, high_open=True),
    "optimizer.betas.1": Range(low=0, high=1, high_open=True),
}


#: Ranges of ``rlhf-lit plan``'s own options (by option name; an option left unset is not checked).
PLAN_RULES: dict[str, Range] = {
    "device-memory-gb": _gt0(),
    "world-size": _count(1),
    "response-len": _count(1),
}


#: Ranges of the stage modules' settings that neither their dataclasses nor their classes (``ARG_RANGES``: plain
#: ``__init__`` arguments) declare, by stage name: the optimizer's tuple items.
MODEL_RULES: dict[str, dict[str, Range]] = {stage: {**_OPTIMIZER} for stage in ("sft", "reward", "dpo", "ppo")}

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


# ------------------------------------------------------------------------------------------- helpers
def import_class(class_path: str | None) -> type | None:
    if not class_path:
        return None
    import importlib

    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def range_of(key: str, section_class: type | None = None) -> Range | None:
    """The declared range of a setting, by its key as the user writes it (``model.init_args.optimizer.lr``,
    ``data.init_args.batch_size``, ``trainer.max_epochs``); ``section_class`` is the class the config gives
    its ``model`` or ``data`` section. None where no range is declared.

    The same declarations :func:`check_ranges` reads: :func:`model_ranges`, :data:`DATA_RULES`,
    :data:`TRAINER_RULES`.
    """
    section, _, rest = key.partition(".")
    if section == "trainer":
        return TRAINER_RULES.get(rest)
    rest = rest.removeprefix("init_args.")
    if section == "model" and section_class is not None:
        from rlhf_lit.stages import find_stage

        return model_ranges(section_class, find_stage(section_class)).get(rest)
    if section == "data" and section_class is not None:
        from rlhf_lit.stages import data_kind

        kind = data_kind(section_class)
        return DATA_RULES.get(kind.rsplit(".", 1)[-1], {}).get(rest) if kind else None
    return None


def model_ranges(model_cls: type, stage: Any) -> dict[str, Range]:
    """Every range of a stage module's settings (keys relative to ``model.init_args``): those declared on the
    dataclasses its ``__init__`` takes, its class's ``ARG_RANGES`` (plain arguments), then :data:`MODEL_RULES` for
    ``stage`` (a :class:`~rlhf_lit.stages.StageSpec`)."""
    import inspect
    import sys

    from rlhf_lit.ranges import dataclass_in

    found: dict[str, Range] = {}
    for klass in reversed(getattr(model_cls, "__mro__", ())):
        annotations = getattr(klass.__dict__.get("__init__"), "__annotations__", {}) or {}
        namespace = vars(sys.modules.get(klass.__module__)) if klass.__module__ in sys.modules else {}
        for name, hint in annotations.items():
            if name == "return":
                continue
            if isinstance(hint, str):
                try:
                    hint = eval(hint, dict(namespace))  # noqa: S307 - the module's own annotation
                except Exception:  # noqa: BLE001 - a name only imported for type checking: no ranges from it
                    continue
            nested = dataclass_in(hint)
            if nested is not None and not inspect.isabstract(nested):
                found.update(dataclass_ranges(nested, f"{name}."))
    for klass in reversed(getattr(model_cls, "__mro__", ())):
        found.update(klass.__dict__.get("ARG_RANGES", {}))  # the plain __init__ arguments' ranges
    found.update(MODEL_RULES.get(getattr(stage, "name", stage), {}))
    return found


def get(tree: Any, dotted: str, default: Any = None) -> Any:
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


def check_ranges(tree: dict, rules: dict[str, Range], prefix: str) -> None:
    for key, rule in rules.items():
        parent, _, _ = key.rpartition(".")
        if parent and get(tree, parent) is None:
            continue  # the whole section is unset: the module's defaults apply
        container = get(tree, parent) if parent else tree
        last = key.rpartition(".")[2]
        if isinstance(container, dict) and last in container:
            value = container[last]
        elif isinstance(container, (list, tuple)) and last.isdigit() and int(last) < len(container):
            value = container[int(last)]
        else:
            continue
        message = rule.refusal(f"{prefix}{key}", value)
        if message:
            raise ConfigError(message)


def file_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]
