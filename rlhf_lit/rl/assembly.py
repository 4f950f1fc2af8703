"""The RL core's components assembled from typed settings and models, without the LightningModule.

:func:`build_rl` builds every component of an iteration (KL controller, estimator, objective, score statistics,
sampler, collector, dynamic sampling, updater) from the run's settings (``rl.loading.PPOSettings``), what
``rl.loading.build_models`` loaded and the trainer's callables (:class:`TrainerHooks`), and returns them as one
:class:`RLComponents`. Nothing is set on a component afterwards: what is only known at fit (the trainer's
precision, its loader, its optimizers) is read through the hooks when it is needed. The optimizer's groups and
the learning-rate schedule's length are here too (:func:`optimizer_groups`, :func:`schedule_steps`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from rlhf_lit.data.ptx import PTXStream
from rlhf_lit.errors import ConfigError
from rlhf_lit.models.policy import ActorCritic
from rlhf_lit.rl.algorithms import AlgorithmSpec
from rlhf_lit.rl.dynamic_sampling import DatasetPrompts, DynamicSampling, PromptSource
from rlhf_lit.rl.estimators import AdvantageEstimator
from rlhf_lit.rl.filters import FilterSettings
from rlhf_lit.rl.generation import GAP_TOLERANCE, SamplingConfig
from rlhf_lit.rl.kl_control import KLController, build_kl_controller
from rlhf_lit.rl.loading import PPOModels, PPOSettings, describe_reward_source
from rlhf_lit.rl.objectives import PPOObjective
from rlhf_lit.rl.reward_norm import RunningMeanStd, ScoreShaper
from rlhf_lit.rl.rollout import RolloutCollector, RolloutSettings
from rlhf_lit.rl.sampler import Sampler, build_sampler
from rlhf_lit.rl.schedule import epoch_schedule
from rlhf_lit.rl.settings import PPOConfig
from rlhf_lit.rl.update import PPOUpdater, UpdateSettings

__all__ = [
    "RLComponents",
    "TrainerHooks",
    "build_rl",
    "optimizer_groups",
    "optimizer_steps_per_iteration",
    "rollout_settings",
    "schedule_steps",
    "training_prompts",
    "update_settings",
]


@dataclass(frozen=True)
class TrainerHooks:
    """The trainer's side of an iteration, as callables (so no component holds the LightningModule).

    Attributes:
        backward: ``backward(loss)`` (``manual_backward``); clip: ``clip(opt) -> norm`` before clipping.
        optimizers: ``() -> (optimizer, lr scheduler)``.
        world: ``() -> trainer`` (or None outside one): rank, world size, collectives, precision, loaders.
    """

    backward: Callable[[Any], Any]
    clip: Callable[[Any], float | None]
    optimizers: Callable[[], tuple[Any, Any]]
    world: Callable[[], Any] = lambda: None


@dataclass(frozen=True)
class RLComponents:
    """One iteration's components (``rlhf_lit.rl``), built by :func:`build_rl`."""

    kl_ctl: KLController
    algorithm: AlgorithmSpec
    estimator: AdvantageEstimator
    objective: PPOObjective
    score_stats: RunningMeanStd
    sampler: Sampler
    collector: RolloutCollector
    dynamic_sampling: DynamicSampling
    updater: PPOUpdater


def rollout_settings(settings: PPOSettings, kl_estimator: str) -> RolloutSettings:
    """The collector's settings: ``sampling``, ``ppo``, ``reward`` (shaping), ``backbone``, ``reward_model``; the
    guard's tolerance for each dtype the policy may compute in (resolved at each rollout with the trainer's
    precision: ``RolloutSettings.gap_tolerance``)."""
    sampling, ppo, backbone = settings.sampling, settings.ppo, settings.backbone
    return RolloutSettings(
        temperature=sampling.temperature,
        num_samples_per_prompt=sampling.num_samples_per_prompt,
        forward_batch_size=ppo.rollout_forward_batch_size,
        logprob_chunk_size=ppo.logprob_chunk_size,
        kl_estimator=kl_estimator,
        merge_adapter=sampling.merge_adapter and not backbone.load_in_4bit,
        skip_non_finite=settings.reward.skip_non_finite,
        seed=ppo.seed,
        reward_description=describe_reward_source(settings.reward_model),
        logprob_gap_tolerances={dtype: sampling.gap_tolerance(dtype) for dtype in GAP_TOLERANCE},
        weights_dtype=backbone.dtype,
        strict_sync=sampling.strict_sync,
        tis_cap=ppo.tis_cap,
        filters=FilterSettings(
            tis_level=ppo.tis_level or "token",
            tis_mode=ppo.tis_mode or "truncate",
            mask_truncated=ppo.mask_truncated_completions,
            dynamic_sampling=ppo.dynamic_sampling,
        ),
    )


def build_rl(
    settings: PPOSettings,
    models: PPOModels,
    hooks: TrainerHooks,
    make_sampler: Callable[..., Sampler] = build_sampler,
    schedule: Callable = epoch_schedule,
    prompts: PromptSource | None = None,
) -> RLComponents:
    """Every component of an iteration (steps of ``rlhf_lit.rl``), each built with what it needs.

    Args:
        settings, models: the run's typed settings and what ``rl.loading.build_models`` loaded.
        hooks: the trainer's callables (backward, clipping, optimizers, the trainer itself).
        make_sampler: ``(sampling, stop_ids, pad_token_id) -> Sampler`` (``rl.sampler.build_sampler``).
        schedule: the minibatch schedule (``rl.schedule.epoch_schedule`` or one with its signature).
        prompts: dynamic sampling's extra prompts; default :func:`training_prompts` (the trainer's loader).
    """
    s, pad = settings, models.tokenizer.pad_token_id
    kl_ctl = build_kl_controller(s.kl.kl_coef, s.kl.adaptive, s.kl.target_kl, s.kl.horizon)
    algorithm = s.ppo.algorithm  # the registry entry of ppo.advantage_estimator
    estimator = algorithm.estimator(s.ppo, s.sampling.num_samples_per_prompt)  # step 5
    kl_estimator = s.kl.resolved_estimator(s.ppo.kl_in_loss())
    objective = PPOObjective.from_settings(s.ppo, kl_estimator)  # the loss of step 6
    score_stats = RunningMeanStd(distributed=True)
    sampler = make_sampler(s.sampling, models.stop_ids, pad)
    shaper = ScoreShaper(
        s.reward, score_stats, has_stop_token=bool(models.stop_ids), max_new_tokens=s.sampling.max_new_tokens
    )
    collector = RolloutCollector(
        models.policy,
        models.reward_source,
        sampler,
        shaper,
        rollout_settings(s, kl_estimator),
        models.tokenizer,
        hooks.world,
    )
    max_rounds = s.ppo.dynamic_sampling_max_rounds
    dynamic = DynamicSampling(
        collector, max_rounds, prompts or training_prompts(hooks.world, s.ppo.seed), pad
    )
    ptx = PTXStream(s.ptx, models.tokenizer, s.ppo.seed) if s.ptx.coef > 0 else None
    updater = PPOUpdater(
        models.policy,
        objective,
        update_settings(s.ppo, s.sampling),
        backward=hooks.backward,
        clip=hooks.clip,
        optimizers=hooks.optimizers,
        world=hooks.world,
        schedule=schedule,
        ptx_stream=ptx,
        ptx_coef=s.ptx.coef,
    )
    return RLComponents(
        kl_ctl, algorithm, estimator, objective, score_stats, sampler, collector, dynamic, updater
    )


def update_settings(ppo: PPOConfig, sampling: SamplingConfig) -> UpdateSettings:
    """The updater's settings (``rl.update.UpdateSettings``) from ``ppo`` and ``sampling``."""
    return UpdateSettings(
        ppo_epochs=ppo.ppo_epochs,
        ppo_minibatch_size=ppo.ppo_minibatch_size,
        micro_batch_size=ppo.micro_batch_size,
        seed=ppo.seed,
        logprob_chunk_size=ppo.logprob_chunk_size,
        entropy_coef=ppo.entropy_coef,
        loss_norm_constant=ppo.loss_norm_constant,
        max_consecutive_skips=ppo.max_consecutive_skips,
        aggregation=ppo.aggregation(),
        temperature=sampling.temperature,
        group_size=sampling.num_samples_per_prompt,
        max_new_tokens=sampling.max_new_tokens,
    )


def training_prompts(world: Callable[[], Any], seed: int) -> PromptSource:
    """The default prompts of dynamic sampling's extra rounds: ``rl.dynamic_sampling.DatasetPrompts`` over the
    dataset and ``collate_fn`` of the trainer's training loader (``seed``: ``ppo.seed``; the trainer's rank,
    world size and device), built at the first draw, when the loader exists.

    Raises:
        ConfigError: at the first draw, when the run is not fitting with one training loader of a dataset.
    """
    source: DatasetPrompts | None = None

    def draw(iteration: int, round: int, num_prompts: int) -> dict:
        nonlocal source
        if source is None:
            trainer = world()
            loader = getattr(trainer, "train_dataloader", None) if trainer is not None else None
            if not hasattr(loader, "dataset") or not hasattr(loader, "collate_fn"):
                raise ConfigError(
                    "ppo.dynamic_sampling_max_rounds draws more prompts from the training loader's dataset, but "
                    f"the trainer has no single training DataLoader (got {type(loader).__name__}); pass "
                    "PPOModule(refill_prompts=...) or set ppo.dynamic_sampling_max_rounds: 0"
                )
            rank, world_size, device = trainer.global_rank, trainer.world_size, trainer.strategy.root_device
            source = DatasetPrompts(loader.dataset, loader.collate_fn, seed, rank, world_size, device)
        return source(iteration, round, num_prompts)

    return draw


def optimizer_steps_per_iteration(ppo: PPOConfig, sampling: SamplingConfig, prompts: int | None) -> int:
    """``ppo_epochs`` x minibatches per rollout (one minibatch when the rollout size is unknown)."""
    rollout = prompts * sampling.num_samples_per_prompt if prompts else ppo.ppo_minibatch_size
    return ppo.ppo_epochs * max(1, rollout // ppo.ppo_minibatch_size)


def optimizer_groups(policy: ActorCritic, lr: float, critic_lr: float | None) -> list[dict]:
    """The optimizer's parameter groups: the actor adapter at ``lr``; the critic adapter and value head (when the
    algorithm has a critic) at ``critic.lr`` (default ``lr``)."""
    groups = [{"params": policy.actor_parameters(), "lr": lr}]
    if policy.has_critic:
        groups.append({"params": policy.critic_parameters(), "lr": critic_lr or lr})
    return groups


def schedule_steps(
    ppo: PPOConfig, sampling: SamplingConfig, prompts: int | None, batches: float, max_epochs: int | None
) -> int:
    """The learning-rate schedule's length in optimizer steps: iterations (``ppo.total_iterations``, else the
    trainer's ``batches`` x ``max_epochs``; 1000 for an endless loader) x :func:`optimizer_steps_per_iteration`.
    Warns when the rollout size (``prompts``) is unknown: the schedule then assumes one minibatch per rollout."""
    if prompts is None:  # plain dataloaders: their batch size is not known when the optimizer is built
        rank_zero_warn(
            "PPOModule: rollout_batch_size is not set and there is no data module with a `batch_size`, so "
            f"the learning-rate schedule assumes one minibatch per rollout ({ppo.ppo_minibatch_size} "
            "responses); with larger rollouts it ends early. Pass rollout_batch_size, a LightningDataModule "
            "(e.g. PromptDataModule) or use optimizer.scheduler: constant."
        )
    if ppo.total_iterations:
        iterations = ppo.total_iterations
    else:
        epochs = max(1, max_epochs or 1)
        iterations = int(batches * epochs) if batches != float("inf") else 1000
    return iterations * optimizer_steps_per_iteration(ppo, sampling, prompts)
