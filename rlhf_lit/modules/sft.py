"""Stage 1: supervised fine-tuning on demonstrations, with the loss on response tokens only.

The loss is the mean negative log-likelihood of the response tokens (EOS included) given the prompt
(Ouyang et al. 2022, section 3.5); prompt and padding tokens carry label -100 (docs/pitfalls.md: SFT labels). The mean is
over every response token of an optimizer step: with ``accumulate_grad_batches`` and under several
processes the gradient is that of one batch holding all their tokens (``AccumulatedMean``), not an
average of per-micro-batch means.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Literal

import lightning as L
import torch
import torchmetrics

from rlhf_lit import metrics as M
from rlhf_lit.callbacks import HFExport, unless_configured
from rlhf_lit.functional.losses import sft_nll
from rlhf_lit.functional.packing import pack, pack_layout, packed_labels
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
from rlhf_lit.parallel import data_parallel_mesh, shard_lm
from rlhf_lit.ranges import as_config

log = logging.getLogger("rlhf_lit")


class SFTModule(L.LightningModule):
    """Supervised fine-tuning of a causal LM (full or LoRA).

    Args:
        backbone: the model to fine-tune, and how it is held (LoRA, 4-bit, checkpointing, dtype).
        optimizer: optimizer and learning-rate schedule.
        export_dir: at the end of fit, the trained model is written here in Hugging Face format
            (weights with any LoRA adapter merged, the adapter alone in ``adapter/``, the tokenizer).
        export_mode: ``auto`` | ``merged`` | ``adapter`` (see ``rlhf_lit.models.export``).
        packing: run each training and validation batch padding-free: its rows laid end to end in bins no
            longer than its longest row, position ids restarting per row and attention confined to each row
            (``rlhf_lit.functional.packing``; docs/scale.md). The same loss as the padded batch (within float
            rounding) for less compute where the lengths are ragged; on by default (measured faster,
            bench/RESULTS.md "Packing").
    """

    def __init__(
        self,
        backbone: BackboneConfig,
        optimizer: OptimizerConfig | None = None,
        export_dir: str | None = None,
        export_mode: Literal["auto", "merged", "adapter"] = "auto",
        packing: bool = True,
    ) -> None:
        super().__init__()
        backbone = as_config(BackboneConfig, backbone)
        optimizer = as_config(OptimizerConfig, optimizer) or OptimizerConfig()
        self.save_hyperparameters(
            plain_hparams(
                type(self),
                backbone=backbone,
                optimizer=optimizer,
                export_dir=export_dir,
                export_mode=export_mode,
                packing=packing,
            )
        )
        self.backbone_cfg = backbone
        self.optim_cfg = optimizer
        self.export_dir = export_dir
        self.export_mode = export_mode
        self.packing = packing
        # Built on the meta device (trainer.init_module(empty_init=True) under FSDP2, or rlhf-lit fit with
        # FSDP2Strategy): the base's weights are read shard by shard in configure_model, after sharding
        # (rlhf_lit.models.sharded_load).
        empty = weights_deferred()
        with torch.device("cpu") if empty else nullcontext():
            self.tokenizer = load_backbone_tokenizer(backbone)
            adapters = {"default": backbone.lora} if backbone.lora is not None else None
            self.lm, self._checkpoint_files = build_lm(backbone, self.tokenizer, adapters, empty)
            self.val_nll = torchmetrics.MeanMetric()
        self._token_mean = AccumulatedMean()
        self._finite_steps = FiniteSteps()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids and mask -> ``(B, T, V)`` logits."""
        return self.lm.logits(self.lm.hidden_states(input_ids, attention_mask))

    def _loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        if not self.packing:
            return sft_nll(self(ids, mask), labels)
        layout = pack_layout(mask)
        hidden = self.lm.hidden_states(pack(ids, layout), None, layout.position_ids)
        return sft_nll(self.lm.logits(hidden), packed_labels(labels, layout))

    def configure_model(self) -> None:
        """FSDP2 under ``ModelParallelStrategy`` (``rlhf_lit.parallel``); then, for a module built on the meta
        device, each rank reads its shard of the base's weights (``fill_from_checkpoint``)."""
        mesh = data_parallel_mesh(self.device_mesh)
        if mesh is not None:
            shard_lm(self.lm, mesh)
        if self._checkpoint_files is not None:
            fill_from_checkpoint(self.lm, self._checkpoint_files)
            self._checkpoint_files = None

    def on_fit_start(self) -> None:
        log_data_report(self)

    def on_train_start(self) -> None:
        """Log ``val/loss`` of the untrained model at step 0, so the curve shows where training started."""
        if self.global_step > 0:  # a resumed run
            return
        loaders = self.trainer.val_dataloaders  # every rank scores its share; val_nll syncs them
        if not loaders:
            return
        was_training = self.training
        self.eval()
        with torch.no_grad():
            for batch in loaders:
                batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
                with self.trainer.precision_plugin.forward_context():
                    loss, num_tokens = self._loss(batch)
                self.val_nll.update(loss.detach().float(), weight=num_tokens)
        self.train(was_training)
        loss = self.val_nll.compute()
        self.val_nll.reset()
        for logger in self.loggers:  # loggers write on rank 0 only
            logger.log_metrics(
                {M.VAL_LOSS: float(loss), M.VAL_PERPLEXITY: float(torch.exp(loss.clamp(max=50)))}, step=0
            )
        log.info("SFT: validation loss before training %.4f", float(loss))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, num_tokens = self._loss(batch)
        self.log(M.TRAIN_LOSS, loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        # Token mean over everything one optimizer step sees: all accumulated micro-batches of all ranks
        # (ranks and micro-batches hold different numbers of response tokens; an average of their means would
        # over-weight the short ones). The weighting is finished in on_before_optimizer_step.
        return self._token_mean.scale(self, loss, num_tokens)

    def on_train_end(self) -> None:
        self._finite_steps.summarize(self)  # a warning when optimizer steps were skipped (FiniteSteps)

    def on_before_optimizer_step(self, optimizer) -> None:
        self._finite_steps.check(self, optimizer)  # inf / nan gradients: the step is skipped (FiniteSteps)
        self._token_mean.rescale_gradients(self, optimizer)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss, num_tokens = self._loss(batch)
        # Weighted by response tokens, so val/loss is a per-token mean over the whole split.
        self.val_nll.update(loss.detach(), weight=num_tokens)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_nll.compute()
        self.val_nll.reset()
        # val_nll already holds every rank's tokens (equal on all ranks); sync_dist averages equal values and
        # is what Lightning asks of an epoch-level metric under several devices (FSDP2, DDP)
        self.log(M.VAL_LOSS, loss, prog_bar=True, sync_dist=True)
        self.log(M.VAL_PERPLEXITY, torch.exp(loss.clamp(max=50.0)), sync_dist=True)

    def configure_optimizers(self):
        return configure_trainable_optimizer(self, self.optim_cfg)

    def configure_callbacks(self):
        """The Hugging Face export at the end of fit when ``export_dir`` is set (``HFExport``; one in
        ``trainer.callbacks`` is kept instead)."""
        return unless_configured(attached_trainer(self), [HFExport()] if self.export_dir else [])

    def export(self, path: str) -> None:
        """Write the model (any LoRA adapter merged, and alone in ``adapter/``, per ``export_mode``) and the
        tokenizer in Hugging Face format to ``path``; every rank calls it (a collective under FSDP2: the weights are
        gathered one FSDP unit at a time), rank 0 writes."""
        save_causal_lm(
            self.lm,
            self.tokenizer,
            path,
            self.backbone_cfg,
            self.export_mode,
            meta={"kind": "policy", "stage": "sft"},
            writer=writes_exports(self),
        )
