"""PPOModule on tiny models: on-policy first step, frozen reference, wiring of rewards, metrics, invariances."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlhf_lit import metrics as M
from rlhf_lit.models import BackboneConfig, load_backbone
from rlhf_lit.models.tokenizer import build_byte_tokenizer
from rlhf_lit.rl.settings import PPOConfig, RewardShapingConfig
from tests.conftest import TINY_GPT2
from tests.ppo.helpers import RecordingReward, make_data, make_module, make_trainer


def _fit(module, tmp_path, batch_size=4, **trainer_kwargs):
    data = make_data(module, batch_size=batch_size)
    trainer = make_trainer(tmp_path, **trainer_kwargs)
    trainer.fit(module, datamodule=data)
    return trainer


def test_first_minibatch_is_on_policy_and_kl_is_zero_at_step_zero(tmp_path):
    """pitfall: sampling temperature, dropout: rollout log-probs at the sampling temperature, dropout off -> ratio 1, KL 0 at step 0."""
    module = make_module()  # temperature 0.7, one epoch, one minibatch = the whole rollout
    _fit(module, tmp_path)
    first = module.history[0]
    assert first[M.PPO_RATIO_MEAN] == pytest.approx(1.0, abs=1e-6)
    assert first[M.PPO_APPROX_KL] == pytest.approx(0.0, abs=1e-7)
    assert first[M.PPO_CLIPFRAC] == 0.0
    # lora_B starts at 0, so the actor equals the reference exactly before the first update
    assert first[M.ROLLOUT_KL_REF] == 0.0
    assert first[M.ROLLOUT_KL_ESTIMATOR.format(estimator="k3")] == 0.0


def test_only_adapters_and_value_head_train_and_reference_stays_the_base(tmp_path):
    module = make_module(optimizer=None)
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all(
        ("lora_" in n and (".actor." in n or ".critic." in n)) or "value_head" in n for n in trainable
    )
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    _fit(module, tmp_path)
    changed = [n for n, p in module.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert any(".actor." in n for n in changed) and any("value_head" in n for n in changed)
    base = load_backbone(BackboneConfig(tiny=TINY_GPT2), build_byte_tokenizer())
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = base(input_ids=ids).logits
        with module.policy.lm.reference():
            ref = module.policy.lm.logits(module.policy.lm.hidden_states(ids, mask))
        with module.policy.lm.adapter("actor"):
            actor = module.policy.lm.logits(module.policy.lm.hidden_states(ids, mask))
    torch.testing.assert_close(ref, expected)
    assert (actor - expected).abs().max() > 1e-6  # one AdamW step of lr 1e-5 moved the actor


def test_one_iteration_writes_the_metric_keys(tmp_path):
    module = make_module(log_samples_every=1)
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="tb")
    _fit(module, tmp_path, logger=logger)
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    logged = set(events.Tags()["scalars"]) - {"hp_metric"}  # Lightning's own placeholder
    expected = {
        M.ROLLOUT_SCORE_MEAN,
        M.ROLLOUT_SCORE_STD,
        M.ROLLOUT_KL_REF,
        M.ROLLOUT_RESPONSE_LEN,
        M.ROLLOUT_NO_EOS_FRAC,
        M.PPO_POLICY_LOSS,
        M.PPO_VALUE_LOSS,
        M.PPO_CLIPFRAC,
        M.PPO_VALUE_CLIPFRAC,
        M.PPO_APPROX_KL,
        M.PPO_ENTROPY,
        M.PPO_RATIO_MEAN,
        M.PPO_KL_COEF,
        M.CRITIC_EXPLAINED_VARIANCE,
        M.PERF_GENERATION_S,
        M.PERF_UPDATE_S,
        M.PERF_SYNC_S,
        M.PERF_GENERATION_TOKENS_PER_S,
        "rollout/kl_ref_k1",
        "rollout/kl_ref_k3",
        M.MONITOR_SCORE_LENGTH_CORR,  # the reward-hacking monitors run in every PPO run
        M.MONITOR_REF_PERPLEXITY,
        M.MONITOR_OVEROPTIMIZATION,
    }
    assert expected <= logged, expected - logged
    assert "monitor/score_kl_frontier" in events.Tags()["images"]
    assert all(M.is_known(tag) for tag in logged), [t for t in logged if not M.is_known(t)]
    assert any(tag.startswith("rollout/samples") for tag in events.Tags()["tensors"]), events.Tags()[
        "tensors"
    ]


def test_perf_sync_s_times_the_samplers_refresh_inside_the_update(tmp_path):
    """``perf/sync_s`` is the sampler's ``sync`` (vLLM's weight push) alone, and part of ``perf/update_s``."""
    from rlhf_lit.rl.sampler import HFSampler

    class SlowSync(HFSampler):
        def sync(self, policy):
            time.sleep(0.25)

    module = make_module(ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=2, total_iterations=1), sampler=SlowSync)
    _fit(module, tmp_path, batch_size=2)
    figures = module.history[0]
    assert 0.25 <= figures[M.PERF_SYNC_S] < figures[M.PERF_UPDATE_S] < figures[M.PERF_ITERATION_S]


def test_score_lands_on_the_last_real_token_with_pad_equal_eos(tmp_path, monkeypatch):
    """pitfall: score token, score slot: pad = eos = 0; row 0 stops at its EOS (index 2), row 1 fills max_new_tokens (index 4)."""
    responses = torch.tensor([[40, 41, 0, 0, 0], [42, 43, 44, 45, 46]])
    masks = torch.tensor([[True, True, True, False, False], [True] * 5])

    class Fixed:  # a Sampler that returns the same two responses
        def __init__(self, *args):
            pass

        def sample(self, policy, prompt_ids, prompt_mask, **kwargs):
            return responses.clone(), masks.clone(), torch.tensor([True, False])

        def sync(self, policy):
            pass

    module = make_module(
        tokenizer="byte:pad=eos",
        sampling=copy.deepcopy(make_module().sampling),
        reward=RewardShapingConfig(missing_eos_penalty=1.0),
        ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=2, total_iterations=1),
        sampler=Fixed,
    )
    module.collector.reward_fn = RecordingReward(module.collector.reward_fn, lambda s: torch.tensor([2.0, 3.0]))
    seen = {}
    import rlhf_lit.rl.estimators as advantages_mod  # GAE is called there

    real_gae = advantages_mod.gae

    def spy(rewards, values, mask, gamma, lam):
        seen["rewards"], seen["mask"] = rewards.clone(), mask.clone()
        return real_gae(rewards, values, mask, gamma, lam)

    monkeypatch.setattr(advantages_mod, "gae", spy)
    _fit(module, tmp_path, batch_size=2)
    rewards = seen["rewards"]
    # KL is 0 at step 0, so the rewards are the scores alone: 2.0 at index 2; 3.0 - 1.0 (no EOS) at index 4
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]]))
    assert seen["mask"].sum().item() == 8  # 3 + 5 real response tokens contribute, not padding
    assert module.history[0][M.ROLLOUT_NO_EOS_FRAC] == 0.5


def test_micro_batches_with_accumulation_equal_one_big_batch(tmp_path):
    """TRL's invariance test: micro-batch 1 x accumulation 4 equals 4 x 1 for one update."""
    params = {}
    for micro in (4, 1):
        torch.manual_seed(0)
        module = make_module(
            ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=4, micro_batch_size=micro, total_iterations=1)
        )
        initial = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
        torch.manual_seed(123)
        _fit(module, tmp_path / str(micro))
        params[micro] = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    assert any(not torch.equal(params[4][n], initial[n]) for n in initial)
    for name in params[4]:
        torch.testing.assert_close(params[1][name], params[4][name], atol=1e-6, rtol=1e-5)


def test_batch_sizes_must_divide(tmp_path):
    module = make_module(ppo=PPOConfig(ppo_minibatch_size=4, total_iterations=1))
    with pytest.raises(ValueError, match="rollout_batch_size=6.*ppo_minibatch_size=4"):
        _fit(module, tmp_path, batch_size=6)
