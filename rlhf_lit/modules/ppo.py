"""Stage 3: PPO against a frozen reward model, with a per-token KL penalty to a frozen reference.

One ``training_step`` is one PPO iteration on one batch of prompts (Ouyang et al. 2022; Stiennon et al.
2020; Schulman et al. 2017):

1. rollout: the actor adapter samples responses;
2. reference log-probs with every adapter switched off;
3. old log-probs (actor) and values (critic), at the sampling temperature with dropout off;
4. reward-model scores (calibrated; an inf / nan one raises ``NonFiniteError``, or with
   ``reward.skip_non_finite`` leaves the update), missing-EOS penalty, normalisation and clipping;
5. shaped token rewards, GAE, advantage whitening;
6. ``ppo_epochs`` x shuffled minibatches x micro-batches: clipped policy loss + value loss - entropy bonus
   (+ PTX), one optimizer step per minibatch with global-norm gradient clipping (a step whose norm is inf or
   nan is skipped and counted; ``ppo.max_consecutive_skips`` in a row raise ``NonFiniteError``);
7. the KL controller update and the iteration's metrics.

Refused before any model loads: dropout left on, ``top_k`` / ``top_p`` sampling, a missing-EOS penalty
without a stop token (each would make the ratio, the KL or the reward wrong without an error).

Manual optimization: Lightning never calls ``optimizer_step`` here; ``trainer.global_step`` counts
optimizer steps, so ``ppo/iteration`` is our own counter.

Several processes (``ddp``, or FSDP2 via ``ModelParallelStrategy`` / ``FSDP2Strategy``; each rank holds
its own slice of the rollout): advantage whitening, reward normalisation and the KL controller's input
use statistics of all ranks; every rank draws the same permutation of the GLOBAL batch per epoch and takes its
own rows of each global minibatch (``epoch_schedule``); the loss of a minibatch is the token mean over the
global minibatch (see ``_update``); generation keeps every rank stepping until all have finished
(``synced_gpus``); gradient clipping takes the global norm over sharded gradients. So 2 ranks x 4 sequences
make the same update as 1 rank x 8, with any number of minibatches and epochs. State that a resumed run
needs (iteration, KL controller, reward statistics, RNG, PTX position, skipped-step count) is saved in the
checkpoint, so a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from dataclasses import asdict
from typing import Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn

from rlhf_lit import metrics as M
from rlhf_lit.callbacks import RewardHackingMonitor
from rlhf_lit.functional.advantages import explained_variance, gae
from rlhf_lit.functional.kl import kl_per_token, shaped_rewards
from rlhf_lit.functional.losses import ppo_policy_loss, ppo_value_loss, sft_nll
from rlhf_lit.functional.masked import masked_mean, masked_whiten
from rlhf_lit.functional.sequence import trim_left_padding
from rlhf_lit.generation import SamplingConfig, resolve_stop_ids, sample_responses
from rlhf_lit.kl_control import build_kl_controller
from rlhf_lit.models.backbone import BackboneConfig, load_backbone, load_backbone_tokenizer
from rlhf_lit.models.export import save_causal_lm
from rlhf_lit.models.policy import ActorCritic
from rlhf_lit.models.reward_source import RewardModelConfig, RewardSource
from rlhf_lit.modules.common import (
    OptimizerConfig,
    as_config,
    build_optimizer,
    build_scheduler,
    log_data_report,
    peak_memory_mb,
    plain_hparams,
)
from rlhf_lit.modules.ppo_config import (
    CriticConfig,
    KLConfig,
    MonitorConfig,
    PPOConfig,
    PTXConfig,
    RewardShapingConfig,
)
from rlhf_lit.parallel import (
    data_parallel_mesh,
    gathered_parameters,
    grad_norm_value,
    shard_head,
    shard_lm,
)
from rlhf_lit.plots import curves_figure, save_figure
from rlhf_lit.reward_norm import RunningMeanStd, normalize_scores

log = logging.getLogger("rlhf_lit")


def _chunks(n: int, size: int | None):
    size = size or n
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class NonFiniteError(FloatingPointError):
    """A PPO run met an inf or nan where it must not go on: a reward-model score, or a gradient norm that
    stayed non-finite for ``ppo.max_consecutive_skips`` optimizer steps in a row."""


def epoch_schedule(
    order: torch.Tensor, world_size: int, rank: int, minibatch_size: int, micro_batch_size: int
) -> list[tuple[torch.Tensor, int]]:
    """This rank's rows of each global minibatch of one PPO epoch, and the micro-batches every rank runs.

    The global rollout batch has ``W * B`` rows; global row ``g`` is row ``g // W`` of rank ``g % W`` (the
    prompt sampler deals each global batch out round-robin: ``ResumableSampler``, like PyTorch's
    ``DistributedSampler``). ``order`` is one permutation of the global rows, drawn identically on every
    rank; global minibatch ``k`` is ``order[k * W * minibatch_size : (k + 1) * W * minibatch_size]``, exactly
    the minibatch one rank holding all ``W * B`` rows draws with ``ppo_minibatch_size = W * minibatch_size``.
    Each rank takes its own rows of it, in that order; their number varies between ranks and minibatches.
    DDP and FSDP need the same number of forwards and backwards on every rank, so the micro-batch count of a
    minibatch is the largest over the ranks (a rank with fewer runs empty, zero-weight micro-batches).

    Args:
        order: ``(W * B,)`` a permutation of the global rows.
        world_size: W.
        rank: this rank.
        minibatch_size: ``ppo.ppo_minibatch_size``, rows per rank per minibatch on average.
        micro_batch_size: rows per forward / backward.

    Returns:
        One ``(local_rows, num_micro_batches)`` per global minibatch; ``local_rows`` is a long tensor of this
        rank's row indices (possibly empty). E.g. W = 2, order ``[3, 0, 2, 1, ...]``, minibatch 2: global
        minibatch ``[3, 0, 2, 1]`` -> rank 0 takes rows ``[0, 1]`` (global 0, 2), rank 1 rows ``[1, 0]``.
    """
    global_mb = minibatch_size * world_size
    out = []
    for start in range(0, order.numel(), global_mb):
        rows = order[start : start + global_mb]
        owners = rows % world_size
        counts = torch.bincount(owners, minlength=world_size)
        n_micro = int(-(-int(counts.max()) // micro_batch_size))
        out.append((rows[owners == rank] // world_size, n_micro))
    return out


def describe_reward_source(cfg: RewardModelConfig) -> str:
    """The reward model as the config names it, for error messages."""
    if cfg.path is not None:
        return f"reward_model.path={cfg.path!r} (mode {cfg.mode})"
    return "reward_model.backbone (an untrained reward model built from config)"


class PPOModule(L.LightningModule):
    """PPO with actor, critic and reference on one base (LoRA adapters), under manual optimization.

    Args:
        backbone: the policy's base (normally the SFT export) and how it is held; ``backbone.lora`` is the
            actor adapter's LoRA settings (required: the reference is the base with adapters off). An SFT
            export that holds only an adapter (a QLoRA SFT) is loaded as its base plus that adapter, frozen
            and kept on beneath actor and critic and in the reference, so the reference is the SFT policy.
        reward_model: the frozen reward model (a separate model or an adapter on this base).
        sampling: how responses are sampled.
        ppo: the PPO update and GAE settings.
        kl: the KL penalty and its controller.
        reward: score normalisation, clipping and the missing-EOS penalty.
        critic: the critic adapter and value head.
        optimizer: optimizer and schedule (``lr`` is the actor's; ``critic.lr`` the critic's).
        ptx: the optional pretraining-mix term.
        monitor: the reward-hacking monitors (on by default).
        log_samples_every: write a table of sampled prompts, responses and scores to TensorBoard text
            every this many iterations (0 disables).
        export_dir: where the final policy is written in Hugging Face format at the end of fit.
        export_mode: ``auto`` | ``merged`` | ``adapter``.
    """

    def __init__(
        self,
        backbone: BackboneConfig,
        reward_model: RewardModelConfig,
        sampling: SamplingConfig | None = None,
        ppo: PPOConfig | None = None,
        kl: KLConfig | None = None,
        reward: RewardShapingConfig | None = None,
        critic: CriticConfig | None = None,
        optimizer: OptimizerConfig | None = None,
        ptx: PTXConfig | None = None,
        monitor: MonitorConfig | None = None,
        log_samples_every: int = 10,
        export_dir: str | None = None,
        export_mode: Literal["auto", "merged", "adapter"] = "auto",
    ) -> None:
        super().__init__()
        backbone = as_config(BackboneConfig, backbone)
        if backbone.lora is None:
            raise ValueError(
                "PPO needs LoRA adapters (backbone.lora): the reference is the base with adapters off"
            )
        self.backbone_cfg = backbone
        self.reward_model_cfg = as_config(RewardModelConfig, reward_model)
        self.sampling = as_config(SamplingConfig, sampling) or SamplingConfig()
        self.ppo = as_config(PPOConfig, ppo) or PPOConfig()
        self.kl_cfg = as_config(KLConfig, kl) or KLConfig()
        self.shaping = as_config(RewardShapingConfig, reward) or RewardShapingConfig()
        self.critic_cfg = as_config(CriticConfig, critic) or CriticConfig()
        self.optim_cfg = as_config(OptimizerConfig, optimizer) or OptimizerConfig()
        self.ptx_cfg = as_config(PTXConfig, ptx) or PTXConfig()
        self.monitor_cfg = as_config(MonitorConfig, monitor) or MonitorConfig()
        # Every switch (PPO-Max tricks included) is recorded, as plain dicts so checkpoints load weights-only.
        self.save_hyperparameters(
            plain_hparams(
                type(self),
                backbone=backbone,
                reward_model=self.reward_model_cfg,
                sampling=self.sampling,
                ppo=self.ppo,
                kl=self.kl_cfg,
                reward=self.shaping,
                critic=self.critic_cfg,
                optimizer=self.optim_cfg,
                ptx=self.ptx_cfg,
                monitor=self.monitor_cfg,
                log_samples_every=log_samples_every,
                export_dir=export_dir,
                export_mode=export_mode,
            )
        )
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold adapters and heads only, not the frozen base
        self.export_dir = export_dir
        self.export_mode = export_mode

        self._refuse_impossible_settings()
        self.tokenizer = load_backbone_tokenizer(backbone)
        self.stop_ids = resolve_stop_ids(self.sampling, self.tokenizer)
        if self.shaping.missing_eos_penalty is not None and not self.stop_ids:
            raise ValueError(
                f"reward.missing_eos_penalty={self.shaping.missing_eos_penalty} needs a stop token, but none is "
                "set (sampling.stop_at_eos is off or the tokenizer has no EOS, and no stop_token_ids / "
                "stop_strings): every response would count as missing its EOS. Set a stop token or drop the penalty"
            )
        base = load_backbone(backbone, self.tokenizer)
        backbone.lora.dropout = 0.0  # log-probs must be exact (B12)
        critic_lora = None if self.critic_cfg.shared_trunk else self.critic_cfg.lora
        if critic_lora is not None:
            critic_lora.dropout = 0.0
        self.policy = ActorCritic(base, backbone.lora, critic_lora)
        self.reward_source = RewardSource(self.reward_model_cfg, self.tokenizer, self.policy.lm, backbone)
        if self.critic_cfg.init_from_reward:
            self._init_critic_from_reward()
        self.kl_ctl = build_kl_controller(
            self.kl_cfg.kl_coef, self.kl_cfg.adaptive, self.kl_cfg.target_kl, self.kl_cfg.horizon
        )
        self.score_stats = RunningMeanStd(distributed=True)
        self.iteration = 0
        self.history: list[dict[str, float]] = []
        self._two_pass = True  # sequential actor / critic backward on one process (_update); tests switch it
        self.last_rollout: dict[str, list] = {}
        self._pending_rng: dict | None = None
        self._ptx: _PTXStream | None = None
        self._ptx_consumed = 0
        self._consecutive_skips = 0  # optimizer steps skipped in a row for a non-finite gradient norm

    # ------------------------------------------------------------------ setup
    def _refuse_impossible_settings(self) -> None:
        """Settings under which PPO's ratio or KL would be wrong, refused before any model loads."""
        if not self.backbone_cfg.disable_dropout:
            raise ValueError(
                "PPO needs backbone.disable_dropout: true: with dropout on, the rollout, reference and training "
                "forwards of the same tokens differ, so the first PPO ratio is not 1 and the KL at step 0 is "
                "not 0 (PITFALLS B12). Dropout is set to 0 in the configs, training mode is kept"
            )
        if self.sampling.top_k or self.sampling.top_p < 1.0:
            raise ValueError(
                f"PPO refuses sampling.top_k={self.sampling.top_k} / top_p={self.sampling.top_p}: responses would "
                "come from the truncated distribution while the PPO ratio and the KL use the full softmax at "
                "the sampling temperature (an off-policy mismatch, PITFALLS B10). Use top_k: 0 and top_p: 1.0"
            )

    def _init_critic_from_reward(self) -> None:
        src = self.reward_source
        head = src.head if src.scorer is None else src.scorer.head
        if head.linear.in_features != self.policy.value_head.linear.in_features:
            raise ValueError(
                "critic.init_from_reward: the reward model's hidden size differs from the policy's"
            )
        self.policy.value_head.load_state_dict(head.state_dict())
        if src.scorer is None and not self.critic_cfg.shared_trunk:
            reward_params = dict(self.policy.lm.model.named_parameters())
            for name, p in list(reward_params.items()):
                if ".critic." in name and "lora_" in name:
                    p.data.copy_(reward_params[name.replace(".critic.", ".reward.")].data)

    def configure_model(self) -> None:
        """FSDP2 under ``ModelParallelStrategy``: shard the policy, its value head and a separate reward model.

        Does nothing under other strategies (DDP wraps the whole module itself). Units and their forward
        methods: ``rlhf_lit.parallel``.
        """
        mesh = data_parallel_mesh(self.device_mesh)
        if mesh is None:
            return
        shard_lm(self.policy.lm, mesh)
        shard_head(self.policy.value_head, mesh)
        if self.reward_source.scorer is not None:  # frozen: sharded to save memory; its head stays whole
            shard_lm(self.reward_source.scorer.lm, mesh)

    def _check_batch_sizes(self, rollout_batch_size: int) -> None:
        mb = self.ppo.ppo_minibatch_size
        micro = self.ppo.micro_batch_size or mb
        if rollout_batch_size % mb:
            raise ValueError(
                f"rollout_batch_size={rollout_batch_size} (the prompt data module's batch_size) must be a "
                f"multiple of ppo.ppo_minibatch_size={mb}"
            )
        if mb % micro:
            raise ValueError(
                f"ppo.ppo_minibatch_size={mb} must be a multiple of ppo.micro_batch_size={micro}"
            )

    def _total_iterations(self) -> int:
        if self.ppo.total_iterations:
            return self.ppo.total_iterations
        batches = self.trainer.num_training_batches
        epochs = max(1, self.trainer.max_epochs or 1)
        return int(batches * epochs) if batches != float("inf") else 1000

    def configure_optimizers(self):
        groups = [{"params": self.policy.actor_parameters(), "lr": self.optim_cfg.lr}]
        groups.append(
            {"params": self.policy.critic_parameters(), "lr": self.critic_cfg.lr or self.optim_cfg.lr}
        )
        optimizer = build_optimizer(groups, self.optim_cfg, self._trainer)
        datamodule = getattr(self.trainer, "datamodule", None)
        rollout = getattr(datamodule, "batch_size", None)
        if rollout is None:  # plain dataloaders: their batch size is not known yet when this runs
            rollout = self.ppo.ppo_minibatch_size
            rank_zero_warn(
                "PPOModule: no data module with a `batch_size`, so the learning-rate schedule assumes one "
                f"minibatch per rollout ({rollout} prompts); with larger rollouts it ends early. Pass a "
                "LightningDataModule (e.g. PromptDataModule) or use optimizer.scheduler: constant."
            )
        steps = (
            self._total_iterations() * self.ppo.ppo_epochs * max(1, rollout // self.ppo.ppo_minibatch_size)
        )
        scheduler = build_scheduler(optimizer, self.optim_cfg, steps)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    def configure_callbacks(self):
        """The reward-hacking monitor (``monitor.enabled``), added to whatever callbacks the trainer has."""
        if not self.monitor_cfg.enabled:
            return []
        settings = {k: v for k, v in asdict(self.monitor_cfg).items() if k != "enabled"}
        return [RewardHackingMonitor(**settings)]

    def on_fit_start(self) -> None:
        log_data_report(self)
        datamodule = getattr(self.trainer, "datamodule", None)
        if getattr(datamodule, "batch_size", None):
            self._check_batch_sizes(datamodule.batch_size)
        if self.ptx_cfg.coef > 0:
            self._ptx = _PTXStream(self.ptx_cfg, self.tokenizer, self.ppo.seed)
            if self._ptx_consumed:
                self._ptx.fast_forward(self._ptx_consumed)

    def on_train_start(self) -> None:
        if self._pending_rng is not None:
            _set_rng_state(self._pending_rng)
            self._pending_rng = None

    # ------------------------------------------------------------------ the PPO iteration
    def training_step(self, batch: dict, batch_idx: int) -> None:
        t0 = time.perf_counter()
        prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
        self._check_batch_sizes(prompt_ids.shape[0])
        # columns that are padding in every prompt do no work anywhere below (exact: B11)
        prompt_ids, prompt_mask, _ = trim_left_padding(prompt_ids, prompt_mask, prompt_ids.shape[1])

        # 1. rollout: sample responses with the actor adapter (optionally merged into the base for speed)
        merge = self.sampling.merge_adapter and not self._distributed() and not self.backbone_cfg.load_in_4bit
        with self.policy.lm.merged("actor") if merge else self.policy.lm.adapter("actor"):
            response_ids, response_mask, has_stop = sample_responses(
                self.policy.lm,  # AdaptedLM.generate: an FSDP forward method when sharded
                prompt_ids,
                prompt_mask,
                self.sampling,
                self.stop_ids,
                self.tokenizer.pad_token_id,
                synced_gpus=self._synced_generation(),
            )
        t1 = time.perf_counter()
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
        P = prompt_ids.shape[1]

        # 2-3. reference log-probs (adapters off), old log-probs and values (actor / critic adapters)
        ref_logprobs, old_logprobs, old_values = self._experience_forwards(input_ids, attention_mask, P)

        # 4. reward-model scores (inf / nan: an error, or the response leaves the update), missing-EOS
        #    penalty, normalisation and clipping
        raw_scores = self.reward_source.score(
            prompt_ids, prompt_mask, response_ids, response_mask, has_stop, batch.get("prompt")
        )
        finite, num_non_finite = self._check_scores(raw_scores, batch, response_ids, response_mask)
        scores = torch.where(finite, raw_scores, torch.zeros_like(raw_scores))
        if self.shaping.missing_eos_penalty is not None and self.stop_ids:
            scores = scores - self.shaping.missing_eos_penalty * (~has_stop).float()
        if self.shaping.normalize:
            self.score_stats.update(scores[finite])
        scores = normalize_scores(
            scores, self.score_stats if self.shaping.normalize else None, self.shaping.clip
        )
        # the tokens that enter the update: every real response token, less those of dropped responses
        update_mask = response_mask & finite.unsqueeze(-1)

        # 5. shaped token rewards, GAE, whitening
        kl = kl_per_token(old_logprobs, ref_logprobs, self.kl_cfg.estimator)
        kl_coef = self.kl_ctl.value
        rewards, non_score = shaped_rewards(scores, kl, response_mask, kl_coef)
        advantages, returns = gae(rewards, old_values, response_mask, self.ppo.gamma, self.ppo.gae_lambda)
        raw_advantage_mean = masked_mean(advantages, update_mask, distributed=self._distributed())
        if self.ppo.whiten_advantages:
            advantages = masked_whiten(advantages, update_mask, distributed=self._distributed())
        t2 = time.perf_counter()

        # 6. PPO epochs over shuffled minibatches
        update_stats = self._update(
            input_ids, attention_mask, P, update_mask, old_logprobs, old_values, advantages, returns
        )
        t3 = time.perf_counter()

        # 7. KL controller (fed the KL of the global batch, so every rank moves beta identically) and metrics
        seq_kl = (kl * response_mask).sum(-1)
        num_sequences = self._global_sum(torch.tensor(float(seq_kl.numel()), device=seq_kl.device))
        self.kl_ctl.update(
            float(self._global_sum(seq_kl.detach().sum()) / num_sequences), n_steps=int(num_sequences)
        )
        self.iteration += 1
        stats = {
            M.ROLLOUT_SCORE_MEAN: raw_scores[finite].mean(),
            M.ROLLOUT_SCORE_STD: raw_scores[finite].std(unbiased=False),
            M.ROLLOUT_KL_REF: seq_kl.mean(),
            M.ROLLOUT_KL_ESTIMATOR.format(estimator="k1"): ((old_logprobs - ref_logprobs) * response_mask)
            .sum(-1)
            .mean(),
            M.ROLLOUT_KL_ESTIMATOR.format(estimator="k3"): (
                kl_per_token(old_logprobs, ref_logprobs, "k3") * response_mask
            )
            .sum(-1)
            .mean(),
            M.ROLLOUT_NON_SCORE_REWARD: non_score.sum(-1).mean(),
            M.ROLLOUT_RESPONSE_LEN: response_mask.sum(-1).float().mean(),
            M.ROLLOUT_NO_EOS_FRAC: (~has_stop).float().mean() if self.stop_ids else torch.tensor(1.0),
            M.PPO_ADVANTAGE_MEAN: raw_advantage_mean,
            M.PPO_RETURN_MEAN: masked_mean(returns, update_mask, distributed=self._distributed()),
            M.CRITIC_VALUE_MEAN: masked_mean(old_values, update_mask, distributed=self._distributed()),
            M.CRITIC_EXPLAINED_VARIANCE: explained_variance(old_values, returns, update_mask),
            M.MONITOR_REF_PERPLEXITY: torch.exp(
                -masked_mean(ref_logprobs, update_mask, distributed=self._distributed())
            ),
            **update_stats,
        }
        stats = self._global_stats(stats, raw_scores, response_mask.sum(-1), finite)
        stats.update(
            {
                M.PERF_GENERATION_S: t1 - t0,
                M.PERF_EXPERIENCE_S: t2 - t1,
                M.PERF_UPDATE_S: t3 - t2,
                M.PERF_ITERATION_S: t3 - t0,
                M.PERF_GENERATION_TOKENS_PER_S: response_ids.numel() / max(t1 - t0, 1e-9),
                M.PERF_PEAK_MEMORY_MB: peak_memory_mb(),
                M.PPO_ITERATION: self.iteration,
                M.ROLLOUT_NON_FINITE_SCORES: float(num_non_finite),
            }
        )
        stats[M.PPO_KL_COEF] = kl_coef
        self._log_iteration(stats, batch, response_ids, response_mask, raw_scores)
        if self.ppo.total_iterations and self.iteration >= self.ppo.total_iterations:
            self.trainer.should_stop = True

    # ------------------------------------------------------------------ step 4 guard
    def _check_scores(self, raw_scores, batch, response_ids, response_mask) -> tuple[torch.Tensor, int]:
        """Which scores are finite, and how many in the global batch are not (every rank decides together).

        Raises:
            NonFiniteError: if a score is inf or nan (on any rank) and ``reward.skip_non_finite`` is off, or
                if every score of the global batch is.
        """
        finite = torch.isfinite(raw_scores)
        num_bad = int(self._global_sum((~finite).sum().float()))
        if num_bad == 0:
            return finite, 0
        if not self.shaping.skip_non_finite or num_bad == finite.numel() * self.trainer.world_size:
            raise NonFiniteError(
                self._non_finite_message(raw_scores, finite, batch, response_ids, response_mask)
            )
        log.warning(
            "PPO iteration %d: %d response(s) with a non-finite score dropped from the update "
            "(reward.skip_non_finite; rollout/non_finite_scores)",
            self.iteration + 1,
            num_bad,
        )
        return finite, num_bad

    def _non_finite_message(self, raw_scores, finite, batch, response_ids, response_mask) -> str:
        source = describe_reward_source(self.reward_model_cfg)
        where = f"PPO iteration {self.iteration + 1}"
        if self._distributed():
            where += f", rank {self.trainer.global_rank}"
        bad = (~finite).nonzero().flatten().tolist()
        if not bad:
            return f"{where}: a reward-model score on another rank is inf or nan ({source}); see that rank's error"
        if self.shaping.skip_non_finite:
            return f"{where}: every reward-model score of the batch is inf or nan ({source}); nothing to learn from"
        i = bad[0]
        prompts = batch.get("prompt_text")
        prompt = (
            prompts[i] if prompts else self.tokenizer.decode(batch["input_ids"][i], skip_special_tokens=True)
        )
        response = self.tokenizer.decode(response_ids[i][response_mask[i].bool()], skip_special_tokens=True)
        return (
            f"{where}: the reward model ({source}) scored response {i} of the batch {float(raw_scores[i])} "
            f"(prompt {i}: {prompt[-60:]!r}; response: {response[:60]!r})"
            + (f", and {len(bad) - 1} more (indices {bad[1:6]})" if len(bad) > 1 else "")
            + ". Set reward.skip_non_finite: true to drop such responses from the update instead"
        )

    # ------------------------------------------------------------------ steps 2-3
    @torch.no_grad()
    def _experience_forwards(self, input_ids, attention_mask, prompt_len):
        ref, old, values = [], [], []
        chunk = self.ppo.logprob_chunk_size
        T = self.sampling.temperature
        for rows in _chunks(input_ids.shape[0], self.ppo.rollout_forward_batch_size):
            ids, mask, p = trim_left_padding(input_ids[rows], attention_mask[rows], prompt_len)
            ref.append(self.policy.reference_logprobs(ids, mask, p, T, chunk))
            out = self.policy(ids, mask, p, T, chunk_size=chunk)
            old.append(out.logprobs)
            values.append(out.values)
        return torch.cat(ref), torch.cat(old), torch.cat(values)

    # ------------------------------------------------------------------ validation (rlhf-lit validate)
    @torch.no_grad()
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Sample responses to validation prompts and log ``val/score_mean``, ``val/kl_ref`` (k1, nats per
        response) and ``val/response_len``. Sampling draws from a forked RNG seeded with ``ppo.seed`` and the
        batch index, so validation is repeatable and leaves the training trajectory untouched."""
        prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
        prompt_ids, prompt_mask, _ = trim_left_padding(prompt_ids, prompt_mask, prompt_ids.shape[1])
        with torch.random.fork_rng(devices=[]), self.policy.lm.adapter("actor"):
            torch.manual_seed(self.ppo.seed * 1_000_003 + batch_idx)
            response_ids, response_mask, _ = sample_responses(
                self.policy.lm,
                prompt_ids,
                prompt_mask,
                self.sampling,
                self.stop_ids,
                self.tokenizer.pad_token_id,
                synced_gpus=self._synced_generation(),
            )
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
        ref_logprobs, logprobs, _ = self._experience_forwards(input_ids, attention_mask, prompt_ids.shape[1])
        scores = self.reward_source.score(prompt_ids, prompt_mask, response_ids, response_mask)
        n = scores.shape[0]
        kl = ((logprobs - ref_logprobs) * response_mask).sum(-1)
        self.log(M.VAL_SCORE_MEAN, scores.mean(), batch_size=n, sync_dist=True)
        self.log(M.VAL_KL_REF, kl.mean(), batch_size=n, sync_dist=True)
        self.log(M.VAL_RESPONSE_LEN, response_mask.sum(-1).float().mean(), batch_size=n, sync_dist=True)

    # ------------------------------------------------------------------ step 6
    def _update(
        self,
        input_ids,
        attention_mask,
        prompt_len,
        response_mask,
        old_logprobs,
        old_values,
        advantages,
        returns,
    ) -> dict[str, float]:
        opt = self.optimizers()
        sched = self.lr_schedulers()
        cfg = self.ppo
        B = input_ids.shape[0]
        micro = cfg.micro_batch_size or cfg.ppo_minibatch_size
        world_size = self.trainer.world_size
        rank = self.trainer.global_rank
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.iteration)
        sums: dict[str, float] = {}
        n_steps = n_applied = 0
        grad_norms = 0.0
        # Actor and critic on separate adapters have disjoint trainable parameters, so the backward of the
        # policy terms and that of the value term can run one after the other: the same gradients, but the
        # actor's activations are freed before the critic's forward (peak ~ one forward's activations, not
        # two). One process only: DDP expects every trainable parameter's gradient from each backward.
        two_pass = self._two_pass and not self.policy.shared_critic and not self._distributed()
        for _ in range(cfg.ppo_epochs):
            # one permutation of the GLOBAL batch, the same on every rank (same generator): each rank takes its
            # own rows of each global minibatch, so the minibatches are those of one rank holding every row
            order = torch.randperm(B * world_size, generator=generator)
            for mb_rows, n_micro in epoch_schedule(order, world_size, rank, cfg.ppo_minibatch_size, micro):
                mb_rows = mb_rows.to(input_ids.device)
                mb_tokens = response_mask[mb_rows].sum()
                # The loss is the token-level mean over the GLOBAL minibatch (this rank's rows of it and every
                # other rank's). DDP and FSDP average gradients over ranks, so a micro-batch's mean loss is
                # weighted by world_size * its tokens / global tokens: the average of the ranks' gradients is
                # then sum(token losses) / global tokens however unevenly rows and tokens are spread (a
                # per-rank mean, averaged, would not be). One rank: n / N.
                global_tokens = self._global_sum(mb_tokens.float()).clamp(min=1.0)
                opt.zero_grad()
                for m in range(n_micro):
                    rows = mb_rows[m * micro : (m + 1) * micro]
                    mask = response_mask[rows]
                    if rows.numel() == 0:
                        # this rank holds fewer rows of the global minibatch than another: every rank must run
                        # as many forwards and backwards (DDP / FSDP collectives), so it runs one of its rows
                        # with no real token (loss 0, weight 0, zero gradients)
                        rows = torch.zeros(1, dtype=torch.long, device=input_ids.device)
                        mask = torch.zeros_like(response_mask[rows])
                    weight = world_size * mask.sum().float() / global_tokens
                    # each micro-batch drops the prompt columns that are padding in all of its rows
                    ids, attn, p = trim_left_padding(input_ids[rows], attention_mask[rows], prompt_len)
                    if two_pass:
                        pg_loss, pg_stats, entropy, vf_loss, vf_stats = self._two_pass_backward(
                            ids,
                            attn,
                            p,
                            mask,
                            weight,
                            old_logprobs[rows],
                            old_values[rows],
                            advantages[rows],
                            returns[rows],
                        )
                    else:
                        out = self.policy(
                            ids,
                            attn,
                            p,
                            self.sampling.temperature,
                            want_entropy=True,
                            chunk_size=cfg.logprob_chunk_size,
                            entropy_grad=cfg.entropy_coef != 0,
                        )
                        pg_loss, pg_stats = ppo_policy_loss(
                            out.logprobs,
                            old_logprobs[rows],
                            advantages[rows],
                            mask,
                            cfg.clip_range,
                            cfg.dual_clip,
                        )
                        vf_loss, vf_stats = ppo_value_loss(
                            out.values, old_values[rows], returns[rows], mask, cfg.value_clip_range
                        )
                        entropy = masked_mean(out.entropy, mask)
                        loss = pg_loss + cfg.vf_coef * vf_loss - cfg.entropy_coef * entropy
                        self.manual_backward(loss * weight)
                    # the same weights for the logged losses and fractions: their mean over ranks
                    # (_global_stats) is then the token mean over the global minibatch, as on one rank
                    w = float(weight)
                    for key, value in (
                        (M.PPO_POLICY_LOSS, pg_loss),
                        (M.PPO_VALUE_LOSS, vf_loss),
                        (M.PPO_ENTROPY, entropy),
                        (M.PPO_CLIPFRAC, pg_stats["clipfrac"]),
                        (M.PPO_APPROX_KL, pg_stats["approx_kl"]),
                        (M.PPO_RATIO_MEAN, pg_stats["ratio_mean"]),
                        (M.PPO_VALUE_CLIPFRAC, vf_stats["value_clipfrac"]),
                    ):
                        sums[key] = sums.get(key, 0.0) + w * float(value.detach())
                if self._ptx is not None:
                    ptx_batch = {
                        k: v.to(self.device) for k, v in self._ptx.next_batch().items() if torch.is_tensor(v)
                    }
                    with self.policy.lm.adapter("actor"):
                        hidden = self.policy.lm.hidden_states(
                            ptx_batch["input_ids"], ptx_batch["attention_mask"]
                        )
                        ptx_loss, _ = sft_nll(self.policy.lm.logits(hidden), ptx_batch["labels"])
                    self.manual_backward(self.ptx_cfg.coef * ptx_loss)
                    sums[M.PPO_PTX_LOSS] = sums.get(M.PPO_PTX_LOSS, 0.0) + float(ptx_loss.detach())
                n_steps += 1
                grad_norm = self._clip_gradients(opt)
                if grad_norm is not None and not math.isfinite(grad_norm):
                    self._skip_step(opt, grad_norm)
                    continue
                self._consecutive_skips = 0
                grad_norms += float("nan") if grad_norm is None else grad_norm
                n_applied += 1
                opt.step()
                sched.step()
        stats = {k: v / n_steps for k, v in sums.items()}
        stats[M.PPO_GRAD_NORM] = grad_norms / n_applied if n_applied else float("nan")
        stats[M.PPO_SKIPPED_STEPS] = float(n_steps - n_applied)
        return stats

    def _skip_step(self, opt, grad_norm: float) -> None:
        """Drop a minibatch's gradients whose global norm is inf or nan: no parameter, optimizer-state or
        learning-rate change. Every rank sees the same global norm, so every rank skips together.

        Raises:
            NonFiniteError: after ``ppo.max_consecutive_skips`` skipped steps in a row.
        """
        opt.zero_grad()
        self._consecutive_skips += 1
        log.warning(
            "PPO iteration %d: optimizer step skipped, the global gradient norm is %s (%d in a row)",
            self.iteration + 1,
            grad_norm,
            self._consecutive_skips,
        )
        if self._consecutive_skips >= self.ppo.max_consecutive_skips:
            raise NonFiniteError(
                f"PPO stopped at iteration {self.iteration + 1}: {self._consecutive_skips} optimizer steps in a "
                f"row had a non-finite gradient norm ({grad_norm}), so none was applied "
                f"(ppo.max_consecutive_skips={self.ppo.max_consecutive_skips}). The run has diverged: lower "
                "optimizer.lr, set ppo.max_grad_norm, or check the reward model's scores"
            )

    def _two_pass_backward(
        self, ids, attn, prompt_len, mask, weight, old_logprobs, old_values, advantages, returns
    ):
        """Backward of ``weight * (policy_loss - entropy_coef * entropy)``, then of ``weight * vf_coef *
        value_loss``, each right after its own forward (see ``_update``); returns the losses and stats."""
        cfg = self.ppo
        out = self.policy(
            ids,
            attn,
            prompt_len,
            self.sampling.temperature,
            want_values=False,
            want_entropy=True,
            chunk_size=cfg.logprob_chunk_size,
            entropy_grad=cfg.entropy_coef != 0,
        )
        pg_loss, pg_stats = ppo_policy_loss(
            out.logprobs, old_logprobs, advantages, mask, cfg.clip_range, cfg.dual_clip
        )
        entropy = masked_mean(out.entropy, mask)
        self.manual_backward((pg_loss - cfg.entropy_coef * entropy) * weight)
        del out
        values = self.policy(ids, attn, prompt_len, self.sampling.temperature, want_logprobs=False).values
        vf_loss, vf_stats = ppo_value_loss(values, old_values, returns, mask, cfg.value_clip_range)
        self.manual_backward(cfg.vf_coef * vf_loss * weight)
        return pg_loss, pg_stats, entropy, vf_loss, vf_stats

    def _clip_gradients(self, opt) -> float | None:
        """Clip the global gradient norm over actor and critic parameters; returns the norm before clipping
        (inf or nan when a gradient is), or None under fp16 mixed precision, where Lightning clips and the
        GradScaler skips non-finite steps itself.

        Owned here (not Lightning's ``clip_gradients``) because Lightning's FSDP precision plugin refuses
        norm clipping; ``torch.nn.utils.clip_grad_norm_`` handles sharded (DTensor) parameters.
        """
        params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return 0.0
        if "16-mixed" == str(self.trainer.precision):  # fp16 GradScaler: Lightning must unscale first
            # the norm is not returned; the GradScaler itself skips steps with inf / nan gradients
            self.clip_gradients(opt, gradient_clip_val=self.ppo.max_grad_norm, gradient_clip_algorithm="norm")
            return None
        max_norm = self.ppo.max_grad_norm if self.ppo.max_grad_norm is not None else float("inf")
        # With FSDP2 the gradients are DTensor shards: clip_grad_norm_ reduces the partial norms over the
        # ranks (the norm it returns is a DTensor), so the norm is the global one and every rank scales
        # its shard by the same factor. Under DDP the gradients are already averaged, the same on each rank.
        return grad_norm_value(torch.nn.utils.clip_grad_norm_(params, max_norm))

    # ------------------------------------------------------------------ helpers
    def _distributed(self) -> bool:
        return self.trainer.world_size > 1

    def _synced_generation(self) -> bool:
        return self._distributed()

    def _global_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of a (detached) tensor over all ranks; the tensor itself on one process."""
        if not self._distributed():
            return value
        return self.trainer.strategy.reduce(value.detach().clone(), reduce_op="sum")

    def _global_stats(
        self, stats: dict, raw_scores: torch.Tensor, response_len: torch.Tensor, finite: torch.Tensor
    ) -> dict:
        """The iteration's statistics over all ranks (one all-reduce), for the logs of rank 0.

        Every rank holds the same number of sequences, so the mean over ranks of a per-sequence mean is the
        global mean; token means (advantages, returns, values) are already global (``distributed=True``);
        the losses and clip fractions of ``_update`` are weighted so that their mean over ranks is the token
        mean of the global minibatch; the score's mean and std and its correlation with the response length
        come from all scores (all-gather). Only ``critic/explained_variance`` is a mean of per-rank values.
        """
        if not self._distributed():
            return {
                **stats,
                M.MONITOR_SCORE_LENGTH_CORR: _correlation(raw_scores[finite], response_len[finite]),
            }
        keys = list(stats)
        values = torch.stack([torch.as_tensor(stats[k], dtype=torch.float64).detach().cpu() for k in keys])
        values = self.trainer.strategy.reduce(values.to(raw_scores.device), reduce_op="mean").cpu()
        out = dict(zip(keys, values.unbind()))
        scores = self.all_gather(raw_scores.detach()).flatten().double()
        kept = torch.isfinite(scores)  # dropped responses (reward.skip_non_finite) are not scores
        scores = scores[kept]
        out[M.ROLLOUT_SCORE_MEAN] = scores.mean()
        out[M.ROLLOUT_SCORE_STD] = scores.std(unbiased=False)
        lengths = self.all_gather(response_len.detach()).flatten()[kept]
        out[M.MONITOR_SCORE_LENGTH_CORR] = _correlation(scores, lengths)
        return out

    def _log_iteration(self, stats, batch, response_ids, response_mask, scores) -> None:
        values = {k: float(v) for k, v in stats.items()}
        self.history.append(values)
        prompts = batch.get("prompt_text") or self.tokenizer.batch_decode(
            batch["input_ids"], skip_special_tokens=True
        )
        # The iteration's samples as text, for callbacks (e.g. an evaluation-only gold scorer) and TensorBoard.
        self.last_rollout = {
            "prompt_text": list(prompts),
            "response_text": [
                self.tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                for ids, mask in zip(response_ids, response_mask)
            ],
            "score": [float(x) for x in scores],
        }
        progress = {
            "iter": float(self.iteration),
            "score": values[M.ROLLOUT_SCORE_MEAN],
            "kl": values[M.ROLLOUT_KL_REF],
        }
        self.log_dict(progress, prog_bar=True, logger=False, on_step=True, on_epoch=False)
        if not self.trainer.is_global_zero:
            return
        for logger in self.loggers:
            logger.log_metrics(values, step=self.iteration)
        every = self.hparams.log_samples_every
        if every and (self.iteration == 1 or self.iteration % every == 0):
            self._log_samples()

    def _log_samples(self, n: int = 4) -> None:
        """A markdown table of the first ``n`` prompts, responses and scores, to TensorBoard text."""
        cell = lambda text: text.replace("|", "\\|").replace("\n", "<br>")[-300:]  # noqa: E731
        rows = ["| prompt | response | score |", "|---|---|---|"]
        sample = self.last_rollout
        for prompt, response, score in list(
            zip(sample["prompt_text"], sample["response_text"], sample["score"])
        )[:n]:
            rows.append(f"| {cell(prompt)} | {cell(response)} | {score:.3f} |")
        for logger in self.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):
                experiment.add_text("rollout/samples", "\n".join(rows), global_step=self.iteration)

    # ------------------------------------------------------------------ checkpoints and export
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["ppo_state"] = {
            "iteration": self.iteration,
            "kl_controller": self.kl_ctl.state_dict(),
            "score_stats": self.score_stats.state_dict(),
            "rng": _get_rng_state(),
            "ptx_consumed": self._ptx.consumed if self._ptx is not None else 0,
            "history": self.history,
            "consecutive_skips": self._consecutive_skips,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("ppo_state")
        if state is None:
            return
        self.iteration = state["iteration"]
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.score_stats.load_state_dict(state["score_stats"])
        self.history = list(state.get("history", []))
        self._pending_rng = state["rng"]  # applied at on_train_start, after everything else has set up
        self._ptx_consumed = int(state.get("ptx_consumed", 0))
        self._consecutive_skips = int(state.get("consecutive_skips", 0))

    def on_fit_end(self) -> None:
        if not self.export_dir:
            return
        with gathered_parameters(self.policy.lm):  # a collective under FSDP2; nothing otherwise
            if self.trainer.is_global_zero:
                save_causal_lm(
                    self.policy.lm,
                    self.tokenizer,
                    self.export_dir,
                    self.backbone_cfg,
                    self.export_mode,
                    adapter_name="actor",
                    meta={
                        "kind": "policy",
                        "stage": "ppo",
                        "iterations": self.iteration,
                        "sampling": asdict(self.sampling),
                        "target_kl": self.kl_cfg.target_kl,
                    },
                )
        if self.trainer.is_global_zero:  # one writer
            self._plot_curves(os.path.join(self.export_dir, "ppo_curves.png"))

    def _plot_curves(self, path: str) -> None:
        """Score and KL per iteration (the whole run, resumed parts included), with the KL budget."""
        if not self.history:
            return
        steps = [h[M.PPO_ITERATION] for h in self.history]
        series = {
            "RM score (rollout/score_mean)": [h[M.ROLLOUT_SCORE_MEAN] for h in self.history],
            "KL to reference (rollout/kl_ref, nats)": [h[M.ROLLOUT_KL_REF] for h in self.history],
        }
        fig = curves_figure(steps, series, "PPO iteration", "PPO: reward-model score and KL per iteration")
        if self.kl_cfg.target_kl is not None:
            fig.axes[1].axhline(self.kl_cfg.target_kl, color="red", linestyle="--", label="kl.target_kl")
            fig.axes[1].legend()
        save_figure(fig, path)


class _PTXStream:
    """An endless, resumable stream of SFT batches for the PTX term."""

    def __init__(self, cfg: PTXConfig, tokenizer, seed: int) -> None:
        from rlhf_lit.data import SFTDataModule

        self.datamodule = SFTDataModule(
            train_files=cfg.train_files,
            format=cfg.format,
            batch_size=cfg.batch_size,
            max_length=cfg.max_length,
            val_size=0,
            seed=seed,
            tokenizer=tokenizer,
        )
        self.datamodule.setup("fit")
        self.consumed = 0
        self._iterator = None

    def next_batch(self) -> dict:
        while True:
            if self._iterator is None:
                self._iterator = iter(self.datamodule.train_dataloader())
            try:
                batch = next(self._iterator)
                self.consumed += 1
                return batch
            except StopIteration:
                self._iterator = None

    def fast_forward(self, consumed: int) -> None:
        """Skip the batches an interrupted run already used (the loader order is seeded)."""
        for _ in range(consumed):
            self.next_batch()


def _correlation(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of two (N,) series; 0 when either is constant (no linear relation to report)."""
    both = torch.stack([x.detach().double().flatten(), y.detach().double().flatten()])
    if both.shape[1] < 2 or bool((both.std(dim=1) == 0).any()):
        return torch.tensor(0.0, dtype=torch.float64)
    return torch.corrcoef(both)[0, 1]


def _get_rng_state() -> dict:
    """RNG states in types a weights-only ``torch.load`` accepts (tensors, lists, ints, strings)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss_next],
        "numpy": numpy_state,
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
