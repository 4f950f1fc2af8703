"""Host memory that does not climb on a CPU: :class:`HeapTrim` hands the allocator's free pages back after each
step.

glibc keeps what PyTorch frees (``docs/scale.md``, "Host memory on a CPU"): after the first
steps most activations come from its heap, whose freed pages stay resident, and each new batch shape leaves the
heap larger and more fragmented, so the resident set between steps climbs with the run. ``malloc_trim(0)``
(glibc >= 2.8) returns the free top of the heap and ``madvise``s free whole pages inside it, so each step starts
from what is live. It frees nothing live and moves nothing: a no-op on results.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from lightning.pytorch.callbacks import Callback

__all__ = ["HeapTrim", "trim_heap"]

_LIBC = None


def trim_heap() -> bool:
    """``malloc_trim(0)`` of glibc; ``True`` when memory was returned to the system, ``False`` when none was or
    the C library is not glibc (macOS, musl: nothing is called)."""
    global _LIBC
    if not sys.platform.startswith("linux"):
        return False
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):  # not glibc
            _LIBC = False
    return bool(_LIBC and _LIBC.malloc_trim(0))


class HeapTrim(Callback):
    """Trim the host heap (:func:`trim_heap`) after every ``every_n_steps`` training batches (PPO: iterations)
    and after each validation, when the module runs on the CPU (on a GPU the activations live on the device).

    Args:
        every_n_steps: batches between trims (>= 1).

    Raises:
        ValueError: ``every_n_steps`` < 1.
    """

    def __init__(self, every_n_steps: int = 1) -> None:
        if int(every_n_steps) < 1:
            raise ValueError(f"HeapTrim: every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = int(every_n_steps)
        self.trims = 0  # how many trims ran (returned memory or not)

    def _trim(self, pl_module) -> None:
        if pl_module.device.type == "cpu":
            trim_heap()
            self.trims += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % self.every_n_steps == 0:
            self._trim(pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._trim(pl_module)
