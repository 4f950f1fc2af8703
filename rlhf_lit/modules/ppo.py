"""Stage 3: PPO (or a critic-free estimator) against a frozen reward model, as a Lightning shell around the RL core.

One ``training_step`` is one iteration on one batch of prompts (Ouyang et al. 2022; Stiennon et al. 2020;
Schulman et al. 2017), each step a component of ``rlhf_lit.rl`` built in ``__init__`` with what it needs:

1-4. ``collector.collect`` (``rl.rollout.RolloutCollector``): the sampler (``rl.sampler.HFSampler``) draws
   responses with the actor adapter; reference log-probs with every adapter off; old log-probs and values at
   the sampling temperature with dropout off; the reward function's scores, the non-finite guard, the
   missing-EOS penalty, normalisation and clipping (``rl.rollout.ScoreShaper``);
5. the advantage estimator ``ppo.advantage_estimator`` (registered in ``rl.algorithms``, which says whether
   it needs a critic: critic-free ones build no critic adapter and no value head);
6. ``updater.update`` (``rl.update.PPOUpdater``): ``ppo_epochs`` x shuffled global minibatches x
   micro-batches of the objective (``rl.objectives.PPOObjective``), + PTX, one optimizer step per minibatch
   with global-norm clipping (non-finite norms skip the step; ``ppo.max_consecutive_skips`` in a row raise);
7. ``sampler.sync``, the KL controller (``rl.kl_control``) and the iteration's metrics (``rl.stats``).

Metrics: every iteration's figures go to the loggers with step = the PPO iteration (``ppo/iteration``, not
``trainer.global_step``, which counts optimizer steps) and, through ``self.log_dict(on_step=True,
logger=False)``, to ``trainer.callback_metrics``, so ``ModelCheckpoint(monitor="rollout/score_mean")`` and
``EarlyStopping`` can watch them (one training step = one iteration).

Refused before any model loads: dropout on, greedy or ``top_k`` / ``top_p`` sampling, a missing-EOS penalty
without a stop token. Several processes (DDP, FSDP2): statistics are over all ranks, minibatches are global,
generation keeps every rank stepping and clipping takes the global norm. A resumed run equals an
uninterrupted one: iteration, KL controller, reward statistics, RNG, PTX position and skipped-step count are
checkpointed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from rlhf_lit import metrics as M
from rlhf_lit.callbacks import HFExport, PPOCurves, RewardHackingMonitor, RolloutSamples, unless_configured
from rlhf_lit.data.ptx import PTXStream
from rlhf_lit.generation import SamplingConfig, resolve_stop_ids
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
from rlhf_lit.parallel import data_parallel_mesh, gathered_parameters, is_distributed, shard_head, shard_lm
from rlhf_lit.reward_norm import RunningMeanStd
from rlhf_lit.rewards import MixedReward, RewardSourceConfig
from rlhf_lit.rl.kl_control import build_kl_controller
from rlhf_lit.rl.objectives import PPOObjective
from rlhf_lit.rl.rollout import RolloutCollector, RolloutSettings, ScoreShaper, describe_reward_source
from rlhf_lit.rl.sampler import HFSampler, Sampler
from rlhf_lit.rl.stats import global_kl_per_response, global_stats, iteration_stats, perf_stats
from rlhf_lit.rl.update import PPOUpdater, UpdateBatch, UpdateSettings, clip_global_grad_norm, epoch_schedule
from rlhf_lit.rng import get_rng_state, set_rng_state

log = logging.getLogger("rlhf_lit")

__all__ = ["PPOModule"]


def reward_config(value) -> RewardModelConfig | list[RewardSourceConfig]:
    """``reward_model`` as given (a config, its dict form, or a list of either) as config objects."""
    if isinstance(value, (list, tuple)):
        return [as_config(RewardSourceConfig, entry) for entry in value]
    return as_config(RewardModelConfig, value)


class PPOModule(L.LightningModule):
    """PPO with actor, critic and reference on one base (LoRA adapters), under manual optimization; with a
    critic-free ``ppo.advantage_estimator`` (``grpo``, ``rloo``, ``reinforce_pp``, or any registered one that
    declares no critic) the same iteration without a critic.

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
        sampler: a factory ``(sampling, stop_ids, pad_token_id) -> Sampler`` (``rlhf_lit.rl.sampler``);
            default ``HFSampler`` (Hugging Face ``generate``).
        schedule: the minibatch schedule (``rlhf_lit.rl.update.epoch_schedule`` or one with its signature).
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
        sampler: Callable[..., Sampler] | None = None,
        schedule: Callable | None = None,
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
        reward_hparam = self.reward_model_cfg
        if isinstance(reward_hparam, list):
            reward_hparam = [asdict(e) for e in reward_hparam]
        # Every switch (PPO-Max tricks included) is recorded, as plain dicts so checkpoints load weights-only.
        self.save_hyperparameters(
            plain_hparams(
                type(self),
                backbone=backbone,
                reward_model=reward_hparam,
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
        self._build_components(sampler or HFSampler, schedule or epoch_schedule)
        self.iteration = 0
        self.history: list[dict[str, float]] = []
        self.last_rollout: dict[str, list] = {}
        self._pending_rng: dict | None = None
        self._ptx_consumed = 0

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

    def _build_components(self, make_sampler: Callable[..., Sampler], schedule: Callable) -> None:
        """The RL core's components (``rlhf_lit.rl``), each given what it needs and never this module."""
        self.kl_ctl = build_kl_controller(
            self.kl_cfg.kl_coef, self.kl_cfg.adaptive, self.kl_cfg.target_kl, self.kl_cfg.horizon
        )
        self.algorithm = self.ppo.algorithm  # the registry entry of ppo.advantage_estimator
        self.estimator = self.algorithm.estimator(self.ppo, self.sampling.num_samples_per_prompt)  # step 5
        kl_estimator = self.kl_cfg.resolved_estimator(self.ppo.kl_in_loss())
        self.objective = PPOObjective.from_settings(self.ppo, kl_estimator)  # the loss of step 6
        self.score_stats = RunningMeanStd(distributed=True)
        self.sampler = make_sampler(self.sampling, self.stop_ids, self.tokenizer.pad_token_id)
        settings = RolloutSettings(
            temperature=self.sampling.temperature,
            num_samples_per_prompt=self.sampling.num_samples_per_prompt,
            forward_batch_size=self.ppo.rollout_forward_batch_size,
            logprob_chunk_size=self.ppo.logprob_chunk_size,
            kl_estimator=kl_estimator,
            merge_adapter=self.sampling.merge_adapter and not self.backbone_cfg.load_in_4bit,
            skip_non_finite=self.shaping.skip_non_finite,
            seed=self.ppo.seed,
            reward_description=describe_reward_source(self.reward_model_cfg),
        )
        shaper = ScoreShaper(self.shaping, self.score_stats, has_stop_token=bool(self.stop_ids))
        world = self._world
        self.collector = RolloutCollector(
            self.policy, self.reward_source, self.sampler, shaper, settings, self.tokenizer, world
        )
        self.updater = PPOUpdater(
            self.policy,
            self.objective,
            UpdateSettings.from_configs(self.ppo, self.sampling),
            backward=self.manual_backward,
            clip=self._clip,
            optimizers=lambda: (self.optimizers(), self.lr_schedulers()),
            world=world,
            schedule=schedule,
        )

    def _world(self):
        return attached_trainer(self)

    def _clip(self, opt) -> float | None:
        """Global-norm clipping of each optimizer step (``rl.update.clip_global_grad_norm``)."""
        precision = str(self.trainer.precision)
        return clip_global_grad_norm(opt, self.ppo.max_grad_norm, precision, self.clip_gradients)

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
            stream = PTXStream(self.ptx_cfg, self.tokenizer, self.ppo.seed)
            if self._ptx_consumed:
                stream.fast_forward(self._ptx_consumed)
            self.updater.ptx_stream, self.updater.ptx_coef = stream, self.ptx_cfg.coef

    def on_train_start(self) -> None:
        if self._pending_rng is not None:
            set_rng_state(self._pending_rng)
            self._pending_rng = None

    # ------------------------------------------------------------------ the iteration
    def training_step(self, batch: dict, batch_idx: int) -> None:
        t0 = time.perf_counter()
        check_batch_sizes(self.ppo, batch["input_ids"].shape[0], self.sampling.num_samples_per_prompt)
        # 1-4. sampling, reference / old log-probs and values, reward scores
        rollout = self.collector.collect(batch, self.iteration)
        t1 = t0 + rollout.generation_s
        # 5. token rewards, advantages, returns
        kl_coef, kl_in_loss = self.kl_ctl.value, self.ppo.kl_in_loss()
        adv = self.estimator(rollout, 0.0 if kl_in_loss else kl_coef, is_distributed(self.trainer))
        t2 = time.perf_counter()
        # 6. PPO epochs over shuffled minibatches
        update_batch = UpdateBatch(
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
        update_stats = self.updater.update(update_batch, self.iteration)
        t3 = time.perf_counter()
        # 7. the sampler sees the new weights; KL controller (every rank moves beta alike); metrics
        self.sampler.sync(self.policy)
        self.kl_ctl.update(*global_kl_per_response(self.trainer, rollout))
        self.iteration += 1
        stats = iteration_stats(rollout, adv, bool(self.stop_ids), is_distributed(self.trainer))
        stats = global_stats(self.trainer, {**stats, **update_stats}, rollout)
        stats.update(perf_stats((t0, t1, t2, t3), rollout.response_ids.numel(), peak_memory_mb()))
        stats[M.PPO_ITERATION] = self.iteration
        stats[M.ROLLOUT_NON_FINITE_SCORES] = float(rollout.num_non_finite)
        stats[M.PPO_KL_COEF] = kl_coef
        self.last_rollout = rollout.as_text(self.tokenizer, rollout.prompt_ids)  # for RolloutSamples & co.
        self._log_iteration(stats)
        if self.ppo.total_iterations and self.iteration >= self.ppo.total_iterations:
            self.trainer.should_stop = True

    @torch.no_grad()
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """``val/score_mean``, ``val/kl_ref`` (k1, nats per response), ``val/response_len`` of sampled
        responses to validation prompts (``RolloutCollector.validate``: a forked RNG seeded with ``ppo.seed``
        and the batch index, so validation is repeatable and leaves training untouched)."""
        scores, kl, lengths = self.collector.validate(batch, batch_idx)
        n = scores.shape[0]
        self.log(M.VAL_SCORE_MEAN, scores.mean(), batch_size=n, sync_dist=True)
        self.log(M.VAL_KL_REF, kl.mean(), batch_size=n, sync_dist=True)
        self.log(M.VAL_RESPONSE_LEN, lengths.float().mean(), batch_size=n, sync_dist=True)

    def _log_iteration(self, stats: dict) -> None:
        """The iteration's figures (the same on every rank: ``rl.stats.global_stats``) into ``history``, the
        loggers (step = iteration) and ``trainer.callback_metrics`` (for ModelCheckpoint / EarlyStopping)."""
        values = {k: float(v) for k, v in stats.items()}
        self.history.append(values)
        self.log_dict(values, on_step=True, on_epoch=False, logger=False, batch_size=1)
        progress = {"iter": values[M.PPO_ITERATION], "score": values[M.ROLLOUT_SCORE_MEAN]}
        progress["kl"] = values[M.ROLLOUT_KL_REF]
        self.log_dict(progress, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)
        if self.trainer.is_global_zero:
            for logger in self.loggers:
                logger.log_metrics(values, step=self.iteration)

    # ------------------------------------------------------------------ checkpoints and export
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        stream = self.updater.ptx_stream
        checkpoint["ppo_state"] = {
            "iteration": self.iteration,
            "kl_controller": self.kl_ctl.state_dict(),
            "score_stats": self.score_stats.state_dict(),
            "rng": get_rng_state(),
            "ptx_consumed": stream.consumed if stream is not None else 0,
            "history": self.history,
            **self.updater.state_dict(),  # consecutive_skips
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
        self.updater.load_state_dict(state)

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
