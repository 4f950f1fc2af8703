"""Sampling responses with transformers ``generate``: left-padded prompts, KV cache, stop tokens.

Positions come from the attention mask inside ``generate`` (transformers derives ``position_ids`` from it
for left-padded batches), which matches ``position_ids_from_mask`` used by every scoring forward (pitfall: left padding).
Finished rows are padded with ``pad_token_id``; the real response is everything up to and including the
first stop token (``stop_mask``), never ``ids != pad`` (pad may equal EOS; pitfall: score token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from rlhf_lit.functional.sequence import truncate_after_stop
from rlhf_lit.ranges import check_field_ranges, ranged


@dataclass
class SamplingConfig:
    """How the policy samples responses during rollouts.

    Args:
        max_new_tokens: R, the most tokens a response may have.
        min_new_tokens: suppress the stop tokens until this many tokens were sampled.
        temperature: softmax temperature; the log-probs used by PPO are computed at the same temperature
            (docs/pitfalls.md: sampling temperature).
        top_k: keep the k most likely tokens (0 = off). PPO refuses it: its ratio and KL use the log-probs
            of the full softmax at ``temperature``, which are not those of a truncated distribution, so the
            rollout would be off-policy (docs/pitfalls.md: sampling temperature). For evaluation sampling only.
        top_p: nucleus sampling threshold (1.0 = off); refused by PPO like ``top_k``.
        stop_at_eos: stop a response at the tokenizer's EOS token.
        stop_token_ids: further token ids that end a response (e.g. ``<|im_end|>``).
        stop_strings: further tokens given as strings, converted with the tokenizer (each must be a single
            token).
        do_sample: sample (True) or decode greedily (False; evaluation only).
        merge_adapter: fold the actor's LoRA adapter into the base weights while sampling, then put the
            exact base weights back: one matmul per adapted layer and decoding step instead of three (faster
            decoding, most for small models). Costs a copy of the adapted base weights while sampling;
            ignored for a 4-bit base and under several processes. The log-probs PPO keeps are computed
            afterwards with the adapter unmerged, as always, so the sampled distribution differs from the
            trained one only by float rounding.
        num_samples_per_prompt: n responses sampled for each prompt of a rollout (a group; >= 2 for the
            group estimators ``grpo`` / ``rloo``). The rollout then holds prompts x n responses, the n of a
            prompt in consecutive rows on the rank that holds the prompt; ``ppo.ppo_minibatch_size`` counts
            responses. Validation samples one response per prompt.
    """

    max_new_tokens: int = ranged(48, "int >= 1")
    min_new_tokens: int = ranged(0, "int >= 0")
    temperature: float = ranged(1.0, "> 0")
    top_k: int = ranged(0, "int >= 0")
    top_p: float = ranged(1.0, "(0, 1]")
    stop_at_eos: bool = True
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    do_sample: bool = True
    merge_adapter: bool = False
    num_samples_per_prompt: int = ranged(1, "int >= 1")

    def __post_init__(self) -> None:
        check_field_ranges(self, "sampling.")  # the ranges declared above (ConfigError)


def resolve_stop_ids(cfg: SamplingConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids that end a response: EOS (if ``stop_at_eos``), ``stop_token_ids``, ``stop_strings``.

    Raises:
        ValueError: if a stop string is not exactly one token.
    """
    ids = list(cfg.stop_token_ids)
    if cfg.stop_at_eos and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    for text in cfg.stop_strings:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"stop string {text!r} is {len(encoded)} tokens {encoded}; it must be exactly one"
            )
        ids.append(int(encoded[0]))
    return sorted(set(ids))


@torch.no_grad()
def sample_responses(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cfg: SamplingConfig,
    stop_ids: list[int],
    pad_token_id: int,
    synced_gpus: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one response per left-padded prompt.

    Args:
        model: a causal LM (or peft model) with ``generate``.
        input_ids: ``(B, P)`` prompt ids, left padded.
        attention_mask: ``(B, P)``, 1 = real token.
        cfg: sampling settings.
        stop_ids: token ids that end a response (``resolve_stop_ids``); may be empty.
        pad_token_id: id written after a response's stop token.
        synced_gpus: keep stepping the forward until every rank has finished (FSDP; docs/pitfalls.md: FSDP generation).

    Returns:
        ``(response_ids (B, R), response_mask (B, R) bool, has_stop (B,) bool)`` with R <= max_new_tokens;
        the mask is True up to and including the first stop token, and tokens after it are ``pad_token_id``.
    """
    gen_cfg = GenerationConfig(
        do_sample=cfg.do_sample,
        max_new_tokens=cfg.max_new_tokens,
        min_new_tokens=cfg.min_new_tokens if stop_ids else 0,
        temperature=cfg.temperature if cfg.do_sample else None,
        top_k=cfg.top_k if cfg.do_sample else None,
        top_p=cfg.top_p if cfg.do_sample else None,
        eos_token_id=list(stop_ids),
        pad_token_id=pad_token_id,
        use_cache=True,
    )
    was_training = model.training
    # eval() only for the KV cache (transformers refuses the cache under gradient checkpointing in train
    # mode); dropout is already 0, so this changes no number.
    model.eval()
    try:
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=gen_cfg,
            synced_gpus=synced_gpus,
        )
    finally:
        model.train(was_training)
    response = sequences[:, input_ids.shape[1] :]
    if not stop_ids:
        mask = torch.ones_like(response, dtype=torch.bool)
        return response, mask, torch.zeros(response.shape[0], dtype=torch.bool, device=response.device)
    return truncate_after_stop(response, stop_ids, pad_token_id)
