"""The pieces a policy-gradient iteration is assembled from, each behind one small interface.

* advantage estimators (:mod:`rlhf_lit.algorithms.advantages`): a :class:`~rlhf_lit.rollout.Rollout` in,
  ``(B, R)`` advantages (and returns, when there is a critic to fit) out: step 5 of the PPO iteration.
  :class:`GAEEstimator` is PPO's (KL-shaped token rewards, GAE, whitening); :class:`GroupEstimator` (GRPO,
  Dr.GRPO, RLOO) and :class:`ReinforcePPEstimator` (REINFORCE++) need no critic. ``ppo.advantage_estimator``
  picks one (:func:`build_estimator`).
* objectives (:mod:`rlhf_lit.algorithms.objectives`): the loss of one micro-batch from the policy's outputs
  and the rollout's rows, by terms, so the update can back-propagate the policy terms and the value term in
  one pass or two. :class:`PPOObjective` is the clipped surrogate + value loss - entropy bonus.

``rlhf_lit.modules.ppo`` builds one of each from its config; ``rlhf_lit.modules.ppo_update`` runs the
objective over epochs and minibatches. A critic-free estimator (group-relative or leave-one-out baselines)
sets ``needs_critic = False`` and returns ``returns=None``; the objective then has no value term.
"""

from rlhf_lit.algorithms.advantages import (
    AdvantageEstimator,
    Advantages,
    GAEEstimator,
    GroupEstimator,
    ReinforcePPEstimator,
    build_estimator,
)
from rlhf_lit.algorithms.objectives import MicroBatch, Objective, PPOObjective

__all__ = [
    "AdvantageEstimator",
    "Advantages",
    "GAEEstimator",
    "GroupEstimator",
    "MicroBatch",
    "Objective",
    "PPOObjective",
    "ReinforcePPEstimator",
    "build_estimator",
]
