"""Stage 4: direct preference optimisation without RL (DPO, cDPO, robust DPO, hinge, IPO, SimPO; KTO).

Each training step (the losses are pure functions in ``rlhf_lit.functional.preference``):

1. stack chosen and rejected (or the KTO completions) into one batch and run the policy on it (``packing``:
   the rows end to end without padding; else with ``trim_padding`` once per group of rows of similar length);
2. sum the log-probs of each response's tokens (``response_logps_from_hidden``: token ``x[i]`` scored at ``i - 1``,
   logits made for response positions only);
3. the same sums under the reference: from the on-disk cache (``reference_cache``; then no reference forward
   runs at all), else from one no-grad forward of the reference (none for the reference-free ``simpo``);
4. the loss (``dpo_loss`` / ``kto_loss``), plus ``nll_coef`` times the chosen responses' NLL per token;
5. log TRL's metrics per split (``{split}/rewards/chosen``, ...; ``rlhf_lit.metrics``).

**The reference on the one base** (``rlhf_lit.models.adapters``): with LoRA, the policy is adapter
``"default"`` and the reference is ``AdaptedLM.reference()``: every adapter off, except the frozen SFT adapter
of an adapter-only SFT export, which stays on (``load_backbone`` puts it beneath the trained adapter), so
the reference is the SFT policy and never the bare base. A merged SFT export is itself the base. Full
fine-tuning (``backbone.lora: null``) has no adapter to switch off: its reference is the cache (computed
before the first update) or, with ``reference_copy``, a second frozen copy of the model loaded from the same
backbone config; with neither the module refuses to start.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Literal

import lightning as L
import torch

from rlhf_lit import metrics as M
from rlhf_lit.callbacks import HFExport, unless_configured
from rlhf_lit.errors import ConfigError
from rlhf_lit.functional.preference import (
    LOSS_TYPES,
    REFERENCE_FREE_LOSS_TYPES,
    chosen_nll,
    dpo_loss,
    kto_loss,
    reward_accuracy,
)
from rlhf_lit.models.backbone import BackboneConfig, load_backbone_tokenizer
from rlhf_lit.models.export import save_causal_lm
from rlhf_lit.models.sharded_load import build_lm, fill_from_checkpoint, weights_deferred
from rlhf_lit.modules.common import (
    AccumulatedMean,
    FiniteSteps,
    OptimizerConfig,
    attached_trainer,
    configure_trainable_optimizer,
    log_data_report,
    plain_hparams,
    writes_exports,
)
from rlhf_lit.modules.dpo_reference import (
    ReferenceSource,
    RowLayout,
    lm_response_logps,
    reference_numerics,
    sequences,
)
from rlhf_lit.parallel import data_parallel_mesh, shard_lm
from rlhf_lit.ranges import BETA, LABEL_SMOOTHING, Range, as_config, check_arguments, parse_range

log = logging.getLogger("rlhf_lit")

LossTypeArg = Literal["sigmoid", "ipo", "robust", "label_smoothing", "hinge", "simpo", "kto"]


class DPOModule(L.LightningModule):
    """Preference optimisation of a causal LM on pairs (DPO and variants) or unpaired completions (KTO).

    Args:
        backbone: the policy to train (usually the SFT export) and how it is held (LoRA, 4-bit, dtype).
        optimizer: optimizer and learning-rate schedule.
        loss_type: ``sigmoid`` (DPO), ``label_smoothing`` (cDPO), ``robust``, ``hinge``, ``ipo`` (per-token
            averaged), ``simpo`` (reference-free, length-normalised) on pairs; ``kto`` on unpaired rows.
        beta: > 0, the strength of the implicit KL anchor (DPO's beta; SimPO's reward scale).
        label_smoothing: eps in [0, 0.5), the assumed label-flip rate (``label_smoothing``, ``robust``).
        simpo_gamma: SimPO's target reward margin (Meng et al. 2024's gamma; named as in TRL so it is not
            read as a discount factor).
        nll_coef: weight of the chosen responses' NLL per token (0: none; KTO: the desirable ones).
        desirable_weight: KTO's lambda_D.
        undesirable_weight: KTO's lambda_U.
        reference_cache: a folder for reference log-probs computed once before training and reused by every
            run with the same data, tokenizer, reference weights, lengths, precision and row layout (``packing``,
            ``trim_padding``), in the training step's precision context (``bf16-mixed``: its autocast), so a cached
            run's losses are an uncached run's: bit for bit when the cache saw the training batches (``shuffle:
            false``), else up to the rounding of other batch shapes (bf16 tiny config: first loss 0.693132 cached,
            ln 2 uncached). With it the reference never runs during training.
        reference_copy: full fine-tuning only: keep a second, frozen copy of the model as the reference
            (twice the weight memory) instead of a ``reference_cache``.
        trim_padding: without ``packing``, run a batch's rows in groups of similar length, each cut to its
            longest row (``response_logps_in_length_groups``; DPO benchmark: peak live tensors 304 -> 162 MB);
            False: one padded forward. Not under FSDP2 (``ModelParallelStrategy``): every forward there gathers
            weights with the other ranks, which must run as many forwards.
        packing: run each batch's rows padding-free, one forward (``response_logps_packed``; docs/scale.md):
            end to end in bins no longer than the longest row, position ids restarting per row, attention
            confined to each row; replaces ``trim_padding``, under FSDP2 too. On by default (bench/RESULTS.md,
            "DPO: packed vs trim_padding": ~0.6x the padded time, as trimming). Every layout gives the padded
            forward's values up to float summation order.
        export_dir: at the end of fit, the trained policy is written here in Hugging Face format.
        export_mode: ``auto`` | ``merged`` | ``adapter`` (see ``rlhf_lit.models.export``).
    """

    #: The allowed ranges of the plain constructor arguments, declared once: ``__init__`` and the CLI's checks
    #: (``checks.rules.model_ranges``) read them.
    ARG_RANGES = {
        "beta": BETA,
        "label_smoothing": LABEL_SMOOTHING,
        "simpo_gamma": Range(),  # any finite number
        "nll_coef": parse_range(">= 0"),
        "desirable_weight": parse_range(">= 0"),
        "undesirable_weight": parse_range(">= 0"),
    }

    def __init__(
        self,
        backbone: BackboneConfig,
        optimizer: OptimizerConfig | None = None,
        loss_type: LossTypeArg = "sigmoid",
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        simpo_gamma: float = 0.5,
        nll_coef: float = 0.0,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        reference_cache: str | None = None,
        reference_copy: bool = False,
        trim_padding: bool = True,
        packing: bool = True,
        export_dir: str | None = None,
        export_mode: Literal["auto", "merged", "adapter"] = "auto",
    ) -> None:
        super().__init__()
        backbone = as_config(BackboneConfig, backbone)
        optimizer = as_config(OptimizerConfig, optimizer) or OptimizerConfig()
        plain = dict(beta=beta, label_smoothing=label_smoothing, simpo_gamma=simpo_gamma, nll_coef=nll_coef)
        plain.update(desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)
        check_arguments(self.ARG_RANGES, plain)  # ConfigError, one line
        _check_settings(backbone, loss_type, label_smoothing, reference_cache, reference_copy, packing)
        self.save_hyperparameters(
            plain_hparams(
                type(self),
                backbone=backbone,
                optimizer=optimizer,
                loss_type=loss_type,
                beta=beta,
                label_smoothing=label_smoothing,
                simpo_gamma=simpo_gamma,
                nll_coef=nll_coef,
                desirable_weight=desirable_weight,
                undesirable_weight=undesirable_weight,
                reference_cache=reference_cache,
                reference_copy=reference_copy,
                trim_padding=trim_padding,
                packing=packing,
                export_dir=export_dir,
                export_mode=export_mode,
            )
        )
        self.backbone_cfg, self.optim_cfg = backbone, optimizer
        self.loss_type, self.beta = loss_type, float(beta)
        self.export_dir, self.export_mode = export_dir, export_mode
        self.trim_padding, self.packing = bool(trim_padding), packing
        empty = weights_deferred()  # FSDP2: the bases stay on meta until configure_model (as in SFTModule)
        with torch.device("cpu") if empty else nullcontext():
            self.tokenizer = load_backbone_tokenizer(backbone)
            adapters = {"default": backbone.lora} if backbone.lora is not None else None
            self.lm, self._checkpoint_files = build_lm(backbone, self.tokenizer, adapters, empty)
            reference_lm = None
            if reference_copy and loss_type not in REFERENCE_FREE_LOSS_TYPES:
                # the same backbone config: deferred exactly when the policy is, from the same files
                reference_lm = build_lm(backbone, self.tokenizer, None, empty)[0].requires_grad_(False)
        self.reference_lm = reference_lm  # a submodule (moved with the module); None on the one base
        self.reference = ReferenceSource(
            run=self.run_reference,
            weights=self._reference_weights,
            tokenizer=self.tokenizer,
            folder=reference_cache,
            reference_free=loss_type in REFERENCE_FREE_LOSS_TYPES,
            device=lambda: self.device,
            sequences=sequences,
        )
        self._step_mean = AccumulatedMean()
        self._finite_steps = FiniteSteps()
        self.strict_loading = False  # checkpoints hold the trained parameters only (on_save_checkpoint)

    # -- the two forwards ------------------------------------------------------------------------------
    def _layout(self) -> RowLayout:
        """``packed`` with ``packing`` (one forward per batch), else ``trimmed`` with ``trim_padding`` except under
        FSDP2: there every forward gathers weights with the other ranks, which must run as many forwards (their
        batches would group differently and the run would hang)."""
        if self.packing:
            return "packed"
        return "trimmed" if self.trim_padding and self.device_mesh is None else "padded"

    def policy_logps(self, ids, mask, prompt_len, response_len) -> torch.Tensor:
        """``(N,)`` summed response log-probs under the policy (with gradient)."""
        return lm_response_logps(self.lm, ids, mask, prompt_len, response_len, self._layout())

    @torch.no_grad()
    def run_reference(self, ids, mask, prompt_len, response_len) -> torch.Tensor:
        """``(N,)`` summed response log-probs under the reference, one forward (``self.reference`` counts
        them)."""
        if self.reference_lm is not None:
            return lm_response_logps(self.reference_lm, ids, mask, prompt_len, response_len, self._layout())
        with self.lm.reference():
            return lm_response_logps(self.lm, ids, mask, prompt_len, response_len, self._layout())

    def _reference_weights(self):
        """The tensors the reference reads: the copy's, or the base's and its frozen base adapters' (every
        tensor of the policy but the trained adapter's; all of them under full fine-tuning)."""
        if self.reference_lm is not None:
            return list(self.reference_lm.state_dict().items())
        return [(k, v) for k, v in self.lm.state_dict().items() if ".default." not in k]

    # -- the loss --------------------------------------------------------------------------------------
    def _loss(self, batch: dict, split: str) -> tuple[torch.Tensor, int]:
        hp = self.hparams
        ids, mask, prompt_len, response_len = sequences(batch)
        # the reference first: its forward's activations are freed before the policy's graph exists, so the
        # step's peak memory is the policy's forward and backward alone
        ref = self.reference.logps(ids, mask, prompt_len, response_len)
        logps = self.policy_logps(ids, mask, prompt_len, response_len)
        if self.loss_type == "kto":
            desirable = batch["label"].bool()
            losses, rewards, z0 = kto_loss(
                logps, ref, desirable, self.beta, hp.desirable_weight, hp.undesirable_weight
            )
            loss = losses.mean()
            nll = chosen_nll(logps[desirable], response_len[desirable]) if bool(desirable.any()) else None
            self._log_kto(split, rewards, logps.detach(), desirable, z0)
        else:
            n = ids.shape[0] // 2
            losses, chosen, rejected = dpo_loss(
                logps[:n],
                logps[n:],
                None if ref is None else ref[:n],
                None if ref is None else ref[n:],
                self.beta,
                self.loss_type,
                response_len[:n],
                response_len[n:],
                hp.label_smoothing,
                hp.simpo_gamma,
            )
            loss = losses.mean()
            nll = chosen_nll(logps[:n], response_len[:n])
            self._log_pairs(split, chosen, rejected, logps.detach(), n)
        if nll is not None:
            self.log(M.PREF_NLL_LOSS.format(split=split), nll.detach(), batch_size=losses.shape[0])
            if hp.nll_coef > 0:
                loss = loss + hp.nll_coef * nll
        return loss, losses.shape[0]

    def _log_pairs(self, split, chosen, rejected, logps, n) -> None:
        values = {
            M.PREF_REWARDS_CHOSEN: chosen.mean(),
            M.PREF_REWARDS_REJECTED: rejected.mean(),
            M.PREF_REWARDS_MARGINS: (chosen - rejected).mean(),
            M.PREF_REWARDS_ACCURACIES: reward_accuracy(chosen, rejected),
            M.PREF_LOGPS_CHOSEN: logps[:n].mean(),
            M.PREF_LOGPS_REJECTED: logps[n:].mean(),
        }
        for name, value in values.items():
            self.log(name.format(split=split), value, batch_size=n, sync_dist=split == "val")

    def _log_kto(self, split, rewards, logps, desirable, z0) -> None:
        for rows, reward_name, logp_name in (
            (desirable, M.PREF_REWARDS_CHOSEN, M.PREF_LOGPS_CHOSEN),
            (~desirable, M.PREF_REWARDS_REJECTED, M.PREF_LOGPS_REJECTED),
        ):
            count = int(rows.sum())
            if count:  # a batch without such rows logs nothing for them (never a mean of nothing)
                self.log(reward_name.format(split=split), rewards[rows].mean(), batch_size=count)
                self.log(logp_name.format(split=split), logps[rows].mean(), batch_size=count)
        self.log(M.PREF_KTO_KL.format(split=split), z0, batch_size=rewards.shape[0])

    # -- Lightning hooks -------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """FSDP2 (``ModelParallelStrategy``) on the policy and the reference copy; built on the meta device, each
        rank then reads its shards of the base into both (``fill_from_checkpoint``). Last, when fitting, the
        reference cache's fingerprint: of the filled weights, before Lightning restores a ``ckpt_path``."""
        mesh = data_parallel_mesh(self.device_mesh)
        for lm in [m for m in (self.lm, self.reference_lm) if m is not None]:
            if mesh is not None:
                shard_lm(lm, mesh)
            if self._checkpoint_files is not None:
                fill_from_checkpoint(lm, self._checkpoint_files)
        self._checkpoint_files = None
        trainer = attached_trainer(self)
        if trainer is not None and trainer.state.fn == "fit":
            self.reference.fingerprint_start()

    def setup(self, stage: str) -> None:
        datamodule = getattr(attached_trainer(self), "datamodule", None)
        unpaired = getattr(datamodule, "unpaired", None)
        if unpaired is not None:
            check_data_kind(self.loss_type, unpaired)

    def on_fit_start(self) -> None:
        log_data_report(self)
        own = self.reference_lm is None and self.backbone_cfg.lora is None  # full FT: the reference is the start
        self.reference.prepare(
            getattr(self.trainer, "datamodule", None),
            reference_restored=own and self.trainer.ckpt_path is not None,  # (global_step: restored later)
            numerics=reference_numerics(str(self.trainer.precision), self._layout()),
            context=self.trainer.precision_plugin.train_step_context,
        )

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, units = self._loss(batch, "train")
        self.log(M.TRAIN_LOSS, loss, prog_bar=True, batch_size=units)
        # every pair (KTO: completion) weighs the same in an optimizer step (AccumulatedMean)
        return self._step_mean.scale(self, loss, units)

    def on_train_end(self) -> None:
        self._finite_steps.summarize(self)  # a warning when optimizer steps were skipped (FiniteSteps)

    def on_before_optimizer_step(self, optimizer) -> None:
        self._finite_steps.check(self, optimizer)  # inf / nan gradients: the step is skipped (FiniteSteps)
        self._step_mean.rescale_gradients(self, optimizer)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, units = self._loss(batch, "val")
        self.log(M.VAL_LOSS, loss, prog_bar=True, batch_size=units, sync_dist=True)

    def configure_optimizers(self):
        return configure_trainable_optimizer(self, self.optim_cfg)

    def configure_callbacks(self):
        """The Hugging Face export at the end of fit when ``export_dir`` is set (``HFExport``)."""
        return unless_configured(attached_trainer(self), [HFExport()] if self.export_dir else [])

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Checkpoints hold the trained parameters only (the adapter, or every weight under full fine-tuning);
        the frozen base, base adapters and reference copy are rebuilt from ``backbone``."""
        trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}

    def export(self, path: str) -> None:
        """Write the policy (any LoRA adapter merged, and alone in ``adapter/``, per ``export_mode``) and the
        tokenizer in Hugging Face format; every rank calls it (a collective under FSDP2: the weights are gathered
        one FSDP unit at a time), rank 0 writes."""
        save_causal_lm(
            self.lm,
            self.tokenizer,
            path,
            self.backbone_cfg,
            self.export_mode,
            meta={"kind": "policy", "stage": "dpo", "loss_type": self.loss_type},
            writer=writes_exports(self),
        )


def check_data_kind(loss_type: str, unpaired: bool) -> None:
    """Raises ConfigError if KTO gets pairs or a paired loss gets unpaired rows."""
    if unpaired and loss_type != "kto":
        raise ConfigError(
            f"data: the preference files hold unpaired (KTO-style) completions, but loss_type {loss_type!r} "
            "trains on pairs; set model.init_args.loss_type: kto, or data.init_args.pair_unpaired: true"
        )
    if not unpaired and loss_type == "kto":
        raise ConfigError(
            "data: loss_type 'kto' trains on unpaired completions (prompt, completion, label), but the "
            "preference files hold pairs; use a paired loss_type (sigmoid, ipo, ...) or unpaired data"
        )


def _check_settings(backbone, loss_type, label_smoothing, reference_cache, reference_copy, packing) -> None:
    if not isinstance(packing, bool):
        raise ConfigError(f"model.init_args.packing must be true or false, got {packing!r}")
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"model.init_args.loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if label_smoothing and loss_type not in ("label_smoothing", "robust"):
        raise ConfigError(
            f"model.init_args.label_smoothing is used by loss_type label_smoothing or robust, not {loss_type!r}"
        )
    if loss_type in REFERENCE_FREE_LOSS_TYPES and (reference_cache or reference_copy):
        raise ConfigError(
            f"loss_type {loss_type!r} is reference-free: remove model.init_args.reference_cache / reference_copy"
        )
    if reference_copy and backbone.lora is not None:
        raise ConfigError(
            "model.init_args.reference_copy is for full fine-tuning; with backbone.lora the reference is the "
            "same base with the adapter off (no copy needed)"
        )
    if (
        backbone.lora is None
        and loss_type not in REFERENCE_FREE_LOSS_TYPES
        and not (reference_cache or reference_copy)
    ):
        raise ConfigError(
            "full fine-tuning (backbone.lora: null) has no adapter to switch off for the reference: set "
            "model.init_args.reference_cache: <folder> (reference log-probs computed once) or reference_copy: true"
        )
