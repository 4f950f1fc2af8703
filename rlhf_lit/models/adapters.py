"""One base model, several named LoRA adapters (peft), and the reference as the base with them off.

``AdaptedLM`` owns a causal LM and, optionally, LoRA adapters on it: ``"default"`` in SFT and reward
training; ``"actor"``, ``"critic"`` (and ``"reward"``) in PPO. One adapter is active at a time;
``reference()`` switches all of them off, so the frozen reference policy costs no memory and is never a
deep copy (STYLE habit 10).

**Base adapters.** A model that is already a ``peft.PeftModel`` when it is handed over (``load_backbone``
of an adapter-only export, e.g. a QLoRA SFT) carries adapters that belong to the BASE: they stay frozen and
switched on beneath whichever adapter is active, and ``reference()`` keeps them on too, so the reference is
the SFT policy exactly as ``PeftModel.from_pretrained(base, sft_adapter)`` computes it. (peft runs every
active LoRA adapter of a layer and adds their updates: ``W x + sum_a s_a B_a A_a x``.) Chosen over merging
the SFT adapter into a de-quantized copy of a 4-bit base and re-quantizing it: re-quantization moves every
weight by up to half an NF4 step, so that reference would no longer be the SFT policy, and it would cost a
full-precision copy of the base at load time; the stacked adapter costs ``2 r (in + out)`` extra FLOPs per
token and adapted layer (under 1% of the layer's for r = 16 on a 4096-wide model).

peft's ``set_adapter`` marks only the active adapter trainable. PPO trains two adapters in one backward
pass, so ``AdaptedLM`` keeps its own list of trainable adapters and restores their ``requires_grad`` after
every switch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import PreTrainedModel

from rlhf_lit.models.backbone import LoraSettings
from rlhf_lit.models.peft_compat import activate_adapters, zero_adapter_dropout
from rlhf_lit.models.trunk import lm_head, trunk_hidden_states

if TYPE_CHECKING:  # peft is imported when a model is wrapped: a refused config never pays for it
    from peft import LoraConfig


def _is_peft(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def lora_config(settings: LoraSettings, model: nn.Module) -> LoraConfig:
    """peft's ``LoraConfig`` for ``model`` (GPT-2-style ``Conv1D`` layers store weights transposed)."""
    from peft import LoraConfig
    conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())
    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        bias="none",
        fan_in_fan_out=conv1d,
    )


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def _adapter_state(layers: list[nn.Module]) -> list[tuple]:
    """Which adapters each LoRA layer runs: ``(active_adapter, disable_adapters)`` per layer, as peft keeps them."""
    state = []
    for layer in layers:
        active = layer.active_adapter
        state.append((list(active) if isinstance(active, list) else active, layer.disable_adapters))
    return state


def _set_adapter_state(layers: list[nn.Module], state: list[tuple]) -> None:
    # peft's own attributes, set directly: set_adapter / enable_adapters would also change requires_grad, which
    # must stay as the forward had it (the recomputed graph feeds the trainable adapters' gradients)
    for layer, (active, disabled) in zip(layers, state):
        layer._active_adapter, layer._disable_adapters = active, disabled


class RecomputeUnderForwardAdapters:
    """Gradient checkpointing that recomputes each layer with the adapters its forward ran with.

    Non-reentrant checkpointing (``torch.utils.checkpoint``) runs a layer's forward again during backward. PPO
    runs the actor and the critic adapters (and DPO the policy and, between forward and backward, the reference
    with adapters off) through one base and backpropagates once, so at backward time the model is switched to
    whichever adapter the last context left on: the recomputed activations, and so the gradients, would be the
    wrong adapter's (pitfall: checkpointing with several adapters). Through
    torch's ``context_fn``, each checkpointed forward records the LoRA layers' adapter state, and its recompute
    runs under that state (switched back afterwards; skipped when it already holds). A no-op for a model
    without gradient checkpointing or without LoRA layers.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers: list[nn.Module] = []
        base = model.get_base_model() if _is_peft(model) else None
        if base is None or not getattr(base, "is_gradient_checkpointing", False):
            return
        self.refresh()
        base.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": self.contexts}
        )

    def refresh(self) -> None:
        """Find the LoRA layers again (after an adapter was added)."""
        if _is_peft(self.model):
            self.layers = _lora_layers(self.model)

    def contexts(self):
        """``(forward context, recompute context)`` for one checkpointed forward (torch's ``context_fn``)."""
        return nullcontext(), self._under(_adapter_state(self.layers))

    @contextmanager
    def _under(self, saved: list[tuple]) -> Iterator[None]:
        current = _adapter_state(self.layers)
        if current == saved:
            yield
            return
        _set_adapter_state(self.layers, saved)
        try:
            yield
        finally:
            _set_adapter_state(self.layers, current)


class AdaptedLM(nn.Module):
    """A causal LM with named LoRA adapters, of which one is active.

    Args:
        model: the causal LM (already quantized, if 4-bit); a ``peft.PeftModel`` brings base adapters
            (see the module docstring).
        adapters: adapter name -> LoRA settings, added in order; the first one is active. Empty: the
            model is trained in full (all its parameters stay trainable), or is a frozen stack of base
            adapters.
        trainable: names of the adapters whose parameters are trained (default: all of them).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        adapters: dict[str, LoraSettings] | None = None,
        trainable: list[str] | None = None,
    ) -> None:
        super().__init__()
        adapters = dict(adapters or {})
        self.base_adapters: list[str] = list(model.peft_config) if _is_peft(model) else []
        names = list(adapters)
        if names and self.base_adapters:
            for name in names:
                model.add_adapter(name, lora_config(adapters[name], model))
        elif names:
            from peft import get_peft_model

            model = get_peft_model(model, lora_config(adapters[names[0]], model), adapter_name=names[0])
            for name in names[1:]:
                model.add_adapter(name, lora_config(adapters[name], model))
        self.model = model
        self._recompute = RecomputeUnderForwardAdapters(model)  # gradient checkpointing: see the class
        self.adapter_names: list[str] = names
        self.trainable_adapters: list[str] = list(trainable if trainable is not None else adapters)
        self._active: str | None = None
        if names:
            self.set_adapter(names[0])
        elif self.base_adapters:
            self._activate(self.base_adapters)
        self._restore_trainable()

    @property
    def is_peft(self) -> bool:
        return _is_peft(self.model)

    @property
    def active_adapter(self) -> str | None:
        """The active (switchable) adapter; base adapters are always on beneath it."""
        return self._active

    def add_saved_adapter(self, path: str, name: str, trainable: bool = False) -> None:
        """Load a saved peft adapter (e.g. a reward adapter) under ``name``."""
        if not self.is_peft:
            raise ValueError("a saved adapter can only be added to a model that already has LoRA adapters")
        active = self.active_adapter
        was_training = self.model.training
        self.model.load_adapter(path, adapter_name=name, is_trainable=trainable)
        # peft puts the WHOLE model in eval mode after loading a frozen adapter; that would switch off
        # gradient checkpointing for the policy's training forwards (docs/pitfalls.md: dropout). A frozen adapter is only
        # ever evaluated, so its own LoRA dropout (a reward model trained with lora.dropout > 0) is set to 0
        # instead: in train mode it would otherwise make identical calls score differently.
        self.model.train(was_training)
        if not trainable:
            self._zero_adapter_dropout(name)
        self.adapter_names.append(name)
        self._recompute.refresh()  # a saved adapter on other target modules brings new LoRA layers
        if trainable:
            self.trainable_adapters.append(name)
        self._active = None  # load_adapter may have changed peft's active adapter: switch back for sure
        if active is not None:
            self.set_adapter(active)
        elif self.base_adapters:
            self._activate(self.base_adapters)

    def _zero_adapter_dropout(self, name: str) -> None:
        zero_adapter_dropout(self.model, name)

    def adapter_parameters(self, name: str) -> list[nn.Parameter]:
        """The LoRA parameters of one adapter."""
        marker = f".{name}."
        return [p for n, p in self.model.named_parameters() if "lora_" in n and marker in n]

    def copy_adapter(self, source: str, target: str) -> None:
        """Copy adapter ``source``'s LoRA weights into adapter ``target`` (e.g. the critic starts as the reward
        adapter: PPO-Max's critic initialised from the reward model).

        Raises:
            ValueError: if ``target`` has a LoRA matrix that ``source`` lacks or holds in another shape (other
                target modules or rank).
        """
        params = dict(self.model.named_parameters())
        for name, p in params.items():
            if "lora_" not in name or f".{target}." not in name:
                continue
            src = params.get(name.replace(f".{target}.", f".{source}."))
            if src is None or src.shape != p.shape:
                raise ValueError(
                    f"cannot copy adapter {source!r} into {target!r}: {name} has no match of shape "
                    f"{tuple(p.shape)} in {source!r} (give both the same LoRA rank and target modules)"
                )
            with torch.no_grad():
                p.copy_(src)

    def _restore_trainable(self) -> None:
        if not self.is_peft:
            return
        for name in self.base_adapters + self.adapter_names:
            for p in self.adapter_parameters(name):
                p.requires_grad_(name in self.trainable_adapters)

    def _activate(self, names: list[str]) -> None:
        """Switch on exactly ``names`` in every LoRA layer (peft adds their updates)."""
        activate_adapters(self.model, names)

    def set_adapter(self, name: str) -> None:
        """Make ``name`` the active adapter (above any base adapters), keeping every trainable adapter
        trainable."""
        if name not in self.adapter_names:
            raise KeyError(f"no adapter named {name!r}; have {self.adapter_names}")
        if self._active != name:
            # PeftModel.set_adapter, not base_model.set_adapter alone: the latter leaves
            # PeftModel.active_adapter stale
            self.model.set_adapter(name)
            if self.base_adapters:
                self._activate(self.base_adapters + [name])
            self._active = name
            self._restore_trainable()

    @contextmanager
    def adapter(self, name: str) -> Iterator[None]:
        """Run the enclosed forward passes with adapter ``name`` active."""
        previous = self.active_adapter
        self.set_adapter(name)
        try:
            yield
        finally:
            if previous is not None:
                self.set_adapter(previous)

    @contextmanager
    def merged(self, name: str, copy_to_cpu: bool = False) -> Iterator[None]:
        """Run the enclosed (inference) forwards with adapter ``name`` folded into the base weights.

        ``W + scaling * B @ A`` is one matmul per layer instead of the base matmul plus two LoRA ones. On exit
        the adapter is unmerged and the base weights are written back bit for bit from a copy (unmerging
        alone is not an exact round trip in floating point, and the base is the frozen reference policy).
        ``copy_to_cpu`` keeps that copy in host memory (exports) instead of beside the weights (sampling).
        Not for 4-bit or sharded bases; no gradients flow to the adapter while it is merged.
        """
        if not self.is_peft:
            yield
            return
        base = self.model.get_base_model()
        originals = {
            n: p.detach().to("cpu", copy=True) if copy_to_cpu else p.detach().clone()
            for n, p in base.named_parameters()
            if ".base_layer." in n
        }
        with self.adapter(name):
            self.model.merge_adapter()
            try:
                yield
            finally:
                self.model.unmerge_adapter()
                with torch.no_grad():
                    for n, p in base.named_parameters():
                        if n in originals:
                            p.copy_(originals[n])

    def reference(self):
        """Context: every adapter off except the base adapters, i.e. the frozen base model (the PPO
        reference policy: the SFT model, also when it is a base plus its frozen SFT adapter)."""
        if not self.is_peft:
            return nullcontext()
        if not self.base_adapters:
            return self._adapters_off()
        return self._base_adapters_only()

    @contextmanager
    def _adapters_off(self) -> Iterator[None]:
        # peft's disable_adapter leaves every adapter but the active one frozen on exit; PPO trains two (a
        # reference forward between a forward and its backward would otherwise cut the critic's gradients)
        try:
            with self.model.disable_adapter():
                yield
        finally:
            self._restore_trainable()

    @contextmanager
    def _base_adapters_only(self) -> Iterator[None]:
        self._activate(self.base_adapters)
        try:
            yield
        finally:
            self._activate(self.base_adapters + ([self._active] if self._active else []))
            self._restore_trainable()

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Last-layer hidden states ``(B, T, H)`` from the trunk, without vocabulary logits.

        Position ids come from the attention mask, so left padding does not shift positions (pitfall: left padding); an
        encoder's rows must be right padded. Packed rows: no mask and ``position_ids`` restarting per row
        (``rlhf_lit.models.trunk.trunk_hidden_states``).
        """
        return trunk_hidden_states(self.model, input_ids, attention_mask, position_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``(..., V)`` for hidden states ``(..., H)``."""
        return lm_head(self.model)(hidden)

    def generation_model(self) -> nn.Module:
        """The module to call ``generate`` on (the peft wrapper routes it through the active adapter)."""
        return self.model

    def generate(self, **kwargs):
        """``generate`` of the wrapped model, with the active adapter.

        A method of this module (not of ``self.model``) so that FSDP2 can gather this unit's parameters
        around the whole decode loop (``rlhf_lit.parallel`` registers it as a forward method).
        """
        return self.model.generate(**kwargs)
