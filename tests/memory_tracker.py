"""Peak live tensor memory of CPU code, for checking the memory planner's estimates.

``TensorMemoryTracker`` is a ``TorchDispatchMode``: every tensor an op returns whose storage it has not
seen is counted (``untyped_storage().nbytes()``) until that storage is freed (a weakref finalizer; torch
keeps one Python object per storage, so it fires when the memory is released). ``peak`` is the high-water
mark of the bytes created inside the context and still alive: on a GPU, ``torch.cuda.max_memory_allocated``
counts the same allocations (plus its 512-byte rounding). Storages that existed before entering (the
model's weights) must be declared with ``ignore`` (an op returning a view of a weight, e.g. its transpose
in ``F.linear``, would otherwise count the weight as new); add their bytes yourself (``storage_bytes``).
A DTensor (FSDP2's sharded parameters) is counted by its local shard, the memory the rank holds.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (shared and tied tensors counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


class TensorMemoryTracker(TorchDispatchMode):
    def __init__(self, ignore=()) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self._known = {t.untyped_storage()._cdata for t in ignore}

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def _track(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):  # a wrapper: its storage is the rank's local shard
            t = t.to_local()
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live or key in self._known:
            return
        nbytes = st.nbytes()
        self._live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out
