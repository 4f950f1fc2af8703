"""The model's shape: parameter counts and sizes, from its config, built on the ``meta`` device (no memory)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf_lit.models.architecture import read_architecture
from rlhf_lit.models.backbone import BackboneConfig
from rlhf_lit.parallel.fsdp import no_split_module_names

__all__ = ["ModelShape", "model_shape"]


@dataclass
class ModelShape:
    """Parameter counts and sizes of an architecture (from its config, built on the meta device)."""

    name: str
    source: str
    family: str  # "rms" (Llama-style) or "ln" (GPT-2-style)
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

    def lora_params(self, r: int, target_modules) -> int:
        """LoRA parameters ``r * (in + out)`` over the Linear layers peft would adapt."""
        if target_modules == "all-linear":
            return sum(r * (i + o) for _, i, o in self.linear_shapes)
        targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
        return sum(
            r * (i + o)
            for name, i, o in self.linear_shapes
            if any(name == t or name.endswith("." + t) for t in targets)
        )


def model_shape(backbone: BackboneConfig, model_config: str | None = None) -> ModelShape:
    """Count an architecture's parameters on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    config, source = read_architecture(backbone, model_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out_emb = model.get_output_embeddings()
    names = no_split_module_names(model)
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    block_linear = 0
    for block in blocks:
        for m in block.modules():
            if type(m).__name__ in ("Linear", "Conv1D"):
                block_linear += m.weight.numel()
    shapes = []
    for name, m in model.named_modules():
        if m is out_emb or type(m).__name__ not in ("Linear", "Conv1D"):
            continue
        w = m.weight.shape
        i, o = (w[1], w[0]) if type(m).__name__ == "Linear" else (w[0], w[1])
        shapes.append((name, int(i), int(o)))
    hidden = int(getattr(config, "hidden_size", None) or config.n_embd)
    heads = int(getattr(config, "num_attention_heads", None) or config.n_head)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    family = (
        "ln"
        if getattr(config, "model_type", "") in ("gpt2", "gpt_neo", "gptj", "gpt_bigcode", "opt")
        else "rms"
    )
    return ModelShape(
        name=backbone.name_or_path or f"tiny {backbone.tiny.get('model_type', 'gpt2')}",
        source=source,
        family=family,
        num_layers=int(getattr(config, "num_hidden_layers", None) or config.n_layer),
        hidden=hidden,
        intermediate=int(inter),
        kv=kv_heads * head_dim,
        vocab=int(config.vocab_size),
        num_params=sum(p.numel() for p in model.parameters()),
        block_linear_params=block_linear,
        linear_shapes=shapes,
        fused_gelu=bool(getattr(backbone, "fused_activations", True))
        and getattr(config, "activation_function", None) in ("gelu_new", "gelu_fast"),
    )
