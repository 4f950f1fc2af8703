"""The PPO oracle over the whole update schedule: every minibatch of every epoch, for GAE and each critic-free
estimator, under configs in which every option the update reads has a distinct, non-default value.

The module runs one real iteration (sampling, reward model, ``ppo_epochs`` x minibatches x micro-batches of
clipped, AdamW-stepped updates). What it did is recorded through its collaborators, never by patching
production code: the sampler and the minibatch schedule are injected through ``PPOModule``'s constructor;
the reward function, the updater, the updater's objective and its ``backward`` / ``clip`` callables are
replaced on the built module by recording wrappers that delegate to the real ones.

From what was sampled and scored alone, a plain-torch oracle replays the iteration with its OWN copy of the
trainable weights (LoRA matrices merged by hand into a fresh Hugging Face GPT-2, ``test_oracle``'s helpers;
one unpadded sequence at a time) and its own arithmetic, written from the papers' equations and nothing of
``rlhf_lit``'s math:

* experience: reference / old log-probs, values, the per-token KL (k1 ``logp - ref``, k2 ``(logp - ref)^2 / 2``,
  k3 ``exp(ref - logp) - 1 - (ref - logp)``, abs ``|logp - ref|``), the token rewards, and the advantages of
  GAE (Schulman et al. 2016, eq. 16; whitening optional), GRPO / Dr.GRPO (Shao et al. 2024 s. 4.1.2; Liu et
  al. 2025), RLOO (Ahmadian et al. 2024, eq. 7) and REINFORCE++ (Hu 2025): checked against the update's input;
* with ``ppo.tis_cap``, from a stand-in sampler whose recorded log-probs are not the trainer's
  (:func:`offset_sampler`, injected through the constructor): the truncated importance weights
  ``min(exp(old - sampler), tis_cap)`` (Yao et al. 2025) from the trainer's old log-probs the oracle
  recomputes and the log-probs the sampler recorded, 1 on a token the sampler did not draw; checked against
  the update's input and the logged ``rollout/tis_*``;
* for each minibatch, in the order the module's schedule drew them: the clipped surrogate with the dual clip
  (Schulman et al. 2017, eq. 7; Ye et al. 2020) times the importance weight where configured, the clipped
  value loss (``0.5 * max((V - R)^2, (V_clip - R)^2)``), the KL term in the loss where configured, the
  entropy bonus, aggregated as configured (token mean; mean over responses of token means, Shao et al. 2024
  eq. 3; token sum / (responses x constant), Liu et al. 2025 eq. 3); its statistics (clip fraction, value
  clip fraction, approximate KL, mean ratio, entropy, KL term); with ``ptx.coef``, the SFT loss of the step's
  PTX batch through the actor (Ouyang et al. 2022, eq. 2); its gradients by autograd; the global-norm
  clipping; and an AdamW step (Loshchilov & Hutter 2019, Alg. 2) at the learning rate the schedule gives
  that step, per parameter group.

Checked per minibatch: the loss the module back-propagated, its statistics, the gradients before clipping
and the parameters the step started from (so after the first update the ratios, clip fractions and value
clips are those of a policy that has moved), then the final parameters and the figures the module logged
(the means over the minibatches). Every config has more prompts than samples per prompt, uneven response
lengths, several minibatches per epoch and at least two epochs; each aggregation, both KL placements and
every KL estimator appear; the non-degeneracy test asserts that the clip, the dual clip, the value clip and
the importance-weight cap all bind somewhere. ``READ`` lists every option the update reads, each set away from
its default by some case (warm-up and three schedules, the PTX term included); ``NOT_READ`` every other
field of the same settings with the reason no case needs it.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass

import pytest
import torch
from torch.testing import assert_close

from rlhf_lit import metrics as M
from rlhf_lit.functional.aggregation import AGGREGATIONS
from rlhf_lit.modules.common import OptimizerConfig
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.sampler import SampleRecord
from rlhf_lit.rl.settings import CriticConfig, KLConfig, PPOConfig, PTXConfig
from tests.ppo.helpers import LORA, RecordingReward, make_data, make_module, make_trainer, uneven_sampler
from tests.ppo.oracle_recording import move_off_zero, record_steps, recording_schedule
from tests.ppo.test_oracle import _forward, _plain_gpt2

TEMPERATURE = 0.7
SCALING = LORA.alpha / LORA.r  # peft's LoRA scaling
PREFIX = "policy.lm.model.base_model.model."


@dataclass
class Case:
    """One configuration: ``ppo`` / ``kl`` / ``optimizer`` fields by name, the rollout's shape, and which
    rows the sampler cuts short (``(row, stop position)``) so response lengths differ."""

    estimator: str
    prompts: int
    n: int
    ppo: dict
    kl: dict
    optimizer: dict
    critic_lr: float | None = None
    shared_trunk: bool = False
    max_new_tokens: int = 6
    short_rows: tuple = ((1, 1), (2, 3))
    sampler_offset: float = 0.0  # > 0: the sampler's recorded log-probs are not the trainer's (with tis_cap)
    ptx: dict | None = None  # PTXConfig fields: the pretraining-mix term


# Every option the update reads differs from its default and from the other options of its kind (clip_range
# != value_clip_range, and so on); between the two configs of an estimator the KL placement, the loss
# aggregation and the KL estimator change.
CASES = {
    "gae_reward_kl_seq_mean": Case(
        "gae",
        prompts=6,
        n=1,
        ppo=dict(
            ppo_epochs=2,
            ppo_minibatch_size=2,
            micro_batch_size=2,
            gamma=0.9,
            gae_lambda=0.8,
            clip_range=0.05,
            value_clip_range=0.5,
            dual_clip=1.06,
            vf_coef=0.3,
            entropy_coef=0.02,
            whiten_advantages=True,
            max_grad_norm=0.5,
            loss_aggregation="seq_mean_token_mean",
            kl_placement="reward",
            logprob_chunk_size=2,
            seed=7,
            tis_cap=1.08,
            max_consecutive_skips=2,
            rollout_forward_batch_size=4,
        ),
        kl=dict(kl_coef=0.15, estimator="k2"),
        optimizer=dict(lr=0.15, weight_decay=0.01, betas=(0.8, 0.95), eps=1e-2, scheduler="linear"),
        critic_lr=0.03,
        short_rows=((1, 1), (2, 3), (4, 0)),
        sampler_offset=0.15,
    ),
    "gae_loss_kl_token_sum_shared_trunk": Case(
        "gae",
        prompts=3,
        n=2,
        ppo=dict(
            ppo_epochs=3,
            ppo_minibatch_size=3,
            micro_batch_size=None,
            gamma=0.95,
            gae_lambda=0.7,
            clip_range=0.25,
            value_clip_range=0.4,
            dual_clip=1.3,
            vf_coef=0.7,
            entropy_coef=0.05,
            whiten_advantages=False,
            max_grad_norm=None,
            loss_aggregation="token_sum_norm",
            loss_norm_constant=5.0,
            kl_placement="loss",
            seed=3,
        ),
        kl=dict(kl_coef=0.3, estimator="k1"),
        optimizer=dict(
            lr=0.03, weight_decay=0.02, betas=(0.85, 0.9), eps=1e-2, scheduler="cosine", warmup_steps=1
        ),
        shared_trunk=True,
    ),
    "grpo_loss_kl_token_sum": Case(
        "grpo",
        prompts=3,
        n=2,
        ppo=dict(
            ppo_epochs=2,
            ppo_minibatch_size=2,
            micro_batch_size=1,
            clip_range=0.12,
            dual_clip=1.15,
            entropy_coef=0.03,
            max_grad_norm=0.4,
            scale_by_std=True,
            loss_aggregation="token_sum_norm",
            loss_norm_constant=4.0,
            kl_placement="loss",
            seed=5,
            tis_cap=1.05,
            rollout_forward_batch_size=4,
        ),
        kl=dict(kl_coef=0.1, estimator="k2"),
        optimizer=dict(
            lr=0.06, weight_decay=0.03, betas=(0.7, 0.9), eps=1e-2, scheduler="linear", warmup_steps=1
        ),
        sampler_offset=0.1,
    ),
    "dr_grpo_reward_kl_token_mean": Case(
        "grpo",
        prompts=4,
        n=3,
        ppo=dict(
            ppo_epochs=2,
            ppo_minibatch_size=4,
            micro_batch_size=2,
            clip_range=0.14,
            dual_clip=1.15,
            entropy_coef=0.01,
            max_grad_norm=None,
            scale_by_std=False,
            loss_aggregation="token_mean",
            kl_placement="reward",
            seed=11,
        ),
        kl=dict(kl_coef=0.2, estimator="k3"),
        optimizer=dict(lr=0.05, weight_decay=0.01, betas=(0.8, 0.95), eps=1e-2, scheduler="cosine"),
        short_rows=((1, 1), (4, 3), (6, 0)),
    ),
    "rloo_reward_kl_seq_mean": Case(
        "rloo",
        prompts=4,
        n=3,
        ppo=dict(
            ppo_epochs=2,
            ppo_minibatch_size=6,
            micro_batch_size=3,
            clip_range=0.18,
            dual_clip=1.2,
            entropy_coef=0.04,
            max_grad_norm=0.6,
            loss_aggregation="seq_mean_token_mean",
            kl_placement="reward",
            seed=13,
        ),
        kl=dict(kl_coef=0.25, estimator="abs"),
        optimizer=dict(lr=0.05, weight_decay=0.02, betas=(0.8, 0.9), eps=1e-2, scheduler="linear"),
        short_rows=((0, 2), (5, 1), (9, 3)),
    ),
    "rloo_loss_kl_token_mean": Case(
        "rloo",
        prompts=3,
        n=2,
        ppo=dict(
            ppo_epochs=3,
            ppo_minibatch_size=2,
            micro_batch_size=1,
            clip_range=0.22,
            dual_clip=1.1,
            entropy_coef=0.06,
            max_grad_norm=None,
            loss_aggregation="token_mean",
            kl_placement="loss",
            seed=17,
        ),
        kl=dict(kl_coef=0.12, estimator="k2"),
        optimizer=dict(
            lr=0.04,
            weight_decay=0.01,
            betas=(0.85, 0.95),
            eps=1e-2,
            scheduler="constant_with_warmup",
            warmup_steps=1,
        ),
    ),
    "reinforce_pp_reward_kl_token_sum": Case(
        "reinforce_pp",
        prompts=4,
        n=1,
        ppo=dict(
            ppo_epochs=2,
            ppo_minibatch_size=2,
            micro_batch_size=1,
            gamma=0.85,
            clip_range=0.16,
            dual_clip=1.4,
            entropy_coef=0.02,
            max_grad_norm=0.3,
            loss_aggregation="token_sum_norm",
            loss_norm_constant=7.0,
            kl_placement="reward",
            seed=19,
        ),
        kl=dict(kl_coef=0.2, estimator="k2"),
        optimizer=dict(lr=0.05, weight_decay=0.01, betas=(0.8, 0.95), eps=1e-2, scheduler="linear"),
    ),
    "reinforce_pp_loss_kl_seq_mean": Case(
        "reinforce_pp",
        prompts=3,
        n=2,
        ppo=dict(
            ppo_epochs=2,
            ppo_minibatch_size=3,
            micro_batch_size=3,
            gamma=0.75,
            clip_range=0.1,
            dual_clip=1.12,
            entropy_coef=0.03,
            max_grad_norm=None,
            loss_aggregation="seq_mean_token_mean",
            kl_placement="loss",
            seed=23,
        ),
        kl=dict(kl_coef=0.15, estimator="abs"),
        optimizer=dict(lr=0.05, weight_decay=0.02, betas=(0.8, 0.9), eps=1e-2, scheduler="cosine"),
        ptx=dict(
            coef=0.4,
            train_files=["demo:sft?n=12&seed=3&split=train"],
            format="explicit",
            batch_size=3,
            max_length=40,
        ),
    ),
}


# ---------------------------------------------------------------------------------------- the recording
def offset_sampler(record: dict, rows, offset: float):
    """``uneven_sampler`` standing in for a sampler that is not the trainer (a 16-bit copy, an inference
    engine): the log-prob it records for each drawn token is the true one plus a fixed offset drawn uniformly
    from ``[-offset, offset]`` (seeded), so ``pi_trainer / pi_sampler`` is ``exp(-offset_t)``, away from 1 on
    every token. ``record["drawn"]`` keeps ``(response_ids as drawn, recorded log-probs)``."""

    class Offset(uneven_sampler(record, rows)):
        def sample(self, policy, prompt_ids, prompt_mask, **kwargs):
            out = super().sample(policy, prompt_ids, prompt_mask, **kwargs)
            true = self.last_record  # HFSampler's record: the tokens before Uneven cut rows short
            gen = torch.Generator().manual_seed(29)
            shift = (2 * torch.rand(true.logprobs.shape, generator=gen) - 1) * offset
            self.last_record = SampleRecord(true.response_ids, true.logprobs + shift, true.fingerprint)
            record["drawn"] = (true.response_ids.clone(), self.last_record.logprobs.clone())
            return out

    return Offset


class RecordingStream:
    """Stands in for the updater's PTX stream: delegates, and keeps a copy of every batch it hands out."""

    def __init__(self, inner, batches: list) -> None:
        self.inner, self.batches = inner, batches

    def next_batch(self) -> dict:
        batch = self.inner.next_batch()
        self.batches.append({k: v.clone() for k, v in batch.items() if torch.is_tensor(v)})
        return batch

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _record(case: Case, tmp_path):
    rec: dict = {"epochs": [], "steps": []}
    if case.sampler_offset:  # the rollout guard would warn about the offsets it is told to expect
        sampler = offset_sampler(rec, case.short_rows, case.sampler_offset)
        guard = {"logprob_gap_tolerance": 1.0}
    else:
        sampler, guard = uneven_sampler(rec, rows=case.short_rows), {}
    extra = {} if case.ptx is None else {"ptx": PTXConfig(**case.ptx)}
    torch.manual_seed(0)
    module = make_module(
        sampling=SamplingConfig(
            max_new_tokens=case.max_new_tokens,
            temperature=TEMPERATURE,
            num_samples_per_prompt=case.n,
            **guard,
        ),
        ppo=PPOConfig(advantage_estimator=case.estimator, total_iterations=1, **case.ppo),
        kl=KLConfig(**case.kl),
        critic=CriticConfig(lora=copy.deepcopy(LORA), shared_trunk=case.shared_trunk, lr=case.critic_lr),
        optimizer=OptimizerConfig(**case.optimizer),
        sampler=sampler,
        schedule=recording_schedule(rec),
        **extra,
    )
    move_off_zero(module)
    rec["initial"] = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}

    reward = RecordingReward(module.collector.reward_fn)
    module.collector.reward_fn = reward
    updater = record_steps(module, rec)  # the update's input, and every minibatch's loss, gradients and step
    real_ptx_backward = updater.ptx_backward

    def ptx_backward(device):  # the stream is the updater's (built with it): record what it hands out
        if not isinstance(updater.ptx_stream, RecordingStream):
            updater.ptx_stream = RecordingStream(updater.ptx_stream, rec.setdefault("ptx", []))
        return real_ptx_backward(device)

    updater.ptx_backward = ptx_backward
    make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=case.prompts))
    assert module.iteration == 1
    rec["scores"] = reward.calls[-1]
    rec["final"] = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    rec["logged"] = module.history[-1]
    return module, rec


# ---------------------------------------------------------------------------------------- the oracle
def _kl(estimator: str, logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimates (Schulman 2020, "Approximating KL divergence")."""
    d = logp - ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(-d) - 1 + d
    assert estimator == "abs"
    return d.abs()


def _whiten(rows: list[list[float]]) -> list[list[float]]:
    """(a - mean) / sqrt(var + 1e-8) with the mean and unbiased variance over every token of the rollout."""
    flat = [a for row in rows for a in row]
    mean = sum(flat) / len(flat)
    var = sum((a - mean) ** 2 for a in flat) / (len(flat) - 1)
    return [[(a - mean) / math.sqrt(var + 1e-8) for a in row] for row in rows]


class Oracle:
    """Replays the iteration with its own weights: ``experience()``, then ``step(rows)`` per minibatch."""

    def __init__(self, case: Case, module, rec) -> None:
        self.case, self.rec = case, rec
        self.cfg = PPOConfig(advantage_estimator=case.estimator, **case.ppo)
        self.aggregation = case.ppo["loss_aggregation"]
        self.kl_in_loss = case.ppo["kl_placement"] == "loss"
        self.kl_coef, self.kl_estimator = case.kl["kl_coef"], case.kl["estimator"]
        self.has_critic = case.estimator == "gae"
        self.plain, self.base = _plain_gpt2(module)
        # the oracle's own trainable weights, by the module's parameter names
        self.params = {n: t.clone().requires_grad_() for n, t in rec["initial"].items()}
        self.state = {n: (torch.zeros_like(t), torch.zeros_like(t)) for n, t in self.params.items()}
        self.steps_done = 0  # AdamW steps applied (its bias correction's t - 1)
        self.minibatches_done = 0  # minibatches so far, empty ones included (the learning-rate schedule's step)
        prompt_ids, prompt_mask, response_ids, response_mask = rec["sample"]
        self.rows = []
        for i in range(prompt_ids.shape[0]):
            prompt = prompt_ids[i][prompt_mask[i].bool()]
            response = response_ids[i][response_mask[i].bool()]
            self.rows.append({"ids": torch.cat([prompt, response]), "P": len(prompt), "response": response})
        opt = case.optimizer
        self.lr = {"actor": opt["lr"], "critic": case.critic_lr or opt["lr"]}
        n_rows = case.prompts * case.n
        self.total_steps = self.cfg.ppo_epochs * (n_rows // self.cfg.ppo_minibatch_size)

    # -- the model
    def merged(self, adapter: str | None) -> dict[str, torch.Tensor]:
        """The base weights plus ``scaling * (B A)^T`` of ``adapter``'s LoRA pairs (GPT-2's Conv1D is x @ W)."""
        weights = dict(self.base)
        if adapter is None:
            return weights
        for name, a in self.params.items():
            m = re.fullmatch(rf"{re.escape(PREFIX)}(.*)\.lora_A\.{adapter}\.weight", name)
            if m:
                b = self.params[f"{PREFIX}{m[1]}.lora_B.{adapter}.weight"]
                weights[f"{m[1]}.weight"] = self.base[f"{m[1]}.weight"] + SCALING * (b @ a).T
        return weights

    def token_terms(self, row, actor_w, critic_w):
        """Log-probs, entropies and values of the response tokens: the logits at P - 1 + t predict token t,
        and that action's value is read from the hidden state at the same position."""
        logits, hidden = _forward(self.plain, actor_w, row["ids"])
        if critic_w is not None and not self.case.shared_trunk:
            _, hidden = _forward(self.plain, critic_w, row["ids"])
        logp, entropy, values = [], [], []
        for t, token in enumerate(row["response"].tolist()):
            pos = row["P"] - 1 + t
            dist = torch.log_softmax(logits[pos] / TEMPERATURE, dim=-1)
            logp.append(dist[token])
            entropy.append(-(dist.exp() * dist).sum())
            if self.has_critic:
                w, b = (
                    self.params["policy.value_head.linear.weight"],
                    self.params["policy.value_head.linear.bias"],
                )
                values.append(hidden[pos] @ w[0] + b[0])
        return torch.stack(logp), torch.stack(entropy), torch.stack(values) if values else None

    # -- steps 2-5
    @torch.no_grad()
    def experience(self) -> None:
        ref_w, actor_w = self.merged(None), self.merged("actor")
        critic_w = self.merged("critic") if self.has_critic else None
        scores = [float(s) for s in self.rec["scores"]]
        for row in self.rows:
            row["ref"], _, _ = self.token_terms(row, ref_w, None)
            row["old"], _, values = self.token_terms(row, actor_w, critic_w)
            row["values"] = None if values is None else [float(v) for v in values]
            row["kl"] = [float(k) for k in _kl(self.kl_estimator, row["old"], row["ref"])]
        if self.cfg.tis_cap is not None:
            self.importance_weights()
        beta = 0.0 if self.kl_in_loss else self.kl_coef
        rewards = []
        for row, score in zip(self.rows, scores):
            r = [-beta * k for k in row["kl"]]
            r[-1] += score
            rewards.append(r)
        est = self.case.estimator
        if est == "gae":
            raw = []
            for row, r in zip(self.rows, rewards):
                adv, last, next_v = [0.0] * len(r), 0.0, 0.0
                for t in reversed(range(len(r))):
                    delta = r[t] + self.cfg.gamma * next_v - row["values"][t]
                    last = delta + self.cfg.gamma * self.cfg.gae_lambda * last
                    adv[t], next_v = last, row["values"][t]
                raw.append(adv)
                row["returns"] = [a + v for a, v in zip(adv, row["values"])]
            advs = _whiten(raw) if self.cfg.whiten_advantages else raw
        elif est == "reinforce_pp":
            raw = []
            for r in rewards:
                g, acc = [0.0] * len(r), 0.0
                for t in reversed(range(len(r))):
                    acc = r[t] + self.cfg.gamma * acc
                    g[t] = acc
                raw.append(g)
            advs = _whiten(raw)
        else:
            n, seq = self.case.n, [sum(r) for r in rewards]
            per_seq = []
            for g in range(0, len(seq), n):
                group = seq[g : g + n]
                mean = sum(group) / n
                std = math.sqrt(sum((x - mean) ** 2 for x in group) / (n - 1))
                for x in group:
                    if est == "rloo":
                        per_seq.append(x - (sum(group) - x) / (n - 1))
                    elif self.cfg.scale_by_std:
                        per_seq.append((x - mean) / (std + 1e-6))
                    else:
                        per_seq.append(x - mean)
            advs = [[a] * len(row["response"]) for a, row in zip(per_seq, self.rows)]
        for row, adv in zip(self.rows, advs):
            row["adv"] = adv

    def importance_weights(self) -> None:
        """Truncated importance sampling (Yao et al. 2025): each response token's weight is
        ``min(pi_trainer / pi_sampler, tis_cap) = min(exp(old - sampler), tis_cap)`` from the trainer's
        log-prob at rollout time (``old``, recomputed here) and the one the sampler recorded when it drew the
        token; 1 where the token is not the one the sampler drew (a row the stand-in cut short)."""
        drawn_ids, drawn_logprobs = self.rec["drawn"]
        for i, row in enumerate(self.rows):
            weights = []
            for t, token in enumerate(row["response"].tolist()):
                if t < drawn_ids.shape[1] and int(drawn_ids[i, t]) == token:
                    log_ratio = float(row["old"][t]) - float(drawn_logprobs[i, t])
                    weights.append(min(math.exp(log_ratio), self.cfg.tis_cap))
                else:
                    weights.append(1.0)
            row["tis"] = weights

    # -- step 6, one minibatch
    def aggregate(self, per_row: list[torch.Tensor]) -> torch.Tensor:
        """The minibatch's loss from each response's token losses (``ppo.loss_aggregation``)."""
        if self.aggregation == "token_mean":
            return torch.cat(per_row).sum() / sum(len(x) for x in per_row)
        if self.aggregation == "seq_mean_token_mean":
            return sum(x.mean() for x in per_row) / len(per_row)
        constant = self.cfg.loss_norm_constant or self.case.max_new_tokens
        return torch.cat(per_row).sum() / (len(per_row) * constant)

    def lr_factor(self, k: int) -> float:
        """The schedule's multiplier at minibatch k (0-based; a minibatch without update tokens makes no
        optimizer step but counts: the schedule spans ``ppo_epochs`` x minibatches, as the planner counts):
        ``k / w`` over the ``w`` warm-up steps, then linear decay to 0 at the run's end, a half cosine over the
        same span, or constant."""
        warmup = self.case.optimizer.get("warmup_steps", 0)
        if k < warmup:
            return k / warmup
        progress = (k - warmup) / (self.total_steps - warmup)
        scheduler = self.case.optimizer["scheduler"]
        if scheduler == "linear":
            return 1.0 - progress
        if scheduler == "constant_with_warmup":
            return 1.0
        assert scheduler == "cosine"
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def step(self, mb_rows: list[int]) -> dict:
        cfg, eps = self.cfg, self.cfg.clip_range
        actor_w = self.merged("actor")
        critic_w = self.merged("critic") if self.has_critic else None
        pg, vf, ent, kl, stats = [], [], [], [], {k: [] for k in ("clip", "dual", "vclip", "approx", "ratio")}
        for i in mb_rows:
            row = self.rows[i]
            logp, entropy, values = self.token_terms(row, actor_w, critic_w)
            adv = torch.tensor(row["adv"])
            ratio = torch.exp(logp - row["old"])
            surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
            if cfg.dual_clip is not None:  # Ye et al. 2020: for A < 0 the loss is at most -c * A
                capped = torch.minimum(surrogate, -cfg.dual_clip * adv)
                stats["dual"].append((adv < 0) & (capped < surrogate))
                surrogate = torch.where(adv < 0, capped, surrogate)
            if "tis" in row:  # the importance weight multiplies the token's (dual-)clipped term
                surrogate = surrogate * torch.tensor(row["tis"])
            pg.append(surrogate)
            ent.append(entropy)
            kl.append(_kl(self.kl_estimator, logp, row["ref"]))
            r = ratio.detach()
            # the clipped term binds: A > 0 above 1 + eps, A < 0 below 1 - eps (its gradient is then 0)
            stats["clip"].append(((adv > 0) & (r > 1 + eps)) | ((adv < 0) & (r < 1 - eps)))
            stats["approx"].append(r - 1 - torch.log(r))
            stats["ratio"].append(r)
            if self.has_critic:
                old_v, ret = torch.tensor(row["values"]), torch.tensor(row["returns"])
                c = cfg.value_clip_range
                clipped_v = old_v + (values - old_v).clamp(-c, c)
                vf.append(0.5 * torch.maximum((values - ret) ** 2, (clipped_v - ret) ** 2))
                stats["vclip"].append((values.detach() - old_v).abs() > c)
        loss = self.aggregate(pg) - self.case.ppo["entropy_coef"] * self.aggregate(ent)
        if self.kl_in_loss:
            loss = loss + self.kl_coef * self.aggregate(kl)
        if self.has_critic:
            loss = loss + cfg.vf_coef * self.aggregate(vf)
        if self.case.ptx is not None:  # Ouyang et al. 2022, eq. 2: this step's PTX batch through the actor
            nll = self.ptx_nll(self.rec["ptx"][self.steps_done], actor_w)
            loss = loss + self.case.ptx["coef"] * nll

        def token_mean(parts):
            return float(torch.cat([p.float() for p in parts]).mean())

        out = {
            "loss": float(loss.detach()),
            M.PPO_POLICY_LOSS: float(self.aggregate(pg).detach()),
            M.PPO_CLIPFRAC: token_mean(stats["clip"]),
            M.PPO_APPROX_KL: token_mean(stats["approx"]),
            M.PPO_RATIO_MEAN: token_mean(stats["ratio"]),
            M.PPO_ENTROPY: token_mean([e.detach() for e in ent]),
            M.PPO_DUAL_CLIPFRAC: token_mean(stats["dual"]),
        }
        if self.kl_in_loss:
            out[M.PPO_KL_LOSS] = token_mean([k.detach() for k in kl])
        if self.case.ptx is not None:
            out[M.PPO_PTX_LOSS] = float(nll.detach())
        if self.has_critic:
            out[M.PPO_VALUE_LOSS] = float(self.aggregate(vf).detach())
            out[M.PPO_VALUE_CLIPFRAC] = token_mean(stats["vclip"])
        names = [n for n, p in self.params.items()]
        grads = dict(zip(names, torch.autograd.grad(loss, [self.params[n] for n in names])))
        out["grads"] = grads
        out["norm"] = self.apply(grads)
        out["next"] = {n: p.detach().clone() for n, p in self.params.items()}
        return out

    def ptx_nll(self, batch: dict, actor_w) -> torch.Tensor:
        """The SFT loss of a PTX batch: ``-log p(token)`` at temperature 1, summed over every label token
        (labels != -100; the logits at position t predict token t + 1) of every row, over their number.
        Rows are right padded: each is run unpadded."""
        total, count = 0.0, 0
        for ids, mask, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
            keep = mask.bool()
            ids, labels = ids[keep], labels[keep]
            logits, _ = _forward(self.plain, actor_w, ids)
            logp = torch.log_softmax(logits, dim=-1)
            for t in range(1, len(ids)):
                if int(labels[t]) != -100:
                    total = total - logp[t - 1, int(labels[t])]
                    count += 1
        assert count > 0
        return total / count

    @torch.no_grad()
    def apply(self, grads: dict[str, torch.Tensor]) -> float:
        """Global-norm clipping (scale by max_norm / (norm + 1e-6) when that is < 1), then AdamW; returns
        the norm before clipping."""
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
        max_norm = self.cfg.max_grad_norm
        scale = min(1.0, max_norm / (norm + 1e-6)) if max_norm is not None else 1.0
        opt = self.case.optimizer
        beta1, beta2 = opt["betas"]
        t = self.steps_done + 1
        factor = self.lr_factor(self.minibatches_done)
        for name, p in self.params.items():
            g = grads[name] * scale
            m, v = self.state[name]
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            self.state[name] = (m, v)
            group = "actor" if ".actor." in name else "critic"
            lr = self.lr[group] * factor
            new = p * (1 - lr * opt["weight_decay"])
            new = new - (lr / (1 - beta1**t)) * m / ((v / (1 - beta2**t)).sqrt() + opt["eps"])
            self.params[name] = new.requires_grad_()
        self.steps_done += 1
        self.minibatches_done += 1
        return norm

    def skip(self) -> None:
        """A minibatch without update tokens: no AdamW step (weights, moments and t unchanged); the
        learning-rate schedule moves on by one."""
        self.minibatches_done += 1


# ---------------------------------------------------------------------------------------- the tests
def _replay(case: Case, tmp_path):
    module, rec = _record(case, tmp_path)
    oracle = Oracle(case, module, rec)
    oracle.experience()
    schedule = [(rows.tolist(), n_micro) for epoch in rec["epochs"] for rows, n_micro in epoch]
    steps = []
    for (rows, _), recorded in zip(schedule, rec["steps"]):
        # each minibatch from the parameters the module's step started from: float rounding, which the
        # steps would amplify, does not compound; the oracle's own step must land on the next ones
        oracle.params = {n: t.clone().requires_grad_() for n, t in recorded["params"].items()}
        steps.append(oracle.step(rows))
    return module, rec, oracle, schedule, steps


@pytest.fixture(scope="module", params=sorted(CASES))
def replayed(request, tmp_path_factory):
    case = CASES[request.param]
    return (case, *_replay(case, tmp_path_factory.mktemp(request.param)))


def _combined(micro: list[dict], key: str, weights: str = "tokens") -> float:
    """One minibatch's statistic from its micro-batches' (each a token mean over its update tokens): their
    token-weighted mean, the minibatch's token mean."""
    parts = [(c["tokens"], float(c["stats"][key])) for c in micro if key in c["stats"]]
    return sum(n * x for n, x in parts) / sum(n for n, _ in parts)


def test_the_schedule_covers_every_row_in_every_epoch(replayed):
    case, module, rec, oracle, schedule, steps = replayed
    n_rows = case.prompts * case.n
    assert case.prompts > case.n  # a group-layout error cannot hide behind a single group
    assert len(rec["epochs"]) == case.ppo["ppo_epochs"] >= 2
    for epoch in rec["epochs"]:
        assert len(epoch) == n_rows // case.ppo["ppo_minibatch_size"] >= 2
        assert sorted(torch.cat([rows for rows, _ in epoch]).tolist()) == list(range(n_rows))
    assert len(rec["steps"]) == len(schedule)  # one optimizer step per minibatch, in that order
    micro = case.ppo["micro_batch_size"] or case.ppo["ppo_minibatch_size"]
    terms = 2 if case.estimator == "gae" and not case.shared_trunk else 1  # the two-pass option
    for step, (rows, n_micro) in zip(rec["steps"], schedule):
        assert n_micro == len(rows) // micro and len(step["micro"]) == n_micro * terms


def test_the_case_is_not_degenerate(replayed):
    """Scores and lengths differ, the actor is not the reference, and after the first update the clip, the
    dual clip and the value clip each bind on some tokens but not on all."""
    case, module, rec, oracle, schedule, steps = replayed
    rows = oracle.rows
    assert len(set(rec["scores"].tolist())) == len(rows)
    assert len({len(row["response"]) for row in rows}) > 1
    assert sum(abs(k) for row in rows for k in row["kl"]) / sum(len(row["kl"]) for row in rows) > 0.01
    assert steps[0][M.PPO_CLIPFRAC] == 0.0 and steps[0][M.PPO_DUAL_CLIPFRAC] == 0.0  # ratio 1 at the start
    assert any(0 < s[M.PPO_CLIPFRAC] < 1 for s in steps[1:])
    assert any(s[M.PPO_DUAL_CLIPFRAC] > 0 for s in steps[1:])
    if case.estimator == "gae":
        assert steps[0][M.PPO_VALUE_CLIPFRAC] == 0.0
        assert any(0 < s[M.PPO_VALUE_CLIPFRAC] < 1 for s in steps[1:])
    if case.ppo["max_grad_norm"] is not None:
        assert any(s["norm"] > case.ppo["max_grad_norm"] for s in steps)  # the clipping binds
    if case.ppo.get("tis_cap") is not None:  # the weights bind: some capped, some well below 1
        weights = [w for row in rows for w in row["tis"]]
        assert 0 < sum(w == case.ppo["tis_cap"] for w in weights) < len(weights) / 2
        assert min(weights) < 0.97


def test_the_experience_equals_the_oracle(replayed):
    """Old log-probs, values, returns and advantages that reach the update, and the KL term's inputs."""
    case, module, rec, oracle, schedule, steps = replayed
    batch = rec["batch"]
    mask = batch.mask.bool()
    assert torch.equal(mask, rec["sample"][3].bool())
    width = mask.shape[1]

    def padded(key):
        out = torch.zeros(len(oracle.rows), width)
        for i, row in enumerate(oracle.rows):
            out[i, : len(row[key])] = torch.as_tensor([float(x) for x in row[key]])
        return out[mask]

    checks = [("old", batch.old_logprobs, 2e-5), ("adv", batch.advantages, 1e-4)]
    if case.estimator == "gae":
        checks += [("values", batch.old_values, 2e-5), ("returns", batch.returns, 1e-4)]
    else:
        assert batch.old_values is None and batch.returns is None
    if oracle.kl_in_loss:
        checks.append(("ref", batch.ref_logprobs, 2e-5))
        assert batch.kl_coef == case.kl["kl_coef"]
    else:
        assert batch.ref_logprobs is None
    if case.ppo.get("tis_cap") is not None:
        checks.append(("tis", batch.is_weights, 2e-5))
    else:
        assert batch.is_weights is None
    for key, ours, atol in checks:
        assert_close(ours[mask], padded(key), atol=atol, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    assert (batch.advantages[~mask] == 0).all()


def test_every_minibatch_equals_the_oracle(replayed):
    """For every minibatch of every epoch, in the schedule's order: the parameters the step starts from, the
    loss back-propagated, its statistics and the gradients before clipping; then the final parameters."""
    case, module, rec, oracle, schedule, steps = replayed
    assert set(rec["steps"][0]["params"]) == set(rec["initial"])
    for name, p in rec["initial"].items():
        assert torch.equal(rec["steps"][0]["params"][name], p), name  # the first step starts where fit did
    after = [s["params"] for s in rec["steps"][1:]] + [rec["final"]]
    for k, (ours, theirs, next_params) in enumerate(zip(rec["steps"], steps, after)):
        where = f"minibatch {k} (epoch {k // len(rec['epochs'][0])})"
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-6), where
        for key in (
            M.PPO_CLIPFRAC,
            M.PPO_APPROX_KL,
            M.PPO_RATIO_MEAN,
            M.PPO_ENTROPY,
            M.PPO_DUAL_CLIPFRAC,
            M.PPO_KL_LOSS,
            M.PPO_VALUE_CLIPFRAC,
        ):
            if key in theirs:
                assert _combined(ours["micro"], key) == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (
                    f"{where} {key}"
                )
            else:
                assert not any(key in c["stats"] for c in ours["micro"]), f"{where} {key}"
        assert set(ours["grads"]) == set(theirs["grads"])
        for name, grad in theirs["grads"].items():
            scale = float(grad.abs().max())
            assert scale > 1e-7, f"{where} {name}"  # every trainable parameter gets a gradient
            # float32 rounding, relative to the tensor's largest entry: up to 2.1e-5 measured on an AMD EPYC
            # with AVX-512 (Zen 4) in an entry that cancels to 1% of the largest; a wiring mistake moves a
            # gradient by far more (and the loss, checked above to 1e-5, with it)
            assert_close(
                ours["grads"][name],
                grad,
                atol=1e-4 * scale,
                rtol=1e-4,
                msg=lambda m, n=name, w=where: f"{w} {n}: {m}",
            )
        assert ours["norm"] == pytest.approx(theirs["norm"], rel=1e-4), where
        assert set(next_params) == set(theirs["next"])
        for name, p in theirs["next"].items():  # the step: clipping, AdamW, the schedule's learning rate
            assert_close(
                next_params[name], p, atol=1e-5, rtol=0, msg=lambda m, n=name, w=where: f"{w} step {n}: {m}"
            )


def test_the_logged_update_figures_equal_the_oracle(replayed):
    """What the module logged for the iteration: each figure's mean over the minibatches (the losses as
    aggregated, the rest as token means), the mean gradient norm, no skipped step."""
    case, module, rec, oracle, schedule, steps = replayed
    logged = rec["logged"]
    keys = [M.PPO_POLICY_LOSS, M.PPO_CLIPFRAC, M.PPO_DUAL_CLIPFRAC, M.PPO_APPROX_KL, M.PPO_RATIO_MEAN]
    keys += [M.PPO_ENTROPY]
    keys += [M.PPO_KL_LOSS] if oracle.kl_in_loss else []
    keys += [M.PPO_PTX_LOSS] if case.ptx is not None else []
    keys += [M.PPO_VALUE_LOSS, M.PPO_VALUE_CLIPFRAC] if case.estimator == "gae" else []
    for key in keys:
        expected = sum(s[key] for s in steps) / len(steps)
        assert logged[key] == pytest.approx(expected, rel=1e-5, abs=1e-6), key
    for key in (M.PPO_KL_LOSS, M.PPO_VALUE_LOSS, M.PPO_VALUE_CLIPFRAC, M.PPO_PTX_LOSS):
        if key not in keys:
            assert key not in logged, key
    assert logged[M.PPO_GRAD_NORM] == pytest.approx(sum(s["norm"] for s in steps) / len(steps), rel=1e-4)
    assert logged[M.PPO_SKIPPED_STEPS] == 0.0
    cap = case.ppo.get("tis_cap")
    if cap is not None:  # every response token is an update token (test_the_experience_equals_the_oracle)
        weights = [w for row in oracle.rows for w in row["tis"]]
        assert logged[M.ROLLOUT_TIS_WEIGHT] == pytest.approx(sum(weights) / len(weights), rel=1e-5)
        capped = sum(w == cap for w in weights) / len(weights)
        assert logged[M.ROLLOUT_TIS_CAPPED_FRAC] == pytest.approx(capped, rel=1e-5)
    else:
        assert M.ROLLOUT_TIS_WEIGHT not in logged and M.ROLLOUT_TIS_CAPPED_FRAC not in logged


# Every option the update reads: walk ``rlhf_lit/rl/update.py`` (``UpdateSettings``, built by ``rl.assembly.update_settings``; the
# optimizer and schedule it steps, the clipping it calls, ``UpdateBatch``'s fields),
# ``rlhf_lit/rl/objectives.py`` (``PPOObjective.from_settings``) and the options of
# ``rlhf_lit/rl/settings.py`` that make the update's input (advantages, KL placement and estimator,
# importance weights). Each must be set away from its default by some case (``_case_value``);
# ``test_every_option_the_update_reads_is_set_off_its_default`` checks it.
READ = {
    "ppo": {
        *("ppo_epochs", "ppo_minibatch_size", "micro_batch_size", "gamma", "gae_lambda", "clip_range"),
        *("dual_clip", "value_clip_range", "vf_coef", "entropy_coef", "whiten_advantages", "max_grad_norm"),
        *("max_consecutive_skips", "total_iterations", "rollout_forward_batch_size", "logprob_chunk_size"),
        *("seed", "advantage_estimator", "scale_by_std", "loss_aggregation", "loss_norm_constant"),
        *("kl_placement", "tis_cap"),
    },
    "kl": {"kl_coef", "estimator"},
    "critic": {"lora", "shared_trunk", "lr"},
    "optimizer": {"lr", "weight_decay", "betas", "eps", "scheduler", "warmup_steps"},
    "sampling": {"max_new_tokens", "temperature", "num_samples_per_prompt"},
    "ptx": {"coef", "train_files", "format", "batch_size", "max_length"},
}
# The policy-gradient family's options: read by the update, each with its own whole-schedule case (and a case
# combining them) in tests/ppo/test_oracle_pg_family.py, whose oracle extends this one.
FAMILY = "the policy-gradient family's whole-schedule cases: tests/ppo/test_oracle_pg_family.py"
FAMILY_PPO = (
    *("clip_range_low", "clip_range_high", "importance_sampling_level", "policy_loss", "top_entropy_quantile"),
    *("mask_truncated_completions", "dynamic_sampling", "tis_level", "tis_mode"),
)
# The other fields of the same settings: what they do is not the update's, or no case here can exercise it.
NOT_READ = {
    "ppo": {"checkpoint_every": "a callback writes checkpoints (test_checkpoint_every.py)"}
    | {name: FAMILY for name in FAMILY_PPO}
    | {
        "dynamic_sampling_max_rounds": "more rollouts before the update; the update gets the configured batch "
        "(tests/ppo/test_dynamic_sampling.py checks the rows it keeps)"
    },
    "kl": {
        "adaptive": "the KL controller moves beta after the update (tests/unit/test_kl_control.py)",
        "target_kl": "the adaptive controller's (tests/unit/test_kl_control.py)",
        "horizon": "the adaptive controller's (tests/unit/test_kl_control.py)",
    },
    "critic": {"init_from_reward": "the value head's initial weights, which every case sets itself"},
    "optimizer": {"name": "the 8-bit AdamWs are bitsandbytes', CUDA only"},
    "sampling": {
        name: "how responses are drawn; the oracle reads what was drawn"
        for name in (
            "min_new_tokens", "top_k", "top_p", "stop_at_eos", "stop_token_ids", "stop_strings", "do_sample",
            "merge_adapter", "backend", "copy_dtype", "strict_sync", "vllm",
        )
    }
    | {"logprob_gap_tolerance": "the rollout guard's (the sampler_offset cases raise it to keep it quiet)"},
    "reward": {
        name: "shapes the score before the advantages (test_ppo_module.py); these cases keep the raw score"
        for name in ("normalize", "clip", "missing_eos_penalty", "skip_non_finite")
    }
    | {name: FAMILY for name in ("overlong_buffer", "overlong_penalty")},
    "monitor": {
        name: "the reward-hacking monitor reads the logged figures"
        for name in ("enabled", "heldout", "window", "num_se", "max_perplexity_ratio")
    },
}


def _settings() -> dict:
    from rlhf_lit.rl.settings import MonitorConfig, RewardShapingConfig

    return {
        "ppo": PPOConfig,
        "kl": KLConfig,
        "critic": CriticConfig,
        "optimizer": OptimizerConfig,
        "sampling": SamplingConfig,
        "reward": RewardShapingConfig,
        "monitor": MonitorConfig,
        "ptx": PTXConfig,
    }


def _case_value(case: Case, group: str, name: str):
    """The value ``case`` gives option ``group.name`` (as ``_record`` builds the module), or its default."""
    default = getattr(_settings()[group](), name)
    if group == "ppo":
        fixed = {"advantage_estimator": case.estimator, "total_iterations": 1}
        return fixed[name] if name in fixed else case.ppo.get(name, default)
    if group == "kl":
        return case.kl.get(name, default)
    if group == "optimizer":
        return case.optimizer.get(name, default)
    if group == "ptx":
        return (case.ptx or {}).get(name, default)
    if group == "critic":
        return {"lora": LORA, "shared_trunk": case.shared_trunk, "lr": case.critic_lr}[name]
    if group == "sampling":
        return {
            "max_new_tokens": case.max_new_tokens,
            "temperature": TEMPERATURE,
            "num_samples_per_prompt": case.n,
        }[name]
    raise KeyError(f"{group}.{name}")


def test_every_option_the_update_reads_is_set_off_its_default():
    """Each field of the settings is either read by the update (then some case sets it away from its default)
    or listed with the reason no case needs it, so a new option cannot slip past the oracle unnoticed."""
    import dataclasses

    for group, settings in _settings().items():
        fields = {f.name for f in dataclasses.fields(settings)}
        read, other = READ.get(group, set()), set(NOT_READ.get(group, {}))
        assert read | other == fields and not read & other, (group, fields ^ (read | other), read & other)
        for name in read:
            default = getattr(settings(), name)
            assert any(_case_value(c, group, name) != default for c in CASES.values()), f"{group}.{name}"


def test_every_option_is_away_from_its_default_and_every_combination_is_covered():
    """What the acceptance asks of the configs: two or more per estimator with both KL placements; every
    option the update reads away from its default (the estimator's default aggregation and the placement's
    default KL estimator included); each loss aggregation with each KL placement; every KL estimator."""
    # switches whose two values both appear (one is then the default): placement, whitening, std scaling;
    # sizes: the rollout's shape, not a setting of the arithmetic
    variants = {"kl_placement", "whiten_advantages", "scale_by_std", "ppo_minibatch_size", "micro_batch_size"}
    defaults, kl_default, opt_default = PPOConfig(), KLConfig(), OptimizerConfig()
    by_estimator: dict[str, list[Case]] = {}
    for name, case in CASES.items():
        by_estimator.setdefault(case.estimator, []).append(case)
        ppo = PPOConfig(advantage_estimator=case.estimator, **case.ppo)
        for key, value in case.ppo.items():
            if key not in variants:
                assert value != getattr(defaults, key), f"{name}: ppo.{key}"
        assert ppo.dual_clip is not None and ppo.entropy_coef != 0, name
        assert case.ppo["loss_aggregation"] != ppo.algorithm.default_aggregation(ppo), name
        assert case.kl["estimator"] != KLConfig().resolved_estimator(ppo.kl_in_loss()), name
        assert case.kl["kl_coef"] not in (0, kl_default.kl_coef), name
        for key, value in case.optimizer.items():
            assert value != getattr(opt_default, key) or key == "scheduler", f"{name}: optimizer.{key}"
        assert ppo.ppo_epochs >= 2 and case.prompts > case.n, name
        if case.estimator == "gae":
            assert ppo.clip_range != ppo.value_clip_range and {"gamma", "gae_lambda", "vf_coef"} <= set(
                case.ppo
            )
    assert {"gae", "grpo", "rloo", "reinforce_pp"} <= set(by_estimator)
    for cases in by_estimator.values():
        assert len(cases) >= 2
        assert {c.ppo["kl_placement"] for c in cases} == {"reward", "loss"}
    combinations = {(c.ppo["loss_aggregation"], c.ppo["kl_placement"]) for c in CASES.values()}
    for c in CASES.values():  # a response's weight 1 / its length differs from its neighbour's only in a
        if c.ppo["loss_aggregation"] == "seq_mean_token_mean":  # micro-batch of two or more responses
            assert (c.ppo["micro_batch_size"] or c.ppo["ppo_minibatch_size"]) >= 2
    assert combinations == {(a, p) for a in AGGREGATIONS for p in ("reward", "loss")}
    assert {c.kl["estimator"] for c in CASES.values()} == {"k1", "k2", "k3", "abs"}
