"""Step 6 of the PPO iteration: ``ppo_epochs`` x global minibatches x micro-batches, one optimizer step each.

One path for every configuration: each micro-batch runs the policy's forward for the objective's terms and
back-propagates them (:func:`micro_batch_backward`); the two-pass option splits the terms into two forward +
backward pairs (actor terms, then the value term). Then the PTX term (if any), global-norm gradient clipping,
the optimizer and schedule step -- skipped, nothing changed, when the gradient norm is inf or nan.

The loss of a minibatch is the token mean over the GLOBAL minibatch (this rank's rows of it and every
other rank's): DDP and FSDP average gradients over ranks, so a micro-batch's mean loss is weighted by
``world_size * its tokens / global tokens``; the average of the ranks' gradients is then
``sum(token losses) / global tokens`` however unevenly rows and tokens are spread (a per-rank mean,
averaged, would not be). One rank: ``n / N``. The other aggregations (``ppo.loss_aggregation``) weigh each
token by ``w`` (``functional.aggregation.aggregation_weights``): the micro-batch's ``w``-weighted mean times
``world_size * sum(its w) / D``, with ``D`` the global minibatch's ``sum(w)`` (its number of responses for
``seq_mean_token_mean``) or, for ``token_sum_norm``, its responses x ``ppo.loss_norm_constant``.

Lightning's manual-optimization contract (docs/layout.md): ``manual_backward`` for every backward, our own
clipping (Lightning's FSDP precision plugin refuses norm clipping), ``opt.step()`` and ``sched.step()``
here. :class:`PPOUpdater` is built with those as callables (``backward``, ``clip``, ``optimizers``), never
with the LightningModule, and keeps the count of skipped steps in a row (its ``state_dict``).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_lit import metrics as M
from rlhf_lit.errors import NonFiniteError
from rlhf_lit.functional.aggregation import aggregation_weights
from rlhf_lit.functional.losses import sft_nll
from rlhf_lit.functional.sequence import trim_left_padding
from rlhf_lit.parallel import global_sum, grad_norm_value, rank_and_world
from rlhf_lit.rl.objectives import MicroBatch, Objective
from rlhf_lit.rl.schedule import epoch_schedule

log = logging.getLogger("rlhf_lit")

LOSS_KEYS = (
    M.PPO_POLICY_LOSS,
    M.PPO_VALUE_LOSS,
)  # logged as aggregated (ppo.loss_aggregation); the rest token means

__all__ = ["PPOUpdater", "UpdateBatch", "UpdateSettings", "clip_global_grad_norm"]


@dataclass
class UpdateBatch:
    """The rollout tensors the update reads (this rank's B rows).

    Attributes:
        input_ids: ``(B, T)`` prompt (left padded) then response; ``attention_mask`` ``(B, T)``.
        prompt_len: P.
        mask: ``(B, R)`` bool, the update tokens (``Rollout.update_mask``).
        old_logprobs: ``(B, R)``.
        old_values: ``(B, R)`` or None without a critic.
        advantages: ``(B, R)``.
        returns: ``(B, R)`` or None without a critic.
        ref_logprobs: ``(B, R)`` with the KL in the loss, else None; ``kl_coef`` its weight.
        token_weights: ``(B, R)`` the loss aggregation's weights (``functional.aggregation.aggregation_weights``), or None for
            the plain token mean.
        is_weights: ``(B, R)`` the policy loss's truncated importance-sampling weights (``Rollout.is_weights``), or None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    old_values: torch.Tensor | None
    advantages: torch.Tensor
    returns: torch.Tensor | None
    ref_logprobs: torch.Tensor | None = None
    kl_coef: float = 0.0
    token_weights: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None

    @classmethod
    def from_rollout(cls, rollout, adv, kl_coef: float | None = None) -> UpdateBatch:
        """The update's view of a ``Rollout`` and its ``Advantages``; ``kl_coef`` (the KL in the loss) also
        passes the reference log-probs."""
        kl = {} if kl_coef is None else {"ref_logprobs": rollout.ref_logprobs, "kl_coef": kl_coef}
        return cls(
            rollout.input_ids,
            rollout.attention_mask,
            rollout.prompt_len,
            rollout.update_mask,
            rollout.old_logprobs,
            rollout.old_values,
            adv.advantages,
            adv.returns,
            **kl,
            is_weights=rollout.is_weights,
        )

    def micro_batch(self, rows: torch.Tensor) -> MicroBatch:
        """Rows ``rows`` (long, on the batch's device), with the prompt columns that are padding in all of
        them dropped. No rows: one zero-weight filler row (row 0 with an all-False mask), because every rank
        must run as many forwards and backwards as the others (DDP / FSDP collectives)."""
        mask = self.mask[rows]
        if rows.numel() == 0:
            rows = torch.zeros(1, dtype=torch.long, device=self.input_ids.device)
            mask = torch.zeros_like(self.mask[rows])
        ids, attn, p = trim_left_padding(self.input_ids[rows], self.attention_mask[rows], self.prompt_len)
        return MicroBatch(
            input_ids=ids,
            attention_mask=attn,
            prompt_len=p,
            mask=mask,
            old_logprobs=self.old_logprobs[rows],
            advantages=self.advantages[rows],
            old_values=None if self.old_values is None else self.old_values[rows],
            returns=None if self.returns is None else self.returns[rows],
            ref_logprobs=None if self.ref_logprobs is None else self.ref_logprobs[rows],
            kl_coef=self.kl_coef,
            token_weights=None if self.token_weights is None else self.token_weights[rows],
            is_weights=None if self.is_weights is None else self.is_weights[rows],
        )


@dataclass
class UpdateSettings:
    """The update's settings (``PPOConfig`` and ``SamplingConfig`` fields of the same names).

    Attributes:
        ppo_epochs, ppo_minibatch_size, micro_batch_size, seed, logprob_chunk_size, entropy_coef,
        loss_norm_constant, max_consecutive_skips: ``ppo.*``.
        aggregation: the resolved ``ppo.loss_aggregation`` (``PPOConfig.aggregation()``).
        temperature: ``sampling.temperature``; group_size: ``sampling.num_samples_per_prompt``;
        max_new_tokens: ``sampling.max_new_tokens`` (default of ``loss_norm_constant``).
        two_pass: on one process with a separate critic adapter, back-propagate the actor terms before the
            critic's forward (same gradients, lower peak memory).
    """

    ppo_epochs: int
    ppo_minibatch_size: int
    micro_batch_size: int | None
    seed: int
    logprob_chunk_size: int | None
    entropy_coef: float
    loss_norm_constant: float | None
    max_consecutive_skips: int
    aggregation: str
    temperature: float
    group_size: int = 1
    max_new_tokens: int = 1
    two_pass: bool = True


class PPOUpdater:
    """Step 6: ``update(batch, iteration) -> stats``.

    Args:
        policy: the ``ActorCritic`` (forward for the objective's terms; ``shared_critic``; ``lm`` for PTX).
        objective: the loss (``rlhf_lit.rl.objectives``).
        settings: :class:`UpdateSettings`.
        backward: ``backward(loss)``, e.g. the LightningModule's ``manual_backward``.
        clip: ``clip(opt) -> norm before clipping`` (inf / nan when a gradient is; None when the precision
            plugin clips), e.g. :func:`clip_global_grad_norm` bound to the run's settings.
        optimizers: ``() -> (optimizer, lr scheduler)``.
        world: ``() -> trainer`` for the world size, rank and collectives (None: one process, no trainer).
        schedule: the minibatch schedule (:func:`epoch_schedule` or one with its signature).
        ptx_stream, ptx_coef: the pretraining mix (``ptx.coef > 0``; a ``data.ptx.PTXStream``), None: none.
    """

    def __init__(
        self,
        policy,
        objective: Objective,
        settings: UpdateSettings,
        backward: Callable[[torch.Tensor], Any],
        clip: Callable[[Any], float | None],
        optimizers: Callable[[], tuple[Any, Any]],
        world: Callable[[], Any],
        schedule: Callable = epoch_schedule,
        ptx_stream: Any = None,
        ptx_coef: float = 0.0,
    ) -> None:
        self.policy, self.objective, self.settings = policy, objective, settings
        self.backward, self.clip, self.optimizers, self.world = backward, clip, optimizers, world
        self.schedule, self.ptx_stream, self.ptx_coef = schedule, ptx_stream, ptx_coef
        self.consecutive_skips = 0  # optimizer steps skipped in a row for a non-finite gradient norm

    def state_dict(self) -> dict:
        consumed = self.ptx_stream.consumed if self.ptx_stream is not None else 0
        return {"consecutive_skips": self.consecutive_skips, "ptx_consumed": consumed}

    def load_state_dict(self, state: dict) -> None:
        """The skip count; the (seeded) PTX stream moves past the batches the interrupted run used."""
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        if self.ptx_stream is not None:
            self.ptx_stream.fast_forward(int(state.get("ptx_consumed", 0)))

    def update(self, batch: UpdateBatch, iteration: int = 0) -> dict[str, float]:
        """``ppo_epochs`` passes over the rollout in global minibatches (``schedule``), one optimizer step per
        minibatch holding an update token. Returns each figure's mean over those minibatches (``ppo/*``: the
        losses as aggregated, the rest token-weighted means over the micro-batches), the PTX loss, the mean
        gradient norm of the applied steps and the skipped steps. ``iteration`` (0-based) seeds the shuffles.
        A minibatch with no update token on any rank (dynamic sampling, truncation masking; a global count)
        runs no forward, PTX term or optimizer step (AdamW would move weights on zero gradients) and is not in
        the figures; the schedule, sized in minibatches (``rl.assembly.schedule_steps``, the planner's
        count), still advances. No update token at all: no step, ``{}`` returned.

        Raises:
            NonFiniteError: after ``max_consecutive_skips`` optimizer steps in a row with a non-finite norm.
        """
        cfg, trainer = self.settings, self.world()
        if not global_sum(trainer, batch.mask.sum().float()):
            log.warning("PPO iteration %d: no response is left for the update: no optimizer step", iteration + 1)
        aggregation = cfg.aggregation
        batch.token_weights = aggregation_weights(batch.mask, aggregation)
        opt, sched = self.optimizers()
        micro = cfg.micro_batch_size or cfg.ppo_minibatch_size
        rank, world_size = rank_and_world(trainer)
        has_critic = batch.returns is not None
        # Actor and critic on separate adapters have disjoint trainable parameters, so the backward of the
        # policy terms and that of the value term can run one after the other: the same gradients, but the
        # actor's activations are freed before the critic's forward (peak ~ one forward's activations, not
        # two). One process only: DDP expects every trainable parameter's gradient from each backward.
        two_pass = cfg.two_pass and has_critic and not self.policy.shared_critic and world_size == 1
        terms = self.objective.terms(has_critic)
        passes = tuple((t,) for t in terms) if two_pass else (terms,)
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + iteration)
        sums: dict[str, float] = {}
        n_steps = n_applied = 0
        grad_norms = 0.0
        for _ in range(cfg.ppo_epochs):
            # one permutation of the GLOBAL batch, the same on every rank (same generator): each rank takes its
            # own rows of each global minibatch, so the minibatches are those of one rank holding every row
            order = torch.randperm(batch.input_ids.shape[0] * world_size, generator=generator)
            for mb_rows, n_micro in self.schedule(
                order, world_size, rank, cfg.ppo_minibatch_size, micro, cfg.group_size
            ):
                mb_rows = mb_rows.to(batch.input_ids.device)
                global_tokens = global_sum(trainer, batch.mask[mb_rows].sum().float())
                if not global_tokens:  # nothing to learn from on any rank: no step, the schedule advances
                    advance_schedule(sched)
                    continue
                denominator = (
                    global_tokens
                    if aggregation == "token_mean"
                    else self.minibatch_denominator(batch, mb_rows, aggregation)
                )
                opt.zero_grad()
                for m in range(n_micro):
                    mb = batch.micro_batch(mb_rows[m * micro : (m + 1) * micro])
                    tokens = mb.mask.sum().float()
                    mass = tokens if mb.token_weights is None else mb.token_weights[mb.mask].sum()
                    weight = world_size * mass / denominator
                    stats = self.micro_batch_backward(mb, weight, passes)
                    # the losses are logged with the loss's weights (their sum is the minibatch's loss,
                    # aggregated as configured), every other statistic with token weights: their mean over
                    # ranks is then the token mean over the global minibatch, as on one rank
                    token_weight = world_size * tokens / global_tokens
                    for key, value in stats.items():
                        w = weight if key in LOSS_KEYS else token_weight
                        sums[key] = sums.get(key, 0.0) + float(w) * float(value)
                if self.ptx_stream is not None:
                    sums[M.PPO_PTX_LOSS] = sums.get(M.PPO_PTX_LOSS, 0.0) + self.ptx_backward(
                        batch.input_ids.device
                    )
                n_steps += 1
                applied, grad_norm = self.optimizer_step(opt, sched, iteration)
                if applied:
                    n_applied += 1
                    grad_norms += float("nan") if grad_norm is None else grad_norm
        if not n_steps:
            return {}
        out = {k: v / n_steps for k, v in sums.items()}
        out[M.PPO_GRAD_NORM] = grad_norms / n_applied if n_applied else float("nan")
        out[M.PPO_SKIPPED_STEPS] = float(n_steps - n_applied)
        return out

    def minibatch_denominator(self, batch: UpdateBatch, rows: torch.Tensor, aggregation: str):
        """``D`` of the module docstring for this rank's ``rows`` of a global minibatch (a collective), for
        the aggregations other than ``token_mean`` (whose ``D`` is the global minibatch's update tokens): its
        responses with an update token (``seq_mean_token_mean``) or its responses x ``loss_norm_constant``
        (default ``max_new_tokens``; ``token_sum_norm``). At least 1."""
        trainer, mask = self.world(), batch.mask[rows]
        if aggregation == "seq_mean_token_mean":
            return global_sum(trainer, batch.token_weights[rows].sum()).clamp(min=1.0)
        constant = self.settings.loss_norm_constant or self.settings.max_new_tokens
        rows_total = global_sum(trainer, torch.tensor(float(rows.numel()), device=mask.device))
        return (rows_total * constant).clamp(min=1.0)

    def micro_batch_backward(
        self, mb: MicroBatch, weight: torch.Tensor, passes: tuple[tuple[str, ...], ...]
    ) -> dict[str, torch.Tensor]:
        """For each group of terms in ``passes``: the policy's forward for those terms, the objective's loss,
        and the backward of ``loss * weight``. ``passes`` is ``(("policy", "value"),)`` for one combined
        pass, ``(("policy",), ("value",))`` for the two-pass option. Returns the detached statistics."""
        cfg, stats = self.settings, {}
        for terms in passes:
            out = self.policy(
                mb.input_ids,
                mb.attention_mask,
                mb.prompt_len,
                cfg.temperature,
                chunk_size=cfg.logprob_chunk_size,
                entropy_grad=cfg.entropy_coef != 0,
                **self.objective.wants(terms),
            )
            loss, term_stats = self.objective.loss(out, mb, terms)
            self.backward(loss * weight)
            stats.update(term_stats)
            del out, loss  # the actor's outputs are not kept alive through the critic's forward
        return stats

    def ptx_backward(self, device) -> float:
        """Backward of ``ptx_coef`` times the next PTX batch's SFT loss through the actor (Ouyang et al. 2022,
        eq. 2); returns the loss."""
        batch = {k: v.to(device) for k, v in self.ptx_stream.next_batch().items() if torch.is_tensor(v)}
        lm = self.policy.lm
        with lm.adapter("actor"):
            hidden = lm.hidden_states(batch["input_ids"], batch["attention_mask"])
            loss, _ = sft_nll(lm.logits(hidden), batch["labels"])
        self.backward(self.ptx_coef * loss)
        return float(loss.detach())

    def optimizer_step(self, opt, sched, iteration: int = 0) -> tuple[bool, float | None]:
        """Clip, then step optimizer and schedule. Returns ``(applied, norm)``: the gradient norm before
        clipping (None under fp16 mixed precision, where Lightning clips). A step whose norm is inf / nan is
        skipped (``applied`` False): gradients dropped, no parameter, optimizer-state or learning-rate change
        (every rank sees the same global norm, so every rank skips together).

        Raises:
            NonFiniteError: after ``max_consecutive_skips`` skipped steps in a row.
        """
        grad_norm = self.clip(opt)
        if grad_norm is None or math.isfinite(grad_norm):
            self.consecutive_skips = 0
            opt.step()
            sched.step()
            return True, grad_norm
        opt.zero_grad()
        self.consecutive_skips += 1
        log.warning(
            "PPO iteration %d: optimizer step skipped, the global gradient norm is %s (%d in a row)",
            iteration + 1,
            grad_norm,
            self.consecutive_skips,
        )
        limit = self.settings.max_consecutive_skips
        if self.consecutive_skips >= limit:
            raise NonFiniteError(
                f"PPO stopped at iteration {iteration + 1}: {self.consecutive_skips} optimizer steps in a "
                f"row had a non-finite gradient norm ({grad_norm}), so none was applied "
                f"(ppo.max_consecutive_skips={limit}). The run has diverged: lower "
                "optimizer.lr, set ppo.max_grad_norm, or check the reward model's scores"
            )
        return False, grad_norm


def advance_schedule(sched) -> None:
    """A schedule step without an optimizer step (an empty minibatch), torch's warning about it silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        sched.step()


def clip_global_grad_norm(
    opt, max_grad_norm: float | None, precision: str, lightning_clip: Callable | None = None
) -> float | None:
    """Clip the global gradient norm over the optimizer's parameters; returns the norm before clipping
    (inf or nan when a gradient is), or None under fp16 mixed precision (``precision == "16-mixed"``),
    where ``lightning_clip`` (the LightningModule's ``clip_gradients``) clips and the GradScaler skips
    non-finite steps itself.

    Owned here (not Lightning's ``clip_gradients``) because Lightning's FSDP precision plugin refuses
    norm clipping; ``torch.nn.utils.clip_grad_norm_`` handles sharded (DTensor) parameters.
    """
    params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
    if not params:
        return 0.0
    if precision == "16-mixed":  # fp16 GradScaler: Lightning must unscale first
        lightning_clip(opt, gradient_clip_val=max_grad_norm, gradient_clip_algorithm="norm")
        return None
    max_norm = max_grad_norm if max_grad_norm is not None else float("inf")
    # With FSDP2 the gradients are DTensor shards: clip_grad_norm_ reduces the partial norms over the
    # ranks (the norm it returns is a DTensor), so the norm is the global one and every rank scales
    # its shard by the same factor. Under DDP the gradients are already averaged, the same on each rank.
    return grad_norm_value(torch.nn.utils.clip_grad_norm_(params, max_norm))
