"""docs/exports.md followed literally: its tested Python block, run as it stands, scores text with a reward
export and plain transformers exactly as the reward stage scored the same text in training, for a causal LM
and for encoders (the MiniLM recipe's response-only input, and prompt + response).

Each export is written at the end of a short ``fit`` of the reward stage (tiny models built from config; a
WordPiece tokenizer trained here for the encoder). Training's score of an example is the module's own
``score`` of the ids its data module built, divided by the exported temperature.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from rlhf_lit.data import PreferenceDataModule
from rlhf_lit.models import BackboneConfig
from rlhf_lit.modules import RewardModule
from rlhf_lit.modules.common import OptimizerConfig
from tests.conftest import REPO_ROOT, TINY_GPT2
from tests.models.encoders import wordpiece_folder
from tests.tiny_runs import one_thread

PAGE = REPO_ROOT / "docs" / "exports.md"
MARKER = "<!-- tested: tests/test_docs_exports.py -->"
TINY_BERT = {
    "model_type": "bert",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}
PROMPTS = [
    "\n\nHuman: How do I bake bread at home?\n\nAssistant:",
    "\n\nHuman: What is a good name for a cat?\n\nAssistant:",
    "\n\nHuman: Why is the sky blue?\n\nAssistant:",
]
GOOD = [
    " Mix flour, water, yeast and salt, let it rise, then bake it hot.",
    " Whiskers is a classic; Luna and Milo are popular too.",
    " Sunlight scatters off air molecules, and blue light scatters the most.",
]
BAD = [" No.", " I do not know.", " It just is."]


def page_block() -> str:
    """The Python block right after the page's ``tested`` marker, as a reader would copy it."""
    text = PAGE.read_text()
    assert MARKER in text, "docs/exports.md lost the marker of its tested code block"
    match = re.match(r"\s*```python\n(.*?)```", text.split(MARKER, 1)[1], re.S)
    assert match, "no ```python block follows the marker"
    return match.group(1)


def load_reward_export():
    namespace: dict = {}
    exec(compile(page_block(), str(PAGE), "exec"), namespace)
    return namespace["load_reward_export"]


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory) -> str:
    corpus = PROMPTS + GOOD + BAD + ["human assistant"] * 3
    return wordpiece_folder(tmp_path_factory.mktemp("wordpiece"), corpus)


def _rows(n: int) -> list[dict]:
    return [
        {"prompt": PROMPTS[i % 3], "chosen": GOOD[i % 3], "rejected": BAD[(i + i // 3) % 3]} for i in range(n)
    ]


def _export(backbone: BackboneConfig, pooling: str, max_prompt_length: int | None, root: Path):
    """Fit the reward stage for 3 steps (calibration included) and export; returns what the test needs."""
    L.seed_everything(0, verbose=False)
    module = RewardModule(
        backbone, optimizer=OptimizerConfig(lr=1e-3), pooling=pooling, export_dir=str(root / "hf")
    )
    rows = _rows(18)
    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = PreferenceDataModule(
        train_files=str(path),
        format="explicit",
        val_size=6,
        max_prompt_length=max_prompt_length,
        batch_size=4,
        tokenizer=module.tokenizer,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        default_root_dir=str(root),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=3,
    )
    trainer.fit(module, datamodule=data)
    module.eval()
    return SimpleNamespace(module=module, data=data, rows=rows, folder=str(root / "hf"))


@pytest.fixture(
    scope="module",
    params=[
        "causal_last_prompt",
        "encoder_mean_response_only",
        "encoder_mean_prompt",
        "encoder_first_prompt",
    ],
)
def export(request, wordpiece, tmp_path_factory) -> SimpleNamespace:
    kind, pooling, prompt = request.param.split("_", 2)
    max_prompt_length = 1 if prompt == "response_only" else None  # the MiniLM recipe drops the prompt
    if kind == "encoder":
        backbone = BackboneConfig(tiny=TINY_BERT, tokenizer=wordpiece)
    else:
        backbone = BackboneConfig(tiny={**TINY_GPT2, "n_positions": 256}, tokenizer="byte")
    out = _export(backbone, pooling, max_prompt_length, tmp_path_factory.mktemp(request.param))
    out.kind = kind
    return out


def _training_scores(export) -> list[tuple[dict, str, float]]:
    """(row, side, calibrated score) for every example the data module built, scored by the module."""
    temperature = json.loads((Path(export.folder) / "rlhf_lit.json").read_text())["temperature"]
    out = []
    examples = export.data.train_dataset.examples + export.data.val_dataset.examples
    for example in examples:
        for side in ("chosen", "rejected"):
            ids = example["prompt_ids"] + example[f"{side}_ids"]
            with torch.no_grad():
                raw = export.module.score(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
            out.append((export.rows[example["row"]], side, float(raw) / temperature))
    return out


def test_the_page_scores_text_as_the_reward_stage_did(export):
    score = load_reward_export()(export.folder)
    expected = _training_scores(export)
    got = [score(row["prompt"], row[side]) for row, side, _ in expected]
    torch.testing.assert_close(
        torch.tensor(got), torch.tensor([s for _, _, s in expected]), atol=1e-5, rtol=1e-5
    )
    assert len({round(s, 4) for _, _, s in expected}) > 2  # the scores differ: the comparison has teeth


def test_the_causal_recipe_followed_literally_on_an_encoder_export_scores_another_input(export):
    """What the page warns about: ``tokenizer(prompt)`` + response ids + EOS, read at the last token, is not
    what an encoder was trained on (an extra [SEP], the prompt kept, another position)."""
    if export.kind != "encoder":
        pytest.skip("the warning is about encoder exports")
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export.folder)
    trunk = AutoModel.from_pretrained(export.folder).eval()
    head = load_file(f"{export.folder}/reward_head.safetensors")
    temperature = json.loads((Path(export.folder) / "rlhf_lit.json").read_text())["temperature"]
    score = load_reward_export()(export.folder)
    differences = []
    for row, side, _ in _training_scores(export)[:6]:
        ids = tok(row["prompt"])["input_ids"] + tok(row[side], add_special_tokens=False)["input_ids"]
        ids = ids + [tok.eos_token_id]
        with torch.no_grad():
            last = trunk(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
            literal = float(last @ head["weight"][0] + head["bias"][0]) / temperature
        differences.append(abs(literal - score(row["prompt"], row[side])))
    assert min(differences) > 1e-4
