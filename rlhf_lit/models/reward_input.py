"""What a reward model with another encoding than the policy's is fed: the policy's prompt and response
rebuilt the way reward training built them (``rlhf_lit.models.reward_source``'s docstring says when and how).

``same_encoding`` decides whether the policy's ids can be scored as they are; ``RewardInputFormat`` is the
reward model's recorded ``input_format``; ``RewardInputBuilder`` renders and tokenizes each row.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from rlhf_lit.data.formats import chat_prompt
from rlhf_lit.data.records import ASSISTANT_MARK, HUMAN_MARK
from rlhf_lit.data.tokenize import Tokenization, left_truncate


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    return a is b or (len(a) == len(b) and a.get_vocab() == b.get_vocab())


def same_encoding(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """Whether two tokenizers turn the same conversation into the same ids.

    Same vocabulary, same chat template (a different template renders the same messages differently even
    over one vocabulary), same BOS and EOS ids, and the same special tokens added to plain text.
    """
    if a is b:
        return True
    probe = "Hello there"
    return (
        same_vocabulary(a, b)
        and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
        and (a.bos_token_id, a.eos_token_id) == (b.bos_token_id, b.eos_token_id)
        and a(probe)["input_ids"] == b(probe)["input_ids"]
    )


@dataclass
class RewardInputFormat:
    """How a reward model's training sequences were built (``input_format`` in its ``rlhf_lit.json``).

    Args:
        chat_template: text prompts were rendered as a chat with its tokenizer's chat template (message
            lists always are).
        append_eos: its EOS was appended to every response.
        max_length: the longest prompt + response in training, in its tokens (None: no limit recorded).
        max_prompt_length: prompts were cut to this many tokens first, from the left (None: no limit).
    """

    chat_template: bool = False
    append_eos: bool = True
    max_length: int | None = None
    max_prompt_length: int | None = None

    @classmethod
    def from_meta(cls, meta: dict | None) -> RewardInputFormat:
        """The format recorded in an export's metadata; the data modules' defaults where none is."""
        recorded = (meta or {}).get("input_format") or {}
        flags = {k: bool(v) for k, v in recorded.items() if k in ("chat_template", "append_eos")}
        limits = {
            k: int(v)
            for k, v in recorded.items()
            if k in ("max_length", "max_prompt_length") and v is not None
        }
        return cls(**flags, **limits)


def hh_transcript(messages: list[dict]) -> str:
    """Messages as the HH-RLHF transcript text they parse from (``rlhf_lit.data.records.parse_hh_messages``),
    ending with the assistant's turn marker: ``"\n\nHuman: hi\n\nAssistant: hello\n\nHuman: more?\n\nAssistant:"``.
    A system message's text leads the transcript."""
    parts = []
    for m in messages:
        content = str(m.get("content", "")).strip()
        if m["role"] == "system":
            parts.append(content)
        else:
            parts.append(f"{HUMAN_MARK if m['role'] == 'user' else ASSISTANT_MARK} {content}")
    return "".join(parts) + ASSISTANT_MARK


def _is_hh(text: str) -> bool:
    return HUMAN_MARK in text or ASSISTANT_MARK in text


class RewardInputBuilder:
    """Builds a reward model's input from a prompt and a response text, the way reward training did.

    Args:
        tokenizer: the reward model's tokenizer (with its chat template, if any).
        input_format: how its training sequences were built.
        max_positions: the reward model's position limit (its config's ``max_position_embeddings``); inputs
            are cut to it, to the tokenizer's ``model_max_length`` and to the recorded ``max_length``.

    The prompt is a string or a list of ``{"role", "content"}`` messages (a canonical record's prompt).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        input_format: RewardInputFormat,
        max_positions: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.input_format = input_format
        limits = [
            n for n in (tokenizer.model_max_length, max_positions, input_format.max_length) if n and n < 10**6
        ]
        self.max_length = int(min(limits)) if limits else None
        eos = input_format.append_eos and tokenizer.eos_token_id is not None
        length = self.max_length or 1 << 30
        self._with_eos = Tokenization(tokenizer, length, min_prompt_tokens=0, append_eos=eos)
        self._without_eos = Tokenization(tokenizer, length, min_prompt_tokens=0, append_eos=False)

    def renders_chat(self, prompt: str | list[dict]) -> bool:
        return not isinstance(prompt, str) or self.input_format.chat_template

    def texts(self, prompt: str | list[dict], response: str, stopped: bool) -> tuple[str, str, bool]:
        """``(prompt_text, response_text, rendered)``: what reward training would encode for this pair, the
        closing end-of-turn text left out of a response that did not stop."""
        tok = self._with_eos
        if not self.renders_chat(prompt):
            return prompt, response, False
        if not isinstance(prompt, str) and not getattr(self.tokenizer, "chat_template", None):
            # a reward model without a chat template (an encoder such as MiniLM) was trained on text: a chat
            # prompt becomes the HH transcript it came from, the response its assistant turn
            return hh_transcript(prompt), " " + response.strip(), False
        messages = list(prompt) if not isinstance(prompt, str) else chat_prompt(prompt, _is_hh(prompt))
        content = response.strip()  # chat contents are stripped, as in the data modules
        prompt_text, response_text, _ = tok.render(messages, {"role": "assistant", "content": content})
        if response_text is None:
            raise ValueError(
                "reward model: its chat template's rendering of the prompt is not a prefix of the rendering "
                "of prompt + response, so the response cannot be placed (no_response_boundary)"
            )
        if not stopped:  # the assistant turn as far as it goes: the template's text before the content
            marker = "\u2063rlhf_lit\u2063"
            _, probe, _ = tok.render(messages, {"role": "assistant", "content": marker})
            response_text = probe[: probe.rindex(marker)] + content
        return prompt_text, response_text, True

    def encode(self, prompt: str | list[dict], response: str, stopped: bool) -> list[int]:
        """The reward model's ids for one (prompt, response) pair.

        Args:
            prompt: the prompt as the data gave it.
            response: the response text, without its stop token.
            stopped: the response ended with a stop token (only then is EOS appended).

        Returns:
            Prompt ids + response ids, the prompt cut from the left (a leading BOS kept) to the recorded
            ``max_prompt_length`` and so that the whole fits ``max_length`` (module docstring); a response
            that alone exceeds ``max_length`` is cut from the left too.
        """
        prompt_text, response_text, rendered = self.texts(prompt, response, stopped)
        tok = self._with_eos if stopped else self._without_eos
        prompt_ids = tok.encode_prompts([prompt_text], [rendered])[0]
        response_ids = tok.encode_responses([response_text])[0]
        budget = self.max_length - len(response_ids) if self.max_length is not None else len(prompt_ids)
        if self.input_format.max_prompt_length is not None:
            budget = min(budget, self.input_format.max_prompt_length)
        bos = self.tokenizer.bos_token_id
        keep_first = bool(prompt_ids) and bos is not None and prompt_ids[0] == bos
        if budget >= 0:
            return left_truncate(prompt_ids, budget, keep_first) + response_ids
        return left_truncate(prompt_ids + response_ids, self.max_length, keep_first)
