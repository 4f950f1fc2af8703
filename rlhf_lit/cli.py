"""The ``rlhf-lit`` command: the stages through LightningCLI, the demo, and the memory planner.

    rlhf-lit fit --config configs/<stage>/<name>.yaml      # train a stage
    rlhf-lit fit --config ... --ckpt_path <file>.ckpt       # resume (the model is rebuilt from the checkpoint)
    rlhf-lit validate --config ... --ckpt_path ...          # evaluate a checkpoint
    rlhf-lit fit --config ... --print_config                # the full, resolved config
    rlhf-lit plan --config ... [--device-memory-gb 24]      # peak-memory estimate (rlhf_lit.planner)
    rlhf-lit demo [--fast]                                  # the whole pipeline on the offline demo task

``--verbose`` (any subcommand) shows what is silenced by default: Lightning's "Tip" lines for other products,
its GPU/TPU/HPU availability lines, known-harmless warnings and third-party log lines below WARNING.

``main`` dispatches the subcommands of :data:`EXTRA_SUBCOMMANDS` (``plan`` to :mod:`rlhf_lit.planner`, ``demo``
to :mod:`rlhf_lit.demo`; one entry each, ``name -> "module:function"``), everything else to LightningCLI
(:mod:`rlhf_lit.lightning_cli`, which the planner and the demo use to read configs). The console script,
``python -m rlhf_lit`` and ``python -m rlhf_lit.cli`` all run ``main``.

Start-up: this module imports nothing heavy. ``rlhf-lit --help`` is answered here, ``plan --help`` and
``demo --help`` by their own argument parsers before they import models; Lightning, torch and transformers are
imported only by the subcommands that use them. Before any of them, :func:`allocator_defaults` puts
``THP_MEM_ALLOC_ENABLE=1`` in the environment unless it is set (PyTorch reads it once, at its first allocation).

Errors: a user mistake (an unknown or misspelled key, an abbreviated option, a value out of range, a missing
or unwritable path, a malformed data file) is printed as one line naming the key, file, row or field, and the
command exits with status 2 (:func:`main`); ``--debug`` or ``RLHF_LIT_DEBUG=1`` adds the traceback. Other
exceptions are internal errors and keep their traceback. The order is: parse (unknown keys, types), the
checks of :mod:`rlhf_lit.checks` (values, paths, stage/data consistency), then the model is built, the data
is read (so data errors come before the trainer starts), and only then the trainer.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from argparse import ArgumentError
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

from rlhf_lit.cli_messages import condense, did_you_mean
from rlhf_lit.commands import DESCRIPTION, EXTRA_SUBCOMMANDS, SUBCOMMANDS
from rlhf_lit.errors import ConfigError, UserError
from rlhf_lit.quiet import drop_held, hold_third_party, quiet_third_party, release_held, verbose_requested

if TYPE_CHECKING:
    from rlhf_lit.lightning_cli import RLHFCLI, cli_main, parse_config

__all__ = [
    "DESCRIPTION",
    "EXTRA_SUBCOMMANDS",
    "RLHFCLI",
    "SUBCOMMANDS",
    "cli_main",
    "main",
    "parse_config",
    "user_error_message",
]

_LAZY = {
    "RLHFCLI": "rlhf_lit.lightning_cli",
    "cli_main": "rlhf_lit.lightning_cli",
    "parse_config": "rlhf_lit.lightning_cli",
}


def __getattr__(name: str) -> Any:
    """``RLHFCLI``, ``cli_main``, ``parse_config``: imported (with Lightning) on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def user_error_message(err: BaseException) -> str | None:
    """The message to print for a user mistake, or None for an internal error (which keeps its traceback).

    A user mistake is a :class:`UserError` anywhere in the exception's cause chain (jsonargparse wraps
    errors raised while it instantiates a class: a ``ConfigError`` raised in a module's or data module's
    constructor arrives here as the cause of jsonargparse's ``ValueError``), a parse error, or Lightning's
    ``MisconfigurationException`` (raised for trainer settings that cannot work, e.g. an unknown accelerator).
    Only ``__cause__`` is followed, not ``__context__``: a bug raised while handling a user error is a bug.
    """
    exceptions = sys.modules.get("lightning.fabric.utilities.exceptions")  # loaded if Lightning raised it
    misconfiguration = getattr(exceptions, "MisconfigurationException", ())
    seen = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, UserError):
            return str(current)
        if isinstance(current, ArgumentError):
            return condense(str(current))
        if misconfiguration and isinstance(current, misconfiguration):
            return f"trainer: {str(current).strip().splitlines()[0]}"
        current = current.__cause__
    return None


#: PyTorch's CPU allocator (c10 ``alloc_cpu``) page-aligns each block of 2 MiB or more and ``madvise``s it
#: ``MADV_HUGEPAGE`` when this is "1", so a fresh mapping faults in 2 MiB pages rather than 4 KiB ones; it reads
#: the variable once, at its first allocation. With ``HeapTrim``'s ``mmap_threshold`` that is what a fresh
#: mapping per activation costs (docs/scale.md, "Host memory on a CPU").
THP_ENV = "THP_MEM_ALLOC_ENABLE"


def allocator_defaults(environ: MutableMapping[str, str]) -> None:
    """Sets ``THP_MEM_ALLOC_ENABLE=1`` in ``environ`` unless it holds the variable (``0`` turns huge pages off).
    It takes effect only in a process that has not imported torch yet: the ``rlhf-lit`` command and what it
    starts. Harmless where the kernel's transparent huge pages are ``never`` (the advice is then ignored)."""
    environ.setdefault(THP_ENV, "1")


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``rlhf-lit`` console script: ``fit``/``validate``/``test``/``predict``, ``demo``,
    ``plan``. A user mistake prints ``rlhf-lit: error: ...`` (one or two lines) and exits 2."""
    allocator_defaults(os.environ)
    argv = list(sys.argv[1:] if args is None else args)
    debug = "--debug" in argv or os.environ.get("RLHF_LIT_DEBUG", "").strip().lower() in ("1", "true", "yes")
    verbose = verbose_requested(argv)
    argv = [a for a in argv if a not in ("--debug", "--verbose")]
    quiet_third_party(verbose)
    if not verbose:  # other libraries' lines wait until the run starts (rlhf_lit.quiet)
        hold_third_party()
    try:
        _dispatch(argv)
    except SystemExit as err:
        (release_held if err.code in (0, None) else drop_held)()
        raise
    except KeyboardInterrupt:
        release_held()
        raise
    except BaseException as err:  # noqa: BLE001 - sorted into user mistakes and internal errors below
        message = user_error_message(err)
        if message is None or debug:  # an internal error's traceback, or --debug: with everything held
            release_held()
        else:
            drop_held()  # a user mistake: its line stands alone
        if message is None:
            raise
        if debug:
            traceback.print_exception(err)
        # what stdout holds goes out first (a progress bar's last line), so with 2>&1 the message starts a line
        sys.stdout.flush()
        print(f"rlhf-lit: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    else:
        release_held()
    finally:
        quiet_third_party(False)  # the next command in this process (a test) starts quiet again


def _usage() -> str:
    import textwrap

    names = ", ".join((*SUBCOMMANDS, *EXTRA_SUBCOMMANDS))
    return (
        f"usage: rlhf-lit [-h] [--debug] [--verbose] {{{names}}} ...\n\n"
        + textwrap.fill(DESCRIPTION, width=100)
        + "\n\nrlhf-lit <subcommand> --help lists a subcommand's options.\n"
    )


def _dispatch(argv: list[str]) -> None:
    names = [*SUBCOMMANDS, *EXTRA_SUBCOMMANDS]
    if not argv:
        raise ConfigError(f"give a subcommand: {', '.join(names)} (rlhf-lit --help)")
    if argv[0] in ("-h", "--help"):
        print(_usage())
        raise SystemExit(0)
    if not argv[0].startswith("-") and argv[0] not in names:
        raise ConfigError(
            f"unknown subcommand {argv[0]!r}{did_you_mean(argv[0], names)}; expected one of {', '.join(names)}"
        )
    if argv[0] in EXTRA_SUBCOMMANDS:
        module, _, function = EXTRA_SUBCOMMANDS[argv[0]].partition(":")
        getattr(importlib.import_module(module), function)(argv[1:])
        return
    from rlhf_lit.lightning_cli import cli_main

    cli_main(argv)


if __name__ == "__main__":
    main()
