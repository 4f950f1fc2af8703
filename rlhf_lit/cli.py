"""The ``rlhf-lit`` command: the stages through LightningCLI, the demo, and the memory planner.

    rlhf-lit fit --config configs/<stage>/<name>.yaml      # train a stage
    rlhf-lit fit --config ... --ckpt_path <file>.ckpt       # resume (the model is rebuilt from the checkpoint)
    rlhf-lit validate --config ... --ckpt_path ...          # evaluate a checkpoint
    rlhf-lit fit --config ... --print_config                # the full, resolved config
    rlhf-lit plan --config ... [--device-memory-gb 24]      # peak-memory estimate (rlhf_lit.planner)
    rlhf-lit demo [--fast]                                  # the whole pipeline on the offline demo task

``main`` dispatches: ``plan`` to :mod:`rlhf_lit.planner`, ``demo`` to :mod:`rlhf_lit.demo`, everything else to
LightningCLI (:mod:`rlhf_lit.lightning_cli`, which the planner and the demo use to read configs). The console
script, ``python -m rlhf_lit`` and ``python -m rlhf_lit.cli`` all run ``main``.

Errors: a user mistake (an unknown or misspelled key, an abbreviated option, a value out of range, a missing
or unwritable path, a malformed data file) is printed as one line naming the key, file, row or field, and the
command exits with status 2 (:func:`main`); ``--debug`` or ``RLHF_LIT_DEBUG=1`` adds the traceback. Other
exceptions are internal errors and keep their traceback. The order is: parse (unknown keys, types), the
checks of :mod:`rlhf_lit.checks` (values, paths, stage/data consistency), then the model is built, the data
is read (so data errors come before the trainer starts), and only then the trainer.
"""

from __future__ import annotations

import os
import sys
import traceback
from argparse import ArgumentError

from rlhf_lit.cli_messages import condense, did_you_mean
from rlhf_lit.errors import ConfigError, UserError
from rlhf_lit.lightning_cli import (
    EXTRA_SUBCOMMANDS,
    RLHFCLI,
    SUBCOMMANDS,
    _quiet_third_party,
    cli_main,
    parse_config,
)

__all__ = ["RLHFCLI", "cli_main", "main", "parse_config", "user_error_message"]


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
    if argv and argv[0] == "evaluate":  # score a preference model on preference files (rlhf_lit.evaluation)
        _quiet_third_party()
        from rlhf_lit.evaluation import main as evaluate_main

        evaluate_main(argv[1:])
        return
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
