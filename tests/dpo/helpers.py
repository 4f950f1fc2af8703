"""Tiny DPO / KTO runs for the preference-stage tests: a tiny GPT-2 with a LoRA adapter, short pairs."""

from __future__ import annotations

import copy
import json

import lightning as L
import torch
from torch.nn import functional as F

from rlhf_lit.data import PreferenceDataModule
from rlhf_lit.functional.sequence import position_ids_from_mask
from rlhf_lit.models import BackboneConfig, LoraSettings
from rlhf_lit.modules import DPOModule
from tests.conftest import TINY_GPT2

LORA = LoraSettings(r=4, alpha=8, target_modules=["c_attn", "c_fc"])


def write_pairs(path, n: int = 12) -> str:
    """``n`` explicit pairs of different lengths (so rows have different prompt and response lengths)."""
    with open(path, "w") as f:
        for i in range(n):
            row = {
                "prompt": f"Q{i}: say {'ab' * (i % 3 + 1)}",
                "chosen": f" {'ab' * (i % 3 + 1)}!",
                "rejected": f" no{'pe' * (i % 4)}",
            }
            f.write(json.dumps(row) + "\n")
    return str(path)


def write_unpaired(path, n: int = 10) -> str:
    """``n`` KTO-style rows, labels alternating (an odd count leaves the last batch uneven)."""
    with open(path, "w") as f:
        for i in range(n):
            row = {"prompt": f"Q{i}:", "completion": f" {'yes' if i % 2 == 0 else 'no'}{'!' * (i % 3)}"}
            f.write(json.dumps({**row, "label": i % 2 == 0}) + "\n")
    return str(path)


def make_module(backbone: BackboneConfig | None = None, **overrides) -> DPOModule:
    backbone = backbone or BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", lora=copy.deepcopy(LORA))
    return DPOModule(backbone=backbone, **{"beta": 0.5, **overrides})


def make_data(
    module: DPOModule, path: str, batch_size: int = 4, val_size: int = 4, **kw
) -> PreferenceDataModule:
    kw = {"max_length": 64, **kw}
    return PreferenceDataModule(
        train_files=[path], val_size=val_size, batch_size=batch_size, tokenizer=module.tokenizer, **kw
    )


def make_trainer(tmp_path, **kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


@torch.no_grad()
def plain_response_logps(model, ids, mask, prompt_len, response_len) -> torch.Tensor:
    """``(N,)`` summed response log-probs from a plain Hugging Face forward, row by row with a loop."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    logprobs = F.log_softmax(logits.float(), dim=-1)
    out = []
    for b in range(ids.shape[0]):
        p, r = int(prompt_len[b]), int(response_len[b])
        out.append(sum(float(logprobs[b, i - 1, ids[b, i]]) for i in range(p, p + r)))
    return torch.tensor(out)
