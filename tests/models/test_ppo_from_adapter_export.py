"""PPO seeded from an SFT export that holds only a LoRA adapter: the reference IS the SFT policy.

An SFT run exports merged weights plus ``adapter/``, or (``export_mode: adapter``, and always over a 4-bit
base: a QLoRA SFT) the adapter alone. Before, PPO pointed at such a folder silently dropped the adapter (or
could not load it): policy and reference were the raw base and the KL was 0 for the wrong reason. Now the
recorded base is loaded and the SFT adapter stays frozen and switched on beneath actor and critic and in
``reference()`` (``rlhf_lit.models.adapters``). The SFT policy is computed independently here with peft
(``PeftModel.from_pretrained(base, export/adapter)``) and a plain Hugging Face forward.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from peft import PeftModel

from rlhf_lit import metrics as M
from rlhf_lit.functional.sequence import position_ids_from_mask
from rlhf_lit.models import BackboneConfig, LoraSettings, RewardModelConfig, load_backbone, save_causal_lm
from rlhf_lit.models.backbone import base_adapter_source, load_backbone_tokenizer
from rlhf_lit.models.tokenizer import build_byte_tokenizer
from rlhf_lit.modules import SFTModule
from tests.conftest import TINY_GPT2
from tests.ppo.helpers import LORA, make_data, make_module, make_trainer

# n_embd 64: bitsandbytes' CPU kernel for 4-bit inference (used by generate, in eval mode) needs every
# quantized layer's input width to be a multiple of its block size, 64
TINY_4BIT = {**TINY_GPT2, "n_embd": 64}
SFT_LORA = LoraSettings(r=4, alpha=8, target_modules=["c_attn", "c_fc", "c_proj"])
TEMPERATURE = 0.7


def _sft_export(path, tiny: dict, load_in_4bit: bool, export_mode: str = "auto") -> str:
    """An SFT export whose adapter moves the policy clearly away from the base; written as SFTModule's
    ``on_fit_end`` writes it."""
    module = SFTModule(
        BackboneConfig(tiny=tiny, tokenizer="byte", load_in_4bit=load_in_4bit, lora=copy.deepcopy(SFT_LORA)),
        export_mode=export_mode,
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.lm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2, generator=generator)
    save_causal_lm(
        module.lm,
        module.tokenizer,
        str(path),
        module.backbone_cfg,
        export_mode,
        meta={"kind": "policy", "stage": "sft"},
    )
    return str(path)


def _sft_policy(export: str, tiny: dict, load_in_4bit: bool):
    """The SFT policy computed without rlhf_lit's adapter code: peft over a freshly loaded base."""
    base = load_backbone(BackboneConfig(tiny=tiny, tokenizer="byte", load_in_4bit=load_in_4bit))
    model = PeftModel.from_pretrained(base, os.path.join(export, "adapter"))
    model.train()  # dropout is 0; bitsandbytes' CPU inference kernel (eval mode) is not needed here
    return model


@torch.no_grad()
def _response_logprobs(model, input_ids, attention_mask, prompt_len: int) -> torch.Tensor:
    """``(B, R)`` log-probs of the response tokens at the sampling temperature, from a plain HF forward."""
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    ).logits.float()
    logprobs = torch.log_softmax(logits[:, prompt_len - 1 : -1] / TEMPERATURE, dim=-1)
    return logprobs.gather(-1, input_ids[:, prompt_len:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sft_exports")
    return {
        "adapter_only": _sft_export(root / "adapter_only", TINY_GPT2, False, export_mode="adapter"),
        "qlora": _sft_export(root / "qlora", TINY_4BIT, True),
    }


def test_qlora_and_adapter_mode_sft_exports_hold_only_an_adapter(exports):
    for export in exports.values():
        assert not os.path.exists(os.path.join(export, "config.json"))
        assert os.path.exists(os.path.join(export, "adapter", "adapter_config.json"))
        source = base_adapter_source(BackboneConfig(name_or_path=export))
        assert source is not None and source[1] == os.path.join(export, "adapter")
    with open(os.path.join(exports["qlora"], "rlhf_lit.json")) as f:
        assert json.load(f)["base"]["load_in_4bit"] is True


@pytest.mark.parametrize(
    ("kind", "tiny", "load_in_4bit"), [("adapter_only", TINY_GPT2, False), ("qlora", TINY_4BIT, True)]
)
def test_ppo_from_adapter_only_sft_starts_at_kl_zero_with_the_sft_policy_as_reference(
    exports, tmp_path, kind, tiny, load_in_4bit
):
    export = exports[kind]
    module = make_module(
        tokenizer=None,
        backbone=BackboneConfig(name_or_path=export, load_in_4bit=load_in_4bit, lora=copy.deepcopy(LORA)),
        reward_model=RewardModelConfig(backbone=BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", seed=1)),
    )
    assert module.policy.lm.base_adapters == ["base_0"]
    # only the actor and critic adapters and the value head train; the SFT adapter is frozen
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all(".actor." in n or ".critic." in n or "value_head" in n for n in trainable)
    assert any(".base_0." in n for n, _ in module.named_parameters())

    seen = {}
    forwards = module.collector.experience_forwards

    def spy(input_ids, attention_mask, prompt_len):
        seen["batch"] = (input_ids, attention_mask, prompt_len)
        seen["out"] = forwards(input_ids, attention_mask, prompt_len)
        return seen["out"]

    module.collector.experience_forwards = spy
    make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=4))

    input_ids, attention_mask, prompt_len = seen["batch"]
    ref_logprobs, old_logprobs, _ = seen["out"]
    mask = attention_mask[:, prompt_len:].bool()
    # KL 0 at step 0: the actor (lora_B = 0 on top of the SFT adapter) equals the reference exactly
    assert torch.equal(old_logprobs[mask], ref_logprobs[mask])
    assert module.history[0][M.ROLLOUT_KL_REF] == 0.0
    # ... and the reference is the SFT policy, not the raw base
    sft = _response_logprobs(_sft_policy(export, tiny, load_in_4bit), input_ids, attention_mask, prompt_len)
    torch.testing.assert_close(ref_logprobs[mask], sft[mask], rtol=1e-5, atol=1e-5)
    base = load_backbone(BackboneConfig(tiny=tiny, tokenizer="byte", load_in_4bit=load_in_4bit))
    raw = _response_logprobs(base, input_ids, attention_mask, prompt_len)
    assert (raw[mask] - sft[mask]).abs().max() > 0.05


def test_a_bare_adapter_folder_is_recognised_and_gives_the_same_policy(exports):
    export = exports["adapter_only"]
    ids = torch.tensor([[1, 1, 40, 41, 42, 43, 44, 45], [50, 51, 52, 53, 54, 55, 56, 57]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    expected = _response_logprobs(_sft_policy(export, TINY_GPT2, False), ids, mask, 4)
    for folder in (export, os.path.join(export, "adapter")):
        cfg = BackboneConfig(name_or_path=folder, lora=copy.deepcopy(LORA))
        assert len(load_backbone_tokenizer(cfg)) == len(build_byte_tokenizer())
        model = load_backbone(cfg)
        assert isinstance(model, PeftModel) and list(model.peft_config) == ["base_0"]
        torch.testing.assert_close(_response_logprobs(model, ids, mask, 4), expected)


def test_full_finetuning_from_an_adapter_only_export_merges_it(exports):
    """Without LoRA on a full-precision base the adapter is merged into the weights, which all train."""
    export = exports["adapter_only"]
    model = load_backbone(BackboneConfig(name_or_path=export))
    assert not isinstance(model, PeftModel)
    assert all(p.requires_grad for p in model.parameters())
    ids = torch.tensor([[40, 41, 42, 43, 44, 45]])
    mask = torch.ones_like(ids)
    expected = _response_logprobs(_sft_policy(export, TINY_GPT2, False), ids, mask, 2)
    torch.testing.assert_close(_response_logprobs(model, ids, mask, 2), expected, rtol=1e-5, atol=1e-5)


def test_incomplete_exports_and_unrooted_adapters_are_refused(tmp_path, exports):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "rlhf_lit.json").write_text(json.dumps({"format": "rlhf_lit", "base": {"tiny": TINY_GPT2}}))
    with pytest.raises(ValueError, match="neither merged weights"):
        load_backbone(BackboneConfig(name_or_path=str(broken)))
    # a peft folder on its own (no rlhf_lit.json beside it) whose config names no base model
    lonely = tmp_path / "lonely"
    model = PeftModel.from_pretrained(
        load_backbone(BackboneConfig(tiny=TINY_GPT2)), os.path.join(exports["adapter_only"], "adapter")
    )
    model.save_pretrained(str(lonely))
    with pytest.raises(ValueError, match="names no base model"):
        load_backbone(BackboneConfig(name_or_path=str(lonely), tokenizer="byte"))


def test_qlora_pipeline_reward_adapter_on_the_sft_adapter_scores_as_in_reward_training(exports, tmp_path):
    """SFT (QLoRA, adapter only) -> reward model trained on that export -> PPO with the reward model as an
    adapter on the same base: the reward adapter sits on the SFT adapter, as in reward training."""
    from rlhf_lit.modules import RewardModule

    export = exports["qlora"]
    rm = RewardModule(
        BackboneConfig(
            name_or_path=export, load_in_4bit=True, lora=LoraSettings(r=4, target_modules=["c_attn"])
        )
    )
    assert rm.lm.base_adapters == ["base_0"] and rm.lm.active_adapter == "default"
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in rm.lm.named_parameters():
            if "lora_B" in name and ".default." in name:
                p.normal_(std=0.3, generator=generator)
    rm.export(str(tmp_path / "rm"))
    assert not os.path.exists(tmp_path / "rm" / "config.json")  # 4-bit: adapter only

    module = make_module(
        tokenizer=None,
        backbone=BackboneConfig(name_or_path=export, load_in_4bit=True, lora=copy.deepcopy(LORA)),
        reward_model=RewardModelConfig(path=str(tmp_path / "rm"), mode="adapter"),
    )
    tok = module.tokenizer
    prompt = tok("\n\nHuman: Hi?\n\nAssistant:", return_tensors="pt")
    response = tok(" Hello there.", return_tensors="pt")
    ids = torch.cat([prompt["input_ids"], response["input_ids"]], 1)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = rm.score(ids, mask)
    got = module.reward_source.score(
        prompt["input_ids"],
        prompt["attention_mask"],
        response["input_ids"],
        response["attention_mask"].bool(),
    )
    torch.testing.assert_close(got, expected)
    with torch.no_grad(), rm.lm.reference():  # and the reward adapter does matter
        assert (rm.score(ids, mask) - expected).abs().max() > 1e-3
