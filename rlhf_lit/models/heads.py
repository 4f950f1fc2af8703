"""Scalar heads for reward and value models.

A ``ScalarHead`` maps a hidden state ``(..., H)`` to one float ``(...)``. Its weights are float32 and the
hidden states are cast to float32 first, so a bf16 or 4-bit backbone never meets a dtype mismatch
(PITFALLS B15).
"""

from __future__ import annotations

import torch
from torch import nn

from rlhf_lit.functional.sequence import last_real_index


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


def score_last_token(head: ScalarHead, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scalar read at the last real token of each row (PITFALLS B04).

    Args:
        head: the scalar head.
        hidden: ``(B, T, H)`` hidden states.
        attention_mask: ``(B, T)``, 1 = real token; left or right padding, pad may equal EOS.

    Returns:
        ``(B,)`` float32 scores.
    """
    index = last_real_index(attention_mask)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return head(hidden[rows, index])
