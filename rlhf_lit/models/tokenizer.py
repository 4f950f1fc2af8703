"""Tokenizers: the offline byte-level tokenizer used by the tiny configs, and loading by spec.

A tokenizer spec is a string:

* ``"byte"`` — a byte-level tokenizer built in memory (no file, no download): 4 special tokens and the
  256 byte symbols, 260 ids in all. Ids: ``<|endoftext|>`` = 0 (EOS and BOS), ``<|pad|>`` = 1,
  ``<|im_start|>`` = 2, ``<|im_end|>`` = 3. It carries a ChatML chat template, so chat-formatted data
  works on the tiny models too. It never adds BOS/EOS by itself.
* ``"byte:pad=eos"`` — the same with the pad token equal to EOS (how GPT-2, Llama and SmolLM2 ship), for
  tests of the pad == eos cases.
* a local folder or a hub id, loaded with ``AutoTokenizer.from_pretrained``; with ``gguf_file`` the
  tokenizer is read from a GGUF file.
"""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

BYTE_SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_byte_tokenizer(pad_equals_eos: bool = False) -> PreTrainedTokenizerFast:
    """Build the offline byte-level tokenizer (260 ids) described in the module docstring.

    Args:
        pad_equals_eos: use ``<|endoftext|>`` (id 0) as the pad token, as GPT-2-style tokenizers do.

    Returns:
        A ``PreTrainedTokenizerFast`` that needs no file and gives the same ids on every machine.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(BYTE_SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>" if pad_equals_eos else "<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=4096,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def load_tokenizer(spec: str, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a spec (see the module docstring).

    Args:
        spec: ``"byte"``, ``"byte:pad=eos"``, a folder or a hub id.
        gguf_file: a GGUF file name inside ``spec`` (a folder) to read the tokenizer from.

    Returns:
        The tokenizer, with a pad token set (EOS is used when the tokenizer has none).

    Raises:
        ValueError: if the spec names neither the byte tokenizer nor a loadable tokenizer.
    """
    if spec in ("byte", "byte:pad=eos"):
        return build_byte_tokenizer(pad_equals_eos=spec.endswith("pad=eos"))
    if spec.startswith("byte"):
        raise ValueError(f"unknown byte tokenizer spec {spec!r}; use 'byte' or 'byte:pad=eos'")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tok = AutoTokenizer.from_pretrained(spec, **kwargs)
    except OSError as err:
        where = "folder" if os.path.isdir(spec) else "folder or hub id"
        raise ValueError(f"could not load a tokenizer from {where} {spec!r}: {err}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
