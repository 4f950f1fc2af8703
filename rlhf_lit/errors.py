"""The one exception type for user mistakes, which the ``rlhf-lit`` command prints as one line.

A :class:`UserError` is a mistake in what the user gave: a config key or value, a path, a data file. The
command prints its message (what is wrong, where, how to fix it) and exits with status 2, without a
traceback; ``RLHF_LIT_DEBUG=1`` or ``--debug`` shows the traceback too. Every other exception is an internal
error and keeps its traceback. Subclasses also derive from the builtin they refine (``ValueError``,
``FileNotFoundError``), so code that catches those still catches them.

No imports from the rest of the package: every layer may raise these.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DivergedExportError",
    "DivergedTrainingError",
    "NonFiniteError",
    "SamplerEngineError",
    "SamplerSyncError",
    "UserError",
]


class UserError(Exception):
    """A mistake in the user's config, paths or data; its message is what the user reads (one or two lines)."""


class ConfigError(UserError, ValueError):
    """A config key or value that cannot work: unknown, out of range, inconsistent, or a missing path."""


class NonFiniteError(FloatingPointError):
    """A PPO run met an inf or nan where it must not go on: a reward-model score, or a gradient norm that
    stayed non-finite for ``ppo.max_consecutive_skips`` optimizer steps in a row. Not a user mistake: the
    run has diverged or the reward model is broken, and the traceback is kept."""


class SamplerSyncError(UserError, RuntimeError):
    """With ``sampling.strict_sync: true``, the rollout-policy guard found that the sampler is not the policy
    being trained (``rlhf_lit.rl.guard``): its log-probs are further from the trainer's than
    ``sampling.logprob_gap_tolerance``, or the adapter weights that sampled are not the policy's. The user asked
    for a stop, so the message (iteration, gap, tolerance, what to check) is printed as one line."""


class SamplerEngineError(UserError, RuntimeError):
    """The rollout engine (``sampling.backend: vllm``, ``rlhf_lit.vllm_server``) is not reachable, refused a
    request or failed: at start (before any model loads) or mid-run (the run stops; its last checkpoint is
    intact). The message names the server's address and how to start it, printed as one line."""


class DivergedExportError(UserError, ValueError):
    """An export refused because weights hold inf or nan: the run diverged (often a learning rate too high for
    the model). Nothing was written; the message names the export folder and the first tensors, and the command
    prints it as one line (a stage's settings to change, not a bug to trace)."""


class DivergedTrainingError(UserError, FloatingPointError):
    """An SFT, reward or DPO run stopped because its gradients held inf or nan for
    ``rlhf_lit.modules.common.MAX_CONSECUTIVE_SKIPS`` optimizer steps in a row (none of them was applied, so the
    weights hold the last finite step's values). Most often a learning rate too high for the model: the
    command prints the message (step, loss, what to change) as one line."""
