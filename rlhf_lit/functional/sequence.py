"""Positions, last real tokens, selective log-probabilities and stop-token masks.

Notation:
    B batch size, P prompt length, R response length, T = P + R, V vocabulary size.
    mask / attention_mask: bool or 0/1, True = a real token (left or right padding alike).
    Log-probabilities are natural logs (nats).

Masks are never derived from ``ids != pad_token_id``: many tokenizers (GPT-2, Llama, SmolLM2) set
``pad == eos``, and that comparison would hide the real end-of-sequence token (docs/pitfalls.md: score token, SFT labels).
The response mask comes from the first stop token instead (``stop_mask``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "position_ids_from_mask",
    "last_real_index",
    "chunk_views",
    "scaled_piece",
    "gather_logprobs",
    "response_positions",
    "stop_mask",
    "truncate_after_stop",
    "trim_left_padding",
    "length_groups",
    "pad_cat",
    "repeat_prompts",
]


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids that start at 0 on the first real token of each row.

    ``clamp(cumsum(mask) - 1, min=0)``: left padding gets position 0 (it is masked out anyway), so a
    left-padded sequence sees the same positions as the unpadded one (docs/pitfalls.md: left padding).

    Args:
        attention_mask: (B, T) bool or 0/1; True = real token.

    Returns:
        (B, T) long tensor, e.g. mask ``[0, 0, 1, 1, 1]`` -> ``[0, 0, 0, 1, 2]``.
    """
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def response_positions(outputs: Tensor, prompt_len: int) -> Tensor:
    """The outputs that predict the response tokens: ``outputs[:, P - 1 : T - 1]`` of ``(B, T, ...)`` outputs
    (logits or hidden states) of a prompt of width P followed by R response tokens (docs/layout.md: the log-prob
    of token ``x[i]`` comes from the logits at position ``i - 1``; the critic's value of that action is read
    at the same position). A view, ``(B, R, ...)``; e.g. T = 5, P = 3: positions 2 and 3 predict tokens 3, 4.

    Raises:
        ValueError: if ``prompt_len`` is not in ``[1, T - 1]``.
    """
    if not 1 <= prompt_len < outputs.shape[1]:
        raise ValueError(f"prompt_len must be in [1, T - 1] = [1, {outputs.shape[1] - 1}], got {prompt_len}")
    return outputs[:, prompt_len - 1 : -1]


def trim_left_padding(
    input_ids: Tensor, attention_mask: Tensor, prompt_len: int
) -> tuple[Tensor, Tensor, int]:
    """Drop the leading columns that are padding in every row (left-padded prompts + responses).

    Exact for a causal LM fed ``position_ids_from_mask``: a masked column changes no real token's output
    (docs/pitfalls.md: left padding). The prompt block keeps at least one column, so response positions stay at
    ``prompt_len' - 1 + j`` for the logits.

    Args:
        input_ids: ``(B, T)``, the prompt block (width ``prompt_len``, left padded) then the response.
        attention_mask: ``(B, T)``, 1 = real token.
        prompt_len: width P of the prompt block.

    Returns:
        ``(input_ids[:, k:], attention_mask[:, k:], P - k)`` with k the number of all-padding leading
        columns, at most ``P - 1``. E.g. masks ``[[0, 0, 1, 1], [0, 1, 1, 1]]`` with P = 3 -> k = 1.
    """
    real = attention_mask[:, :prompt_len].any(dim=0)
    k = int(real.long().argmax()) if bool(real.any()) else prompt_len - 1
    k = min(k, prompt_len - 1)
    if k == 0:
        return input_ids, attention_mask, prompt_len
    return input_ids[:, k:], attention_mask[:, k:], prompt_len - k


def pad_cat(tensors: Sequence[Tensor], value: float | bool = 0, side: str = "right") -> Tensor:
    """Concatenate ``(B_i, W_i, ...)`` tensors along dim 0, each first padded along dim 1 to the widest ``W``.

    The pieces of one batch collected at different widths (left-padded prompts, right-padded responses) become
    one ``(sum B_i, max W_i, ...)`` tensor; a new tensor, the inputs are not modified.

    Args:
        tensors: one or more tensors of the same dtype, rank >= 2 and equal sizes beyond dim 1.
        value: what the added columns hold (the pad id, 0, False, 1.0 for weights).
        side: ``right`` (add columns after a piece's own: responses) or ``left`` (before: prompts).

    Returns:
        E.g. ``[[1, 2]]`` and ``[[3], [4]]`` with value 0: ``right`` -> ``[[1, 2], [3, 0], [4, 0]]``, ``left`` ->
        ``[[1, 2], [0, 3], [0, 4]]``.

    Raises:
        ValueError: no tensors, a tensor of rank < 2, or ``side`` not ``left`` / ``right``.
    """
    if not tensors:
        raise ValueError("pad_cat needs at least one tensor")
    if side not in ("left", "right"):
        raise ValueError(f"pad_cat: side must be 'left' or 'right', got {side!r}")
    if any(t.dim() < 2 for t in tensors):
        raise ValueError(f"pad_cat pads dim 1: got shapes {[tuple(t.shape) for t in tensors]}")
    width = max(t.shape[1] for t in tensors)
    pieces = []
    for t in tensors:
        extra = width - t.shape[1]
        if extra == 0:
            pieces.append(t)
            continue
        pad = torch.full((t.shape[0], extra, *t.shape[2:]), value, dtype=t.dtype, device=t.device)
        pieces.append(torch.cat([t, pad] if side == "right" else [pad, t], dim=1))
    return torch.cat(pieces, dim=0)


def last_real_index(mask: Tensor) -> Tensor:
    """Index of the last real token of each row, for left or right padding.

    Not ``sum(mask) - 1`` (wrong under left padding) and not "first pad - 1" (wrong when
    ``pad == eos``); docs/pitfalls.md: score token: ``[1,1,1,1,1,1,0,0]`` -> 5, ``[0,0,1,1,1,1,1,1]`` -> 7.

    Args:
        mask: (B, T) bool or 0/1; True = real token.

    Returns:
        (B,) long tensor of positions in ``[0, T)``.

    Raises:
        ValueError: If a row has no real token (the message names the rows).
    """
    mask = mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=-1)
    if bool((last < 0).any()):
        empty = (last < 0).nonzero().flatten().tolist()
        raise ValueError(f"last_real_index: row(s) {empty} have no real token (mask is all False)")
    return last


# The default (``chunk_size=None``) path cuts the B x R positions into pieces of ``B * R // AUTO_CHUNK_PARTS``
# positions, raised to ``AUTO_CHUNK_MIN_ELEMENTS // V`` (256 KiB of float32 logits: smaller pieces only add
# per-op overhead), lowered to ``AUTO_CHUNK_MAX_ELEMENTS // V`` (16 MiB), and at least one position. Rounding
# down keeps every piece within 1 / AUTO_CHUNK_PARTS of the (B, R, V) tensor once that tensor holds 8 MiB
# (32 minimum pieces) and B * R >= 32 positions (rounding up gave 2 of 48 positions at V = 50257). The
# memory each function keeps per piece, and the bound that gives, are in its docstring.
AUTO_CHUNK_PARTS = 32
AUTO_CHUNK_MIN_ELEMENTS = 1 << 16
AUTO_CHUNK_MAX_ELEMENTS = 1 << 22


def chunk_views(shape: torch.Size, chunk_size: int | None) -> list[tuple[slice, slice]]:
    """``(rows, positions)`` slices that tile a ``(B, R, V)`` tensor into pieces of a few positions each.

    Slicing (never reshaping) keeps every piece a view, also of non-contiguous logits (e.g. ``logits[:, :-1]``).

    Args:
        shape: ``(B, R, V)``.
        chunk_size: batch rows per piece; ``None`` picks ``B * R // AUTO_CHUNK_PARTS`` positions per
            piece, raised to ``AUTO_CHUNK_MIN_ELEMENTS // V`` and lowered to ``AUTO_CHUNK_MAX_ELEMENTS // V``
            (at least 1; whole rows when that is at least R).

    Returns:
        The pieces, in row-major order; empty when ``B * R == 0``.
    """
    B, R, V = shape
    if B == 0 or R == 0:
        return []
    if chunk_size is not None:
        step = chunk_size * R
    else:
        V = max(V, 1)
        step = max((B * R) // AUTO_CHUNK_PARTS, AUTO_CHUNK_MIN_ELEMENTS // V)
        step = max(1, min(step, AUTO_CHUNK_MAX_ELEMENTS // V))
    if step >= R:
        rows = step // R
        return [(slice(b, min(b + rows, B)), slice(0, R)) for b in range(0, B, rows)]
    return [(slice(b, b + 1), slice(r, min(r + step, R))) for b in range(B) for r in range(0, R, step)]


def scaled_piece(piece: Tensor, temperature: float, compute_dtype: torch.dtype) -> tuple[Tensor, bool]:
    """``piece / temperature`` in ``compute_dtype``, and whether it is a new tensor (safe to edit in place).

    Without a temperature or a dtype change the piece itself (a view of the caller's logits) comes back.
    """
    if piece.dtype != compute_dtype:
        x = piece.to(compute_dtype)
        return (x.div_(temperature) if temperature != 1.0 else x), True
    if temperature != 1.0:
        return piece / temperature, True
    return piece, False


class _SelectiveLogSoftmax(torch.autograd.Function):
    """``z[token] - logsumexp(z)`` with ``z = logits / T``, piece by piece; the backward recomputes the
    softmax piece by piece.

    Saves only the logits (already alive) and the (B, R) log-sum-exp, and holds one float32 temporary of one
    piece at a time (in-place arithmetic on it, freed before the next piece is made), so neither pass holds a
    second (B, R, V) tensor: the only full-size tensor made is the gradient of the logits itself.
    """

    @staticmethod
    def forward(ctx, logits, tokens, temperature, pieces):
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        out = torch.empty(tokens.shape, dtype=compute_dtype, device=logits.device)
        lse = torch.empty_like(out)
        for rows, cols in pieces:
            z, own = scaled_piece(logits[rows, cols], temperature, compute_dtype)
            picked = z.gather(-1, tokens[rows, cols].unsqueeze(-1)).squeeze(-1)
            peak = z.amax(dim=-1, keepdim=True)
            e = z.sub_(peak) if own else z - peak  # the one temporary
            piece_lse = e.exp_().sum(dim=-1).log_().add_(peak.squeeze(-1))
            lse[rows, cols] = piece_lse
            out[rows, cols] = picked - piece_lse
            del z, e, picked, peak, piece_lse  # freed before the next piece is made, not when rebound
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.pieces = temperature, pieces
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        # d logp / d x_v = (onehot_v - softmax_v) / T
        logits, tokens, lse = ctx.saved_tensors
        T = ctx.temperature
        grad = torch.empty_like(logits)
        for rows, cols in ctx.pieces:
            z, own = scaled_piece(logits[rows, cols], T, lse.dtype)
            shift = lse[rows, cols].unsqueeze(-1)
            p = (z.sub_(shift) if own else z - shift).exp_()  # softmax, the one temporary
            g = grad_out[rows, cols].unsqueeze(-1).to(lse.dtype)
            p.mul_(-g).scatter_add_(-1, tokens[rows, cols].unsqueeze(-1), g)
            grad[rows, cols] = p.div_(T) if T != 1.0 else p
            del z, p, g  # freed before the next piece is made
        return grad, None, None, None


def gather_logprobs(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """Log-probability of each token under ``softmax(logits / temperature)``, selectively.

    Computes ``logits[token] / T - logsumexp(logits / T)`` instead of ``log_softmax`` followed by a
    gather, piece by piece over the positions (``chunk_views``), so no second (B, R, V) tensor is
    materialised at any temperature (docs/pitfalls.md: vocabulary memory): one float32 temporary of one piece (``logits / T``,
    then its exponentials, in place) is all that is alive at once, and the backward recomputes the softmax
    piece by piece instead of keeping it (a custom autograd function; the one full-size tensor it makes is
    the logits' gradient). Work is done in float32 (float64 stays
    float64), so bf16 logits are upcast per piece only. The temperature must be the sampling temperature,
    for rollout, training and reference passes alike, or the first PPO ratio is not 1 (docs/pitfalls.md: sampling temperature).

    Args:
        logits: (B, R, V) logits already aligned with ``tokens``: ``logits[:, i]`` predicts
            ``tokens[:, i]`` (the caller slices the model output at positions P-1 .. T-2); any strides.
        tokens: (B, R) long token ids.
        temperature: Sampling temperature T > 0.
        chunk_size: Batch rows per piece; None (the default) picks pieces of a few positions
            (``chunk_views``). The extra memory is one float32 piece plus the (B, R) results, in the forward
            and again on top of the logits' gradient in the backward: under 4% of one float32 (B, R, V)
            tensor once it holds 8 MiB, B * R >= 32 and V >= 1024, and never above 16 MiB plus the (B, R)
            results. With rows, the piece is one float32 tensor of shape (chunk_size, R, V).

    Returns:
        (B, R) log-probabilities in nats (<= 0), float32 (float64 for float64 logits);
        differentiable with respect to ``logits``.

    Raises:
        ValueError: If shapes disagree, ``temperature <= 0`` or ``chunk_size < 1``.
    """
    if logits.dim() != 3 or logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be tokens {tuple(tokens.shape)} + (V,)")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    pieces = chunk_views(logits.shape, chunk_size)
    return _SelectiveLogSoftmax.apply(logits, tokens.long(), float(temperature), pieces)


def _as_id_tensor(stop_token_ids: int | Sequence[int] | Tensor, device: torch.device) -> Tensor:
    ids = torch.as_tensor(stop_token_ids, dtype=torch.long, device=device).flatten()
    if ids.numel() == 0:
        raise ValueError("stop_token_ids is empty; give at least one stop (e.g. eos) token id")
    return ids


def stop_mask(
    response_ids: Tensor,
    stop_token_ids: int | Sequence[int] | Tensor,
    pad_token_id: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Mask of the real response tokens: everything up to and including the first stop token.

    A row without a stop token (it ran to ``max_new_tokens``) is real throughout. Tokens after the
    first stop are not real whatever their ids, so this works when ``pad == eos``.

    Args:
        response_ids: (B, R) generated token ids (prompt excluded).
        stop_token_ids: One id or several (eos, end-of-turn, ...).
        pad_token_id: Not used to build the mask (pad may equal eos, and masks never come from
            pad ids); accepted so callers can pass their generation settings uniformly.

    Returns:
        ``(mask, has_stop)``: mask (B, R) bool, True = real response token; has_stop (B,) bool,
        True where the row contains a stop token.

    Raises:
        ValueError: If ``stop_token_ids`` is empty.
    """
    del pad_token_id  # documented as unused; see the docstring
    is_stop = torch.isin(response_ids, _as_id_tensor(stop_token_ids, response_ids.device))
    stops_before = is_stop.long().cumsum(dim=-1) - is_stop.long()  # stop tokens strictly before t
    return stops_before == 0, is_stop.any(dim=-1)


def truncate_after_stop(
    response_ids: Tensor, stop_token_ids: int | Sequence[int] | Tensor, pad_token_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Replace every token after the first stop token by ``pad_token_id`` (out of place).

    Args:
        response_ids: (B, R) generated token ids; not modified.
        stop_token_ids: One id or several.
        pad_token_id: Id written after the first stop token.

    Returns:
        ``(ids, mask, has_stop)``: ids (B, R) a new tensor; mask and has_stop as in ``stop_mask``.

    Raises:
        ValueError: If ``stop_token_ids`` is empty.
    """
    mask, has_stop = stop_mask(response_ids, stop_token_ids)
    ids = torch.where(mask, response_ids, torch.full_like(response_ids, pad_token_id))
    return ids, mask, has_stop


#: A row joins a length group while it holds at least this fraction of the group's longest row's tokens.
LENGTH_GROUP_FILL = 0.9


def length_groups(lengths: Tensor, fill: float = LENGTH_GROUP_FILL) -> list[Tensor]:
    """Rows grouped by similar length, so a right-padded batch can run in pieces each trimmed to its longest row.

    Rows are taken longest first (ties in row order); a row starts a new group when it is shorter than ``fill``
    times the current group's longest row. So no row of a group is padded by more than ``1 - fill`` of the
    group's width, whatever the batch's spread of lengths. E.g. lengths ``[5, 10, 9, 4]`` with ``fill = 0.9``
    give ``[[1, 2], [0], [3]]``.

    Args:
        lengths: ``(B,)`` long, the real tokens of each row (>= 1).
        fill: in (0, 1]; 1 groups equal lengths only.

    Returns:
        Long index tensors (on ``lengths``' device) that partition ``0 .. B - 1``, longest group first.

    Raises:
        ValueError: if ``fill`` is outside (0, 1] or ``lengths`` is not one-dimensional.
    """
    if not 0 < fill <= 1:
        raise ValueError(f"fill must be in (0, 1], got {fill}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be (B,), got {tuple(lengths.shape)}")
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    values = lengths.tolist()
    groups: list[list[int]] = []
    for row in order:
        if not groups or values[row] < fill * values[groups[-1][0]]:
            groups.append([])
        groups[-1].append(row)
    return [torch.tensor(g, dtype=torch.long, device=lengths.device) for g in groups]


def repeat_prompts(batch: dict, n: int) -> dict:
    """The batch with each prompt repeated ``n`` times in consecutive rows (every tensor's dim 0 and every
    list), so a prompt's n responses (its group) are sampled on the rank that holds the prompt, next to each
    other: group ``g`` is rows ``g * n .. g * n + n - 1``. ``n = 1`` returns the batch itself."""
    if n == 1:
        return batch
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() > 0:
            out[key] = value.repeat_interleave(n, dim=0)
        elif isinstance(value, list):
            out[key] = [item for item in value for _ in range(n)]
        else:
            out[key] = value
    return out
