"""The Hugging Face export of an FSDP2-sharded ``AdaptedLM``, streamed one FSDP unit at a time.

Every rank calls :func:`save_sharded_weights` (a collective); only the writer (rank 0) writes. For each FSDP unit
of the model (``rlhf_lit.parallel.fsdp_units``: one per transformer block, and the ``AdaptedLM`` unit holding the
embeddings, final norm and LM head), in the same order on every rank:

1. ``unit.unshard()`` gathers that unit's parameters, no other unit's;
2. the tensors it owns are exported: the merged weights (a LoRA layer's ``W + sum_a delta_a``, computed out of
   place by ``peft_compat.merged_lora_weight``: bit for bit peft's merge; every other tensor as it is) under the
   names ``save_pretrained`` writes, and the exported adapter's LoRA matrices (copied: they are small);
3. every rank checks them for inf / nan (``export.check_finite``), so all ranks raise at the same unit;
4. the writer writes the unit's merged weights as ``model-<i>-of-<n>.safetensors``, and every rank learns whether
   that write succeeded (one all-reduce of a flag), so a failed write raises on every rank too;
5. ``unit.reshard()``.

A rank holds its shards plus one unit's gathered parameters (and that unit's merged weights) at a time, never the
whole model. After the last unit the writer writes ``model.safetensors.index.json`` (``metadata.total_size``,
``weight_map``), ``config.json`` and ``generation_config.json`` (what ``save_pretrained`` writes beside the
weights) and ``adapter/`` through peft's ``save_pretrained`` with the collected LoRA matrices. On a failure the
writer removes the files it wrote (the export transaction, ``rlhf_lit.outputs``, drops its staging folder too).

The walk (steps 1, 2, 5: :func:`unit_weights`) and the writing of the weight files (step 4 and the index:
:func:`write_weight_files`) are the two pieces the vLLM sampler's weight push (``rl.vllm_sampler.VLLMSampler``) reuses.

Private APIs (checked against transformers 5.24; ``tests/test_library_contracts.py``): ``save_pretrained``'s
name handling, applied to each unit's tensors as transformers applies them to each shard of an offloaded model:
``modeling_utils.remove_tied_weights_from_state_dict`` (tied weights written once, under the name it keeps) and
``core_model_loading.revert_weight_conversion`` (names as the checkpoint had them); ``nn.Module._parameters`` /
``_buffers`` / ``_non_persistent_buffers_set`` (the tensors registered right now, as ``plain_state_dict``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field

import torch
from safetensors.torch import save_file
from torch import nn

from rlhf_lit.models.adapters import AdaptedLM
from rlhf_lit.models.peft_compat import merged_lora_weight
from rlhf_lit.parallel.fsdp import fsdp_units, is_sharded, transformer_blocks

INDEX_FILE = "model.safetensors.index.json"


@dataclass
class _Entry:
    """One tensor an FSDP unit owns: read from ``module`` after the unit is unsharded."""

    key: str
    module: nn.Module
    attr: str
    lora_layer: nn.Module | None = None  # the LoRA layer whose base weight this is: exported merged


@dataclass
class _UnitPlan:
    unit: nn.Module | None  # None: tensors outside every unit (plain tensors, nothing to gather)
    merged: list[_Entry] = field(default_factory=list)
    adapter: list[_Entry] = field(default_factory=list)


def _registered(root: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module, str]]:
    """``(state-dict key, module, attribute)`` of every parameter and persistent buffer under ``root``, tied
    ones under every name (as ``state_dict()`` lists them)."""
    out = []
    for name, sub in root.named_modules(remove_duplicate=False, prefix=prefix):
        dot = f"{name}." if name else ""
        out += [(dot + n, sub, n) for n, p in sub._parameters.items() if p is not None]
        out += [
            (dot + n, sub, n)
            for n, b in sub._buffers.items()
            if b is not None and n not in sub._non_persistent_buffers_set
        ]
    return out


def _plan(
    lm: AdaptedLM, adapter_name: str | None, write_merged: bool, write_adapter: bool
) -> list[_UnitPlan]:
    """What each FSDP unit exports, in unit order (tensors outside every unit last)."""
    from peft.tuners.lora import LoraLayer

    units, owner = fsdp_units(lm)
    if not units:  # not sharded: one transformer block at a time all the same (nothing to gather)
        try:
            blocks = {id(block) for block in transformer_blocks(lm.model)}
        except ValueError:  # blocks unknown (no _no_split_modules): the whole model as one piece
            blocks = set()
        units, owner = fsdp_units(lm, lambda sub: id(sub) in blocks)
    plans = {id(u): _UnitPlan(u) for u in units}
    loose = _UnitPlan(None)
    lora_of = {id(m.get_base_layer()): m for m in lm.model.modules() if isinstance(m, LoraLayer)}

    def plan_of(module: nn.Module) -> _UnitPlan:
        unit = owner.get(id(module))
        return loose if unit is None else plans[id(unit)]

    if write_merged:
        base = lm.model.get_base_model() if lm.is_peft else lm.model
        for key, module, attr in _registered(base):
            if "lora_" in key:
                continue
            layer = lora_of.get(id(module)) if attr == "weight" else None
            plan_of(module).merged.append(_Entry(key.replace(".base_layer.", "."), module, attr, layer))
    if write_adapter:
        for key, module, attr in _registered(lm.model):
            if "lora_" in key and f".{adapter_name}." in key:
                plan_of(module).adapter.append(_Entry(key, module, attr))
    return [p for p in [*(plans[id(u)] for u in units), loose] if p.merged or p.adapter]


def _value(entry: _Entry) -> torch.Tensor:
    if entry.lora_layer is not None and not entry.lora_layer.disable_adapters:
        return merged_lora_weight(entry.lora_layer)
    tensor = entry.module._parameters.get(entry.attr)
    return (tensor if tensor is not None else entry.module._buffers[entry.attr]).detach()


def _agree(failed: bool, device: torch.device, collective: bool) -> bool:
    """True when any rank ``failed`` (every rank calls it when ``collective``; otherwise, or on one process:
    ``failed``)."""
    import torch.distributed as dist

    if not collective or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return failed
    flag = torch.tensor([float(failed)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _unit_device(plan: _UnitPlan) -> torch.device:
    unit = plan.unit if plan.unit is not None else (plan.merged or plan.adapter)[0].module
    tensor = next(unit.parameters(), None)
    local = getattr(tensor, "to_local", None)
    return (local() if local is not None else tensor).device if tensor is not None else torch.device("cpu")


def flatten_adapter_folder(folder: str, name: str) -> None:
    """peft saves a non-default adapter in ``folder/<name>/``; move it up so the folder loads directly."""
    nested = os.path.join(folder, name)
    if os.path.isdir(nested):
        for entry in os.listdir(nested):
            os.replace(os.path.join(nested, entry), os.path.join(folder, entry))
        os.rmdir(nested)


@dataclass
class UnitWeights:
    """What one FSDP unit exports, read while the unit is gathered (:func:`unit_weights`).

    Attributes:
        merged: the unit's merged weights under the names ``save_pretrained`` writes (a tied weight once, in the
            unit that owns it); new tensors for a merged LoRA weight, the parameters themselves (detached, not
            copied: do not write into them) otherwise. Empty for a unit with nothing to export merged.
        adapter: the exported adapter's LoRA matrices of the unit (copied), by their peft state-dict keys.
        device: where the unit's tensors live (for the collectives that follow).
        index: the unit's 0-based place among the walk's units with merged weights; ``count`` their number.
        collective: whether the walk is a collective (the model is FSDP2-sharded: every rank walks it); a model
            that is not sharded is walked one transformer block at a time by its one writer.
    """

    merged: dict[str, torch.Tensor]
    adapter: dict[str, torch.Tensor]
    device: torch.device
    index: int = 0
    count: int = 0
    collective: bool = True


def unit_weights(
    lm: AdaptedLM, adapter_name: str | None, write_merged: bool, write_adapter: bool
) -> Iterator[UnitWeights]:
    """The walk of the module docstring (steps 1, 2 and 5): one :class:`UnitWeights` per FSDP unit of the
    sharded ``lm``, in the same order on every rank (a collective: every rank must draw every item). The unit is
    gathered while its item is held and resharded when the next one is drawn or the generator is closed (close
    it, ``contextlib.closing``, when leaving the loop early). LoRA layers are merged over their active adapters
    (none while adapters are disabled: ``AdaptedLM.reference`` without base adapters). An ``lm`` that is not
    sharded is walked the same way, its transformer blocks (``parallel.transformer_blocks``) taking the units'
    place, so one block's merged weights are held at a time; that walk is no collective.
    """
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    base = lm.model.get_base_model() if lm.is_peft else lm.model
    plans = _plan(lm, adapter_name, write_merged, write_adapter)
    files = [p for p in plans if p.merged]
    sharded = is_sharded(lm)
    for plan in plans:
        if sharded and plan.unit is not None:
            plan.unit.unshard()
        try:
            merged = {e.key: _value(e) for e in plan.merged}
            if merged:
                merged = revert_weight_conversion(base, remove_tied_weights_from_state_dict(merged, base))
            adapter = {e.key: _value(e).clone() for e in plan.adapter}
            index = files.index(plan) if plan.merged else 0
            yield UnitWeights(merged, adapter, _unit_device(plan), index, len(files), sharded)
        finally:
            if sharded and plan.unit is not None:
                plan.unit.reshard()


def write_weight_files(
    units: Iterator[UnitWeights],
    path: str,
    writer: bool,
    on_unit: Callable[[UnitWeights], None] = lambda unit: None,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write the merged weights of ``units`` (the generator :func:`unit_weights`) to ``path`` as Hugging Face
    sharded safetensors, ``model-<i>-of-<n>.safetensors`` per unit with merged weights and then
    ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``; written when any unit had merged
    weights); every rank calls it (one all-reduce of a flag per unit), the ``writer`` writes.

    Args:
        units: the walk; ``on_unit(unit)`` is called with each item on every rank before its file is written.
        path: an existing folder (the writer's).
        writer: whether this rank writes (rank 0).
        dtype: the dtype the tensors are written in (None: their own).

    Returns:
        The writer's written paths in order (the index last; ``[]`` on the other ranks).

    Raises:
        OSError: (or safetensors' ``SafetensorError``) the writer could not write a file; the other ranks raise
            ``RuntimeError`` at the same unit. The writer removes the files it wrote.
    """
    written: list[str] = []
    weight_map: dict[str, str] = {}
    total_size = 0
    try:
        with closing(units):
            for unit in units:
                on_unit(unit)
                error = None
                if writer and unit.merged:
                    name = f"model-{unit.index + 1:05d}-of-{unit.count:05d}.safetensors"
                    written.append(os.path.join(path, name))
                    try:
                        sizes = _write_file(unit.merged, written[-1], dtype)
                        weight_map.update(dict.fromkeys(sizes, name))
                        total_size += sum(sizes.values())
                    except Exception as err:  # every rank must learn of it before the next unit's collective
                        error = err
                if _agree(error is not None, unit.device, unit.collective):
                    if error is not None:
                        raise error
                    raise RuntimeError(f"the writer (rank 0) failed to write {path}; see its error")
        if writer and weight_map:
            index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
            written.append(os.path.join(path, INDEX_FILE))
            with open(written[-1], "w") as f:
                json.dump(index, f, indent=2)
    except BaseException:
        for file in written:
            if os.path.isfile(file):
                os.remove(file)
        raise
    return written


def save_sharded_weights(
    lm: AdaptedLM,
    path: str,
    adapter_name: str | None,
    write_merged: bool,
    write_adapter: bool,
    writer: bool,
    check_finite: Callable[[dict[str, torch.Tensor], str], None],
) -> None:
    """Write the weights of an FSDP2-sharded ``lm`` to ``path`` one unit at a time (module docstring); every
    rank calls it, the ``writer`` writes. The adapter ``adapter_name`` must be the active one.

    Writes (writer): ``model-<i>-of-<n>.safetensors`` + ``model.safetensors.index.json`` + ``config.json``
    (+ ``generation_config.json``) when ``write_merged``; ``adapter/`` (peft's files) when ``write_adapter``.

    Raises:
        DivergedExportError: (from ``check_finite``) a unit's exported tensors hold inf or nan, on every rank.
        OSError: (or safetensors' ``SafetensorError``) the writer could not write a file; the other ranks raise
            ``RuntimeError`` at the same unit.
    """
    base = lm.model.get_base_model() if lm.is_peft else lm.model
    adapter_state: dict[str, torch.Tensor] = {}

    def collect(unit: UnitWeights) -> None:
        check_finite({**unit.merged, **unit.adapter}, path)
        adapter_state.update(unit.adapter)

    walk = unit_weights(lm, adapter_name, write_merged, write_adapter)
    written = write_weight_files(walk, path, writer, collect)
    if not writer:
        return
    try:
        if write_merged:
            save_config(base, path, written)
        if write_adapter:
            folder = os.path.join(path, "adapter")
            written.append(folder)
            lm.model.save_pretrained(folder, selected_adapters=[adapter_name], state_dict=adapter_state)
            flatten_adapter_folder(folder, adapter_name)
    except BaseException:
        for item in written:  # files, and the adapter folder (only written whole)
            if os.path.isfile(item):
                os.remove(item)
            elif item == os.path.join(path, "adapter"):
                shutil.rmtree(item, ignore_errors=True)
        raise


def _write_file(merged: dict[str, torch.Tensor], file: str, dtype: torch.dtype | None) -> dict[str, int]:
    """One unit's merged weights (already under their file names) as a safetensors file; returns each name's
    bytes."""
    tensors = {k: v.to(device="cpu", dtype=dtype or v.dtype).contiguous() for k, v in merged.items()}
    save_file(tensors, file, metadata={"format": "pt"})
    return {k: t.numel() * t.element_size() for k, t in tensors.items()}


def save_config(base: nn.Module, path: str, written: list[str]) -> None:
    """``config.json`` (and ``generation_config.json`` for a model that generates) as ``save_pretrained`` writes
    them beside the weights: the dtype and architecture recorded in the config first."""
    base.config.dtype = str(base.dtype).split(".")[1]
    base.config.architectures = [type(base).__name__.removeprefix("FSDP")]
    written.append(os.path.join(path, "config.json"))
    base.config.save_pretrained(path)
    if base.can_generate():
        written.append(os.path.join(path, "generation_config.json"))
        base.generation_config.save_pretrained(path)
