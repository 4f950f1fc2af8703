"""Lightning callbacks: everything a run writes besides its logged metrics, and how progress is shown.

* :class:`StageProgressBar` (``progress``): the tqdm bar with the stage's name; the CLI adds it.
* :class:`HFExport`, :class:`RolloutSamples`, :class:`PPOCurves` (``outputs``): the Hugging Face export,
  PPO's sample table and PPO's curves; the modules attach them as their settings ask.
* :class:`RewardHackingMonitor` (``monitor``): PPO's over-optimisation watch (``monitor.enabled``).
* :class:`GoldScoreCallback` (``gold_score``): the demo's evaluation-only gold score of PPO's samples.

The reward model's calibration report, reliability diagram and export are still written by
``RewardModule.on_fit_end`` (``rlhf_lit.modules.reward``).
"""

from rlhf_lit.callbacks.gold_score import GoldScoreCallback
from rlhf_lit.callbacks.monitor import RewardHackingMonitor, _shift_se
from rlhf_lit.callbacks.outputs import HFExport, PPOCurves, RolloutSamples, unless_configured
from rlhf_lit.callbacks.progress import StageProgressBar

__all__ = [
    "GoldScoreCallback",
    "HFExport",
    "PPOCurves",
    "RewardHackingMonitor",
    "RolloutSamples",
    "StageProgressBar",
    "_shift_se",
    "unless_configured",
]
