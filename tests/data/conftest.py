"""Fixtures for the data tests: byte tokenizers and small files written into tmp_path."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from rlhf_lit.models.tokenizer import build_byte_tokenizer  # noqa: F401  (re-exported for tests)


@pytest.fixture(scope="session")
def tok():
    """Byte tokenizer: eos = bos = 0, pad = 1, <|im_start|> = 2, <|im_end|> = 3; never adds specials."""
    return build_byte_tokenizer()


@pytest.fixture(scope="session")
def tok_pad_eos():
    """Byte tokenizer with pad == eos == 0 (as GPT-2, Llama and SmolLM2 ship)."""
    return build_byte_tokenizer(pad_equals_eos=True)


@pytest.fixture(scope="session")
def tok_bos():
    """Byte tokenizer whose post-processor prepends BOS (id 0), like Llama's."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = build_byte_tokenizer()
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", 0)]
    )
    return tokenizer


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., str]:
    """``write_jsonl(rows, name="data.jsonl")`` writes one JSON value per line; returns the path."""

    def write(rows: list, name: str = "data.jsonl") -> str:
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return str(path)

    return write


def byte_ids(text: str) -> list[int]:
    """Ids of ``text`` under the byte tokenizer (4 specials first, then the 256 byte symbols)."""
    return build_byte_tokenizer()(text, add_special_tokens=False)["input_ids"]
