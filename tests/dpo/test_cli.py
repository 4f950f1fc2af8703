"""The preference stage through the command line: user mistakes are one ``rlhf-lit: error:`` line with exit
status 2; ``--ckpt_path`` resumes a run to the same state as an uninterrupted one, bit for bit; the KTO config
trains."""

from __future__ import annotations

import pytest
import torch

from rlhf_lit.callbacks.progress import _label
from rlhf_lit.cli import cli_main, main
from tests.dpo.helpers import make_module
from tests.tiny_runs import in_repo_root, one_thread

DPO = "configs/dpo/tiny.yaml"
KTO = "configs/dpo/kto_tiny.yaml"


def _small(root) -> list[str]:
    return [
        f"--trainer.default_root_dir={root}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--model.init_args.export_dir=null",
    ]


CASES = [
    ("beta_zero", [DPO, "--model.init_args.beta=0"], "model.init_args.beta must be a number > 0, got 0"),
    (
        "kto_loss_on_pairs",
        [DPO, "--model.init_args.loss_type=kto", "--data.init_args.max_train_samples_per_file=8"],
        "loss_type 'kto' trains on unpaired completions",
    ),
    ("paired_loss_on_kto_rows", [KTO, "--model.init_args.loss_type=sigmoid"], "hold unpaired (KTO-style)"),
    (
        "simpo_with_reference_cache",
        [DPO, "--model.init_args.loss_type=simpo", "--model.init_args.reference_cache=/tmp/x"],
        "loss_type 'simpo' is reference-free",
    ),
    ("full_finetuning_without_reference", [DPO, "--config", "NO_LORA"], "full fine-tuning"),
    (
        "label_smoothing_with_hinge",
        [DPO, "--model.init_args.loss_type=hinge", "--model.init_args.label_smoothing=0.1"],
        "label_smoothing is used by loss_type label_smoothing or robust",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_preference_mistake_is_one_line_and_exit_2(case, tmp_path, capsys):
    _, (config, *extra), expected = case
    no_lora = tmp_path / "no_lora.yaml"  # a stacked config: jsonargparse does not take lora=null as an option
    no_lora.write_text("model:\n  init_args:\n    backbone:\n      lora: null\n")
    extra = [str(no_lora) if arg == "NO_LORA" else arg for arg in extra]
    capsys.readouterr()
    with in_repo_root(), one_thread(), pytest.raises(SystemExit) as info:
        main(["fit", "--config", config, *_small(tmp_path), *extra])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert info.value.code == 2, lines
    assert 1 <= len(lines) <= 3 and not any("Traceback" in line for line in lines), lines
    assert lines[-1].startswith("rlhf-lit: error: ") and expected in lines[-1], lines[-1]


def _fit(root, *extra: str) -> dict:
    args = [
        "fit",
        "--config",
        DPO,
        *_small(root),
        "--data.init_args.max_train_samples_per_file=24",
        "--data.init_args.val_size=4",
        "--data.init_args.batch_size=4",
        "--data.init_args.max_length=256",
        # a schedule over the run's length would differ between a 1-epoch and a 2-epoch run by design
        "--model.init_args.optimizer.scheduler=constant",
        "--trainer.limit_val_batches=1",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={root / 'ck'}",
        "--trainer.callbacks.save_last=true",
        *extra,
    ]
    with in_repo_root(), one_thread():
        cli_main(args)
    return torch.load(root / "ck" / "last.ckpt", map_location="cpu", weights_only=True)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_resume_from_ckpt_path_equals_an_uninterrupted_run(tmp_path):
    straight = _fit(tmp_path / "straight", "--trainer.max_epochs=2")
    first = _fit(tmp_path / "first", "--trainer.max_epochs=1")
    resumed = _fit(
        tmp_path / "resumed",
        "--trainer.max_epochs=2",
        "--ckpt_path",
        str(tmp_path / "first" / "ck" / "last.ckpt"),
    )
    assert straight["global_step"] == resumed["global_step"] == 2 * first["global_step"] > 0
    assert straight["state_dict"] and all("lora_" in k for k in straight["state_dict"])  # adapter only
    assert _same(straight["state_dict"], resumed["state_dict"])
    assert _same(straight["optimizer_states"], resumed["optimizer_states"])
    assert _same(straight["lr_schedulers"], resumed["lr_schedulers"])
    assert not _same(first["state_dict"], straight["state_dict"])  # the second epoch did train


def test_the_kto_config_trains_and_its_progress_bar_says_kto(tmp_path, capsys):
    shown = [a for a in _small(tmp_path) if a != "--trainer.enable_progress_bar=false"]
    with in_repo_root(), one_thread():
        cli = cli_main(["fit", "--config", KTO, *shown, "--trainer.limit_train_batches=2"])
    assert cli.trainer.global_step == 2 and cli.trainer.state.finished
    captured = capsys.readouterr()
    bar = captured.out + captured.err
    assert "[kto] epoch 0" in bar and "[dpo]" not in bar  # the DPO stage's KTO variant (rlhf_lit.stages)
    dpo = make_module(loss_type="sigmoid")
    assert _label(dpo) == "dpo"
