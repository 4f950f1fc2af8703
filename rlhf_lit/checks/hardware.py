"""Settings that run, but run many times slower on this machine than an equivalent setting: one warning line
each, printed by ``rlhf-lit fit`` / ``validate`` before any model loads (a warning, not a refusal: the run goes on
as configured).

Today one case: bf16 compute (``trainer.precision: bf16-mixed``, a bf16 base or sampling copy) on an x86 CPU
without bf16 matrix instructions (neither AVX512_BF16 nor AMX). PyTorch then runs bf16 matrix products in its
portable fallback kernel instead of a vectorised one, so bf16 costs time instead of saving it: a
SmolLM2-135M-shaped training step (4 x 256 tokens, one thread) took ~18x longer under bf16 autocast than in
float32 on an AMD EPYC (family 25, model 1, AVX2 only) (docs/experiments/bf16_cpu.md).
"""

from __future__ import annotations

import platform
from collections.abc import Callable

from rlhf_lit.checks.rules import get

__all__ = ["BF16_PRECISIONS", "BF16_SETTINGS", "bf16_on_cpu_note", "cpu_has_bf16", "cpu_name"]

BF16_PRECISIONS = frozenset({"bf16", "bf16-mixed", "bf16-true"})  # Lightning's names for bf16 compute


def cpu_has_bf16(
    machine: str | None = None, probes: dict[str, Callable[[], bool]] | None = None
) -> bool | None:
    """Whether this CPU multiplies bf16 matrices natively: True with AVX512_BF16 or AMX tiles, False without
    either, None where that is not known (not x86, or a PyTorch without the probes).

    Args:
        machine: ``platform.machine()`` (injected by tests).
        probes: name -> probe, PyTorch's ``torch.cpu._is_avx512_bf16_supported`` and ``_is_amx_tile_supported``
            by default (private helpers: a PyTorch without them gives None, never a wrong answer).
    """
    machine = (machine if machine is not None else platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):  # ARM's bf16 (BF16 / SVE) is not what these probes read
        return None
    if probes is None:
        import torch

        names = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        probes = {name: getattr(torch.cpu, name, None) for name in names}
    if not probes or any(probe is None for probe in probes.values()):
        return None
    return any(bool(probe()) for probe in probes.values())


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU as reports and benchmark lines name it: ``/proc/cpuinfo``'s model name with its family and model,
    e.g. ``"AMD EPYC (family 25 model 1)"`` (two CPUs both named "AMD EPYC" differ in bf16 instructions, so in
    every figure measured on them).

    Args:
        cpuinfo: the text of ``/proc/cpuinfo`` (injected by tests); read from the file when None.

    Returns:
        The first processor's ``model name`` with ``(family F model M)`` where both are given; where the file is
        missing or names no model, ``platform.processor()`` or ``"unknown CPU"``.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    first = cpuinfo.split("\n\n")[0]
    fields = {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in first.splitlines() if ":" in ln)}
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    if fields.get("cpu family") and fields.get("model"):
        return f"{name} (family {fields['cpu family']} model {fields['model']})"
    return name


# config key -> (the values that compute in bf16, the float32 setting); model keys with or without ``init_args``
BF16_SETTINGS = {
    "trainer.precision": (BF16_PRECISIONS, "32-true"),
    "model.init_args.backbone.dtype": (frozenset({"bfloat16"}), "float32"),
    "model.init_args.sampling.copy_dtype": (frozenset({"bfloat16"}), "null (sample from the float32 policy)"),
}


def _value(config: dict, key: str):
    """``key``'s value in ``config``; for ``model.init_args.<section>.<name>`` also where the section is given as
    a class (``model.init_args.<section>.init_args.<name>``)."""
    found = get(config, key)
    if found is None and key.startswith("model.init_args.") and key.count(".") == 3:
        section, name = key.split(".")[2:]
        found = get(config, f"model.init_args.{section}.init_args.{name}")
    return found


def bf16_on_cpu_note(config: dict, has_bf16: bool | None, cuda_available: bool) -> str | None:
    """The warning for bf16 compute on a CPU without bf16 instructions, or None.

    Args:
        config: the parsed config as a dict (``trainer.precision``, ``trainer.accelerator``, and the keys of
            :data:`BF16_SETTINGS`: the trainer's precision, the base's dtype, the sampling copy's dtype).
        has_bf16: :func:`cpu_has_bf16` (None: unknown, no warning).
        cuda_available: whether ``accelerator: auto`` would pick a GPU.

    Returns:
        One line naming every key that asks for bf16 and its float32 setting; None when the run is not on the
        CPU, the CPU has bf16 instructions or is not known to lack them, or nothing asks for bf16.
    """
    accelerator = str(get(config, "trainer.accelerator") or "auto")
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not cuda_available)
    if not on_cpu or has_bf16 is not False:
        return None
    asked = [
        (key, str(value), fix)
        for key, (bf16, fix) in BF16_SETTINGS.items()
        if (value := _value(config, key)) in bf16
    ]
    if not asked:
        return None
    settings = ", ".join(f"{key}: {value}" for key, value, _ in asked)
    fixes = ", ".join(f"{key}: {fix}" for key, _, fix in asked)
    return (
        f"{settings} on a CPU without bf16 instructions (neither AVX512_BF16 nor AMX): PyTorch falls back to "
        f"slow bf16 kernels here (15-18x slower than float32 on an AVX2 CPU); set {fixes}"
    )
