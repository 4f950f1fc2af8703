"""An optimizer step whose gradients hold inf or nan changes nothing in SFT, reward and DPO runs (``FiniteSteps``).

A nan loss (a learning rate too high, an overflow) gives nan gradients; AdamW would write them into every
trainable weight and the rest of the epoch would train on nan. The step is skipped instead, counted in
``train/skipped_steps``, and too many skips in a row stop the run with a one-line user error.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger

from rlhf_lit import metrics as M
from rlhf_lit.data import PreferenceDataModule, SFTDataModule
from rlhf_lit.errors import DivergedTrainingError, UserError
from rlhf_lit.models import BackboneConfig, LoraSettings
from rlhf_lit.modules import DPOModule, RewardModule, SFTModule
from rlhf_lit.modules.common import FiniteSteps, OptimizerConfig
from tests.conftest import TINY_GPT2
from tests.tiny_runs import one_thread

LORA = LoraSettings(r=4, alpha=8, target_modules=["c_attn"])


class PoisonGradients(L.Callback):
    """Test collaborator: after the backward of the listed optimizer steps (0-based), one gradient becomes nan;
    records every trainable weight after each step."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.weights.append(_trainable(pl_module))

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step in self.steps:
            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
            grad.view(-1)[0] = float("nan")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.weights.append(_trainable(pl_module))


def _trainable(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _sft(tmp_path: Path):
    path = tmp_path / "sft.jsonl"
    rows = [{"prompt": f"Q: {w}?\nA:", "response": f" {w} {w}"} for w in ("a", "bb", "ccc", "dd", "e", "ff")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    module = SFTModule(
        BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", lora=LORA), optimizer=OptimizerConfig(lr=1e-2)
    )
    data = SFTDataModule(
        train_files=str(path), val_size=0, batch_size=2, shuffle=False, tokenizer=module.tokenizer
    )
    return module, data


def _pairs(tmp_path: Path) -> str:
    path = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": f"Q: {w}?\nA:", "chosen": f" {w} yes", "rejected": f" {w} no, never"}
        for w in ("a", "bb", "ccc", "dd", "e", "ff")
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _reward(tmp_path: Path):
    module = RewardModule(
        BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", lora=LORA), optimizer=OptimizerConfig(lr=1e-2)
    )
    return module, _pref_data(tmp_path, module)


def _dpo(tmp_path: Path):
    module = DPOModule(
        BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", lora=LORA), optimizer=OptimizerConfig(lr=1e-2)
    )
    with torch.no_grad():  # B = 0 would leave the policy equal to the reference and A without gradient
        for name, p in module.lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return module, _pref_data(tmp_path, module)


def _pref_data(tmp_path: Path, module):
    return PreferenceDataModule(
        train_files=_pairs(tmp_path),
        format="explicit",
        val_size=0,
        batch_size=2,
        shuffle=False,
        tokenizer=module.tokenizer,
    )


class RecordingLogger(Logger):
    """Test collaborator: keeps every (name, value, step) the trainer writes."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[tuple[str, float, int]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.written += [(k, float(v), step) for k, v in metrics.items()]

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def _fit(module, data, callback: L.Callback, steps: int = 3, logger=None) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        limit_val_batches=0,
        logger=logger if logger is not None else False,
        log_every_n_steps=50,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[callback],
    )
    with one_thread():
        trainer.fit(module, datamodule=data)
    return trainer


@pytest.mark.parametrize("build", [_sft, _reward, _dpo], ids=["sft", "reward", "dpo"])
def test_a_nan_gradient_skips_the_step_and_changes_no_weight(tmp_path, build, caplog):
    torch.manual_seed(0)
    module, data = build(tmp_path)
    poison = PoisonGradients(steps={1})
    with caplog.at_level("WARNING", logger="rlhf_lit"):
        trainer = _fit(module, data, poison)
    w = poison.weights  # before training, then after each of the 3 steps
    assert len(w) == 4
    assert not _equal(w[0], w[1])  # step 1 trained
    assert _equal(w[1], w[2])  # step 2 had a nan gradient: nothing changed
    assert not _equal(w[2], w[3])  # step 3 trained again
    assert all(torch.isfinite(t).all() for t in w[3].values())
    assert float(trainer.callback_metrics[M.TRAIN_SKIPPED_STEPS]) == 1.0
    # AdamW saw two steps only: its step counter and moments were not touched by the skipped one
    state = next(iter(trainer.optimizers[0].state.values()))
    assert float(state["step"]) == 2.0
    # the end of training says so, and that the run did not end skipping
    ends = [r.getMessage() for r in caplog.records if "optimizer steps were skipped" in r.getMessage()]
    assert ends == [
        "1 of 3 optimizer steps were skipped, their gradients held inf or nan (train/skipped_steps)"
    ]


def test_too_many_skips_in_a_row_stop_the_run_with_a_one_line_user_error(tmp_path):
    torch.manual_seed(0)
    module, data = _sft(tmp_path)
    module._finite_steps = FiniteSteps(max_consecutive=2)  # the guard is the module's collaborator
    poison = PoisonGradients(steps={0, 1, 2})
    logger = RecordingLogger()
    with pytest.raises(DivergedTrainingError) as info:
        _fit(module, data, poison, logger=logger)
    message = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in message
    assert message.startswith(
        "training stopped at step 2: 2 optimizer steps in a row had inf or nan gradients"
    )
    assert "optimizer.lr" in message
    assert _equal(poison.weights[0], _trainable(module))  # no step was ever applied


def test_a_finite_step_resets_the_count_of_skips_in_a_row(tmp_path, caplog):
    torch.manual_seed(0)
    module, data = _sft(tmp_path)
    module._finite_steps = FiniteSteps(max_consecutive=2)
    with caplog.at_level("WARNING", logger="rlhf_lit"):
        trainer = _fit(module, data, PoisonGradients(steps={0, 2}))  # never two in a row: the run completes
    assert trainer.global_step == 3 and float(trainer.callback_metrics[M.TRAIN_SKIPPED_STEPS]) == 2.0
    # the run ended on a skipped step: the closing warning says the weights are those before it
    end = next(r.getMessage() for r in caplog.records if "optimizer steps were skipped" in r.getMessage())
    assert end.startswith("2 of 3 optimizer steps were skipped") and "the last 1 in a row" in end
