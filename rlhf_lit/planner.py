"""Memory planner: the peak accelerator memory of a run, estimated from its configs before anything loads.

    rlhf-lit plan --config configs/ppo/llama3_8b_qlora.yaml --config configs/trainer/single_gpu_qlora.yaml \\
        [--device-memory-gb 24] [--model-config path/to/config.json]

The model is read as a config only: ``tiny`` dicts, a folder's ``config.json``, GGUF metadata, or the
``rlhf_lit.json`` of an export; a hub id that is not cached (offline) is taken from ``--model-config`` or a
small table of known architectures (the output says which). The architecture is then built on the
``meta`` device (shapes, no storage) to count parameters exactly: embeddings, the Linear layers of the
transformer blocks (what 4-bit quantizes and LoRA adapts), the rest.

Notation: N parameters; L layers, H hidden size, I MLP width, kv = key/value width (n_kv_heads x head_dim),
V vocabulary; B sequences per micro-batch, T tokens per sequence (P prompt + R response in PPO); s_w weight
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
  (saved-tensor hooks on 1- and 3-layer models, H = 128; attention by SDPA, which keeps no T x T matrix):
  Llama-style blocks (RMSNorm, gated MLP): ``7H`` elements in fp32 (RMSNorm upcasts) + ``H + 2kv + 4I``
  at s_a; GPT-2-style blocks (LayerNorm, GELU MLP): ``2H`` at 4 bytes under autocast (else s_a) +
  ``10H + 4I`` at s_a, ``10H + I`` when the tanh GELU runs as one kernel (``fused_activations``). Whole
  model: ``B * T * L * per_layer``. With gradient checkpointing only each block's input is kept,
  ``B * T * L * H * s_r`` (s_r: the residual stream's bytes), plus one block recomputed in full:
  ``B * T * per_layer``.
* autocast weight copies: under bf16-mixed with fp32 (non-4-bit) weights every block Linear weight is cast
  to bf16 and the copy is saved for backward: ``2 * N_linear`` per training forward (one block's worth with
  checkpointing); a 4-bit base dequantizes one layer at a time: ``2 * N_linear / L``.
* logits (the LM head output; only the R response positions in PPO): ``B * T * V * 2 * s_a`` for the loss
  with its backward: the logits and their gradient, at the logits' dtype. The selective log-prob and the
  entropy (``rlhf_lit.functional``, PITFALLS B21) work on pieces of a few positions in fp32 and recompute the
  softmax in the backward, so they keep no full-size copy (a full log-softmax, ``B * T * V * 4``, is
  reported as the saving); PPO's entropy bonus, when ``ppo.entropy_coef`` is not 0, adds its own gradient
  and autograd's sum of the two: ``+ 2 * s_a``.
* KV cache (PPO rollout): ``2 * L * B_rollout * (P + R) * kv * s_a``, plus the prefill's transient
  ``B_rollout * P * (2H + 2I) * s_a`` and per-step logits ``3 * B_rollout * V * 4``.
* separate reward model: its weights as above; its forward is no-grad and short-lived.

Peak = weights + adapters + heads + reward model + optimizer + the largest phase: SFT / reward step
(activations + weight copies + logits + gradients); PPO rollout (KV cache + prefill); PPO experience
(no-grad forwards over ``rollout_forward_batch_size`` rows: one layer's intermediates + the response
logits); PPO update (micro-batch activations of one forward; with a separate critic adapter on several
processes of two, because there the actor's backward cannot run before the critic's forward + weight copies
+ response logits + gradients). FSDP adds the largest gathered unit.

Not modelled: the CUDA context and allocator fragmentation (the "fits" line adds 10 % + 1 GiB for them),
the optimizer's temporary buffers during ``step`` (foreach AdamW: about one more copy of the trainable
parameters), dataloader tensors, the prompt/response buffers (KBs), and activation memory of attention
implementations that do store the T x T matrix (``attn_implementation: eager``).

Validation: ``tests/test_planner.py`` runs the tiny and SmolLM2 configs on the CPU and compares this
estimate with the measured peak of live tensor bytes (a dispatch mode that records every tensor storage
created and freed: what ``torch.cuda.max_memory_allocated`` counts on a GPU), with the same batch shapes.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlhf_lit.models.backbone import BackboneConfig, resolve_path
from rlhf_lit.stage_outputs import not_written_yet, producing_config

GiB = 1024**3
MiB = 1024**2
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 1 / 4096
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Architectures a hub id may name when its config cannot be read offline (published config.json values).
_LLAMA3_8B: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
KNOWN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "meta-llama/meta-llama-3-8b": _LLAMA3_8B,
    "meta-llama/llama-3.1-8b": {**_LLAMA3_8B, "max_position_embeddings": 131072},
    "mistralai/mistral-7b": {
        "model_type": "mistral",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32768,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "qwen/qwen2.5-7b": {
        "model_type": "qwen2",
        "num_hidden_layers": 28,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "huggingfacetb/smollm2-135m": {
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}


# ------------------------------------------------------------------ the model's shape
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


def _hf_config(backbone: BackboneConfig, model_config: str | None):
    """(transformers config, where it came from) for a backbone, reading no weights."""
    from transformers import AutoConfig

    if model_config:
        path = Path(model_config)
        spec = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        return AutoConfig.for_model(spec.pop("model_type"), **spec), f"--model-config {model_config}"
    if backbone.tiny is not None:
        from rlhf_lit.models.backbone import _tiny_config, load_backbone_tokenizer

        return _tiny_config(backbone, load_backbone_tokenizer(backbone)), "tiny config"
    name = backbone.name_or_path
    path = resolve_path(name)
    if os.path.isdir(path):
        meta_file = os.path.join(path, "rlhf_lit.json")
        if not os.path.exists(os.path.join(path, "config.json")) and os.path.exists(meta_file):
            base = json.loads(Path(meta_file).read_text()).get("base") or {}
            base = {**base, "lora": None}
            config, source = _hf_config(BackboneConfig(**base), None)
            return config, f"{source} (base of the export {name})"
        kwargs = {"gguf_file": backbone.gguf_file} if backbone.gguf_file else {}
        return AutoConfig.from_pretrained(
            path, **kwargs
        ), f"{'GGUF metadata' if kwargs else 'config.json'} in {path}"
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True), f"cached hub config {name}"
    except Exception:  # noqa: BLE001 - offline and not cached: fall through to the table
        pass
    key = name.lower()
    for known, spec in KNOWN_ARCHITECTURES.items():
        if key.startswith(known):
            spec = dict(spec)
            return AutoConfig.for_model(
                spec.pop("model_type"), **spec
            ), f"built-in table entry {known!r} (offline)"
    raise ValueError(
        f"cannot read the config of {name!r} offline and it is not in the planner's table; "
        "pass --model-config <config.json>"
    )


def model_shape(backbone: BackboneConfig, model_config: str | None = None) -> ModelShape:
    """Count an architecture's parameters on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    config, source = _hf_config(backbone, model_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out_emb = model.get_output_embeddings()
    names = set(getattr(model, "_no_split_modules", None) or [])
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


# ------------------------------------------------------------------ the run's settings
@dataclass
class RunSettings:
    """What the estimate depends on, read from the stacked configs (each field can be overridden)."""

    stage: str  # sft | reward | ppo
    backbone: BackboneConfig
    precision: str = "32-true"
    world_size: int = 1
    sharded: bool = False
    optimizer: str = "adamw"
    batch_size: int = (
        8  # sequences per micro-batch (SFT), pairs per batch (reward), prompts per rollout (PPO)
    )
    seq_len: int = 512  # T (SFT, reward)
    prompt_len: int = 256  # P (PPO)
    response_len: int = 48  # R (PPO)
    ppo_micro_batch: int = 4
    rollout_forward_batch: int | None = None
    logprob_chunk: int | None = None
    entropy_coef: float = 0.0
    shared_critic: bool = False
    critic_lora: dict | None = None
    reward_mode: str | None = None  # separate | adapter (PPO)
    reward_backbone: BackboneConfig | None = None
    reward_load_in_4bit: bool | None = None
    reward_dtype: str | None = None


def _deep_merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            if "class_path" in v and out[k].get("class_path") not in (None, v["class_path"]):
                out[k] = copy.deepcopy(v)  # another class: its arguments replace the old ones
            else:
                out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def load_stacked(configs: list[str]) -> dict:
    """The configs merged in order (later keys win), as LightningCLI stacks ``--config`` files."""
    merged: dict = {}
    for path in configs:
        merged = _deep_merge(merged, yaml.safe_load(Path(path).read_text()) or {})
    return merged


def _export_backbone(path: str, configs_root: Path) -> BackboneConfig | None:
    """The backbone an export folder was (or will be) made from: its rlhf_lit.json, else the stage config
    under ``configs/`` whose ``export_dir`` is that folder (``rlhf_lit.stage_outputs``)."""
    meta_file = Path(path) / "rlhf_lit.json"
    if meta_file.exists():
        base = json.loads(meta_file.read_text()).get("base")
        if base:
            return BackboneConfig(**{**base, "lora": None})
    found_config = producing_config(path, configs_root)
    init = ((found_config[1].get("model") or {}).get("init_args") or {}) if found_config else {}
    if init.get("backbone"):
        found = BackboneConfig(**{**init["backbone"], "lora": None})
        if found.name_or_path and not_written_yet(found.name_or_path):
            return _export_backbone(found.name_or_path, configs_root) or found
        return found
    return None


def settings_from_config(spec: dict, configs_root: Path | None = None) -> RunSettings:
    """Read the stage, the model and the shapes that matter from a merged config dict."""
    configs_root = configs_root or Path("configs")
    model = spec.get("model") or {}
    init = model.get("init_args") or {}
    class_path = model.get("class_path", "")
    stage = "ppo" if "PPO" in class_path else "reward" if "Reward" in class_path else "sft"
    backbone_spec = dict(init.get("backbone") or {})
    backbone = BackboneConfig(**backbone_spec)
    if backbone.name_or_path and not_written_yet(backbone.name_or_path):
        found = _export_backbone(backbone.name_or_path, configs_root)
        if found is not None:  # where the weights come from; how they are held stays this run's
            source = {
                k: getattr(found, k) for k in ("name_or_path", "gguf_file", "tiny", "tokenizer", "seed")
            }
            backbone = BackboneConfig(**{**backbone_spec, **source})
    trainer = spec.get("trainer") or {}
    data = (spec.get("data") or {}).get("init_args") or {}
    strategy = trainer.get("strategy", "auto")
    strategy_name = json.dumps(strategy).lower()
    devices = trainer.get("devices", 1)
    world = int(devices) if isinstance(devices, int) and devices > 0 else 1
    world *= int(trainer.get("num_nodes", 1) or 1)
    settings = RunSettings(
        stage=stage,
        backbone=backbone,
        precision=str(trainer.get("precision", "32-true")),
        world_size=world,
        sharded=any(k in strategy_name for k in ("fsdp", "modelparallel")),
        optimizer=(init.get("optimizer") or {}).get("name", "adamw"),
        batch_size=int(data.get("batch_size", 8)),
        seq_len=int(data.get("max_length", 512)),
    )
    if stage == "ppo":
        ppo = init.get("ppo") or {}
        sampling = init.get("sampling") or {}
        critic = init.get("critic") or {}
        reward_model = init.get("reward_model") or {}
        settings.prompt_len = int(data.get("max_prompt_length") or data.get("pad_to_length") or 256)
        settings.response_len = int(sampling.get("max_new_tokens", 48))
        settings.ppo_micro_batch = int(ppo.get("micro_batch_size") or ppo.get("ppo_minibatch_size", 4))
        settings.rollout_forward_batch = ppo.get("rollout_forward_batch_size")
        settings.logprob_chunk = ppo.get("logprob_chunk_size")
        settings.entropy_coef = float(ppo.get("entropy_coef") or 0.0)
        settings.shared_critic = bool(critic.get("shared_trunk", False))
        settings.critic_lora = critic.get("lora") or {"r": 8, "target_modules": "all-linear"}
        settings.reward_mode = reward_model.get("mode", "separate")
        settings.reward_dtype = reward_model.get("dtype")
        settings.reward_load_in_4bit = reward_model.get("load_in_4bit")
        if reward_model.get("backbone"):
            settings.reward_backbone = BackboneConfig(**{**reward_model["backbone"], "lora": None})
        elif reward_model.get("path") and settings.reward_mode == "separate":
            settings.reward_backbone = _export_backbone(reward_model["path"], configs_root)
    return settings


# ------------------------------------------------------------------ the estimate
@dataclass
class Estimate:
    """Bytes per component (per device), the phase totals, and the peak."""

    settings: RunSettings
    shape: ModelShape
    rows: list[tuple[str, float, str]] = field(default_factory=list)  # (component, bytes, note)
    phases: dict[str, float] = field(default_factory=dict)
    static: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return self.static + max(self.phases.values(), default=0.0)

    def add(self, name: str, nbytes: float, note: str = "") -> float:
        self.rows.append((name, float(nbytes), note))
        return float(nbytes)


def _weights_bytes(
    shape: ModelShape, cfg: BackboneConfig, dtype_override: str | None = None, four_bit=None
) -> float:
    four_bit = cfg.load_in_4bit if four_bit is None else four_bit
    if four_bit:
        return (
            shape.block_linear_params * NF4_BYTES_PER_PARAM
            + (shape.num_params - shape.block_linear_params) * 4
        )
    return shape.num_params * _DTYPE_BYTES[dtype_override or cfg.dtype]


def _activation_dtype(s: RunSettings) -> int:
    """s_a: bytes of the activations the matmuls produce."""
    if "16" in s.precision:  # bf16-mixed, 16-mixed, bf16-true, 16-true
        return 2
    return _DTYPE_BYTES[s.backbone.dtype]  # a 4-bit base computes in backbone.dtype


def _loss_bytes(s_a: int) -> int:
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


def estimate(settings: RunSettings, shape: ModelShape, reward_shape: ModelShape | None = None) -> Estimate:
    """The breakdown and the peak of one run (see the module docstring for every formula)."""
    s, est = settings, Estimate(settings, shape)
    cfg = s.backbone
    W = s.world_size if s.sharded else 1
    autocast = "mixed" in s.precision
    s_w = _DTYPE_BYTES[cfg.dtype]
    s_a = _activation_dtype(s)
    s_r = 4 if (cfg.load_in_4bit or s_w == 4) else s_w  # residual stream (fp32 after prepare_for_kbit)
    L, H, V = shape.num_layers, shape.hidden, shape.vocab

    # -- static: weights, adapters, heads, reward model
    static = est.add(
        "base weights",
        _weights_bytes(shape, cfg) / W,
        f"{shape.num_params / 1e6:,.1f} M params, {'NF4 (+fp32 non-quantized)' if cfg.load_in_4bit else cfg.dtype}",
    )
    lora_params = shape.lora_params(cfg.lora.r, cfg.lora.target_modules) if cfg.lora else 0
    trainable = 0
    if s.stage == "ppo":
        critic_lora = s.critic_lora or {}
        critic_params = (
            0
            if s.shared_critic
            else shape.lora_params(critic_lora.get("r", 8), critic_lora.get("target_modules", "all-linear"))
        )
        trainable = lora_params + critic_params + H + 1
        reward_adapter = lora_params if s.reward_mode == "adapter" else 0
        static += est.add(
            "LoRA adapters (fp32)",
            (lora_params + critic_params + reward_adapter) * 4 / W,
            f"actor {lora_params / 1e6:.2f} M"
            + ("" if s.shared_critic else f", critic {critic_params / 1e6:.2f} M")
            + (f", reward {reward_adapter / 1e6:.2f} M (frozen)" if reward_adapter else ""),
        )
        static += est.add(
            "value head (+ reward head)", (H + 1) * 4 * (2 if s.reward_mode == "adapter" else 1), "fp32"
        )
        if s.reward_mode == "separate" and reward_shape is not None:
            rcfg = s.reward_backbone
            rbytes = _weights_bytes(
                reward_shape,
                rcfg,
                s.reward_dtype or rcfg.dtype,
                s.reward_load_in_4bit if s.reward_load_in_4bit is not None else rcfg.load_in_4bit,
            )
            static += est.add(
                "reward model (separate, frozen)",
                rbytes / W + (reward_shape.hidden + 1) * 4,
                f"{reward_shape.num_params / 1e6:,.1f} M params",
            )
    else:
        if cfg.lora:
            trainable = lora_params
            static += est.add(
                "LoRA adapter (fp32)",
                lora_params * 4 / W,
                f"{lora_params / 1e6:.2f} M params, r={cfg.lora.r}",
            )
        else:
            trainable = shape.num_params
            est.notes.append("full fine-tuning: every base parameter is trainable")
        if s.stage == "reward":
            trainable += H + 1
            static += est.add("reward head", (H + 1) * 4, "fp32")
    grad_bytes_per = 4 if (cfg.lora or s.stage == "ppo") else s_w
    opt_per = {"adamw": 2 * grad_bytes_per, "adamw_8bit": 2.0, "paged_adamw_8bit": 2.0}[s.optimizer]
    static += est.add(
        f"optimizer state ({s.optimizer})",
        trainable * opt_per / W,
        f"{trainable / 1e6:.2f} M trainable params",
    )
    grads = trainable * grad_bytes_per / W
    if s.sharded and W > 1:  # all-gathered while in use: one block, and the root unit (embeddings, head)
        block = shape.block_linear_params / L * s_w
        root = (shape.num_params - shape.block_linear_params) * s_w
        static += est.add("FSDP gathered units", block + root, "one transformer block + the root unit")

    # -- per-phase transients
    per_layer = layer_activation_bytes(shape, s_a, autocast, s_w)
    ckpt = cfg.gradient_checkpointing

    workspace = (3 * H + 3 * shape.intermediate) * s_a  # per token: gradients inside one block's backward

    def activations(tokens: int, forwards: int = 1) -> tuple[float, float, float]:
        outside = tokens * 3 * H * s_r  # embedding output, final norm, its output
        full = forwards * (tokens * L * per_layer + outside) + tokens * workspace
        with_ckpt = forwards * (tokens * L * H * s_r + outside) + tokens * (per_layer + workspace)
        return (with_ckpt if ckpt else full), full, with_ckpt

    def weight_copies(forwards: int) -> float:
        if cfg.load_in_4bit:
            return 2 * shape.block_linear_params / L
        if autocast and s_w == 4:
            return 2 * shape.block_linear_params * (1 / L if ckpt else 1) * forwards / W
        return 0.0

    if s.stage in ("sft", "reward"):
        rows = s.batch_size * (2 if s.stage == "reward" else 1)
        tokens = rows * s.seq_len
        act, full, with_ckpt = activations(tokens)
        est.add(
            "activations (training step)",
            act,
            f"{rows} x {s.seq_len} tokens; without checkpointing {full / GiB:.2f} GiB, with {with_ckpt / GiB:.2f} GiB",
        )
        copies = (
            est.add("autocast weight copies", weight_copies(1), "bf16 casts saved for backward")
            if weight_copies(1)
            else 0.0
        )
        logits = 0.0
        if s.stage == "sft":
            logits = est.add(
                "logits + loss",
                tokens * V * _loss_bytes(s_a),
                f"B x T x V = {rows} x {s.seq_len} x {V}; a full log_softmax would add {tokens * V * 4 / GiB:.2f} GiB",
            )
        est.add("gradients", grads, "fp32" if grad_bytes_per == 4 else cfg.dtype)
        est.phases["training step"] = act + copies + logits + grads
    else:
        B, P, R, m = s.batch_size, s.prompt_len, s.response_len, s.ppo_micro_batch
        T = P + R
        kv_cache = est.add(
            "KV cache (rollout)",
            2 * L * B * T * shape.kv * s_a,
            f"2 x L x {B} x {T} tokens x kv {shape.kv}",
        )
        prefill = B * P * (2 * H + 2 * shape.intermediate) * s_a + 3 * B * V * 4
        est.phases["rollout"] = kv_cache + prefill
        f = s.rollout_forward_batch or B
        # explicit logprob_chunk_size rows: two fp32 temporaries of that many rows; by default a few positions
        pieces = min(s.logprob_chunk, f) * R * V * 8 if s.logprob_chunk else 0
        experience = f * T * (2 * H + 2 * shape.intermediate) * s_a + f * T * H * 4 + f * R * V * s_a + pieces
        est.add(
            "experience forwards (no grad)", experience, f"{f} rows; logits over R={R} response positions"
        )
        est.phases["experience"] = experience
        # one process: the actor's backward runs before the critic's forward (PPOModule._update), so only
        # one forward's activations are alive; several processes keep both (DDP needs one backward)
        forwards = 1 if s.shared_critic or s.world_size == 1 else 2
        act, full, with_ckpt = activations(m * T, forwards)
        est.add(
            "activations (PPO micro-batch)",
            act,
            f"{m} x {T} tokens x {forwards} forward(s); without checkpointing {full / GiB:.2f} GiB, with {with_ckpt / GiB:.2f} GiB",
        )
        copies = weight_copies(forwards)
        if copies:
            est.add("autocast weight copies", copies, "bf16 casts saved for backward")
        logits = est.add(
            "response logits + loss + entropy",
            m * R * V * (_loss_bytes(s_a) + (2 * s_a if s.entropy_coef else 0)),
            f"{m} x {R} x {V}; a full log_softmax would add {m * R * V * 4 / GiB:.2f} GiB",
        )
        est.add("gradients", grads, "fp32")
        est.phases["update"] = act + copies + logits + grads
    est.static = static
    return est


def _fmt(nbytes: float) -> str:
    return f"{nbytes / GiB:8.3f} GiB" if nbytes >= 0.1 * GiB else f"{nbytes / MiB:8.2f} MiB"


def report(est: Estimate, device_memory_gb: float | None = None) -> str:
    s, shape = est.settings, est.shape
    lines = [
        f"rlhf-lit plan: {s.stage} stage, model {shape.name} ({shape.source})",
        f"  {shape.num_params / 1e6:,.1f} M params, L={shape.num_layers} H={shape.hidden} I={shape.intermediate} "
        f"kv={shape.kv} V={shape.vocab}; precision {s.precision}; {s.world_size} device(s)"
        + (" sharded (FSDP)" if s.sharded else ""),
        "",
        f"  {'component':<36} {'memory':>12}   note",
        f"  {'-' * 36} {'-' * 12}   {'-' * 30}",
    ]
    for name, nbytes, note in est.rows:
        lines.append(f"  {name:<36} {_fmt(nbytes):>12}   {note}")
    lines.append(f"  {'-' * 36} {'-' * 12}")
    lines.append(f"  {'static (weights, adapters, optimizer)':<36} {_fmt(est.static):>12}")
    for phase, nbytes in est.phases.items():
        lines.append(
            f"  {'+ ' + phase:<36} {_fmt(nbytes):>12}   peak in this phase {_fmt(est.static + nbytes).strip()}"
        )
    lines.append(f"  {'estimated peak':<36} {_fmt(est.peak):>12}")
    for note in est.notes:
        lines.append(f"  note: {note}")
    if device_memory_gb:
        need = est.peak * 1.10 + GiB
        verdict = "fits" if need <= device_memory_gb * GiB else "does NOT fit"
        lines.append(
            f"  {verdict} in {device_memory_gb:g} GiB: needs ~{need / GiB:.2f} GiB with 10 % allocator slack + 1 GiB CUDA context"
        )
    return "\n".join(lines)


def plan(configs: list[str], model_config: str | None = None, overrides: dict | None = None) -> Estimate:
    """Estimate the run that ``rlhf-lit fit --config <configs...>`` would start."""
    spec = load_stacked(configs)
    root = Path(configs[0]).resolve().parent
    while root.name and root.name != "configs" and root.parent != root:
        root = root.parent
    settings = settings_from_config(spec, root if root.name == "configs" else Path("configs"))
    for key, value in (overrides or {}).items():
        setattr(settings, key, value)
    shape = model_shape(settings.backbone, model_config)
    reward_shape = None
    if (
        settings.stage == "ppo"
        and settings.reward_mode == "separate"
        and settings.reward_backbone is not None
    ):
        reward_shape = model_shape(settings.reward_backbone)
    return estimate(settings, shape, reward_shape)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlhf-lit plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True, help="a config; repeat to stack them")
    parser.add_argument("--device-memory-gb", type=float, default=None, help="say whether the run fits")
    parser.add_argument("--model-config", default=None, help="a config.json (or its folder) for the model")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="processes (default: trainer.devices x num_nodes; -1 counts as 1)",
    )
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    args = parser.parse_args(argv)
    est = plan(args.config, args.model_config, {"world_size": args.world_size} if args.world_size else None)
    if args.json:
        print(
            json.dumps(
                {
                    "peak_bytes": est.peak,
                    "static_bytes": est.static,
                    "phases": est.phases,
                    "rows": [{"component": n, "bytes": b, "note": t} for n, b, t in est.rows],
                },
                indent=2,
            )
        )
    else:
        print(report(est, args.device_memory_gb))
