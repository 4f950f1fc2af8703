"""The reward model PPO scores with has every dropout off, in every mode, with the modules in train mode.

The reward model here was trained with dropout on: LoRA dropout 0.3 and the tiny GPT-2's own dropout 0.1
(``disable_dropout: false``). Before the fix, the adapter mode and a separate reward model exported as an
adapter only kept that dropout, and identical calls scored differently (docs/pitfalls.md: dropout: dropout is switched
off by setting p = 0, not by ``eval()``, so gradient checkpointing keeps working).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForSequenceClassification

from rlhf_lit.models import ActorCritic, BackboneConfig, LoraSettings, RewardModelConfig, RewardSource
from rlhf_lit.models.backbone import load_backbone
from rlhf_lit.models.tokenizer import build_byte_tokenizer
from rlhf_lit.modules import RewardModule
from tests.conftest import TINY_GPT2
from tests.ppo.helpers import make_module

LORA = LoraSettings(r=4, alpha=8, dropout=0.3, target_modules=["c_attn", "c_fc"])
PROMPTS = ["\n\nHuman: What is 2 plus 3?\n\nAssistant:", "\n\nHuman: Name a colour.\n\nAssistant:"]
RESPONSES = [" It is 5.", " Blue, I think; or maybe green."]


def _reward_export(path, export_mode: str) -> str:
    module = RewardModule(
        BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", disable_dropout=False, lora=copy.deepcopy(LORA)),
        export_mode=export_mode,
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter (lora_B = 0 would make LoRA dropout invisible)
        for name, p in module.lm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3, generator=generator)
    module.export(str(path))
    return str(path)


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rm_dropout")
    classifier = root / "classifier"
    config = AutoConfig.for_model("gpt2", **{k: v for k, v in TINY_GPT2.items() if k != "model_type"})
    config.update({"vocab_size": 260, "pad_token_id": 1, "num_labels": 1})  # dropouts stay at GPT-2's 0.1
    AutoModelForSequenceClassification.from_config(config).save_pretrained(classifier)
    build_byte_tokenizer().save_pretrained(classifier)
    return {
        "merged": _reward_export(root / "merged", "auto"),
        "adapter_only": _reward_export(root / "adapter_only", "adapter"),
        "classifier": str(classifier),
    }


def _batch(tok):
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    responses = [tok(r)["input_ids"] + [tok.eos_token_id] for r in RESPONSES]
    P, R = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.tensor([[tok.pad_token_id] * (P - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    response_ids = torch.tensor([r + [tok.pad_token_id] * (R - len(r)) for r in responses])
    response_mask = torch.tensor([[True] * len(r) + [False] * (R - len(r)) for r in responses])
    return prompt_ids, prompt_mask, response_ids, response_mask


def _dropout_probabilities(module: nn.Module) -> list[float]:
    out = []
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            out.append(m.p)
        out += [v for k, v in vars(m).items() if "dropout" in k and isinstance(v, float)]
    return out


def _assert_deterministic_in_train_mode(source: RewardSource, scoring_path: nn.Module) -> None:
    source.train()
    scoring_path.train()
    assert all(m.training for m in scoring_path.modules())
    probabilities = _dropout_probabilities(scoring_path)
    assert probabilities and all(p == 0.0 for p in probabilities)
    batch = _batch(source.policy_tokenizer)
    first = source.score(*batch)
    for _ in range(3):
        assert torch.equal(source.score(*batch), first)
    assert first.shape == (2,) and torch.isfinite(first).all()


@pytest.mark.parametrize("kind", ["merged", "adapter_only", "classifier"])
def test_separate_reward_model_scores_identically_in_train_mode(exports, kind):
    source = RewardSource(RewardModelConfig(path=exports[kind]), build_byte_tokenizer())
    _assert_deterministic_in_train_mode(source, source.scorer)


def test_adapter_reward_model_scores_identically_in_train_mode(exports):
    tok = build_byte_tokenizer()
    policy_base = BackboneConfig(tiny=TINY_GPT2, tokenizer="byte")
    policy = ActorCritic(load_backbone(policy_base, tok), LoraSettings(r=4, target_modules=["c_attn"]), None)
    source = RewardSource(
        RewardModelConfig(path=exports["adapter_only"], mode="adapter"), tok, policy.lm, policy_base
    )
    # the reward adapter's LoRA dropout modules exist (p = 0 now): the check below covers them
    assert any("lora_dropout.reward" in name for name, _ in policy.lm.named_modules())
    _assert_deterministic_in_train_mode(source, policy.lm)


@pytest.mark.parametrize("mode", ["adapter", "separate"])
def test_ppo_module_reward_scores_are_deterministic(exports, mode):
    module = make_module(reward_model=RewardModelConfig(path=exports["adapter_only"], mode=mode))
    module.train()
    assert module.reward_source.same_tokenizer
    _assert_deterministic_in_train_mode(module.reward_source, module)
