"""What ``PPOModule.__init__`` builds from its configs: the models (tokenizer, stop tokens, the shared base with
actor and critic adapters, the reward source) and the RL core's components."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from lightning.pytorch.utilities import rank_zero_warn

from rlhf_lit.errors import ConfigError
from rlhf_lit.generation import compute_dtype, resolve_stop_ids
from rlhf_lit.models.backbone import BackboneConfig, load_backbone_tokenizer
from rlhf_lit.models.export import save_causal_lm
from rlhf_lit.models.policy import ActorCritic
from rlhf_lit.models.reward_source import RewardModelConfig, RewardSource
from rlhf_lit.models.sharded_load import build_base, init_meta_adapters
from rlhf_lit.modules.common import as_config, attached_trainer, build_optimizer, build_scheduler
from rlhf_lit.modules.ppo_config import check_batch_sizes, check_overlong, check_stop_tokens
from rlhf_lit.reward_norm import RunningMeanStd, ScoreShaper
from rlhf_lit.rewards import MixedReward, RewardSourceConfig
from rlhf_lit.rl.dynamic_sampling import DatasetPrompts, DynamicSampling, PromptSource
from rlhf_lit.rl.filters import FilterSettings
from rlhf_lit.rl.kl_control import build_kl_controller
from rlhf_lit.rl.objectives import PPOObjective
from rlhf_lit.rl.rollout import RolloutCollector, RolloutSettings
from rlhf_lit.rl.sampler import Sampler
from rlhf_lit.rl.update import PPOUpdater, UpdateSettings

__all__ = [
    "build_components",
    "training_prompts",
    "check_sampling_engine",
    "build_models",
    "configure_optimizer",
    "export_policy",
    "hparams_of",
    "optimizer_steps_per_iteration",
    "reward_adapter_on_base",
    "reward_config",
    "rollout_prompts",
    "rollout_settings",
]


def reward_config(value) -> RewardModelConfig | list[RewardSourceConfig]:
    """``reward_model`` as given (a config, its dict form, or a list of either) as config objects."""
    if isinstance(value, (list, tuple)):
        return [as_config(RewardSourceConfig, entry) for entry in value]
    return as_config(RewardModelConfig, value)


def build_models(
    backbone: BackboneConfig, reward_cfg, sampling, shaping, critic_cfg, ppo, packing=False, deferred=False
):
    """``(tokenizer, stop_ids, policy, reward_source, loads)``: the policy is an ``ActorCritic`` on the loaded base,
    with a critic adapter and value head only when the algorithm declares ``needs_critic`` (the registry), no
    critic adapter under ``critic.shared_trunk``; the reward source is a ``RewardSource`` or, for a list, a
    ``MixedReward``. ``critic.init_from_reward`` (PPO-Max) starts the critic from the reward model. ``packing``:
    the policy's forwards run padding-free (``ActorCritic``). ``deferred`` (FSDP2: the module's
    ``weights_deferred()``): the policy's base and a separate reward model that can be read shard by shard are
    built on meta; ``loads`` lists each such ``(AdaptedLM, checkpoint files)`` for ``fill_from_checkpoint``
    after sharding (empty when all is loaded whole, as with a reward adapter on the policy's base).

    Raises:
        ValueError: a missing-EOS penalty or ``ppo.mask_truncated_completions`` without a stop token, an
            overlong buffer above ``max_new_tokens`` (before anything loads); ``init_from_reward`` with a reward list.
        SamplerEngineError: ``sampling.backend: vllm`` and its server does not answer (``check_sampling_engine``).
    """
    check_overlong(shaping.overlong_buffer, shaping.overlong_penalty, sampling.max_new_tokens)
    check_sampling_engine(sampling, backbone.lora)  # before any model loads
    tokenizer = load_backbone_tokenizer(backbone)
    stop_ids = resolve_stop_ids(sampling, tokenizer)
    check_stop_tokens(shaping.missing_eos_penalty, ppo.mask_truncated_completions, bool(stop_ids))
    # the base on meta, each rank fills its shards in configure_model; not under a reward adapter, which peft
    # would load onto the meta base's device
    empty = deferred and not reward_adapter_on_base(reward_cfg)
    base, files = build_base(backbone, tokenizer, empty)
    with_critic = ppo.needs_critic  # critic-free estimators: no critic adapter, no value head
    critic_lora = None if critic_cfg.shared_trunk or not with_critic else critic_cfg.lora
    if critic_lora is not None:
        critic_lora.dropout = 0.0  # log-probs and values must be exact (pitfall: dropout)
    policy = ActorCritic(base, backbone.lora, critic_lora, with_critic, packing)
    if files is not None:
        init_meta_adapters(policy.lm)
    if isinstance(reward_cfg, list):
        reward_source = MixedReward(
            reward_cfg,
            tokenizer,
            lambda cfg: RewardSource(as_config(RewardModelConfig, cfg), tokenizer, policy.lm, backbone),
        )
    else:
        reward_source = RewardSource(reward_cfg, tokenizer, policy.lm, backbone, empty)
    if critic_cfg.init_from_reward:  # PPO-Max; a reward adapter on this base starts the critic adapter
        if isinstance(reward_source, MixedReward):
            raise ValueError("critic.init_from_reward needs one reward model, not a reward_model list")
        in_base = reward_source.scorer is None
        head = reward_source.head if in_base else reward_source.scorer.head
        policy.start_critic_from(head, "reward" if in_base else None)
    loads = [(policy.lm, files)] if files is not None else []
    scorer = getattr(reward_source, "scorer", None)
    if scorer is not None and scorer.checkpoint_files is not None:
        loads.append((scorer.lm, scorer.checkpoint_files))
    return tokenizer, stop_ids, policy, reward_source, loads


def reward_adapter_on_base(reward_cfg) -> bool:
    """Whether the reward model, or a reward model of a ``reward_model`` list, is an adapter on the policy's base."""
    if isinstance(reward_cfg, list):
        models = [as_config(RewardModelConfig, c.model) for c in reward_cfg if c.model is not None]
        return any(m.mode == "adapter" for m in models)
    return reward_cfg.mode == "adapter"


def check_sampling_engine(sampling, lora=None) -> None:
    """With ``sampling.backend: vllm``, ask the engine's server for ``/health`` (``build_models`` calls it first,
    so an engine that is not running costs no model load); with ``sampling.vllm.weight_sync: lora``, check that
    it serves adapters of the actor's rank ``lora.r`` (``backbone.lora``).

    Raises:
        SamplerEngineError: the server is not reachable, speaks another protocol, or (``weight_sync: lora``)
            was started without ``--enable-lora`` or with a ``--max-lora-rank`` below ``lora.r`` (one line).
    """
    if sampling.backend != "vllm":
        return
    from rlhf_lit.errors import SamplerEngineError
    from rlhf_lit.rl.vllm_client import VLLMClient

    health = VLLMClient(sampling.vllm.url, sampling.vllm.timeout_s).health()
    rank, served = (lora.r if lora is not None else 0), health.get("max_lora_rank")
    if sampling.vllm.weight_sync == "lora" and (served is None or served < rank):
        started = "without --enable-lora" if served is None else f"with --max-lora-rank {served}"
        enough = 1 << max(3, (rank - 1).bit_length())  # vLLM's ranks: 1, 8, 16, 32, ...
        raise SamplerEngineError(
            f"sampling.vllm.weight_sync: lora, but the vLLM server at {sampling.vllm.url} was started {started}; "
            f"restart it with `rlhf-lit vllm-serve ... --enable-lora --max-lora-rank {enough}` "
            f"(>= backbone.lora.r = {rank}), or use weight_sync: merged"
        )


def prepare_fit(module) -> None:
    """At fit start: check the batch sizes when the rollout size is known (``check_batch_sizes``), and set the
    rollout-policy guard's tolerance for the dtype the forwards compute in, now that the trainer's precision is
    known (``generation.compute_dtype``; ``sampling.logprob_gap_tolerance`` when set).

    Raises:
        ValueError: the minibatch sizes do not divide the rollout (``check_batch_sizes``).
    """
    if rollout_prompts(module):
        check_batch_sizes(module.ppo, rollout_prompts(module), module.sampling.num_samples_per_prompt)
    compute = compute_dtype(str(module.trainer.precision), module.backbone_cfg.dtype)
    module.collector.settings.logprob_gap_tolerance = module.sampling.gap_tolerance(compute)


def rollout_settings(module, kl_estimator: str) -> RolloutSettings:
    """The collector's settings from the module's configs (``sampling``, ``ppo``, ``shaping``, ``backbone_cfg``,
    ``reward_model_cfg``)."""
    sampling, ppo = module.sampling, module.ppo
    return RolloutSettings(
        temperature=sampling.temperature,
        num_samples_per_prompt=sampling.num_samples_per_prompt,
        forward_batch_size=ppo.rollout_forward_batch_size,
        logprob_chunk_size=ppo.logprob_chunk_size,
        kl_estimator=kl_estimator,
        merge_adapter=sampling.merge_adapter and not module.backbone_cfg.load_in_4bit,
        skip_non_finite=module.shaping.skip_non_finite,
        seed=ppo.seed,
        reward_description=describe_reward_source(module.reward_model_cfg),
        # the trainer's precision is known at fit: PPOModule.on_fit_start resolves it again with it
        logprob_gap_tolerance=sampling.gap_tolerance(compute_dtype(None, module.backbone_cfg.dtype)),
        strict_sync=sampling.strict_sync,
        tis_cap=ppo.tis_cap,
        filters=FilterSettings(
            tis_level=ppo.tis_level or "token",
            tis_mode=ppo.tis_mode or "truncate",
            mask_truncated=ppo.mask_truncated_completions,
            dynamic_sampling=ppo.dynamic_sampling,
        ),
    )


def build_components(
    module, make_sampler: Callable[..., Sampler], schedule: Callable, prompts: PromptSource | None = None
) -> None:
    """The RL core's components (``rlhf_lit.rl``) on the PPO module, each built with what it needs
    (the module's configs, models and its ``manual_backward`` / clipping / optimizers as callables), never with
    the module itself: ``kl_ctl``, ``algorithm``, ``estimator``, ``objective``, ``score_stats``, ``sampler``,
    ``collector``, ``dynamic_sampling`` (its extra rounds' prompts from ``prompts``, else
    :func:`training_prompts`), ``updater``."""
    module.kl_ctl = build_kl_controller(
        module.kl_cfg.kl_coef, module.kl_cfg.adaptive, module.kl_cfg.target_kl, module.kl_cfg.horizon
    )
    module.algorithm = module.ppo.algorithm  # the registry entry of ppo.advantage_estimator
    module.estimator = module.algorithm.estimator(
        module.ppo, module.sampling.num_samples_per_prompt
    )  # step 5
    kl_estimator = module.kl_cfg.resolved_estimator(module.ppo.kl_in_loss())
    module.objective = PPOObjective.from_settings(module.ppo, kl_estimator)  # the loss of step 6
    module.score_stats = RunningMeanStd(distributed=True)
    module.sampler = make_sampler(module.sampling, module.stop_ids, module.tokenizer.pad_token_id)
    settings = rollout_settings(module, kl_estimator)
    shaper = ScoreShaper(
        module.shaping,
        module.score_stats,
        has_stop_token=bool(module.stop_ids),
        max_new_tokens=module.sampling.max_new_tokens,
    )

    def world():  # the trainer, when attached (collectives)
        return attached_trainer(module)

    module.collector = RolloutCollector(
        module.policy, module.reward_source, module.sampler, shaper, settings, module.tokenizer, world
    )
    module.dynamic_sampling = DynamicSampling(
        module.collector,
        module.ppo.dynamic_sampling_max_rounds,
        prompts or training_prompts(module),
        module.tokenizer.pad_token_id,
    )
    module.updater = PPOUpdater(
        module.policy,
        module.objective,
        UpdateSettings.from_configs(module.ppo, module.sampling),
        backward=module.manual_backward,
        clip=module.clip_global_norm,
        optimizers=lambda: (module.optimizers(), module.lr_schedulers()),
        world=world,
        schedule=schedule,
    )


def training_prompts(module) -> PromptSource:
    """The default prompts of dynamic sampling's extra rounds: ``rl.dynamic_sampling.DatasetPrompts`` over the
    dataset and ``collate_fn`` of the trainer's training loader (``ppo.seed``, the trainer's rank and world size,
    the module's device), built at the first draw, when the loader exists.

    Raises:
        ConfigError: at the first draw, when the module is not fitting with one training loader of a dataset.
    """
    source: DatasetPrompts | None = None

    def draw(iteration: int, round: int, num_prompts: int) -> dict:
        nonlocal source
        if source is None:
            trainer = attached_trainer(module)
            loader = getattr(trainer, "train_dataloader", None) if trainer is not None else None
            if not hasattr(loader, "dataset") or not hasattr(loader, "collate_fn"):
                raise ConfigError(
                    "ppo.dynamic_sampling_max_rounds draws more prompts from the training loader's dataset, but "
                    f"the trainer has no single training DataLoader (got {type(loader).__name__}); pass "
                    "PPOModule(refill_prompts=...) or set ppo.dynamic_sampling_max_rounds: 0"
                )
            rank, world = trainer.global_rank, trainer.world_size
            source = DatasetPrompts(loader.dataset, loader.collate_fn, module.ppo.seed, rank, world, module.device)
        return source(iteration, round, num_prompts)

    return draw


def hparams_of(module) -> dict:
    """The module's config objects by constructor argument (a reward list as plain dicts)."""
    reward = module.reward_model_cfg
    return dict(
        backbone=module.backbone_cfg,
        reward_model=[asdict(e) for e in reward] if isinstance(reward, list) else reward,
        sampling=module.sampling,
        ppo=module.ppo,
        kl=module.kl_cfg,
        reward=module.shaping,
        critic=module.critic_cfg,
        optimizer=module.optim_cfg,
        ptx=module.ptx_cfg,
        monitor=module.monitor_cfg,
    )


def rollout_prompts(module) -> int | None:
    """Prompts per rollout per rank: ``rollout_batch_size`` (linked by the CLI at parse time), else (a module
    built in Python) the batch size of the trainer's data module, else None."""
    if module.rollout_batch_size is not None:
        return module.rollout_batch_size
    return getattr(getattr(attached_trainer(module), "datamodule", None), "batch_size", None)


def optimizer_steps_per_iteration(ppo, sampling, prompts: int | None) -> int:
    """``ppo_epochs`` x minibatches per rollout (one minibatch when the rollout size is unknown)."""
    rollout = prompts * sampling.num_samples_per_prompt if prompts else ppo.ppo_minibatch_size
    return ppo.ppo_epochs * max(1, rollout // ppo.ppo_minibatch_size)


def total_iterations(module) -> int:
    """``ppo.total_iterations``, else the trainer's batches x epochs (1000 for an endless loader)."""
    if module.ppo.total_iterations:
        return module.ppo.total_iterations
    batches = module.trainer.num_training_batches
    epochs = max(1, module.trainer.max_epochs or 1)
    return int(batches * epochs) if batches != float("inf") else 1000


def configure_optimizer(module):
    """``configure_optimizers`` of the PPO module: one optimizer with parameter groups (actor; critic adapter
    and value head at ``critic.lr``) and its schedule over every optimizer step of the run."""
    optim_cfg, ppo = module.optim_cfg, module.ppo
    groups = [{"params": module.policy.actor_parameters(), "lr": optim_cfg.lr}]
    if module.policy.has_critic:
        groups.append(
            {"params": module.policy.critic_parameters(), "lr": module.critic_cfg.lr or optim_cfg.lr}
        )
    optimizer = build_optimizer(groups, optim_cfg, attached_trainer(module))
    prompts = rollout_prompts(module)
    if prompts is None:  # plain dataloaders: their batch size is not known yet when this runs
        rank_zero_warn(
            "PPOModule: rollout_batch_size is not set and there is no data module with a `batch_size`, so "
            f"the learning-rate schedule assumes one minibatch per rollout ({ppo.ppo_minibatch_size} "
            "responses); with larger rollouts it ends early. Pass rollout_batch_size, a LightningDataModule "
            "(e.g. PromptDataModule) or use optimizer.scheduler: constant."
        )
    steps = total_iterations(module) * optimizer_steps_per_iteration(ppo, module.sampling, prompts)
    scheduler = build_scheduler(optimizer, optim_cfg, steps)
    return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


def export_policy(module, path: str) -> None:
    """``PPOModule.export``: the actor adapter, merged or alone per ``export_mode``, in Hugging Face format
    (``rlhf_lit.models.export``); every rank calls it (a collective under FSDP2: the weights are gathered one
    FSDP unit at a time), rank 0 writes."""
    meta = {"kind": "policy", "stage": "ppo", "iterations": module.iteration}
    meta.update(sampling=asdict(module.sampling), target_kl=module.kl_cfg.target_kl)
    save_causal_lm(
        module.policy.lm,
        module.tokenizer,
        path,
        module.backbone_cfg,
        module.export_mode,
        adapter_name="actor",
        meta=meta,
        writer=getattr(attached_trainer(module), "is_global_zero", True),  # no trainer: one process
    )


def describe_reward_source(cfg) -> str:
    """The reward model as the config (``RewardModelConfig``) names it, for error messages."""
    if isinstance(cfg, list):
        return "reward_model (a list of " + ", ".join(e.function or "model" for e in cfg) + ")"
    if cfg.path is not None:
        return f"reward_model.path={cfg.path!r} (mode {cfg.mode})"
    return "reward_model.backbone (an untrained reward model built from config)"
