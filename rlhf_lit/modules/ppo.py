"""Stage 3: PPO (or a critic-free estimator) against a frozen reward model: the Lightning shell of the RL core.

``training_step`` is one iteration on one batch of prompts (Ouyang et al. 2022; Schulman et al. 2017), each
step a component of ``rlhf_lit.rl`` (``rl.assembly.build_rl``): 1-4 ``dynamic_sampling.collect`` (sampler,
reference / old log-probs and values, scores); 5 ``estimator`` (``ppo.advantage_estimator`` in the registry
``rl.algorithms``); 6 ``updater.update`` (epochs x global minibatches x micro-batches, clipped steps);
7 ``sampler.sync``, the KL controller, the metrics: to the loggers with step = PPO iteration and, via
``self.log_dict(logger=False)``, to ``trainer.callback_metrics`` for ``ModelCheckpoint(monitor=...)`` and
``EarlyStopping`` (one training step = one iteration). A resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, fields
from typing import Literal

import lightning as L
import torch

from rlhf_lit import metrics as M
from rlhf_lit.callbacks import HFExport, PPOCurves, RewardHackingMonitor, RolloutSamples, unless_configured
from rlhf_lit.callbacks.checkpoints import periodic_checkpoint
from rlhf_lit.models.backbone import BackboneConfig
from rlhf_lit.models.export import save_causal_lm
from rlhf_lit.models.reward_source import RewardModelConfig
from rlhf_lit.models.sharded_load import fill_from_checkpoint, weights_deferred
from rlhf_lit.modules.common import (
    OptimizerConfig,
    attached_trainer,
    build_optimizer,
    build_scheduler,
    log_data_report,
    peak_memory_mb,
    plain_hparams,
    writes_exports,
)
from rlhf_lit.parallel import data_parallel_mesh, is_distributed, shard_head, shard_lm
from rlhf_lit.ranges import as_config, check_arguments, parse_range
from rlhf_lit.rewards import RewardSourceConfig
from rlhf_lit.rl.assembly import (
    TrainerHooks,
    build_rl,
    optimizer_groups,
    optimizer_steps_per_iteration,
    schedule_steps,
)
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.loading import PPOSettings, build_models
from rlhf_lit.rl.sampler import Sampler, build_sampler
from rlhf_lit.rl.schedule import epoch_schedule
from rlhf_lit.rl.settings import (
    CriticConfig,
    KLConfig,
    MonitorConfig,
    PPOConfig,
    PTXConfig,
    RewardShapingConfig,
    check_batch_sizes,
    refuse_sharded_settings,
)
from rlhf_lit.rl.stats import all_stats, global_kl_per_response, peak_memory
from rlhf_lit.rl.update import UpdateBatch, clip_global_grad_norm
from rlhf_lit.rng import gather_rng_states, get_rng_state, start_rank_stream

__all__ = ["PPOModule"]


class PPOModule(L.LightningModule):
    """PPO with actor, critic and reference on one base (LoRA adapters), under manual optimization.

    Args:
        backbone: the policy's base (normally the SFT export) and how it is held; ``backbone.lora``: the actor
            adapter (required: the reference is the base with adapters off). An adapter-only SFT export (QLoRA)
            loads as its base plus that adapter, frozen beneath actor and critic and on in the reference.
        reward_model: the frozen reward model (a separate model or an adapter on this base), or a list of
            weighted reward sources (reward models and ``module:function`` reward functions, e.g.
            ``rlhf_lit.rewards:instruction_constraints``), each logged as ``rollout/score/<name>``.
        sampling, ppo: how responses are sampled; the update, advantage estimator (a critic-free one: no critic),
            loss aggregation, KL placement.
        kl, reward: the KL penalty and its controller; score normalisation, clipping, the missing-EOS penalty.
        critic, optimizer: the critic adapter and value head; optimizer and schedule (``lr`` the actor's).
        ptx, monitor: the optional pretraining-mix term; the reward-hacking monitors (on by default).
        log_samples_every: write a table of sampled prompts, responses and scores to TensorBoard text
            every this many iterations (0 disables; ``rlhf_lit.callbacks.RolloutSamples``).
        export_dir, export_mode: the final policy in HF format with ``ppo_curves.png`` (null: neither); how.
        rollout_batch_size: prompts per rollout per rank; linked by the CLI from ``data.init_args.batch_size``
            (not set in YAML); sizes the learning-rate schedule. Default: the trainer's data module's.
        sampler, schedule, refill_prompts (from Python only, not config keys): a factory ``(sampling, stop_ids,
            pad_token_id) -> Sampler``, default ``rl.sampler.build_sampler``; the minibatch schedule, default
            ``rl.schedule.epoch_schedule``; dynamic sampling's prompts, default ``rl.assembly.training_prompts``.
        packing: the policy's forwards (actor, critic, reference) padding-free (``ActorCritic``; docs/scale.md).
    """

    ARG_RANGES = {"log_samples_every": parse_range("int >= 0")}  # its plain arguments' ranges (CLI and __init__)

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
        refill_prompts: Callable[[int, int, int], dict] | None = None,
        packing: bool = False,
    ) -> None:
        super().__init__()
        check_arguments(self.ARG_RANGES, {"log_samples_every": log_samples_every})
        settings = st = PPOSettings.build(backbone, reward_model, sampling, ppo, kl, reward, critic, ptx)
        self.backbone_cfg, self.reward_model_cfg, self.critic_cfg = st.backbone, st.reward_model, st.critic
        self.sampling, self.ppo, self.kl_cfg, self.shaping = st.sampling, st.ppo, st.kl, st.reward
        self.ptx_cfg, self.optim_cfg = st.ptx, as_config(OptimizerConfig, optimizer) or OptimizerConfig()
        self.monitor_cfg = as_config(MonitorConfig, monitor) or MonitorConfig()
        # Every switch (PPO-Max tricks included) is recorded, as plain dicts so checkpoints load weights-only.
        self.save_hyperparameters(
            plain_hparams(
                type(self),
                **settings.hparams(),
                optimizer=self.optim_cfg,
                monitor=self.monitor_cfg,
                log_samples_every=log_samples_every,
                export_dir=export_dir,
                export_mode=export_mode,
                packing=packing,
            )
        )
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold adapters and heads only, not the frozen base
        # rollout_batch_size is derived from the data, so not a hyper-parameter
        self.export_dir, self.export_mode, self.rollout_batch_size = export_dir, export_mode, rollout_batch_size
        with torch.device("cpu") if (deferred := weights_deferred()) else nullcontext():  # FSDP2: base on meta
            models = build_models(settings, packing, deferred)
            self.tokenizer, self.stop_ids, self.policy = models.tokenizer, models.stop_ids, models.policy
            self.reward_source, self._deferred_loads = models.reward_source, models.loads
            hooks = TrainerHooks(
                self.manual_backward, self.clip_global_norm, lambda: (self.optimizers(), self.lr_schedulers()),
                lambda: attached_trainer(self),
            )
            make_sampler, schedule = sampler or build_sampler, schedule or epoch_schedule
            rl = build_rl(settings, models, hooks, make_sampler, schedule, refill_prompts)
        for part in fields(rl):  # the components as attributes: kl_ctl, estimator, collector, updater, ...
            setattr(self, part.name, getattr(rl, part.name))
        self.iteration = 0
        self.history: list[dict[str, float]] = []
        self.last_rollout: dict[str, list] = {}
        self._pending_rng: tuple[dict, list[dict] | None] | None = None

    def clip_global_norm(self, opt) -> float | None:
        """Global-norm clipping of each optimizer step (``rl.update.clip_global_grad_norm``)."""
        precision = str(self.trainer.precision)
        return clip_global_grad_norm(opt, self.ppo.max_grad_norm, precision, self.clip_gradients)

    def configure_model(self) -> None:
        """FSDP2 under ``ModelParallelStrategy``: shard the policy, its value head and a separate reward model
        (``rlhf_lit.parallel``; DDP wraps the whole module itself); then the models built on meta read their shards."""
        if (mesh := data_parallel_mesh(self.device_mesh)) is not None:
            refuse_sharded_settings(self.sampling)
            shard_lm(self.policy.lm, mesh)
            if self.policy.value_head is not None:
                shard_head(self.policy.value_head, mesh)
            if self.reward_source.scorer is not None:  # frozen: sharded to save memory; its head stays whole
                shard_lm(self.reward_source.scorer.lm, mesh)
        for lm, files in self._deferred_loads:  # built on meta (FSDP2): each rank reads its shards
            fill_from_checkpoint(lm, files)
        self._deferred_loads = []

    def optimizer_steps_per_iteration(self) -> int:
        """``ppo_epochs`` x minibatches per rollout (one minibatch when the rollout size is unknown)."""
        return optimizer_steps_per_iteration(self.ppo, self.sampling, self.rollout_prompts())

    def rollout_prompts(self) -> int | None:
        """Prompts per rollout per rank: ``rollout_batch_size`` (linked by the CLI), else the data module's."""
        if self.rollout_batch_size is not None:
            return self.rollout_batch_size
        return getattr(getattr(attached_trainer(self), "datamodule", None), "batch_size", None)

    def configure_optimizers(self):
        """One optimizer (``rl.assembly.optimizer_groups``), a schedule over every optimizer step of the run."""
        groups = optimizer_groups(self.policy, self.optim_cfg.lr, self.critic_cfg.lr)
        optimizer = build_optimizer(groups, self.optim_cfg, attached_trainer(self))
        batches, epochs = self.trainer.num_training_batches, self.trainer.max_epochs
        steps = schedule_steps(self.ppo, self.sampling, self.rollout_prompts(), batches, epochs)
        return [optimizer], [{"scheduler": build_scheduler(optimizer, self.optim_cfg, steps), "interval": "step"}]

    def configure_callbacks(self):
        """What the settings ask for: ``ppo.checkpoint_every``, ``monitor.enabled``, the ``log_samples_every`` table,
        the export and score / KL curves (``export_dir``); one of a class in ``trainer.callbacks`` wins."""
        settings = {k: v for k, v in asdict(self.monitor_cfg).items() if k != "enabled"}
        callbacks = periodic_checkpoint(self.ppo.checkpoint_every, attached_trainer(self))
        callbacks += [RewardHackingMonitor(**settings)] if self.monitor_cfg.enabled else []
        if self.hparams.log_samples_every:
            callbacks.append(RolloutSamples(every=self.hparams.log_samples_every))
        if self.export_dir:
            callbacks += [HFExport(), PPOCurves(target_kl=self.kl_cfg.target_kl)]
        return unless_configured(attached_trainer(self), callbacks)

    def on_fit_start(self) -> None:
        log_data_report(self)
        if prompts := self.rollout_prompts():
            check_batch_sizes(self.ppo, prompts, self.sampling.num_samples_per_prompt)

    def on_train_start(self) -> None:  # resumed: each rank's RNG as it was saved; a fresh run: the ranks draw apart
        start_rank_stream(*(self._pending_rng or (None, None)), self.trainer.global_rank, self.trainer.world_size)
        self._pending_rng = None

    # ------------------------------------------------------------------ the iteration
    def training_step(self, batch: dict, batch_idx: int) -> None:
        t0 = time.perf_counter()
        check_batch_sizes(self.ppo, batch["input_ids"].shape[0], self.sampling.num_samples_per_prompt)
        # 1-4. sampling, reference / old log-probs and values, scores (and dynamic sampling's extra rounds)
        rollout = self.dynamic_sampling.collect(batch, self.iteration)
        t1 = t0 + rollout.generation_s
        # 5. token rewards, advantages, returns
        kl_coef, kl_in_loss = self.kl_ctl.value, self.ppo.kl_in_loss()
        adv = self.estimator(rollout, 0.0 if kl_in_loss else kl_coef, is_distributed(self.trainer))
        t2 = time.perf_counter()
        # 6. PPO epochs over shuffled minibatches
        update_batch = UpdateBatch.from_rollout(rollout, adv, kl_coef if kl_in_loss else None)
        update_stats = self.updater.update(update_batch, self.iteration)
        t_sync = time.perf_counter()
        self.sampler.sync(self.policy)  # 7. the sampler sees the new weights (timed with the update, and alone)
        t3 = time.perf_counter()
        # KL controller (every rank moves beta alike); metrics
        self.kl_ctl.update(*global_kl_per_response(self.trainer, rollout))
        self.iteration += 1
        stats = all_stats(self.trainer, rollout, adv, update_stats, bool(self.stop_ids), (t0, t1, t2, t3))
        stats.update({M.PPO_ITERATION: self.iteration, M.PPO_KL_COEF: kl_coef, M.PERF_SYNC_S: t3 - t_sync})
        stats.update(peak_memory(peak_memory_mb()))
        self.last_rollout = rollout.as_text(self.tokenizer, rollout.prompt_ids)  # for RolloutSamples & co.
        self._log_iteration(stats)
        if self.ppo.total_iterations and self.iteration >= self.ppo.total_iterations:
            self.trainer.should_stop = True

    @torch.no_grad()
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """``val/score_mean``, ``val/kl_ref`` (k1, nats per response), ``val/response_len`` of responses to validation
        prompts (``RolloutCollector.validate``: an RNG forked from ``ppo.seed`` and the batch: repeatable)."""
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
        keys = {"iter": M.PPO_ITERATION, "score": M.ROLLOUT_SCORE_MEAN, "kl": M.ROLLOUT_KL_REF}
        progress = {short: values[name] for short, name in keys.items()}
        self.log_dict(progress, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)
        if self.trainer.is_global_zero:
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
            "rng_ranks": gather_rng_states(),  # every rank's (a collective; None in one process)
            "history": self.history,
            **self.updater.state_dict(),  # consecutive_skips, ptx_consumed
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if (state := checkpoint.get("ppo_state")) is None:
            return
        self.iteration = state["iteration"]
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.score_stats.load_state_dict(state["score_stats"])
        self.history = list(state.get("history", []))
        self._pending_rng = (state["rng"], state.get("rng_ranks"))  # applied at on_train_start, after the rest
        self.updater.load_state_dict(state)  # the PTX stream moves past the batches already used

    def export(self, path: str) -> None:
        """The policy in HF format to ``path`` (``export_mode``); every rank calls it, ``writes_exports`` writes."""
        meta = {"kind": "policy", "stage": "ppo", "iterations": self.iteration}
        meta.update(sampling=asdict(self.sampling), target_kl=self.kl_cfg.target_kl)
        save_causal_lm(self.policy.lm, self.tokenizer, path, self.backbone_cfg, self.export_mode, "actor", meta,
                       writes_exports(self))
