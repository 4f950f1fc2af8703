"""Tokenisation of canonical records: exact prompt/response boundaries, EOS, left truncation, skips.

Rules, the same in every stage:

1. Prompt and response are encoded SEPARATELY and concatenated, so the boundary is exact (docs/pitfalls.md: SFT labels: a response template encoded alone can tokenize differently than in context). The response is
   encoded with ``add_special_tokens=False``. A plain-text prompt gets the tokenizer's BOS only if the
   tokenizer adds one by itself and the text does not already start with it; a chat-template rendering
   is encoded with ``add_special_tokens=False`` (the template already wrote any BOS).
2. EOS is appended to every response unless it already ends with EOS (``append_eos``). For chat
   records the response is the template's text after the prompt (it ends with the end-of-turn text);
   whitespace the template writes after a final EOS is dropped so the response ends with EOS.
3. Truncation keeps responses WHOLE and cuts the PROMPT FROM THE LEFT (its oldest tokens; a leading
   BOS is kept): first to ``max_prompt_length``, then so that prompt + the longer response fits
   ``max_length``. If a response + EOS cannot fit with at least ``min_prompt_tokens`` prompt tokens
   the example is skipped as ``response_too_long``. This departs from right truncation, which can cut
   away exactly the tokens that tell chosen from rejected (docs/pitfalls.md: degenerate pairs); a pair that is still
   token-identical is skipped as ``identical_pair``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlhf_lit.data.records import SkipCounter
from rlhf_lit.errors import ConfigError

__all__ = ["Tokenization", "fit_prompt", "left_truncate"]


def left_truncate(ids: Sequence[int], length: int, keep_first: bool = False) -> list[int]:
    """Keep the last ``length`` ids (and the first id too when ``keep_first``, e.g. a BOS).

    Example: ``left_truncate([9, 1, 2, 3, 4], 3, keep_first=True) == [9, 3, 4]``.
    """
    if len(ids) <= length:
        return list(ids)
    if length <= 0:
        return []
    if keep_first:
        return [ids[0]] + list(ids[len(ids) - (length - 1) :]) if length > 1 else [ids[0]]
    return list(ids[len(ids) - length :])


def fit_prompt(
    prompt_ids: Sequence[int],
    response_lengths: Sequence[int],
    max_length: int,
    max_prompt_length: int | None = None,
    min_prompt_tokens: int = 1,
    keep_first: bool = False,
) -> list[int] | None:
    """Cut a prompt from the left so that it plus the LONGEST response fits ``max_length``.

    Args:
        prompt_ids: prompt token ids, length P.
        response_lengths: lengths of the responses that follow this prompt (incl. EOS); one for SFT,
            two for a preference pair.
        max_length: the largest P + R allowed.
        max_prompt_length: cut the prompt to this many tokens first (None: no separate limit).
        min_prompt_tokens: the fewest prompt tokens a kept example has (fewer if the prompt is shorter).
        keep_first: keep the prompt's first token (a BOS) when cutting.

    Returns:
        The (possibly cut) prompt ids, or None when the longest response leaves too little room.

    Example (docs/pitfalls.md: degenerate pairs): prompt ``[11..16]``, responses of 3 tokens, ``max_length=8`` gives
    ``[12, 13, 14, 15, 16]``, so chosen ``[..., 21, 22, 23]`` and rejected ``[..., 21, 22, 24]`` differ.
    """
    budget = max_length - max(response_lengths, default=0)
    if max_prompt_length is not None:
        budget = min(budget, max_prompt_length)
    if budget < min(min_prompt_tokens, len(prompt_ids)) or budget < 0:
        return None
    return left_truncate(prompt_ids, budget, keep_first)


class Tokenization:
    """Applies the module's rules to canonical records of one split.

    Args:
        tokenizer: a ``transformers`` tokenizer (with a pad token and, if ``append_eos``, an EOS token).
        max_length: the longest prompt + response, in tokens.
        max_prompt_length: cut prompts to at most this many tokens first.
        min_prompt_tokens: the fewest prompt tokens a kept example may have.
        append_eos: append EOS to every response that does not already end with it.

    Raises:
        ValueError: if the tokenizer is None. ConfigError (a ValueError): if it lacks a pad/EOS token, or the
            lengths are inconsistent.
    """

    def __init__(
        self,
        tokenizer: Any,
        max_length: int = 512,
        max_prompt_length: int | None = None,
        min_prompt_tokens: int = 1,
        append_eos: bool = True,
    ) -> None:
        if tokenizer is None:
            raise ValueError("no tokenizer: pass `tokenizer=` to the DataModule (the CLI links the model's)")
        if tokenizer.pad_token_id is None:
            raise ConfigError(
                "the tokenizer has no pad token; set one (e.g. tokenizer.pad_token = tokenizer.eos_token)"
            )
        if append_eos and tokenizer.eos_token_id is None:
            raise ConfigError("append_eos=True but the tokenizer has no EOS token")
        if min_prompt_tokens < 0 or max_length <= min_prompt_tokens:
            raise ConfigError(
                f"need 0 <= min_prompt_tokens ({min_prompt_tokens}) < max_length ({max_length})"
            )
        if max_prompt_length is not None and max_prompt_length < max(min_prompt_tokens, 1):
            raise ConfigError(
                f"max_prompt_length ({max_prompt_length}) must be >= max(min_prompt_tokens, 1) ({min_prompt_tokens})"
            )
        self.tokenizer = tokenizer
        self.max_length, self.max_prompt_length = max_length, max_prompt_length
        self.min_prompt_tokens, self.append_eos = min_prompt_tokens, append_eos
        self.eos_id, self.bos_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        probe = tokenizer("a")["input_ids"]
        self.adds_bos = (
            self.bos_id is not None
            and len(probe) > 0
            and probe[0] == self.bos_id
            and tokenizer("a", add_special_tokens=False)["input_ids"][:1] != [self.bos_id]
        )

    # ---------------------------------------------------------------------------------- rendering
    def render(
        self, prompt: str | list[dict], response: str | dict | None = None
    ) -> tuple[str, str | None, bool]:
        """Texts for a record: ``(prompt_text, response_text, rendered)``.

        Chat records go through the chat template; ``response_text`` is None when the template's
        prompt rendering is not a prefix of the full rendering (``no_response_boundary``).
        """
        if isinstance(prompt, str):
            return (
                prompt,
                response if isinstance(response, str) or response is None else response["content"],
                False,
            )
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                "chat data (message lists, or chat_template=True) needs a tokenizer with a chat template; "
                f"{type(self.tokenizer).__name__} has none"
            )
        template = self.tokenizer.apply_chat_template
        prompt_text = template(prompt, tokenize=False, add_generation_prompt=True)
        if response is None:
            return prompt_text, None, True
        full = template(prompt + [response], tokenize=False)
        if not full.startswith(prompt_text):
            return prompt_text, None, True
        text = full[len(prompt_text) :]
        eos = self.tokenizer.eos_token
        if eos and text.rstrip().endswith(eos):
            text = text.rstrip()
        return prompt_text, text, True

    # ---------------------------------------------------------------------------------- encoding
    def _encode(self, texts: list[str]) -> list[list[int]]:
        return (
            list(self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]) if texts else []
        )

    def encode_prompts(self, texts: list[str], rendered: list[bool]) -> list[list[int]]:
        """Encode prompts; BOS is added to plain-text prompts as the tokenizer would (rule 1)."""
        ids = self._encode(texts)
        if self.adds_bos:
            bos_text = self.tokenizer.bos_token
            for i, (text, was_rendered) in enumerate(zip(texts, rendered)):
                if not was_rendered and not text.startswith(bos_text):
                    ids[i] = [self.bos_id] + ids[i]
        return ids

    def encode_responses(self, texts: list[str]) -> list[list[int]]:
        """Encode responses without specials and append EOS (rule 2)."""
        ids = self._encode(texts)
        if self.append_eos:
            ids = [x if x and x[-1] == self.eos_id else x + [self.eos_id] for x in ids]
        return ids

    def _fit(self, prompt_ids: list[int], lengths: Sequence[int]) -> list[int] | None:
        keep_first = bool(prompt_ids) and self.bos_id is not None and prompt_ids[0] == self.bos_id
        return fit_prompt(
            prompt_ids, lengths, self.max_length, self.max_prompt_length, self.min_prompt_tokens, keep_first
        )

    # ---------------------------------------------------------------------------------- stages
    def preference(self, records: list[dict], counter: SkipCounter, split: str) -> list[dict]:
        """Tokenise preference records into ``prompt_ids``/``chosen_ids``/``rejected_ids`` examples."""
        texts = []
        for rec in records:
            prompt, chosen, rendered = self.render(rec["prompt"], rec["chosen"])
            _, rejected, _ = self.render(rec["prompt"], rec["rejected"])
            if chosen is None or rejected is None:
                counter.count_skip(split, "no_response_boundary")
            else:
                texts.append((rec, prompt, chosen, rejected, rendered))
        prompts = self.encode_prompts([t[1] for t in texts], [t[4] for t in texts])
        chosen_ids = self.encode_responses([t[2] for t in texts])
        rejected_ids = self.encode_responses([t[3] for t in texts])
        out = []
        for (rec, *_), p, c, r in zip(texts, prompts, chosen_ids, rejected_ids):
            cut = self._fit(p, (len(c), len(r)))
            if cut is None:
                counter.count_skip(split, "response_too_long")
            elif c == r:
                counter.count_skip(split, "identical_pair")
            else:
                counter.count_truncated(split, int(len(cut) < len(p)))
                example = {
                    "prompt_ids": cut,
                    "chosen_ids": c,
                    "rejected_ids": r,
                    "margin": rec["margin"],
                    "source": rec["source"],
                    "row": rec["row"],
                }
                if "weight" in rec:
                    example["weight"] = rec["weight"]
                out.append(example)
        return out

    def sft(self, records: list[dict], counter: SkipCounter, split: str) -> list[dict]:
        """Tokenise SFT records into ``prompt_ids``/``response_ids`` examples."""
        texts = []
        for rec in records:
            prompt, response, rendered = self.render(rec["prompt"], rec["response"])
            if response is None:
                counter.count_skip(split, "no_response_boundary")
            else:
                texts.append((rec, prompt, response, rendered))
        prompts = self.encode_prompts([t[1] for t in texts], [t[3] for t in texts])
        responses = self.encode_responses([t[2] for t in texts])
        out = []
        for (rec, *_), p, r in zip(texts, prompts, responses):
            cut = self._fit(p, (len(r),))
            if cut is None:
                counter.count_skip(split, "response_too_long")
                continue
            counter.count_truncated(split, int(len(cut) < len(p)))
            example = {"prompt_ids": cut, "response_ids": r, "source": rec["source"], "row": rec["row"]}
            if "label" in rec:  # an unpaired (KTO-style) completion keeps its desirability label
                example["label"] = rec["label"]
            out.append(example)
        return out

    def prompts(self, records: list[dict], counter: SkipCounter, split: str) -> list[dict]:
        """Tokenise prompt records; prompts over ``max_prompt_length`` are cut from the left (counted
        as truncated, not skipped)."""
        rendered = [self.render(rec["prompt"]) for rec in records]
        ids = self.encode_prompts([r[0] for r in rendered], [r[2] for r in rendered])
        limit = self.max_prompt_length if self.max_prompt_length is not None else self.max_length
        out = []
        for rec, (text, _, _), p in zip(records, rendered, ids):
            keep_first = bool(p) and self.bos_id is not None and p[0] == self.bos_id
            cut = left_truncate(p, limit, keep_first)
            counter.count_truncated(split, int(len(cut) < len(p)))
            out.append(
                {
                    "prompt_ids": cut,
                    "prompt_text": text,
                    "prompt": rec["prompt"],
                    "reference": rec["reference"],
                    "source": rec["source"],
                    "row": rec["row"],
                    "fields": {**rec.get("fields", {}), "reference": rec["reference"]},
                }
            )
        return out
