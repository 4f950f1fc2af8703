"""Every metric rlhf_lit logs: name, meaning and unit, in one place.

Modules log only names defined here (a test checks it, and the glossary of docs/metrics.md is generated
from ``GLOSSARY``). Groups are TensorBoard sections: ``train/`` and ``val/`` hold losses, ``reward/`` the
reward model's validation results, ``rollout/`` what PPO's sampling produced, ``ppo/`` the update,
``critic/`` the value head (never ``val/``, which means validation), ``perf/`` speed and memory, and
``data/`` what the data modules kept and skipped.
"""

from __future__ import annotations

# Losses
TRAIN_LOSS = "train/loss"
TRAIN_ACCURACY = "train/accuracy"
TRAIN_SKIPPED_STEPS = "train/skipped_steps"
VAL_LOSS = "val/loss"
VAL_PERPLEXITY = "val/perplexity"
VAL_SCORE_MEAN = "val/score_mean"
VAL_KL_REF = "val/kl_ref"
VAL_RESPONSE_LEN = "val/response_len"

# Reward model (validation)
REWARD_ACCURACY = "reward/accuracy"
REWARD_MARGIN = "reward/margin"
REWARD_CHOSEN_MEAN = "reward/chosen_mean"
REWARD_REJECTED_MEAN = "reward/rejected_mean"
REWARD_ECE = "reward/ece"
REWARD_ECE_CALIBRATED = "reward/ece_calibrated"
REWARD_NLL = "reward/nll"
REWARD_NLL_CALIBRATED = "reward/nll_calibrated"
REWARD_TEMPERATURE = "reward/temperature"
REWARD_LENGTH_RULE_ACCURACY = "reward/length_rule_accuracy"
# Length bias (rlhf_lit.functional.length_bias)
REWARD_VS_LENGTH_RULE_SE = "reward/accuracy_vs_length_rule_se"
REWARD_LENGTH_MATCHED_ACCURACY = "reward/length_matched_accuracy"
REWARD_LENGTH_MATCHED_LENGTH_RULE = "reward/length_matched_length_rule_accuracy"
REWARD_LENGTH_MATCHED_FRACTION = "reward/length_matched_fraction"
REWARD_ACCURACY_BY_LENGTH_DIFF = "reward/accuracy_by_length_diff/{bucket}"
REWARD_LENGTH_RULE_BY_LENGTH_DIFF = "reward/length_rule_accuracy_by_length_diff/{bucket}"
REWARD_SCORE_LENGTH_SPEARMAN = "reward/score_length_spearman"

# PPO rollout (one value per iteration)
ROLLOUT_SCORE_MEAN = "rollout/score_mean"
ROLLOUT_SCORE_STD = "rollout/score_std"
ROLLOUT_KL_REF = "rollout/kl_ref"
ROLLOUT_KL_ESTIMATOR = "rollout/kl_ref_{estimator}"
ROLLOUT_SOURCE_SCORE = "rollout/score/{name}"
ROLLOUT_NON_SCORE_REWARD = "rollout/non_score_reward"
ROLLOUT_RESPONSE_LEN = "rollout/response_len"
ROLLOUT_NO_EOS_FRAC = "rollout/no_eos_frac"
ROLLOUT_NON_FINITE_SCORES = "rollout/non_finite_scores"
ROLLOUT_SAMPLER_LOGPROB_GAP = "rollout/sampler_logprob_gap"
ROLLOUT_SAMPLER_LOGPROB_GAP_MAX = "rollout/sampler_logprob_gap_max"
ROLLOUT_TIS_WEIGHT = "rollout/tis_weight"
ROLLOUT_TIS_CAPPED_FRAC = "rollout/tis_capped_frac"
ROLLOUT_OVERLONG_FRAC = "rollout/overlong_frac"
ROLLOUT_OVERLONG_PENALTY = "rollout/overlong_penalty"
ROLLOUT_TRUNCATED_MASKED_FRAC = "rollout/truncated_masked_frac"
ROLLOUT_FILTERED_GROUPS = "rollout/filtered_groups"
ROLLOUT_DYNAMIC_SAMPLING_ROUNDS = "rollout/dynamic_sampling_rounds"
ROLLOUT_UNFILLED_GROUPS = "rollout/unfilled_groups"

# PPO update (means over the iteration's minibatches)
PPO_POLICY_LOSS = "ppo/policy_loss"
PPO_VALUE_LOSS = "ppo/value_loss"
PPO_PTX_LOSS = "ppo/ptx_loss"
PPO_CLIPFRAC = "ppo/clipfrac"
PPO_VALUE_CLIPFRAC = "ppo/value_clipfrac"
PPO_DUAL_CLIPFRAC = "ppo/dual_clipfrac"
PPO_CLIPFRAC_LOW = "ppo/clipfrac_low"
PPO_CLIPFRAC_HIGH = "ppo/clipfrac_high"
PPO_HIGH_ENTROPY_FRAC = "ppo/high_entropy_frac"
PPO_APPROX_KL = "ppo/approx_kl"
PPO_ENTROPY = "ppo/entropy"
PPO_KL_LOSS = "ppo/kl_loss"
PPO_RATIO_MEAN = "ppo/ratio_mean"
PPO_KL_COEF = "ppo/kl_coef"
PPO_GRAD_NORM = "ppo/grad_norm"
PPO_SKIPPED_STEPS = "ppo/skipped_steps"
PPO_ADVANTAGE_MEAN = "ppo/advantage_mean"
PPO_RETURN_MEAN = "ppo/return_mean"
PPO_ITERATION = "ppo/iteration"
CRITIC_EXPLAINED_VARIANCE = "critic/explained_variance"
CRITIC_VALUE_MEAN = "critic/value_mean"

# Reward-hacking monitors (PPO; RewardHackingMonitor)
MONITOR_SCORE_LENGTH_CORR = "monitor/score_length_corr"
MONITOR_REF_PERPLEXITY = "monitor/ref_perplexity"
MONITOR_SCORE_TREND = "monitor/score_trend_se"
MONITOR_OVEROPTIMIZATION = "monitor/overoptimization"
# A held-out reward model that PPO never optimises (experiments/heldout_rm)
HELDOUT_RM_SCORE = "heldout/rm_score"

# Speed and memory
PERF_GENERATION_S = "perf/generation_s"
PERF_EXPERIENCE_S = "perf/experience_s"
PERF_UPDATE_S = "perf/update_s"
PERF_SYNC_S = "perf/sync_s"
PERF_ITERATION_S = "perf/iteration_s"
PERF_GENERATION_TOKENS_PER_S = "perf/generation_tokens_per_s"
PERF_PEAK_MEMORY_MB = "perf/peak_memory_mb"

# The demo's evaluation-only gold scorer
DEMO_GOLD_SCORE = "demo/gold_score"

# Direct preference optimisation (DPO and variants, KTO): one name per split, "{split}" = train | val,
# as train/loss and val/loss; the names after the split are TRL's (rewards/chosen, ...).
PREF_REWARDS_CHOSEN = "{split}/rewards/chosen"
PREF_REWARDS_REJECTED = "{split}/rewards/rejected"
PREF_REWARDS_MARGINS = "{split}/rewards/margins"
PREF_REWARDS_ACCURACIES = "{split}/rewards/accuracies"
PREF_LOGPS_CHOSEN = "{split}/logps/chosen"
PREF_LOGPS_REJECTED = "{split}/logps/rejected"
PREF_NLL_LOSS = "{split}/nll_loss"
PREF_KTO_KL = "{split}/kl"
PREF_SPLITS = ("train", "val")

# Data
DATA_KEPT = "data/{split}/kept"
DATA_SKIPPED = "data/{split}/skipped_{reason}"

GLOSSARY: dict[str, str] = {
    TRAIN_LOSS: "training loss of the stage (SFT: NLL per response token, nats; reward: Bradley-Terry loss per pair)",
    TRAIN_SKIPPED_STEPS: "SFT, reward, DPO: optimizer steps skipped so far because a gradient held inf or nan "
    "(logged when one is; the weights did not change)",
    TRAIN_ACCURACY: "reward model: fraction of training pairs with r_chosen > r_rejected (ties count as wrong)",
    VAL_LOSS: "validation loss, same definition as train/loss",
    VAL_PERPLEXITY: "SFT: exp(val/loss), per response token",
    VAL_SCORE_MEAN: "PPO validation: mean reward-model score of responses sampled for the validation prompts",
    VAL_KL_REF: "PPO validation: KL(policy || reference) per response (k1, summed over its tokens, nats)",
    VAL_RESPONSE_LEN: "PPO validation: mean number of real response tokens",
    REWARD_ACCURACY: "fraction of validation pairs with r_chosen > r_rejected (ties count as wrong); "
    "`reward/accuracy/<file>` per input file",
    REWARD_MARGIN: "mean of r_chosen - r_rejected over validation pairs (reward units)",
    REWARD_CHOSEN_MEAN: "mean reward of chosen responses (validation)",
    REWARD_REJECTED_MEAN: "mean reward of rejected responses (validation)",
    REWARD_ECE: "expected calibration error of sigmoid(r_chosen - r_rejected), 10 bins, both orderings of every pair",
    REWARD_ECE_CALIBRATED: "the same ECE after dividing rewards by the fitted temperature",
    REWARD_NLL: "mean -log sigmoid(r_chosen - r_rejected) over validation pairs (nats), what the temperature fit minimises",
    REWARD_NLL_CALIBRATED: "the same NLL with rewards divided by the fitted temperature (never above reward/nll)",
    REWARD_TEMPERATURE: "calibration temperature T fitted on the validation pairs (scores are divided by T)",
    REWARD_LENGTH_RULE_ACCURACY: "accuracy of the baseline rule 'the longer response wins' on the same pairs "
    "(equal lengths count 0.5); `reward/length_rule_accuracy/<file>` per input file",
    REWARD_VS_LENGTH_RULE_SE: "reward/accuracy minus reward/length_rule_accuracy, in paired standard errors "
    "(pair by pair on the same pairs; above 3: the reward model beats the length rule)",
    REWARD_LENGTH_MATCHED_ACCURACY: "accuracy on the length-matched validation pairs: response lengths (tokens, "
    "EOS included) differ by at most 10% of the longer one",
    REWARD_LENGTH_MATCHED_LENGTH_RULE: "the length rule's accuracy on those same length-matched pairs",
    REWARD_LENGTH_MATCHED_FRACTION: "fraction of validation pairs that are length-matched",
    REWARD_ACCURACY_BY_LENGTH_DIFF: "accuracy on the pairs whose relative length difference |L_c - L_r| / "
    "max(L_c, L_r) is in a bucket: 0-10pct (the length-matched pairs), 10-25pct, 25-50pct, 50-100pct",
    REWARD_LENGTH_RULE_BY_LENGTH_DIFF: "the length rule's accuracy on the pairs of the same bucket",
    REWARD_SCORE_LENGTH_SPEARMAN: "Spearman rank correlation of the reward score with the response length over "
    "all validation responses, chosen and rejected (near 1: the score mostly measures length)",
    ROLLOUT_SCORE_MEAN: "mean reward-model score of the sampled responses (calibrated, before normalisation)",
    ROLLOUT_SCORE_STD: "standard deviation of those scores",
    ROLLOUT_KL_REF: "KL(policy || reference) per response, summed over its tokens, with the configured estimator (nats)",
    ROLLOUT_KL_ESTIMATOR: "the same KL with a named estimator (k1, k3)",
    ROLLOUT_SOURCE_SCORE: "mean unweighted score of one source of a reward_model list (its name)",
    ROLLOUT_NON_SCORE_REWARD: "mean over responses of the summed KL penalty -kl_coef * KL_t",
    ROLLOUT_RESPONSE_LEN: "mean number of real response tokens (up to and including the stop token)",
    ROLLOUT_NO_EOS_FRAC: "fraction of responses that reached max_new_tokens without a stop token",
    ROLLOUT_NON_FINITE_SCORES: "responses of the iteration (all ranks) whose reward-model score was inf or nan, "
    "dropped from the update (reward.skip_non_finite; without it such a score stops the run)",
    ROLLOUT_SAMPLER_LOGPROB_GAP: "rollout-policy guard: mean |sampler log-prob - trainer log-prob| over the "
    "sampled tokens of the iteration (all ranks), before the first update; the sampler's log-prob is that of "
    "the scores it drew each token from, the trainer's the rollout's old log-prob (nats per token; ~0 when the "
    "sampler runs the policy's weights in float32, ~1e-3 from a bf16 `sampling.copy_dtype` copy on the tiny "
    "config and ~0.03 on SmolLM2-135M, as under bf16-mixed; above sampling.logprob_gap_tolerance: a warning, or an error with "
    "sampling.strict_sync)",
    ROLLOUT_SAMPLER_LOGPROB_GAP_MAX: "the largest of those per-token differences (nats per token)",
    ROLLOUT_TIS_WEIGHT: "with ppo.tis_cap: mean truncated importance-sampling weight min(pi_trainer / pi_sampler, "
    "tis_cap) over the update tokens (all ranks); 1 when the sampler is the trainer's policy",
    ROLLOUT_TIS_CAPPED_FRAC: "with ppo.tis_cap: fraction of the update tokens (ppo.tis_level: sequence: of the "
    "responses) whose importance ratio exceeded tis_cap: capped (ppo.tis_mode: truncate) or weighted 0 (mask)",
    ROLLOUT_OVERLONG_FRAC: "with reward.overlong_buffer: fraction of responses inside the overlong window (longer "
    "than max_new_tokens - overlong_buffer tokens), which paid part of the overlong penalty",
    ROLLOUT_OVERLONG_PENALTY: "with reward.overlong_buffer: mean overlong penalty added to the scores (<= 0, "
    "score units; -overlong_penalty at max_new_tokens)",
    ROLLOUT_TRUNCATED_MASKED_FRAC: "with ppo.mask_truncated_completions: fraction of responses left out of the "
    "loss for reaching max_new_tokens without a stop token",
    ROLLOUT_FILTERED_GROUPS: "with ppo.dynamic_sampling: groups (prompts) of the loader's batch, all ranks, whose "
    "scores were all equal (DAPO's dynamic-sampling filter): they leave the loss, or with "
    "ppo.dynamic_sampling_max_rounds are replaced by groups of extra rounds (see rollout/unfilled_groups)",
    ROLLOUT_DYNAMIC_SAMPLING_ROUNDS: "with ppo.dynamic_sampling_max_rounds: extra rounds of prompts sampled this "
    "iteration to replace filtered groups (0 to max_rounds; each round a batch of the loader's size per rank)",
    ROLLOUT_UNFILLED_GROUPS: "with ppo.dynamic_sampling_max_rounds: groups of the update batch, all ranks, whose "
    "scores are all equal after the last round (the cap was hit): they stay in the batch with weight 0",
    PPO_POLICY_LOSS: "clipped surrogate loss (ppo.policy_loss: cispo: CISPO's), aggregated as ppo.loss_aggregation "
    "(default: token-level mean)",
    PPO_VALUE_LOSS: "clipped value loss 0.5 * max((V-R)^2, (V_clip-R)^2), aggregated as ppo.loss_aggregation",
    PPO_PTX_LOSS: "pretraining (PTX) NLL term, nats per token",
    PPO_CLIPFRAC: "fraction of update tokens where the clip binds (ratio > 1+clip_range with a positive advantage, "
    "or < 1-clip_range with a negative one: the token's gradient is 0); ppo/clipfrac_low + ppo/clipfrac_high",
    PPO_DUAL_CLIPFRAC: "fraction of update tokens where the dual clip binds (negative advantage, loss capped at "
    "-dual_clip * A; logged when ppo.dual_clip is set)",
    PPO_CLIPFRAC_LOW: "fraction of update tokens where the clip binds below: ratio < 1 - clip_range_low with a "
    "negative advantage (ppo.policy_loss: cispo: ratio < 1 - clip_range_low, the weight clipped)",
    PPO_CLIPFRAC_HIGH: "fraction of update tokens where the clip binds above: ratio > 1 + clip_range_high with a "
    "positive advantage (cispo: ratio > 1 + clip_range_high)",
    PPO_HIGH_ENTROPY_FRAC: "with ppo.top_entropy_quantile < 1: fraction of update tokens whose policy term "
    "counts (entropy at or above the micro-batch's 1 - q quantile; about q)",
    PPO_VALUE_CLIPFRAC: "fraction of tokens whose new value left old value +- value_clip_range",
    PPO_APPROX_KL: "mean (ratio - 1) - log(ratio) between the updated and the rollout policy (nats per token)",
    PPO_ENTROPY: "mean policy entropy per response token (nats)",
    PPO_KL_LOSS: "KL(policy || reference) term of the loss (kl.estimator; nats per token; ppo.kl_placement: loss)",
    PPO_RATIO_MEAN: "mean probability ratio pi_new / pi_old over response tokens",
    PPO_KL_COEF: "the KL penalty coefficient in force for this iteration",
    PPO_GRAD_NORM: "global gradient norm before clipping (mean over the optimizer steps applied)",
    PPO_SKIPPED_STEPS: "optimizer steps of the iteration skipped because the global gradient norm was inf or nan "
    "(ppo.max_consecutive_skips in a row stop the run)",
    PPO_ADVANTAGE_MEAN: "mean advantage before whitening",
    PPO_RETURN_MEAN: "mean return (advantages + values)",
    PPO_ITERATION: "PPO iterations completed (one rollout + its updates)",
    CRITIC_EXPLAINED_VARIANCE: "1 - Var(returns - values) / Var(returns) over response tokens",
    CRITIC_VALUE_MEAN: "mean critic value over response tokens",
    MONITOR_SCORE_LENGTH_CORR: "Pearson correlation of the RM score with the response length over an iteration's "
    "responses (near 1: the reward model pays for length)",
    MONITOR_REF_PERPLEXITY: "perplexity of the sampled responses under the reference policy, exp(-mean reference "
    "log-prob per response token) at the sampling temperature (rising fast: text the reference finds unlikely)",
    MONITOR_SCORE_TREND: "slope of rollout/score_mean over the monitor's window of iterations, in standard errors",
    MONITOR_OVEROPTIMIZATION: "1 when the monitor flags over-optimisation: the RM score rises (> num_se standard "
    "errors over the window) while a held-out signal falls, or reference perplexity exceeds its limit; else 0",
    HELDOUT_RM_SCORE: "mean calibrated score a held-out reward model (trained on other pairs, never optimised) "
    "gives an iteration's rollout responses; a held-out signal for the monitor (`experiments/heldout_rm`)",
    PERF_GENERATION_S: "seconds spent sampling responses, per iteration",
    PERF_EXPERIENCE_S: "seconds for the old-logprob, reference, value and reward passes plus GAE, per iteration",
    PERF_UPDATE_S: "seconds for the PPO epochs and the sampler's refresh (Sampler.sync), per iteration",
    PERF_SYNC_S: "seconds of the sampler's refresh alone (part of perf/update_s), per iteration: vLLM's weight push "
    "and the engine's load, the bf16 sampling copy's refresh; ~0 for hf and static",
    PERF_ITERATION_S: "seconds per PPO iteration",
    PERF_GENERATION_TOKENS_PER_S: "sampled tokens per second",
    PERF_PEAK_MEMORY_MB: "peak accelerator memory (CUDA) or peak resident memory (CPU), MiB",
    DEMO_GOLD_SCORE: "demo only: mean gold score of an iteration's samples (hidden scorer, evaluation only)",
    PREF_REWARDS_CHOSEN: "DPO/KTO: mean implicit reward of the chosen (KTO: desirable) responses, beta * (logp - "
    "ref_logp) summed over the response (ipo: per token; simpo: beta * mean logp per token, no reference); "
    "{split} = train or val",
    PREF_REWARDS_REJECTED: "DPO/KTO: the same for the rejected (KTO: undesirable) responses",
    PREF_REWARDS_MARGINS: "DPO: mean of rewards/chosen - rewards/rejected over pairs",
    PREF_REWARDS_ACCURACIES: "DPO: fraction of pairs with reward_chosen > reward_rejected, a tie counting 1/2",
    PREF_LOGPS_CHOSEN: "DPO/KTO: mean policy log-prob of a chosen (desirable) response, summed over its tokens (nats)",
    PREF_LOGPS_REJECTED: "DPO/KTO: the same for the rejected (undesirable) responses",
    PREF_NLL_LOSS: "DPO: NLL of the chosen responses per token (nats), the nll_coef term (logged also at 0)",
    PREF_KTO_KL: "KTO: the baseline z0, max(0, batch mean of logp - ref_logp), nats per response",
    DATA_KEPT: "rows kept by a data module for a split",
    DATA_SKIPPED: "rows skipped for a reason (empty_chosen, identical_pair, response_too_long, ...)",
}


def is_known(name: str) -> bool:
    """True if ``name`` is one of the names above, or a per-file / per-reason / per-estimator / per-split
    variant."""
    if name in GLOSSARY:
        return True
    prefixes = (
        "reward/accuracy/",
        "reward/length_rule_accuracy/",
        "reward/accuracy_by_length_diff/",
        "reward/length_rule_accuracy_by_length_diff/",
        "data/",
        "rollout/kl_ref_",
        "rollout/score/",
    )
    if name.startswith(prefixes):
        return True
    split, _, rest = name.partition("/")
    return split in PREF_SPLITS and "{split}/" + rest in GLOSSARY


def glossary_markdown() -> str:
    """The metric glossary of docs/metrics.md (tests/test_readme.py checks that the page holds exactly this table)."""
    rows = ["| metric | meaning |", "|---|---|"]
    # a "|" inside a cell ends it in Markdown tables: escaped ("|a - b|", "KL(p || q)")
    rows += [f"| `{name}` | {text.replace('|', chr(92) + '|')} |" for name, text in GLOSSARY.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(glossary_markdown())
