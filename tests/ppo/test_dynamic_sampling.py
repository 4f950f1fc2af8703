"""DAPO's dynamic sampling with refill (``ppo.dynamic_sampling_max_rounds``) in a real iteration of a tiny GRPO run:
a scripted reward makes chosen groups' scores equal, the extra rounds replace them with groups of freshly drawn
training prompts, and the update gets exactly the configured batch; when the cap is hit, filtered groups top the
batch up with weight 0. The extra prompts depend on (seed, iteration, round, rank) only, so a resumed run draws
the same ones."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from rlhf_lit import metrics as M
from rlhf_lit.errors import ConfigError
from rlhf_lit.functional.policy_gradient import zero_variance_groups
from rlhf_lit.rl.dynamic_sampling import DatasetPrompts, DynamicSampling, merge_groups
from rlhf_lit.rl.filters import RolloutFilters
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.rollout import Rollout
from rlhf_lit.rl.settings import CriticConfig, PPOConfig, check_advantage_estimator
from tests.ppo.helpers import RecordingUpdater, make_data, make_module, make_trainer

N, PROMPTS = 2, 3  # samples per prompt, prompts (groups) per batch


class ScriptedReward:
    """Scores each call's groups by a script: call c's group g gets ``[0.5, 0.5]`` (equal: filtered) where
    ``flat[c][g]`` is True, else ``[0.0, 1.0]``; every call's prompts and tokens are kept in ``calls``."""

    def __init__(self, flat: list[list[bool]]) -> None:
        self.flat, self.calls = flat, []

    def score(self, prompt_ids, prompt_mask, response_ids, response_mask, has_stop=None, prompts=None, fields=None):
        flags = self.flat[len(self.calls)]
        scores = torch.tensor([[0.5, 0.5] if f else [0.0, 1.0] for f in flags]).flatten()
        self.calls.append(
            {
                "prompts": list(prompts),
                "tokens": [
                    torch.cat([p[m.bool()], r[rm.bool()]])
                    for p, m, r, rm in zip(prompt_ids, prompt_mask, response_ids, response_mask)
                ],
            }
        )
        return scores.to(response_ids.device)


def _module(max_rounds: int, refill_prompts=None, **ppo):
    torch.manual_seed(0)
    settings = dict(
        advantage_estimator="grpo",
        ppo_epochs=1,
        ppo_minibatch_size=PROMPTS * N,
        total_iterations=1,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=max_rounds,
        seed=5,
    )
    settings.update(ppo)
    return make_module(
        sampling=SamplingConfig(max_new_tokens=6, temperature=0.7, num_samples_per_prompt=N),
        ppo=PPOConfig(**settings),
        refill_prompts=refill_prompts,
    )


def _fit(module, tmp_path, flat):
    module.collector.reward_fn = reward = ScriptedReward(flat)
    module.updater = updater = RecordingUpdater(module.updater)
    trainer = make_trainer(tmp_path)
    trainer.fit(module, datamodule=make_data(module, batch_size=PROMPTS))
    return reward, updater.calls[-1], trainer


def _rows(reward, kept):
    """The real tokens (prompt then response) of the groups ``kept`` = [(call, group)], row by row."""
    return [reward.calls[c]["tokens"][g * N + j] for c, g in kept for j in range(N)]


def _drawn_texts(trainer, round: int) -> list[str]:
    """The prompt texts ``DatasetPrompts`` draws for ``round`` of iteration 0 (seed 5, one rank)."""
    dataset = trainer.train_dataloader.dataset
    source = DatasetPrompts(dataset, trainer.train_dataloader.collate_fn, seed=5)
    return [dataset[i]["prompt_text"] for i in source.indices(0, round, PROMPTS)]


def test_a_refill_round_replaces_the_filtered_groups(tmp_path):
    module = _module(max_rounds=2)
    # the loader's batch: group 0 informative, 1 and 2 equal; the extra round: group 0 equal, 1 and 2 informative
    reward, batch, trainer = _fit(module, tmp_path, [[False, True, True], [True, False, False]])
    assert len(reward.calls) == 2  # one extra round sufficed, the second was not run
    logged = module.history[-1]
    assert logged[M.ROLLOUT_FILTERED_GROUPS] == 2.0  # the loader's batch's
    assert logged[M.ROLLOUT_DYNAMIC_SAMPLING_ROUNDS] == 1.0
    assert logged[M.ROLLOUT_UNFILLED_GROUPS] == 0.0
    # the update gets the configured 3 groups x 2 samples: (round 0, group 0), (round 1, group 1), (round 1, group 2)
    assert batch.input_ids.shape[0] == PROMPTS * N
    expected = _rows(reward, [(0, 0), (1, 1), (1, 2)])
    got = [ids[m.bool()] for ids, m in zip(batch.input_ids, batch.attention_mask)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    # every row enters the loss: its update mask is its response mask (the prompt block is batch.prompt_len wide)
    response_mask = batch.attention_mask[:, batch.prompt_len :].bool()
    assert torch.equal(batch.mask, response_mask) and bool(batch.mask.any(-1).all())
    # group [0, 1]: GRPO's advantages -1/sqrt(2), +1/sqrt(2) on every token of the first and second response
    for row in range(0, PROMPTS * N, 2):
        low, high = batch.advantages[row][batch.mask[row]], batch.advantages[row + 1][batch.mask[row + 1]]
        torch.testing.assert_close(low, torch.full_like(low, -(2**-0.5)), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(high, torch.full_like(high, 2**-0.5), atol=1e-4, rtol=1e-4)
    # the extra round's prompts are those DatasetPrompts draws for (seed 5, iteration 0, round 1) from the dataset
    drawn = _drawn_texts(trainer, 1)
    assert reward.calls[1]["prompts"] == [t for t in drawn for _ in range(N)]
    first = reward.calls[0]["prompts"]
    assert module.last_rollout["prompt_text"] == [first[0]] * N + [drawn[1]] * N + [drawn[2]] * N


def test_a_prompt_source_given_to_the_module_feeds_the_extra_rounds(tmp_path):
    asked, seen = [], {}

    def source(iteration, round, num_prompts):  # rows 5, 6, 7 of the training prompts
        asked.append((iteration, round, num_prompts))
        loader = seen["trainer"].train_dataloader
        return loader.collate_fn([loader.dataset[i] for i in (5, 6, 7)])

    module = _module(max_rounds=2, refill_prompts=source)
    module.collector.reward_fn = reward = ScriptedReward([[True, False, False], [False, True, True]])
    seen["trainer"] = trainer = make_trainer(tmp_path)
    trainer.fit(module, datamodule=make_data(module, batch_size=PROMPTS))
    assert asked == [(0, 1, PROMPTS)]
    dataset = trainer.train_dataloader.dataset
    assert reward.calls[1]["prompts"] == [dataset[i]["prompt_text"] for i in (5, 6, 7) for _ in range(N)]
    first = reward.calls[0]["prompts"]
    assert module.last_rollout["prompt_text"] == [first[2]] * N + [first[4]] * N + [dataset[5]["prompt_text"]] * N


def test_the_cap_on_rounds_tops_the_batch_up_with_filtered_groups(tmp_path, caplog):
    module = _module(max_rounds=2)
    script = [[False, True, True], [True, True, True], [True, False, True]]
    with caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        reward, batch, _ = _fit(module, tmp_path, script)
    assert len(reward.calls) == 3  # the loader's batch and 2 extra rounds: the cap
    logged = module.history[-1]
    assert logged[M.ROLLOUT_FILTERED_GROUPS] == 2.0
    assert logged[M.ROLLOUT_DYNAMIC_SAMPLING_ROUNDS] == 2.0
    assert logged[M.ROLLOUT_UNFILLED_GROUPS] == 1.0
    assert "ppo.dynamic_sampling_max_rounds=2" in caplog.text and "rollout/unfilled_groups" in caplog.text
    # informative (0, 0) and (2, 1) first, then the first filtered group, (0, 1), with no update token
    expected = _rows(reward, [(0, 0), (2, 1), (0, 1)])
    got = [ids[m.bool()] for ids, m in zip(batch.input_ids, batch.attention_mask)]
    assert len(got) == PROMPTS * N and all(torch.equal(a, b) for a, b in zip(got, expected))
    assert batch.mask[:4].any(-1).all() and not batch.mask[4:].any()
    assert M.PPO_POLICY_LOSS in logged  # the two informative groups were learned from


def test_no_round_runs_when_every_group_has_signal(tmp_path):
    module = _module(max_rounds=3)
    reward, batch, _ = _fit(module, tmp_path, [[False, False, False]])
    assert len(reward.calls) == 1
    logged = module.history[-1]
    assert logged[M.ROLLOUT_DYNAMIC_SAMPLING_ROUNDS] == 0.0 and logged[M.ROLLOUT_UNFILLED_GROUPS] == 0.0
    assert logged[M.ROLLOUT_FILTERED_GROUPS] == 0.0
    # without max_rounds the rounds are not logged (today's filter)
    module = _module(max_rounds=0)
    reward, _, _ = _fit(module, tmp_path / "off", [[False, True, True]])
    assert len(reward.calls) == 1 and M.ROLLOUT_DYNAMIC_SAMPLING_ROUNDS not in module.history[-1]
    assert module.history[-1][M.ROLLOUT_FILTERED_GROUPS] == 2.0


def test_dataset_prompts_depend_on_seed_iteration_round_and_rank_only():
    dataset = [{"i": i} for i in range(20)]

    def source(rank=0, seed=5):
        return DatasetPrompts(dataset, lambda rows: {"i": [r["i"] for r in rows]}, seed, rank, world_size=2)

    a = source().indices(3, 1, 4)
    assert source()(3, 1, 4) == {"i": a}  # the batch is the collated rows
    assert source().indices(3, 1, 4) == a  # a fresh source (a resumed run) draws the same
    torch.manual_seed(123)  # the global RNG plays no part, and is not drawn from
    state = torch.get_rng_state()
    assert source().indices(3, 1, 4) == a and torch.equal(torch.get_rng_state(), state)
    # rounds and ranks of one iteration take distinct rows of one permutation (20 rows, 2 rounds x 2 ranks x 4)
    drawn = [source(rank).indices(3, r, 4) for r in (1, 2) for rank in (0, 1)]
    assert len({i for d in drawn for i in d}) == 16
    assert source().indices(4, 1, 4) != a and source(seed=6).indices(3, 1, 4) != a
    assert sorted(source().indices(0, 1, 20)) == list(range(20))  # a permutation: no row twice
    assert len(source().indices(0, 3, 8)) == 8  # more than the dataset holds: cycles


def test_max_rounds_without_dynamic_sampling_is_refused():
    with pytest.raises(ConfigError, match=r"ppo.dynamic_sampling_max_rounds=2 .* ppo.dynamic_sampling filters, which is off"):
        check_advantage_estimator(
            PPOConfig(advantage_estimator="grpo", dynamic_sampling_max_rounds=2),
            SamplingConfig(num_samples_per_prompt=2),
            CriticConfig(),
        )
    with pytest.raises(ConfigError, match=r"ppo.dynamic_sampling_max_rounds must be a whole number >= 0"):
        PPOConfig(dynamic_sampling=True, dynamic_sampling_max_rounds=-1)


def _flat_prompts_reward(module):
    """A reward that makes the groups of prompts of even length equal (0.5 each) and leaves the others' real
    scores: deterministic in the prompt, so a resumed run sees the same filtered groups."""
    inner = module.collector.reward_fn

    class ByPrompt:
        def score(self, prompt_ids, prompt_mask, response_ids, response_mask, has_stop=None, prompts=None, **kw):
            scores = inner.score(prompt_ids, prompt_mask, response_ids, response_mask)
            even = torch.tensor([len(p) % 2 == 0 for p in prompts], device=scores.device)
            return torch.where(even, torch.full_like(scores, 0.5), scores)

    module.collector.reward_fn = ByPrompt()


def test_a_resumed_run_draws_the_same_rounds_as_an_uninterrupted_one(tmp_path):
    def run(folder, **fit):
        module = _module(max_rounds=2, total_iterations=3)
        _flat_prompts_reward(module)
        trainer = make_trainer(tmp_path / folder, **fit.pop("trainer", {}))
        trainer.fit(module, datamodule=make_data(module, batch_size=PROMPTS), **fit)
        return module, trainer

    straight, _ = run("straight")
    first, trainer = run("first", trainer=dict(max_steps=1))
    assert first.iteration == 1
    ckpt = tmp_path / "one.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed, _ = run("resumed", ckpt_path=str(ckpt))
    assert resumed.iteration == straight.iteration == 3
    rounds = [h[M.ROLLOUT_DYNAMIC_SAMPLING_ROUNDS] for h in straight.history]
    assert sum(rounds) > 0  # the even-length prompts were refilled somewhere
    assert [h[M.ROLLOUT_DYNAMIC_SAMPLING_ROUNDS] for h in resumed.history] == rounds
    assert [h[M.ROLLOUT_SCORE_MEAN] for h in resumed.history] == [h[M.ROLLOUT_SCORE_MEAN] for h in straight.history]
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        if a.requires_grad:
            torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=name)


# ---------------------------------------------------------------------------------------- without a model
def _rollout(prompts, prompt_mask, responses, response_mask, scores, logprob, texts, is_weight, non_finite=0):
    """A hand-made ``Rollout`` of n = 2 (its filtered flags from ``zero_variance_groups``, as ``apply_filters``)."""
    prompt_ids, response_ids = torch.tensor(prompts), torch.tensor(responses)
    p_mask, r_mask = torch.tensor(prompt_mask), torch.tensor(response_mask).bool()
    scores = torch.tensor(scores)
    zeros = torch.zeros(response_ids.shape)
    return Rollout(
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        response_mask=r_mask,
        has_stop=torch.ones(len(scores), dtype=torch.bool),
        input_ids=torch.cat([prompt_ids, response_ids], 1),
        attention_mask=torch.cat([p_mask, r_mask.long()], 1),
        ref_logprobs=zeros.clone(),
        old_logprobs=torch.full(response_ids.shape, logprob),
        old_values=None,
        kl=zeros.clone(),
        raw_scores=scores.clone(),
        scores=scores,
        finite=torch.ones(len(scores), dtype=torch.bool),
        num_non_finite=non_finite,
        prompt_text=texts,
        generation_s=0.5,
        is_weights=torch.full(response_ids.shape, is_weight),
        filters=RolloutFilters(filtered=zero_variance_groups(scores, 2), filtered_groups=1),
    )


def _round0():  # group 0 (prompt "a") informative, group 1 ("b") equal; P = 2, R = 3
    return _rollout(
        [[0, 11], [0, 11], [12, 13], [12, 13]], [[0, 1], [0, 1], [1, 1], [1, 1]],
        [[21, 22, 23], [24, 0, 0], [25, 26, 0], [27, 28, 29]], [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]],
        [1.0, 2.0, 3.0, 3.0], -1.0, ["a", "a", "b", "b"], 0.5,
    )


def _round1():  # group 0 ("c") equal, group 1 ("d") informative; P = 3, R = 2
    return _rollout(
        [[31, 32, 33], [31, 32, 33], [0, 34, 35], [0, 34, 35]], [[1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1]],
        [[41, 0], [42, 43], [44, 0], [45, 46]], [[1, 0], [1, 1], [1, 0], [1, 1]],
        [5.0, 5.0, 6.0, 7.0], -2.0, ["c", "c", "d", "d"], 0.75, non_finite=1,
    )


def test_merge_groups_by_hand():
    merged = merge_groups([_round0(), _round1()], torch.tensor([0, 1]), torch.tensor([0, 1]), 2, pad_token_id=0)
    # prompts left padded to 3, then column 0 (padding in every kept row) dropped: P = 2; responses right padded to 3
    assert merged.prompt_len == 2
    assert merged.input_ids.tolist() == [[0, 11, 21, 22, 23], [0, 11, 24, 0, 0], [34, 35, 44, 0, 0], [34, 35, 45, 46, 0]]
    assert merged.attention_mask.tolist() == [[0, 1, 1, 1, 1], [0, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    assert merged.prompt_ids.tolist() == [[0, 11], [0, 11], [34, 35], [34, 35]]
    assert merged.response_mask.tolist() == [[True] * 3, [True, False, False], [True, False, False], [True, True, False]]
    # log-probs padded with 0, importance weights with 1
    assert merged.old_logprobs.tolist() == [[-1.0] * 3, [-1.0] * 3, [-2.0, -2.0, 0.0], [-2.0, -2.0, 0.0]]
    assert merged.is_weights.tolist() == [[0.5] * 3, [0.5] * 3, [0.75, 0.75, 1.0], [0.75, 0.75, 1.0]]
    assert merged.scores.tolist() == [1.0, 2.0, 6.0, 7.0] and merged.filters.filtered.tolist() == [False] * 4
    assert merged.prompt_text == ["a", "a", "d", "d"]
    assert merged.num_non_finite == 1 and merged.generation_s == 1.0
    assert merged.sampled_tokens == 4 * 3 + 4 * 2  # every round's response positions, kept or not
    # only the right padding of every kept response goes: (1, 1) then (0, 1) keeps R = 2 of round 1's rows
    narrow = merge_groups([_round0(), _round1()], torch.tensor([1, 1]), torch.tensor([1, 0]), 2, pad_token_id=0)
    assert narrow.prompt_len == 3 and narrow.response_ids.tolist() == [[44, 0], [45, 46], [41, 0], [42, 43]]


class _World:
    """A trainer of 2 ranks for the collectives: the other rank's shortfall is ``other[k]`` at the k-th sum."""

    world_size = 2

    def __init__(self, other):
        self.other, self.strategy = list(other), self

    def reduce(self, value, reduce_op="sum"):
        return value + self.other.pop(0)


class _Collector:
    """Returns the scripted rollouts in turn; the settings and world ``DynamicSampling`` reads."""

    def __init__(self, rollouts, world):
        self.rollouts, self.batches = list(rollouts), []
        self.settings = SimpleNamespace(num_samples_per_prompt=2)
        self.world = lambda: world

    def collect(self, batch, iteration=0):
        self.batches.append(batch)
        return self.rollouts.pop(0)


def test_every_rank_runs_the_rounds_another_rank_needs():
    # this rank's first round has 1 informative group of 2; round 1 brings one; the other rank needs a round too
    draws = []
    collector = _Collector([_round0(), _round1()], _World([1, 0, 0]))
    sampling = DynamicSampling(collector, 3, lambda *a: draws.append(a) or {"drawn": a}, pad_token_id=0)
    merged = sampling.collect({"loader": True}, iteration=7)
    assert draws == [(7, 1, 2)] and collector.batches == [{"loader": True}, {"drawn": (7, 1, 2)}]
    assert merged.prompt_text == ["a", "a", "d", "d"] and merged.filters.rounds == 1
    assert merged.filters.unfilled_groups == 0 and merged.filters.filtered_groups == 1
    # this rank is full after round 0 (two informative groups), but the other rank is short by 1, then not:
    # both run one round, and this rank keeps its own first round
    full = _rollout(
        [[0, 11], [0, 11], [12, 13], [12, 13]], [[0, 1], [0, 1], [1, 1], [1, 1]], [[21], [22], [23], [24]],
        [[1]] * 4, [1.0, 2.0, 3.0, 4.0], -1.0,
        ["a", "a", "b", "b"], 1.0,
    )
    collector = _Collector([full, _round1()], _World([1, 0, 0]))
    sampling = DynamicSampling(collector, 3, lambda *a: {"drawn": a}, pad_token_id=0)
    merged = sampling.collect({"loader": True})
    assert len(collector.batches) == 2 and merged.filters.rounds == 1
    assert merged.prompt_text == ["a", "a", "b", "b"] and merged.input_ids.tolist() == full.input_ids.tolist()


def test_the_cap_warning_is_given_once(caplog):
    flat = _round1()
    flat.scores = flat.raw_scores = torch.tensor([5.0, 5.0, 6.0, 6.0])
    flat.filters = RolloutFilters(filtered=torch.ones(4, dtype=torch.bool), filtered_groups=2)

    def one_rank():
        return SimpleNamespace(world_size=1)

    collector = _Collector([flat, _round0(), flat, _round0()], None)
    collector.world = one_rank
    sampling = DynamicSampling(collector, 1, lambda *a: {}, pad_token_id=0)
    with caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        first = sampling.collect({})
        second = sampling.collect({})
    # 1 round: round 0's groups both equal, round 1's group 0 informative: (1, 0), then (0, 0) unfilled
    assert first.prompt_text == ["a", "a", "c", "c"] and first.filters.unfilled_groups == 1
    assert second.filters.unfilled_groups == 1
    assert caplog.text.count("still have equal scores") == 1
