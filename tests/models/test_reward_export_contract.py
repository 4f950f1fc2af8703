"""The reward export's contract, as docs/exports.md states it, checked with plain transformers.

A user without rlhf_lit scores (prompt, response) with an exported reward model like this:

* text prompts: ``tokenizer(prompt)`` ids (BOS only if the tokenizer adds one itself), then
  ``tokenizer(response, add_special_tokens=False)`` ids of the response as it follows the prompt (with
  its leading space), then the EOS id;
* chat conversations: ``tokenizer.apply_chat_template(messages)`` ids, then the EOS id unless they end
  with it;
* the trunk's last hidden state at the last real token, through ``reward_head.safetensors``, divided by
  the ``temperature`` in ``rlhf_lit.json``.

The test builds exactly that from text and compares it with what the reward stage's own data module and
module score for the same rows: a training-time score that drifted from the documented contract fails here.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_lit.data import PreferenceDataModule
from rlhf_lit.models import BackboneConfig, load_reward_model
from rlhf_lit.modules import RewardModule
from tests.conftest import TINY_GPT2

TEXT_ROWS = [
    {"prompt": "Hello, how are", "chosen": " you?", "rejected": " they doing today?"},
    {"prompt": "Say a word:", "chosen": " word", "rejected": " nothing at all"},
]
CHAT_ROWS = [
    {
        "chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go away."}],
    },
    {
        "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5, surely"}],
    },
]


def _plain_ids(tokenizer, fmt: str, row: dict, side: str) -> list[int]:
    if fmt == "explicit":
        ids = tokenizer(row["prompt"])["input_ids"] + tokenizer(row[side], add_special_tokens=False)["input_ids"]
    else:
        ids = list(tokenizer.apply_chat_template(row[side], tokenize=True, return_dict=False))
    return ids if ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]


@pytest.mark.parametrize("fmt, rows", [("explicit", TEXT_ROWS), ("messages", CHAT_ROWS)])
def test_plain_transformers_scores_text_as_the_reward_stage_does(fmt, rows, tmp_path):
    module = RewardModule(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"))
    with torch.no_grad():
        module.head.linear.weight.normal_(std=0.5)
        module.temperature.fill_(1.7)
    module.eval()
    module.export(str(tmp_path / "rm"))
    data_file = tmp_path / "pairs.jsonl"
    data_file.write_text("\n".join(json.dumps(r) for r in rows))
    data = PreferenceDataModule(
        train_files=[str(data_file)], format=fmt, val_size=0, batch_size=len(rows), tokenizer=module.tokenizer
    )
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    with torch.no_grad():
        trained = module.score(batch["chosen_input_ids"], batch["chosen_attention_mask"])  # uncalibrated

    # what a user does with the export folder and transformers alone
    folder = tmp_path / "rm"
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    head = load_file(str(folder / "reward_head.safetensors"))
    temperature = json.loads((folder / "rlhf_lit.json").read_text())["temperature"]
    assert temperature == pytest.approx(1.7)
    by_hand = []
    for row in rows:
        ids = torch.tensor([_plain_ids(tokenizer, fmt, row, "chosen")])
        with torch.no_grad():
            hidden = model.base_model(input_ids=ids).last_hidden_state[0, -1]
        by_hand.append(float(hidden @ head["weight"][0] + head["bias"][0]))
    # the rows in the batch may be in another order: match them by their real ids
    got = {}
    for ids, mask, score in zip(batch["chosen_input_ids"], batch["chosen_attention_mask"], trained):
        got[tuple(ids[mask.bool()].tolist())] = float(score)
    for row, expected in zip(rows, by_hand):
        key = tuple(_plain_ids(tokenizer, fmt, row, "chosen"))
        assert key in got, "the data module built other ids than the documented contract"
        assert got[key] == pytest.approx(expected, abs=1e-5)
        # and rlhf_lit's own loader gives the calibrated score head(h_last) / T
        calibrated = load_reward_model(str(folder)).score(torch.tensor([list(key)]), torch.ones(1, len(key)))
        assert float(calibrated) == pytest.approx(expected / temperature, abs=1e-5)
