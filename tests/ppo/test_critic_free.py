"""Critic-free estimators in the PPO module: no critic parameters, groups of n samples per prompt, the
advantages that reach the update, the loss aggregations and the KL placement."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import rlhf_lit.rl.loading as ppo_build
from rlhf_lit.functional.aggregation import aggregation_weights
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.schedule import epoch_schedule
from rlhf_lit.rl.settings import KLConfig, PPOConfig
from tests.ppo.helpers import RecordingReward, RecordingUpdater, make_data, make_module, make_trainer


def _module(estimator: str, n: int = 2, **ppo):
    settings = dict(ppo_epochs=1, ppo_minibatch_size=4, total_iterations=1, advantage_estimator=estimator)
    settings.update(ppo)
    return make_module(
        sampling=SamplingConfig(max_new_tokens=6, temperature=0.7, num_samples_per_prompt=n),
        ppo=PPOConfig(**settings),
    )


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_a_critic_free_module_holds_no_critic_parameters(estimator):
    torch.manual_seed(0)
    module = _module(estimator)
    names = [name for name, _ in module.named_parameters()]
    assert module.policy.value_head is None and not module.policy.has_critic
    assert not [n for n in names if "critic" in n or "value_head" in n]
    assert module.policy.critic_parameters() == []
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in module.policy.actor_parameters()}
    assert module.algorithm.needs_critic is False
    # the same module with GAE has a critic adapter and a value head
    gae = _module("gae", n=1)
    assert gae.policy.value_head is not None and any("critic" in n for n, _ in gae.named_parameters())
    assert len(gae.policy.critic_parameters()) > 2


def test_a_group_estimator_with_one_sample_is_refused_before_any_model_loads(monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(ppo_build, "build_base", no_model)
    with pytest.raises(ValueError, match=r"num_samples_per_prompt >= 2 \(it is 1\)"):
        _module("grpo", n=1)


def _fit_one(module, tmp_path, batch_size=4):
    """Fit with a recording updater and reward function; ``args`` are the update's 8 tensor fields, ``kwargs``
    the KL-in-loss fields when given."""
    module.updater = updater = RecordingUpdater(module.updater)
    module.collector.reward_fn = reward = RecordingReward(module.collector.reward_fn)
    make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=batch_size))
    batch = updater.calls[-1]
    seen = {
        "args": (
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_len,
            batch.mask,
            batch.old_logprobs,
            batch.old_values,
            batch.advantages,
            batch.returns,
        ),
        "kwargs": {}
        if batch.ref_logprobs is None
        else {"ref_logprobs": batch.ref_logprobs, "kl_coef": batch.kl_coef},
        "scores": reward.calls[-1],
        "prompt_ids": batch.input_ids[:, : batch.prompt_len],
    }
    return seen


def test_grpo_iteration_groups_the_n_responses_of_a_prompt_and_puts_kl_in_the_loss(tmp_path):
    torch.manual_seed(0)
    module = _module("grpo", n=2)
    seen = _fit_one(module, tmp_path)
    _, _, _, mask, _, old_values, advantages, returns = seen["args"]
    assert old_values is None and returns is None
    # GRPO's default: the KL is a loss term, so the update gets the reference log-probs
    assert set(seen["kwargs"]) == {"ref_logprobs", "kl_coef"} and seen["kwargs"]["kl_coef"] == 0.05
    prompts, scores = seen["prompt_ids"], seen["scores"]
    assert prompts.shape[0] == scores.shape[0] == 8  # 4 prompts x 2 samples
    assert torch.equal(prompts[0::2], prompts[1::2])  # a prompt's samples are consecutive rows
    # group of 2 (a, b): mean (a + b) / 2, unbiased std |a - b| / sqrt(2) -> advantages -+1/sqrt(2)
    for g in range(4):
        a, b = scores[2 * g], scores[2 * g + 1]
        expected = torch.sign(torch.stack([a - b, b - a])) / 2**0.5
        first, second = advantages[2 * g][mask[2 * g]], advantages[2 * g + 1][mask[2 * g + 1]]
        assert_close(first, torch.full_like(first, float(expected[0])), atol=1e-4, rtol=1e-4)
        assert_close(second, torch.full_like(second, float(expected[1])), atol=1e-4, rtol=1e-4)
    assert (advantages[~mask] == 0).all()
    assert module.history[-1]["ppo/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # first iteration: policy = ref


def test_rloo_and_reinforce_pp_take_the_kl_in_the_reward(tmp_path):
    torch.manual_seed(0)
    module = _module("rloo", n=2, ppo_minibatch_size=8)
    seen = _fit_one(module, tmp_path / "rloo")
    assert seen["kwargs"] == {}  # no KL loss term
    mask, advantages = seen["args"][3], seen["args"][6]
    # first iteration: actor == reference, so KL = 0 and the sequence reward is the score;
    # RLOO with n = 2: A_a = a - b, A_b = b - a
    s = seen["scores"]
    for g in range(4):
        a, b = float(s[2 * g]), float(s[2 * g + 1])
        assert_close(
            advantages[2 * g][mask[2 * g]], torch.full((int(mask[2 * g].sum()),), a - b), atol=1e-5, rtol=1e-5
        )
        assert_close(
            advantages[2 * g + 1][mask[2 * g + 1]],
            torch.full((int(mask[2 * g + 1].sum()),), b - a),
            atol=1e-5,
            rtol=1e-5,
        )
    torch.manual_seed(0)
    module = _module("reinforce_pp", n=1)
    seen = _fit_one(module, tmp_path / "rpp")
    mask, advantages = seen["args"][3], seen["args"][6]
    # whitened over the batch's tokens: mean 0, unbiased variance 1
    assert float(advantages[mask].mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(advantages[mask].var()) == pytest.approx(1.0, abs=1e-4)


def test_aggregation_weights_by_hand():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert aggregation_weights(mask, "token_mean") is None
    assert_close(aggregation_weights(mask, "token_sum_norm"), mask.float())
    # 1 / length of each response: [1/2, 1/2, 0, 0], [1/4] * 4
    assert_close(
        aggregation_weights(mask, "seq_mean_token_mean"),
        torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]),
    )
    with pytest.raises(ValueError, match="loss_aggregation"):
        aggregation_weights(mask, "sum")


def test_per_estimator_defaults():
    assert PPOConfig().aggregation() == "token_mean" and not PPOConfig().kl_in_loss()
    grpo = PPOConfig(advantage_estimator="grpo")
    assert grpo.aggregation() == "seq_mean_token_mean" and grpo.kl_in_loss()
    dr = PPOConfig(advantage_estimator="grpo", scale_by_std=False)
    assert dr.aggregation() == "token_sum_norm"
    assert PPOConfig(advantage_estimator="rloo").aggregation() == "token_sum_norm"
    assert not PPOConfig(advantage_estimator="rloo").kl_in_loss()
    assert PPOConfig(advantage_estimator="reinforce_pp").aggregation() == "token_mean"
    assert PPOConfig(advantage_estimator="grpo", kl_placement="reward").kl_in_loss() is False
    assert PPOConfig(loss_aggregation="seq_mean_token_mean").aggregation() == "seq_mean_token_mean"
    assert KLConfig().kl_coef == 0.05


def test_epoch_schedule_keeps_the_one_rank_numbering_with_groups():
    # 2 ranks, 2 prompts each, n = 2: rank 0 holds global prompts 0, 2 (rows p0s0, p0s1, p2s0, p2s1),
    # rank 1 prompts 1, 3. Global row g = sample g % 2 of prompt g // 2.
    order = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    r0 = epoch_schedule(order, 2, 0, 2, 2, group_size=2)
    r1 = epoch_schedule(order, 2, 1, 2, 2, group_size=2)
    # global minibatch 0 = rows 0-3 = prompt 0 (rank 0 rows 0, 1) and prompt 1 (rank 1 rows 0, 1)
    assert r0[0][0].tolist() == [0, 1] and r1[0][0].tolist() == [0, 1]
    # global minibatch 1 = rows 4-7 = prompt 2 (rank 0 rows 2, 3) and prompt 3 (rank 1 rows 2, 3)
    assert r0[1][0].tolist() == [2, 3] and r1[1][0].tolist() == [2, 3]
    # group_size 1 is the old numbering: row g of rank g % W is local g // W
    old = epoch_schedule(torch.tensor([3, 0, 2, 1]), 2, 0, 2, 2)
    assert old[0][0].tolist() == [0, 1]


def test_repeat_prompts_keeps_a_prompts_copies_together():
    from rlhf_lit.functional.sequence import repeat_prompts

    batch = {
        "input_ids": torch.tensor([[1, 2], [3, 4]]),
        "prompt": ["a", "b"],
        "fields": [{"x": 1}, {"x": 2}],
    }
    out = repeat_prompts(batch, 3)
    assert out["input_ids"].tolist() == [[1, 2]] * 3 + [[3, 4]] * 3
    assert out["prompt"] == ["a", "a", "a", "b", "b", "b"] and out["fields"][3] == {"x": 2}
    assert repeat_prompts(batch, 1) is batch
