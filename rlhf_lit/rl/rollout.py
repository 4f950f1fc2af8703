"""One PPO iteration's experience (:class:`Rollout`) and how it is collected: steps 1-4 of the iteration.

:class:`RolloutCollector` is built with the policy, the reward function, the sampler, the score shaping and
its settings; ``collect(batch)`` runs, for one batch of prompts (``rlhf_lit.modules.ppo`` numbers the steps):

1. sampling: the sampler (``rlhf_lit.rl.sampler``) draws ``num_samples_per_prompt`` responses per prompt
   with the actor adapter (merged into the base for speed when ``merge_adapter`` allows);
2. reference log-probs, every adapter off;
3. old log-probs (actor) and values (critic), at the sampling temperature with dropout off, and the
   per-token KL to the reference (``kl.estimator``);
4. the reward function's scores (``RewardSource.score``: the calibrated reward model; or
   ``rlhf_lit.rewards.MixedReward.score``: a weighted sum of reward models and Python reward functions, the
   same :class:`RewardFunction` call), the non-finite guard, the missing-EOS penalty, normalisation and
   clipping.

Step 5 (token rewards, advantages, returns) belongs to an advantage estimator (``rlhf_lit.rl.estimators``):
it reads a :class:`Rollout` and nothing else, so estimators that need no critic (``old_values is None``)
plug in without touching this file.

Notation: B prompts of this rank, P prompt width (left padded), R response width (right padded),
T = P + R. Log-probabilities and KL in nats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlhf_lit.errors import NonFiniteError
from rlhf_lit.functional.kl import kl_per_token
from rlhf_lit.functional.sequence import repeat_prompts, trim_left_padding
from rlhf_lit.parallel.collectives import global_sum, is_distributed, rank_and_world
from rlhf_lit.rl.filters import FilterSettings, RolloutFilters, apply_filters
from rlhf_lit.rl.generation import GAP_TOLERANCE, compute_dtype
from rlhf_lit.rl.guard import check_sampler
from rlhf_lit.rl.reward_norm import ScoreShaper
from rlhf_lit.rl.sampler import Sampler
from rlhf_lit.rng import rank_seed

log = logging.getLogger("rlhf_lit")

__all__ = ["RewardFunction", "Rollout", "RolloutCollector", "RolloutSettings", "ScoreShaper"]


class RewardFunction(Protocol):
    """What step 4 calls (``score``): ``(B,)`` float scores of ``(B, P)`` left-padded prompts and ``(B, R)`` responses
    (``RewardSource.score`` and ``rlhf_lit.rewards.MixedReward.score`` are two). ``has_stop`` is ``(B,)`` bool;
    ``prompts`` the data's prompts (strings or message lists) or None; ``fields`` the prompt rows' fields
    (``batch["fields"]``) or None. A score may be inf or nan; the collector's guard handles it."""

    def score(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        has_stop: torch.Tensor | None = None,
        prompts: list[Any] | None = None,
        fields: list[dict] | None = None,
    ) -> torch.Tensor: ...


@dataclass
class Rollout:
    """The experience of one iteration on one rank (tensors on the module's device).

    Attributes:
        prompt_ids: ``(B, P)`` long, left padded (columns that are padding in every row dropped).
        response_ids: ``(B, R)`` long, right padded with the pad id after the first stop token.
        response_mask: ``(B, R)`` bool, True up to and including the first stop token.
        has_stop: ``(B,)`` bool, the response ended with a stop token.
        input_ids: ``(B, T)`` prompt then response.
        attention_mask: ``(B, T)`` long, 1 = real token.
        ref_logprobs: ``(B, R)`` log-probs of the response tokens under the reference (adapters off).
        old_logprobs: ``(B, R)`` the same under the actor that sampled them.
        old_values: ``(B, R)`` critic values at the same positions; None when the run has no critic.
        kl: ``(B, R)`` per-token KL to the reference (``kl.estimator``), 0 on padding.
        raw_scores: ``(B,)`` the reward function's scores as returned (inf / nan possible where
            ``finite`` is False).
        scores: ``(B,)`` what the rewards use: 0 where not finite, minus the missing-EOS penalty, normalised
            and clipped (``reward.*``).
        finite: ``(B,)`` bool, ``raw_scores`` is finite.
        num_non_finite: non-finite scores in the GLOBAL batch (every rank).
        prompt_text: the prompts as text when the data module gives them, else None.
        generation_s: wall seconds of step 1.
        reward_components: ``{name: (B,)}`` each source's unweighted scores when ``reward_model`` is a list
            (``rlhf_lit.rewards.MixedReward``), else empty.
        sampler_stats: the rollout-policy guard's figures (``rlhf_lit.rl.guard``), global over ranks.
        is_weights: ``(B, R)`` truncated importance-sampling weights of the policy loss
            (``functional.policy_gradient.rollout_is_weights``) with ``ppo.tis_cap``, else None; ``is_cap`` the cap.
        filters: what the policy-gradient family's options decided (``rlhf_lit.rl.filters.RolloutFilters``).
        sampled_tokens: response positions sampled for this rollout, rounds whose rows were left out included
            (``rl.dynamic_sampling``); None: ``response_ids.numel()``.
    """

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    has_stop: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    ref_logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    old_values: torch.Tensor | None
    kl: torch.Tensor
    raw_scores: torch.Tensor
    scores: torch.Tensor
    finite: torch.Tensor
    num_non_finite: int
    prompt_text: list[str] | None
    generation_s: float
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)
    sampler_stats: dict[str, float] = field(default_factory=dict)
    is_weights: torch.Tensor | None = None
    is_cap: float | None = None
    filters: RolloutFilters = field(default_factory=RolloutFilters)
    sampled_tokens: int | None = None

    @property
    def prompt_len(self) -> int:
        """P, the width of the prompt block of ``input_ids``."""
        return self.prompt_ids.shape[1]

    @property
    def update_mask(self) -> torch.Tensor:
        """``(B, R)`` bool: the tokens that enter the update, every real response token less those of
        responses whose score was not finite or that ``filters`` left out (truncated, filtered groups)."""
        return self.response_mask & self.filters.kept(self.finite).unsqueeze(-1)

    def as_text(self, tokenizer, prompt_ids: torch.Tensor) -> dict[str, list]:
        """``{"prompt_text", "response_text", "score"}`` lists (B each): the prompts as the data gave them
        (else ``prompt_ids`` decoded), the responses decoded without special tokens, the raw scores."""
        prompts = self.prompt_text or tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
        return {
            "prompt_text": list(prompts),
            "response_text": [
                tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                for ids, mask in zip(self.response_ids, self.response_mask)
            ],
            "score": [float(x) for x in self.raw_scores],
        }


@dataclass
class RolloutSettings:
    """How experience is collected.

    Attributes:
        temperature: the sampling temperature; log-probs are computed at it.
        num_samples_per_prompt: n responses per prompt (each prompt repeated n times).
        forward_batch_size: rows per no-grad forward of steps 2-3 (``ppo.rollout_forward_batch_size``);
            None = the whole rollout.
        logprob_chunk_size: ``ppo.logprob_chunk_size``.
        kl_estimator: the per-token KL of ``Rollout.kl`` (``KLConfig.resolved_estimator``).
        merge_adapter: fold the actor adapter into the base while sampling (already resolved: one process,
            not 4-bit).
        skip_non_finite: drop responses with a non-finite score instead of raising (``reward.skip_non_finite``).
        seed: ``ppo.seed``, seeds validation sampling.
        reward_description: how error messages name the reward function.
        logprob_gap_tolerances, weights_dtype, strict_sync: the rollout-policy guard's (``rlhf_lit.rl.guard``): its
            tolerance by compute dtype (:meth:`gap_tolerance`), ``backbone.dtype``, ``sampling.strict_sync``.
        tis_cap: ``ppo.tis_cap`` (truncated importance-sampling weights from the sampler's log-probs), or None.
        filters: the policy-gradient family's (``rlhf_lit.rl.filters.FilterSettings``).
    """

    temperature: float
    num_samples_per_prompt: int = 1
    forward_batch_size: int | None = None
    logprob_chunk_size: int | None = None
    kl_estimator: str = "k1"
    merge_adapter: bool = False
    skip_non_finite: bool = False
    seed: int = 0
    reward_description: str = "the reward model"
    logprob_gap_tolerances: dict[str, float] = field(default_factory=lambda: dict(GAP_TOLERANCE))
    weights_dtype: str = "float32"
    strict_sync: bool = False
    tis_cap: float | None = None
    filters: FilterSettings = field(default_factory=FilterSettings)

    def gap_tolerance(self, precision: str | None) -> float:
        """The tolerance at Lightning ``precision`` (None: no trainer), by ``generation.compute_dtype``."""
        return self.logprob_gap_tolerances[compute_dtype(precision, self.weights_dtype)]


class RolloutCollector:
    """Steps 1-4 of an iteration: ``collect(batch) -> Rollout``.

    Args:
        policy: the ``ActorCritic`` (actor / critic forwards, ``reference_logprobs``, ``has_critic``).
        reward_fn: a :class:`RewardFunction` (``RewardSource`` or ``MixedReward``; ``score`` is looked up at
            each call); its optional attributes
            ``reads_fields`` (pass the prompt rows' fields) and ``last_components`` (per-source scores) are read.
        sampler: a :class:`~rlhf_lit.rl.sampler.Sampler`.
        shaper: the :class:`ScoreShaper`.
        settings: :class:`RolloutSettings`.
        tokenizer: decodes prompts and responses for error messages.
        world: returns the Lightning trainer (or None) for collectives; every rank calls ``collect`` together.
    """

    def __init__(
        self,
        policy,
        reward_fn: RewardFunction,
        sampler: Sampler,
        shaper: ScoreShaper,
        settings: RolloutSettings,
        tokenizer,
        world: Callable[[], Any] = lambda: None,
    ) -> None:
        self.policy, self.reward_fn, self.sampler, self.shaper = policy, reward_fn, sampler, shaper
        self.settings, self.tokenizer, self.world = settings, tokenizer, world

    def collect(self, batch: dict, iteration: int = 0) -> Rollout:
        """Steps 1-4 on one batch of prompts (see the module docstring).

        Args:
            batch: a ``PromptDataModule`` batch: ``input_ids`` / ``attention_mask`` ``(B, P)`` left padded, and
                optionally ``prompt_text``, ``prompt`` and ``fields``.
            iteration: the iteration number (0-based) for messages.

        Raises:
            NonFiniteError: a score is inf or nan and ``skip_non_finite`` is off, or every score of the global
                batch is (see :meth:`finite_scores`).
        """
        s, trainer = self.settings, self.world()
        batch = repeat_prompts(batch, s.num_samples_per_prompt)
        prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
        # columns that are padding in every prompt do no work anywhere below (exact: pitfall: left padding)
        prompt_ids, prompt_mask, _ = trim_left_padding(prompt_ids, prompt_mask, prompt_ids.shape[1])
        t0 = time.perf_counter()
        response_ids, response_mask, has_stop = self.sampler.sample(
            self.policy, prompt_ids, prompt_mask, synced_gpus=is_distributed(trainer), merge=s.merge_adapter
        )
        generation_s = time.perf_counter() - t0
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
        ref_logprobs, old_logprobs, old_values = self.experience_forwards(
            input_ids, attention_mask, prompt_ids.shape[1]
        )
        sampler_stats = check_sampler(  # the rollout-policy guard, before any update
            self.sampler, self.policy, response_ids, response_mask, old_logprobs, s, iteration, trainer
        )
        raw_scores = self.reward_fn.score(
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            has_stop,
            batch.get("prompt"),
            **self._fields(batch),
        )
        finite, num_non_finite = self.finite_scores(raw_scores, batch, response_ids, response_mask, iteration)
        shaped = apply_filters(self, raw_scores, finite, has_stop, response_ids, response_mask, old_logprobs)
        return Rollout(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=response_mask,
            has_stop=has_stop,
            input_ids=input_ids,
            attention_mask=attention_mask,
            ref_logprobs=ref_logprobs,
            old_logprobs=old_logprobs,
            old_values=old_values,
            kl=kl_per_token(old_logprobs, ref_logprobs, s.kl_estimator),
            raw_scores=raw_scores,
            scores=shaped.scores,
            finite=finite,
            num_non_finite=num_non_finite,
            prompt_text=batch.get("prompt_text"),
            generation_s=generation_s,
            reward_components=dict(getattr(self.reward_fn, "last_components", None) or {}),
            sampler_stats=sampler_stats,
            is_weights=shaped.is_weights,
            is_cap=s.tis_cap,
            filters=shaped.filters,
        )

    @torch.no_grad()
    def experience_forwards(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Steps 2-3: ``(ref_logprobs, old_logprobs, old_values)``, each ``(B, R)`` (values None without a
        critic), at the sampling temperature, in no-grad forwards of ``forward_batch_size`` rows (each piece
        without the prompt columns that are padding in all its rows)."""
        s, policy = self.settings, self.policy
        ref, old, values = [], [], []
        want_values = policy.has_critic
        size = s.forward_batch_size or input_ids.shape[0]
        for start in range(0, input_ids.shape[0], size):
            rows = slice(start, min(start + size, input_ids.shape[0]))
            ids, mask, p = trim_left_padding(input_ids[rows], attention_mask[rows], prompt_len)
            ref.append(policy.reference_logprobs(ids, mask, p, s.temperature, s.logprob_chunk_size))
            out = policy(
                ids, mask, p, s.temperature, want_values=want_values, chunk_size=s.logprob_chunk_size
            )
            old.append(out.logprobs)
            values.append(out.values)
        return torch.cat(ref), torch.cat(old), torch.cat(values) if want_values else None

    @torch.no_grad()
    def validate(self, batch: dict, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample, score and measure the KL of validation prompts: ``(scores, kl, response_len)``, each
        ``(B,)`` (scores as returned, the k1 KL per response in nats, real response tokens).

        Sampling draws from a forked RNG seeded with ``seed``, ``batch_idx`` and the rank (``rng.rank_seed``), so
        validation is repeatable and leaves the training trajectory untouched; the actor adapter is not merged."""
        prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
        prompt_ids, prompt_mask, _ = trim_left_padding(prompt_ids, prompt_mask, prompt_ids.shape[1])
        trainer = self.world()
        # torch.manual_seed seeds the CUDA generators too: fork the one sampling uses, or training's stream moves
        device = prompt_ids.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            rank, _ = rank_and_world(trainer)
            torch.manual_seed(rank_seed(self.settings.seed * 1_000_003 + batch_idx, rank))  # ranks apart
            response_ids, response_mask, _ = self.sampler.sample(
                self.policy, prompt_ids, prompt_mask, synced_gpus=is_distributed(trainer)
            )
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)
        attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
        ref_logprobs, logprobs, _ = self.experience_forwards(input_ids, attention_mask, prompt_ids.shape[1])
        if getattr(self.reward_fn, "reads_fields", False):  # reward functions read prompts and row fields
            scores = self.reward_fn.score(
                prompt_ids,
                prompt_mask,
                response_ids,
                response_mask,
                None,
                batch.get("prompt"),
                **self._fields(batch),
            )
        else:
            scores = self.reward_fn.score(prompt_ids, prompt_mask, response_ids, response_mask)
        kl = ((logprobs - ref_logprobs) * response_mask).sum(-1)
        return scores, kl, response_mask.sum(-1)

    def _fields(self, batch: dict) -> dict:
        """``{"fields": the prompt rows' fields}`` for a reward function that reads them (``reads_fields``,
        e.g. ``rlhf_lit.rewards.MixedReward``), else nothing: a reward model is called as before."""
        return {"fields": batch.get("fields")} if getattr(self.reward_fn, "reads_fields", False) else {}

    def finite_scores(self, raw_scores, batch, response_ids, response_mask, iteration: int = 0):
        """``(finite (B,) bool, non-finite count in the GLOBAL batch)``: every rank decides together.

        Raises:
            NonFiniteError: if a score is inf or nan (on any rank) and ``skip_non_finite`` is off, or if every
                score of the global batch is.
        """
        finite = torch.isfinite(raw_scores)
        trainer = self.world()
        num_bad = int(global_sum(trainer, (~finite).sum().float()))
        if num_bad == 0:
            return finite, 0
        _, world_size = rank_and_world(trainer)
        if not self.settings.skip_non_finite or num_bad == finite.numel() * world_size:
            raise NonFiniteError(
                self._non_finite_message(raw_scores, finite, batch, response_ids, response_mask, iteration)
            )
        log.warning(
            "PPO iteration %d: %d response(s) with a non-finite score dropped from the update "
            "(reward.skip_non_finite; rollout/non_finite_scores)",
            iteration + 1,
            num_bad,
        )
        return finite, num_bad

    def _non_finite_message(self, raw_scores, finite, batch, response_ids, response_mask, iteration) -> str:
        source = self.settings.reward_description
        where = f"PPO iteration {iteration + 1}"
        trainer = self.world()
        if is_distributed(trainer):
            where += f", rank {trainer.global_rank}"
        bad = (~finite).nonzero().flatten().tolist()
        if not bad:
            return f"{where}: a reward-model score on another rank is inf or nan ({source}); see that rank's error"
        if self.settings.skip_non_finite:
            return f"{where}: every reward-model score of the batch is inf or nan ({source}); nothing to learn from"
        i = bad[0]
        tokenizer = self.tokenizer
        prompts = batch.get("prompt_text")
        prompt = prompts[i] if prompts else tokenizer.decode(batch["input_ids"][i], skip_special_tokens=True)
        response = tokenizer.decode(response_ids[i][response_mask[i].bool()], skip_special_tokens=True)
        return (
            f"{where}: the reward model ({source}) scored response {i} of the batch {float(raw_scores[i])} "
            f"(prompt {i}: {prompt[-60:]!r}; response: {response[:60]!r})"
            + (f", and {len(bad) - 1} more (indices {bad[1:6]})" if len(bad) > 1 else "")
            + ". Set reward.skip_non_finite: true to drop such responses from the update instead"
        )
