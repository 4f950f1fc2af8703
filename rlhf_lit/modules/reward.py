"""Stage 2: a reward model trained on preference pairs, then calibrated.

Loss per pair (Bradley & Terry 1952; Ouyang et al. 2022 eq. 1), with d = r_chosen - r_rejected - margin:

    loss = -(1 - eps) * log sigmoid(d) - eps * log sigmoid(-d)

``margin`` is the optional per-pair margin (Touvron et al. 2023, eq. 2) and ``eps`` the label smoothing.
Two optional terms: ``beta_rm * NLL(chosen response)``, the language-modelling imitation term of the
MOSS-RLHF reward model (Zheng et al. 2023, "Secrets of RLHF ... Part I", section 4), and
``center_rewards_coef * mean((r_chosen + r_rejected)^2)``, which keeps rewards centred on 0
(Eisenstein et al. 2023). Means are over the pairs of an optimizer step: with ``accumulate_grad_batches``
or several processes every pair weighs the same even when micro-batches differ in size (an epoch's short
last batch); the imitation term, a token mean per micro-batch, is weighted by the micro-batch's pairs.

Calibration (Guo et al. 2017): at the end of fit a single temperature T > 0 is fitted on the validation
pairs by minimising the NLL of sigmoid(d / T); T never changes the ranking. ECE before and after, and the
reliability diagram, go to TensorBoard, to ``eval_results.json`` and to ``reliability.png``.

Every evaluation also reports the length bias (``rlhf_lit.modules.reward_eval``, docs/metrics.md):
length-matched accuracy, accuracy by length difference, score-length Spearman and the length rule.

Backbones: a causal LM (the score read at its last real token by default) or an encoder such as BERT,
RoBERTa, DeBERTa or MiniLM (the mean of its last-layer states over the real tokens by default; ``pooling``;
``rlhf_lit.models.backbone`` for how encoder inputs are built), trained in full or with LoRA alike.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import nullcontext
from typing import Literal

import lightning as L
import torch
from torchmetrics import CatMetric

from rlhf_lit import metrics as M
from rlhf_lit.functional.losses import bt_pairwise_loss, sft_nll
from rlhf_lit.functional.packing import pack, pack_layout, unpack
from rlhf_lit.models.backbone import BackboneConfig, load_backbone_tokenizer
from rlhf_lit.models.export import save_causal_lm, save_reward_head
from rlhf_lit.models.heads import POOLINGS, ScalarHead, score_pooled
from rlhf_lit.models.sharded_load import build_lm, fill_from_checkpoint, weights_deferred
from rlhf_lit.models.trunk import freeze_lower_layers, hidden_size, model_is_encoder
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
from rlhf_lit.modules.reward_eval import (
    calibration_batches,
    evaluate_pairs,
    export_meta,
    fit_calibration,
    report_calibration,
)
from rlhf_lit.modules.reward_length import LengthControl
from rlhf_lit.outputs import staged
from rlhf_lit.parallel import data_parallel_mesh, gathered_parameters, shard_head, shard_lm
from rlhf_lit.ranges import LABEL_SMOOTHING, as_config, check_arguments, parse_range

log = logging.getLogger("rlhf_lit")

PACKING_ON_ENCODER = "packing: true needs a causal-LM backbone; an encoder has no packed path (leave packing unset)"
PACKING_WITH_LENGTH_GROUPS = "packing: true and length_groups > 1 both cut padding; choose one"


def _check_arguments(
    backbone: BackboneConfig,
    length_groups: int,
    pooling: str,
    freeze_layers: int,
    packing: bool | None,
) -> None:
    """What ``RewardModule`` refuses before it loads the model (ValueError, see its docstring)."""
    if packing and length_groups > 1:
        raise ValueError(PACKING_WITH_LENGTH_GROUPS)
    if pooling != "auto" and pooling not in POOLINGS:
        raise ValueError(f"pooling must be 'auto' or one of {POOLINGS}, got {pooling!r}")
    if freeze_layers and backbone.lora is not None:
        raise ValueError("freeze_layers is for full fine-tuning; with backbone.lora the base is frozen already")


class RewardModule(L.LightningModule):
    """A scalar reward model on a causal-LM or encoder trunk, trained with the Bradley–Terry pairwise loss.

    Args:
        backbone: the trunk (often the SFT model, or an encoder such as all-MiniLM-L6-v2) and how it is held
            (LoRA, 4-bit, dtype).
        optimizer: optimizer and learning-rate schedule (the head and the adapter share it).
        label_smoothing: eps in the conservative smoothed loss; 0 disables it.
        beta_rm: weight of the LM-imitation term NLL(chosen response); 0 disables it.
        center_rewards_coef: weight of mean((r_chosen + r_rejected)^2); 0 disables it.
        calibrate: fit the temperature on the validation pairs at the end of fit.
        ece_bins: number of equal-width bins for ECE and the reliability diagram.
        head_init_std: std of the head's initial weights (default 1/sqrt(H+1)).
        export_dir: where the Hugging Face-format reward model, ``eval_results.json`` and
            ``reliability.png`` are written at the end of fit.
        export_mode: ``auto`` | ``merged`` | ``adapter`` (see ``rlhf_lit.models.export``).
        length_groups: run the 2B sequences of a step (chosen and rejected) as this many forwards of
            similar length (sorted by length, equal counts), each cut to its own real-token columns, instead
            of one forward padded to the longest: the same scores (causal attention and position ids from
            the mask make padding inert) for less padded compute. 1 = one forward (default). In fp32 on the
            shared benchmark, 4 groups cut the FLOPs by 40% and ran 1.6x faster; the SmolLM2 bf16-mixed CPU
            run was 1.8x slower per step with 4 (more, smaller forwards; under autocast each forward re-casts
            the frozen base weights), so measure before raising it. Not used with ``beta_rm > 0`` (the
            imitation term reads the chosen hidden states) or under FSDP2.
        pooling: the state the head reads (``rlhf_lit.models.heads``): ``last`` (last real token), ``mean``
            (mean over real tokens) or ``first`` (first real token, an encoder's ``[CLS]``); ``auto`` is
            ``last`` for a causal LM and ``mean`` for an encoder. Recorded in the export.
        freeze_layers: freeze the embeddings and the lowest this many transformer layers (full fine-tuning
            only: less backward compute, and fewer weights to fit on few pairs); 0 trains everything.
        length_control: length-controlled training (``rlhf_lit.modules.reward_length``); off by default.
        packing: score the 2B sequences of a training or validation step padding-free: laid end to end in
            bins no longer than the longest, position ids restarting per sequence and attention confined to
            each (``rlhf_lit.functional.packing``; docs/scale.md); the same scores within float rounding.
            ``None`` (default): packed for a causal LM with ``length_groups: 1``, padded otherwise (an encoder
            has no packed path); ``True``: packed, refused on an encoder or with ``length_groups > 1``.

    Raises:
        ValueError: a setting out of range, an unknown pooling, ``beta_rm > 0`` or ``packing=True`` on an
            encoder (it has no language-model head to imitate with, nor a packed path), or ``packing=True`` with
            ``length_groups > 1``.
    """

    #: The allowed ranges of the plain constructor arguments, declared once: ``__init__`` and the CLI's checks
    #: (``checks.rules.model_ranges``) read them.
    ARG_RANGES = {
        "label_smoothing": LABEL_SMOOTHING,
        "beta_rm": parse_range(">= 0"),
        "center_rewards_coef": parse_range(">= 0"),
        "ece_bins": parse_range("int >= 1"),
        "head_init_std": parse_range("> 0 or null"),
        "length_groups": parse_range("int >= 1"),
        "freeze_layers": parse_range("int >= 0"),
    }

    def __init__(
        self,
        backbone: BackboneConfig,
        optimizer: OptimizerConfig | None = None,
        label_smoothing: float = 0.0,
        beta_rm: float = 0.0,
        center_rewards_coef: float = 0.0,
        calibrate: bool = True,
        ece_bins: int = 10,
        head_init_std: float | None = None,
        export_dir: str | None = None,
        export_mode: Literal["auto", "merged", "adapter"] = "auto",
        length_groups: int = 1,
        pooling: Literal["auto", "last", "mean", "first"] = "auto",
        freeze_layers: int = 0,
        length_control: LengthControl | None = None,
        packing: bool | None = None,
    ) -> None:
        super().__init__()
        backbone = as_config(BackboneConfig, backbone)
        plain = dict(label_smoothing=label_smoothing, beta_rm=beta_rm, center_rewards_coef=center_rewards_coef)
        plain.update(ece_bins=ece_bins, head_init_std=head_init_std, length_groups=length_groups)
        check_arguments(self.ARG_RANGES, {**plain, "freeze_layers": freeze_layers})  # ConfigError, one line
        _check_arguments(backbone, length_groups, pooling, freeze_layers, packing)
        optimizer = as_config(OptimizerConfig, optimizer) or OptimizerConfig()
        self.save_hyperparameters(
            plain_hparams(
                type(self),
                backbone=backbone,
                optimizer=optimizer,
                label_smoothing=label_smoothing,
                beta_rm=beta_rm,
                center_rewards_coef=center_rewards_coef,
                calibrate=calibrate,
                ece_bins=ece_bins,
                head_init_std=head_init_std,
                export_dir=export_dir,
                export_mode=export_mode,
                length_groups=length_groups,
                pooling=pooling,
                freeze_layers=freeze_layers,
                length_control=as_config(LengthControl, length_control),
                packing=packing,
            )
        )
        self.backbone_cfg = backbone
        self.optim_cfg = optimizer
        empty = weights_deferred()  # FSDP2: the base stays on meta until configure_model (as in SFTModule)
        with torch.device("cpu") if empty else nullcontext():
            self.tokenizer = load_backbone_tokenizer(backbone)
            adapters = {"default": backbone.lora} if backbone.lora is not None else None
            self.lm, self._checkpoint_files = build_lm(backbone, self.tokenizer, adapters, empty)
            model = self.lm.model
            self.is_encoder = model_is_encoder(model)
            if self.is_encoder and beta_rm > 0:
                raise ValueError(
                    "beta_rm > 0 needs a causal LM head to imitate with; the backbone is an encoder"
                )
            if self.is_encoder and packing:
                raise ValueError(PACKING_ON_ENCODER)
            self.packing = packing if packing is not None else not self.is_encoder and length_groups == 1
            self.pooling = pooling if pooling != "auto" else "mean" if self.is_encoder else "last"
            self.num_frozen = freeze_lower_layers(self.lm.model, freeze_layers)
            self.head = ScalarHead(hidden_size(model), init_std=head_init_std)
            self.length_control = as_config(LengthControl, length_control) or LengthControl()
            self.length_head = ScalarHead(hidden_size(model)) if self.length_control.odin else None
            self.register_buffer("temperature", torch.tensor(1.0))
            self.val_chosen = CatMetric()
            self.val_rejected = CatMetric()
            self.val_sources = CatMetric()
            self.val_len_chosen = CatMetric()
            self.val_len_rejected = CatMetric()
        self.results: dict = {}
        self._last_val_pass: tuple | None = None
        self._step_mean = AccumulatedMean()
        self._finite_steps = FiniteSteps()

    # -- scoring ---------------------------------------------------------------------------------------
    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids and mask -> ``(B,)`` uncalibrated float32 rewards of the pooled state (``pooling``)."""
        return score_pooled(
            self.head, self.lm.hidden_states(input_ids, attention_mask), attention_mask, self.pooling
        )

    def _score_pairs(
        self, batch: dict, need_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Chosen and rejected scored together: (r_chosen (B,), r_rejected (B,), hidden (2B, T, H) or None).

        One forward over all 2B rows, or ``length_groups`` forwards over rows of similar length (see the
        class docstring); ``need_hidden`` (the imitation term) forces the single forward.
        """
        n = batch["chosen_input_ids"].shape[0]
        ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        mask = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
        if self.packing:
            layout = pack_layout(mask)
            hidden = unpack(self.lm.hidden_states(pack(ids, layout), None, layout.position_ids), layout)
            scores = score_pooled(self.head, hidden, mask, self.pooling)
            return scores[:n], scores[n:], hidden if need_hidden else None
        groups = self.hparams.get("length_groups", 1)
        if need_hidden or groups <= 1 or self.device_mesh is not None or ids.shape[0] < 2 * groups:
            hidden = self.lm.hidden_states(ids, mask)
            scores = score_pooled(self.head, hidden, mask, self.pooling)
            return scores[:n], scores[n:], hidden if need_hidden else None
        order = torch.argsort(mask.sum(-1), stable=True)
        parts = []
        for rows in torch.tensor_split(order, groups):
            sub_mask = mask[rows]
            real = sub_mask.any(0).nonzero()
            # the columns holding a real token of these rows (all of them if none does)
            first, last = (int(real.min()), int(real.max()) + 1) if real.numel() else (0, mask.shape[1])
            sub_mask, sub_ids = sub_mask[:, first:last], ids[rows, first:last]
            hidden = self.lm.hidden_states(sub_ids, sub_mask)
            parts.append(score_pooled(self.head, hidden, sub_mask, self.pooling))
        scores = torch.cat(parts)[torch.argsort(order)]
        return scores[:n], scores[n:], None

    # -- training --------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """FSDP2 under ``ModelParallelStrategy`` (``rlhf_lit.parallel``); nothing otherwise."""
        mesh = data_parallel_mesh(self.device_mesh)
        if mesh is not None:
            shard_lm(self.lm, mesh)
            shard_head(self.head, mesh)
        if self._checkpoint_files is not None:  # built on the meta device: each rank reads its shards
            fill_from_checkpoint(self.lm, self._checkpoint_files)
            self._checkpoint_files = None

    def on_fit_start(self) -> None:
        log_data_report(self)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        lc = self.length_control
        chosen, rejected, hidden = self._score_pairs(batch, need_hidden=hp.beta_rm > 0 or lc.odin)
        heads = (self.head, self.length_head)
        r_c, r_r, weights, penalty = lc.terms(chosen, rejected, batch, hidden, heads, self.pooling)
        losses = bt_pairwise_loss(r_c, r_r, batch.get("margin"), hp.label_smoothing)
        loss, units = self._pair_mean(losses, weights)
        loss = loss + penalty
        if hp.center_rewards_coef > 0:
            loss = loss + hp.center_rewards_coef * ((chosen + rejected) ** 2).mean()
        if hp.beta_rm > 0:
            nll, _ = sft_nll(self.lm.logits(hidden[: chosen.shape[0]]), batch["chosen_labels"])
            loss = loss + hp.beta_rm * nll
        n = chosen.shape[0]
        self.log(M.TRAIN_LOSS, loss, prog_bar=True, batch_size=n)
        self.log(M.TRAIN_ACCURACY, (chosen > rejected).float().mean(), prog_bar=True, batch_size=n)
        # every pair (or unit of pair weight) weighs the same in an optimizer step, also when accumulated
        # micro-batches (an epoch's short last batch) or ranks hold different numbers of pairs
        # (see AccumulatedMean)
        return self._step_mean.scale(self, loss, units)

    def on_train_end(self) -> None:
        self._finite_steps.summarize(self)  # a warning when optimizer steps were skipped (FiniteSteps)

    def on_before_optimizer_step(self, optimizer) -> None:
        self._finite_steps.check(self, optimizer)  # inf / nan gradients: the step is skipped (FiniteSteps)
        self._step_mean.rescale_gradients(self, optimizer)

    def _pair_mean(self, losses: torch.Tensor, weights: torch.Tensor | None) -> tuple[torch.Tensor, float]:
        """This micro-batch's mean of per-pair losses ``(B,)`` and its number of units: B pairs, or, with pair
        ``weights`` ``(B,)`` (the data module's ``pair_weight`` of ``weight_ranked_pairs``, times the length
        balance of ``length_control``; ``LengthControl.terms``), the weighted mean
        ``sum(w * loss) / sum(w)`` and ``sum(w)`` units. ``AccumulatedMean`` then makes the optimizer step's
        gradient that of the weighted mean over the GLOBAL batch (all micro-batches and ranks), so each
        prompt of a ranked list weighs the same (Ouyang et al. 2022, eq. 1)."""
        if weights is None:
            return losses.mean(), losses.shape[0]
        weights = weights.to(losses.dtype)
        total = weights.sum().detach()
        return (losses * weights).sum() / total.clamp(min=torch.finfo(losses.dtype).tiny), float(total)

    def configure_optimizers(self):
        return configure_trainable_optimizer(self, self.optim_cfg)

    # -- validation ------------------------------------------------------------------------------------
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        chosen, rejected, _ = self._score_pairs(batch)
        loss = bt_pairwise_loss(chosen, rejected, batch.get("margin"), self.hparams.label_smoothing)
        self.log(M.VAL_LOSS, loss.mean(), batch_size=chosen.shape[0], sync_dist=True)
        self.log(M.REWARD_CHOSEN_MEAN, chosen.mean(), batch_size=chosen.shape[0], sync_dist=True)
        self.log(M.REWARD_REJECTED_MEAN, rejected.mean(), batch_size=chosen.shape[0], sync_dist=True)
        self.val_chosen.update(chosen.float())
        self.val_rejected.update(rejected.float())
        self.val_sources.update(batch["source"].float())
        self.val_len_chosen.update(batch["chosen_response_len"].float())
        self.val_len_rejected.update(batch["rejected_response_len"].float())

    def on_validation_epoch_end(self) -> None:
        state = (self.val_chosen, self.val_rejected, self.val_sources, self.val_len_chosen)
        state = (*state, self.val_len_rejected)
        # CatMetric.compute() squeezes a single value to a 0-d tensor: one validation pair must stay (1,)
        chosen, rejected, sources, len_c, len_r = (m.compute().cpu().reshape(-1) for m in state)
        for metric in state:
            metric.reset()
        scores = (chosen.float(), rejected.float(), sources.long(), len_c, len_r)
        results = self._evaluate(*scores, temperature=float(self.temperature))
        self.results = results
        trainer = attached_trainer(self)
        limit = trainer.limit_val_batches if trainer is not None else None
        if trainer is not None and not trainer.sanity_checking and isinstance(limit, float) and limit == 1.0:
            # a whole pass, kept so that calibration at the end of fit needs no second pass over the same weights
            self._last_val_pass = (self.global_step, *scores)
        for name, value in results["metrics"].items():
            self.log(name, value, prog_bar=name == M.REWARD_ACCURACY)

    def _source_names(self) -> list[str]:
        datamodule = getattr(attached_trainer(self), "datamodule", None)
        return list(getattr(datamodule, "source_names", []) or [])

    def _evaluate(self, chosen, rejected, sources, len_c, len_r, temperature: float) -> dict:
        """``reward_eval.evaluate_pairs`` of these pairs with this module's bins and the data's file names."""
        return evaluate_pairs(
            chosen, rejected, sources, len_c, len_r, temperature, self.hparams.ece_bins, self._source_names()
        )

    # -- calibration and export ------------------------------------------------------------------------
    def _calibration_batches(self, dataloader) -> int | None:
        """How many batches of ``dataloader`` calibration scores (``reward_eval.calibration_batches`` of
        ``trainer.limit_val_batches``)."""
        return calibration_batches(getattr(attached_trainer(self), "limit_val_batches", None), dataloader)

    @torch.no_grad()
    def collect_margins(self, dataloader, max_batches: int | None = None) -> tuple[torch.Tensor, ...]:
        """Score the pairs of a loader: (margins, sources, len_chosen, len_rejected), on the CPU.

        Args:
            dataloader: preference batches.
            max_batches: score only the first this many batches (default: all), with a progress bar.
        """
        chosen, rejected, sources, len_c, len_r = self.collect_scores(dataloader, max_batches)
        return chosen - rejected, sources, len_c, len_r

    @torch.no_grad()
    def collect_scores(self, dataloader, max_batches: int | None = None) -> tuple[torch.Tensor, ...]:
        """Score the pairs of a loader: ``(r_chosen, r_rejected, sources, len_chosen, len_rejected)``, each
        ``(N,)`` on the CPU, the scores uncalibrated float32 (see ``collect_margins``)."""
        from tqdm.auto import tqdm

        was_training = self.training
        self.eval()
        out = {"chosen": [], "rejected": [], "s": [], "c": [], "r": []}
        try:
            total = len(dataloader) if max_batches is None else max_batches
        except TypeError:
            total = None
        trainer = attached_trainer(self)
        show = trainer is None or trainer.is_global_zero
        batches = tqdm(dataloader, total=total, desc="[reward] calibration", disable=not show, leave=False)
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            chosen, rejected, _ = self._score_pairs(batch)
            out["chosen"].append(chosen.float().cpu())
            out["rejected"].append(rejected.float().cpu())
            out["s"].append(batch["source"].cpu())
            out["c"].append(batch["chosen_response_len"].cpu())
            out["r"].append(batch["rejected_response_len"].cpu())
        self.train(was_training)
        return tuple(torch.cat(v) for v in out.values())

    def calibrate_temperature(self, dataloader) -> dict:
        """Fit T on a loader's pairs, store it in the ``temperature`` buffer, and return the results.

        When the last validation pass ran on the current weights (same optimizer step), its scores are
        reused instead of scoring the loader again.
        """
        cached = self._last_val_pass
        if cached is not None and attached_trainer(self) is not None and cached[0] == self.global_step:
            scores = cached[1:]
        else:
            scores = self.collect_scores(dataloader, self._calibration_batches(dataloader))
        temperature, at_bound, reliability = fit_calibration(scores[0] - scores[1], self.hparams.ece_bins)
        self.temperature.fill_(temperature)
        results = self._evaluate(*scores, temperature=temperature)
        results.update(temperature=temperature, temperature_at_bound=at_bound, reliability=reliability)
        return results

    def on_fit_end(self) -> None:
        results = None
        datamodule = getattr(self.trainer, "datamodule", None)
        if self.hparams.calibrate and datamodule is not None:
            loader = datamodule.val_dataloader()
            if isinstance(loader, (list, tuple)) and not loader:  # no validation split: nothing to fit T on
                log.warning("reward model: no validation pairs, so no temperature calibration (T stays 1)")
            elif self._calibration_batches(loader) == 0:
                log.warning("reward model: limit_val_batches is 0, so no temperature calibration (T stays 1)")
            else:
                results = self.calibrate_temperature(loader)
                self._report_calibration(results)
        if self.hparams.export_dir:
            self.export(self.hparams.export_dir, results)  # every rank: a collective under FSDP2

    def _report_calibration(self, results: dict) -> None:
        folder = self.hparams.export_dir or self.trainer.log_dir or self.trainer.default_root_dir
        report_calibration(self.trainer, results, folder, self.global_step)

    def export(self, path: str, results: dict | None = None) -> None:
        """Write the reward model in Hugging Face format (see ``rlhf_lit.models.export``) to ``path``, with
        ``eval_results.json`` when calibration ``results`` are given. Every rank calls it (a collective under FSDP2:
        the trunk is gathered one FSDP unit at a time, the head alone), rank 0 writes."""
        datamodule = getattr(attached_trainer(self), "datamodule", None)
        meta = export_meta(
            self.is_encoder, self.head.linear.in_features, float(self.temperature), self.pooling, datamodule
        )
        if results is not None and "summary" in results:  # what evaluate compares a new file with
            meta["validation_summary"] = results["summary"]
        writer = writes_exports(self)
        mode = self.hparams.export_mode
        save_causal_lm(self.lm, self.tokenizer, path, self.backbone_cfg, mode, meta=meta, writer=writer)
        with gathered_parameters(self.head):  # a collective under FSDP2; nothing otherwise
            save_reward_head(self.head, path, writer)
        if writer and results is not None:
            summary = {k: v for k, v in results.items() if k != "reliability"}
            with open(os.path.join(staged(path), "eval_results.json"), "w") as f:
                json.dump(summary, f, indent=2)
