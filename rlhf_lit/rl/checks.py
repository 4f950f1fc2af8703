"""Checks of the PPO settings that read several of them together, refused before any model loads.

Each raises ``ConfigError`` (a ``ValueError``) with one line naming the keys, so the command prints that line and
exits 2 wherever the check runs: in the CLI's checks, or while the module is built (``check_stop_tokens`` runs in
both: before anything loads on what the config alone decides, then on the tokenizer's stop ids);
``rlhf_lit.rl.settings`` re-exports them.
"""

from __future__ import annotations

from rlhf_lit.errors import ConfigError

__all__ = [
    "check_advantage_estimator",
    "check_batch_sizes",
    "check_dynamic_sampling",
    "check_objective_options",
    "check_overlong",
    "check_stop_tokens",
    "refuse_impossible_settings",
    "refuse_sharded_settings",
]


def refuse_impossible_settings(backbone, sampling) -> None:
    """Settings under which PPO's ratio or KL would be wrong, refused before any model loads.

    Raises:
        ConfigError: for ``backbone.disable_dropout: false`` (pitfall: dropout), ``do_sample: false``, or
            ``top_k`` / ``top_p`` sampling (pitfall: sampling temperature), or a ``sampling.copy_dtype``
            copy or a ``sampling.backend: vllm`` engine of a 4-bit base.
    """
    if sampling.copy_dtype is not None and backbone.load_in_4bit:
        raise ConfigError(
            "sampling.copy_dtype cannot copy a 4-bit base (its weights are quantized). Remove "
            "sampling.copy_dtype, or load the base unquantized (backbone.load_in_4bit: false)"
        )
    if sampling.backend == "vllm" and backbone.load_in_4bit:
        raise ConfigError(
            "sampling.backend: vllm cannot push a 4-bit base's merged weights to the engine (they are quantized). "
            "Use sampling.backend: hf, or load the base unquantized (backbone.load_in_4bit: false)"
        )
    if not backbone.disable_dropout:
        raise ConfigError(
            "PPO needs backbone.disable_dropout: true: with dropout on, the rollout, reference and training "
            "forwards of the same tokens differ, so the first PPO ratio is not 1 and the KL at step 0 is "
            "not 0. Dropout is set to 0 in the configs, training mode is kept"
        )
    if not sampling.do_sample:
        raise ConfigError(
            "PPO refuses sampling.do_sample: false: greedy responses are not samples of the policy whose "
            "log-probs the PPO ratio and the KL use (an off-policy mismatch). Use do_sample: true"
        )
    if sampling.top_k or sampling.top_p < 1.0:
        raise ConfigError(
            f"PPO refuses sampling.top_k={sampling.top_k} / top_p={sampling.top_p}: responses would "
            "come from the truncated distribution while the PPO ratio and the KL use the full softmax at "
            "the sampling temperature (an off-policy mismatch). Use top_k: 0 and top_p: 1.0"
        )


def refuse_sharded_settings(sampling) -> None:
    """Settings that need the whole weights in each process, refused when FSDP shards them
    (``PPOModule.configure_model``). ``sampling.backend: vllm`` is not one of them: its weight push gathers one
    FSDP unit at a time (``rl.vllm_sampler.VLLMSampler``).

    Raises:
        ConfigError: for ``sampling.copy_dtype`` (its copy is built from the whole weights).
    """
    if sampling.copy_dtype is not None:
        raise ConfigError(
            "sampling.copy_dtype needs the whole weights in each process; under FSDP they are sharded. "
            "Remove sampling.copy_dtype or use the ddp strategy"
        )


def check_advantage_estimator(ppo, sampling, critic) -> None:
    """Estimator settings that cannot work, refused before any model loads.

    Raises:
        ConfigError: for ``grpo`` / ``rloo`` with ``sampling.num_samples_per_prompt < 2`` (a group of one has
            no baseline), ``critic.init_from_reward`` with a critic-free estimator (there is no critic), or what
            :func:`check_dynamic_sampling` refuses.
    """
    n = getattr(sampling, "num_samples_per_prompt", 1)
    check_dynamic_sampling(ppo.dynamic_sampling, ppo.dynamic_sampling_max_rounds, n)
    if ppo.needs_groups and n < 2:
        raise ConfigError(
            f"ppo.advantage_estimator={ppo.advantage_estimator} compares the responses to one prompt: set "
            f"sampling.num_samples_per_prompt >= 2 (it is {n})"
        )
    if not ppo.needs_critic and critic.init_from_reward:
        raise ConfigError(
            f"critic.init_from_reward is set, but ppo.advantage_estimator={ppo.advantage_estimator} builds no "
            "critic; drop critic.init_from_reward"
        )


def check_objective_options(
    policy_loss: str, dual_clip: float | None, tis_cap: float | None, tis_level, tis_mode, prefix: str = ""
) -> None:
    """The policy-gradient family's options that need (or exclude) another one: ``ppo.dual_clip`` with
    ``ppo.policy_loss: cispo``, ``ppo.tis_level`` / ``ppo.tis_mode`` without ``ppo.tis_cap``. ``PPOConfig`` and the
    CLI's checks (``prefix`` ``model.init_args.``) both call it.

    Raises:
        ConfigError: naming the keys.
    """
    p = prefix
    if policy_loss == "cispo" and dual_clip is not None:
        raise ConfigError(
            f"{p}ppo.dual_clip caps the clipped surrogate's loss; {p}ppo.policy_loss: cispo has no such term. "
            f"Drop {p}ppo.dual_clip"
        )
    if tis_cap is None and (tis_level is not None or tis_mode is not None):
        raise ConfigError(
            f"{p}ppo.tis_level / ppo.tis_mode shape the rollout importance weights, which {p}ppo.tis_cap turns "
            "on: set ppo.tis_cap (e.g. 2.0) or drop them"
        )


def check_dynamic_sampling(dynamic_sampling: bool, max_rounds: int, n: int, prefix: str = "") -> None:
    """DAPO's dynamic-sampling settings (``ppo.dynamic_sampling``, ``ppo.dynamic_sampling_max_rounds``) against the
    group size ``n`` (``sampling.num_samples_per_prompt``); the module and the CLI's checks (``prefix``
    ``model.init_args.``) both call it.

    Raises:
        ConfigError: ``dynamic_sampling`` with ``n < 2`` (no group to filter), or ``max_rounds > 0`` without
            ``dynamic_sampling`` (nothing is filtered, so nothing is refilled).
    """
    p = prefix
    if max_rounds and not dynamic_sampling:
        raise ConfigError(
            f"{p}ppo.dynamic_sampling_max_rounds={max_rounds} samples more prompts to replace the groups that "
            f"{p}ppo.dynamic_sampling filters, which is off: set {p}ppo.dynamic_sampling: true or drop "
            "dynamic_sampling_max_rounds"
        )
    if dynamic_sampling and n < 2:
        raise ConfigError(
            f"{p}ppo.dynamic_sampling filters groups of responses to one prompt: set "
            f"{p}sampling.num_samples_per_prompt >= 2 (it is {n})"
        )


def check_overlong(
    buffer: int | None, penalty: float | None, max_new_tokens: int | None = None, prefix: str = ""
) -> None:
    """DAPO's overlong punishment (``reward.overlong_buffer``, ``reward.overlong_penalty``): the penalty acts
    only inside the buffer's window, so a penalty without a buffer would be inert; and the window ends at
    ``sampling.max_new_tokens``, so the buffer is at most that (checked when ``max_new_tokens`` is given).

    Args:
        buffer, penalty: ``reward.overlong_buffer`` and ``reward.overlong_penalty`` (None: DAPO's 1.0).
        max_new_tokens: ``sampling.max_new_tokens``, or None where it is not known (``RewardShapingConfig``).
        prefix: the keys' section as the user writes it (``model.init_args.`` in the CLI's checks).

    Raises:
        ConfigError: for a penalty without a buffer, or a buffer above ``max_new_tokens``.
    """
    p = prefix
    if buffer is None and penalty is not None:
        raise ConfigError(
            f"{p}reward.overlong_penalty={penalty} is set but {p}reward.overlong_buffer is not: the penalty "
            "applies only to responses inside the buffer's window before sampling.max_new_tokens, so it would "
            "do nothing. Set reward.overlong_buffer (the window, in tokens) or drop reward.overlong_penalty"
        )
    if buffer is not None and max_new_tokens is not None and buffer > max_new_tokens:
        raise ConfigError(
            f"{p}reward.overlong_buffer={buffer} must be at most {p}sampling.max_new_tokens={max_new_tokens} "
            "(the penalty window ends at max_new_tokens)"
        )


def check_stop_tokens(
    missing_eos_penalty: float | None, mask_truncated: bool, has_stop_token: bool, prefix: str = ""
) -> None:
    """Raises ConfigError for a missing-EOS penalty (``reward.missing_eos_penalty``) or
    ``ppo.mask_truncated_completions`` without any stop token (every response would pay it, or leave the loss).

    ``has_stop_token``: the resolved stop ids are not empty (``generation.resolve_stop_ids``, when the module is
    built), or, before anything loads, a stop token can come (``generation.may_stop``: the CLI's checks
    refuse only what the config alone decides). ``prefix``: the keys' section as the user writes it
    (``model.init_args.`` in the CLI's checks).
    """
    if has_stop_token:
        return
    p = prefix
    unset = (
        f"but none is set ({p}sampling.stop_at_eos is off or the tokenizer has no EOS, and no "
        f"{p}sampling.stop_token_ids / stop_strings)"
    )
    if mask_truncated:
        raise ConfigError(
            f"{p}ppo.mask_truncated_completions needs a stop token, {unset}: every response would leave the "
            "loss. Set a stop token or drop the option"
        )
    if missing_eos_penalty is not None:
        raise ConfigError(
            f"{p}reward.missing_eos_penalty={missing_eos_penalty} needs a stop token, {unset}: every response "
            "would count as missing its EOS. Set a stop token or drop the penalty"
        )


def check_batch_sizes(ppo, rollout_batch_size: int, samples_per_prompt: int = 1) -> None:
    """Raises ConfigError unless ``ppo_minibatch_size`` divides the rollout's responses (prompts x
    ``samples_per_prompt``) and ``micro_batch_size`` the minibatch (docs/layout.md: rollout_batch_size >=
    ppo_minibatch_size >= micro_batch_size)."""
    mb = ppo.ppo_minibatch_size
    micro = ppo.micro_batch_size or mb
    if (rollout_batch_size * samples_per_prompt) % mb:
        per = f" x sampling.num_samples_per_prompt={samples_per_prompt}" if samples_per_prompt > 1 else ""
        raise ConfigError(
            f"rollout_batch_size={rollout_batch_size} (the prompt data module's batch_size){per} must be a "
            f"multiple of ppo.ppo_minibatch_size={mb}"
        )
    if mb % micro:
        raise ConfigError(f"ppo.ppo_minibatch_size={mb} must be a multiple of ppo.micro_batch_size={micro}")
