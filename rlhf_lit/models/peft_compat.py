"""The parts of peft's internals that ``AdaptedLM`` relies on, in one place.

Checked against peft 0.21.2 (``tests/test_library_contracts.py`` fails loudly when they change):

* ``PeftModel.base_model.set_adapter(names, inference_mode=True)`` (``LoraModel.set_adapter``) with a LIST
  of names switches exactly those adapters on in every LoRA layer (their updates are added); with
  ``inference_mode=True`` it freezes them (``AdaptedLM`` sets ``requires_grad`` of its trainable adapters
  again afterwards) -- ``PeftModel.set_adapter`` takes one name only;
* every LoRA layer keeps its dropouts in an ``nn.ModuleDict`` attribute ``lora_dropout`` keyed by adapter.
"""

from __future__ import annotations

from torch import nn

__all__ = ["activate_adapters", "zero_adapter_dropout"]


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
