"""FSDP2 (``torch.distributed.fsdp.fully_shard``) units for the stage modules, and gathered parameters.

Under Lightning's ``ModelParallelStrategy`` nothing is wrapped for us: each module's ``configure_model``
calls ``shard_lm`` / ``shard_head`` here, and parameters no FSDP unit owns would never have their
gradients averaged across ranks. The units:

* every transformer block (the classes in ``model._no_split_modules``) is one unit: its parameters are
  all-gathered for its forward (and again for its backward) and freed afterwards;
* the rest of a causal LM (embeddings, final norm, LM head; tied input/output embeddings stay in one
  group) is the unit of its ``AdaptedLM``. The stage modules never call ``AdaptedLM.forward``: they call
  ``hidden_states``, ``logits`` and ``generate``, so those three are registered as FSDP forward methods
  (the parameters are gathered around each call), and the unit reshards after every call
  (``reshard_after_forward=True``; FSDP's default keeps a root unsharded, which would let a no-grad
  forward leave stale parameters in place across an optimizer step);
* each trainable ``ScalarHead`` (value head, reward head) is a unit of its own (called directly).

LoRA parameters live inside the blocks and are sharded with them; frozen and trainable parameters may
share a unit (FSDP2 requires one dtype among the trainable ones only). FSDP2 averages gradients over
the data-parallel ranks (reduce-scatter, then divide by the world size), exactly like DDP, so the loss
scaling of the PPO update (``rlhf_lit.rl.update``) serves both.

Generation under FSDP must keep every rank stepping (docs/pitfalls.md: FSDP generation): ``sample_responses`` is called with
``synced_gpus=True`` whenever ``world_size > 1``.

Not supported: 4-bit (bitsandbytes) bases under FSDP (``Params4bit`` cannot be sharded as DTensors);
tensor parallelism (``tensor_parallel_size > 1``).

Private APIs (checked against torch 2.13 and transformers 5.24; ``tests/test_library_contracts.py``):
``PreTrainedModel._no_split_modules`` (the block classes; also read by accelerate for the same purpose) in
``transformer_blocks``, and ``nn.Module._parameters`` / ``_buffers`` / ``_non_persistent_buffers_set`` in
``plain_state_dict`` (FSDP2's state-dict hooks would return shards).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

LM_FORWARD_METHODS = ("hidden_states", "logits", "generate")


def data_parallel_mesh(device_mesh):
    """The 1-D data-parallel mesh of a Lightning ``ModelParallelStrategy`` device mesh, or None.

    Raises:
        ValueError: if the mesh has a tensor-parallel dimension larger than 1.
    """
    if device_mesh is None:
        return None
    names = device_mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and device_mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            "rlhf_lit shards with FSDP2 over data-parallel ranks only; tensor parallelism is not supported. "
            "Use strategy rlhf_lit.parallel.strategy.FSDP2Strategy, or ModelParallelStrategy with "
            "data_parallel_size=<number of processes> and tensor_parallel_size=1"
        )
    return device_mesh["data_parallel"] if "data_parallel" in names else device_mesh


def is_sharded(module: nn.Module) -> bool:
    """True when FSDP2 has been applied to ``module`` or to one of its submodules."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def no_split_module_names(model: nn.Module) -> set[str]:
    """Class names of a transformers model's repeated blocks (``_no_split_modules``, private in
    transformers 5.24: the classes accelerate and FSDP wrap one by one); empty when it has none."""
    return set(getattr(model, "_no_split_modules", None) or [])


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a (peft-wrapped) causal LM, by ``_no_split_modules`` class name."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = no_split_module_names(base)
    blocks = [m for m in base.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"cannot find the transformer blocks of {type(base).__name__} (no _no_split_modules); "
            "FSDP2 sharding needs them"
        )
    return blocks


def shard_lm(lm: nn.Module, mesh) -> None:
    """Apply FSDP2 to an ``AdaptedLM`` (not imported here: ``rlhf_lit.models`` imports this module): one unit per
    transformer block, the rest in the ``lm`` unit.

    Idempotent (a second call does nothing), so ``configure_model`` may run more than once.

    Raises:
        ValueError: if the base is held in 4-bit.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if is_sharded(lm):
        return
    if any(type(p).__name__ == "Params4bit" for p in lm.parameters()):
        raise ValueError(
            "a 4-bit (bitsandbytes) base cannot be sharded with FSDP; train QLoRA on one device "
            "(configs/trainer/single_gpu_qlora.yaml), or shard a bf16 base (configs/trainer/fsdp_bf16.yaml)"
        )
    # The units' outputs are views (a slice of the last hidden state, a squeezed head output); nothing here
    # edits them in place, which is what FSDP's warning is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for block in transformer_blocks(lm.model):
        fully_shard(block, mesh=mesh)
    fully_shard(lm, mesh=mesh, reshard_after_forward=True)
    for name in LM_FORWARD_METHODS:
        register_fsdp_forward_method(lm, name)


def shard_head(head: nn.Module, mesh) -> None:
    """Apply FSDP2 to a small trainable module called on its own (a value or reward head)."""
    from torch.distributed.fsdp import fully_shard

    if not is_sharded(head):
        fully_shard(head, mesh=mesh, reshard_after_forward=True)


@contextmanager
def gathered_parameters(module: nn.Module) -> Iterator[None]:
    """Inside the context every FSDP unit under ``module`` holds its full, unsharded parameters.

    A collective: every rank must enter it (e.g. before rank 0 writes a reward head; a whole model is exported
    one unit at a time instead, ``rlhf_lit.models.streamed_export``). Changes made to the parameters inside are
    not written back to the shards. Without FSDP it does nothing.
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


def fsdp_units(module: nn.Module, is_unit=None) -> tuple[list[nn.Module], dict[int, nn.Module]]:
    """The FSDP units under ``module`` in ``module.modules()`` order (the same on every rank), and which unit
    owns each submodule: its innermost ancestor (itself included) that is a unit, keyed by ``id(submodule)``.
    A unit's ``unshard()`` gathers the parameters registered on the submodules it owns, no others (a block
    inside the ``AdaptedLM`` unit is a unit of its own). Submodules outside every unit are not in the map.
    ``is_unit(submodule)`` picks other units the same way (default: ``FSDPModule`` instances)."""
    from torch.distributed.fsdp import FSDPModule

    units: list[nn.Module] = []
    owner: dict[int, nn.Module] = {}
    is_unit = is_unit or (lambda sub: isinstance(sub, FSDPModule))

    def visit(sub: nn.Module, unit: nn.Module | None) -> None:
        if is_unit(sub):
            unit = sub
            units.append(sub)
        if unit is not None:
            owner[id(sub)] = unit
        for child in sub.children():
            visit(child, unit)

    visit(module, None)
    return units, owner


def grad_norm_value(total_norm: torch.Tensor) -> float:
    """``clip_grad_norm_``'s result as a float; over sharded (DTensor) gradients it is a DTensor."""
    full = getattr(total_norm, "full_tensor", None)
    return float(full() if full is not None else total_norm)


def plain_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` built from the tensors registered right now, without state-dict hooks.

    FSDP2's state-dict hook reshards a unit and returns DTensor shards; inside ``gathered_parameters``
    this returns the full tensors instead (parameters, tied ones under every name, and persistent
    buffers), so an export can be written from them. A module without FSDP units gets its ordinary
    ``state_dict()`` (which also keeps custom entries such as bitsandbytes' quantization state).
    """
    if not is_sharded(module):
        return module.state_dict()
    out: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in sub._parameters.items():
            if param is not None:
                out[dot + name] = param.detach()
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                out[dot + name] = buf.detach()
    return out
