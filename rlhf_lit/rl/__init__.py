"""The RL core: one policy-gradient iteration as components built with what they need, never with the
LightningModule (this package imports nothing from ``rlhf_lit.modules``; ``tests/test_architecture.py``).

An iteration (``rlhf_lit.modules.ppo.PPOModule.training_step``) reads as::

    rollout = collector.collect(batch)                   # 1-4  rollout.RolloutCollector (sampler.Sampler)
    adv = estimator(rollout, kl_coef, distributed)       # 5    estimators (picked in algorithms' registry)
    stats = updater.update(UpdateBatch(...))             # 6    update.PPOUpdater with objectives.PPOObjective
    sampler.sync(policy); kl_ctl.update(...)             # 7    kl_control
    log(iteration_stats(...))                            #      stats

* :mod:`~rlhf_lit.rl.algorithms`: the registry (:class:`AlgorithmSpec`, :func:`register_algorithm`,
  :func:`get_algorithm`), the one place that knows what each estimator needs.
* :mod:`~rlhf_lit.rl.rollout`: :class:`Rollout` and the :class:`RolloutCollector`.
* :mod:`~rlhf_lit.rl.sampler`: the :class:`Sampler` protocol and :class:`HFSampler`.
* :mod:`~rlhf_lit.rl.estimators`, :mod:`~rlhf_lit.rl.objectives`: advantages and losses.
* :mod:`~rlhf_lit.rl.update`: :class:`PPOUpdater` (epochs x minibatches x micro-batches).
* :mod:`~rlhf_lit.rl.kl_control`, :mod:`~rlhf_lit.rl.stats`: the KL controller and the iteration's metrics.
* :mod:`~rlhf_lit.rl.settings` (with :mod:`~rlhf_lit.rl.checks`): the typed PPO settings and their joint checks;
  :mod:`~rlhf_lit.rl.generation`: the sampling settings and ``generate``; :mod:`~rlhf_lit.rl.reward_norm`: score
  shaping and running statistics.
The math itself is in ``rlhf_lit.functional``.
"""

from rlhf_lit.rl.algorithms import (
    AlgorithmSpec,
    algorithm_names,
    build_estimator,
    get_algorithm,
    register_algorithm,
)
from rlhf_lit.rl.estimators import (
    AdvantageEstimator,
    Advantages,
    GAEEstimator,
    GroupEstimator,
    ReinforcePPEstimator,
)
from rlhf_lit.rl.objectives import MicroBatch, Objective, PPOObjective
from rlhf_lit.rl.sampler import HFSampler, Sampler

__all__ = [
    "AdvantageEstimator",
    "Advantages",
    "AlgorithmSpec",
    "GAEEstimator",
    "GroupEstimator",
    "HFSampler",
    "MicroBatch",
    "Objective",
    "PPOObjective",
    "ReinforcePPEstimator",
    "Sampler",
    "algorithm_names",
    "build_estimator",
    "get_algorithm",
    "register_algorithm",
]
