"""The process's random-number-generator states (torch, CUDA, Python, NumPy) as checkpointable values.

A resumed PPO run must draw the same samples as an uninterrupted one, so the PPO module saves these in its
checkpoint and restores them when training starts again (after everything else has set up).

Under data parallelism every rank starts from the run's one seed (``seed_everything``), so without more every rank
would draw the same random numbers while sampling: two ranks given the same prompt (a repeated prompt, a small
prompt set) would return the same responses, and the responses of different prompts would share their noise.
TRL seeds each process apart for the same reason (``set_seed(seed, device_specific=True)`` in its GRPO trainer).
Here rank 0 keeps the run's stream, so a one-process run draws exactly as before, and every other rank reseeds
torch with :func:`rank_seed` when training starts; a checkpoint holds every rank's states (:func:`gather_rng_states`)
and each rank takes back its own (:func:`start_rank_stream`).
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import torch

__all__ = ["gather_rng_states", "get_rng_state", "rank_seed", "set_rng_state", "start_rank_stream"]


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


def rank_seed(seed: int, rank: int) -> int:
    """The torch seed of rank ``rank``'s sampling stream in a process seeded ``seed``: ``seed`` on rank 0 (one
    process draws as it always did), a CRC-32 of ``(seed, rank)`` on every other rank (distinct per rank, and a
    pure function of the two, so a rerun draws the same)."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return seed if rank == 0 else zlib.crc32(f"rlhf_lit/rank/{seed}/{rank}".encode())


def gather_rng_states() -> list[dict] | None:
    """Every rank's :func:`get_rng_state`, in rank order (a collective: every rank must call it), or None in a
    single process (no process group, or a group of one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, get_rng_state())
    return states


def start_rank_stream(saved: dict | None, per_rank: list[dict] | None, rank: int, world_size: int) -> None:
    """Set this rank's RNG for training: its own saved states where the checkpoint holds one per rank for this
    many ranks (``per_rank``, from :func:`gather_rng_states`); else the saved (rank 0's) states, if any, and on a
    rank other than 0 torch reseeded with :func:`rank_seed` of its seed (a fresh run, a checkpoint from before
    states were kept per rank, or one resumed on another number of ranks: the ranks still draw apart)."""
    if per_rank is not None and len(per_rank) == world_size:
        set_rng_state(per_rank[rank])
        return
    if saved is not None:
        set_rng_state(saved)
    if rank > 0:
        torch.manual_seed(rank_seed(torch.initial_seed(), rank))
