"""Stage 3: PPO against a frozen reward model, with a per-token KL penalty to a frozen reference.

One ``training_step`` is one PPO iteration on one batch of prompts (Ouyang et al. 2022; Stiennon et al.
2020; Schulman et al. 2017), assembled from pieces in their own modules:

1-4. ``rlhf_lit.rollout.collect_rollout``: the actor adapter samples responses; reference log-probs with
   every adapter switched off; old log-probs (actor) and values (critic) at the sampling temperature with
   dropout off; reward-model scores (calibrated; an inf / nan one raises ``NonFiniteError``, or with
   ``reward.skip_non_finite`` leaves the update), missing-EOS penalty, normalisation and clipping;
5. the advantage estimator ``ppo.advantage_estimator`` (``rlhf_lit.algorithms.build_estimator``): GAE with a
   critic (shaped token rewards, GAE, whitening), or a critic-free one, which builds no critic adapter and no
   value head: GRPO / Dr.GRPO and RLOO over the ``sampling.num_samples_per_prompt`` responses to each prompt,
   REINFORCE++ (returns normalised over the global batch). With ``ppo.kl_placement: loss`` the KL leaves the
   rewards and enters the objective as a k3 term;
6. ``rlhf_lit.modules.ppo_update.ppo_update``: ``ppo_epochs`` x shuffled minibatches x micro-batches of the
   objective (``rlhf_lit.algorithms.PPOObjective``: clipped policy loss + value loss - entropy bonus), + PTX,
   one optimizer step per minibatch with global-norm gradient clipping (a step whose norm is inf or nan is
   skipped and counted; ``ppo.max_consecutive_skips`` in a row raise ``NonFiniteError``);
7. the KL controller update and the iteration's metrics (``rlhf_lit.modules.ppo_stats``).

Refused before any model loads: dropout left on, ``top_k`` / ``top_p`` sampling, a missing-EOS penalty
without a stop token (each would make the ratio, the KL or the reward wrong without an error).

Manual optimization: Lightning never calls ``optimizer_step`` here; ``trainer.global_step`` counts
optimizer steps, so ``ppo/iteration`` is our own counter.

Several processes (``ddp``, or FSDP2 via ``ModelParallelStrategy`` / ``FSDP2Strategy``; each rank holds
its own slice of the rollout): statistics (whitening, reward normalisation, the KL controller's input) are
over all ranks, minibatches are global (``ppo_update``), generation keeps every rank stepping
(``synced_gpus``) and clipping takes the global norm: 2 ranks x 4 sequences make the same update as 1 rank x 8.
State that a resumed run needs (iteration, KL controller, reward statistics, RNG, PTX position, skipped-step
count) is saved in the checkpoint, so a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from rlhf_lit import metrics as M
from rlhf_lit.algorithms import PPOObjective, build_estimator
from rlhf_lit.callbacks import HFExport, PPOCurves, RewardHackingMonitor, RolloutSamples, unless_configured
from rlhf_lit.data.ptx import PTXStream
from rlhf_lit.errors import NonFiniteError
from rlhf_lit.generation import SamplingConfig, resolve_stop_ids, sample_responses
from rlhf_lit.kl_control import build_kl_controller
from rlhf_lit.models.backbone import BackboneConfig, load_backbone, load_backbone_tokenizer
from rlhf_lit.models.export import save_causal_lm
from rlhf_lit.models.policy import ActorCritic
from rlhf_lit.models.reward_source import RewardModelConfig, RewardSource
from rlhf_lit.modules.common import (
    OptimizerConfig,
    as_config,
    attached_trainer,
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
    check_advantage_estimator,
    check_batch_sizes,
    check_stop_tokens,
    refuse_impossible_settings,
)
from rlhf_lit.modules.ppo_stats import global_kl_per_response, global_stats, iteration_stats, perf_stats
from rlhf_lit.modules.ppo_update import UpdateBatch, clip_global_grad_norm, epoch_schedule, ppo_update
from rlhf_lit.parallel import (
    data_parallel_mesh,
    gathered_parameters,
    is_distributed,
    shard_head,
    shard_lm,
)
from rlhf_lit.reward_norm import RunningMeanStd
from rlhf_lit.rewards import MixedReward, RewardSourceConfig
from rlhf_lit.rng import get_rng_state, set_rng_state
from rlhf_lit.rollout import Rollout, collect_rollout, experience_forwards, validation_rollout

log = logging.getLogger("rlhf_lit")

# ``sample_responses`` and ``epoch_schedule`` are looked up here when an iteration runs, so a test or a
# benchmark can stand in for the sampler or the minibatch schedule (tests/ppo/test_oracle.py does).
__all__ = ["NonFiniteError", "PPOModule", "epoch_schedule", "sample_responses"]


def reward_config(value) -> RewardModelConfig | list[RewardSourceConfig]:
    """``reward_model`` as given (a config, its dict form, or a list of either) as config objects."""
    if isinstance(value, (list, tuple)):
        return [as_config(RewardSourceConfig, entry) for entry in value]
    return as_config(RewardModelConfig, value)


class PPOModule(L.LightningModule):
    """PPO with actor, critic and reference on one base (LoRA adapters), under manual optimization; with a
    critic-free ``ppo.advantage_estimator`` (``grpo``, ``rloo``, ``reinforce_pp``) the same iteration without a
    critic.

    Args:
        backbone: the policy's base (normally the SFT export) and how it is held; ``backbone.lora`` is the
            actor adapter's LoRA settings (required: the reference is the base with adapters off). An SFT
            export that holds only an adapter (a QLoRA SFT) is loaded as its base plus that adapter, frozen
            and kept on beneath actor and critic and in the reference, so the reference is the SFT policy.
        reward_model: the frozen reward model (a separate model or an adapter on this base), or a list of
            weighted reward sources: learned reward models and ``module:function`` reward functions
            (``rlhf_lit.rewards``; e.g. ``rlhf_lit.rewards:instruction_constraints``), summed with their
            weights; each source's scores are logged as ``rollout/score/<name>``.
        sampling: how responses are sampled.
        ppo: the PPO update, the advantage estimator, the loss aggregation and the KL placement.
        kl: the KL penalty and its controller.
        reward: score normalisation, clipping and the missing-EOS penalty.
        critic: the critic adapter and value head.
        optimizer: optimizer and schedule (``lr`` is the actor's; ``critic.lr`` the critic's).
        ptx: the optional pretraining-mix term.
        monitor: the reward-hacking monitors (on by default).
        log_samples_every: write a table of sampled prompts, responses and scores to TensorBoard text
            every this many iterations (0 disables; ``rlhf_lit.callbacks.RolloutSamples``).
        export_dir: where the final policy is written in Hugging Face format at the end of fit, with
            ``ppo_curves.png`` (``HFExport``, ``PPOCurves``); null writes neither.
        export_mode: ``auto`` | ``merged`` | ``adapter``.
        rollout_batch_size: prompts per rollout per rank; the CLI links it from ``data.init_args.batch_size``
            at parse time (not set in YAML). It sizes the learning-rate schedule (optimizer steps per
            iteration) and is checked against ``ppo.ppo_minibatch_size`` before training. A module built in
            Python without it takes the batch size of the trainer's data module.
    """

    def __init__(
        self,
        backbone: BackboneConfig,
        reward_model: RewardModelConfig | list[RewardSourceConfig],
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
        rollout_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        backbone = as_config(BackboneConfig, backbone)
        if backbone.lora is None:
            raise ValueError(
                "PPO needs LoRA adapters (backbone.lora): the reference is the base with adapters off"
            )
        self.backbone_cfg = backbone
        self.reward_model_cfg = reward_config(reward_model)
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
                reward_model=(
                    [asdict(e) for e in self.reward_model_cfg]
                    if isinstance(self.reward_model_cfg, list)
                    else self.reward_model_cfg
                ),
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
        self.rollout_batch_size = rollout_batch_size  # derived from the data, so not a hyper-parameter

        refuse_impossible_settings(self.backbone_cfg, self.sampling)
        check_advantage_estimator(self.ppo, self.sampling, self.critic_cfg)
        self._build_models(backbone)
        self.kl_ctl = build_kl_controller(
            self.kl_cfg.kl_coef, self.kl_cfg.adaptive, self.kl_cfg.target_kl, self.kl_cfg.horizon
        )
        self.estimator = build_estimator(self.ppo, self.sampling.num_samples_per_prompt)  # step 5
        self.objective = PPOObjective.from_settings(self.ppo)  # the loss of step 6
        self.score_stats = RunningMeanStd(distributed=True)
        self.iteration = 0
        self.history: list[dict[str, float]] = []
        # sequential actor / critic backward on one process (ppo_update); tests switch it
        self._two_pass = True
        self.last_rollout: dict[str, list] = {}
        self._pending_rng: dict | None = None
        self._ptx: PTXStream | None = None
        self._ptx_consumed = 0
        self._consecutive_skips = 0  # optimizer steps skipped in a row for a non-finite gradient norm

    # ------------------------------------------------------------------ setup
    def _build_models(self, backbone: BackboneConfig) -> None:
        """Tokenizer and stop tokens, the shared base with actor and critic adapters, the reward source."""
        self.tokenizer = load_backbone_tokenizer(backbone)
        self.stop_ids = resolve_stop_ids(self.sampling, self.tokenizer)
        check_stop_tokens(self.shaping, self.stop_ids)
        base = load_backbone(backbone, self.tokenizer)
        backbone.lora.dropout = 0.0  # log-probs must be exact (pitfall: dropout)
        with_critic = self.ppo.needs_critic  # critic-free estimators: no critic adapter, no value head
        critic_lora = None if self.critic_cfg.shared_trunk or not with_critic else self.critic_cfg.lora
        if critic_lora is not None:
            critic_lora.dropout = 0.0
        self.policy = ActorCritic(base, backbone.lora, critic_lora, with_critic)
        if isinstance(self.reward_model_cfg, list):
            self.reward_source = MixedReward(
                self.reward_model_cfg,
                self.tokenizer,
                lambda cfg: RewardSource(
                    as_config(RewardModelConfig, cfg), self.tokenizer, self.policy.lm, backbone
                ),
            )
        else:
            self.reward_source = RewardSource(self.reward_model_cfg, self.tokenizer, self.policy.lm, backbone)
        if (
            self.critic_cfg.init_from_reward
        ):  # PPO-Max; a reward adapter on this base starts the critic adapter
            if isinstance(self.reward_source, MixedReward):
                raise ValueError("critic.init_from_reward needs one reward model, not a reward_model list")
            src = self.reward_source
            in_base = src.scorer is None
            self.policy.start_critic_from(
                src.head if in_base else src.scorer.head, "reward" if in_base else None
            )

    def configure_model(self) -> None:
        """FSDP2 under ``ModelParallelStrategy``: shard the policy, its value head and a separate reward model.

        Does nothing under other strategies (DDP wraps the whole module itself). Units and their forward
        methods: ``rlhf_lit.parallel``.
        """
        mesh = data_parallel_mesh(self.device_mesh)
        if mesh is None:
            return
        shard_lm(self.policy.lm, mesh)
        if self.policy.value_head is not None:
            shard_head(self.policy.value_head, mesh)
        if self.reward_source.scorer is not None:  # frozen: sharded to save memory; its head stays whole
            shard_lm(self.reward_source.scorer.lm, mesh)

    def _total_iterations(self) -> int:
        if self.ppo.total_iterations:
            return self.ppo.total_iterations
        batches = self.trainer.num_training_batches
        epochs = max(1, self.trainer.max_epochs or 1)
        return int(batches * epochs) if batches != float("inf") else 1000

    def _rollout_batch_size(self) -> int | None:
        """``rollout_batch_size`` (linked by the CLI at parse time), else (a module built in Python) the
        batch size of the trainer's data module, else None."""
        if self.rollout_batch_size is not None:
            return self.rollout_batch_size
        return getattr(getattr(attached_trainer(self), "datamodule", None), "batch_size", None)

    def optimizer_steps_per_iteration(self) -> int:
        """``ppo_epochs`` x minibatches per rollout (one minibatch when the rollout size is unknown)."""
        prompts = self._rollout_batch_size()
        n = self.sampling.num_samples_per_prompt
        rollout = prompts * n if prompts else self.ppo.ppo_minibatch_size
        return self.ppo.ppo_epochs * max(1, rollout // self.ppo.ppo_minibatch_size)

    def configure_optimizers(self):
        groups = [{"params": self.policy.actor_parameters(), "lr": self.optim_cfg.lr}]
        if self.policy.has_critic:
            groups.append(
                {"params": self.policy.critic_parameters(), "lr": self.critic_cfg.lr or self.optim_cfg.lr}
            )
        optimizer = build_optimizer(groups, self.optim_cfg, attached_trainer(self))
        rollout = self._rollout_batch_size()
        if rollout is None:  # plain dataloaders: their batch size is not known yet when this runs
            rank_zero_warn(
                "PPOModule: rollout_batch_size is not set and there is no data module with a `batch_size`, so "
                f"the learning-rate schedule assumes one minibatch per rollout ({self.ppo.ppo_minibatch_size} "
                "prompts); with larger rollouts it ends early. Pass rollout_batch_size, a LightningDataModule "
                "(e.g. PromptDataModule) or use optimizer.scheduler: constant."
            )
        steps = self._total_iterations() * self.optimizer_steps_per_iteration()
        scheduler = build_scheduler(optimizer, self.optim_cfg, steps)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]

    def configure_callbacks(self):
        """The outputs this module's settings ask for, added to the trainer's callbacks: the reward-hacking
        monitor (``monitor.enabled``), the sample table (``log_samples_every``), the Hugging Face export and
        the score / KL curves (``export_dir``). One of the same class in ``trainer.callbacks`` is kept instead."""
        callbacks = []
        if self.monitor_cfg.enabled:
            settings = {k: v for k, v in asdict(self.monitor_cfg).items() if k != "enabled"}
            callbacks.append(RewardHackingMonitor(**settings))
        if self.hparams.log_samples_every:
            callbacks.append(RolloutSamples(every=self.hparams.log_samples_every))
        if self.export_dir:
            callbacks += [HFExport(), PPOCurves(target_kl=self.kl_cfg.target_kl)]
        return unless_configured(attached_trainer(self), callbacks)

    def on_fit_start(self) -> None:
        log_data_report(self)
        if self._rollout_batch_size():
            check_batch_sizes(self.ppo, self._rollout_batch_size(), self.sampling.num_samples_per_prompt)
        if self.ptx_cfg.coef > 0:
            self._ptx = PTXStream(self.ptx_cfg, self.tokenizer, self.ppo.seed)
            if self._ptx_consumed:
                self._ptx.fast_forward(self._ptx_consumed)

    def on_train_start(self) -> None:
        if self._pending_rng is not None:
            set_rng_state(self._pending_rng)
            self._pending_rng = None

    # ------------------------------------------------------------------ the PPO iteration
    def training_step(self, batch: dict, batch_idx: int) -> None:
        t0 = time.perf_counter()
        check_batch_sizes(self.ppo, batch["input_ids"].shape[0], self.sampling.num_samples_per_prompt)
        # 1-4. sampling, reference / old log-probs and values, reward scores (rlhf_lit.rollout)
        rollout = collect_rollout(self, batch, sample=sample_responses)
        t1 = t0 + rollout.generation_s
        # 5. token rewards, advantages, returns (the estimator; rlhf_lit.algorithms)
        kl_coef, kl_in_loss = self.kl_ctl.value, self.ppo.kl_in_loss()
        adv = self.estimator(rollout, 0.0 if kl_in_loss else kl_coef, is_distributed(self.trainer))
        t2 = time.perf_counter()
        # 6. PPO epochs over shuffled minibatches (rlhf_lit.modules.ppo_update)
        update_stats = self._update(
            rollout.input_ids,
            rollout.attention_mask,
            rollout.prompt_len,
            rollout.update_mask,
            rollout.old_logprobs,
            rollout.old_values,
            adv.advantages,
            adv.returns,
            **({"ref_logprobs": rollout.ref_logprobs, "kl_coef": kl_coef} if kl_in_loss else {}),
        )
        t3 = time.perf_counter()
        # 7. KL controller and metrics
        self.kl_ctl.update(*global_kl_per_response(self.trainer, rollout))  # every rank moves beta alike
        self.iteration += 1
        stats = iteration_stats(rollout, adv, bool(self.stop_ids), is_distributed(self.trainer))
        stats = global_stats(self.trainer, {**stats, **update_stats}, rollout)
        stats.update(perf_stats((t0, t1, t2, t3), rollout.response_ids.numel(), peak_memory_mb()))
        stats[M.PPO_ITERATION] = self.iteration
        stats[M.ROLLOUT_NON_FINITE_SCORES] = float(rollout.num_non_finite)
        stats[M.PPO_KL_COEF] = kl_coef
        self._log_iteration(stats, batch, rollout)
        if self.ppo.total_iterations and self.iteration >= self.ppo.total_iterations:
            self.trainer.should_stop = True

    def _experience_forwards(self, input_ids, attention_mask, prompt_len):
        """Steps 2-3 (``rollout.experience_forwards``); tests spy on this method."""
        return experience_forwards(self, input_ids, attention_mask, prompt_len)

    def _update(
        self,
        input_ids,
        attention_mask,
        prompt_len,
        update_mask,
        old_logprobs,
        old_values,
        advantages,
        returns,
        ref_logprobs=None,
        kl_coef: float = 0.0,
    ) -> dict[str, float]:
        """Step 6 on the fields of ``UpdateBatch`` (in its order; tests record them here): see
        ``rlhf_lit.modules.ppo_update.ppo_update``. ``ref_logprobs`` and ``kl_coef`` are given only with the
        KL in the loss (``ppo.kl_placement: loss``)."""
        batch = UpdateBatch(
            input_ids,
            attention_mask,
            prompt_len,
            update_mask,
            old_logprobs,
            old_values,
            advantages,
            returns,
            ref_logprobs=ref_logprobs,
            kl_coef=kl_coef,
        )
        return ppo_update(self, batch, schedule=epoch_schedule)

    def _clip_gradients(self, opt) -> float | None:
        """The global-norm clipping of each optimizer step (``ppo_update.clip_global_grad_norm``)."""
        return clip_global_grad_norm(self, opt)

    # ------------------------------------------------------------------ validation (rlhf-lit validate)
    @torch.no_grad()
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Sample responses to validation prompts and log ``val/score_mean``, ``val/kl_ref`` (k1, nats per
        response) and ``val/response_len`` (``rollout.validation_rollout``: a forked RNG seeded with
        ``ppo.seed`` and the batch index, so validation is repeatable and leaves training untouched)."""
        scores, kl, lengths = validation_rollout(self, batch, batch_idx, sample=sample_responses)
        n = scores.shape[0]
        self.log(M.VAL_SCORE_MEAN, scores.mean(), batch_size=n, sync_dist=True)
        self.log(M.VAL_KL_REF, kl.mean(), batch_size=n, sync_dist=True)
        self.log(M.VAL_RESPONSE_LEN, lengths.float().mean(), batch_size=n, sync_dist=True)

    # ------------------------------------------------------------------ logging
    def _log_iteration(self, stats: dict, batch: dict, rollout: Rollout) -> None:
        values = {k: float(v) for k, v in stats.items()}
        self.history.append(values)
        # the iteration's samples as text, for callbacks (RolloutSamples, an evaluation-only gold scorer)
        self.last_rollout = rollout.as_text(self.tokenizer, rollout.prompt_ids)
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

    # ------------------------------------------------------------------ checkpoints and export
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["ppo_state"] = {
            "iteration": self.iteration,
            "kl_controller": self.kl_ctl.state_dict(),
            "score_stats": self.score_stats.state_dict(),
            "rng": get_rng_state(),
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

    def export(self, path: str) -> None:
        """Write the policy (the actor adapter, merged or alone per ``export_mode``) in Hugging Face format to
        ``path`` (``rlhf_lit.models.export``); every rank calls it (a collective under FSDP2), rank 0 writes.
        ``HFExport`` calls it at the end of fit when ``export_dir`` is set."""
        with gathered_parameters(self.policy.lm):  # a collective under FSDP2; nothing otherwise
            if attached_trainer(self) is None or self.trainer.is_global_zero:
                save_causal_lm(
                    self.policy.lm,
                    self.tokenizer,
                    path,
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
