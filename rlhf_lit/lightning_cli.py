"""``RLHFCLI``: LightningCLI over the stage modules and data modules, and the one config parser.

Everything that reads a config goes through here: ``rlhf-lit fit`` / ``validate`` (:func:`cli_main`), and
the memory planner and the demo (:func:`parse_config`: the same parser, every default filled in, nothing
instantiated). The model and the data are chosen by ``class_path`` in the config (subclass mode), so any
``LightningModule`` / ``LightningDataModule`` works. Values derived from another section are linked, not
repeated: the tokenizer (from the model to the data module, when both are built) and PPO's rollout size
(from the data module's ``batch_size``, at parse time).

Checkpoints: the stage modules store their hyper-parameters with ``_class_path``
(:func:`~rlhf_lit.modules.common.plain_hparams`), the form in which LightningCLI re-parses them for
``--ckpt_path``; as in every LightningCLI, the model is then built with the checkpoint's hyper-parameters,
and a model setting of the config that differs is named in a warning.
"""

from __future__ import annotations

import logging
import sys
import warnings
from argparse import ArgumentError

import lightning as L
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from rlhf_lit.callbacks.progress import StageProgressBar
from rlhf_lit.cli_messages import PYTHON_ONLY_ARGS, condense, config_file_error, config_files, option_strings
from rlhf_lit.commands import DESCRIPTION, EXTRA_SUBCOMMANDS, SUBCOMMANDS
from rlhf_lit.errors import ConfigError
from rlhf_lit.quiet import quiet_third_party, release_held

log = logging.getLogger("rlhf_lit")

__all__ = ["DESCRIPTION", "EXTRA_SUBCOMMANDS", "SUBCOMMANDS", "RLHFCLI", "cli_main", "parse_config"]
# Unknown or abbreviated options are errors (argparse would otherwise accept --trainer.max_step for
# --trainer.max_steps), and parse errors are raised, not printed with the whole usage text: main() prints
# one line.
_PARSER_KWARGS = {"exit_on_error": False, "allow_abbrev": False}


class RLHFArgumentParser(LightningArgumentParser):
    """Lightning's parser, less the model's Python-only constructor arguments (:data:`PYTHON_ONLY_ARGS`)."""

    def add_lightning_class_args(self, lightning_class, nested_key, subclass_mode=False, required=True):
        if nested_key == "model" and subclass_mode:
            return self.add_subclass_arguments(
                lightning_class, nested_key, fail_untyped=False, required=required, skip=set(PYTHON_ONLY_ARGS)
            )
        return super().add_lightning_class_args(lightning_class, nested_key, subclass_mode, required)


class RLHFCLI(LightningCLI):
    """LightningCLI with values linked between model and data, and checks before loading.

    Links: the model's tokenizer is handed to the data module when both are built; the data module's
    ``batch_size`` becomes ``PPOModule``'s ``rollout_batch_size`` at parse time (a model without that argument
    is not linked).

    Outputs (``fit``): the export and log/checkpoint folders are locked and the export is written as one
    transaction (:class:`rlhf_lit.outputs.RunOutputs`, opened before any model loads, committed after the run);
    checkpoints are written atomically (:class:`rlhf_lit.checkpoint_io.AtomicCheckpointIO`). ``overwrite``: replace an
    earlier export in ``export_dir`` instead of refusing (``--overwrite``, an argument of every subcommand).
    """

    def __init__(self, *args, **kwargs) -> None:
        self.run_outputs = None
        kwargs.setdefault("parser_class", RLHFArgumentParser)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--overwrite",
            action="store_true",
            help="replace an earlier export in export_dir (whole, once the new one is complete) instead of "
            "refusing the run",
        )
        parser.link_arguments("model.tokenizer", "data.init_args.tokenizer", apply_on="instantiate")
        parser.link_arguments(
            "data.init_args.batch_size", "model.init_args.rollout_batch_size", apply_on="parse"
        )

    def parse_arguments(self, parser, args) -> None:
        """Parse; an unknown key, abbreviation or bad type becomes one :class:`ConfigError` line."""
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            for file in config_files(args):  # a YAML syntax error, an empty file: name the file (and line)
                if (problem := config_file_error(file)) is not None:
                    raise ConfigError(problem) from err
            raise ConfigError(condense(str(err), option_strings(parser, args))) from err
        from rlhf_lit.checks import check_ckpt_path

        check_ckpt_path(self.config)

    def _parse_ckpt_path(self) -> None:
        """Rebuild the model from the checkpoint's hyper-parameters (:meth:`_rebuild_from_checkpoint`), except the
        settings that control the run, not its weights (``rlhf_lit.checks.checkpoint.RUN_CONTROL_SETTINGS``:
        ``export_dir``, ``ppo.total_iterations``, ...): those keep the config's values, as the ``trainer``
        settings do in Lightning."""
        from rlhf_lit.checks.checkpoint import run_control_values

        subcommand = self.config.get("subcommand")
        control = run_control_values(self.config[subcommand]) if subcommand else {}
        self._rebuild_from_checkpoint()
        for key, value in control.items():
            self.config[subcommand][key] = value

    def _rebuild_from_checkpoint(self) -> None:
        """Rebuild the model from the checkpoint's hyper-parameters also for ``--ckpt_path last`` (Lightning does
        it for a file path only, so with ``last`` a config setting that differs from the checkpoint's silently
        won): the file ``last`` will resume from is found in the config's checkpoint folders
        (``rlhf_lit.checks.checkpoint.last_checkpoint``), its differing settings named in one warning, and
        ``ckpt_path`` stays ``last`` for Lightning to resolve."""
        from rlhf_lit.checks import check_ckpt_path
        from rlhf_lit.checks.checkpoint import last_checkpoint

        subcommand = self.config.get("subcommand")
        if not subcommand or self.config[subcommand].get("ckpt_path") != "last":
            return super()._parse_ckpt_path()
        found = last_checkpoint(self.config[subcommand].as_dict())
        if found is None:
            return super()._parse_ckpt_path()
        self.config[subcommand].ckpt_path = found
        check_ckpt_path(self.config)
        super()._parse_ckpt_path()
        self.config[subcommand].ckpt_path = "last"

    def before_instantiate_classes(self) -> None:
        """Check values, paths and the stage/data pairing of the parsed config before any model loads."""
        from rlhf_lit.checks import check_config

        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        # taken out of the config, so the config.yaml saved beside the run never carries it to a later run
        overwrite = bool(config.pop("overwrite", False))
        check_config(config.as_dict(), subcommand)
        if _model_parallel(config.get("trainer")):  # refused here, before the launcher starts any process
            from rlhf_lit.rl.settings import refuse_sharded_settings

            refuse_sharded_settings(_sampling_section(config.as_dict()))
        from rlhf_lit.models.architecture import estimate_export_bytes
        from rlhf_lit.outputs import RunOutputs, is_first_process

        if subcommand in ("fit", "validate") and is_first_process():
            import torch

            from rlhf_lit.checks.hardware import bf16_on_cpu_note, cpu_has_bf16

            if note := bf16_on_cpu_note(config.as_dict(), cpu_has_bf16(), torch.cuda.is_available()):
                log.warning(note)  # a warning, not a refusal: the run goes on as configured
        if subcommand == "fit" and self.subcommand and is_first_process():
            self.run_outputs = RunOutputs.from_config(config.as_dict(), overwrite, estimate_export_bytes)
            self.run_outputs.open()  # before any model loads: a locked or full folder stops the run now

    def instantiate_classes(self) -> None:
        """Instantiate; under a ``ModelParallelStrategy`` (FSDP2) inside ``deferred_weights()``, so a stage module
        that can (``rlhf_lit.models.sharded_load``) leaves its base on meta and every rank reads only its
        shards in ``configure_model``, instead of each rank loading the whole base first."""
        from contextlib import nullcontext

        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        try:
            if _model_parallel(config.get("trainer")):
                from rlhf_lit.models.sharded_load import deferred_weights

                context = deferred_weights()
            else:
                context = nullcontext()
            with context:
                super().instantiate_classes()
        except BaseException:
            if self.run_outputs is not None:
                self.run_outputs.close(ok=False)
            raise

    def _run_subcommand(self, subcommand: str) -> None:
        """Run; then commit the export and release the locks (or, on any error, drop the export's staging
        folder; a full or unwritable disk becomes one ``OutputError`` line). Other libraries' lines held since
        the command started are printed now (:func:`rlhf_lit.quiet.release_held`): the run has started."""
        release_held()
        outputs, self.run_outputs = self.run_outputs, None
        if outputs is None:
            return super()._run_subcommand(subcommand)
        try:
            super()._run_subcommand(subcommand)
        except BaseException as err:
            outputs.close(ok=False)
            failure = outputs.failure(err)
            if failure is not None:
                raise failure from err
            raise
        outputs.close(ok=True)

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
        config = self.config[self.subcommand] if self.subcommand else self.config
        if (config.get("trainer") or {}).get("enable_progress_bar") is False:
            # a trainer without a progress bar refuses a progress-bar callback: leave StageProgressBar out
            self.trainer_defaults = {k: v for k, v in defaults.items() if k != "callbacks"}
        try:
            trainer = super().instantiate_trainer(**kwargs)
            from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

            from rlhf_lit.checkpoint_io import AtomicCheckpointIO

            if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # a user's own CheckpointIO stays
                trainer.strategy.checkpoint_io = AtomicCheckpointIO()
            self._add_periodic_checkpoint(trainer, config)
            return trainer
        except (ValueError, MisconfigurationException) as err:  # Lightning's checks of the trainer settings
            raise ConfigError(f"trainer: {str(err).strip().splitlines()[0]}") from err
        finally:
            self.trainer_defaults = defaults

    def _add_periodic_checkpoint(self, trainer, config) -> None:
        """Where ``fit`` keeps ``last.ckpt`` (:mod:`rlhf_lit.callbacks.checkpoints`): PPO's ``ppo.checkpoint_every``
        adds its ``IterationCheckpoint``; an SFT, reward or DPO run whose config names no ``ModelCheckpoint`` gets
        Lightning's default one with ``save_last`` in ``<default_root_dir>/checkpoints``. Either joins the trainer
        now, not when ``fit`` attaches the module's own callbacks, because Lightning resolves ``--ckpt_path last``
        before that, and takes the place of Lightning's default ``ModelCheckpoint``, so a run writes one kind.
        With ``ckpt_path: last`` and no last checkpoint to find, one line says where it looked; with any ``ckpt_path``,
        Lightning's warning that the checkpoint folder is not empty is left out (the run resumes from there)."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        from rlhf_lit.callbacks.checkpoints import (
            missing_last_note,
            periodic_checkpoint,
            run_folder_checkpoint,
        )
        from rlhf_lit.stages import find_stage

        listed = (config.get("trainer") or {}).get("callbacks") or []
        configured = any(_is_checkpoint(c) for c in (listed if isinstance(listed, list) else [listed]))
        added = []
        if self.subcommand in ("fit", "validate"):
            # validate writes no checkpoint (Lightning saves only while fitting), but the same callback tells
            # its ``--ckpt_path last`` where the fit of this config keeps last.ckpt
            every = getattr(getattr(self.model, "ppo", None), "checkpoint_every", None)
            added = periodic_checkpoint(every, trainer)
            stage = find_stage(type(self.model))
            if not added and not configured and stage is not None and stage.progress == "epochs":
                added = run_folder_checkpoint(trainer)
        if added:
            kept = [c for c in trainer.callbacks if configured or not isinstance(c, ModelCheckpoint)]
            trainer.callbacks = kept + added
        from rlhf_lit.outputs import is_first_process

        if config.get("ckpt_path") == "last" and is_first_process():
            note = missing_last_note(trainer, self.subcommand or "fit")
            if note:  # Lightning's own warning about it is silenced (rlhf_lit.quiet): this line replaces it
                log.warning(note)
        if config.get("ckpt_path"):  # a resumed run writes beside the checkpoints it resumes from, by design
            warnings.filterwarnings("ignore", message=r".*Checkpoint directory .* exists and is not empty.*")


def _is_checkpoint(entry) -> bool:
    """Whether a ``trainer.callbacks`` entry of the parsed config (``class_path`` + ``init_args``) is a
    ``ModelCheckpoint`` or a subclass of one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from rlhf_lit.checks.rules import import_class

    path = str(getattr(entry, "class_path", None) or "")
    cls = import_class(path) if path else None
    return (isinstance(cls, type) and issubclass(cls, ModelCheckpoint)) or path.endswith("ModelCheckpoint")


def _sampling_section(config: dict):
    """The model's ``sampling`` settings as given in the parsed config (attribute access; unset ones None)."""
    from types import SimpleNamespace

    init = (config.get("model") or {}).get("init_args") or {}
    sampling = init.get("sampling") or {}
    sampling = sampling.get("init_args", sampling) if isinstance(sampling, dict) else {}
    return SimpleNamespace(copy_dtype=sampling.get("copy_dtype"), backend=sampling.get("backend") or "hf")


def _model_parallel(trainer_config) -> bool:
    """Whether the parsed ``trainer`` section names a ``ModelParallelStrategy`` (``FSDP2Strategy`` included) by
    class path."""
    strategy = (trainer_config or {}).get("strategy")
    class_path = strategy.get("class_path") if hasattr(strategy, "get") else None
    if not class_path:
        return False
    import importlib

    from lightning.pytorch.strategies import ModelParallelStrategy

    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False  # the trainer's own instantiation says what is wrong
    return isinstance(cls, type) and issubclass(cls, ModelParallelStrategy)


def cli_main(args: list[str] | None = None, run: bool = True) -> RLHFCLI:
    """Build (and by default run) the CLI in-process; used by ``main`` and by the tests.

    Raises:
        ConfigError: for an unknown key, an abbreviated option or a value of the wrong type (parse), or a
            value, path or stage/data pairing that cannot work (:mod:`rlhf_lit.checks`).
        UserError: other user mistakes found later (e.g. a malformed data file: ``DataFormatError``; a locked,
            non-empty or full output folder: ``OutputError``, which ``--overwrite`` answers for an earlier export).
    """
    quiet_third_party()
    args = list(sys.argv[1:] if args is None else args)
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


class _ParseOnly(RLHFCLI):
    """The CLI's parsing and linking without checks or instantiation (what :func:`parse_config` runs)."""

    def before_instantiate_classes(self) -> None:
        pass  # the checks look for files that a plan or the demo may not have written yet

    def instantiate_classes(self) -> None:
        pass


def parse_config(config_files: list[str], overrides: list[str] | None = None) -> dict:
    """The config ``rlhf-lit fit --config <files...> <overrides...>`` would run, as plain dicts: the stacked
    files parsed by the CLI's own parser, every class's defaults filled in, links applied, nothing built.

    Dataclass-typed settings that the files leave unset (e.g. ``model.init_args.sampling``) are None, as the
    module receives them; the module's dataclass supplies their defaults.

    Raises:
        ConfigError: for an unknown key or a value of the wrong type (as ``fit`` would).
    """
    from rlhf_lit.rng import get_rng_state, set_rng_state

    state = get_rng_state()  # LightningCLI seeds everything when the config sets seed_everything
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)  # no "Seed set to" line: nothing runs
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter is intended.*")
            cli = _ParseOnly(
                L.LightningModule,
                L.LightningDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                args=[a for f in config_files for a in ("--config", str(f))] + list(overrides or []),
                run=False,
                parser_kwargs=dict(_PARSER_KWARGS),
            )
    finally:
        set_rng_state(state)
        seed_log.setLevel(level)
    return cli.config.as_dict()
