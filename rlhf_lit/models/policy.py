"""The PPO actor, critic and reference on one shared base.

``ActorCritic`` holds an ``AdaptedLM`` with an ``"actor"`` LoRA adapter and, unless the critic shares the
actor's trunk, a ``"critic"`` adapter, plus a float32 ``ScalarHead`` for values. The reference policy is the
same base with every adapter switched off (``reference()``), except the frozen SFT adapter of an adapter-only
SFT export, which stays on beneath every adapter (``rlhf_lit.models.adapters``).

Alignment (docs/layout.md): for a sequence ``x`` of length T = P + R whose response starts at P, the log-prob of
response token ``x[P + j]`` comes from the logits at position ``P + j - 1``, and the critic's value for that
action from the hidden state at the same position. So both read hidden positions ``P - 1 .. P + R - 2``.
Only those R positions go through the LM head (no (B, T, V) logits).

With ``packing`` the trunk runs each batch padding-free (``rlhf_lit.functional.packing``: rows end to end in bins
no longer than the longest row, position ids restarting per row, attention confined to each row) and its hidden
states are put back in the padded layout, zero at padding; at every real token the outputs equal the padded
forward's up to float summation order. Padding positions (after a response's end) read a zero hidden state
there instead of a padded forward's; every loss and statistic masks them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from rlhf_lit.functional.losses import entropy_from_logits
from rlhf_lit.functional.packing import PackedLayout, pack, pack_layout, unpack
from rlhf_lit.functional.sequence import gather_logprobs, response_positions
from rlhf_lit.models.adapters import AdaptedLM
from rlhf_lit.models.backbone import LoraSettings
from rlhf_lit.models.heads import ScalarHead
from rlhf_lit.models.trunk import hidden_size


@dataclass
class PolicyOutput:
    """Per-token outputs over the response positions, each ``(B, R)`` (``None`` when not asked for)."""

    logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


class ActorCritic(nn.Module):
    """Actor and critic LoRA adapters on one base, a value head, and the reference as the bare base.

    Args:
        model: the base causal LM (the SFT policy), possibly 4-bit.
        actor_lora: LoRA settings of the actor adapter (its dropout is set to 0, as the critic's: exact log-probs).
        critic_lora: LoRA settings of the critic adapter; ``None`` makes the critic share the actor's
            trunk (one forward gives logits and values; the value loss then also trains the actor adapter).
        with_critic: False for a critic-free estimator (GRPO, RLOO, REINFORCE++): no critic adapter and no
            value head are built (``critic_lora`` is ignored) and ``values`` are never returned.
        packing: run every forward (actor, critic, reference) padding-free (module docstring).
    """

    def __init__(
        self,
        model: nn.Module,
        actor_lora: LoraSettings,
        critic_lora: LoraSettings | None,
        with_critic: bool = True,
        packing: bool = False,
    ) -> None:
        super().__init__()
        self.packing = packing
        # no LoRA dropout in either adapter, whatever the settings say: log-probs and values must be exact
        adapters = {"actor": replace(actor_lora, dropout=0.0)}
        if critic_lora is not None and with_critic:
            adapters["critic"] = replace(critic_lora, dropout=0.0)
        self.lm = AdaptedLM(model, adapters)
        self.has_critic = with_critic
        self.shared_critic = with_critic and critic_lora is None
        self.value_head = ScalarHead(hidden_size(model), init_std=0.0) if with_critic else None

    def actor_parameters(self) -> list[nn.Parameter]:
        return self.lm.adapter_parameters("actor")

    def critic_parameters(self) -> list[nn.Parameter]:
        """The critic adapter's and the value head's parameters (none without a critic)."""
        if not self.has_critic:
            return []
        params = [] if self.shared_critic else self.lm.adapter_parameters("critic")
        return params + list(self.value_head.parameters())

    def start_critic_from(self, head: ScalarHead, adapter: str | None = None) -> None:
        """Start the critic as a reward model (PPO-Max): the value head gets ``head``'s weights and, when the
        reward model is adapter ``adapter`` on this base, the critic adapter gets its LoRA weights.

        Raises:
            ValueError: if the head's hidden size differs from the policy's (or the adapters' shapes do), or
                the policy has no critic.
        """
        if not self.has_critic:
            raise ValueError("critic.init_from_reward: this policy has no critic (a critic-free estimator)")
        if head.linear.in_features != self.value_head.linear.in_features:
            raise ValueError(
                "critic.init_from_reward: the reward model's hidden size differs from the policy's"
            )
        self.value_head.load_state_dict(head.state_dict())
        if adapter is not None and not self.shared_critic:
            self.lm.copy_adapter(adapter, "critic")

    def _layout(self, attention_mask: torch.Tensor) -> PackedLayout | None:
        return pack_layout(attention_mask) if self.packing else None

    def _response_hidden(
        self, input_ids, attention_mask, prompt_len: int, layout: PackedLayout | None
    ) -> torch.Tensor:
        if layout is None:
            hidden = self.lm.hidden_states(input_ids, attention_mask)
        else:
            hidden = unpack(self.lm.hidden_states(pack(input_ids, layout), None, layout.position_ids), layout)
        return response_positions(hidden, prompt_len)

    def _logprob_outputs(
        self, hidden, response_ids, temperature, want_entropy, chunk_size, entropy_grad=True
    ):
        logits = self.lm.logits(hidden)
        logprobs = gather_logprobs(logits, response_ids, temperature=temperature, chunk_size=chunk_size)
        entropy = None
        if want_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = entropy_from_logits(logits, temperature, chunk_size)
        return logprobs, entropy

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_len: int,
        temperature: float,
        want_logprobs: bool = True,
        want_values: bool = True,
        want_entropy: bool = False,
        chunk_size: int | None = None,
        entropy_grad: bool = True,
    ) -> PolicyOutput:
        """Actor log-probs, critic values and entropies over the response positions.

        Args:
            input_ids: ``(B, T)`` prompt (left padded, width P) followed by the response (right padded).
            attention_mask: ``(B, T)``, 1 = real token.
            prompt_len: P, the width of the prompt block.
            temperature: the sampling temperature (log-probs are of ``softmax(logits / T)``; pitfall: sampling temperature).
            want_logprobs / want_values / want_entropy: which outputs to compute.
            chunk_size: batch rows per chunk for log-softmax and entropy.
            entropy_grad: build the autograd graph of the entropy (only needed when it is in the loss; for
                logging alone it is computed without one, which saves a softmax-sized graph).

        Returns:
            ``PolicyOutput`` with ``(B, R)`` tensors, R = T - P.
        """
        response_ids = input_ids[:, prompt_len:]
        layout = self._layout(attention_mask)  # one layout for the actor's and the critic's forward
        out = PolicyOutput()
        want_values = want_values and self.has_critic
        if self.shared_critic or not want_values:
            with self.lm.adapter("actor"):
                hidden = self._response_hidden(input_ids, attention_mask, prompt_len, layout)
            if want_logprobs:
                out.logprobs, out.entropy = self._logprob_outputs(
                    hidden, response_ids, temperature, want_entropy, chunk_size, entropy_grad
                )
            if want_values:
                out.values = self.value_head(hidden)
            return out
        if want_logprobs:
            with self.lm.adapter("actor"):
                hidden = self._response_hidden(input_ids, attention_mask, prompt_len, layout)
            out.logprobs, out.entropy = self._logprob_outputs(
                hidden, response_ids, temperature, want_entropy, chunk_size, entropy_grad
            )
        with self.lm.adapter("critic"):
            out.values = self.value_head(self._response_hidden(input_ids, attention_mask, prompt_len, layout))
        return out

    @torch.no_grad()
    def reference_logprobs(
        self, input_ids, attention_mask, prompt_len: int, temperature: float, chunk_size: int | None = None
    ) -> torch.Tensor:
        """``(B, R)`` log-probs of the response under the reference (all adapters off), at ``temperature``."""
        with self.lm.reference():
            hidden = self._response_hidden(input_ids, attention_mask, prompt_len, self._layout(attention_mask))
            logits = self.lm.logits(hidden)
        return gather_logprobs(
            logits, input_ids[:, prompt_len:], temperature=temperature, chunk_size=chunk_size
        )
