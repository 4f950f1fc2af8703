"""Padding-free packing: the ragged rows of a padded batch laid end to end in a few bins.

Notation:
    B rows, T padded width; NB bins, L bin width (the longest bin's real tokens, <= capacity).
    mask / attention_mask: bool or 0/1, True = a real token (left or right padding alike).

A row's real tokens stay in order and get position ids ``0 .. n - 1`` (what ``position_ids_from_mask`` gives
the padded row). Rows are assigned to bins by first-fit decreasing (Johnson 1973) with a capacity, by default
the longest row of the batch: one bin is never longer than the padded row, so attention over the packed batch
costs ``sum(bin_len^2) <= B * T^2`` where one giant row of all tokens would cost ``(sum of lengths)^2``. A bin's
unused tail holds filler whose position ids count from 0 again, a segment of its own that no real token sees.

The model confines attention to each row from the restarting position ids (transformers' packed-sequence
masks; ``rlhf_lit.models.trunk.trunk_hidden_states``); here is only the index arithmetic, and the summed
response log-probs read from packed hidden states (``response_logps_packed``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_lit.functional.preference import response_scoring_mask, summed_token_logps

__all__ = [
    "PackedLayout",
    "first_fit_decreasing",
    "pack_layout",
    "pack",
    "unpack",
    "packed_labels",
    "response_logps_packed",
]


class PackedLayout(NamedTuple):
    """Where each packed slot's token comes from.

    Attributes:
        source: (NB, L) long, the flat index ``b * T + t`` of the padded token in each slot (0 in the filler).
        valid: (NB, L) bool, True where a slot holds a real token.
        position_ids: (NB, L) long, the token's position within its row; filler counts from 0.
        first: (NB, L) bool, True at the first real token of each row.
        shape: ``(B, T)`` of the padded batch.
    """

    source: Tensor
    valid: Tensor
    position_ids: Tensor
    first: Tensor
    shape: tuple[int, int]


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of row indices whose lengths sum to at most ``capacity``, by first-fit decreasing.

    Rows are taken longest first (ties by index) and each goes to the first bin with room, else a new bin.
    Rows of length 0 go in no bin.

    Args:
        lengths: each row's number of real tokens, ``>= 0``.
        capacity: the most tokens one bin holds, ``>= 1``.

    Returns:
        the bins in the order opened, each the row indices in the order placed,
        e.g. lengths ``[3, 5, 2, 4]``, capacity 6 -> ``[[1], [3, 2], [0]]``.

    Raises:
        ValueError: ``capacity < 1`` or a row longer than ``capacity``.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if lengths and max(lengths) > capacity:
        raise ValueError(f"a row of {max(lengths)} tokens does not fit a bin of {capacity}")
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[row]
        if n == 0:
            continue
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(row)
                room[b] -= n
                break
        else:
            bins.append([row])
            room.append(capacity - n)
    return bins


def pack_layout(attention_mask: Tensor, capacity: int | None = None) -> PackedLayout:
    """The packed layout of a padded batch (module docstring).

    Args:
        attention_mask: (B, T) bool or 0/1, True = real token.
        capacity: the most tokens per bin; default the longest row (at least 1).

    Returns:
        a :class:`PackedLayout` on the mask's device. A batch without real tokens gives one bin of width 1
        holding filler only.

    Raises:
        ValueError: ``capacity`` shorter than the longest row.
    """
    mask = attention_mask.bool()
    num_rows, width = mask.shape
    lengths = mask.sum(-1).tolist()
    bins = first_fit_decreasing(lengths, capacity or max(max(lengths, default=0), 1))
    bin_width = max([sum(lengths[r] for r in rows) for rows in bins] + [1])
    shape = (max(len(bins), 1), bin_width)
    source = torch.zeros(shape, dtype=torch.long)
    valid = torch.zeros(shape, dtype=torch.bool)
    first = torch.zeros(shape, dtype=torch.bool)
    position_ids = torch.zeros(shape, dtype=torch.long)
    columns = [mask[r].nonzero().squeeze(-1).cpu() for r in range(num_rows)]
    for b, rows in enumerate(bins):
        at = 0
        for r in rows:
            n = lengths[r]
            source[b, at : at + n] = r * width + columns[r]
            valid[b, at : at + n] = True
            first[b, at] = True
            position_ids[b, at : at + n] = torch.arange(n)
            at += n
        position_ids[b, at:] = torch.arange(bin_width - at)
    device = attention_mask.device
    return PackedLayout(
        source.to(device), valid.to(device), position_ids.to(device), first.to(device), (num_rows, width)
    )


def pack(values: Tensor, layout: PackedLayout, fill: float | int = 0) -> Tensor:
    """Padded per-token values ``(B, T, ...)`` -> packed ``(NB, L, ...)``, ``fill`` in the filler slots."""
    flat = values.reshape(values.shape[0] * values.shape[1], *values.shape[2:])
    packed = flat[layout.source.reshape(-1)].reshape(*layout.source.shape, *values.shape[2:])
    keep = layout.valid.reshape(*layout.valid.shape, *([1] * (values.dim() - 2)))
    return torch.where(keep, packed, torch.as_tensor(fill, dtype=values.dtype, device=values.device))


def unpack(packed: Tensor, layout: PackedLayout) -> Tensor:
    """Packed per-token values ``(NB, L, ...)`` -> padded ``(B, T, ...)``, 0 at padding (differentiable)."""
    rows, width = layout.shape
    tail = packed.shape[2:]
    flat = packed.reshape(-1, *tail)[layout.valid.reshape(-1)]
    out = packed.new_zeros(rows * width, *tail)
    out = out.index_copy(0, layout.source.reshape(-1)[layout.valid.reshape(-1)], flat)
    return out.reshape(rows, width, *tail)


def packed_labels(labels: Tensor, layout: PackedLayout, ignore_index: int = -100) -> Tensor:
    """Next-token labels ``(B, T)`` -> packed ``(NB, L)`` for a loss that shifts (``sft_nll``).

    Each row's first token and the filler become ``ignore_index``: in the packed bin the token before a row's
    first is the previous row's last, which must predict nothing (in the padded batch nothing precedes it).
    """
    out = pack(labels, layout, fill=ignore_index)
    return out.masked_fill(layout.first, ignore_index)


def response_logps_packed(
    trunk: Callable[[Tensor, Tensor], Tensor],
    head: Callable[[Tensor], Tensor],
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: Tensor,
    response_len: Tensor,
) -> Tensor:
    """``rlhf_lit.functional.preference.response_logps_from_hidden`` with the trunk run once on the batch's rows
    packed (``pack_layout``): no padding goes through the model and no row attends to another (DPO, KTO).

    A response token's scoring position is found in the packed bins (``pack`` of ``response_scoring_mask``):
    the slot after it holds the token it scores, since a row's tokens are contiguous in one bin; only those
    ``N`` hidden states reach ``head``. The values equal one padded forward's up to float summation order.

    Args:
        trunk: ``(input_ids, position_ids)`` ``(NB, L)`` packed -> last hidden states ``(NB, L, H)``, with
            attention confined to the segments the restarting position ids mark.
        head: the LM head, ``(N, H)`` -> ``(N, V)``.
        input_ids, attention_mask: ``(B, T)``, right padded (True = real token).
        prompt_len: ``(B,)`` long, ``P_b >= 1``.
        response_len: ``(B,)`` long, ``R_b >= 1`` and ``P_b + R_b <= T``.

    Returns:
        ``(B,)`` float32 sums in nats (<= 0), in the batch's row order; differentiable.

    Raises:
        ValueError: if a row has no prompt token, no response token, or overflows T.
    """
    width = input_ids.shape[1]
    scoring = response_scoring_mask(prompt_len, response_len, width)  # (B, T - 1): logit j scores token j + 1
    layout = pack_layout(attention_mask)
    packed_ids = pack(input_ids, layout)
    packed_scoring = pack(F.pad(scoring, (0, 1)), layout, fill=False)[:, :-1]  # (NB, L - 1)
    hidden = trunk(packed_ids, layout.position_ids)
    rows = layout.source[:, :-1][packed_scoring] // width
    return summed_token_logps(
        hidden[:, :-1][packed_scoring], head, packed_ids[:, 1:][packed_scoring], rows, input_ids.shape[0]
    )
