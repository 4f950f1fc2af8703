"""Host memory that does not climb on a CPU: :class:`HeapTrim` hands the allocator's free pages back after each
step.

glibc keeps what PyTorch frees (``docs/scale.md``, "Host memory on a CPU"): after the first
steps most activations come from its heap, whose freed pages stay resident, and each new batch shape leaves the
heap larger and more fragmented, so the resident set between steps climbs with the run. ``malloc_trim(0)``
(glibc >= 2.8) returns the free top of the heap and ``madvise``s free whole pages inside it, so each step starts
from what is live. It frees nothing live and moves nothing: a no-op on results.

:func:`set_mmap_threshold` (``HeapTrim(mmap_threshold=...)``) fixes the size from which glibc gives a block its
own mapping, which goes back to the system when freed, so large activations never reach the heap at all.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from lightning.pytorch.callbacks import Callback

from rlhf_lit.errors import ConfigError

__all__ = ["MMAP_THRESHOLD_MAX", "HeapTrim", "set_mmap_threshold", "trim_heap"]

#: ``mallopt``'s parameter number for the mmap threshold (glibc ``malloc.h``: ``#define M_MMAP_THRESHOLD -3``).
M_MMAP_THRESHOLD = -3
#: The largest mmap threshold glibc accepts on a 64-bit system, in bytes: 32 MiB, ``DEFAULT_MMAP_THRESHOLD_MAX``
#: = 4 * 1024 * 1024 * sizeof(long) (mallopt(3), M_MMAP_THRESHOLD: "The lower limit for this parameter is 0. The
#: upper limit is DEFAULT_MMAP_THRESHOLD_MAX"; glibc ``malloc.c`` refuses more than ``HEAP_MAX_SIZE / 2``).
MMAP_THRESHOLD_MAX = 32 * 2**20

_LIBC = None


def _libc():
    """glibc's handle (loaded once), or False when the C library is not glibc or the platform not Linux."""
    global _LIBC
    if _LIBC is None:
        _LIBC = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                libc.malloc_trim.argtypes = [ctypes.c_size_t]
                libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                _LIBC = libc
            except (OSError, AttributeError):  # not glibc
                pass
    return _LIBC


def trim_heap() -> bool:
    """``malloc_trim(0)`` of glibc; ``True`` when memory was returned to the system, ``False`` when none was or
    the C library is not glibc (macOS, musl: nothing is called)."""
    libc = _libc()
    return bool(libc and libc.malloc_trim(0))


def set_mmap_threshold(nbytes: int) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, nbytes)`` of glibc: from now on every block of at least ``nbytes`` bytes that the
    free lists cannot serve gets its own mapping, returned to the system when freed, and glibc's dynamic threshold
    (128 KiB at start, raised to each larger block freed, up to 32 MiB) is off for the rest of the process.

    Args:
        nbytes: the threshold in bytes, in [0, :data:`MMAP_THRESHOLD_MAX`].

    Returns:
        ``True`` when glibc accepted it; ``False`` when it refused it or the C library is not glibc (nothing called).
    """
    libc = _libc()
    return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, int(nbytes)))


class HeapTrim(Callback):
    """Trim the host heap (:func:`trim_heap`) after every ``every_n_steps`` training batches (PPO: iterations)
    and after each validation, when the module runs on the CPU (on a GPU the activations live on the device).

    With ``mmap_threshold`` set, ``setup`` also fixes glibc's mmap threshold once (:func:`set_mmap_threshold`,
    when the run is on the CPU and the C library is glibc): blocks of that size or more get their own mapping and
    go back to the system when freed instead of staying in the heap, whose dynamic threshold otherwise climbs to
    32 MiB so that most activations land there. It lowers the peak, not the RSS between steps (the trim does
    that). Measured on a CPU (``docs/scale.md``, "Host memory on a CPU"): with 1 MiB the SmolLM2 PPO config's
    peak over 5 iterations fell from 2,872 to 2,359 MiB at the same wall time, but the DPO benchmark's steps were
    40-60% slower (each fresh mapping is paged in again); hence off by default. The pages cost less in huge
    pages, which the ``rlhf-lit`` command asks PyTorch for (:data:`rlhf_lit.cli.THP_ENV`): in float32 the SmolLM2
    DPO config's steps took 1.08x glibc's default time with them, ~1.5x without (peak 5,736 -> 1,826 MiB).

    Args:
        every_n_steps: batches between trims (>= 1).
        mmap_threshold: glibc's mmap threshold in bytes, in [0, 33554432] (32 MiB, glibc's ceiling on 64-bit
            systems, mallopt(3)); None (default) leaves glibc's dynamic threshold alone. 1048576 (1 MiB) is the
            measured value. Works like the environment variable ``MALLOC_MMAP_THRESHOLD_``, but from ``setup`` on.

    Raises:
        ConfigError (a ValueError): ``every_n_steps`` < 1, or ``mmap_threshold`` not a whole number in that range.
    """

    def __init__(self, every_n_steps: int = 1, mmap_threshold: int | None = None) -> None:
        if int(every_n_steps) < 1:
            raise ConfigError(f"HeapTrim: every_n_steps must be >= 1, got {every_n_steps}")
        if mmap_threshold is not None and (
            isinstance(mmap_threshold, bool)
            or not isinstance(mmap_threshold, int)
            or not 0 <= mmap_threshold <= MMAP_THRESHOLD_MAX
        ):
            raise ConfigError(
                f"HeapTrim: mmap_threshold must be a whole number of bytes in [0, {MMAP_THRESHOLD_MAX}] (glibc's "
                f"ceiling, 32 MiB) or null, got {mmap_threshold!r}"
            )
        self.every_n_steps = int(every_n_steps)
        self.mmap_threshold = mmap_threshold
        self.trims = 0  # how many trims ran (returned memory or not)
        self.mmap_threshold_set = False  # whether glibc took mmap_threshold (once, in setup)

    def setup(self, trainer, pl_module, stage: str) -> None:
        on_cpu = trainer.strategy.root_device.type == "cpu"  # setup runs before the module is moved there
        if self.mmap_threshold is not None and on_cpu and not self.mmap_threshold_set:
            self.mmap_threshold_set = set_mmap_threshold(self.mmap_threshold)

    def _trim(self, pl_module) -> None:
        if pl_module.device.type == "cpu":
            trim_heap()
            self.trims += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % self.every_n_steps == 0:
            self._trim(pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._trim(pl_module)
