"""The estimate: bytes per component (per device), the phase totals and the peak (formulae: ``rlhf_lit.planner``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlhf_lit.planner.formulas import (
    DTYPE_BYTES,
    GiB,
    activation_bytes,
    attention_mask_bytes,
    backward_workspace_bytes,
    layer_activation_bytes,
    loss_bytes,
    no_grad_intermediate_bytes,
    weights_bytes,
)

if TYPE_CHECKING:  # annotations only: importing the estimate reads no model code
    from rlhf_lit.planner.settings import RunSettings
    from rlhf_lit.planner.shapes import ModelShape

__all__ = ["Estimate", "estimate"]


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


@dataclass
class _Sizes:
    """The byte sizes every formula uses: W ranks sharing the weights, s_w weights, s_a activations, s_r the
    residual stream (fp32 after ``prepare_model_for_kbit_training``), and the model's L, H, V."""

    W: int
    autocast: bool
    s_w: int
    s_a: int
    s_r: int

    @classmethod
    def of(cls, s: RunSettings) -> _Sizes:
        cfg = s.backbone
        s_w = DTYPE_BYTES[cfg.dtype]
        return cls(
            W=s.world_size if s.sharded else 1,
            autocast="mixed" in s.precision,
            s_w=s_w,
            s_a=activation_bytes(s.precision, cfg),
            s_r=4 if (cfg.load_in_4bit or s_w == 4) else s_w,
        )


def estimate(settings: RunSettings, shape: ModelShape, reward_shape: ModelShape | None = None) -> Estimate:
    """The breakdown and the peak of one run (see the package docstring for every formula)."""
    est, z = Estimate(settings, shape), _Sizes.of(settings)
    trainable = _static(est, z, reward_shape)
    grad_bytes_per = 4 if (settings.backbone.lora or settings.stage == "ppo") else z.s_w
    opt_per = {"adamw": 2 * grad_bytes_per, "adamw_8bit": 2.0, "paged_adamw_8bit": 2.0}[settings.optimizer]
    est.static += est.add(
        f"optimizer state ({settings.optimizer})",
        trainable * opt_per / z.W,
        f"{trainable / 1e6:.2f} M trainable params",
    )
    grads = trainable * grad_bytes_per / z.W
    if (
        settings.sharded and z.W > 1
    ):  # all-gathered while in use: one block, and the root unit (embeddings, head)
        block = shape.block_linear_params / shape.num_layers * z.s_w
        root = (shape.num_params - shape.block_linear_params) * z.s_w
        est.static += est.add("FSDP gathered units", block + root, "one transformer block + the root unit")
    if settings.stage == "ppo":
        _ppo_phases(est, z, grads)
    else:
        if settings.stage == "dpo" and settings.reference:
            _reference_forward(est, z)
        if settings.stage == "dpo" and (settings.trim_padding or settings.packing):
            est.notes.append(
                f"{'packing' if settings.packing else 'trim_padding'} is on: this is the worst batch (every row as "
                "long as the longest); batches whose rows differ in length peak lower"
            )
        _training_step(est, z, grads, grad_bytes_per)
    if settings.accelerator == "cpu" and settings.mmap_threshold is None:
        est.notes.append(
            "a CPU run at glibc's dynamic mmap threshold keeps freed activations in its heap: the shipped SmolLM2 "
            "configs' peak RSS measured up to 2x the fits figure (docs/scale.md); HeapTrim's mmap_threshold: "
            "1048576 bounds it"
        )
    return est


def _static(est: Estimate, z: _Sizes, reward_shape: ModelShape | None) -> int:
    """Weights, adapters, heads and a separate reward model into ``est.static``; returns the trainable count."""
    s, shape, cfg = est.settings, est.shape, est.settings.backbone
    H = shape.hidden
    est.static = est.add(
        "base weights",
        weights_bytes(shape, cfg) / z.W,
        f"{shape.num_params / 1e6:,.1f} M params, {'NF4 (+fp32 non-quantized)' if cfg.load_in_4bit else cfg.dtype}",
    )
    lora_params = shape.lora_params(cfg.lora.r, cfg.lora.target_modules) if cfg.lora else 0
    if s.stage != "ppo":
        if cfg.lora:
            trainable = lora_params
            est.static += est.add(
                "LoRA adapter (fp32)",
                lora_params * 4 / z.W,
                f"{lora_params / 1e6:.2f} M params, r={cfg.lora.r}",
            )
        else:
            trainable = shape.num_params
            est.notes.append("full fine-tuning: every base parameter is trainable")
        if s.stage == "reward":
            trainable += H + 1
            est.static += est.add("reward head", (H + 1) * 4, "fp32")
        if s.reference_copy:  # DPO under full fine-tuning: a second, frozen copy of the weights
            est.static += est.add(
                "reference copy (frozen)",
                weights_bytes(shape, cfg) / z.W,
                "reference_copy: the weights again",
            )
        return trainable
    critic_lora = s.critic_lora or {}
    critic_params = (
        0
        if s.shared_critic or s.critic_free
        else shape.lora_params(critic_lora.get("r", 8), critic_lora.get("target_modules", "all-linear"))
    )
    reward_adapter = lora_params if s.reward_mode == "adapter" else 0
    est.static += est.add(
        "LoRA adapters (fp32)",
        (lora_params + critic_params + reward_adapter) * 4 / z.W,
        f"actor {lora_params / 1e6:.2f} M"
        + ("" if s.shared_critic or s.critic_free else f", critic {critic_params / 1e6:.2f} M")
        + (f", reward {reward_adapter / 1e6:.2f} M (frozen)" if reward_adapter else ""),
    )
    heads = (0 if s.critic_free else 1) + (1 if s.reward_mode == "adapter" else 0)
    if heads:
        name = "reward head" if s.critic_free else "value head (+ reward head)"
        est.static += est.add(name, (H + 1) * 4 * heads, "fp32")
    if s.reward_mode == "separate" and reward_shape is not None:
        rcfg = s.reward_backbone
        rbytes = weights_bytes(
            reward_shape,
            rcfg,
            s.reward_dtype or rcfg.dtype,
            s.reward_load_in_4bit if s.reward_load_in_4bit is not None else rcfg.load_in_4bit,
        )
        est.static += est.add(
            "reward model (separate, frozen)",
            rbytes / z.W + (reward_shape.hidden + 1) * 4,
            f"{reward_shape.num_params / 1e6:,.1f} M params",
        )
    if s.sampling_copy_dtype:  # CopySampler: the whole weights again in each process, adapters merged in
        est.static += est.add(
            "sampling copy",
            weights_bytes(shape, cfg, s.sampling_copy_dtype, False),
            f"sampling.copy_dtype: {s.sampling_copy_dtype}, adapters merged",
        )
    return lora_params + critic_params + (0 if s.critic_free else H + 1)


@dataclass
class _Activations:
    """Activation bytes of ``tokens`` tokens: ``saved`` for backward through the whole step (every layer's
    intermediates, or with checkpointing each block's input), ``transient`` alive only inside the backward
    (checkpointing's recomputed block, and the gradients inside one block), and the two configurations'
    totals for the rows' notes."""

    saved: float
    transient: float
    full: float
    with_ckpt: float

    @property
    def total(self) -> float:
        return self.saved + self.transient


def _activations(est: Estimate, z: _Sizes, tokens: int, width: int, forwards: int = 1) -> _Activations:
    """Activations saved for backward of ``tokens`` tokens in rows ``width`` wide, as configured, and both
    configurations' totals."""
    shape, ckpt = est.shape, est.settings.backbone.gradient_checkpointing
    L, H = shape.num_layers, shape.hidden
    per_layer = layer_activation_bytes(shape, z.s_a, z.autocast, z.s_w) + attention_mask_bytes(width, z.s_a)
    workspace = tokens * backward_workspace_bytes(shape, z.s_a)
    outside = tokens * 3 * H * z.s_r  # embedding output, final norm, its output
    full = forwards * (tokens * L * per_layer + outside)
    checkpoints = forwards * (tokens * L * H * z.s_r + outside)
    recompute = tokens * per_layer
    saved, transient = (checkpoints, recompute + workspace) if ckpt else (full, workspace)
    return _Activations(saved, transient, full + workspace, checkpoints + recompute + workspace)


def _weight_copies(est: Estimate, z: _Sizes, forwards: int) -> float:
    """Autocast's bf16 copies of fp32 block weights saved for backward (a 4-bit base: one layer's)."""
    shape, cfg = est.shape, est.settings.backbone
    if cfg.load_in_4bit:
        return 2 * shape.block_linear_params / shape.num_layers
    if z.autocast and z.s_w == 4:
        ckpt = cfg.gradient_checkpointing
        return 2 * shape.block_linear_params * (1 / shape.num_layers if ckpt else 1) * forwards / z.W
    return 0.0


def _no_grad_forward(est: Estimate, z: _Sizes, rows: int, T: int, R: int) -> float:
    """A no-grad forward over ``rows x T`` tokens with logits for ``R`` positions per row: one layer's
    intermediates + the fp32 hidden states + the response logits + the boolean ``(rows, 1, T, T)`` attention
    mask with one layer's additive copy of it (PPO's experience, DPO's reference)."""
    shape = est.shape
    H, V = shape.hidden, shape.vocab
    mask = rows * T * (attention_mask_bytes(T, z.s_a) + attention_mask_bytes(T, 1))
    return rows * T * no_grad_intermediate_bytes(shape, z.s_a) + rows * T * H * 4 + rows * R * V * z.s_a + mask


def _dpo_rows_and_response(s: RunSettings) -> tuple[int, int, str]:
    """DPO's rows per forward, response positions per row and how R was chosen (for the rows' notes)."""
    rows = s.batch_size * s.rows_per_example
    if s.response_len is None:
        return rows, s.seq_len - 1, "R unknown: bounded by T - 1"
    return rows, s.response_len, f"R = {s.response_len} response tokens per row"


def _reference_forward(est: Estimate, z: _Sizes) -> None:
    """DPO's reference: one no-grad forward before the policy's (its intermediates are freed before the
    policy's graph exists, so it is a phase of its own); with ``reference_cache`` it runs only while the cache
    is first written, before training."""
    s = est.settings
    rows, R, how = _dpo_rows_and_response(s)
    when = "before training, while reference_cache is written" if s.reference == "cache" else "every step"
    forward = est.add(
        "reference forward (no grad)",
        _no_grad_forward(est, z, rows, s.seq_len, R),
        f"{rows} x {s.seq_len} tokens, {when}; {how}",
    )
    est.phases["reference forward"] = forward


def _training_step(est: Estimate, z: _Sizes, grads: float, grad_bytes_per: int) -> None:
    """The SFT / reward / DPO step: weight copies + logits (SFT: all positions; DPO: the response positions) +
    the larger of the forward's end (saved activations + every gradient) and the backward's peak (all the
    activations + the gradients alive there)."""
    s, V = est.settings, est.shape.vocab
    rows = s.batch_size * s.rows_per_example
    tokens = rows * s.seq_len
    act = _activations(est, z, tokens, s.seq_len)
    est.add(
        "activations (training step)",
        act.total,
        f"{rows} x {s.seq_len} tokens; without checkpointing {act.full / GiB:.2f} GiB, with {act.with_ckpt / GiB:.2f} GiB",
    )
    copies = _weight_copies(est, z, 1)
    if copies:
        est.add("autocast weight copies", copies, "bf16 casts saved for backward")
    logits = 0.0
    if s.stage == "sft":
        logits = est.add(
            "logits + loss",
            tokens * V * loss_bytes(z.s_a),
            f"B x T x V = {rows} x {s.seq_len} x {V}; a full log_softmax would add {tokens * V * 4 / GiB:.2f} GiB",
        )
    elif s.stage == "dpo":
        _, R, how = _dpo_rows_and_response(s)
        logits = est.add(
            "response logits + loss",
            rows * R * V * loss_bytes(z.s_a),
            f"rows x R x V = {rows} x {R} x {V}; {how}",
        )
    kept = s.accumulate_grad_batches > 1
    est.add(
        "gradients",
        grads,
        ("fp32" if grad_bytes_per == 4 else s.backbone.dtype)
        + ("; kept through the backward (accumulate_grad_batches)" if kept else "; the last step's until backward"),
    )
    # Lightning sets the last step's gradients to None just before backward (zero_grad in its closure): they
    # are alive through the forward; the backward frees saved activations as it makes new gradients, and its
    # peak (the last blocks) holds about one block's worth. Accumulating, all of them stay (traced: bench/RESULTS.md)
    in_backward = grads if kept else grads / est.shape.num_layers
    est.phases["training step"] = copies + logits + max(act.saved + grads, act.total + in_backward)


def _ppo_phases(est: Estimate, z: _Sizes, grads: float) -> None:
    """PPO's rollout (KV cache + prefill), experience (no-grad forwards) and update (one micro-batch)."""
    s, shape = est.settings, est.shape
    L, V = shape.num_layers, shape.vocab
    B, P, R, m = s.batch_size * s.samples_per_prompt, s.prompt_len, s.response_len, s.ppo_micro_batch
    T = P + R
    # a sampling copy decodes in its own dtype (no autocast there); otherwise the trainer's activation bytes
    s_kv = DTYPE_BYTES[s.sampling_copy_dtype] if s.sampling_copy_dtype else z.s_a
    kv_cache = est.add(
        "KV cache (rollout)",
        2 * L * B * T * shape.kv * s_kv,
        f"2 x L x {B} x {T} tokens x kv {shape.kv} x {s_kv} bytes",
    )
    prefill = B * P * no_grad_intermediate_bytes(shape, s_kv) + 3 * B * V * 4
    est.phases["rollout"] = kv_cache + prefill
    f = s.rollout_forward_batch or B
    # explicit logprob_chunk_size rows: two fp32 temporaries of that many rows; by default a few positions
    pieces = min(s.logprob_chunk, f) * R * V * 8 if s.logprob_chunk else 0
    experience = _no_grad_forward(est, z, f, T, R) + pieces
    est.add("experience forwards (no grad)", experience, f"{f} rows; logits over R={R} response positions")
    est.phases["experience"] = experience
    # one process: the actor's backward runs before the critic's forward (the two-pass update), so only one
    # forward's activations are alive; several processes keep both (DDP needs one backward)
    forwards = 1 if s.shared_critic or s.critic_free or s.world_size == 1 else 2
    act = _activations(est, z, m * T, T, forwards)
    est.add(
        "activations (PPO micro-batch)",
        act.total,
        f"{m} x {T} tokens x {forwards} forward(s); without checkpointing {act.full / GiB:.2f} GiB, with {act.with_ckpt / GiB:.2f} GiB",
    )
    copies = _weight_copies(est, z, forwards)
    if copies:
        est.add("autocast weight copies", copies, "bf16 casts saved for backward")
    logits = est.add(
        "response logits + loss + entropy",
        m * R * V * (loss_bytes(z.s_a) + (2 * z.s_a if s.entropy_coef else 0)),
        f"{m} x {R} x {V}; a full log_softmax would add {m * R * V * 4 / GiB:.2f} GiB",
    )
    est.add("gradients", grads, "fp32")
    est.phases["update"] = act.total + copies + logits + grads
