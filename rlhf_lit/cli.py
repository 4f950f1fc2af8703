"""The ``rlhf-lit`` command: LightningCLI over the stage modules and data modules.

    rlhf-lit fit --config configs/<stage>/<name>.yaml      # train a stage
    rlhf-lit fit --config ... --ckpt_path <file>.ckpt       # resume (the model is rebuilt from the checkpoint)
    rlhf-lit validate --config ... --ckpt_path ...          # evaluate a checkpoint
    rlhf-lit fit --config ... --print_config                # the full, resolved config
    rlhf-lit plan --config ... [--device-memory-gb 24]      # peak-memory estimate (rlhf_lit.planner)
    rlhf-lit demo [--fast]                                  # the whole pipeline on the offline demo task

The model and the data are chosen by ``class_path`` in the config (subclass mode), so any
``LightningModule`` / ``LightningDataModule`` works. The tokenizer belongs to the model: it is built from
the model's backbone config and handed to the data module when both are instantiated, so a config names it
once.

Errors: a user mistake (an unknown or misspelled key, an abbreviated option, a value out of range, a missing
or unwritable path, a malformed data file) is printed as one line naming the key, file, row or field, and the
command exits with status 2 (:func:`main`); ``--debug`` or ``RLHF_LIT_DEBUG=1`` adds the traceback. Other
exceptions are internal errors and keep their traceback. The order is: parse (unknown keys, types), the
checks of :mod:`rlhf_lit.checks` (values, paths, stage/data consistency), then the model is built, the data
is read (so data errors come before the trainer starts), and only then the trainer.

Checkpoints: the stage modules store their hyper-parameters with ``_class_path``
(:func:`~rlhf_lit.modules.common.plain_hparams`), the form in which LightningCLI re-parses them for
``--ckpt_path``; as in every LightningCLI, the model is then built with the checkpoint's hyper-parameters,
and a model setting of the config that differs is named in a warning.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
import warnings
from argparse import ArgumentError

import lightning as L
from lightning.pytorch.cli import LightningCLI

from rlhf_lit.callbacks import StageProgressBar
from rlhf_lit.cli_messages import condense, did_you_mean
from rlhf_lit.errors import ConfigError, UserError

log = logging.getLogger("rlhf_lit")

SUBCOMMANDS = ("fit", "validate", "test", "predict")  # LightningCLI's
EXTRA_SUBCOMMANDS = ("demo", "plan")  # dispatched by main()
DESCRIPTION = (
    "RLHF (SFT -> calibrated reward model -> PPO) on PyTorch Lightning. Subcommands: fit, validate, test, "
    "predict (LightningCLI: rlhf-lit fit --config configs/<stage>/<name>.yaml); demo (the whole pipeline on "
    "the offline demo task: rlhf-lit demo [--fast]; rlhf-lit demo --help); plan (peak-memory estimate of a "
    "config, loads no weights: rlhf-lit plan --config <file>; rlhf-lit plan --help). Add --debug (or set "
    "RLHF_LIT_DEBUG=1) to see the traceback of an error."
)
# Unknown or abbreviated options are errors (argparse would otherwise accept --trainer.max_step for
# --trainer.max_steps), and parse errors are raised, not printed with the whole usage text: main() prints
# one line.
_PARSER_KWARGS = {"exit_on_error": False, "allow_abbrev": False}


class RLHFCLI(LightningCLI):
    """LightningCLI with values linked between model and data, and checks before loading.

    Links: the model's tokenizer is handed to the data module when both are built; the data module's
    ``batch_size`` becomes ``PPOModule``'s ``rollout_batch_size`` at parse time (a model without that argument
    is not linked).
    """

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.tokenizer", "data.init_args.tokenizer", apply_on="instantiate")
        parser.link_arguments(
            "data.init_args.batch_size", "model.init_args.rollout_batch_size", apply_on="parse"
        )

    def parse_arguments(self, parser, args) -> None:
        """Parse; an unknown key, abbreviation or bad type becomes one :class:`ConfigError` line."""
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            raise ConfigError(condense(str(err), _options(parser, args))) from err
        from rlhf_lit.checks import check_ckpt_path

        check_ckpt_path(self.config)

    def before_instantiate_classes(self) -> None:
        """Check values, paths and the stage/data pairing of the parsed config before any model loads."""
        from rlhf_lit.checks import check_config

        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        check_config(config.as_dict(), subcommand)

    def instantiate_trainer(self, **kwargs):
        """Read the data first (model and data module exist by now), so a data error stops the run before the
        trainer prints anything; the trainer's own ``setup`` call then finds the data ready. Only rlhf_lit's
        data modules, whose ``setup`` needs no trainer."""
        from rlhf_lit.data.base import RLHFDataModule

        if self.subcommand in ("fit", "validate") and isinstance(self.datamodule, RLHFDataModule):
            from rlhf_lit.checks import check_data_fits_model

            self.datamodule.setup(self.subcommand)
            check_data_fits_model(self.model, self.datamodule)
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        defaults = self.trainer_defaults
        if self._get(self.config, "trainer", {}).get("enable_progress_bar") is False:
            # a trainer without a progress bar refuses a progress-bar callback: leave StageProgressBar out
            self.trainer_defaults = {k: v for k, v in defaults.items() if k != "callbacks"}
        try:
            return super().instantiate_trainer(**kwargs)
        except (ValueError, MisconfigurationException) as err:  # Lightning's checks of the trainer settings
            raise ConfigError(f"trainer: {str(err).strip().splitlines()[0]}") from err
        finally:
            self.trainer_defaults = defaults


def _options(parser, args) -> list[str]:
    """Option strings of the subcommand being parsed (for "did you mean"), else of the main parser."""
    names = [s for a in parser._actions for s in a.option_strings]
    argv = list(args or [])
    for action in parser._actions:
        choices = getattr(action, "choices", None)
        if isinstance(choices, dict) and argv and argv[0] in choices:
            names += [s for a in choices[argv[0]]._actions for s in a.option_strings]
    return names


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
    # a data module with val_size 0 returns no validation loader (an empty list), which is what it means
    warnings.filterwarnings("ignore", message=".*Total length of `list` across ranks is zero.*")
    # Lightning 2.6 asks manual-optimization modules to stash a pre-step state for ModelCheckpoint; a PPO
    # training_step is one whole iteration, and the state after it is the one a resume must start from.
    warnings.filterwarnings("ignore", message=".*no pre-optimization state was saved.*")
    # main() always hands LightningCLI its arguments explicitly (after taking out --debug and the demo/plan
    # subcommands), so LightningCLI's guard against "args given while sys.argv has arguments" is moot.
    warnings.filterwarnings(
        "ignore", message=".*LightningCLI's args parameter is intended to run from within.*"
    )
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def cli_main(args: list[str] | None = None, run: bool = True) -> RLHFCLI:
    """Build (and by default run) the CLI in-process; used by ``main`` and by the tests.

    Raises:
        ConfigError: for an unknown key, an abbreviated option or a value of the wrong type (parse), or a
            value, path or stage/data pairing that cannot work (:mod:`rlhf_lit.checks`).
        UserError: other user mistakes found later (e.g. a malformed data file: ``DataFormatError``).
    """
    _quiet_third_party()
    parser_kwargs = dict(_PARSER_KWARGS, description=DESCRIPTION)
    parser_kwargs.update({name: dict(_PARSER_KWARGS) for name in SUBCOMMANDS})
    return RLHFCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        parser_kwargs=parser_kwargs if run else dict(_PARSER_KWARGS),
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"callbacks": [StageProgressBar()]},
    )


def user_error_message(err: BaseException) -> str | None:
    """The message to print for a user mistake, or None for an internal error (which keeps its traceback).

    A user mistake is a :class:`UserError` anywhere in the exception's cause chain (jsonargparse wraps
    errors raised while it instantiates a class), a parse error, or Lightning's ``MisconfigurationException``
    (raised for trainer settings that cannot work, e.g. an unknown accelerator).
    """
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    seen = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, UserError):
            return str(current)
        if isinstance(current, ArgumentError):
            return condense(str(current))
        if isinstance(current, MisconfigurationException):
            return f"trainer: {str(current).strip().splitlines()[0]}"
        current = current.__cause__  # not __context__: a bug raised while handling a user error is a bug
    return None


def _debug_requested(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("RLHF_LIT_DEBUG", "").strip().lower() in ("1", "true", "yes")


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``rlhf-lit`` console script: ``fit``/``validate``/``test``/``predict``, ``demo``,
    ``plan``. A user mistake prints ``rlhf-lit: error: ...`` (one or two lines) and exits 2."""
    argv = list(sys.argv[1:] if args is None else args)
    debug = _debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    try:
        _dispatch(argv)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - sorted into user mistakes and internal errors below
        message = user_error_message(err)
        if message is None:
            raise
        if debug:
            traceback.print_exception(err)
        print(f"rlhf-lit: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


def _dispatch(argv: list[str]) -> None:
    if not argv:
        raise ConfigError(
            f"give a subcommand: {', '.join(SUBCOMMANDS + EXTRA_SUBCOMMANDS)} (rlhf-lit --help)"
        )
    if not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS + EXTRA_SUBCOMMANDS:
        raise ConfigError(
            f"unknown subcommand {argv[0]!r}{did_you_mean(argv[0], list(SUBCOMMANDS + EXTRA_SUBCOMMANDS))}; "
            f"expected one of {', '.join(SUBCOMMANDS + EXTRA_SUBCOMMANDS)}"
        )
    if argv and argv[0] == "plan":  # the memory planner: reads configs, loads no weights
        from rlhf_lit.planner import main as plan_main

        for flag, value in zip(argv, argv[1:]):
            if flag == "--config" and not os.path.isfile(value):
                raise ConfigError(
                    f"plan: --config {value}: no such config file (resolved to {os.path.abspath(value)})"
                )

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
