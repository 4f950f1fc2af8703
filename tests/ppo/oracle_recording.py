"""What the PPO oracles share to record one real iteration (``test_oracle.py``, ``test_oracle_critic_free.py``,
``test_oracle_schedule.py``, ``test_oracle_pg_family.py``): the set-up that moves the adapters off their zero
start, the recording schedule, and the recorders of the update's minibatches. Each recorder stands in for one of
the updater's collaborators and delegates to the real one: no production code is patched."""

from __future__ import annotations

import torch

from rlhf_lit.rl.schedule import epoch_schedule
from tests.ppo.helpers import RecordingUpdater

__all__ = ["RecordingObjective", "move_off_zero", "record_steps", "recording_schedule", "snapshot"]


def move_off_zero(module) -> None:
    """LoRA B and the value head start at 0: add ``0.3 * N(0, 1)`` (generator seeded 1) to every actor and critic
    LoRA matrix, then draw the value head's weight from ``N(0, 0.5)`` and set its bias to 0.3 (when the module has
    them), so the actor is not the reference (KL != 0) and the values vary."""
    lm = module.policy.lm
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in lm.adapter_parameters("actor") + lm.adapter_parameters("critic"):
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
        if module.policy.value_head is not None:
            module.policy.value_head.linear.weight.normal_(0.0, 0.5, generator=gen)
            module.policy.value_head.linear.bias.fill_(0.3)


def recording_schedule(rec: dict):
    """:func:`epoch_schedule`, keeping each epoch's ``[(rows, n_micro), ...]`` (rows cloned) in ``rec["epochs"]``;
    pass it as ``PPOModule(schedule=...)``."""

    def schedule(*args):
        out = epoch_schedule(*args)
        rec.setdefault("epochs", []).append([(rows.clone(), n_micro) for rows, n_micro in out])
        return out

    return schedule


class RecordingObjective:
    """Stands in for the updater's objective: delegates, and keeps each micro-batch's terms, update-token
    count and detached statistics in ``calls``."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def loss(self, out, mb, terms):
        loss, stats = self.inner.loss(out, mb, terms)
        self.calls.append({"terms": terms, "tokens": int(mb.mask.sum()), "stats": dict(stats)})
        return loss, stats

    def __getattr__(self, name):
        return getattr(self.inner, name)


def snapshot(batch):
    """A copy of an ``UpdateBatch`` whose tensors are clones."""
    return type(batch)(**{k: v.clone() if torch.is_tensor(v) else v for k, v in vars(batch).items()})


def record_steps(module, rec: dict):
    """Record every optimizer step of the module's updates into ``rec``: ``rec["batch"]``, a copy of the first
    update's input as it arrives (the update sets its token weights); per step, in ``rec["steps"]``, the loss
    back-propagated (the sum over its backward calls), the gradients before clipping, the parameters the step
    starts from, its micro-batches' statistics (:class:`RecordingObjective`) and the norm the clipping returned.
    Returns the real updater (``module.updater.inner``), its objective, backward and clip replaced."""
    module.updater = RecordingUpdater(module.updater, on_update=lambda b: rec.setdefault("batch", snapshot(b)))
    updater = module.updater.inner
    objective = RecordingObjective(updater.objective)
    updater.objective = objective
    real_backward, real_clip = updater.backward, updater.clip
    losses: list[float] = []
    steps = rec.setdefault("steps", [])

    def backward(loss, *args, **kwargs):
        losses.append(float(loss.detach()))
        return real_backward(loss, *args, **kwargs)

    def clip(opt):  # the end of a minibatch: its gradients (before clipping) and the step's start
        params = dict(module.named_parameters())
        steps.append(
            {
                "loss": sum(losses),
                "grads": {n: p.grad.clone() for n, p in params.items() if p.grad is not None},
                "params": {n: p.detach().clone() for n, p in params.items() if p.requires_grad},
                "micro": list(objective.calls),
            }
        )
        losses.clear()
        objective.calls.clear()
        norm = real_clip(opt)
        steps[-1]["norm"] = norm
        return norm

    updater.backward, updater.clip = backward, clip
    return updater
