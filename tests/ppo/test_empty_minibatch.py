"""A global minibatch with no update token (its responses all left out by ``ppo.dynamic_sampling`` or
``ppo.mask_truncated_completions``) makes no optimizer step and does not dilute the update's figures; the
learning-rate schedule still advances (it is sized in minibatches). Hand-computed on a one-parameter policy
driven through :class:`PPOUpdater` with stand-in collaborators (constructor arguments, nothing patched)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf_lit import metrics as M
from rlhf_lit.rl.update import PPOUpdater, UpdateBatch, UpdateSettings, clip_global_grad_norm


class OneWeight(torch.nn.Module):
    """The "policy": its output is its one weight ``w`` (initially 1)."""

    shared_critic = True

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0]))

    def forward(self, input_ids, attention_mask, prompt_len, temperature, **kwargs):
        return self.w


class LinearObjective:
    """Loss ``w * token mean of old_logprobs`` over the micro-batch's update tokens (gradient: that mean);
    ``ppo/entropy`` the token mean of ``advantages`` (a stand-in with known values)."""

    def terms(self, has_critic):
        return ("policy",)

    def wants(self, terms):
        return {}

    def loss(self, out, mb, terms):
        mask = mb.mask.float()
        n = mask.sum().clamp(min=1.0)
        loss = out.sum() * (mb.old_logprobs * mask).sum() / n
        return loss, {M.PPO_ENTROPY: ((mb.advantages * mask).sum() / n).detach()}


class OtherRank:
    """A strategy whose sums add what a second rank holds: ``other`` update tokens in every count."""

    def __init__(self, other: float) -> None:
        self.other = other

    def reduce(self, value, reduce_op="sum"):
        assert reduce_op == "sum"
        return value + self.other


def _batch() -> UpdateBatch:
    # rows 0 and 1 hold the update tokens (3 of them); rows 2 and 3 none (left out of the update)
    mask = torch.tensor([[True, True], [True, False], [False, False], [False, False]])
    return UpdateBatch(
        input_ids=torch.zeros(4, 3, dtype=torch.long),
        attention_mask=torch.ones(4, 3, dtype=torch.long),
        prompt_len=1,
        mask=mask,
        old_logprobs=torch.tensor([[1.0, 2.0], [3.0, 9.0], [5.0, 5.0], [7.0, 7.0]]),
        old_values=None,
        advantages=torch.tensor([[0.3, 0.6], [0.9, 4.0], [2.0, 2.0], [2.0, 2.0]]),
        returns=None,
    )


def _updater(world):
    policy = OneWeight()
    opt = torch.optim.AdamW([policy.w], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 - 0.25 * k)  # 0.1, 0.075, 0.05, ...
    settings = UpdateSettings(
        ppo_epochs=1,
        ppo_minibatch_size=2,
        micro_batch_size=2,
        seed=0,
        logprob_chunk_size=None,
        entropy_coef=0.0,
        loss_norm_constant=None,
        max_consecutive_skips=3,
        aggregation="token_mean",
        temperature=1.0,
    )
    updater = PPOUpdater(
        policy,
        LinearObjective(),
        settings,
        backward=lambda loss: loss.backward(),
        clip=lambda o: clip_global_grad_norm(o, None, "32-true"),
        optimizers=lambda: (opt, sched),
        world=lambda: world,
        # two minibatches, in this order: rows 0-1, then rows 2-3 (no update token on this rank)
        schedule=lambda order, *args: [(torch.tensor([0, 1]), 1), (torch.tensor([2, 3]), 1)],
    )
    return updater, policy, opt, sched


def test_a_minibatch_without_update_tokens_makes_no_step_and_no_zeros_in_the_figures():
    updater, policy, opt, sched = _updater(SimpleNamespace(world_size=1, global_rank=0))
    stats = updater.update(_batch())
    # minibatch 1: loss = w * (1 + 2 + 3) / 3 = 2w, gradient 2. AdamW's first step (t = 1, lr 0.1):
    # m = 0.1 * 2 = 0.2, v = 0.001 * 4 = 0.004, m_hat = 2, v_hat = 4; w = 1 * (1 - 0.1 * 0.5) - 0.1 * 2 / 2
    # = 0.95 - 0.1 = 0.85. Minibatch 2 is empty: no step. (A second AdamW step on its zero gradient at lr
    # 0.075 would give w = 0.85 * (1 - 0.0375) - 0.075 * 0.94737 / 1.41386 = 0.76787.)
    assert float(policy.w.detach()) == pytest.approx(0.85, abs=1e-6)
    assert opt.state[policy.w]["step"] == 1
    # the schedule advanced over both minibatches: lr factor 1 - 0.25 * 2 = 0.5
    assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.05)
    # ppo/entropy: minibatch 1's token mean (0.3 + 0.6 + 0.9) / 3 = 0.6, averaged over the one minibatch
    # with tokens (over both it would be (0.6 + 0) / 2 = 0.3)
    assert stats[M.PPO_ENTROPY] == pytest.approx(0.6)
    assert stats[M.PPO_GRAD_NORM] == pytest.approx(2.0)
    assert stats[M.PPO_SKIPPED_STEPS] == 0.0


def test_the_decision_is_global_a_rank_without_tokens_steps_when_another_rank_has_some():
    # two ranks; the other holds 3 update tokens in every minibatch, so minibatch 2 is not empty globally
    updater, policy, opt, sched = _updater(SimpleNamespace(world_size=2, global_rank=0, strategy=OtherRank(3.0)))
    stats = updater.update(_batch())
    # minibatch 1: weight 2 ranks * 3 tokens / 6 global tokens = 1, gradient 2, w = 0.85 (as above); minibatch 2:
    # this rank runs one zero-weight filler micro-batch (gradient 0) and steps with the other rank (lr 0.075):
    # m = 0.18, v = 0.003996, m_hat = 0.18 / 0.19 = 0.94737, sqrt(v_hat) = sqrt(0.003996 / 0.001999) = 1.41386;
    # w = 0.85 * (1 - 0.075 * 0.5) - 0.075 * 0.94737 / 1.41386 = 0.76787
    assert opt.state[policy.w]["step"] == 2 and sched.last_epoch == 2
    assert float(policy.w.detach()) == pytest.approx(0.767871, abs=1e-5)
    # this rank's share of the token means (weight 2 * 3 / 6 = 1 in minibatch 1, 0 in minibatch 2): the
    # ranks' mean of the two is the global token mean
    assert stats[M.PPO_ENTROPY] == pytest.approx((0.6 + 0.0) / 2)


def test_a_batch_without_update_tokens_returns_no_figures_and_advances_the_schedule():
    updater, policy, opt, sched = _updater(SimpleNamespace(world_size=1, global_rank=0))
    batch = _batch()
    batch.mask = torch.zeros_like(batch.mask)
    assert updater.update(batch) == {}
    assert float(policy.w.detach()) == 1.0 and not opt.state
    assert sched.last_epoch == 2
