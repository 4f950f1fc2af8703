"""DAPO's dynamic sampling with refill: more rounds of prompts until the batch holds enough groups with signal.

``ppo.dynamic_sampling`` leaves the groups whose scores are all equal out of the loss (``rl.filters``). With
``ppo.dynamic_sampling_max_rounds: K > 0``, :class:`DynamicSampling` also replaces them, as DAPO does (Yu et al.
2025, s. 3.2 and Algorithm 1; veRL's DAPO recipe generates batches up to ``max_num_gen_batches``): after the
loader's batch of B prompts is collected, while some rank holds fewer than B informative groups and fewer than K
extra rounds have run, every rank draws B more prompts (:class:`DatasetPrompts`) and collects them with the same
``RolloutCollector``; the iteration's rollout is then B groups per rank, informative ones first
(``functional.policy_gradient.refill_order``), topped up with filtered groups (still out of the loss) when the
cap is hit. The batch size the update sees is the configured one; its rows may come from several rounds, of
different prompt and response widths (``functional.sequence.pad_cat``).

Every rank runs the same number of rounds (the decision reads a global count), so generation and the collectives
of each round line up under several processes. Each round's scores pass the score shaping as they come: with
``reward.normalize`` the running statistics take every round's scores, and a group is normalised with the
statistics of its round. The extra prompts are drawn with a generator of their own, seeded by ``ppo.seed`` and the
iteration, so the global RNG (sampling) and the prompt loader are untouched and a resumed run draws the same ones.

Notation: B prompts (groups) per rank, n samples per prompt, W ranks.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from dataclasses import replace

import torch

from rlhf_lit import metrics as M
from rlhf_lit.functional.policy_gradient import refill_order
from rlhf_lit.functional.sequence import pad_cat, trim_left_padding
from rlhf_lit.parallel.collectives import global_sum
from rlhf_lit.rl.filters import RolloutFilters
from rlhf_lit.rl.rollout import Rollout, RolloutCollector

log = logging.getLogger("rlhf_lit")

__all__ = ["DatasetPrompts", "DynamicSampling", "PromptSource", "merge_groups"]

PromptSource = Callable[[int, int, int], dict]
"""``(iteration, round, num_prompts) -> batch``: a prompt batch as the prompt data module gives it (``input_ids``,
``attention_mask`` ``(num_prompts, P)`` left padded, optionally ``prompt_text``, ``prompt``, ``fields``) for extra
round ``round`` (1-based) of iteration ``iteration`` (0-based), on the module's device."""


class DatasetPrompts:
    """Prompts for the extra rounds, drawn from the training prompts without touching the loader or the global RNG.

    Iteration i draws one permutation of the N prompts with a ``torch.Generator`` seeded by ``(seed, i)`` (the same
    on every rank); round r of rank k takes its positions ``((r - 1) * W + k) * B ...`` onwards, cycling when the
    rounds of all ranks need more than N. So the draws of one iteration differ between rounds and ranks (until N
    runs out), depend on nothing but ``(seed, i, r, k)``, and a resumed run draws the same prompts. A prompt of the
    loader's batch may be drawn again.

    Args:
        dataset: the training prompts (``dataset[j]`` an example the collate function takes).
        collate: makes a batch of examples (the training loader's ``collate_fn``).
        seed: ``ppo.seed``.
        rank, world_size: this process's rank and the number of ranks.
        device: where the batch's tensors go (the module's device).
    """

    def __init__(self, dataset, collate: Callable, seed: int, rank: int = 0, world_size: int = 1, device=None):
        if len(dataset) == 0:
            raise ValueError("ppo.dynamic_sampling_max_rounds draws more training prompts, but there are none")
        self.dataset, self.collate, self.seed = dataset, collate, seed
        self.rank, self.world_size, self.device = rank, world_size, device

    def indices(self, iteration: int, round: int, num_prompts: int) -> list[int]:
        """The dataset rows of extra round ``round`` (>= 1) of ``iteration`` on this rank."""
        gen = torch.Generator().manual_seed(zlib.crc32(f"dynamic_sampling/{self.seed}/{iteration}".encode()))
        order = torch.randperm(len(self.dataset), generator=gen)
        start = ((round - 1) * self.world_size + self.rank) * num_prompts
        return order[(start + torch.arange(num_prompts)) % len(self.dataset)].tolist()

    def __call__(self, iteration: int, round: int, num_prompts: int) -> dict:
        batch = self.collate([self.dataset[j] for j in self.indices(iteration, round, num_prompts)])
        if self.device is None:
            return batch
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}


def group_flags(rollout: Rollout, group_size: int) -> torch.Tensor:
    """``(G,)`` bool: the rollout's groups that ``ppo.dynamic_sampling`` filtered (scores all equal)."""
    return rollout.filters.filtered.view(-1, group_size)[:, 0]


def merge_groups(
    parts: list[Rollout], rounds: torch.Tensor, groups: torch.Tensor, group_size: int, pad_token_id: int
) -> Rollout:
    """One :class:`Rollout` of the groups ``(rounds[j], groups[j])`` of the rollouts ``parts``, in that order.

    Prompts are left padded and responses right padded to the widest part (``pad_cat``; pad id, mask 0,
    log-probs, values and KL 0, importance weights 1), then the columns that are padding in every kept row are
    dropped (left of the prompts, right of the responses). Per-row fields follow their rows; the counts add up
    (``num_non_finite``, ``generation_s``, ``sampled_tokens``); the sampler guard's figures are the rounds' mean gap
    and largest gap. ``filters`` keeps the per-row decisions; its counts are the caller's to set.

    Args:
        parts: the rounds' rollouts (each of whole groups of ``group_size`` consecutive rows).
        rounds, groups: ``(G,)`` long, as ``functional.policy_gradient.refill_order`` returns them.
        group_size: n.
        pad_token_id: the id written into added padding.
    """
    first, n = parts[0], group_size
    device = first.scores.device
    offsets = torch.tensor([0] + [p.scores.numel() for p in parts[:-1]]).cumsum(0)
    starts = offsets[rounds] + groups * n
    rows = (starts.repeat_interleave(n) + torch.arange(n).repeat(len(starts))).to(device)

    def left(get, value):
        return pad_cat([get(p) for p in parts], value, "left")[rows]

    def right(get, value):
        return pad_cat([get(p) for p in parts], value, "right")[rows]

    def flat(get):
        values = [get(p) for p in parts]
        return None if any(v is None for v in values) else torch.cat(values)[rows]

    prompt_ids = left(lambda p: p.prompt_ids, pad_token_id)
    prompt_mask = left(lambda p: p.attention_mask[:, : p.prompt_len], 0)
    response_ids = right(lambda p: p.response_ids, pad_token_id)
    response_mask = right(lambda p: p.response_mask, False)
    width = max(1, int(response_mask.sum(-1).max()))  # right padding of every kept response dropped
    input_ids = torch.cat([prompt_ids, response_ids[:, :width]], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask[:, :width].to(prompt_mask.dtype)], dim=1)
    input_ids, attention_mask, prompt_len = trim_left_padding(input_ids, attention_mask, prompt_ids.shape[1])

    def responses(get, value):
        return None if get(first) is None else right(get, value)[:, :width]

    f = first.filters
    filters = RolloutFilters(
        overlong=flat(lambda p: p.filters.overlong),
        truncated_masked=flat(lambda p: p.filters.truncated_masked),
        filtered=flat(lambda p: p.filters.filtered),
        is_affected=responses(lambda p: p.filters.is_affected, False),
        is_level=f.is_level,
    )
    return Rollout(
        prompt_ids=input_ids[:, :prompt_len],
        response_ids=input_ids[:, prompt_len:],
        response_mask=response_mask[:, :width],
        has_stop=flat(lambda p: p.has_stop),
        input_ids=input_ids,
        attention_mask=attention_mask,
        ref_logprobs=responses(lambda p: p.ref_logprobs, 0.0),
        old_logprobs=responses(lambda p: p.old_logprobs, 0.0),
        old_values=responses(lambda p: p.old_values, 0.0),
        kl=responses(lambda p: p.kl, 0.0),
        raw_scores=flat(lambda p: p.raw_scores),
        scores=flat(lambda p: p.scores),
        finite=flat(lambda p: p.finite),
        num_non_finite=sum(p.num_non_finite for p in parts),
        prompt_text=_texts([p.prompt_text for p in parts], rows.tolist()),
        generation_s=sum(p.generation_s for p in parts),
        sampled_tokens=sum(p.response_ids.numel() for p in parts),
        reward_components={name: flat(lambda p, k=name: p.reward_components[k]) for name in first.reward_components},
        sampler_stats=_sampler_stats([p.sampler_stats for p in parts]),
        is_weights=responses(lambda p: p.is_weights, 1.0),
        is_cap=first.is_cap,
        filters=filters,
    )


def _texts(texts: list[list[str] | None], rows: list[int]) -> list[str] | None:
    """The prompt texts of ``rows`` of the parts' texts laid end to end (None unless every part has them)."""
    if any(t is None for t in texts):
        return None
    every = [t for text in texts for t in text]
    return [every[i] for i in rows]


def _sampler_stats(rounds: list[dict]) -> dict:
    """The rollout-policy guard's figures of several rounds: the mean of their mean gaps, the largest gap."""
    gaps = [r[M.ROLLOUT_SAMPLER_LOGPROB_GAP] for r in rounds if M.ROLLOUT_SAMPLER_LOGPROB_GAP in r]
    if not gaps:
        return {}
    return {
        M.ROLLOUT_SAMPLER_LOGPROB_GAP: sum(gaps) / len(gaps),
        M.ROLLOUT_SAMPLER_LOGPROB_GAP_MAX: max(r[M.ROLLOUT_SAMPLER_LOGPROB_GAP_MAX] for r in rounds if r),
    }


class DynamicSampling:
    """Steps 1-4 with DAPO's refill: ``collect(batch, iteration) -> Rollout`` of the configured size (the module
    docstring).

    Args:
        collector: the ``RolloutCollector`` (its ``settings.num_samples_per_prompt``; its ``world()`` for the global
            counts: every rank calls ``collect`` together).
        max_rounds: ``ppo.dynamic_sampling_max_rounds``; 0 collects the loader's batch only (``collector.collect``).
        prompts: a :data:`PromptSource` for the extra rounds (default in the PPO module: :class:`DatasetPrompts`
            over the training prompts); read only when a round is needed.
        pad_token_id: the id of added padding when rounds of different widths are merged.
    """

    def __init__(
        self, collector: RolloutCollector, max_rounds: int, prompts: PromptSource | None, pad_token_id: int
    ) -> None:
        self.collector, self.max_rounds, self.prompts = collector, max_rounds, prompts
        self.pad_token_id = pad_token_id
        self.warned = False

    def collect(self, batch: dict, iteration: int = 0) -> Rollout:
        """The iteration's rollout: the loader's batch, its filtered groups replaced by those of up to
        ``max_rounds`` extra rounds. ``filters.filtered_groups`` counts the first round's filtered groups (all
        ranks), ``filters.rounds`` the extra rounds, ``filters.unfilled_groups`` the filtered groups left in the
        rollout (all ranks; they weigh 0). Raises what ``RolloutCollector.collect`` raises."""
        first = self.collector.collect(batch, iteration)
        if self.max_rounds == 0 or first.filters.filtered is None:
            return first
        n = self.collector.settings.num_samples_per_prompt
        num_groups = first.scores.numel() // n
        parts, flat = [first], [group_flags(first, n)]
        while len(parts) <= self.max_rounds and self._global_shortfall(flat, num_groups) > 0:
            if self.prompts is None:
                raise ValueError("ppo.dynamic_sampling_max_rounds needs a prompt source for its extra rounds")
            more = self.prompts(iteration, len(parts), num_groups)
            parts.append(self.collector.collect(more, iteration))
            flat.append(group_flags(parts[-1], n))
        if len(parts) == 1:  # every group of every rank has signal
            first.filters.rounds = 0
            return first
        rounds, groups = refill_order(flat, num_groups)
        merged = merge_groups(parts, rounds, groups, n, self.pad_token_id)
        unfilled = self._global_shortfall(flat, num_groups)
        merged.filters = replace(
            merged.filters, filtered_groups=first.filters.filtered_groups, rounds=len(parts) - 1, unfilled_groups=unfilled
        )
        trainer = self.collector.world()
        if unfilled and not self.warned and getattr(trainer, "is_global_zero", True):
            self.warned = True
            log.warning(
                "PPO iteration %d: after ppo.dynamic_sampling_max_rounds=%d extra round(s), %d group(s) of the batch "
                "(all ranks) still have equal scores; they stay in the batch out of the loss "
                "(rollout/unfilled_groups; this warning is given once)",
                iteration + 1,
                self.max_rounds,
                unfilled,
            )
        return merged

    def _global_shortfall(self, flat: list[torch.Tensor], num_groups: int) -> int:
        """Informative groups missing from this rank's batch, summed over ranks (the same on every rank)."""
        informative = sum(int((~f).sum()) for f in flat)
        mine = torch.tensor(float(max(0, num_groups - informative)), device=flat[0].device)
        return int(round(float(global_sum(self.collector.world(), mine))))
