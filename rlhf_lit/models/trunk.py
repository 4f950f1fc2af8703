"""What the stages do with a loaded model: find its trunk, LM head and hidden size, tell an encoder from a
causal LM, switch dropout off, fuse activations, freeze lower layers, keep bitsandbytes' 4-bit layout on CPU.

Torch and transformers only (no Lightning); the loading itself is ``rlhf_lit.models.backbone``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from rlhf_lit.functional.sequence import position_ids_from_mask


def is_encoder_config(config) -> bool:
    """Whether a transformers config describes an encoder (module docstring): its model type has a
    masked-LM head in transformers and it is not an encoder-decoder."""
    return config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(
        config, "is_encoder_decoder", False
    )


def model_is_encoder(model: nn.Module) -> bool:
    """Whether a loaded model (possibly wrapped by peft) is an encoder."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    return config is not None and is_encoder_config(config)


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

    The module stays in train mode, so gradient checkpointing keeps working (docs/pitfalls.md: dropout).
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
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Last-layer hidden states ``(B, T, H)`` of a model's trunk (no vocabulary logits).

    A causal LM gets position ids from the attention mask, so left padding does not shift positions (pitfall: left padding).
    An encoder gets none (module docstring): its rows must be right padded.

    Packed rows (``rlhf_lit.functional.packing``): ``attention_mask=None`` and ``position_ids`` ``(NB, L)`` that
    restart at 0 on each row. transformers (5.x, ``masking_utils.find_packed_sequence_indices``, checked with
    5.24 for GPT-2 and Llama under sdpa and eager) then builds a causal mask confined to each row.

    Raises:
        ValueError: an encoder given a row with padding before a real token, or packed rows (it has no
            packed path); neither a mask nor position ids.
    """
    if attention_mask is None:
        if position_ids is None or model_is_encoder(model):
            raise ValueError("packed rows need position ids and a causal LM (an encoder has no packed path)")
        out = trunk(model)(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return out.last_hidden_state
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
