"""A separate copy of the policy for sampling, in its own dtype, with the adapters merged into its weights.

Inference engines (vLLM, SGLang; veRL and OpenRLHF run PPO that way) sample from their own copy of the policy,
in bf16, while the trainer keeps its weights; after every update the new weights must reach the copy, or the
rollouts come from a stale policy while every loss stays finite (veRL #7495; the rollout-policy guard of
``rlhf_lit.rl.guard`` checks for it). This module builds such a copy with transformers and fills it:

* :func:`build_inference_copy`: a fresh model of the policy's architecture (``from_config``), in ``dtype``,
  eval mode, run under ``no_grad`` only; it holds no adapter layers, so a decoding step is one matmul per
  linear layer.
* :func:`load_merged_weights`: writes into the copy the policy's weights as the active adapters compute them,
  ``W + sum_a s_a B_a A_a`` per adapted layer (peft's ``get_delta_weight``, which handles ``fan_in_fan_out``
  and the scaling) for adapter ``name`` and the frozen base adapters beneath it (an adapter-only SFT export),
  computed in the policy's dtype and cast once. The policy's own weights are never touched (unlike
  ``AdaptedLM.merged``, which folds the adapter in and restores the base from a copy).

Cost: one copy of the model in ``dtype`` (for 135M parameters in bf16: 270 MB), and per refresh one pass
over the weights plus one ``B @ A`` per adapted layer. Not for a 4-bit base (its weights are not plain
tensors) nor a sharded one (FSDP): ``refuse_impossible_settings`` and ``refuse_sharded_settings`` in
``rlhf_lit.rl.settings`` refuse them.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["build_inference_copy", "load_merged_weights", "merged_weights"]


def _plain_model(lm) -> nn.Module:
    """The transformers model inside an ``AdaptedLM`` (peft's LoRA layers still injected, if any)."""
    return lm.model.get_base_model() if lm.is_peft else lm.model


def build_inference_copy(lm, dtype: torch.dtype) -> nn.Module:
    """A transformers causal LM of ``lm``'s architecture in ``dtype``, eval mode, on ``lm``'s device, its
    buffers (rotary frequencies, masks) copied from ``lm``'s model. Built on the meta device, so no weight is
    initialised (nor the random state touched): its weights are uninitialised memory until
    :func:`load_merged_weights` fills them.

    Raises:
        ValueError: if ``lm``'s model has no transformers config (``from_config`` cannot rebuild it).
    """
    from transformers import AutoModelForCausalLM

    model = _plain_model(lm)
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f"sampling.copy_dtype: cannot rebuild a {type(model).__name__} (no transformers config)"
        )
    device = next(model.parameters()).device
    with torch.device("meta"):
        copy = AutoModelForCausalLM.from_config(config, dtype=dtype)
    copy.to_empty(device=device)
    copy.tie_weights()  # to_empty gave tied weights (embedding, LM head) separate storage
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, buffer in copy.named_buffers():
            buffer.copy_(buffers[name.replace(".base_layer.", ".")])
    # frozen: the copy is in no optimizer (generation.sample_responses gives its LM head contiguous inputs, which
    # a frozen 16-bit head on a CPU needs to be fast: generation.contiguous_head_inputs)
    copy.requires_grad_(False)
    copy.eval()
    return copy


@torch.no_grad()
def merged_weights(lm, name: str | None) -> dict[str, torch.Tensor]:
    """``lm``'s weights with adapter ``name`` (and every base adapter) merged, by their Hugging Face names
    (the plain model's parameter names; a tied LM head appears once, as its embedding): the tensors an
    inference engine loads. A merged weight is a new tensor ``W + sum_a s_a B_a A_a`` in the policy's dtype;
    an unadapted one is the policy's own parameter (detached, not copied: do not write into it).

    Raises:
        ValueError: for a DoRA adapter (its magnitude vector does not merge into ``W`` by ``get_delta_weight``).
    """
    model = _plain_model(lm)
    deltas: dict[str, torch.Tensor] = {}
    if lm.is_peft:
        from peft.tuners.lora import LoraLayer

        with lm.adapter(name) if name is not None else lm.reference():
            for module_name, module in model.named_modules():
                if isinstance(module, LoraLayer):
                    active = (
                        []
                        if module.disable_adapters
                        else [a for a in module.active_adapters if a in module.lora_A]
                    )
                    if any(module.use_dora.get(a, False) for a in active):
                        raise ValueError("sampling: DoRA adapters cannot be merged into a sampling copy")
                    if active:
                        deltas[f"{module_name}.weight"] = sum(module.get_delta_weight(a) for a in active)
    out: dict[str, torch.Tensor] = {}
    for param_name, param in model.named_parameters():
        if ".lora_" not in param_name:
            key = param_name.replace(".base_layer.", ".")
            delta = deltas.get(key)
            out[key] = param.detach() if delta is None else param.detach() + delta
    return out


@torch.no_grad()
def load_merged_weights(lm, name: str | None, copy: nn.Module) -> None:
    """Write ``lm``'s weights, with adapter ``name`` (and every base adapter) merged, into ``copy``
    (:func:`merged_weights`).

    Args:
        lm: the ``AdaptedLM`` being trained (unchanged).
        name: the adapter to merge (``"actor"``), or None for a model without adapters.
        copy: a model from :func:`build_inference_copy` for the same ``lm``.

    Raises:
        ValueError: if a weight of ``copy`` has no counterpart in ``lm`` or their shapes differ.
    """
    sources = merged_weights(lm, name)
    for param_name, target in copy.named_parameters():
        source = sources.get(param_name)
        if source is None or source.shape != target.shape:
            raise ValueError(
                f"the sampling copy's {param_name} {tuple(target.shape)} has no counterpart in the policy"
            )
        target.copy_(source)
