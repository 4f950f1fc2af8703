"""The whole-schedule oracle of ``test_oracle_schedule.py`` for the 2025 policy-gradient family's options.

One case per option, each away from its default, on a rollout with more prompts than samples per prompt and
several epochs of several minibatches (and micro-batches): asymmetric clipping (``clip_range_low`` /
``clip_range_high``), GSPO's sequence ratio and GSPO-token, CISPO, the entropy-quantile mask, DAPO's overlong
penalty, masking truncated completions (and minibatches it leaves without an update token, which make no
optimizer step), DAPO's dynamic-sampling filter, and the rollout importance weights at the sequence level in mask
mode; then one case that combines them. The module runs one real iteration,
recorded as ``test_oracle_schedule._record`` records it (``tests.ppo.oracle_recording``) (plus a reward that makes one group's scores equal and a
sampler whose recorded log-probs differ from the trainer's by known amounts); the oracle replays it in plain torch,
from the papers' equations (``test_oracle_schedule.Oracle`` for the experience, the model, the aggregation and
AdamW; the policy term, its masks and its statistics re-written below), and every minibatch's loss, clip
fractions per side, gradients and AdamW step must agree.

Each case also asserts that its option changed something in this rollout (a clip bound between the symmetric
and the asymmetric one, a sequence ratio clipped, a group filtered, a row truncated, ...), so a case passes
only if the option's wiring is followed; each was checked to fail with the option's wiring broken.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace

import pytest
import torch
from torch.testing import assert_close

from rlhf_lit import metrics as M
from rlhf_lit.modules.common import OptimizerConfig
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.sampler import SampleRecord
from rlhf_lit.rl.settings import CriticConfig, KLConfig, PPOConfig, RewardShapingConfig
from tests.ppo.helpers import LORA, RecordingReward, make_data, make_module, make_trainer, uneven_sampler
from tests.ppo.oracle_recording import move_off_zero, record_steps, recording_schedule
from tests.ppo.test_oracle_schedule import Oracle, _combined


@dataclass
class FamilyCase:
    """``test_oracle_schedule.Case``'s fields, plus the reward shaping, a group whose scores are made equal
    (``equal_group``), and synthetic sampler log-probs (``sampler_shift``: the sampler's log-prob of each token
    is the trainer's minus this pattern, so the rollout importance ratios are known numbers)."""

    estimator: str
    prompts: int
    n: int
    ppo: dict
    kl: dict
    optimizer: dict
    reward: dict = field(default_factory=dict)
    equal_group: int | None = None
    sampler_shift: tuple | None = None
    critic_lr: float | None = None
    shared_trunk: bool = False
    max_new_tokens: int = 6
    short_rows: tuple = ((1, 1), (2, 3), (4, 2))


BASE = dict(ppo_epochs=2, ppo_minibatch_size=4, micro_batch_size=2, entropy_coef=0.02, max_grad_norm=None)
OPT = dict(lr=0.08, weight_decay=0.01, betas=(0.8, 0.95), eps=1e-2, scheduler="linear")
CASES = {
    # clip-higher: the high side (0.15) wider than the low one (0.05)
    "asymmetric_clip": FamilyCase(
        "grpo", 4, 2, dict(BASE, clip_range_low=0.05, clip_range_high=0.15, seed=3), dict(kl_coef=0.1), OPT
    ),
    # GSPO: the sequence ratio, clipped per sequence (wider than the paper's 3e-4 so the tiny case moves past it)
    "gspo_sequence": FamilyCase(
        "grpo",
        4,
        2,
        dict(BASE, importance_sampling_level="sequence", clip_range_low=0.03, clip_range_high=0.04, seed=5),
        dict(kl_coef=0.1),
        OPT,
    ),
    # GSPO-token differs from GSPO only with per-token advantages: REINFORCE++'s reward-to-go
    "gspo_token": FamilyCase(
        "reinforce_pp",
        3,
        2,
        dict(BASE, ppo_minibatch_size=3, micro_batch_size=3, importance_sampling_level="sequence_token",
             clip_range=0.05, seed=7),
        dict(kl_coef=0.1),
        OPT,
    ),
    "cispo": FamilyCase(
        "grpo",
        4,
        2,
        dict(BASE, policy_loss="cispo", clip_range_low=0.1, clip_range_high=0.15, seed=9),
        dict(kl_coef=0.1),
        OPT,
    ),
    "top_entropy": FamilyCase(
        "grpo", 3, 2, dict(BASE, ppo_minibatch_size=3, micro_batch_size=3, top_entropy_quantile=0.4, seed=11),
        dict(kl_coef=0.1), OPT,
    ),
    "overlong": FamilyCase(
        "grpo", 4, 2, dict(BASE, seed=13), dict(kl_coef=0.1), OPT, reward=dict(overlong_buffer=3, overlong_penalty=0.7)
    ),
    "mask_truncated": FamilyCase(
        "rloo", 4, 2, dict(BASE, mask_truncated_completions=True, seed=17), dict(kl_coef=0.1), OPT
    ),
    # minibatches of 2 responses, 5 of the 8 truncated: minibatches 2 and 8 hold no update token (no AdamW step,
    # the learning-rate schedule moves on)
    "empty_minibatches": FamilyCase(
        "rloo", 4, 2, dict(BASE, ppo_minibatch_size=2, micro_batch_size=1, mask_truncated_completions=True, seed=8),
        dict(kl_coef=0.1), OPT,
    ),
    "dynamic_sampling": FamilyCase(
        "grpo", 4, 2, dict(BASE, dynamic_sampling=True, loss_aggregation="seq_mean_token_mean", seed=19),
        dict(kl_coef=0.1), OPT, equal_group=1,
    ),
    "tis_sequence_mask": FamilyCase(
        "grpo",
        4,
        2,
        dict(BASE, tis_cap=1.8, tis_level="sequence", tis_mode="mask", seed=23),
        dict(kl_coef=0.1),
        OPT,
        sampler_shift=(0.3, 0.2, 0.1, -0.25, 0.15, 0.05),
    ),
    "combined": FamilyCase(
        "grpo",
        4,
        3,
        dict(
            BASE,
            ppo_minibatch_size=6,
            micro_batch_size=3,
            ppo_epochs=3,
            clip_range_low=0.05,
            clip_range_high=0.09,
            importance_sampling_level="sequence_token",
            top_entropy_quantile=0.6,
            mask_truncated_completions=True,
            dynamic_sampling=True,
            tis_cap=1.3,
            tis_level="token",
            tis_mode="truncate",
            loss_aggregation="token_mean",
            seed=29,
        ),
        dict(kl_coef=0.1),
        OPT,
        reward=dict(overlong_buffer=4, overlong_penalty=0.5),
        equal_group=3,  # rows 9-11 run to max_new_tokens: their overlong penalties are equal too
        sampler_shift=(0.4, -0.3, 0.2, 0.0, -0.1, 0.3),
        short_rows=((1, 1), (2, 3), (4, 2), (7, 0)),
    ),
}


# ---------------------------------------------------------------------------------------- the recording
def _sampler(rec: dict, case: FamilyCase):
    """``uneven_sampler``, and with ``sampler_shift`` a record whose log-probs are the trainer's minus the shift
    (filled in after the experience forward: ``rec["shift"]`` holds the pattern laid over the responses)."""
    base = uneven_sampler(rec, rows=case.short_rows)
    if case.sampler_shift is None:
        return base

    class Shifted(base):
        def sample(self, policy, prompt_ids, prompt_mask, **kwargs):
            ids, mask, stop = super().sample(policy, prompt_ids, prompt_mask, **kwargs)
            width = ids.shape[1]
            shift = torch.tensor(case.sampler_shift[:width]).expand(ids.shape[0], width).clone()
            shift = shift * torch.linspace(1.0, 2.0, ids.shape[0]).unsqueeze(-1)  # rows differ
            rec["shift"] = shift
            # the trainer's old log-probs are not known yet: the record holds the shift, ShiftedRecord below
            # turns it into log-probs when the guard reads it
            self.last_record = SampleRecord(ids.clone(), None, None)
            self.pending_shift = shift
            return ids, mask, stop

    return Shifted


def _record(case: FamilyCase, tmp_path):
    rec: dict = {"epochs": [], "steps": []}
    torch.manual_seed(0)
    module = make_module(
        sampling=SamplingConfig(
            max_new_tokens=case.max_new_tokens, temperature=0.7, num_samples_per_prompt=case.n
        ),
        ppo=PPOConfig(advantage_estimator=case.estimator, total_iterations=1, **case.ppo),
        kl=KLConfig(**case.kl),
        reward=RewardShapingConfig(**case.reward),
        critic=CriticConfig(lora=copy.deepcopy(LORA), shared_trunk=case.shared_trunk, lr=case.critic_lr),
        optimizer=OptimizerConfig(**case.optimizer),
        sampler=_sampler(rec, case),
        schedule=recording_schedule(rec),
    )
    move_off_zero(module)  # critic-free: the actor's LoRA matrices only
    rec["initial"] = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}

    def replace(scores):
        if case.equal_group is None:
            return scores
        out = scores.clone()
        g = case.equal_group * case.n
        out[g : g + case.n] = out[g]  # one group whose scores are all equal
        return out

    reward = RecordingReward(module.collector.reward_fn, replace=replace)
    module.collector.reward_fn = reward
    if case.sampler_shift is not None:  # the sampler's log-probs: the trainer's old ones minus the shift
        collector = module.collector
        real_forwards = collector.experience_forwards

        def forwards(*args, **kwargs):
            ref, old, values = real_forwards(*args, **kwargs)
            sampler = collector.sampler
            sampler.last_record = SampleRecord(
                sampler.last_record.response_ids, (old - sampler.pending_shift).float(), None
            )
            return ref, old, values

        collector.experience_forwards = forwards
    record_steps(module, rec)  # as test_oracle_schedule records it
    make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=case.prompts))
    assert module.iteration == 1
    rec["scores"] = reward.calls[-1]
    rec["final"] = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    rec["logged"] = module.history[-1]
    rec["stop_ids"] = list(module.stop_ids)
    return module, rec


# ---------------------------------------------------------------------------------------- the oracle
class FamilyOracle(Oracle):
    """``Oracle`` with the family's options: shaped scores, left-out rows, rollout importance weights, and the
    policy term (clip bounds per side, the ratio's level, CISPO, the entropy mask)."""

    def __init__(self, case: FamilyCase, module, rec) -> None:
        self.raw_scores = [float(s) for s in rec["scores"]]
        cfg = PPOConfig(advantage_estimator=case.estimator, **case.ppo)
        # the defaults the base oracle reads by name: the estimator's aggregation, placement and KL estimator
        ppo = {**case.ppo, "loss_aggregation": cfg.aggregation()}
        ppo["kl_placement"] = "loss" if cfg.kl_in_loss() else "reward"
        kl = {**case.kl, "estimator": KLConfig(**case.kl).resolved_estimator(cfg.kl_in_loss())}
        super().__init__(replace(case, ppo=ppo, kl=kl), module, rec)
        stop_ids = set(rec["stop_ids"])
        for row in self.rows:
            row["has_stop"] = int(row["response"][-1]) in stop_ids
            row["len"] = len(row["response"])

    def importance_weights(self) -> None:
        """Nothing here: the family's rollout weights (token or sequence level, truncated or masked) are computed
        at the end of :meth:`experience` from the sampler's known shift."""

    @torch.no_grad()
    def experience(self) -> None:
        case, L = self.case, self.case.max_new_tokens
        scores = list(self.raw_scores)
        self.penalties = [0.0] * len(scores)
        buffer = case.reward.get("overlong_buffer")
        if buffer is not None:  # DAPO eq. 13: ((L_max - L_cache) - |y|) / L_cache in the window, times the factor
            factor = case.reward.get("overlong_penalty", 1.0)
            for i, row in enumerate(self.rows):
                if row["len"] > L - buffer:
                    self.penalties[i] = factor * ((L - buffer) - row["len"]) / buffer
        scores = [s + p for s, p in zip(scores, self.penalties)]
        self.rec = {**self.rec, "scores": torch.tensor(scores)}
        super().experience()
        self.excluded = set()
        if self.cfg.mask_truncated_completions:
            self.excluded |= {i for i, row in enumerate(self.rows) if not row["has_stop"]}
        self.filtered_groups = 0
        if self.cfg.dynamic_sampling:  # a group whose scores are all equal leaves the loss
            n = case.n
            for g in range(0, len(scores), n):
                if len(set(scores[g : g + n])) == 1:
                    self.excluded |= set(range(g, g + n))
                    self.filtered_groups += 1
        self.is_w = None
        if self.cfg.tis_cap is not None:
            cap, shift = self.cfg.tis_cap, self.rec["shift"]
            self.is_w, self.is_hit = [], []
            for i, row in enumerate(self.rows):
                d = shift[i, : row["len"]].double()  # old - sampler
                if self.cfg.tis_level == "sequence":
                    d = d.sum().expand(row["len"])
                ratio = torch.exp(d)
                hit = ratio > cap
                if self.cfg.tis_mode == "mask":
                    w = torch.where(hit, 0.0, ratio)
                else:
                    w = ratio.clamp(max=cap)
                self.is_w.append(w.float())
                self.is_hit.append(hit)

    def aggregate_rows(self, per_row: list[torch.Tensor], n_rows: int) -> torch.Tensor:
        """``Oracle.aggregate`` over the kept rows, with token_sum_norm's denominator counting every row of the
        minibatch (its responses x the constant)."""
        if not per_row:
            return torch.zeros(())
        if self.aggregation == "token_sum_norm":
            constant = self.cfg.loss_norm_constant or self.case.max_new_tokens
            return torch.cat(per_row).sum() / (n_rows * constant)
        return self.aggregate(per_row)

    def step(self, mb_rows: list[int]) -> dict:
        cfg = self.cfg
        low, high = cfg.clip_bounds
        micro = cfg.micro_batch_size or cfg.ppo_minibatch_size
        q = cfg.top_entropy_quantile
        actor_w = self.merged("actor")
        pg, ent, kl = [], [], []
        stats = {k: [] for k in ("clip", "low", "high", "between", "approx", "ratio", "keep")}
        for start in range(0, len(mb_rows), micro):
            chunk = [i for i in mb_rows[start : start + micro] if i not in self.excluded]
            terms = {i: self.token_terms(self.rows[i], actor_w, None) for i in chunk}
            threshold = None
            if q < 1.0 and chunk:  # the micro-batch's (1 - q) quantile of its update tokens' entropies
                threshold = torch.quantile(torch.cat([terms[i][1].detach() for i in chunk]), 1.0 - q)
            for i in chunk:
                row = self.rows[i]
                logp, entropy, _ = terms[i]
                adv = torch.tensor(row["adv"])
                d = logp - row["old"]
                level = cfg.importance_sampling_level
                if level == "token":
                    log_ratio = d
                elif level == "sequence":  # GSPO eq. 7: (pi / pi_old)^(1 / |y|)
                    log_ratio = d.mean().expand(len(d))
                else:  # GSPO-token eq. 13: sg[s_i] * pi(y_t) / sg[pi(y_t)]
                    log_ratio = d.mean().detach() + logp - logp.detach()
                ratio = torch.exp(log_ratio)
                r = ratio.detach()
                if cfg.policy_loss == "cispo":  # MiniMax-M1 eq. 4
                    term = -r.clamp(1 - low, 1 + high) * adv * logp
                    lo, hi = r < 1 - low, r > 1 + high
                else:
                    term = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))
                    lo, hi = (adv < 0) & (r < 1 - low), (adv > 0) & (r > 1 + high)
                # a symmetric clip at the low epsilon would clip these; the asymmetric one does not
                stats["between"].append((adv > 0) & (r > 1 + low) & (r <= 1 + high))
                if self.is_w is not None:
                    term = term * self.is_w[i]
                if threshold is not None:
                    keep = entropy.detach() >= threshold
                    stats["keep"].append(keep)
                    term = term * keep
                pg.append(term)
                ent.append(entropy)
                kl.append(_kl(self.kl_estimator, logp, row["ref"]))
                stats["low"].append(lo)
                stats["high"].append(hi)
                stats["clip"].append(lo | hi)
                stats["approx"].append(r - 1 - torch.log(r))
                stats["ratio"].append(r)
        n_rows = len(mb_rows)
        policy = self.aggregate_rows(pg, n_rows)
        loss = policy - self.case.ppo["entropy_coef"] * self.aggregate_rows(ent, n_rows)
        if self.kl_in_loss:
            loss = loss + self.kl_coef * self.aggregate_rows(kl, n_rows)

        def token_mean(parts):
            return float(torch.cat([p.float() for p in parts]).mean()) if parts else 0.0

        out = {
            "loss": float(loss.detach()),
            "between": sum(int(b.sum()) for b in stats["between"]),
            M.PPO_POLICY_LOSS: float(policy.detach()),
            M.PPO_CLIPFRAC: token_mean(stats["clip"]),
            M.PPO_CLIPFRAC_LOW: token_mean(stats["low"]),
            M.PPO_CLIPFRAC_HIGH: token_mean(stats["high"]),
            M.PPO_APPROX_KL: token_mean(stats["approx"]),
            M.PPO_RATIO_MEAN: token_mean(stats["ratio"]),
            M.PPO_ENTROPY: token_mean([e.detach() for e in ent]),
        }
        if q < 1.0:
            out[M.PPO_HIGH_ENTROPY_FRAC] = token_mean(stats["keep"])
        if self.kl_in_loss:
            out[M.PPO_KL_LOSS] = token_mean([k.detach() for k in kl])
        names = list(self.params)
        if loss.requires_grad:
            grads = dict(zip(names, torch.autograd.grad(loss, [self.params[n] for n in names])))
        else:
            grads = {n: torch.zeros_like(p) for n, p in self.params.items()}
        out["grads"] = grads
        out["norm"] = self.apply(grads)
        out["next"] = {n: p.detach().clone() for n, p in self.params.items()}
        return out


def _kl(estimator: str, logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    d = logp - ref
    return {"k1": d, "k2": 0.5 * d * d, "k3": torch.exp(-d) - 1 + d, "abs": d.abs()}[estimator]


# ---------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module", params=sorted(CASES))
def replayed(request, tmp_path_factory):
    case = CASES[request.param]
    module, rec = _record(case, tmp_path_factory.mktemp(request.param))
    oracle = FamilyOracle(case, module, rec)
    oracle.experience()
    schedule = [(rows.tolist(), n_micro) for epoch in rec["epochs"] for rows, n_micro in epoch]
    steps = []
    recorded = iter(rec["steps"])
    for rows, _ in schedule:
        if all(i in oracle.excluded for i in rows):  # no update token: no optimizer step, nothing recorded
            oracle.skip()
            continue
        oracle.params = {n: t.clone().requires_grad_() for n, t in next(recorded)["params"].items()}
        steps.append(oracle.step(rows))
    return request.param, case, module, rec, oracle, schedule, steps


def _stat(micro: list[dict], key: str) -> float:
    parts = [c for c in micro if key in c["stats"] and c["tokens"]]
    return _combined(parts, key) if parts else 0.0


def test_the_option_changes_this_rollout(replayed):
    """Each case's option does something here, so the oracle's agreement below depends on its wiring."""
    name, case, module, rec, oracle, schedule, steps = replayed
    cfg = oracle.cfg
    assert case.prompts > case.n and cfg.ppo_epochs >= 2 and len(rec["epochs"][0]) >= 2
    assert len({len(row["response"]) for row in oracle.rows}) > 1
    low, high = cfg.clip_bounds
    if low != high:  # a side binds somewhere after the first step
        assert any(s[M.PPO_CLIPFRAC_LOW] > 0 or s[M.PPO_CLIPFRAC_HIGH] > 0 for s in steps[1:]), name
    if name == "asymmetric_clip":  # a positive-advantage ratio between 1 + low and 1 + high: unclipped only here
        assert any(s["between"] > 0 for s in steps[1:])
        assert any(s[M.PPO_CLIPFRAC_LOW] > 0 for s in steps[1:]) and any(s[M.PPO_CLIPFRAC_HIGH] > 0 for s in steps[1:])
    if cfg.importance_sampling_level != "token":  # the sequence ratio differs from the token ratios
        assert any(0 < s[M.PPO_CLIPFRAC] < 1 for s in steps[1:]), name
    if cfg.policy_loss == "cispo":  # clipped tokens keep a gradient: the loss is not the clipped surrogate's
        assert any(s[M.PPO_CLIPFRAC] > 0 for s in steps[1:])
    if cfg.top_entropy_quantile < 1:
        assert any(0 < s[M.PPO_HIGH_ENTROPY_FRAC] < 1 for s in steps)
    if case.reward.get("overlong_buffer"):
        assert any(p < 0 for p in oracle.penalties) and any(p == 0 for p in oracle.penalties)
        assert rec["logged"][M.ROLLOUT_OVERLONG_FRAC] == pytest.approx(
            sum(p < 0 for p in oracle.penalties) / len(oracle.penalties)
        )
        assert rec["logged"][M.ROLLOUT_OVERLONG_PENALTY] == pytest.approx(
            sum(oracle.penalties) / len(oracle.penalties), abs=1e-6
        )
    if cfg.mask_truncated_completions:
        truncated = [not row["has_stop"] for row in oracle.rows]
        assert 0 < sum(truncated) < len(truncated)
        assert rec["logged"][M.ROLLOUT_TRUNCATED_MASKED_FRAC] == pytest.approx(sum(truncated) / len(truncated))
    if cfg.dynamic_sampling:
        assert oracle.filtered_groups >= 1
        assert rec["logged"][M.ROLLOUT_FILTERED_GROUPS] == oracle.filtered_groups
    if cfg.tis_cap is not None:
        hits = [bool(h.any()) for h in oracle.is_hit]
        units = hits if cfg.tis_level == "sequence" else torch.cat(oracle.is_hit).tolist()
        assert 0 < sum(units) < len(units)  # the cap binds on some tokens (responses), not on all
        if cfg.tis_level == "sequence":
            kept = [i for i in range(len(oracle.rows)) if i not in oracle.excluded]
            expected = sum(hits[i] for i in kept) / len(kept)
        else:
            kept = [h for i, h in enumerate(oracle.is_hit) if i not in oracle.excluded]
            expected = float(torch.cat(kept).float().mean())
        assert rec["logged"][M.ROLLOUT_TIS_CAPPED_FRAC] == pytest.approx(expected, abs=1e-6)


def test_only_the_minibatches_with_update_tokens_make_a_step(replayed):
    """One optimizer step per minibatch holding an update token, none for the others (the oracle's replay
    skips those, its learning-rate schedule moving on); ``empty_minibatches`` has such minibatches, one of
    them followed by a step (whose learning rate is then the schedule's at its minibatch, not at its step)."""
    name, case, module, rec, oracle, schedule, steps = replayed
    empty = [k for k, (rows, _) in enumerate(schedule) if all(i in oracle.excluded for i in rows)]
    assert len(rec["steps"]) == len(steps) == len(schedule) - len(empty), name
    assert oracle.minibatches_done == len(schedule) and oracle.steps_done == len(steps)
    if name == "empty_minibatches":
        assert empty and empty[0] < len(schedule) - 1
        assert rec["logged"][M.PPO_SKIPPED_STEPS] == 0.0  # skipped for a non-finite norm: none


def test_the_update_mask_equals_the_oracle(replayed):
    """The rows left out (truncated, filtered) carry no update token; the others all theirs."""
    name, case, module, rec, oracle, schedule, steps = replayed
    batch = rec["batch"]
    for i, row in enumerate(oracle.rows):
        expected = 0 if i in oracle.excluded else row["len"]
        assert int(batch.mask[i].sum()) == expected, (name, i)
    mask = batch.mask.bool()
    adv = torch.zeros(mask.shape)
    for i, row in enumerate(oracle.rows):
        if i not in oracle.excluded:
            adv[i, : row["len"]] = torch.tensor(row["adv"])
    assert_close(batch.advantages[mask], adv[mask], atol=1e-4, rtol=1e-5)


def test_every_minibatch_equals_the_oracle(replayed):
    name, case, module, rec, oracle, schedule, steps = replayed
    after = [s["params"] for s in rec["steps"][1:]] + [rec["final"]]
    for k, (ours, theirs, next_params) in enumerate(zip(rec["steps"], steps, after)):
        where = f"{name} minibatch {k}"
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-6), where
        for key in (
            M.PPO_CLIPFRAC,
            M.PPO_CLIPFRAC_LOW,
            M.PPO_CLIPFRAC_HIGH,
            M.PPO_APPROX_KL,
            M.PPO_RATIO_MEAN,
            M.PPO_ENTROPY,
            M.PPO_KL_LOSS,
            M.PPO_HIGH_ENTROPY_FRAC,
        ):
            if key in theirs:
                assert _stat(ours["micro"], key) == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), f"{where} {key}"
            else:
                assert not any(key in c["stats"] for c in ours["micro"]), f"{where} {key}"
        for pname, grad in theirs["grads"].items():
            scale = float(grad.abs().max())
            assert_close(
                ours["grads"].get(pname, torch.zeros_like(grad)),
                grad,
                atol=2e-5 * max(scale, 1e-6),
                rtol=1e-4,
                msg=lambda m, n=pname, w=where: f"{w} {n}: {m}",
            )
        for pname, p in theirs["next"].items():
            assert_close(next_params[pname], p, atol=1e-5, rtol=0, msg=lambda m, n=pname, w=where: f"{w} {n}: {m}")


def test_the_logged_figures_equal_the_oracle(replayed):
    name, case, module, rec, oracle, schedule, steps = replayed
    logged = rec["logged"]
    for key in (M.PPO_POLICY_LOSS, M.PPO_CLIPFRAC_LOW, M.PPO_CLIPFRAC_HIGH, M.PPO_HIGH_ENTROPY_FRAC):
        if key in steps[0]:
            assert logged[key] == pytest.approx(sum(s[key] for s in steps) / len(steps), rel=1e-5, abs=1e-6), key
        else:
            assert key not in logged, key
    assert math.isfinite(logged[M.PPO_GRAD_NORM])
