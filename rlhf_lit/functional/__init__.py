"""Pure tensor math for RLHF: torch in, torch out; no Lightning, no logging, no in-place edits.

Conventions (docs/layout.md): masks are True on real tokens; shapes B batch, P prompt, R response,
T = P + R, V vocabulary; log-probabilities and KL are natural logs (nats per token).
"""

from rlhf_lit.functional.advantages import explained_variance, gae
from rlhf_lit.functional.calibration import (
    binary_nll,
    expected_calibration_error,
    fit_temperature,
    pairwise_calibration_inputs,
    reliability_bins,
)
from rlhf_lit.functional.group_advantages import (
    discounted_returns,
    group_relative_advantages,
    leave_one_out_advantages,
    token_advantages,
)
from rlhf_lit.functional.kl import KL_ESTIMATORS, kl_per_token, shaped_rewards
from rlhf_lit.functional.losses import (
    bt_pairwise_loss,
    entropy_from_logits,
    ppo_policy_loss,
    ppo_value_loss,
    sft_nll,
)
from rlhf_lit.functional.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlhf_lit.functional.sequence import (
    gather_logprobs,
    last_real_index,
    position_ids_from_mask,
    response_positions,
    stop_mask,
    trim_left_padding,
    truncate_after_stop,
)

__all__ = [
    "token_advantages",
    "leave_one_out_advantages",
    "group_relative_advantages",
    "discounted_returns",
    "KL_ESTIMATORS",
    "binary_nll",
    "bt_pairwise_loss",
    "entropy_from_logits",
    "expected_calibration_error",
    "explained_variance",
    "fit_temperature",
    "gae",
    "gather_logprobs",
    "kl_per_token",
    "last_real_index",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pairwise_calibration_inputs",
    "position_ids_from_mask",
    "ppo_policy_loss",
    "ppo_value_loss",
    "reliability_bins",
    "response_positions",
    "sft_nll",
    "shaped_rewards",
    "stop_mask",
    "trim_left_padding",
    "truncate_after_stop",
]
