"""Length-controlled reward training: the switches of ``RewardModule(length_control=...)``.

Each is off by default and moves the training loss only (``rlhf_lit.functional.length_control`` holds the
math and the sources):

* ``balance``: the chosen-longer and the chosen-shorter pairs of a batch weigh the same in the pairwise loss
  (``length_balance_weights``, multiplied into any ``pair_weight`` of the data);
* ``decorrelation_coef``: adds ``coef * |rho(score, length)|`` over the batch's 2B responses
  (``pearson_correlation``), so the score stops tracking length;
* ``odin_length_coef`` > 0: ODIN's disentangled heads (Chen et al. 2024): a second, length head; the pairwise
  loss is on ``r_Q + r_L`` (quality head + length head), plus ``odin_length_coef * (|rho(r_Q, L)| -
  rho(r_L, L))`` and ``odin_orthogonality_coef * |w_Q . w_L|`` (``head_orthogonality``). Only the quality
  head scores validation pairs and is exported, so every consumer of the export (PPO, ``rlhf-lit evaluate``)
  reads ``r_Q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_lit.functional.length_control import head_orthogonality, length_balance_weights, pearson_correlation
from rlhf_lit.models.heads import ScalarHead, score_pooled

__all__ = ["LengthControl"]


@dataclass
class LengthControl:
    """Length-controlled reward training (module docstring); all off by default.

    Args:
        balance: re-weight the pairs so that chosen-longer and chosen-shorter pairs weigh the same per batch.
        decorrelation_coef: weight of ``|rho(score, response length)|`` over the batch; 0 disables it.
        odin_length_coef: ODIN's length-loss weight; > 0 adds the length head.
        odin_orthogonality_coef: weight of ODIN's ``|w_Q . w_L|`` (used only with the length head).

    Raises:
        ValueError: a negative coefficient, or ``odin_orthogonality_coef`` without ``odin_length_coef``.
    """

    balance: bool = False
    decorrelation_coef: float = 0.0
    odin_length_coef: float = 0.0
    odin_orthogonality_coef: float = 0.0

    def __post_init__(self) -> None:
        for name in ("decorrelation_coef", "odin_length_coef", "odin_orthogonality_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"length_control.{name} must be >= 0, got {getattr(self, name)}")
        if self.odin_orthogonality_coef > 0 and not self.odin:
            raise ValueError(
                "length_control.odin_orthogonality_coef needs odin_length_coef > 0 (the length head)"
            )

    @property
    def odin(self) -> bool:
        """Whether the module has ODIN's length head."""
        return self.odin_length_coef > 0

    def terms(
        self,
        chosen: torch.Tensor,
        rejected: torch.Tensor,
        batch: dict,
        hidden: torch.Tensor | None = None,
        heads: tuple[ScalarHead, ScalarHead | None] | None = None,
        pooling: str = "last",
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """What the switches add to one micro-batch's loss.

        Args:
            chosen, rejected: ``(B,)`` the quality head's scores.
            batch: the preference batch (``chosen_response_len``, ``rejected_response_len`` ``(B,)``, any
                ``pair_weight``; the attention masks, for the length head).
            hidden: ``(2B, T, H)`` hidden states of chosen then rejected rows (ODIN only).
            heads: ``(quality_head, length_head)`` (ODIN only).
            pooling: the module's pooling (ODIN only).

        Returns:
            ``(r_chosen, r_rejected, pair_weights, penalty)``: the scores the pairwise loss compares (``r_Q +
            r_L`` with ODIN, else the scores given), the ``(B,)`` pair weights (the data's ``pair_weight``
            times the balance weights; None when neither applies) and a 0-dim penalty to add to the loss.
        """
        weights = batch.get("pair_weight")
        penalty = chosen.new_zeros(())
        if not (self.balance or self.decorrelation_coef > 0 or self.odin):
            return chosen, rejected, weights, penalty
        len_c, len_r = batch["chosen_response_len"], batch["rejected_response_len"]
        lengths = torch.cat([len_c, len_r]).float().to(chosen.device)
        if self.balance:
            balance = length_balance_weights(len_c, len_r).to(chosen.device)
            weights = balance if weights is None else weights * balance
        if self.decorrelation_coef > 0:
            rho = pearson_correlation(torch.cat([chosen, rejected]), lengths)
            penalty = penalty + self.decorrelation_coef * rho.abs()
        if not self.odin:
            return chosen, rejected, weights, penalty
        if hidden is None or heads is None or heads[1] is None:
            raise ValueError("ODIN's length head needs the hidden states and both heads")
        mask = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
        length_scores = score_pooled(heads[1], hidden, mask, pooling)
        quality = torch.cat([chosen, rejected])
        penalty = penalty + self.odin_length_coef * (
            pearson_correlation(quality, lengths).abs() - pearson_correlation(length_scores, lengths)
        )
        if self.odin_orthogonality_coef > 0:
            penalty = penalty + self.odin_orthogonality_coef * head_orthogonality(
                heads[0].linear.weight, heads[1].linear.weight
            )
        n = chosen.shape[0]
        return chosen + length_scores[:n], rejected + length_scores[n:], weights, penalty
