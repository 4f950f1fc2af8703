"""Lengths fit the model: ``max_length`` (PPO: prompt limit + ``max_new_tokens``) within its positions."""

from __future__ import annotations

from typing import Any

from rlhf_lit.checks.rules import get
from rlhf_lit.errors import ConfigError

__all__ = ["check_data_fits_model", "check_lengths", "model_config", "model_positions"]


def model_config(backbone: dict | Any) -> Any | None:
    """A backbone's transformers config, read without weights; None if unknown (a hub id not cached offline,
    a GGUF file, a folder that does not exist yet)."""
    from dataclasses import asdict, is_dataclass

    from rlhf_lit.models.architecture import read_architecture
    from rlhf_lit.models.backbone import BackboneConfig

    spec = asdict(backbone) if is_dataclass(backbone) else dict(backbone or {})
    if spec.get("gguf_file"):
        return None  # reading a GGUF file's metadata takes seconds (its whole vocabulary); the load will tell
    try:
        config, _ = read_architecture(BackboneConfig(**{**spec, "lora": None}), None)
    except Exception:  # noqa: BLE001 - unknown here; the model load will say what is wrong
        return None
    return config


def model_positions(backbone: dict | Any) -> int | None:
    """The most positions (tokens) a backbone's model takes, read from its config (no weights); None if
    unknown (:func:`model_config`, or a config without a position limit)."""
    config = model_config(backbone)
    if config is None:
        return None
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_lengths(stage: Any, init: dict, data: dict) -> None:
    """A stage that generates (:attr:`~rlhf_lit.stages.StageSpec.generates`): prompt limit + ``max_new_tokens``
    within the model's positions; any other: ``data.max_length``."""
    from rlhf_lit.rl.generation import SamplingConfig
    from rlhf_lit.rl.settings import PTXConfig

    backbone = init.get("backbone")
    if not backbone:
        return
    positions = model_positions(backbone)
    if positions is None:
        return
    if not stage.generates:
        max_length = data.get("max_length")
        if isinstance(max_length, int) and max_length > positions:
            raise ConfigError(
                f"data.init_args.max_length ({max_length}) exceeds the model's {positions} positions "
                f"(max_position_embeddings of model.init_args.backbone); set max_length <= {positions}"
            )
        return
    new_tokens = get(init, "sampling.max_new_tokens", SamplingConfig.max_new_tokens)
    limit = data.get("max_prompt_length") or data.get("pad_to_length")
    if limit is not None and limit + new_tokens > positions:
        raise ConfigError(
            f"data.init_args.max_prompt_length ({limit}) + model.init_args.sampling.max_new_tokens ({new_tokens}) "
            f"= {limit + new_tokens} tokens exceed the policy's {positions} positions; lower one of them"
        )
    ptx_length = get(init, "ptx.max_length")
    if get(init, "ptx.coef", PTXConfig.coef) > 0 and ptx_length and ptx_length > positions:
        raise ConfigError(
            f"model.init_args.ptx.max_length ({ptx_length}) exceeds the policy's {positions} positions"
        )


def check_data_fits_model(model: Any, datamodule: Any) -> None:
    """After the data is read: a reward model gets pairs; PPO prompts without a length limit leave room for
    the response.

    Raises:
        ConfigError: if a stage that trains on pairs gets unpaired data, or the longest prompt plus
            ``sampling.max_new_tokens`` exceeds the policy's positions.
    """
    from rlhf_lit.stages import find_stage

    stage = find_stage(type(model))
    if getattr(datamodule, "unpaired", False) and stage is not None and stage.trains_on_pairs:
        raise ConfigError(
            f"data: the preference files hold unpaired (KTO-style) completions, but {type(model).__name__} trains "
            "on pairs; "
            "set data.init_args.pair_unpaired: true to pair each desirable completion with the undesirable ones "
            "of the same prompt"
        )
    if getattr(datamodule, "unpaired", None) is not None and stage is not None and stage.name == "dpo":
        from rlhf_lit.modules.dpo import check_data_kind

        check_data_kind(model.loss_type, datamodule.unpaired)  # KTO needs unpaired rows, the others pairs
    sampling = getattr(model, "sampling", None)
    backbone = getattr(model, "backbone_cfg", None)
    dataset = getattr(datamodule, "train_dataset", None)
    if (
        sampling is None
        or backbone is None
        or dataset is None
        or getattr(datamodule, "stage", "") != "prompt"
    ):
        return
    if getattr(datamodule, "max_prompt_length", None) is not None and datamodule.max_prompt_length < 1 << 30:
        return  # checked before loading (check_config)
    positions = model_positions(backbone)
    if positions is None:
        return
    splits = [dataset] + ([datamodule.val_dataset] if datamodule.val_dataset is not None else [])
    longest = max((len(e["prompt_ids"]) for split in splits for e in split.examples), default=0)
    if longest + sampling.max_new_tokens > positions:
        raise ConfigError(
            f"the longest prompt ({longest} tokens) + model.init_args.sampling.max_new_tokens "
            f"({sampling.max_new_tokens}) exceed the policy's {positions} positions; set "
            f"data.init_args.max_prompt_length <= {positions - sampling.max_new_tokens} (prompts are cut from the left)"
        )
