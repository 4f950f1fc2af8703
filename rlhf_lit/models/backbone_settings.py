"""The settings of a backbone (where a model comes from and how it is held) and of its LoRA adapters.

Plain dataclasses with their ranges declared on their fields (``rlhf_lit.ranges``); ``rlhf_lit.models.backbone``
loads what they describe (and re-exports them), ``rlhf_lit.models.model_files`` finds the files.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from rlhf_lit.ranges import check_field_ranges, ranged

__all__ = ["DTYPES", "BackboneConfig", "LoraSettings"]

#: The weight dtypes a backbone may be held in (``backbone.dtype``).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoraSettings:
    """LoRA adapter settings (Hu et al. 2021), passed to ``peft.LoraConfig``.

    Args:
        r: adapter rank.
        alpha: scaling numerator; the update is scaled by ``alpha / r``.
        dropout: dropout on the adapter input (forced to 0 in PPO, whose log-probs must be exact).
        target_modules: module names to adapt, or ``"all-linear"``.
    """

    r: int = ranged(8, "int >= 1")
    alpha: int = ranged(16, "> 0")
    dropout: float = ranged(0.0, "[0, 1)")
    target_modules: list[str] | str = "all-linear"

    def __post_init__(self) -> None:
        check_field_ranges(self, "lora.")  # the ranges declared above (ConfigError)


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
        disable_dropout: set every dropout probability to 0 (required by PPO; pitfall: dropout).
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
        if self.dtype not in DTYPES:
            raise ValueError(f"backbone.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.lora, dict):
            self.lora = LoraSettings(**self.lora)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
