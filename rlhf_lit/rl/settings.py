"""PPO settings, grouped the way the field talks about them. Every PPO-Max trick is its own switch.

PPO-Max (Zheng et al. 2023, "Secrets of RLHF in Large Language Models Part I: PPO", section 5.3) is:
reward normalisation and clipping (``reward.normalize``, ``reward.clip``), a token-level KL penalty
(``kl.kl_coef``), a critic initialised from the reward model (``critic.init_from_reward``), value clipping
(``ppo.value_clip_range``), global gradient clipping (``ppo.max_grad_norm``), advantage whitening
(``ppo.whiten_advantages``) and an optional pretraining loss (``ptx.coef``). ``configs/ppo/ppo_max.yaml``
turns them all on; every one is recorded in the run's hparams.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlhf_lit.models.backbone import LoraSettings
from rlhf_lit.ranges import check_field_ranges, ranged
from rlhf_lit.rl.algorithms import AlgorithmSpec, get_algorithm
from rlhf_lit.rl.checks import (  # noqa: F401 -- re-exported: the checks of these settings
    check_advantage_estimator,
    check_batch_sizes,
    check_objective_options,
    check_overlong,
    check_stop_tokens,
    refuse_impossible_settings,
    refuse_sharded_settings,
)


@dataclass
class PPOConfig:
    """The PPO update (Schulman et al. 2017) and GAE (Schulman et al. 2016).

    Args:
        ppo_epochs: passes over each rollout batch.
        ppo_minibatch_size: responses per optimizer step; must divide the rollout's responses (prompts
            per batch of the prompt data module x ``sampling.num_samples_per_prompt``).
        micro_batch_size: sequences per forward/backward inside a minibatch (gradient accumulation);
            must divide ``ppo_minibatch_size``; default: the whole minibatch.
        gamma: discount factor.
        gae_lambda: GAE lambda.
        clip_range: epsilon of the clipped surrogate objective.
        dual_clip: c > 1 enables dual-clip PPO (Ye et al. 2020) for negative advantages; null disables.
        value_clip_range: clip of the value update around the rollout value; null disables.
        vf_coef: weight of the value loss.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        whiten_advantages: normalise advantages to mean 0, variance 1 over the rollout's response tokens
            (``gae``; ``reinforce_pp`` always does, ``grpo`` / ``rloo`` never: their baselines are the group's).
        max_grad_norm: clip the global gradient norm (actor and critic together); null disables.
        max_consecutive_skips: an optimizer step whose global gradient norm is inf or nan is skipped (no
            parameter, optimizer-state or schedule change; counted in ``ppo/skipped_steps``); this many
            skipped steps in a row stop the run with an error (the run has diverged).
        total_iterations: PPO iterations (rollout + update) to run; sets the learning-rate schedule and
            stops training. Default: one epoch over the prompts.
        rollout_forward_batch_size: sequences per no-grad forward when scoring a rollout (memory knob);
            default: the whole rollout batch.
        logprob_chunk_size: batch rows per piece of the log-softmax / entropy; default: pieces of a few
            positions, whose extra memory is under 5% of one (B, R, V) tensor (``gather_logprobs``).
        seed: seed of the minibatch shuffles (mixed with the iteration number). Every rank draws the same
            permutation of the GLOBAL rollout batch per epoch and takes its own rows of each global
            minibatch, so several ranks see the minibatches one rank would.
        advantage_estimator: a name registered in ``rlhf_lit.rl.algorithms`` (which also declares whether
            it needs a critic or groups, and its defaults below). Built in: ``gae`` (PPO with a critic;
            Schulman et al. 2016), or a critic-free one, which builds no critic adapter and no value head: ``grpo`` (group-normalised rewards of
            ``sampling.num_samples_per_prompt`` >= 2 responses per prompt; Shao et al. 2024), ``rloo``
            (leave-one-out baseline over the group; Ahmadian et al. 2024), ``reinforce_pp`` (REINFORCE++:
            KL-shaped token returns normalised over the global batch; Hu 2025).
        scale_by_std: ``grpo`` only: divide by the group's std (GRPO); false = Dr.GRPO (Liu et al. 2025).
        loss_aggregation: how the token losses of a global minibatch make its loss: ``token_mean`` (every
            update token weighs the same), ``seq_mean_token_mean`` (mean over responses of each response's
            token mean; GRPO, Shao et al. 2024 eq. 3), ``token_sum_norm`` (sum over tokens divided by
            responses x ``loss_norm_constant``; Dr.GRPO, Liu et al. 2025 eq. 3). Default per estimator:
            ``gae`` and ``reinforce_pp`` token_mean; ``grpo`` seq_mean_token_mean, or token_sum_norm with
            ``scale_by_std: false``; ``rloo`` token_sum_norm (its REINFORCE gradient sums over a response's
            tokens): the ``AlgorithmSpec``'s.
        loss_norm_constant: the constant of ``token_sum_norm`` (tokens per response); default
            ``sampling.max_new_tokens``.
        kl_placement: ``reward`` (``-kl_coef * KL_t`` in the token rewards; Ziegler et al. 2019) or ``loss``
            (``kl_coef`` times the ``kl.estimator`` estimate of KL(policy || reference) per token, k3 by
            default there, aggregated like the policy loss, added to it; GRPO, Shao et al. 2024 eq. 3-4).
            Default: the ``AlgorithmSpec``'s (``loss`` for ``grpo``, ``reward`` otherwise). ``kl.kl_coef``
            (and its controller) sets the weight either way.
        tis_cap: truncated importance sampling of the policy loss: each update token's clipped-surrogate term
            is multiplied by ``min(pi_trainer / pi_sampler, tis_cap)``, the trainer's probability of the token at
            rollout time over the sampler's (its recorded log-prob), which removes the off-policy bias of a
            sampler whose numbers differ from the trainer's (a 16-bit ``sampling.copy_dtype`` copy, or 16-bit
            sampling against a float32 trainer) at a variance the cap bounds (Yao et al. 2025, "Your Efficient RL
            Framework Secretly Brings You Off-Policy RL Training", their C; veRL's token-level
            ``rollout_is_threshold``). Tokens without a recorded sampler log-prob weigh 1. Logged as
            ``rollout/tis_weight`` and ``rollout/tis_capped_frac``. Null (the default): off.
        tis_level: with ``tis_cap``: ``token`` (default: each token's ratio, today's TIS) or ``sequence`` (the
            product of the response's token ratios, on all its tokens).
        tis_mode: with ``tis_cap``: ``truncate`` (default: ``min(ratio, tis_cap)``) or ``mask`` (weight 0 where
            the ratio exceeds ``tis_cap``: the token, or with ``tis_level: sequence`` the response, leaves the
            policy loss; veRL's ``rollout_is_mode: mask``).
        clip_range_low: the lower epsilon of the clip, ``clip(r, 1 - low, 1 + high)``; null: ``clip_range``.
            With ``policy_loss: cispo`` it bounds CISPO's importance weight from below. Its clip fraction:
            ``ppo/clipfrac_low``.
        clip_range_high: the upper epsilon (DAPO's clip-higher, Yu et al. 2025 s. 3.1: 0.2 low / 0.28 high);
            null: ``clip_range``. With ``policy_loss: cispo`` it bounds CISPO's weight from above. Its clip
            fraction: ``ppo/clipfrac_high``.
        importance_sampling_level: the ratio of the clipped surrogate: ``token`` (PPO, default), ``sequence``
            (GSPO, Zheng et al. 2025: the length-normalised sequence ratio ``exp(mean_t(logp - old))``, clipped
            per sequence; what TRL's ``importance_sampling_level="sequence"`` computes) or ``sequence_token``
            (GSPO-token: that ratio's value on each token with the token's own gradient). GSPO's clip ranges are
            tiny: 3e-4 / 4e-4 (``clip_range_low`` / ``clip_range_high``).
        policy_loss: ``ppo`` (the clipped surrogate, default) or ``cispo`` (MiniMax-M1 2025: ``-sg(clip(r, 1 -
            clip_range_low, 1 + clip_range_high)) * A * logp``: every token keeps a gradient; no ``dual_clip``).
        top_entropy_quantile: keep the policy loss on the top ``q`` highest-entropy update tokens of each
            micro-batch only (Wang et al. 2025, "Beyond the 80/20 Rule": 0.2); the others count 0 but stay in
            the aggregation's denominator, and the KL and entropy terms keep every token (TRL's option of the
            same name). 1.0 (default): off. Logged: ``ppo/high_entropy_frac``.
        mask_truncated_completions: responses that reached ``max_new_tokens`` without a stop token leave the
            loss (their advantages still count in their group's statistics; TRL's option of the same name);
            needs a stop token. Logged: ``rollout/truncated_masked_frac``.
        dynamic_sampling: DAPO's dynamic sampling filter (Yu et al. 2025 s. 3.2): groups whose scores are all
            equal (after ``reward.*`` shaping) carry no signal and leave the loss; counted in
            ``rollout/filtered_groups``. Without ``dynamic_sampling_max_rounds`` the batch is not refilled (the
            rollout keeps its configured size, the filtered responses weigh 0); an iteration whose every group is
            filtered skips its update. Needs ``sampling.num_samples_per_prompt >= 2``.
        dynamic_sampling_max_rounds: with ``dynamic_sampling``, DAPO's refill (Yu et al. 2025, Algorithm 1): while
            a rank holds fewer informative groups than the loader's batch size, sample up to this many extra rounds
            of that many training prompts each and replace the filtered groups with theirs; the rollout keeps its
            configured size (topped up with filtered groups, weight 0, when the cap is hit). Logged:
            ``rollout/dynamic_sampling_rounds``, ``rollout/unfilled_groups``. 0 (default): filter only.
            ``rl.dynamic_sampling``.
        checkpoint_every: write a resumable checkpoint, ``<trainer.default_root_dir>/last.ckpt`` (replaced
            each time, atomically), after every this many iterations, so a run killed at any point
            resumes with ``--ckpt_path last`` and loses at most this many iterations
            (``rlhf_lit.callbacks.IterationCheckpoint``, Lightning's ``ModelCheckpoint``). Null: none, unless
            the trainer's own checkpointing is configured. ``trainer.enable_checkpointing: false`` turns it off,
            and a ``ModelCheckpoint`` with ``save_last`` in ``trainer.callbacks`` is used instead of it.
    """

    ppo_epochs: int = ranged(4, "int >= 1")
    ppo_minibatch_size: int = ranged(4, "int >= 1")
    micro_batch_size: int | None = ranged(None, "int >= 1 or null")
    gamma: float = ranged(1.0, "(0, 1]")
    gae_lambda: float = ranged(0.95, "[0, 1]")
    clip_range: float = ranged(0.2, "> 0")
    dual_clip: float | None = ranged(None, "> 1 or null")
    value_clip_range: float | None = ranged(0.2, "> 0 or null")
    vf_coef: float = ranged(0.1, ">= 0")
    entropy_coef: float = ranged(0.0, ">= 0")
    whiten_advantages: bool = True
    max_grad_norm: float | None = ranged(1.0, "> 0 or null")
    max_consecutive_skips: int = ranged(5, "int >= 1")
    total_iterations: int | None = ranged(None, "int >= 1 or null")
    rollout_forward_batch_size: int | None = ranged(None, "int >= 1 or null")
    logprob_chunk_size: int | None = ranged(None, "int >= 1 or null")
    seed: int = 0
    advantage_estimator: str = "gae"
    scale_by_std: bool = True
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "token_sum_norm"] | None = None
    loss_norm_constant: float | None = ranged(None, "> 0 or null")
    kl_placement: Literal["reward", "loss"] | None = None
    checkpoint_every: int | None = ranged(None, "int >= 1 or null")
    tis_cap: float | None = ranged(None, ">= 1 or null")
    tis_level: Literal["token", "sequence"] | None = None
    tis_mode: Literal["truncate", "mask"] | None = None
    clip_range_low: float | None = ranged(None, "> 0 or null")
    clip_range_high: float | None = ranged(None, "> 0 or null")
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] = "token"
    policy_loss: Literal["ppo", "cispo"] = "ppo"
    top_entropy_quantile: float = ranged(1.0, "(0, 1]")
    mask_truncated_completions: bool = False
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = ranged(0, "int >= 0")

    def __post_init__(self) -> None:
        check_field_ranges(self, "ppo.")  # the ranges declared above (ConfigError)
        self.algorithm  # noqa: B018 -- an unknown advantage_estimator is a ConfigError here
        check_objective_options(self.policy_loss, self.dual_clip, self.tis_cap, self.tis_level, self.tis_mode)

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """``(low, high)`` epsilons of the clip: ``clip_range_low`` / ``clip_range_high``, else ``clip_range``."""
        low = self.clip_range if self.clip_range_low is None else self.clip_range_low
        high = self.clip_range if self.clip_range_high is None else self.clip_range_high
        return low, high

    @property
    def algorithm(self) -> AlgorithmSpec:
        """The registry entry of ``advantage_estimator`` (raises ConfigError for an unknown name)."""
        return get_algorithm(self.advantage_estimator)

    @property
    def needs_critic(self) -> bool:
        """The estimator reads a critic's values (its ``AlgorithmSpec``); the others build none."""
        return self.algorithm.needs_critic

    @property
    def needs_groups(self) -> bool:
        """The estimator compares the responses to one prompt (n >= 2 of them; its ``AlgorithmSpec``)."""
        return self.algorithm.needs_groups

    def aggregation(self) -> str:
        """``loss_aggregation``, or the estimator's default (its ``AlgorithmSpec``)."""
        return self.loss_aggregation or self.algorithm.default_aggregation(self)

    def kl_in_loss(self) -> bool:
        """``kl_placement``, or the estimator's default (its ``AlgorithmSpec``; GRPO: in the loss)."""
        return (self.kl_placement or self.algorithm.kl_placement) == "loss"


@dataclass
class KLConfig:
    """The per-token KL penalty to the reference policy, in the reward (Ziegler et al. 2019; Stiennon 2020).

    Args:
        kl_coef: beta in ``r_t = -beta * KL_t`` (the initial beta when adaptive).
        estimator: per-token KL estimator: ``k1`` (log-ratio), ``k2``, ``k3``, ``abs`` (Schulman 2020); the
            log-ratio is clamped to [-20, 20] nats first (``rlhf_lit.functional.kl``). The same estimator
            feeds the controller, the logged ``rollout/kl_ref`` and the penalty (in the rewards or, with
            ``ppo.kl_placement: loss``, in the loss). Default: k1 in the rewards, k3 in the loss.
        adaptive: adapt beta towards ``target_kl`` (Ziegler et al. 2019, section 2.2).
        target_kl: KL per response (nats, summed over its tokens) that the adaptive controller aims at;
            also reported as the run's KL budget.
        horizon: adaptive controller horizon, in episodes.
    """

    kl_coef: float = ranged(0.05, ">= 0")
    estimator: Literal["k1", "k2", "k3", "abs"] | None = None
    adaptive: bool = False
    target_kl: float | None = ranged(None, "> 0 or null")
    horizon: int = ranged(10000, "int >= 1")

    def __post_init__(self) -> None:
        check_field_ranges(self, "kl.")  # the ranges declared above (ConfigError)

    def resolved_estimator(self, kl_in_loss: bool) -> str:
        """``estimator``, or its default for the placement: ``k3`` in the loss, ``k1`` in the rewards."""
        return self.estimator or ("k3" if kl_in_loss else "k1")


@dataclass
class RewardShapingConfig:
    """What happens to a reward-model score before it enters the token rewards.

    Args:
        normalize: divide (and centre) scores by running statistics of all scores seen so far.
        clip: clip (normalised) scores to ``[-clip, clip]``; null disables.
        missing_eos_penalty: subtracted from the score of a response that reached ``max_new_tokens``
            without a stop token; null disables. Needs a stop token (``sampling.stop_at_eos`` or
            ``stop_token_ids`` / ``stop_strings``): PPO refuses it otherwise.
        skip_non_finite: a score that is inf or nan stops the run with an error naming the response and
            the reward model (default). When true, such responses are dropped from the update instead
            (no loss, no whitening statistics, no reward statistics) and counted in
            ``rollout/non_finite_scores``.
        overlong_buffer: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): a response longer than
            ``sampling.max_new_tokens - overlong_buffer`` tokens (its stop token included) loses
            ``overlong_penalty`` times the fraction of this window it used (the whole penalty at
            ``max_new_tokens``), added to the score before normalisation; at most ``max_new_tokens``. Null
            (default): off. Logged: ``rollout/overlong_frac``, ``rollout/overlong_penalty``.
        overlong_penalty: the punishment at ``max_new_tokens``; null (default): DAPO's 1.0. Only with
            ``overlong_buffer`` (refused without it: it would do nothing).
    """

    normalize: bool = False
    clip: float | None = ranged(None, "> 0 or null")
    missing_eos_penalty: float | None = ranged(None, "any or null")
    skip_non_finite: bool = False
    overlong_buffer: int | None = ranged(None, "int >= 1 or null")
    overlong_penalty: float | None = ranged(None, ">= 0 or null")

    def __post_init__(self) -> None:
        check_field_ranges(self, "reward.")  # the ranges declared above (ConfigError)
        check_overlong(self.overlong_buffer, self.overlong_penalty)  # a penalty needs its buffer


@dataclass
class CriticConfig:
    """The critic: a LoRA adapter on the shared base plus a value head (none with a critic-free
    ``ppo.advantage_estimator``: these settings are then unused, and ``init_from_reward`` is refused).

    Args:
        lora: the critic adapter's LoRA settings; ignored with ``shared_trunk``.
        shared_trunk: no critic adapter: the value head reads the actor's hidden states (one forward
            gives log-probs and values).
        init_from_reward: initialise the value head from the reward model's head, and the critic adapter
            from the reward adapter when the reward model is an adapter on this base (PPO-Max).
        lr: learning rate of the critic parameter group (default: the actor's).
    """

    lora: LoraSettings = field(default_factory=LoraSettings)
    shared_trunk: bool = False
    init_from_reward: bool = False
    lr: float | None = ranged(None, "> 0 or null")

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            self.lora = LoraSettings(**self.lora)
        check_field_ranges(self, "critic.")  # the ranges declared above (ConfigError)


@dataclass
class PTXConfig:
    """The pretraining-mix (PTX) term: ``coef * NLL`` on SFT data added to the PPO loss (Ouyang et al. 2022).

    Its backward reaches the actor adapter only; under ``strategy: ddp`` use
    ``ddp_find_unused_parameters_true`` (DDP otherwise waits for the critic's gradients). FSDP2 needs nothing.

    Args:
        coef: weight of the term; 0 disables it.
        train_files: SFT data files (any format ``SFTDataModule`` reads).
        format: their format (``auto`` detects).
        batch_size: sequences per PTX batch (one batch per optimizer step).
        max_length: token limit of a PTX sequence.
    """

    coef: float = ranged(0.0, ">= 0")
    train_files: list[str] = field(default_factory=list)
    format: str = "auto"
    batch_size: int = ranged(4, "int >= 1")
    max_length: int = ranged(256, "int >= 2")

    def __post_init__(self) -> None:
        check_field_ranges(self, "ptx.")  # the ranges declared above (ConfigError)


@dataclass
class MonitorConfig:
    """Reward-hacking monitors, on in every PPO run (``rlhf_lit.callbacks.RewardHackingMonitor``).

    Every iteration logs the correlation of the RM score with response length, the responses' perplexity
    under the reference and the score's trend; at the end of fit a score-vs-KL frontier plot (Gao et al.
    2022, "Scaling Laws for Reward Model Overoptimization") is written next to the export. A warning is
    logged (and ``monitor/overoptimization`` is 1) while the RM score rises by more than ``num_se`` standard
    errors over the last ``window`` iterations AND a held-out signal falls by more than ``num_se`` standard
    errors, or while the reference perplexity is above ``max_perplexity_ratio`` times its first value.

    Args:
        enabled: attach the monitor.
        heldout: metric names of held-out signals (higher is better) that PPO does not optimise, e.g.
            ``demo/gold_score``; a name not logged in a run is ignored.
        window: iterations over which trends are measured (>= 3).
        num_se: how many standard errors a slope must reach to count as rising or falling.
        max_perplexity_ratio: reference perplexity of the samples, relative to the first iteration's,
            above which the monitor flags degenerate text (while the score rises); null disables.
    """

    enabled: bool = True
    heldout: list[str] = field(default_factory=list)
    window: int = ranged(8, "int >= 3")
    num_se: float = ranged(2.0, "> 0")
    max_perplexity_ratio: float | None = ranged(2.0, "> 0 or null")

    def __post_init__(self) -> None:
        check_field_ranges(self, "monitor.")  # the ranges declared above (ConfigError)
