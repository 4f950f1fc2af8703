"""The planner's formulae (bytes; see ``rlhf_lit.planner`` for each one's derivation and measurement)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the formulae import nothing heavy (rlhf-lit plan --help reads GiB here)
    from rlhf_lit.models.backbone import BackboneConfig
    from rlhf_lit.planner.shapes import ModelShape

__all__ = [
    "DTYPE_BYTES",
    "CUDA_CONTEXT_BYTES",
    "GiB",
    "HOST_PROCESS_BYTES",
    "ALLOCATOR_SLACK",
    "MiB",
    "NF4_BYTES_PER_PARAM",
    "activation_bytes",
    "attention_mask_bytes",
    "backward_workspace_bytes",
    "layer_activation_bytes",
    "loss_bytes",
    "needed_bytes",
    "no_grad_intermediate_bytes",
    "weights_bytes",
]

GiB = 1024**3
MiB = 1024**2
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 1 / 4096
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: what a GPU run needs beyond its tensors on the device: the CUDA context and the kernels' workspaces
CUDA_CONTEXT_BYTES = GiB
#: what a CPU run needs in host memory beside its tensors: the interpreter, torch, transformers, Lightning and
#: peft loaded, the tokenizer and the data module. Measured on the CPU (``bench/config_memory.py``): 520 MiB
#: peak RSS of a process that only imports them; 585 MiB once ``rlhf-lit fit`` has built the SmolLM2 PPO module
#: and its prompt data, before its weights were read (``docs/scale.md``, "What the shipped real-model configs
#: do, measured"). The allocator's heap beyond the live tensors is not in it (the 10 % slack covers part).
HOST_PROCESS_BYTES = 0.6 * GiB
#: the "fits" line's allowance for the allocator beyond the planned tensors (fragmentation, caching): 10 %
ALLOCATOR_SLACK = 0.10


def needed_bytes(peak: float, cpu: bool) -> float:
    """What a run needs beside its planned tensor ``peak`` (bytes): ``peak * (1 + ALLOCATOR_SLACK)`` plus the
    host process (``HOST_PROCESS_BYTES``) on a CPU, the CUDA context (``CUDA_CONTEXT_BYTES``) on a GPU. The one
    composition the "fits" line and ``bench/config_memory.py --table`` compare with a measured peak."""
    return peak * (1.0 + ALLOCATOR_SLACK) + (HOST_PROCESS_BYTES if cpu else CUDA_CONTEXT_BYTES)


def weights_bytes(
    shape: ModelShape, cfg: BackboneConfig, dtype_override: str | None = None, four_bit=None
) -> float:
    four_bit = cfg.load_in_4bit if four_bit is None else four_bit
    if four_bit:
        return (
            shape.block_linear_params * NF4_BYTES_PER_PARAM
            + (shape.num_params - shape.block_linear_params) * 4
        )
    return shape.num_params * DTYPE_BYTES[dtype_override or cfg.dtype]


def activation_bytes(precision: str, backbone: BackboneConfig) -> int:
    """s_a: bytes of the activations the matmuls produce."""
    if "16" in precision:  # bf16-mixed, 16-mixed, bf16-true, 16-true
        return 2
    return DTYPE_BYTES[backbone.dtype]  # a 4-bit base computes in backbone.dtype


def loss_bytes(s_a: int) -> int:
    """Bytes per logit for the log-prob loss with its backward: the logits and their gradient (same dtype);
    the fp32 working pieces of ``gather_logprobs`` are a few positions each."""
    return 2 * s_a


def layer_activation_bytes(shape: ModelShape, s_a: int, autocast: bool, s_w: int) -> float:
    """Bytes saved for backward per layer per token (see the module docstring)."""
    H, mlp, kv = shape.hidden, shape.intermediate, shape.kv
    if shape.family == "rms":
        return 7 * H * 4 + (H + 2 * kv + 4 * mlp) * s_a
    # the Python-arithmetic tanh GELU keeps 3 more I-wide intermediates than the fused kernel (measured)
    return 2 * H * (4 if autocast else s_w) + (10 * H + (1 if shape.fused_gelu else 4) * mlp) * s_a


def attention_mask_bytes(width: int, s_a: int) -> float:
    """Bytes per token per layer of the attention mask a padded or packed batch of width ``width`` (T) costs:
    transformers passes SDPA a boolean ``(rows, 1, T, T)`` mask and each layer's SDPA turns it into an additive
    one in the query's dtype, saved for backward: ``T * s_a`` per token. Traced with transformers 5.24 and
    torch 2.13 on CPU (Llama- and GPT-2-style blocks, 8 x 200 tokens, padded and packed, float32 and bf16
    autocast): one such tensor per layer at the step's peak, one with checkpointing (the recomputed block's)."""
    return width * s_a


def backward_workspace_bytes(shape: ModelShape, s_a: int) -> float:
    """Bytes per token alive only inside one block's backward beyond what the forward saved: about the
    gradient of the block's input and of its MLP's hidden layer, ``(H + I) * s_a``. Traced (fp32, 16 rows x
    384 tokens, Llama-, GPT-2- and BERT-style blocks of H 384-576, I 1536, with and without checkpointing,
    LoRA and full fine-tuning: bench/RESULTS.md, "The step's backward, traced"); the ``3 (H + I)`` counted
    before over-planned every one."""
    return (shape.hidden + shape.intermediate) * s_a


def no_grad_intermediate_bytes(shape: ModelShape, s_a: int) -> float:
    """Bytes per token of one layer's intermediates in a no-grad forward (nothing saved for backward): two
    H-wide tensors and three I-wide at the MLP's widest moment, ``(2H + 3I) * s_a`` (a gated MLP: activation,
    up projection and their product; traced on the tiny PPO's GPT-2 experience pass: three I-wide tensors
    alive at its peak, where ``2I`` had been counted)."""
    return (2 * shape.hidden + 3 * shape.intermediate) * s_a
