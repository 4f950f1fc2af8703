"""A weighted sum of reward sources: learned reward models and Python reward functions.

``reward_model`` in a PPO config is either one ``RewardModelConfig`` (a learned reward model, as before) or a
list of :class:`RewardSourceConfig` entries::

    reward_model:
      - {name: answer, function: rlhf_lit.rewards:gsm8k_answer_match, weight: 1.0}
      - {name: short, function: rlhf_lit.rewards:word_count_in_range, kwargs: {max_words: 120}, weight: 0.2}
      - {name: rm, model: {path: checkpoints/reward/smollm2}, weight: 0.5}

The score of a response is ``sum_k weight_k * score_k``; every source's own (unweighted) scores are kept
(:attr:`MixedReward.last_components`) and logged as ``rollout/score/<name>`` (``rlhf_lit.metrics``).
A function is called once per rollout with the batch's prompts, decoded responses and prompt-row fields
(``rlhf_lit.rewards.functions``) and must return one finite float per response: anything else raises an error
that names the function.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_lit.errors import NonFiniteError

__all__ = ["MixedReward", "RewardSourceConfig", "load_function"]


@dataclass
class RewardSourceConfig:
    """One weighted entry of a ``reward_model`` list.

    Args:
        name: the name its scores are logged under (``rollout/score/<name>``); default: the function's name, or
            ``model`` (``model_2``, ... for further models).
        weight: its weight in the sum.
        function: a Python reward function as ``module:function`` (e.g.
            ``rlhf_lit.rewards:instruction_constraints``), called as ``fn(prompts, responses, fields, **kwargs)``.
        kwargs: keyword arguments for ``function``.
        model: instead of ``function``, a learned reward model (the ``RewardModelConfig`` fields).
    """

    name: str | None = None
    weight: float = 1.0
    function: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.function is None) == (self.model is None):
            raise ValueError(
                f"reward_model entry {self.name or ''!r}: give exactly one of 'function' (module:function) "
                "and 'model' (a reward model config)"
            )
        if not math.isfinite(self.weight):
            raise ValueError(f"reward_model entry {self.name!r}: weight must be finite, got {self.weight}")


def load_function(spec: str) -> Callable:
    """The callable ``module:function`` names.

    Raises:
        ValueError: if the spec has no ``:``, the module does not import or has no such callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"reward function {spec!r}: expected 'module:function', e.g. rlhf_lit.rewards:valid_json"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward function {spec!r}: cannot import {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {module_name!r} has no callable {attr!r}")
    return fn


def _names(entries: list[RewardSourceConfig]) -> list[str]:
    names, models = [], 0
    for entry in entries:
        if entry.name:
            name = entry.name
        elif entry.function:
            name = entry.function.partition(":")[2]
        else:
            models += 1
            name = "model" if models == 1 else f"model_{models}"
        if name in names:
            raise ValueError(f"reward_model: two entries are named {name!r}; give each a distinct 'name'")
        names.append(name)
    return names


class MixedReward(torch.nn.Module):
    """``sum_k weight_k * score_k`` over the configured sources, with the same ``score`` call as
    ``RewardSource`` (``rollout.RewardFunction``).

    Args:
        entries: the ``reward_model`` list.
        policy_tokenizer: decodes the responses for the functions.
        build_model: ``RewardModelConfig dict -> RewardSource`` for the learned entries.

    Attributes:
        last_components: ``{name: (B,) float32}`` each source's unweighted scores of the last call.
        scorer: None (the learned sources are held in ``models``; FSDP2 does not shard them).
    """

    def __init__(self, entries: list[RewardSourceConfig], policy_tokenizer, build_model: Callable) -> None:
        super().__init__()
        self.names = _names(entries)
        self.weights = [float(e.weight) for e in entries]
        self.specs = [e.function or "model" for e in entries]
        self.kwargs = [dict(e.kwargs) for e in entries]
        self.functions = [load_function(e.function) if e.function else None for e in entries]
        self.models = torch.nn.ModuleDict(
            {name: build_model(e.model) for name, e in zip(self.names, entries) if e.model is not None}
        )
        self.policy_tokenizer = policy_tokenizer
        self.scorer = None
        self.reads_fields = True  # RolloutCollector passes the prompt rows' fields (``fields=``)
        self.last_components: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def score(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        has_stop: torch.Tensor | None = None,
        prompts: list[Any] | None = None,
        fields: list[dict] | None = None,
    ) -> torch.Tensor:
        """``(B,)`` float32 weighted scores; arguments as ``RewardSource.score``, plus ``fields``: the prompt
        rows' fields (``batch["fields"]`` of the prompt data module; default empty dicts).

        Raises:
            ValueError: a function returned a number of scores other than B, or something not a number.
            NonFiniteError: a function returned inf or nan (naming the function and the response).
        """
        B = response_ids.shape[0]
        texts = [
            self.policy_tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            for ids, mask in zip(response_ids, response_mask)
        ]
        prompts = list(prompts) if prompts is not None else [None] * B
        fields = [dict(f or {}) for f in fields] if fields is not None else [{} for _ in range(B)]
        total = torch.zeros(B, dtype=torch.float32, device=response_ids.device)
        self.last_components = {}
        for name, weight, spec, fn, kwargs in zip(
            self.names, self.weights, self.specs, self.functions, self.kwargs
        ):
            if fn is None:
                scores = (
                    self.models[name]
                    .score(prompt_ids, prompt_mask, response_ids, response_mask, has_stop, prompts)
                    .float()
                )
            else:
                scores = _checked(spec, fn(prompts, texts, fields, **kwargs), B).to(total.device)
            self.last_components[name] = scores
            total = total + weight * scores
        return total


def _checked(spec: str, values: Any, expected: int) -> torch.Tensor:
    """The function's return value as ``(B,)`` float32, or a clear error naming it."""
    try:
        scores = torch.as_tensor([float(v) for v in values], dtype=torch.float32)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"reward function {spec!r} must return one float per response; got {type(values).__name__} ({err})"
        ) from None
    if scores.numel() != expected:
        raise ValueError(
            f"reward function {spec!r} returned {scores.numel()} scores for {expected} responses (one per response)"
        )
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        raise NonFiniteError(
            f"reward function {spec!r} returned {float(scores[bad[0]])} for response {bad[0]} of the batch"
            + (f" and {len(bad) - 1} more non-finite scores" if len(bad) > 1 else "")
            + "; a reward function must return finite floats"
        )
    return scores
