"""The parts of peft's internals that ``AdaptedLM`` relies on, in one place.

Checked against peft 0.21.2 (``tests/test_library_contracts.py`` fails loudly when they change):

* ``PeftModel.base_model.set_adapter(names, inference_mode=True)`` (``LoraModel.set_adapter``) with a LIST
  of names switches exactly those adapters on in every LoRA layer (their updates are added); with
  ``inference_mode=True`` it freezes them (``AdaptedLM`` sets ``requires_grad`` of its trainable adapters
  again afterwards) -- ``PeftModel.set_adapter`` takes one name only;
* every LoRA layer keeps its dropouts in an ``nn.ModuleDict`` attribute ``lora_dropout`` keyed by adapter;
* ``LoraLayer.merge(safe_merge=False)`` adds ``get_delta_weight(a)`` to the base layer's weight, in place, for
  each active adapter ``a`` the layer holds (``lora_A``, or ``lora_embedding_A`` for an embedding), when the
  adapter has no ``lora_variant`` (DoRA) and no ``lora_bias`` (``merged_lora_weight`` does the same out of place).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["activate_adapters", "merged_lora_weight", "zero_adapter_dropout"]


def activate_adapters(peft_model, names: list[str]) -> None:
    """Switch on exactly ``names`` (in order) in every LoRA layer of a ``PeftModel``."""
    peft_model.base_model.set_adapter(names, inference_mode=True)


def zero_adapter_dropout(model: nn.Module, name: str) -> None:
    """Set every dropout of adapter ``name`` to p = 0 (exact log-probs need dropout off)."""
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(dropouts, nn.ModuleDict) and name in dropouts:
            for m in dropouts[name].modules():
                if isinstance(m, nn.Dropout):
                    m.p = 0.0


def merged_lora_weight(layer: nn.Module) -> torch.Tensor:
    """The weight peft's ``merge_adapter`` would leave in a LoRA layer's base layer: ``W + sum_a delta_a`` over
    the layer's active adapters in order (``delta_a = scaling_a * B_a @ A_a``, transposed for ``fan_in_fan_out``),
    computed out of place with the same arithmetic, so bit for bit what ``merge`` writes; the layer is not
    changed. Shape and dtype of the base weight.

    Raises:
        NotImplementedError: for an adapter with a variant (DoRA) or a trained bias (``lora_bias``), which merge
            differently.
    """
    weight = layer.get_base_layer().weight
    merged = weight
    for name in layer.active_adapters:
        if name not in layer.lora_A and name not in getattr(layer, "lora_embedding_A", {}):
            continue
        if name in getattr(layer, "lora_variant", {}) or layer.lora_bias.get(name, False):
            raise NotImplementedError(f"adapter {name!r} is a LoRA variant (DoRA) or trains a bias: not merged")
        # merge's `W += delta`: W's dtype kept
        merged = (merged + layer.get_delta_weight(name)).to(weight.dtype)
    return merged.detach()
