"""Scalar heads for reward and value models, and the pooling that picks the state a reward is read from.

A ``ScalarHead`` maps a hidden state ``(..., H)`` to one float ``(...)``. Its weights are float32 and the
hidden states are cast to float32 first, so a bf16 or 4-bit backbone never meets a dtype mismatch
(docs/pitfalls.md: 4-bit with LoRA).

Pooling (``POOLINGS``), over the real tokens of each row (attention mask 1):

* ``last``: the state at the last real token; the causal-LM default (it has read the whole sequence) and the
  only one that can sit on a causal LM's EOS (docs/pitfalls.md: score token);
* ``mean``: the mean of the states of every real token, special tokens included (as sentence-transformers
  pools all-MiniLM-L6-v2 and its kin); the encoder default;
* ``first``: the state at the first real token, an encoder's ``[CLS]`` (the last-layer state itself, not
  BERT's pooler, whose dense + tanh layer is not part of every encoder).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from rlhf_lit.functional.sequence import last_real_index

Pooling = Literal["last", "mean", "first"]
POOLINGS: tuple[str, ...] = ("last", "mean", "first")


class ScalarHead(nn.Module):
    """A linear map from hidden states to a scalar (reward or value), in float32.

    Args:
        hidden_size: H, the backbone's hidden size.
        init_std: standard deviation of the normal initialisation of the weight (bias starts at 0).
            ``1 / sqrt(H + 1)`` when not given, the choice of Stiennon et al. 2020 for reward heads.
    """

    def __init__(self, hidden_size: int, init_std: float | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1, dtype=torch.float32)
        std = init_std if init_std is not None else 1.0 / (hidden_size + 1) ** 0.5
        nn.init.normal_(self.linear.weight, std=std)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` hidden states -> ``(...)`` float32 scalars."""
        return self.linear(hidden.to(self.linear.weight.dtype)).squeeze(-1)


def pool_hidden(
    hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling = "last"
) -> torch.Tensor:
    """One state per row: ``(B, T, H)`` hidden states -> ``(B, H)`` (module docstring).

    Args:
        hidden: ``(B, T, H)`` hidden states.
        attention_mask: ``(B, T)``, 1 = real token; left or right padding, pad may equal EOS.
        pooling: ``last`` | ``mean`` | ``first``.

    Returns:
        ``(B, H)``: the chosen row state (``last``, ``first``: in the hidden dtype) or the float32 mean over
        real tokens (``mean``; a row without a real token gives zeros).

    Raises:
        ValueError: an unknown ``pooling``.
    """
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if pooling == "last":
        return hidden[rows, last_real_index(attention_mask)]
    if pooling == "first":  # argmax returns the first maximal index: the first real token
        return hidden[rows, attention_mask.long().argmax(-1)]
    if pooling == "mean":
        mask = attention_mask.to(torch.float32).unsqueeze(-1)
        return (hidden.float() * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")


def score_pooled(
    head: ScalarHead, hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling = "last"
) -> torch.Tensor:
    """``(B,)`` float32 scalars of ``head`` over the pooled state of each row (``pool_hidden``)."""
    return head(pool_hidden(hidden, attention_mask, pooling))


def score_last_token(head: ScalarHead, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scalar read at the last real token of each row (docs/pitfalls.md: score token).

    Args:
        head: the scalar head.
        hidden: ``(B, T, H)`` hidden states.
        attention_mask: ``(B, T)``, 1 = real token; left or right padding, pad may equal EOS.

    Returns:
        ``(B,)`` float32 scores.
    """
    return score_pooled(head, hidden, attention_mask, "last")
