"""bf16 on a CPU without bf16 instructions: ``fit`` says in one line that float32 runs faster there.

On such a CPU PyTorch runs bf16 matrix products in a portable fallback kernel, so ``precision: bf16-mixed`` (or a
bf16 base or sampling copy) makes a CPU run 15-18x slower instead of faster (docs/experiments/bf16_cpu.md); the
shipped SmolLM2 and MiniLM configs ask for it. The note is a warning (the run goes on), printed before any model
loads, only where the CPU is known to lack both AVX512_BF16 and AMX, and only when the run is on the CPU.
"""

from __future__ import annotations

import pytest

from rlhf_lit.checks.hardware import bf16_on_cpu_note, cpu_has_bf16, cpu_name
from tests.cli.helpers import SFT, run_cli


def _probes(avx512_bf16: bool, amx: bool) -> dict:
    return {"avx512_bf16": lambda: avx512_bf16, "amx": lambda: amx}


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "expected"),
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True)],
)
def test_a_cpu_has_bf16_when_it_has_either_instruction_set(avx512_bf16, amx, expected):
    assert cpu_has_bf16("x86_64", _probes(avx512_bf16, amx)) is expected
    assert cpu_has_bf16("AMD64", _probes(avx512_bf16, amx)) is expected  # Windows' name for x86-64


TWO_PROCESSORS = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    "flags\t\t: fpu avx2 avx512_bf16\n\n"
    "processor\t: 1\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: Other\n"
)


def test_reports_name_the_cpu_with_its_family_and_model():
    # two CPUs both named "AMD EPYC" (family 25, models 1 and 17) differ in bf16 instructions: the name alone
    # would not tell their figures apart; the first processor's fields are the ones named
    assert cpu_name(TWO_PROCESSORS) == "AMD EPYC (family 25 model 17)"
    assert cpu_name("model name\t: Some ARM core\n") == "Some ARM core"  # no family/model given: the name only
    assert cpu_name("processor\t: 0\n") not in ("", "processor")  # no model name: platform's or "unknown CPU"


def test_whether_a_cpu_has_bf16_is_unknown_off_x86_or_without_the_probes():
    """ARM's bf16 is not what the x86 probes read, and a PyTorch without them must not be read as 'no bf16'."""
    assert cpu_has_bf16("aarch64", _probes(False, False)) is None
    assert cpu_has_bf16("arm64", _probes(False, False)) is None
    assert cpu_has_bf16("x86_64", {"avx512_bf16": None, "amx": lambda: False}) is None
    assert cpu_has_bf16("x86_64", {}) is None


def _config(precision=None, accelerator=None, dtype=None, copy_dtype=None, sampling_as_class=False) -> dict:
    """A parsed config as plain dicts, as the CLI hands it over (unset keys left out)."""
    trainer = {k: v for k, v in {"precision": precision, "accelerator": accelerator}.items() if v is not None}
    sampling = {"copy_dtype": copy_dtype} if copy_dtype else {}
    if sampling_as_class:
        sampling = {"class_path": "rlhf_lit.rl.generation.SamplingConfig", "init_args": sampling}
    init = {"backbone": {"dtype": dtype} if dtype else {}, "sampling": sampling}
    return {"trainer": trainer, "model": {"class_path": "rlhf_lit.modules.PPOModule", "init_args": init}}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16", "bf16-true"])
def test_bf16_on_a_cpu_without_bf16_instructions_is_named_with_the_faster_setting(precision):
    for config, cuda in [(_config(precision, "cpu"), True), (_config(precision), False)]:
        note = bf16_on_cpu_note(config, has_bf16=False, cuda_available=cuda)
        assert note is not None and note.startswith(f"trainer.precision: {precision} on a CPU without bf16")
        assert note.endswith("set trainer.precision: 32-true") and "\n" not in note


@pytest.mark.parametrize("as_class", [False, True])
def test_a_bf16_base_and_a_bf16_sampling_copy_are_named_too(as_class):
    """bf16 weights compute in bf16 without autocast: the base's dtype and PPO's sampling copy are the other
    two ways a config asks for it; every one asked is named once, with its float32 setting."""
    config = _config("bf16-mixed", "cpu", dtype="bfloat16", copy_dtype="bfloat16", sampling_as_class=as_class)
    note = bf16_on_cpu_note(config, has_bf16=False, cuda_available=False)
    assert note.startswith(
        "trainer.precision: bf16-mixed, model.init_args.backbone.dtype: bfloat16, "
        "model.init_args.sampling.copy_dtype: bfloat16 on a CPU without bf16"
    ), note
    assert note.endswith(
        "set trainer.precision: 32-true, model.init_args.backbone.dtype: float32, "
        "model.init_args.sampling.copy_dtype: null (sample from the float32 policy)"
    ), note
    only_copy = bf16_on_cpu_note(_config(copy_dtype="bfloat16"), has_bf16=False, cuda_available=False)
    assert (
        only_copy.startswith("model.init_args.sampling.copy_dtype: bfloat16 on a CPU")
        and "precision" not in only_copy
    )


@pytest.mark.parametrize(
    ("config", "has_bf16", "cuda"),
    [
        (_config("bf16-mixed", "cpu"), True, False),  # the CPU has the instructions
        (_config("bf16-mixed", "cpu"), None, False),  # unknown: no warning
        (_config("bf16-mixed", "gpu", dtype="bfloat16"), False, True),  # not on the CPU
        (_config("bf16-mixed", "auto"), False, True),  # auto picks the GPU
        (_config("32-true", "cpu"), False, False),
        (_config("16-mixed", "cpu", dtype="float16", copy_dtype="float16"), False, False),  # not bf16
        (_config(accelerator="cpu", dtype="float32", copy_dtype="float32"), False, False),
        (_config(accelerator="cpu"), False, False),  # Lightning's default precision is float32
    ],
)
def test_no_note_where_bf16_is_not_asked_or_not_emulated(config, has_bf16, cuda):
    assert bf16_on_cpu_note(config, has_bf16, cuda) is None


def test_fit_prints_the_note_before_it_reads_the_data_and_runs_on(tmp_path):
    """The real command on this machine: the line appears exactly when this CPU lacks bf16 instructions, once,
    before the data report (the data is read once the model is built), and the run still finishes (exit 0) with
    its export written."""
    out = tmp_path / "run"
    result = run_cli(
        "fit", "--config", SFT,
        "--trainer.precision=bf16-mixed", "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
        "--trainer.logger=false", f"--trainer.default_root_dir={out}",
        f"--model.init_args.export_dir={out / 'hf'}", "--data.init_args.max_train_samples_per_file=16",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "on a CPU without bf16" in line]
    assert len(lines) == (1 if cpu_has_bf16() is False else 0), lines
    stderr = result.stderr.splitlines()
    data_report = next(i for i, line in enumerate(stderr) if "train: kept" in line)
    assert all(i < data_report for i, line in enumerate(stderr) if "on a CPU without bf16" in line), stderr
    assert (out / "hf" / "config.json").exists()
