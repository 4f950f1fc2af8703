"""The allowed ranges of numeric settings, by class, and the helpers that read a parsed config as dicts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rlhf_lit.errors import ConfigError

__all__ = [
    "DATA_RULES",
    "MODEL_RULES",
    "STAGE_DATA",
    "TRAINER_RULES",
    "Range",
    "check_ranges",
    "file_list",
    "get",
    "import_class",
    "kind",
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
    "DPOModule": {
        **_OPTIMIZER,
        **_lora("backbone.lora"),
        "beta": _gt0(),
        "label_smoothing": Range(low=0, high=0.5, high_open=True),
        "simpo_gamma": Range(),
        "nll_coef": _ge0(),
        "desirable_weight": _ge0(),
        "undesirable_weight": _ge0(),
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
        "sampling.num_samples_per_prompt": _count(1),
        "ppo.loss_norm_constant": _gt0(optional=True),
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

STAGE_DATA = {
    "SFTModule": "SFTDataModule",
    "RewardModule": "PreferenceDataModule",
    "DPOModule": "PreferenceDataModule",
    "PPOModule": "PromptDataModule",
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


def kind(cls: type | None, names) -> str | None:
    """The first of ``names`` that is ``cls``'s class name or a base class's name."""
    for klass in getattr(cls, "__mro__", ()):
        if klass.__name__ in names:
            return klass.__name__
    return None


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
        if not rule.allows(value):
            raise ConfigError(f"{prefix}{key} must be {rule.describe()}, got {value!r}")


def file_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]
