"""PPO judged by a reward model it never saw: RM-A trains the policy, RM-B (trained on the other half of the
preference pairs) judges it on held-out prompts, before and after.

A reward model's score rising under PPO only says that PPO optimises what it is given (Gao et al. 2022,
"Scaling Laws for Reward Model Overoptimization", use a second, "gold" model for this reason). Here the
second opinion is a reward model of the same recipe trained on disjoint pairs: if RM-B also scores the PPO
policy higher on prompts neither PPO nor either reward model trained on, the gain is not an artefact of
RM-A alone; if the gain is only in length (RM-B scores longer responses higher), the report says so.

``HeldOutRewardCallback`` (a Lightning callback on a ``PPOModule`` fit):

* before the first PPO iteration and after the last, samples one response per evaluation prompt with the
  actor (the same seeds both times, so responses are paired by prompt), and records per response: RM-A's
  and RM-B's calibrated scores, the KL to the reference (sum over the response's tokens of the k1 and k3
  estimators, nats, at the sampling temperature), the response length (tokens, stop token included) and
  whether it stopped. Before any update the actor IS the reference, so the KL before is 0 exactly.
  Sampling runs under a forked RNG, so the PPO run itself is the one it would be without the callback.
* every iteration, scores the iteration's rollout responses with RM-B too (the same inputs PPO gave RM-A,
  rebuilt for RM-B's tokenizer by ``RewardSource``) and puts the mean into the iteration's history as
  ``heldout/rm_score``, where ``RewardHackingMonitor`` reads it as a held-out signal (``monitor.heldout``).
* at the end writes ``heldout_report.json`` and ``heldout_report.md``: means with standard errors before and
  after, the paired change with its SE, and for both reward models the change that length does not explain
  (``rlhf_lit.functional.length_bias.length_adjusted_change``), with a one-line verdict on RM-B.

``main`` (``python -m experiments.heldout_rm``, from the repository root) runs the whole experiment from
two reward-model exports: it checks from their records that they share one validation split and were trained
on disjoint parts, writes the PPO training prompts (the HH prompts of the training pairs) and the evaluation
prompts (those of the validation pairs, which no reward model and no PPO iteration saw), and runs
``rlhf-lit fit`` on the PPO config with RM-A as the reward model and this callback attached.
"""

from experiments.heldout_rm.callback import HeldOutRewardCallback
from experiments.heldout_rm.experiment import check_disjoint, main, write_prompt_files
from experiments.heldout_rm.report import report_markdown, summarize, verdict, write_report

__all__ = [
    "HeldOutRewardCallback",
    "check_disjoint",
    "main",
    "report_markdown",
    "summarize",
    "verdict",
    "write_prompt_files",
    "write_report",
]
