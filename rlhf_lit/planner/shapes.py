"""The model's shape: parameter counts and sizes, from its config, built on the ``meta`` device (no memory).

A model of up to :data:`EXACT_LAYERS` layers is built whole, so every layer is counted as it is (also where
layers differ: mixture-of-experts after dense layers, hybrid stacks). A deeper one (no released model has
more than ~130 layers; ``tiny: {n_layer: 100000}`` is a typing slip) is built with one layer and that block's
parameters are multiplied by the layer count: time and memory do not grow with the layer count.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from rlhf_lit.models.architecture import read_architecture
from rlhf_lit.models.backbone import BackboneConfig
from rlhf_lit.parallel.fsdp import no_split_module_names

__all__ = ["BERT_LAYER_TYPES", "EXACT_LAYERS", "ModelShape", "model_shape"]

#: Encoders built of BERT's layer (post-LayerNorm, an ungated erf-GELU MLP): counted with the GPT-2-style formula
#: with the GELU as one kernel, not the gated Llama-style one (which counts 1.6x MiniLM's traced activations)
BERT_LAYER_TYPES = ("bert", "roberta", "xlm-roberta", "electra")

#: Models with more layers are built with one layer and the block's counts multiplied (see the module docstring).
EXACT_LAYERS = 256


@dataclass
class ModelShape:
    """Parameter counts and sizes of an architecture (from its config, built on the meta device)."""

    name: str
    source: str
    family: str  # "rms" (Llama-style) or "ln" (GPT-2-style, and BERT-style encoders)
    num_layers: int
    hidden: int
    intermediate: int
    kv: int
    vocab: int
    num_params: int
    block_linear_params: int  # weights of the Linear/Conv1D layers inside the blocks (4-bit quantizes these)
    linear_shapes: list[tuple[str, int, int]] = field(
        default_factory=list
    )  # (module name, in, out), no LM head
    fused_gelu: bool = False  # a tanh GELU run as one kernel (BackboneConfig.fused_activations)
    # layers counted, not built (a model of more than EXACT_LAYERS layers): each is a copy of the first block,
    # whose Linear layers are layer_linear_shapes (linear_shapes holds the built model's)
    extra_layers: int = 0
    layer_linear_shapes: list[tuple[str, int, int]] = field(default_factory=list)

    def lora_params(self, r: int, target_modules) -> int:
        """LoRA parameters ``r * (in + out)`` over the Linear layers peft would adapt."""
        return self._lora(r, target_modules, self.linear_shapes) + self.extra_layers * self._lora(
            r, target_modules, self.layer_linear_shapes
        )

    @staticmethod
    def _lora(r: int, target_modules, shapes: list[tuple[str, int, int]]) -> int:
        if target_modules == "all-linear":
            return sum(r * (i + o) for _, i, o in shapes)
        targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
        return sum(
            r * (i + o) for name, i, o in shapes if any(name == t or name.endswith("." + t) for t in targets)
        )


def model_shape(backbone: BackboneConfig, model_config: str | None = None) -> ModelShape:
    """Count an architecture's parameters on the meta device (no memory, no weights); a model of more than
    :data:`EXACT_LAYERS` layers is built with one and its block counted once per layer."""
    import torch
    from transformers import AutoModelForCausalLM

    config, source = read_architecture(backbone, model_config)
    num_layers = _num_layers(config)
    built = config if num_layers <= EXACT_LAYERS else _with_layers(config, 1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(built)
    out_emb = model.get_output_embeddings()
    names = no_split_module_names(model)
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if built is not config and not blocks:  # no block to count once: build it whole after all
        built = config
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        out_emb, blocks = model.get_output_embeddings(), []
    extra = num_layers - _num_layers(built)
    block_linear = 0
    for block in blocks:
        for m in block.modules():
            if type(m).__name__ in ("Linear", "Conv1D"):
                block_linear += m.weight.numel()
    first_block = {id(m) for m in blocks[0].modules()} if blocks else set()
    shapes, first_block_shapes = [], []
    for name, m in model.named_modules():
        if m is out_emb or type(m).__name__ not in ("Linear", "Conv1D"):
            continue
        w = m.weight.shape
        i, o = (w[1], w[0]) if type(m).__name__ == "Linear" else (w[0], w[1])
        shapes.append((name, int(i), int(o)))
        if id(m) in first_block:
            first_block_shapes.append((name, int(i), int(o)))
    num_params = sum(p.numel() for p in model.parameters())
    if extra:
        block_params = sum(p.numel() for p in blocks[0].parameters())
        num_params += extra * block_params
        block_linear += extra * sum(i * o for _, i, o in first_block_shapes)
    hidden = int(getattr(config, "hidden_size", None) or config.n_embd)
    heads = int(getattr(config, "num_attention_heads", None) or config.n_head)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    model_type = getattr(config, "model_type", "")
    encoder = model_type in BERT_LAYER_TYPES
    family = "ln" if model_type in ("gpt2", "gpt_neo", "gptj", "gpt_bigcode", "opt") or encoder else "rms"
    return ModelShape(
        name=backbone.name_or_path or f"tiny {backbone.tiny.get('model_type', 'gpt2')}",
        source=source,
        family=family,
        num_layers=num_layers,
        hidden=hidden,
        intermediate=int(inter),
        kv=kv_heads * head_dim,
        vocab=int(config.vocab_size),
        num_params=num_params,
        block_linear_params=block_linear,
        linear_shapes=shapes,
        fused_gelu=encoder  # BERT's erf GELU is one kernel already
        or bool(getattr(backbone, "fused_activations", True))
        and getattr(config, "activation_function", None) in ("gelu_new", "gelu_fast"),
        extra_layers=extra,
        layer_linear_shapes=first_block_shapes if extra else [],
    )


def _num_layers(config) -> int:
    return int(getattr(config, "num_hidden_layers", None) or config.n_layer)


def _with_layers(config, layers: int):
    """A copy of ``config`` with ``layers`` layers (a per-layer ``layer_types`` list cut to match)."""
    config = copy.deepcopy(config)
    if hasattr(config, "num_hidden_layers"):
        config.num_hidden_layers = layers  # transformers maps it to n_layer, num_layers, ... (attribute_map)
    else:
        config.n_layer = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    return config
