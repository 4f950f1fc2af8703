"""What the estimate depends on (:class:`RunSettings`), read from the configs by the CLI's own parser.

``read_settings`` stacks the ``--config`` files exactly as ``rlhf-lit fit`` does
(:func:`rlhf_lit.lightning_cli.parse_config`: every class's defaults filled in, links applied) and builds
the modules' own config dataclasses from the result, so a default changed in a module or a data module is
the planner's default too. An export folder that an earlier stage has not written yet (a PPO config naming
the SFT export as its base) is read from the config that writes it (``rlhf_lit.stage_outputs`` finds it),
parsed the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlhf_lit.models.backbone import BackboneConfig
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.stage_outputs import configs_root_of, not_written_yet, producing_config

__all__ = ["RunSettings", "read_settings", "settings_from_config"]

# Prompt length assumed for a PPO run whose prompts have no length limit (the data decides; a guess).
UNLIMITED_PROMPT_GUESS = 256
# ... and the sequence length of an SFT / reward data module that has no max_length (not ours).
UNKNOWN_SEQ_LEN_GUESS = 512


@dataclass
class RunSettings:
    """What the estimate depends on, read from the stacked configs (each field can be overridden)."""

    stage: str  # sft | reward | ppo | dpo
    backbone: BackboneConfig
    precision: str = "32-true"
    world_size: int = 1
    accelerator: str = "auto"  # trainer.accelerator: "cpu" adds the host process, not a CUDA context
    sharded: bool = False
    optimizer: str = "adamw"
    # sequences per micro-batch (SFT), pairs per batch (reward, paired DPO), completions per batch (KTO),
    # prompts per rollout (PPO)
    batch_size: int = 8
    rows_per_example: int = 1  # sequences in one forward per batch element: 2 for pairs (chosen + rejected)
    seq_len: int = 512  # T (SFT, reward, DPO)
    prompt_len: int = 256  # P (PPO)
    response_len: int | None = 48  # R (PPO); DPO: mean response tokens per row, None = unknown (bound: T - 1)
    ppo_micro_batch: int = 4
    rollout_forward_batch: int | None = None
    logprob_chunk: int | None = None
    entropy_coef: float = 0.0
    shared_critic: bool = False
    critic_lora: dict | None = None
    critic_free: bool = False  # a critic-free advantage estimator (PPO): no critic adapter, no value head
    samples_per_prompt: int = 1  # responses per prompt (PPO): the rollout holds batch_size x this
    sampling_copy_dtype: str | None = None  # PPO: the sampler's own copy of the weights (sampling.copy_dtype)
    reward_mode: str | None = None  # separate | adapter (PPO)
    reward_backbone: BackboneConfig | None = None
    reward_load_in_4bit: bool | None = None
    reward_dtype: str | None = None
    # DPO: the reference's no-grad forward runs every step (step), or only while reference_cache is first
    # written (cache), or never (None: a reference-free loss); reference_copy: it is a frozen copy of the weights
    reference: str | None = None
    reference_copy: bool = False
    trim_padding: bool = False  # DPO: rows run in length groups (the plan stays the worst batch's)
    packing: bool = False  # DPO: rows run padding-free (the plan stays the worst batch's)
    # glibc's mmap threshold fixed by trainer.callbacks' HeapTrim (bytes); None: glibc's dynamic threshold
    mmap_threshold: int | None = None
    accumulate_grad_batches: int = 1  # trainer.accumulate_grad_batches: > 1 keeps the gradients through backward


def read_settings(configs: list[str], cli_overrides: list[str] | None = None) -> RunSettings:
    """The settings of ``rlhf-lit fit --config <configs...> <cli_overrides...>`` (``--key=value`` arguments,
    applied after the files as ``fit`` applies them).

    Raises:
        ConfigError: for a setting ``fit`` would refuse before loading a model (``check_settings``: ranges,
            consistency, lengths; not the inputs, which an earlier stage may not have written yet).
    """
    from rlhf_lit.checks import check_settings

    spec = _parse(configs, cli_overrides)
    check_settings(spec)
    return settings_from_config(spec, configs_root_of(configs))


def _parse(configs: list[str], cli_overrides: list[str] | None = None) -> dict:
    from rlhf_lit.lightning_cli import parse_config

    return parse_config([str(c) for c in configs], cli_overrides)


def _stage(class_path: str) -> str:
    """The planner phase (``sft`` / ``reward`` / ``ppo``) of the model class's stage (:mod:`rlhf_lit.stages`;
    a subclass plans as its stage).

    Raises:
        ConfigError: if the class is no stage module, or its stage has no planner phase.
    """
    from rlhf_lit.errors import ConfigError
    from rlhf_lit.stages import stage_for

    stage = stage_for(class_path)
    if stage.planner_phase is None:
        raise ConfigError(
            f"plan: the planner does not support the {stage.title} stage ({class_path.rsplit('.', 1)[-1]}) yet; "
            "its memory is not modelled"
        )
    return stage.planner_phase


def _export_backbone(path: str, roots: list[Path]) -> BackboneConfig | None:
    """The backbone an export folder was (or will be) made from: its rlhf_lit.json, else the backbone of the
    stage config under ``configs/`` whose ``export_dir`` is that folder."""
    meta_file = Path(path) / "rlhf_lit.json"
    if meta_file.exists():
        base = json.loads(meta_file.read_text()).get("base")
        if base:
            return BackboneConfig(**{**base, "lora": None})
    found = producing_config(path, roots)
    if found is None:
        return None
    backbone = _parse([str(found[0])])["model"]["init_args"].get("backbone")
    if not backbone:
        return None
    backbone = BackboneConfig(**{**backbone, "lora": None})
    if backbone.name_or_path and not_written_yet(backbone.name_or_path):
        return _export_backbone(backbone.name_or_path, roots) or backbone
    return backbone


def settings_from_config(spec: dict, roots: list[Path] | None = None) -> RunSettings:
    """The stage, the model and the shapes that matter, from a parsed config (``parse_config``)."""
    from rlhf_lit.modules.common import OptimizerConfig
    from rlhf_lit.ranges import as_config

    roots = roots if roots is not None else configs_root_of(None)
    stage = _stage(spec["model"]["class_path"])  # first: a class that is no stage has none of the keys below
    init = spec["model"]["init_args"]
    backbone = BackboneConfig(**init["backbone"])
    if backbone.name_or_path and not_written_yet(backbone.name_or_path):
        found = _export_backbone(backbone.name_or_path, roots)
        if found is not None:  # where the weights come from; how they are held stays this run's
            source = {
                k: getattr(found, k) for k in ("name_or_path", "gguf_file", "tiny", "tokenizer", "seed")
            }
            backbone = BackboneConfig(**{**init["backbone"], **source})
    trainer = spec.get("trainer") or {}
    data = (spec.get("data") or {}).get("init_args") or {}
    strategy_name = json.dumps(trainer.get("strategy", "auto")).lower()
    devices = trainer.get("devices", 1)
    world = int(devices) if isinstance(devices, int) and devices > 0 else 1
    settings = RunSettings(
        stage=stage,
        backbone=backbone,
        precision=str(trainer.get("precision") or "32-true"),
        world_size=world * int(trainer.get("num_nodes") or 1),
        accelerator=str(trainer.get("accelerator") or "auto"),
        sharded=any(k in strategy_name for k in ("fsdp", "modelparallel")),
        optimizer=(as_config(OptimizerConfig, init.get("optimizer")) or OptimizerConfig()).name,
        batch_size=int(data.get("batch_size", 1)),
        seq_len=int(data.get("max_length") or UNKNOWN_SEQ_LEN_GUESS),
    )
    settings.mmap_threshold = _mmap_threshold(trainer.get("callbacks"))
    settings.accumulate_grad_batches = int(trainer.get("accumulate_grad_batches") or 1)
    if stage == "reward":
        settings.rows_per_example = 2
    if stage == "ppo":
        _ppo_settings(settings, init, data, roots)
    if stage == "dpo":
        _dpo_settings(settings, init)
    return settings


def _mmap_threshold(callbacks) -> int | None:
    """The ``mmap_threshold`` of a ``HeapTrim`` among the parsed ``trainer.callbacks``; None when none sets it."""
    for cb in callbacks or []:
        if isinstance(cb, dict) and str(cb.get("class_path", "")).rsplit(".", 1)[-1] == "HeapTrim":
            threshold = (cb.get("init_args") or {}).get("mmap_threshold")
            if threshold is not None:
                return int(threshold)
    return None


def _dpo_settings(settings: RunSettings, init: dict) -> None:
    """Rows per batch element and where the reference log-probs come from, from the module's own loss-type
    tables (a paired loss stacks chosen and rejected into one forward: ``rlhf_lit.modules.dpo.sequences``).

    Raises:
        ConfigError: for settings the module refuses (its own checks: e.g. ``reference_copy`` with LoRA).
    """
    from rlhf_lit.functional.preference import PAIRED_LOSS_TYPES, REFERENCE_FREE_LOSS_TYPES
    from rlhf_lit.modules.dpo import _check_settings

    loss_type, cache, copy = init["loss_type"], init["reference_cache"], init["reference_copy"]
    packing = init["packing"]
    _check_settings(settings.backbone, loss_type, init["label_smoothing"], cache, copy, packing)
    settings.rows_per_example = 2 if loss_type in PAIRED_LOSS_TYPES else 1
    settings.response_len = None  # the data decides: the estimate bounds it by T - 1
    free = loss_type in REFERENCE_FREE_LOSS_TYPES
    settings.reference = None if free else "cache" if cache else "step"
    settings.reference_copy = bool(copy) and not free
    settings.trim_padding = bool(init.get("trim_padding", True)) and not packing
    settings.packing = bool(packing)


def _ppo_settings(settings: RunSettings, init: dict, data: dict, roots: list[Path]) -> None:
    from rlhf_lit.models.reward_source import RewardModelConfig
    from rlhf_lit.ranges import as_config
    from rlhf_lit.rl.settings import CriticConfig, PPOConfig, refuse_impossible_settings

    ppo = as_config(PPOConfig, init.get("ppo")) or PPOConfig()
    sampling = as_config(SamplingConfig, init.get("sampling")) or SamplingConfig()
    refuse_impossible_settings(settings.backbone, sampling)  # what fit refuses is not planned either
    critic = as_config(CriticConfig, init.get("critic")) or CriticConfig()
    settings.prompt_len = int(
        data.get("max_prompt_length") or data.get("pad_to_length") or UNLIMITED_PROMPT_GUESS
    )
    settings.response_len = sampling.max_new_tokens
    settings.ppo_micro_batch = ppo.micro_batch_size or ppo.ppo_minibatch_size
    settings.rollout_forward_batch = ppo.rollout_forward_batch_size
    settings.logprob_chunk = ppo.logprob_chunk_size
    settings.entropy_coef = ppo.entropy_coef
    settings.shared_critic = critic.shared_trunk
    settings.critic_free = not ppo.needs_critic
    settings.samples_per_prompt = sampling.num_samples_per_prompt
    settings.sampling_copy_dtype = sampling.copy_dtype
    settings.critic_lora = {"r": critic.lora.r, "target_modules": critic.lora.target_modules}
    reward_model = init["reward_model"]
    if isinstance(reward_model, list):  # a list of reward sources: the planner counts its first model, if any
        models = [e.get("model") for e in reward_model if isinstance(e, dict) and e.get("model")]
        reward_model = models[0] if models else None
    if reward_model is None:  # reward functions only: no reward model to hold
        return
    reward_model = as_config(RewardModelConfig, reward_model)
    settings.reward_mode = reward_model.mode
    settings.reward_dtype = reward_model.dtype
    settings.reward_load_in_4bit = reward_model.load_in_4bit
    if reward_model.backbone is not None:
        settings.reward_backbone = BackboneConfig(**{**reward_model.backbone.to_dict(), "lora": None})
    elif reward_model.path and reward_model.mode == "separate":
        settings.reward_backbone = _export_backbone(reward_model.path, roots)
