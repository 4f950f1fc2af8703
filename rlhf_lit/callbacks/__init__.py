"""Lightning callbacks: everything a run writes besides its logged metrics, and how progress is shown.

* :class:`StageProgressBar` (``progress``): the tqdm bar with the stage's name; the CLI adds it.
* :class:`HFExport`, :class:`RolloutSamples`, :class:`PPOCurves` (``outputs``): the Hugging Face export,
  PPO's sample table and PPO's curves; the modules attach them as their settings ask.
* :class:`IterationCheckpoint` (``checkpoints``): PPO's periodic resumable ``last.ckpt``
  (``ppo.checkpoint_every``); :func:`periodic_checkpoint` decides whether a trainer gets one;
  :func:`run_folder_checkpoint` keeps the other stages' ``last.ckpt`` in the run's folder.
* :class:`RewardHackingMonitor` (``monitor``): PPO's over-optimisation watch (``monitor.enabled``).
* :class:`HeapTrim` (``memory``): gives the host heap's free pages back after each step on a CPU, and optionally
  fixes glibc's mmap threshold (the shipped real-model configs add it).
* :class:`GoldScoreCallback` (``gold_score``): the demo's evaluation-only gold score of PPO's samples.

The reward model's calibration report, reliability diagram and export are still written by
``RewardModule.on_fit_end`` (``rlhf_lit.modules.reward``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_lit.callbacks.checkpoints import IterationCheckpoint, periodic_checkpoint, run_folder_checkpoint
    from rlhf_lit.callbacks.gold_score import GoldScoreCallback
    from rlhf_lit.callbacks.memory import HeapTrim
    from rlhf_lit.callbacks.monitor import RewardHackingMonitor, _shift_se
    from rlhf_lit.callbacks.outputs import HFExport, PPOCurves, RolloutSamples, unless_configured
    from rlhf_lit.callbacks.progress import StageProgressBar

# imported on first use (PEP 562): the CLI needs only the progress bar, not the data code the others import
_LAZY = {
    "GoldScoreCallback": "rlhf_lit.callbacks.gold_score",
    "HeapTrim": "rlhf_lit.callbacks.memory",
    "IterationCheckpoint": "rlhf_lit.callbacks.checkpoints",
    "periodic_checkpoint": "rlhf_lit.callbacks.checkpoints",
    "run_folder_checkpoint": "rlhf_lit.callbacks.checkpoints",
    "RewardHackingMonitor": "rlhf_lit.callbacks.monitor",
    "_shift_se": "rlhf_lit.callbacks.monitor",
    "HFExport": "rlhf_lit.callbacks.outputs",
    "PPOCurves": "rlhf_lit.callbacks.outputs",
    "RolloutSamples": "rlhf_lit.callbacks.outputs",
    "unless_configured": "rlhf_lit.callbacks.outputs",
    "StageProgressBar": "rlhf_lit.callbacks.progress",
}

__all__ = [
    "GoldScoreCallback",
    "HFExport",
    "HeapTrim",
    "IterationCheckpoint",
    "PPOCurves",
    "RewardHackingMonitor",
    "RolloutSamples",
    "StageProgressBar",
    "_shift_se",
    "periodic_checkpoint",
    "run_folder_checkpoint",
    "unless_configured",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
