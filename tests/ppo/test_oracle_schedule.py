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
* for each minibatch, in the order the module's schedule drew them: the clipped surrogate with the dual clip
  (Schulman et al. 2017, eq. 7; Ye et al. 2020), the clipped value loss (``0.5 * max((V - R)^2, (V_clip -
  R)^2)``), the KL term in the loss where configured, the entropy bonus, aggregated as configured (token
  mean; mean over responses of token means, Shao et al. 2024 eq. 3; token sum / (responses x constant), Liu
  et al. 2025 eq. 3); its statistics (clip fraction, value clip fraction, approximate KL, mean ratio,
  entropy, KL term); its gradients by autograd; the global-norm clipping; and an AdamW step
  (Loshchilov & Hutter 2019, Alg. 2) at the learning rate the schedule gives that step, per parameter group.

Checked per minibatch: the loss the module back-propagated, its statistics, the gradients before clipping
and the parameters the step started from (so after the first update the ratios, clip fractions and value
clips are those of a policy that has moved), then the final parameters and the figures the module logged
(the means over the minibatches). Every config has more prompts than samples per prompt, uneven response
lengths, several minibatches per epoch and at least two epochs; each aggregation, both KL placements and
every KL estimator appear; the non-degeneracy test asserts that the clip, the dual clip and the value clip
all bind somewhere after the first update.
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
from rlhf_lit.generation import SamplingConfig
from rlhf_lit.modules.common import OptimizerConfig
from rlhf_lit.modules.ppo_config import CriticConfig, KLConfig, PPOConfig
from rlhf_lit.rl.schedule import epoch_schedule
from tests.ppo.helpers import (
    LORA,
    RecordingReward,
    RecordingUpdater,
    make_data,
    make_module,
    make_trainer,
    uneven_sampler,
)
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
        ),
        kl=dict(kl_coef=0.15, estimator="k2"),
        optimizer=dict(lr=0.15, weight_decay=0.01, betas=(0.8, 0.95), eps=1e-2, scheduler="linear"),
        critic_lr=0.03,
        short_rows=((1, 1), (2, 3), (4, 0)),
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
            dual_clip=1.5,
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
        optimizer=dict(lr=0.03, weight_decay=0.02, betas=(0.85, 0.9), eps=1e-2, scheduler="cosine"),
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
        ),
        kl=dict(kl_coef=0.1, estimator="k2"),
        optimizer=dict(lr=0.06, weight_decay=0.03, betas=(0.7, 0.9), eps=1e-2, scheduler="linear"),
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
            dual_clip=1.3,
            entropy_coef=0.06,
            max_grad_norm=None,
            loss_aggregation="token_mean",
            kl_placement="loss",
            seed=17,
        ),
        kl=dict(kl_coef=0.12, estimator="k2"),
        optimizer=dict(lr=0.04, weight_decay=0.01, betas=(0.85, 0.95), eps=1e-2, scheduler="cosine"),
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
    ),
}


# ---------------------------------------------------------------------------------------- the recording
class RecordingObjective:
    """Stands in for the updater's objective: delegates, and keeps each micro-batch's terms, update-token
    count and detached statistics in ``calls``."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def loss(self, out, mb, terms):
        loss, stats = self.inner.loss(out, mb, terms)
        self.calls.append({"terms": terms, "tokens": int(mb.mask.sum()), "stats": dict(stats)})
        return loss, stats

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _snapshot(batch):
    """A copy of an ``UpdateBatch`` whose tensors are clones."""
    return type(batch)(**{k: v.clone() if torch.is_tensor(v) else v for k, v in vars(batch).items()})


def _record(case: Case, tmp_path):
    rec: dict = {"epochs": [], "steps": []}

    def schedule(*args):
        out = epoch_schedule(*args)
        rec["epochs"].append([(rows.clone(), n_micro) for rows, n_micro in out])
        return out

    torch.manual_seed(0)
    module = make_module(
        sampling=SamplingConfig(
            max_new_tokens=case.max_new_tokens, temperature=TEMPERATURE, num_samples_per_prompt=case.n
        ),
        ppo=PPOConfig(advantage_estimator=case.estimator, total_iterations=1, **case.ppo),
        kl=KLConfig(**case.kl),
        critic=CriticConfig(lora=copy.deepcopy(LORA), shared_trunk=case.shared_trunk, lr=case.critic_lr),
        optimizer=OptimizerConfig(**case.optimizer),
        sampler=uneven_sampler(rec, rows=case.short_rows),
        schedule=schedule,
    )
    lm = module.policy.lm
    with torch.no_grad():  # LoRA B and the value head start at 0: move them, so KL != 0 and values vary
        gen = torch.Generator().manual_seed(1)
        for p in lm.adapter_parameters("actor") + lm.adapter_parameters("critic"):
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
        if module.policy.value_head is not None:
            module.policy.value_head.linear.weight.normal_(0.0, 0.5, generator=gen)
            module.policy.value_head.linear.bias.fill_(0.3)
    rec["initial"] = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}

    reward = RecordingReward(module.collector.reward_fn)
    module.collector.reward_fn = reward
    # the update's input as it arrives (a copy: the update sets the batch's token weights)
    module.updater = RecordingUpdater(
        module.updater, on_update=lambda b: rec.setdefault("batch", _snapshot(b))
    )
    updater = module.updater.inner
    objective = RecordingObjective(updater.objective)
    updater.objective = objective
    real_backward, real_clip = updater.backward, updater.clip
    losses: list[float] = []

    def backward(loss, *args, **kwargs):
        losses.append(float(loss.detach()))
        return real_backward(loss, *args, **kwargs)

    def clip(opt):  # the end of a minibatch: its gradients (before clipping) and the step's start
        params = dict(module.named_parameters())
        rec["steps"].append(
            {
                "loss": sum(losses),
                "grads": {n: p.grad.clone() for n, p in params.items() if p.grad is not None},
                "params": {n: p.detach().clone() for n, p in params.items() if p.requires_grad},
                "micro": list(objective.calls),
            }
        )
        losses.clear()
        objective.calls.clear()
        norm = real_clip(opt)
        rec["steps"][-1]["norm"] = norm
        return norm

    updater.backward, updater.clip = backward, clip
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
        self.steps_done = 0
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
        """The schedule's multiplier at optimizer step k (0-based, no warm-up): linear decay to 0 over the
        run, or a half cosine."""
        progress = k / self.total_steps
        if self.case.optimizer["scheduler"] == "linear":
            return 1.0 - progress
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
        if self.has_critic:
            out[M.PPO_VALUE_LOSS] = float(self.aggregate(vf).detach())
            out[M.PPO_VALUE_CLIPFRAC] = token_mean(stats["vclip"])
        names = [n for n, p in self.params.items()]
        grads = dict(zip(names, torch.autograd.grad(loss, [self.params[n] for n in names])))
        out["grads"] = grads
        out["norm"] = self.apply(grads)
        out["next"] = {n: p.detach().clone() for n, p in self.params.items()}
        return out

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
        factor = self.lr_factor(self.steps_done)
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
        return norm


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
            assert_close(
                ours["grads"][name],
                grad,
                atol=2e-5 * scale,
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
    keys += [M.PPO_VALUE_LOSS, M.PPO_VALUE_CLIPFRAC] if case.estimator == "gae" else []
    for key in keys:
        expected = sum(s[key] for s in steps) / len(steps)
        assert logged[key] == pytest.approx(expected, rel=1e-5, abs=1e-6), key
    for key in (M.PPO_KL_LOSS, M.PPO_VALUE_LOSS, M.PPO_VALUE_CLIPFRAC):
        if key not in keys:
            assert key not in logged, key
    assert logged[M.PPO_GRAD_NORM] == pytest.approx(sum(s["norm"] for s in steps) / len(steps), rel=1e-4)
    assert logged[M.PPO_SKIPPED_STEPS] == 0.0


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
