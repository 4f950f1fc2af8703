"""A backbone's transformers config, read without its weights (for the memory planner and the CLI's checks).

``tiny`` dicts, a folder's ``config.json``, GGUF metadata, the ``rlhf_lit.json`` of an adapter-only export,
a cached hub config, or (offline, not cached) a small table of known architectures.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlhf_lit.models.backbone import BackboneConfig
from rlhf_lit.models.model_files import resolve_path

__all__ = ["KNOWN_ARCHITECTURES", "estimate_export_bytes", "read_architecture"]

# Architectures a hub id may name when its config cannot be read offline (published config.json values).
_LLAMA3_8B: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
KNOWN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "meta-llama/meta-llama-3-8b": _LLAMA3_8B,
    "meta-llama/llama-3.1-8b": {**_LLAMA3_8B, "max_position_embeddings": 131072},
    "mistralai/mistral-7b": {
        "model_type": "mistral",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32768,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "qwen/qwen2.5-7b": {
        "model_type": "qwen2",
        "num_hidden_layers": 28,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "huggingfacetb/smollm2-135m": {
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}


def read_architecture(backbone: BackboneConfig, model_config: str | None = None):
    """(transformers config, where it came from) for a backbone, reading no weights."""
    from transformers import AutoConfig

    if model_config:
        path = Path(model_config)
        spec = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        return AutoConfig.for_model(spec.pop("model_type"), **spec), f"--model-config {model_config}"
    if backbone.tiny is not None:
        from rlhf_lit.models.backbone import load_backbone_tokenizer
        from rlhf_lit.models.model_files import tiny_config

        return tiny_config(backbone, load_backbone_tokenizer(backbone)), "tiny config"
    name = backbone.name_or_path
    path = resolve_path(name)
    if os.path.isdir(path):
        meta_file = os.path.join(path, "rlhf_lit.json")
        if not os.path.exists(os.path.join(path, "config.json")) and os.path.exists(meta_file):
            base = json.loads(Path(meta_file).read_text()).get("base") or {}
            base = {**base, "lora": None}
            config, source = read_architecture(BackboneConfig(**base), None)
            return config, f"{source} (base of the export {name})"
        kwargs = {"gguf_file": backbone.gguf_file} if backbone.gguf_file else {}
        try:
            config = AutoConfig.from_pretrained(path, **kwargs)
        except (ValueError, OSError) as err:  # no config.json, an unknown model_type, a GGUF file not named
            from rlhf_lit.errors import ConfigError

            hint = "" if kwargs else " (a folder of GGUF files needs backbone.gguf_file)"
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"backbone.name_or_path={name!r}: no model config in {path}: {reason}{hint}") from err
        return config, f"{'GGUF metadata' if kwargs else 'config.json'} in {path}"
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True), f"cached hub config {name}"
    except Exception:  # noqa: BLE001 - offline and not cached: fall through to the table
        pass
    key = name.lower()
    for known, spec in KNOWN_ARCHITECTURES.items():
        if key.startswith(known):
            spec = dict(spec)
            return AutoConfig.for_model(
                spec.pop("model_type"), **spec
            ), f"built-in table entry {known!r} (offline)"
    raise ValueError(
        f"cannot read the config of {name!r} offline and it is not in the planner's table; "
        "pass --model-config <config.json>"
    )


def estimate_export_bytes(backbone: dict[str, Any] | None) -> int | None:
    """A merged export's size in bytes (parameters x bytes per parameter of the backbone's ``dtype``), counted
    on the meta device from the architecture alone (no weights); None when the architecture cannot be read or
    the base is 4-bit (its export holds only the adapter). For the free-space check before training
    (:class:`rlhf_lit.outputs.RunOutputs`)."""
    if not backbone or backbone.get("load_in_4bit"):
        return None
    try:
        import torch
        from transformers import AutoModelForCausalLM

        cfg = BackboneConfig(**{k: v for k, v in backbone.items() if k != "lora"})
        config, _ = read_architecture(cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        per_param = {"float32": 4, "bfloat16": 2, "float16": 2}.get(cfg.dtype, 4)
        return int(sum(p.numel() for p in model.parameters()) * per_param)
    except Exception:  # noqa: BLE001 - an estimate only: a model that cannot be read is not checked
        return None
