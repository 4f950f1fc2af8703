"""Controllers of the KL penalty coefficient ``kl_coef`` (beta) across PPO iterations.

Notation:
    beta  the current coefficient (``.value``), multiplying the per-token KL in the reward.
    KL    the measured KL(policy || reference) of the last rollout, in nats per *sequence*
          (summed over response tokens) as in Ziegler et al. 2019, or per token if ``target_kl``
          is set per token as well; the controller only compares it with ``target_kl``.
    n_steps  the number of samples (sequences) in that rollout; ``horizon`` is in the same unit.

The state (``value``) is checkpointed with ``state_dict`` so that a resumed run continues with the
same coefficient. Hyper-parameters (``target_kl``, ``horizon``) come from the constructor, that is
from the run's config, and are not overwritten by ``load_state_dict``.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["KLController", "FixedKLController", "AdaptiveKLController", "build_kl_controller"]


class KLController:
    """Common interface: ``value``, ``update``, ``state_dict``, ``load_state_dict``."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust ``value`` after a rollout whose measured KL was ``current_kl`` over ``n_steps`` samples."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (survives ``torch.save`` and restores exactly)."""
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``value`` from ``state_dict()`` output."""
        self.value = float(state_dict["value"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(value={self.value})"


class FixedKLController(KLController):
    """A constant coefficient: ``update`` does nothing.

    Args:
        kl_coef: beta >= 0.
    """

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; the arguments are accepted so both controllers are called the same way."""


class AdaptiveKLController(KLController):
    """Proportional controller that steers the measured KL towards ``target_kl``.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", section 2.2:
    ``e = clip(KL / target_kl - 1, -0.2, 0.2)``; ``beta <- beta * (1 + K_beta * e)`` with
    ``K_beta = n_steps / horizon``. The KL is too high -> beta grows; too low -> beta shrinks, by
    at most 20% per ``horizon`` samples.

    Args:
        init_kl_coef: Initial beta >= 0.
        target_kl: Target KL (> 0), in the unit of the ``current_kl`` passed to ``update``.
        horizon: Samples over which a full 20% correction is applied (> 0; 10000 in the paper).

    Raises:
        ValueError: If an argument is out of range.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        super().__init__(init_kl_coef)
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Multiply ``value`` by ``1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``.

        Args:
            current_kl: KL measured on the last rollout (a float or a 0-dim tensor).
            n_steps: Number of samples in that rollout (>= 0).

        Raises:
            ValueError: If ``n_steps < 0`` or ``current_kl`` is not finite.
        """
        current_kl = float(current_kl)
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        if not math.isfinite(current_kl):
            raise ValueError(f"current_kl must be finite, got {current_kl}")
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target_kl={self.target_kl}, horizon={self.horizon})"


def build_kl_controller(
    kl_coef: float, adaptive: bool, target_kl: float | None = None, horizon: int = 10000
) -> KLController:
    """Build the controller a PPO config asks for.

    Args:
        kl_coef: Constant beta, or the initial beta when ``adaptive``.
        adaptive: Use ``AdaptiveKLController`` (Ziegler et al. 2019) instead of a fixed beta.
        target_kl: Target KL; required when ``adaptive``, ignored otherwise.
        horizon: Adaptive horizon in samples (10000 in Ziegler et al. 2019).

    Returns:
        A ``FixedKLController`` or an ``AdaptiveKLController``.

    Raises:
        ValueError: If ``adaptive`` is set without ``target_kl``, or an argument is out of range.
    """
    if not adaptive:
        return FixedKLController(kl_coef)
    if target_kl is None:
        raise ValueError(
            "adaptive KL control needs target_kl (e.g. target_kl: 6.0 as in Ziegler et al. 2019); "
            "set target_kl or turn the adaptive controller off"
        )
    return AdaptiveKLController(kl_coef, target_kl, horizon)
