"""Pieces the three stage modules share: optimizer settings, schedulers, data reports, peak memory, and the
weighting that makes a mean loss exact under gradient accumulation and several processes."""

from __future__ import annotations

import logging
import resource
import sys
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Literal

import lightning as L
import torch

from rlhf_lit.functional.summary import all_finite
from rlhf_lit.parallel.collectives import rank_and_world
from rlhf_lit.ranges import check_field_ranges, ranged

log = logging.getLogger("rlhf_lit")



def attached_trainer(module: L.LightningModule) -> L.Trainer | None:
    """The module's trainer, or None when it is not attached to one (``module.trainer`` raises then).

    Reads ``LightningModule._trainer``, private in Lightning 2.6.6 (``tests/test_library_contracts.py``)."""
    return module._trainer


def writes_exports(module: L.LightningModule) -> bool:
    """Whether this process writes the module's export files: the global-zero rank, or the one process when the
    module has no trainer (an export called by hand). Every rank still calls ``export``: under FSDP2 the
    weights are gathered collectively, one unit at a time."""
    return getattr(attached_trainer(module), "is_global_zero", True)


def plain_hparams(module_class: type, **kwargs: Any) -> dict[str, Any]:
    """Hyper-parameters with dataclasses turned into dicts, so checkpoints load with ``weights_only=True``,
    plus ``_class_path`` (the module's import path): the form in which LightningCLI re-parses a checkpoint's
    hyper-parameters for ``--ckpt_path`` (``load_from_checkpoint`` ignores the key)."""
    plain = {k: asdict(v) if is_dataclass(v) else v for k, v in kwargs.items()}
    return {"_class_path": f"{module_class.__module__}.{module_class.__qualname__}", **plain}


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule.

    Args:
        lr: peak learning rate.
        weight_decay: decoupled weight decay (AdamW).
        betas: Adam betas.
        eps: Adam epsilon.
        name: ``adamw`` (torch, fused where available), ``adamw_8bit`` or ``paged_adamw_8bit``
            (bitsandbytes; CUDA only).
        scheduler: a transformers schedule name: ``linear``, ``cosine``, ``constant``,
            ``constant_with_warmup``.
        warmup_steps: linear warm-up, in optimizer steps.
    """

    lr: float = ranged(1e-5, "> 0")
    weight_decay: float = ranged(0.0, ">= 0")
    betas: tuple[float, float] = (0.9, 0.999)  # each in [0, 1): checks.rules.MODEL_RULES (a tuple's items)
    eps: float = ranged(1e-8, "> 0")
    name: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = "adamw"
    scheduler: str = "linear"
    warmup_steps: int = ranged(0, "int >= 0")

    def __post_init__(self) -> None:
        check_field_ranges(self, "optimizer.")  # the ranges declared above (ConfigError)


def build_optimizer(
    param_groups: list[dict], cfg: OptimizerConfig, trainer: L.Trainer | None = None
) -> torch.optim.Optimizer:
    """An optimizer over ``param_groups`` (each a dict with ``params`` and optional ``lr``).

    ``trainer``: when it runs Lightning's mixed-precision plugin, AdamW is not fused: that plugin refuses
    gradient clipping for optimizers that unscale gradients themselves, as the fused ones do.
    """
    kwargs = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "adamw":
        fused = _fused_adamw_ok(param_groups) and not _mixed_precision(trainer)
        return torch.optim.AdamW(param_groups, fused=fused, **kwargs)
    import bitsandbytes as bnb

    cls = bnb.optim.AdamW8bit if cfg.name == "adamw_8bit" else bnb.optim.PagedAdamW8bit
    return cls(param_groups, **kwargs)


def _mixed_precision(trainer: L.Trainer | None) -> bool:
    from lightning.pytorch.plugins.precision import MixedPrecision

    return isinstance(getattr(trainer, "precision_plugin", None), MixedPrecision)


def _fused_adamw_ok(param_groups: list[dict]) -> bool:
    """Whether torch's fused AdamW applies: every parameter a plain floating tensor on CPU or CUDA.

    The fused kernel does the whole update in one pass per parameter instead of ~10 elementwise ops (on
    CPU torch otherwise takes the per-tensor loop); the arithmetic is AdamW's (Loshchilov & Hutter 2019,
    Alg. 2). Sharded (DTensor) parameters keep the default implementation.
    """
    params = [p for group in param_groups for p in group["params"]]
    return bool(params) and all(
        type(p) is torch.nn.Parameter
        and p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
        and p.device.type in ("cpu", "cuda")
        for p in params
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int):
    """A transformers schedule stepped once per optimizer step, over ``total_steps`` steps."""
    # imported here: its module imports transformers' trainer utilities, and they peft
    from transformers import get_scheduler

    return get_scheduler(
        cfg.scheduler,
        optimizer,
        num_warmup_steps=cfg.warmup_steps,
        num_training_steps=max(1, int(total_steps)),
    )


def configure_trainable_optimizer(module: L.LightningModule, cfg: OptimizerConfig) -> dict:
    """``configure_optimizers`` of a module trained with automatic optimization (SFT, reward): one optimizer
    over every parameter that requires grad, its schedule stepped per optimizer step over the trainer's
    ``estimated_stepping_batches`` (accumulation, epochs and ``max_steps`` included)."""
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = build_optimizer([{"params": params}], cfg, attached_trainer(module))
    scheduler = build_scheduler(optimizer, cfg, module.trainer.estimated_stepping_batches)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def log_data_report(module: L.LightningModule) -> None:
    """Log the data module's kept/skipped counts (``data/<split>/...``) once, at the start of fit."""
    trainer = module.trainer
    datamodule = getattr(trainer, "datamodule", None)
    if not hasattr(datamodule, "data_metrics") or trainer.logger is None:
        return
    metrics = datamodule.data_metrics()
    if metrics and trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=0)


def peak_memory_mb() -> float:
    """Peak CUDA memory allocated (MiB) on a GPU run, else the process's peak resident set (MiB)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


class AccumulatedMean:
    """Makes the gradient of an optimizer step that of the mean over ALL its units (tokens, pairs).

    A stage loss is a mean over the units of a batch (``sft_nll``: label tokens). Lightning averages the
    micro-batches of ``accumulate_grad_batches`` (it divides each loss by k), and DDP / FSDP average the
    ranks, so the step would get a mean of per-micro-batch means, which over-weights the units of short
    micro-batches (38% off on a case with uneven response lengths). Here micro-batch ``m`` of rank ``r``
    returns ``mean_{r,m} * n_{r,m} / c`` (``scale``), with ``c`` = the mean units per rank of the window's
    first micro-batch (the same on every rank, and ~1 per unit); once the window is complete its gradient is
    ``(1 / (k W c)) sum n ∇mean``, and ``rescale_gradients`` (from ``on_before_optimizer_step``) multiplies
    it by ``k W c / N`` with ``N`` the window's units on all ranks: the result is ``(1 / N) sum_{r,m} n_{r,m}
    ∇mean_{r,m}``, the gradient of the full-batch mean. One micro-batch on one process: the plain mean,
    factor 1. Callbacks' ``on_before_optimizer_step`` run before the module's and see the gradient before
    this rescaling.
    """

    def __init__(self) -> None:
        self._unit: float | None = None
        self._window_units = 0.0

    def scale(self, module: L.LightningModule, loss: torch.Tensor, num_units: int) -> torch.Tensor:
        """The micro-batch's mean ``loss`` over its ``num_units``, weighted for the window (one all-reduce of
        the unit count under several processes)."""
        trainer = attached_trainer(module)
        _, world_size = rank_and_world(trainer)
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        if world_size == 1 and accumulate == 1:
            return loss
        units = torch.tensor(float(num_units), device=loss.device)
        total = trainer.strategy.reduce(units.clone(), reduce_op="sum") if world_size > 1 else units
        total = float(total)
        if self._unit is None:  # the window's first micro-batch
            self._unit = max(total / world_size, 1.0)
            self._window_units = 0.0
        self._window_units += total
        return loss * (num_units / self._unit)

    def rescale_gradients(self, module: L.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        """Turn the window's accumulated gradient into that of the mean over all its units; call from
        ``on_before_optimizer_step`` (after the last backward of the window, before clipping)."""
        if self._unit is None:
            return
        trainer = module.trainer
        factor = (
            trainer.accumulate_grad_batches * trainer.world_size * self._unit / max(self._window_units, 1.0)
        )
        self._unit = None
        if abs(factor - 1.0) < 1e-12:
            return
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(factor)


MAX_CONSECUTIVE_SKIPS = 10  # SFT, reward, DPO: non-finite optimizer steps in a row before the run stops


class FiniteSteps:
    """Keeps inf and nan out of the weights of an automatically optimised stage (SFT, reward, DPO).

    ``check`` (from ``on_before_optimizer_step``, after the last backward of the step, before gradient
    clipping and the optimizer) looks at every gradient of the step; if any holds inf or nan (an overflow,
    a nan loss) the step's gradients are dropped (set to None), so AdamW changes no parameter and no moment (the
    learning-rate schedule still advances one step). Skips are counted in ``train/skipped_steps`` and
    warned about; ``MAX_CONSECUTIVE_SKIPS`` in a row stop the run with :class:`DivergedTrainingError`. Under
    several processes the ranks agree (any rank's non-finite shard skips the step on all).
    """

    def __init__(self, max_consecutive: int = MAX_CONSECUTIVE_SKIPS) -> None:
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.skipped = 0

    def check(self, module: L.LightningModule, optimizer: torch.optim.Optimizer) -> bool:
        """True when the step may go on; False when its gradients were dropped.

        Raises:
            DivergedTrainingError: the ``max_consecutive``-th skipped step in a row.
        """
        from rlhf_lit import metrics as M
        from rlhf_lit.errors import DivergedTrainingError

        trainer = attached_trainer(module)
        if trainer is not None and str(trainer.precision).startswith("16"):
            return True  # fp16 mixed precision: the gradient scaler skips inf / nan steps itself
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        bad = not all_finite(local)
        if trainer is not None and trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if not bad:
            self.consecutive = 0
            return True
        for g in optimizer.param_groups:
            for p in g["params"]:
                p.grad = None
        self.consecutive += 1
        self.skipped += 1
        module.log(M.TRAIN_SKIPPED_STEPS, float(self.skipped), reduce_fx="max")
        # written at once, not at the next log_every_n_steps boundary: a stop may come first
        _write_now(trainer, M.TRAIN_SKIPPED_STEPS, self.skipped)
        step = module.global_step + 1
        log.warning(
            "step %d: optimizer step skipped, a gradient holds inf or nan (%d in a row)",
            step,
            self.consecutive,
        )
        if self.consecutive >= self.max_consecutive:
            raise DivergedTrainingError(
                f"training stopped at step {step}: {self.consecutive} optimizer steps in a row had inf or nan "
                f"gradients, so none was applied (the weights are those of step {step - self.consecutive}); the run "
                "has diverged: lower model.init_args.optimizer.lr"
            )
        return False

    def summarize(self, module: L.LightningModule) -> None:
        """One warning at the end of training when steps were skipped (call from ``on_train_end``): how many, and
        whether the last ones were, i.e. whether the run ended diverging (its export then holds the weights of
        the last applied step)."""
        if not self.skipped:
            return
        tail = (
            f"; the last {self.consecutive} in a row: the run was diverging when it ended, so the weights (and "
            "the export) are those before it; lower model.init_args.optimizer.lr"
            if self.consecutive
            else ""
        )
        log.warning(
            "%d of %d optimizer steps were skipped, their gradients held inf or nan (train/skipped_steps)%s",
            self.skipped,
            module.global_step,
            tail,
        )


def _write_now(trainer: L.Trainer | None, name: str, value: float) -> None:
    """Write a scalar to the trainer's loggers at once (rank 0), at the current global step."""
    if trainer is None or not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        logger.log_metrics({name: float(value)}, step=trainer.global_step)
