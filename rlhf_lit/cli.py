"""The ``rlhf-lit`` command: LightningCLI over the stage modules and data modules.

    rlhf-lit fit --config configs/<stage>/<name>.yaml      # train a stage
    rlhf-lit validate --config ... --ckpt_path ...          # evaluate
    rlhf-lit fit --config ... --print_config                # the full, resolved config
    rlhf-lit plan --config ... [--device-memory-gb 24]      # peak-memory estimate (rlhf_lit.planner)

The model and the data are chosen by ``class_path`` in the config (subclass mode), so any
``LightningModule`` / ``LightningDataModule`` works. The tokenizer belongs to the model: it is built from
the model's backbone config and handed to the data module when both are instantiated, so a config names it
once.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import lightning as L
from lightning.pytorch.cli import LightningCLI

from rlhf_lit.callbacks import StageProgressBar


class RLHFCLI(LightningCLI):
    """LightningCLI with the tokenizer linked from the model to the data module."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.tokenizer", "data.init_args.tokenizer", apply_on="instantiate")


def _quiet_third_party() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for name in ("transformers", "datasets", "peft", "httpx", "urllib3", "filelock"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # bitsandbytes warns on import that an optional CPU kernel package is missing; the fallback is fine.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*gemm_4bit_forward.*")
    warnings.filterwarnings("ignore", message=".*isinstance.treespec, LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*is deprecated.*")
    warnings.filterwarnings("ignore", message=".*val_dataloader.*but have no .validation_step.*")
    # Lightning 2.6 asks manual-optimization modules to stash a pre-step state for ModelCheckpoint; a PPO
    # training_step is one whole iteration, and the state after it is the one a resume must start from.
    warnings.filterwarnings("ignore", message=".*no pre-optimization state was saved.*")
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def cli_main(args: list[str] | None = None, run: bool = True) -> RLHFCLI:
    """Build (and by default run) the CLI in-process; used by ``main`` and by the tests."""
    _quiet_third_party()
    return RLHFCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"callbacks": [StageProgressBar()]},
    )


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``rlhf-lit`` console script."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] == "plan":  # the memory planner: reads configs, loads no weights
        from rlhf_lit.planner import main as plan_main

        plan_main(argv[1:])
        return
    if argv and argv[0] == "demo":
        _quiet_third_party()
        from rlhf_lit.demo import main as demo_main

        demo_main(argv[1:])
        return
    cli_main(argv)


if __name__ == "__main__":
    main()
