"""Does bf16 autocast speed up reward-model training on THIS CPU? Measure before choosing ``precision``.

    python scripts/bf16_cpu_check.py [--config configs/reward/minilm_hh.yaml] [--steps 12] [--rounds 3]

Builds the config's reward module and data module (through the CLI parser, nothing else), takes the first
``steps`` training batches and times full training steps (forward of chosen and rejected, Bradley-Terry
loss, backward, AdamW step) in float32 and under ``torch.autocast("cpu", torch.bfloat16)`` (what
``trainer.precision: bf16-mixed`` runs), alternating the two ``rounds`` times on the same batches so that a
change in the machine's load hits both. Prints the CPU model, its bf16 flags (``avx512_bf16``, ``amx_bf16``:
without them bf16 runs in emulation and is usually slower), the load average and the median seconds per step.
The weights are reset before every round, so both precisions train the same steps from the same start.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from rlhf_lit.checks.hardware import cpu_name
from rlhf_lit.functional.losses import bt_pairwise_loss


def cpu_description() -> tuple[str, list[str]]:
    """The CPU's name, family and model, and its bf16/AMX flags (``/proc/cpuinfo``; none where it is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "flags:")
    flags = [x for x in line.split(":", 1)[1].split() if "bf16" in x or x.startswith("amx")]
    return cpu_name(text), sorted(set(flags))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/reward/minilm_hh.yaml")
    parser.add_argument("--steps", type=int, default=12, help="training batches per timing round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    from rlhf_lit.cli import cli_main

    cli = cli_main(["--config", args.config, "--trainer.logger=false"], run=False)
    module, data = cli.model, cli.datamodule
    data.setup("fit")
    batches = []
    for batch in data.train_dataloader():
        batches.append(batch)
        if len(batches) == args.steps:
            break
    start = copy.deepcopy(module.state_dict())
    times: dict[str, list[float]] = {"float32": [], "bf16 autocast": []}
    for _ in range(args.rounds):
        for mode in times:
            module.load_state_dict(start)
            module.train()
            optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-5)
            for batch in batches:
                t0 = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "float32"):
                    chosen, rejected, _ = module._score_pairs(batch)
                    loss = bt_pairwise_loss(chosen, rejected).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                times[mode].append(time.perf_counter() - t0)
    name, flags = cpu_description()
    result = {
        "cpu": name,
        "bf16_flags": flags,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "seconds_per_step": {k: statistics.median(v) for k, v in times.items()},
        "steps_timed": {k: len(v) for k, v in times.items()},
    }
    s = result["seconds_per_step"]
    result["bf16_speedup"] = s["float32"] / s["bf16 autocast"]
    print(
        f"{name} (bf16 flags: {', '.join(flags) or 'none'}), {result['threads']} threads, load "
        f"{' '.join(f'{x:.2f}' for x in result['load_average'])}: float32 {s['float32']:.2f} s/step, bf16 "
        f"autocast {s['bf16 autocast']:.2f} s/step ({result['bf16_speedup']:.2f}x), median of "
        f"{result['steps_timed']['float32']} steps each"
    )
    return result


if __name__ == "__main__":
    main()
