"""A new algorithm is one ``register_algorithm`` call: registered here, from this file alone, it runs a PPO fit,
and what it declares (``needs_critic``) decides whether the module builds a critic."""

from __future__ import annotations

import torch

from rlhf_lit import metrics as M
from rlhf_lit.rl import Advantages, AlgorithmSpec, GAEEstimator, register_algorithm
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.settings import PPOConfig
from tests.ppo.helpers import make_data, make_module, make_trainer


class CentredScore:
    """A REINFORCE estimator with the batch-mean baseline: every update token of a response gets its score
    minus the mean score; no critic, no returns."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, rollout, kl_coef, distributed):
        self.calls += 1
        centred = rollout.scores - rollout.scores.mean()
        advantages = centred.unsqueeze(-1) * rollout.update_mask
        return Advantages(advantages, None, torch.zeros_like(advantages), advantages.mean())


register_algorithm(
    AlgorithmSpec("test_centred_score", lambda ppo, n: CentredScore(), needs_critic=False), replace=True
)


def _module(estimator: str, **ppo):
    settings = dict(ppo_epochs=1, ppo_minibatch_size=4, total_iterations=2, advantage_estimator=estimator)
    return make_module(
        sampling=SamplingConfig(max_new_tokens=6, temperature=0.7), ppo=PPOConfig(**settings, **ppo)
    )


def test_a_registered_estimator_runs_a_ppo_fit(tmp_path):
    torch.manual_seed(0)
    module = _module("test_centred_score")
    assert isinstance(module.estimator, CentredScore)
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=4))
    assert module.iteration == 2 and module.estimator.calls == 2
    changed = {n for n, p in module.named_parameters() if n in before and not torch.equal(p, before[n])}
    assert changed and all(".actor." in n for n in changed)  # only the actor trains: there is no critic
    assert M.PPO_POLICY_LOSS in module.history[-1] and M.PPO_VALUE_LOSS not in module.history[-1]


def test_needs_critic_alone_decides_whether_a_critic_is_built():
    register_algorithm(
        AlgorithmSpec("test_gae_twin", lambda ppo, n: GAEEstimator.from_settings(ppo), needs_critic=True),
        replace=True,
    )
    with_critic, without = _module("test_gae_twin"), _module("test_centred_score")
    assert with_critic.policy.has_critic and with_critic.policy.value_head is not None
    assert any(".critic." in n for n, _ in with_critic.named_parameters())
    assert len(with_critic.policy.critic_parameters()) > 2 and with_critic.objective.terms(True) == (
        "policy",
        "value",
    )
    assert not without.policy.has_critic and without.policy.value_head is None
    assert without.policy.critic_parameters() == []
    assert not [n for n, _ in without.named_parameters() if ".critic." in n or "value_head" in n]
