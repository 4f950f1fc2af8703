"""Memory planner: the peak accelerator memory of a run, estimated from its configs before anything loads.

    rlhf-lit plan --config configs/ppo/llama3_8b_qlora.yaml --config configs/trainer/single_gpu_qlora.yaml \\
        [--device-memory-gb 24] [--model-config path/to/config.json]

The model is read as a config only: ``tiny`` dicts, a folder's ``config.json``, GGUF metadata, or the
``rlhf_lit.json`` of an export; a hub id that is not cached (offline) is taken from ``--model-config`` or a
small table of known architectures (the output says which). The architecture is then built on the
``meta`` device (shapes, no storage) to count parameters exactly: embeddings, the Linear layers of the
transformer blocks (what 4-bit quantizes and LoRA adapts), the rest.

Notation: N parameters; L layers, H hidden size, I MLP width, kv = key/value width (n_kv_heads x head_dim),
V vocabulary; B examples per micro-batch (sequences, pairs, prompts), T tokens per sequence (P prompt + R
response in PPO); s_w weight
bytes (4 fp32, 2 bf16/fp16), s_a activation bytes (2 under bf16-mixed or a 4-bit base computing in bf16,
else s_w); W data-parallel ranks (FSDP divides weights, gradients and optimizer states by W).

Formulae (bytes; every figure per device):

* base weights: ``N * s_w``; 4-bit NF4 with double quantization (bitsandbytes): the block Linear weights at
  ``0.5 + 1/64 + 1/4096`` bytes per parameter (packed nibbles + an 8-bit absmax per 64 + an fp32 absmax per
  256 absmax), everything else (embeddings, LM head, norms, biases) at 4 bytes, because
  ``peft.prepare_model_for_kbit_training`` upcasts the non-quantized parameters to fp32.
* LoRA: ``r * (in + out)`` parameters per adapted Linear, fp32 (peft keeps adapters fp32), per adapter
  (PPO: actor, critic unless ``shared_trunk``, plus a reward adapter in ``adapter`` mode).
* scalar heads: ``H + 1`` fp32 parameters each.
* gradients: one fp32 copy of every trainable parameter (weight dtype for full fine-tuning).
* optimizer: AdamW two moments at the parameter dtype, ``8`` bytes per fp32 parameter; the bitsandbytes
  8-bit variants ``2`` bytes (paged ones may spill to host memory; counted in full here).
* activations saved for backward, per layer per token, measured on the transformers 5.x implementations
  (saved-tensor hooks on 1- and 3-layer models, H = 128; attention by SDPA, which keeps no T x T score matrix):
  Llama-style blocks (RMSNorm, gated MLP): ``7H`` elements in fp32 (RMSNorm upcasts) + ``H + 2kv + 4I``
  at s_a; GPT-2-style blocks (LayerNorm, GELU MLP): ``2H`` at 4 bytes under autocast (else s_a) +
  ``10H + 4I`` at s_a, ``10H + I`` when the tanh GELU runs as one kernel (``fused_activations``); BERT-style
  encoders (``shapes.BERT_LAYER_TYPES``: LayerNorm, an erf GELU that is one kernel) as GPT-2-style blocks with
  the fused GELU (traced MiniLM-L6, fp32, 32 x 251 tokens: within 3 % without checkpointing). Each adds the
  attention mask of a padded or packed batch: SDPA turns transformers' boolean ``(B, 1, T, T)`` mask into an
  additive one in every layer and saves it, ``T * s_a`` per token (``formulas.attention_mask_bytes``). Whole
  model: ``B * T * L * per_layer``. With gradient checkpointing only each block's input is kept,
  ``B * T * L * H * s_r`` (s_r: the residual stream's bytes), plus one block recomputed in full:
  ``B * T * per_layer``. Both add the backward's workspace inside one block, ``B * T * (H + I) * s_a``
  (``formulas.backward_workspace_bytes``).
* when the gradients are alive (SFT, reward, DPO under Lightning's automatic optimization): the last step's
  until ``zero_grad`` just before backward, so the step's peak is the larger of the forward's end (saved
  activations + all gradients) and the backward's (saved + recomputed block + workspace + one block's
  gradients, ``grads / L``); with ``trainer.accumulate_grad_batches`` > 1 all of them in both. Traced (fp32,
  16 rows x 384 tokens, Llama-, GPT-2- and BERT-style blocks of H 384-576, I 1536, each with and without
  checkpointing, LoRA and full fine-tuning): 0.93-1.20 of the measured peak, against 1.06-1.59 before these
  two terms (bench/RESULTS.md, "The step's backward, traced").
* autocast weight copies: under bf16-mixed with fp32 (non-4-bit) weights every block Linear weight is cast
  to bf16 and the copy is saved for backward: ``2 * N_linear`` per training forward (one block's worth with
  checkpointing); a 4-bit base dequantizes one layer at a time: ``2 * N_linear / L``.
* logits (the LM head output; only the R response positions in PPO): ``B * T * V * 2 * s_a`` for the loss
  with its backward: the logits and their gradient, at the logits' dtype. The selective log-prob and the
  entropy (``rlhf_lit.functional``, docs/pitfalls.md: vocabulary memory) work on pieces of a few positions in fp32 and recompute the
  softmax in the backward, so they keep no full-size copy (a full log-softmax, ``B * T * V * 4``, is
  reported as the saving); PPO's entropy bonus, when ``ppo.entropy_coef`` is not 0, adds its own gradient
  and autograd's sum of the two: ``+ 2 * s_a``.
* KV cache (PPO rollout): ``2 * L * B_rollout * (P + R) * kv * s_a``, plus the prefill's transient
  ``B_rollout * P * (2H + 3I) * s_a`` (a no-grad forward's intermediates, below) and per-step logits ``3 * B_rollout * V * 4``.
* separate reward model: its weights as above; its forward is no-grad and short-lived.
* DPO (``rlhf_lit.modules.DPOModule``; KTO too): one forward over ``rows = 2B`` sequences for a paired loss
  (chosen and rejected stacked, ``rlhf_lit.modules.dpo.sequences``), ``rows = B`` for KTO's unpaired rows; the
  loss tables of ``rlhf_lit.functional.preference`` say which is which. Logits are made for response positions
  only (``response_logps_from_hidden``): ``rows * R * V * 2 * s_a``, R the response tokens per row, which
  the data decides: the planner bounds it by ``T - 1`` (at most T - 1 positions score a token; the row's note
  says so). The reference runs first, one no-grad forward over the same rows whose intermediates are freed
  before the policy's graph exists, so it is a phase of its own, sized like PPO's experience forwards:
  ``rows * T * (2H + 3I) * s_a + rows * T * H * 4 + rows * R * V * s_a`` (``formulas.no_grad_intermediate_bytes``)
  + the boolean mask and one layer's additive copy, ``rows * T * T * (1 + s_a)``; with ``reference_cache`` it runs only
  while the cache is first written (before training), a reference-free loss (``simpo``) has none.
  ``reference_copy`` (full fine-tuning) holds a second frozen copy of the weights: ``+ N * s_w``.
  The plan is of the worst batch, every row ``T`` long: ``packing`` (rows end to end, no padding) and
  ``trim_padding`` (rows grouped by length, each group cut to its longest row) then save nothing; on batches
  whose rows vary it runs below the plan (the DPO benchmark's live tensors with trimming: 304 -> 162 MB).

Peak = weights + adapters + heads + reward model + reference copy + optimizer + the largest phase: SFT /
reward / DPO step (weight copies + logits + the larger of the forward's end and the backward's peak, above); DPO reference forward; PPO rollout (KV
cache + prefill); PPO experience (no-grad forwards over ``rollout_forward_batch_size`` rows: one layer's
intermediates + the response logits); PPO update (micro-batch activations of one forward; with a separate critic adapter on several
processes of two, because there the actor's backward cannot run before the critic's forward + weight copies
+ response logits + gradients). FSDP adds the largest gathered unit.

Not modelled: the CUDA context and allocator fragmentation (the "fits" line adds 10 % + 1 GiB for them; on a
CPU, 10 % + 0.6 GiB for the host process: interpreter, libraries, tokenizer, data — ``HOST_PROCESS_BYTES``;
``formulas.needed_bytes``), glibc's heap on a CPU at its dynamic mmap threshold, which keeps freed activations
resident (the shipped SmolLM2 configs peaked at up to 2x the "fits" figure; a note says so unless a ``HeapTrim``
in ``trainer.callbacks`` fixes ``mmap_threshold``: docs/scale.md, "Plan vs measured"),
the optimizer's temporary buffers during ``step`` (foreach AdamW: about one more copy of the trainable
parameters), dataloader tensors, the prompt/response buffers (KBs), and activation memory of attention
implementations that do store the T x T matrix (``attn_implementation: eager``).

Modules: ``settings`` (the configs, read by the CLI's own parser), ``shapes`` (parameter counts on the meta
device), ``formulas``, ``estimate`` (the breakdown), ``report`` (text, JSON, the command).

Validation: ``tests/test_planner.py`` runs the tiny (SFT, reward, PPO, DPO, KTO) and SmolLM2 configs on the
CPU and compares this estimate with the measured peak of live tensor bytes (a dispatch mode that records every
tensor storage created and freed: what ``torch.cuda.max_memory_allocated`` counts on a GPU), with the same
batch shapes.
"""

from __future__ import annotations

import importlib
from typing import Any

# These three import nothing heavy; the settings (read through the CLI's parser) and the shapes (which build
# the model on the meta device) are imported on first use (PEP 562), so ``rlhf-lit plan --help`` stays light.
from rlhf_lit.planner.estimate import Estimate, estimate
from rlhf_lit.planner.formulas import (
    DTYPE_BYTES,
    NF4_BYTES_PER_PARAM,
    GiB,
    MiB,
    activation_bytes,
    attention_mask_bytes,
    layer_activation_bytes,
    loss_bytes,
    weights_bytes,
)
from rlhf_lit.planner.report import main, plan, report

_weights_bytes = weights_bytes  # the name tests/test_planner.py uses

_LAZY = {
    "KNOWN_ARCHITECTURES": "rlhf_lit.models.architecture",
    "RunSettings": "rlhf_lit.planner.settings",
    "read_settings": "rlhf_lit.planner.settings",
    "settings_from_config": "rlhf_lit.planner.settings",
    "ModelShape": "rlhf_lit.planner.shapes",
    "model_shape": "rlhf_lit.planner.shapes",
}

__all__ = [
    "DTYPE_BYTES",
    "KNOWN_ARCHITECTURES",
    "NF4_BYTES_PER_PARAM",
    "Estimate",
    "GiB",
    "MiB",
    "ModelShape",
    "RunSettings",
    "activation_bytes",
    "attention_mask_bytes",
    "estimate",
    "layer_activation_bytes",
    "loss_bytes",
    "main",
    "model_shape",
    "plan",
    "read_settings",
    "report",
    "settings_from_config",
    "weights_bytes",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
