"""The process's random-number-generator states (torch, CUDA, Python, NumPy) as checkpointable values.

A resumed PPO run must draw the same samples as an uninterrupted one, so the PPO module saves these in its
checkpoint and restores them when training starts again (after everything else has set up).
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> dict:
    """RNG states in types a weights-only ``torch.load`` accepts (tensors, lists, ints, strings)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss_next],
        "numpy": numpy_state,
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`get_rng_state` returned (CUDA states only where CUDA is available)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
