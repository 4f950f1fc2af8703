"""What the ``rlhf-lit`` command does not print unless ``--verbose`` asks (``RLHF_LIT_VERBOSE=1``).

Silenced: Lightning's "Tip" lines advertising other products (litlogger, litmodels), its GPU/TPU/HPU
availability lines, its "Seed set to" line, its warning that an epoch has fewer batches than ``log_every_n_steps``, the bitsandbytes
hint about an optional CPU kernel package, transformers' missing-attention-mask warning on packed rows, progress bars of the Hugging Face libraries, their log lines below
WARNING, and a few warnings known to be harmless here (each is named below with why). Nothing is imported:
the filters attach to loggers and the warnings registry by name, so this costs nothing at start-up.

Held: what other libraries log (any logger outside ``rlhf_lit`` that reaches the root handler) and the Python
warnings they raise, from the start of a command until its run starts (:func:`release_held`, called when the
trainer starts, when a command ends well, or before an internal error's traceback). A user mistake found
before that prints its ``rlhf-lit: error:`` line alone: the held lines are dropped (:func:`drop_held`), since
a library's warning about, say, offline mode is not what the user has to fix. ``--verbose`` holds nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

__all__ = ["drop_held", "quiet_third_party", "release_held", "verbose_requested"]

_VERBOSE = {"on": False}  # what main() decided for this command

# rank_zero_info lines of Lightning that advertise other products or state the obvious on every run
# ("Seed set to N": the seed is in the config.yaml saved beside every run; before a one-line error it is noise)
_LIGHTNING_NOISE = (
    "💡 Tip:",
    "GPU available:",
    "TPU available:",
    "HPU available:",
    "IPU available:",
    "Seed set to",
)
_LIGHTNING_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.fabric.utilities.seed",
)
# GPT-2's forward warns once when ids without an attention mask hold the pad id at either end; packed rows
# (``packing``) pass no mask on purpose, their position ids restart per row (rlhf_lit.functional.packing)
_TRANSFORMERS_NOISE = ("We strongly recommend passing in an `attention_mask`",)
_NOISY_LOGGERS = (*_LIGHTNING_LOGGERS, "transformers.modeling_utils")

_HARMLESS_WARNINGS = (
    ".*does not have many workers.*",  # the data is tokenised in memory; worker processes would not help
    ".*gemm_4bit_forward.*",  # bitsandbytes' CPU fallback for 4-bit matmuls
    ".*isinstance.treespec, LeafSpec.*",
    ".*is_gradient_checkpointing.*is deprecated.*",
    ".*val_dataloader.*but have no .validation_step.*",
    # a data module with val_size 0 returns no validation loader (an empty list), which is what it means
    ".*Total length of `list` across ranks is zero.*",
    # Lightning 2.6 asks manual-optimization modules to stash a pre-step state for ModelCheckpoint; a PPO
    # training_step is one whole iteration, and the state after it is the one a resume must start from.
    ".*no pre-optimization state was saved.*",
    # the tiny configs' epochs are shorter than the logging interval; metrics are still logged at epoch end
    ".*is smaller than the logging interval.*",
    # --ckpt_path last with nothing to resume from: the CLI prints one line naming where it looked instead
    # (rlhf_lit.callbacks.checkpoints.missing_last_note)
    ".*is set, but there is no last checkpoint available.*",
    # under bf16-mixed the model summary counts fp32 bytes for its size estimate: one line per run, no effect
    ".*is not supported by the model summary.*",
)


class _DropNoise(logging.Filter):
    """Drops Lightning's advert and device-availability lines, and transformers' missing-mask warning for
    packed rows, unless the command is verbose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _VERBOSE["on"] or not str(record.getMessage()).startswith(_LIGHTNING_NOISE + _TRANSFORMERS_NOISE)


_FILTER = _DropNoise()

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# other libraries' log records and warnings, while held: each a function that prints it; None = not holding
_HELD: dict[str, list | None] = {"lines": None}
_MAX_HELD = 1000  # a library that logs in a loop before the run starts keeps its first lines only


def _ours(name: str) -> bool:
    return name == "rlhf_lit" or name.startswith("rlhf_lit.")


class _HoldingHandler(logging.StreamHandler):
    """The root handler of the ``rlhf-lit`` command (stderr): rlhf_lit's own records at once, other libraries'
    records held while :data:`_HELD` holds (see the module docstring)."""

    def emit(self, record: logging.LogRecord) -> None:
        held = _HELD["lines"]
        if held is not None and not _ours(record.name):
            if len(held) < _MAX_HELD:
                held.append(lambda: logging.StreamHandler.emit(self, record))
            return
        super().emit(record)


_SHOW_WARNING = {"original": warnings.showwarning}  # what printed warnings before the command held them


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` of the command: a warning raised outside rlhf_lit's files is held like a
    library's log record."""
    original = _SHOW_WARNING["original"]
    held = _HELD["lines"]
    ours = os.path.abspath(str(filename)).startswith(_PACKAGE_DIR + os.sep)
    if held is not None and not ours:
        if len(held) < _MAX_HELD:
            held.append(lambda: original(message, category, filename, lineno, file, line))
        return
    original(message, category, filename, lineno, file, line)


def hold_third_party() -> None:
    """Start holding other libraries' log lines and warnings (``main`` calls it unless ``--verbose``)."""
    if _HELD["lines"] is None:
        _HELD["lines"] = []
    if warnings.showwarning is not _show_warning:
        _SHOW_WARNING["original"] = warnings.showwarning
        warnings.showwarning = _show_warning


def release_held() -> None:
    """Print what was held, in order, and stop holding (the run has started, or the command ended well)."""
    held, _HELD["lines"] = _HELD["lines"], None
    for show in held or []:
        show()
    _restore_showwarning()


def drop_held() -> None:
    """Forget what was held and stop holding (a user mistake ends the command: its line stands alone)."""
    _HELD["lines"] = None
    _restore_showwarning()


def _restore_showwarning() -> None:
    if warnings.showwarning is _show_warning:
        warnings.showwarning = _SHOW_WARNING["original"]


def verbose_requested(argv: list[str]) -> bool:
    """``--verbose`` in ``argv`` or ``RLHF_LIT_VERBOSE`` set to 1/true/yes."""
    return "--verbose" in argv or os.environ.get("RLHF_LIT_VERBOSE", "").strip().lower() in (
        "1",
        "true",
        "yes",
    )


def quiet_third_party(verbose: bool | None = None) -> None:
    """Install the filters (idempotent). ``verbose=None`` keeps what the command decided (default: quiet)."""
    if verbose is not None:
        _VERBOSE["on"] = bool(verbose)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    root = logging.getLogger()
    if not root.handlers:  # as logging.basicConfig: a host (a test runner) that set up logging keeps its own
        handler = _HoldingHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    # Lightning prints its records through its own handler on the "lightning" logger (added on import,
    # whatever the root has); passed on to the root's handler too, every Lightning line showed twice
    logging.getLogger("lightning").propagate = False
    for name in _NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    # main() always hands LightningCLI its arguments explicitly (after taking out --debug, --verbose and its
    # own subcommands), so LightningCLI's guard against "args given while sys.argv has arguments" is moot.
    warnings.filterwarnings(
        "ignore", message=".*LightningCLI's args parameter is intended to run from within.*"
    )
    if _VERBOSE["on"]:
        return
    for name in ("transformers", "datasets", "peft", "httpx", "urllib3", "filelock", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # bitsandbytes warns on import that an optional CPU kernel package is missing; the fallback is fine.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    for message in _HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    # progress bars of the Hugging Face libraries: by environment before they are imported, else directly
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
