"""The seams an iteration is assembled from (rlhf_lit.rl): the objective's terms add up to the
combined loss whatever the split, and an estimator without a critic plugs into a real iteration."""

from __future__ import annotations

import pytest
import torch

from rlhf_lit import metrics as M
from rlhf_lit.models.policy import PolicyOutput
from rlhf_lit.rl import Advantages, MicroBatch, PPOObjective
from rlhf_lit.rl.settings import PPOConfig
from tests.ppo.helpers import make_data, make_module, make_trainer

OBJECTIVE = PPOObjective(clip_range=0.2, dual_clip=None, value_clip_range=None, vf_coef=0.5, entropy_coef=0.1)


def _case():
    mask = torch.tensor([[True, True, False]])
    mb = MicroBatch(
        input_ids=torch.zeros(1, 4, dtype=torch.long),
        attention_mask=torch.ones(1, 4, dtype=torch.long),
        prompt_len=1,
        mask=mask,
        old_logprobs=torch.tensor([[-1.0, -2.0, 0.0]]),
        advantages=torch.tensor([[1.0, -1.0, 0.0]]),
        old_values=torch.tensor([[0.0, 0.0, 0.0]]),
        returns=torch.tensor([[1.0, 2.0, 0.0]]),
    )
    out = PolicyOutput()
    out.logprobs = torch.tensor([[-1.0, -2.0, -9.0]])  # ratio 1 on the real tokens
    out.entropy = torch.tensor([[0.5, 1.5, 9.0]])
    out.values = torch.tensor([[0.0, 1.0, 9.0]])
    return out, mb


def test_ppo_objective_by_hand_and_split_into_its_terms():
    out, mb = _case()
    # policy: ratio 1 -> mean(-A) over real tokens = mean(-1, 1) = 0; value: 0.5 * mean((0-1)^2, (1-2)^2) = 0.5;
    # entropy mean(0.5, 1.5) = 1.0; loss = 0 + 0.5 * 0.5 - 0.1 * 1.0 = 0.15
    loss, stats = OBJECTIVE.loss(out, mb, ("policy", "value"))
    assert abs(float(loss) - 0.15) < 1e-7
    assert float(stats[M.PPO_VALUE_LOSS]) == 0.5 and float(stats[M.PPO_ENTROPY]) == 1.0
    policy, _ = OBJECTIVE.loss(out, mb, ("policy",))
    value, _ = OBJECTIVE.loss(out, mb, ("value",))
    torch.testing.assert_close(policy + value, loss)
    assert abs(float(policy) - (-0.1)) < 1e-7 and abs(float(value) - 0.25) < 1e-7
    assert OBJECTIVE.terms(has_critic=False) == ("policy",)
    assert OBJECTIVE.wants(("value",)) == {"want_logprobs": False, "want_values": True, "want_entropy": False}


def test_the_objective_weighs_the_policy_term_by_the_importance_weights():
    # ratio 1: per-token policy terms -A = (-1, +1); weights (3, 1): mean(-3, 1) = -1 instead of 0, and the
    # entropy and value terms are untouched: -1 + 0.25 - 0.1 = -0.85
    out, mb = _case()
    mb.is_weights = torch.tensor([[3.0, 1.0, 7.0]])  # the padded token's weight never counts
    loss, stats = OBJECTIVE.loss(out, mb, ("policy", "value"))
    assert abs(float(stats[M.PPO_POLICY_LOSS]) - (-1.0)) < 1e-7 and abs(float(loss) - (-0.85)) < 1e-7


class _NoCritic:
    """A stand-in critic-free estimator: every token's advantage is its sequence's score minus the batch mean."""

    def __call__(self, rollout, kl_coef, distributed):
        centred = rollout.scores - rollout.scores.mean()
        advantages = centred.unsqueeze(-1) * rollout.update_mask
        zeros = torch.zeros_like(advantages)
        return Advantages(advantages, None, zeros, advantages.mean())


def test_an_estimator_without_returns_trains_the_actor_and_leaves_the_critic(tmp_path):
    torch.manual_seed(0)
    module = make_module(ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=2, total_iterations=1))
    module.estimator = _NoCritic()
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=4))
    after = dict(module.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(".actor." in n for n in changed)  # no value term: critic and value head untouched
    assert M.PPO_VALUE_LOSS not in module.history[0] and M.PPO_POLICY_LOSS in module.history[0]


def test_copy_adapter_copies_every_lora_matrix_and_refuses_another_shape():
    """``critic.init_from_reward`` starts the critic adapter as the reward adapter (``AdaptedLM.copy_adapter``)."""
    import pytest

    from rlhf_lit.models import AdaptedLM, BackboneConfig, LoraSettings, load_backbone
    from tests.conftest import TINY_GPT2

    lora = LoraSettings(r=2, alpha=4, target_modules=["c_attn"])
    lm = AdaptedLM(
        load_backbone(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte")),
        {"reward": lora, "critic": lora, "wide": LoraSettings(r=4, alpha=4, target_modules=["c_attn"])},
    )
    with torch.no_grad():
        for p in lm.adapter_parameters("reward"):
            p.normal_()
    lm.copy_adapter("reward", "critic")
    reward, critic = lm.adapter_parameters("reward"), lm.adapter_parameters("critic")
    assert len(critic) == len(reward) == 4  # A and B of c_attn in 2 blocks
    assert all(torch.equal(c, r) for c, r in zip(critic, reward))
    with pytest.raises(ValueError, match="cannot copy adapter 'reward' into 'wide'"):
        lm.copy_adapter("reward", "wide")


def test_the_in_loss_kl_term_uses_the_configured_estimator():
    """``kl.estimator`` reaches the loss under ``ppo.kl_placement: loss`` (the controller, the logs and the loss
    read one estimator). Log-ratio logp - ref on the real tokens: -1 - (-1.5) = 0.5 and -2 - (-1) = -1."""
    import dataclasses
    import math

    from rlhf_lit.rl.settings import KLConfig

    out, mb = _case()
    mb = dataclasses.replace(mb, ref_logprobs=torch.tensor([[-1.5, -1.0, 0.0]]), kl_coef=0.2)
    base, _ = OBJECTIVE.loss(out, dataclasses.replace(mb, ref_logprobs=None), ("policy",))
    # k1 token mean = (0.5 - 1) / 2 = -0.25; k3 = e^(ref - logp) - 1 - (ref - logp): (e^-0.5 - 0.5) + (e^1 - 2)
    k1, k3 = -0.25, ((math.exp(-0.5) - 0.5) + (math.exp(1.0) - 2.0)) / 2
    for estimator, expected in (("k1", k1), ("k3", k3)):
        objective = dataclasses.replace(OBJECTIVE, kl_estimator=estimator)
        loss, stats = objective.loss(out, mb, ("policy",))
        assert float(stats[M.PPO_KL_LOSS]) == pytest.approx(expected, rel=1e-6)
        assert float(loss - base) == pytest.approx(0.2 * expected, rel=1e-5)
    # the default per placement: k3 in the loss, k1 in the rewards; an explicit one wins in both
    assert KLConfig().resolved_estimator(kl_in_loss=True) == "k3"
    assert KLConfig().resolved_estimator(kl_in_loss=False) == "k1"
    assert KLConfig(estimator="k2").resolved_estimator(kl_in_loss=True) == "k2"


def test_the_module_gives_one_kl_estimator_to_the_rollout_and_the_loss():
    from rlhf_lit.rl.settings import KLConfig

    module = make_module(
        ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=4, total_iterations=1, kl_placement="loss"),
        kl=KLConfig(kl_coef=0.05, estimator="k2"),
    )
    assert module.objective.kl_estimator == module.collector.settings.kl_estimator == "k2"
