#!/usr/bin/env python
"""Profile our RM steps or one PPO iteration of the benchmark workload (torch.profiler and cProfile).

    python bench/profiling.py --workload rm --steps 8     # RM steps 2..9 (step 1 is warm-up)
    python bench/profiling.py --workload ppo              # PPO iteration 2 (iteration 1 is warm-up)
    python bench/profiling.py --workload grpo             # GRPO iteration 2 (iteration 1 is warm-up)

Prints the top operators by self CPU time (torch.profiler) and the top Python functions by internal and
cumulative time (cProfile) for the profiled window only; ``--trace FILE`` also writes a Chrome trace.
The modules and settings are exactly those of ``bench/run.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

# Run as a script, Python puts bench/ first on sys.path, where our module names could shadow others;
# the repository root takes its place, so the modules are imported as bench.<name>.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import W, setup_child  # noqa: E402


class Window:
    """torch.profiler + cProfile over a window of training batches [first, last]."""

    def __init__(self, first: int, last: int, trace: str | None):
        import torch

        self.first, self.last, self.trace = first, last, trace
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
        self.py = cProfile.Profile()

    def callback(self):
        import lightning as L

        window = self

        class Hook(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if batch_idx == window.first:
                    window.prof.start()
                    window.py.enable()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if batch_idx == window.last:
                    window.py.disable()
                    window.prof.stop()

        return Hook()

    def report(self, rows: int) -> None:
        print(self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
        print(self.prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows))
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(self.py, stream=out).sort_stats(key).print_stats(rows)
            print(out.getvalue())
        if self.trace:
            self.prof.export_chrome_trace(self.trace)


def profile_rm(args) -> None:
    import lightning as L
    from transformers import AutoTokenizer

    from bench.rm import build_module, pair_loader

    L.seed_everything(W.RM["seed"], verbose=False)
    tok = AutoTokenizer.from_pretrained(W.tokenizer_dir())
    pairs = W.load_rm_pairs(tok)[: 8 * (args.steps + 1)]
    window = Window(1, args.steps, args.trace)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[window.callback()])
    trainer.fit(build_module(), train_dataloaders=pair_loader(pairs, tok.pad_token_id, 8))
    window.report(args.rows)


def profile_ppo(args) -> None:
    import lightning as L
    from transformers import AutoTokenizer

    from bench.ppo import build_module, prompt_datamodule

    L.seed_everything(W.PPO["seed"], verbose=False)
    tok = AutoTokenizer.from_pretrained(W.tokenizer_dir(), padding_side="left")
    datamodule = prompt_datamodule(tok, W.load_ppo_prompts(tok), W.PPO["rollout_batch_size"], W.PPO["seed"])
    module = build_module(2)
    window = Window(1, 1, args.trace)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=-1, limit_train_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[window.callback()])
    trainer.fit(module, datamodule=datamodule)
    print({k: round(v, 3) for k, v in module.history[-1].items() if k.startswith("perf/")})
    window.report(args.rows)


def profile_grpo(args) -> None:
    import lightning as L
    from transformers import AutoTokenizer

    from bench.grpo import build_module
    from bench.grpo_workload import GRPO
    from bench.ppo import prompt_datamodule

    L.seed_everything(GRPO["seed"], verbose=False)
    tok = AutoTokenizer.from_pretrained(W.tokenizer_dir(), padding_side="left")
    datamodule = prompt_datamodule(tok, W.load_ppo_prompts(tok), GRPO["prompts_per_rollout"], GRPO["seed"])
    module = build_module(2)
    window = Window(1, 1, args.trace)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=-1, limit_train_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[window.callback()])
    trainer.fit(module, datamodule=datamodule)
    print({k: round(v, 3) for k, v in module.history[-1].items() if k.startswith("perf/")})
    window.report(args.rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["rm", "ppo", "grpo"], default="ppo")
    p.add_argument("--steps", type=int, default=8, help="RM steps in the profiled window")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--trace", default=None, help="write a Chrome trace of the window to this file")
    args = p.parse_args()
    W.ensure_artifacts()
    setup_child(args.threads)
    {"rm": profile_rm, "ppo": profile_ppo, "grpo": profile_grpo}[args.workload](args)


if __name__ == "__main__":
    main()
