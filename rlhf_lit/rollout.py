"""One PPO iteration's experience (:class:`Rollout`) and how it is collected: steps 1-4 of the iteration.

:func:`collect_rollout` runs, for one batch of prompts (``rlhf_lit.modules.ppo`` numbers the steps):

1. sampling: the actor adapter samples ``sampling.num_samples_per_prompt`` responses per prompt (merged into the base for speed when
   ``sampling.merge_adapter`` allows);
2. reference log-probs, every adapter off;
3. old log-probs (actor) and values (critic), at the sampling temperature with dropout off, and the
   per-token KL to the reference (``kl.estimator``);
4. the reward function's scores (``RewardSource.score``: the calibrated reward model; or
   ``rlhf_lit.rewards.MixedReward.score``: a weighted sum of reward models and Python reward functions, the
   same :class:`RewardFunction` call), the non-finite guard, the missing-EOS penalty, normalisation and
   clipping.

Step 5 (token rewards, advantages, returns) belongs to an advantage estimator (``rlhf_lit.algorithms``):
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
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rlhf_lit.errors import NonFiniteError
from rlhf_lit.functional.kl import kl_per_token
from rlhf_lit.functional.sequence import trim_left_padding
from rlhf_lit.generation import sample_responses
from rlhf_lit.parallel.collectives import global_sum, is_distributed
from rlhf_lit.reward_norm import normalize_scores

if TYPE_CHECKING:
    from rlhf_lit.modules.ppo import PPOModule

log = logging.getLogger("rlhf_lit")

__all__ = [
    "RewardFunction",
    "Rollout",
    "collect_rollout",
    "repeat_prompts",
    "experience_forwards",
    "sample_from_actor",
    "validation_rollout",
]

Sampler = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class RewardFunction(Protocol):
    """What step 4 calls: ``(B,)`` float scores of ``(B, P)`` left-padded prompts and ``(B, R)`` responses
    (``RewardSource.score`` and ``rlhf_lit.rewards.MixedReward.score`` are two). ``has_stop`` is ``(B,)`` bool;
    ``prompts`` the data's prompts (strings or message lists) or None; ``fields`` the prompt rows' fields
    (``batch["fields"]``) or None. A score may be inf or nan; the guard of :func:`collect_rollout` handles it."""

    def __call__(
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
        prompt_mask: ``(B, P)``, 1 = real token.
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
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
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

    @property
    def prompt_len(self) -> int:
        """P, the width of the prompt block of ``input_ids``."""
        return self.prompt_ids.shape[1]

    @property
    def update_mask(self) -> torch.Tensor:
        """``(B, R)`` bool: the tokens that enter the update, every real response token less those of
        responses whose score was not finite."""
        return self.response_mask & self.finite.unsqueeze(-1)

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


def sample_from_actor(
    module: PPOModule,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sample: Sampler = sample_responses,
    merge: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1: ``sample`` (``generation.sample_responses`` or a stand-in with its signature) with the actor
    adapter on, or folded into the base weights when ``merge`` (one process, not 4-bit; exact on exit)."""
    lm = module.policy.lm
    with lm.merged("actor") if merge else lm.adapter("actor"):
        return sample(
            lm,  # AdaptedLM.generate: an FSDP forward method when sharded
            prompt_ids,
            prompt_mask,
            module.sampling,
            module.stop_ids,
            module.tokenizer.pad_token_id,
            synced_gpus=is_distributed(module.trainer),
        )


@torch.no_grad()
def experience_forwards(
    module: PPOModule, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 2-3: ``(ref_logprobs, old_logprobs, old_values)``, each ``(B, R)``, at the sampling temperature,
    in no-grad forwards of ``ppo.rollout_forward_batch_size`` rows (each piece without the prompt columns that
    are padding in all its rows)."""
    ref, old, values = [], [], []
    want_values = module.policy.has_critic
    chunk, size = module.ppo.logprob_chunk_size, module.ppo.rollout_forward_batch_size or input_ids.shape[0]
    T = module.sampling.temperature
    for start in range(0, input_ids.shape[0], size):
        rows = slice(start, min(start + size, input_ids.shape[0]))
        ids, mask, p = trim_left_padding(input_ids[rows], attention_mask[rows], prompt_len)
        ref.append(module.policy.reference_logprobs(ids, mask, p, T, chunk))
        out = module.policy(ids, mask, p, T, want_values=want_values, chunk_size=chunk)
        old.append(out.logprobs)
        values.append(out.values)
    return torch.cat(ref), torch.cat(old), torch.cat(values) if want_values else None


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


def collect_rollout(module: PPOModule, batch: dict, sample: Sampler = sample_responses) -> Rollout:
    """Steps 1-4 of a PPO iteration on one batch of prompts (see the module docstring).

    Args:
        module: the PPO module (policy, reward source, settings; its ``_experience_forwards`` runs steps 2-3).
        batch: a ``PromptDataModule`` batch: ``input_ids`` / ``attention_mask`` ``(B, P)`` left padded, and
            optionally ``prompt_text`` and ``prompt``.
        sample: the sampler of step 1 (default ``generation.sample_responses``).

    Raises:
        NonFiniteError: a score is inf or nan and ``reward.skip_non_finite`` is off, or every score of the
            global batch is (see :func:`finite_scores`).
    """
    batch = repeat_prompts(batch, module.sampling.num_samples_per_prompt)
    prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
    # columns that are padding in every prompt do no work anywhere below (exact: pitfall: left padding)
    prompt_ids, prompt_mask, _ = trim_left_padding(prompt_ids, prompt_mask, prompt_ids.shape[1])
    t0 = time.perf_counter()
    merge = (
        module.sampling.merge_adapter
        and not is_distributed(module.trainer)
        and not module.backbone_cfg.load_in_4bit
    )
    response_ids, response_mask, has_stop = sample_from_actor(module, prompt_ids, prompt_mask, sample, merge)
    generation_s = time.perf_counter() - t0
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)

    ref_logprobs, old_logprobs, old_values = module._experience_forwards(
        input_ids, attention_mask, prompt_ids.shape[1]
    )

    raw_scores = module.reward_source.score(
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        has_stop,
        batch.get("prompt"),
        **_fields(module, batch),
    )
    finite, num_non_finite = finite_scores(module, raw_scores, batch, response_ids, response_mask)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        has_stop=has_stop,
        input_ids=input_ids,
        attention_mask=attention_mask,
        ref_logprobs=ref_logprobs,
        old_logprobs=old_logprobs,
        old_values=old_values,
        kl=kl_per_token(old_logprobs, ref_logprobs, module.kl_cfg.estimator),
        raw_scores=raw_scores,
        scores=shaped_scores(module, raw_scores, finite, has_stop),
        finite=finite,
        num_non_finite=num_non_finite,
        prompt_text=batch.get("prompt_text"),
        generation_s=generation_s,
        reward_components=dict(getattr(module.reward_source, "last_components", None) or {}),
    )


@torch.no_grad()
def validation_rollout(
    module: PPOModule, batch: dict, batch_idx: int, sample: Sampler = sample_responses
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample, score and measure the KL of validation prompts: ``(scores, kl, response_len)``, each ``(B,)``
    (reward-model scores as returned, the k1 KL per response in nats, real response tokens).

    Sampling draws from a forked RNG seeded with ``ppo.seed`` and ``batch_idx``, so validation is repeatable
    and leaves the training trajectory untouched; the actor adapter is not merged."""
    prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
    prompt_ids, prompt_mask, _ = trim_left_padding(prompt_ids, prompt_mask, prompt_ids.shape[1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module.ppo.seed * 1_000_003 + batch_idx)
        response_ids, response_mask, _ = sample_from_actor(module, prompt_ids, prompt_mask, sample)
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
    ref_logprobs, logprobs, _ = module._experience_forwards(input_ids, attention_mask, prompt_ids.shape[1])
    if getattr(module.reward_source, "reads_fields", False):  # reward functions read prompts and row fields
        scores = module.reward_source.score(
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            None,
            batch.get("prompt"),
            **_fields(module, batch),
        )
    else:
        scores = module.reward_source.score(prompt_ids, prompt_mask, response_ids, response_mask)
    kl = ((logprobs - ref_logprobs) * response_mask).sum(-1)
    return scores, kl, response_mask.sum(-1)


def _fields(module: PPOModule, batch: dict) -> dict:
    """``{"fields": the prompt rows' fields}`` for a reward source that reads them (``reads_fields``, e.g.
    ``rlhf_lit.rewards.MixedReward``), else nothing: a reward model is called as before."""
    return {"fields": batch.get("fields")} if getattr(module.reward_source, "reads_fields", False) else {}


def shaped_scores(
    module: PPOModule, raw_scores: torch.Tensor, finite: torch.Tensor, has_stop: torch.Tensor
) -> torch.Tensor:
    """``(B,)`` scores the rewards use: non-finite ones 0, minus ``reward.missing_eos_penalty`` without a stop
    token, normalised by the running statistics (updated with this batch's finite scores, all ranks) and
    clipped (``reward.normalize``, ``reward.clip``; Zheng et al. 2023, section 5.3)."""
    shaping = module.shaping
    scores = torch.where(finite, raw_scores, torch.zeros_like(raw_scores))
    if shaping.missing_eos_penalty is not None and module.stop_ids:
        scores = scores - shaping.missing_eos_penalty * (~has_stop).float()
    if shaping.normalize:
        module.score_stats.update(scores[finite])
    return normalize_scores(scores, module.score_stats if shaping.normalize else None, shaping.clip)


def finite_scores(
    module: PPOModule, raw_scores, batch, response_ids, response_mask
) -> tuple[torch.Tensor, int]:
    """Which scores are finite, and how many in the global batch are not (every rank decides together).

    Raises:
        NonFiniteError: if a score is inf or nan (on any rank) and ``reward.skip_non_finite`` is off, or if
            every score of the global batch is.
    """
    finite = torch.isfinite(raw_scores)
    trainer = module.trainer
    num_bad = int(global_sum(trainer, (~finite).sum().float()))
    if num_bad == 0:
        return finite, 0
    if not module.shaping.skip_non_finite or num_bad == finite.numel() * trainer.world_size:
        raise NonFiniteError(
            _non_finite_message(module, raw_scores, finite, batch, response_ids, response_mask)
        )
    log.warning(
        "PPO iteration %d: %d response(s) with a non-finite score dropped from the update "
        "(reward.skip_non_finite; rollout/non_finite_scores)",
        module.iteration + 1,
        num_bad,
    )
    return finite, num_bad


def describe_reward_source(cfg) -> str:
    """The reward model as the config (``RewardModelConfig``) names it, for error messages."""
    if isinstance(cfg, list):
        return "reward_model (a list of " + ", ".join(e.function or "model" for e in cfg) + ")"
    if cfg.path is not None:
        return f"reward_model.path={cfg.path!r} (mode {cfg.mode})"
    return "reward_model.backbone (an untrained reward model built from config)"


def _non_finite_message(module: PPOModule, raw_scores, finite, batch, response_ids, response_mask) -> str:
    source = describe_reward_source(module.reward_model_cfg)
    where = f"PPO iteration {module.iteration + 1}"
    if is_distributed(module.trainer):
        where += f", rank {module.trainer.global_rank}"
    bad = (~finite).nonzero().flatten().tolist()
    if not bad:
        return (
            f"{where}: a reward-model score on another rank is inf or nan ({source}); see that rank's error"
        )
    if module.shaping.skip_non_finite:
        return (
            f"{where}: every reward-model score of the batch is inf or nan ({source}); nothing to learn from"
        )
    i = bad[0]
    tokenizer = module.tokenizer
    prompts = batch.get("prompt_text")
    prompt = prompts[i] if prompts else tokenizer.decode(batch["input_ids"][i], skip_special_tokens=True)
    response = tokenizer.decode(response_ids[i][response_mask[i].bool()], skip_special_tokens=True)
    return (
        f"{where}: the reward model ({source}) scored response {i} of the batch {float(raw_scores[i])} "
        f"(prompt {i}: {prompt[-60:]!r}; response: {response[:60]!r})"
        + (f", and {len(bad) - 1} more (indices {bad[1:6]})" if len(bad) > 1 else "")
        + ". Set reward.skip_non_finite: true to drop such responses from the update instead"
    )
