"""The algorithm registry: the one place that knows what each advantage estimator needs.

An :class:`AlgorithmSpec` names an estimator (``ppo.advantage_estimator``) and declares its facts: how to
build it, whether it needs a critic (a critic adapter and value head are built only then), whether it
compares groups of responses to one prompt (``sampling.num_samples_per_prompt >= 2``), its default loss
aggregation and its default KL placement. ``PPOConfig``'s defaults and validation, ``rlhf_lit.checks``, the
planner and ``PPOModule`` all read them from here, so a new algorithm is one :func:`register_algorithm` call::

    register_algorithm(AlgorithmSpec("my_pg", lambda ppo, n: MyEstimator(ppo.gamma), needs_critic=False))

after which ``ppo.advantage_estimator: my_pg`` works (the module registering it must be imported first,
e.g. by a reward-function module the config names, or by the script that builds the module).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rlhf_lit.errors import ConfigError
from rlhf_lit.functional.aggregation import AGGREGATIONS
from rlhf_lit.rl.estimators import AdvantageEstimator, GAEEstimator, GroupEstimator, ReinforcePPEstimator

__all__ = [
    "AGGREGATIONS",
    "AlgorithmSpec",
    "algorithm_names",
    "build_estimator",
    "get_algorithm",
    "register_algorithm",
]


@dataclass(frozen=True)
class AlgorithmSpec:
    """What one advantage estimator is and needs.

    Args:
        name: the ``ppo.advantage_estimator`` value.
        estimator: ``(ppo_settings, group_size) -> AdvantageEstimator``: builds the estimator from the
            ``PPOConfig`` and ``sampling.num_samples_per_prompt``.
        needs_critic: it reads ``rollout.old_values``; the module builds a critic adapter and a value head only
            then, and the objective has a value term only then.
        needs_groups: it compares the responses to one prompt: ``num_samples_per_prompt >= 2`` is required.
        loss_aggregation: the default ``ppo.loss_aggregation`` (one of :data:`AGGREGATIONS`), or a function of
            the ``PPOConfig`` giving it (GRPO's depends on ``scale_by_std``).
        kl_placement: the default ``ppo.kl_placement``: ``reward`` or ``loss``.
    """

    name: str
    estimator: Callable[[Any, int], AdvantageEstimator]
    needs_critic: bool
    needs_groups: bool = False
    loss_aggregation: str | Callable[[Any], str] = "token_mean"
    kl_placement: Literal["reward", "loss"] = "reward"

    def default_aggregation(self, ppo) -> str:
        """The loss aggregation this algorithm uses when ``ppo.loss_aggregation`` is unset."""
        agg = self.loss_aggregation
        return agg(ppo) if callable(agg) else agg


_REGISTRY: dict[str, AlgorithmSpec] = {}


def register_algorithm(spec: AlgorithmSpec, replace: bool = False) -> AlgorithmSpec:
    """Add ``spec`` under ``spec.name``; returns it.

    Raises:
        ValueError: the name is taken (unless ``replace``), or a default is not a known value.
    """
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"an algorithm named {spec.name!r} is already registered")
    if isinstance(spec.loss_aggregation, str) and spec.loss_aggregation not in AGGREGATIONS:
        raise ValueError(f"{spec.name}: loss_aggregation must be one of {AGGREGATIONS}")
    if spec.kl_placement not in ("reward", "loss"):
        raise ValueError(f"{spec.name}: kl_placement must be 'reward' or 'loss'")
    _REGISTRY[spec.name] = spec
    return spec


def algorithm_names() -> list[str]:
    """The registered names, in registration order."""
    return list(_REGISTRY)


def get_algorithm(name: str) -> AlgorithmSpec:
    """The spec registered as ``name``.

    Raises:
        ConfigError: no algorithm has that name (one line listing the registered ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"ppo.advantage_estimator={name!r} is not a registered algorithm; choose one of "
            f"{', '.join(algorithm_names())}"
        ) from None


def build_estimator(ppo, group_size: int) -> AdvantageEstimator:
    """The estimator ``ppo.advantage_estimator`` names, built with its settings."""
    return get_algorithm(ppo.advantage_estimator).estimator(ppo, group_size)


register_algorithm(AlgorithmSpec("gae", lambda ppo, n: GAEEstimator.from_settings(ppo), needs_critic=True))
register_algorithm(
    AlgorithmSpec(
        "grpo",
        lambda ppo, n: GroupEstimator("grpo", n, ppo.scale_by_std),
        needs_critic=False,
        needs_groups=True,
        # Shao et al. 2024 eq. 3 (mean over responses of token means); Dr.GRPO (no std) sums tokens instead
        loss_aggregation=lambda ppo: "seq_mean_token_mean" if ppo.scale_by_std else "token_sum_norm",
        kl_placement="loss",
    )
)
register_algorithm(
    AlgorithmSpec(
        "rloo",
        lambda ppo, n: GroupEstimator("rloo", n),
        needs_critic=False,
        needs_groups=True,
        loss_aggregation="token_sum_norm",  # its REINFORCE gradient sums over a response's tokens
    )
)
register_algorithm(
    AlgorithmSpec("reinforce_pp", lambda ppo, n: ReinforcePPEstimator(ppo.gamma), needs_critic=False)
)
