"""Resident memory of a PPO/GRPO run phase by phase: after import, after building, with the weights read, and at the
start and end of each iteration's sampling, collection (sampling + experience pass + scores) and update.

    OMP_NUM_THREADS=1 python bench/phase_rss.py --config configs/ppo/smollm2_lora.yaml --iterations 3 \\
        --set model.init_args.backbone.name_or_path=/tmp/smollm2_hf \\
        --set 'model.init_args.reward_model={path: null, backbone: {name_or_path: /tmp/smollm2_hf}, mode: separate}'

Prints one line per mark: the tag, the current RSS, the peak RSS so far (``ru_maxrss``) and the number of imported
modules, all in MiB. The phases are timed by wrapping the built module's collector, updater and sampler methods
in this process only (a measurement, not a way to run). Results: docs/scale.md ("Where a CPU run's resident
memory goes").
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _mark(tag: str) -> None:
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{tag:28s} rss {rss:8.1f} MiB  peak {peak:8.1f} MiB  modules {len(sys.modules)}", flush=True)


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
