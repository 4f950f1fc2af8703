"""DPO and KTO with ``packing`` give the padded path's losses, log-probs and gradients.

Tiny GPT-2 and Llama with a LoRA adapter (B randomised, so policy and reference differ), ragged rows
(sequence lengths 4..16, prompts 1..6 tokens), right padded as the data module pads them. Stated tolerance:
1e-5 absolute on losses and summed log-probs, 1e-4 relative on the adapter's gradients (float32; the packed
forward sums in another order). A control shows the comparison can fail: the same bins with attention running
across rows give other log-probs.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from rlhf_lit.data.collate import IGNORE_INDEX
from rlhf_lit.errors import ConfigError
from rlhf_lit.functional.packing import pack, pack_layout, unpack
from rlhf_lit.functional.preference import response_logps_from_hidden, response_scoring_mask
from rlhf_lit.models import BackboneConfig, LoraSettings
from rlhf_lit.models.trunk import trunk
from rlhf_lit.modules import DPOModule
from rlhf_lit.modules.dpo import sequences
from rlhf_lit.modules.dpo_reference import reference_numerics
from tests.conftest import TINY_GPT2, TINY_LLAMA
from tests.tiny_runs import one_thread

MODELS = {
    "gpt2": (TINY_GPT2, ["c_attn", "c_fc"]),
    "llama": (TINY_LLAMA, ["q_proj", "v_proj", "up_proj"]),
}
# (prompt, response) lengths: chosen rows 0-3, rejected rows 4-7 (pairs); KTO reads all 8 as completions
ROWS = [(3, 6), (1, 3), (6, 10), (2, 2), (5, 11), (2, 7), (4, 9), (1, 5)]
WIDTH = 16  # the longest row (5 + 11): the bin capacity


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _twins(model: str, **kwargs) -> tuple[DPOModule, DPOModule]:
    """(padded, packed) modules with the same weights, the adapter's B randomised."""
    tiny, targets = MODELS[model]
    modules = []
    for packing in (False, True):
        backbone = BackboneConfig(tiny=tiny, tokenizer="byte", lora=LoraSettings(r=4, alpha=8, target_modules=targets))
        torch.manual_seed(0)
        modules.append(DPOModule(backbone, beta=0.5, trim_padding=False, packing=packing, **kwargs))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in modules[0].lm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2, generator=generator)
    modules[1].load_state_dict(modules[0].state_dict())
    return modules[0], modules[1]


def _rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, prompt_len, response_len) of ROWS, right padded to WIDTH with pad id 0."""
    ids = torch.randint(3, 250, (len(ROWS), WIDTH), generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(len(ROWS), WIDTH, dtype=torch.long)
    for row, (p, r) in enumerate(ROWS):
        mask[row, : p + r] = 1
    prompt_len = torch.tensor([p for p, _ in ROWS])
    response_len = torch.tensor([r for _, r in ROWS])
    return ids * mask, mask, prompt_len, response_len


def _batch(loss_type: str) -> dict:
    ids, mask, prompt_len, response_len = _rows()
    if loss_type == "kto":
        response = F.pad(response_scoring_mask(prompt_len, response_len, WIDTH), (1, 0))  # the tokens themselves
        labels = torch.where(response, ids, IGNORE_INDEX)
        label = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0])
        return {"input_ids": ids, "attention_mask": mask, "prompt_len": prompt_len, "labels": labels, "label": label}
    n = len(ROWS) // 2
    # a pair shares its prompt length (the collator's rule); rejected rows take the chosen prompt's
    prompt_len = prompt_len[:n]
    rejected_total = (prompt_len + response_len[n:]).clamp(max=WIDTH)
    rejected_mask = (torch.arange(WIDTH)[None] < rejected_total[:, None]).long()
    return {
        "chosen_input_ids": ids[:n],
        "chosen_attention_mask": mask[:n],
        "rejected_input_ids": ids[n:] * rejected_mask,
        "rejected_attention_mask": rejected_mask,
        "prompt_len": prompt_len,
        "chosen_response_len": response_len[:n],
        "rejected_response_len": rejected_total - prompt_len,
    }


def _grads(module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("loss_type", ["sigmoid", "kto"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_packed_loss_log_probs_and_gradients_equal_the_padded_ones(model, loss_type):
    padded, packed = _twins(model, loss_type=loss_type)
    batch = _batch(loss_type)
    ids, mask, prompt_len, response_len = sequences(batch)
    assert pack_layout(mask).source.shape[0] < ids.shape[0]  # rows share bins
    results = {}
    for name, module in (("padded", padded), ("packed", packed)):
        module.train()
        loss, units = module._loss(batch, "train")
        loss.backward()
        grads = _grads(module)
        with torch.no_grad():
            policy = module.policy_logps(ids, mask, prompt_len, response_len)
            reference = module.run_reference(ids, mask, prompt_len, response_len)
        results[name] = (loss.detach(), units, policy, reference, grads)
    loss, units, policy, reference, grads = results["padded"]
    assert (policy - reference).abs().max() > 1e-2  # the adapter matters: a reference mix-up would show
    assert policy.std() > 1.0  # distinct rows: a mix-up of rows would show
    torch.testing.assert_close(results["packed"][0], loss, atol=1e-5, rtol=0)
    assert results["packed"][1] == units
    # chosen and rejected (KTO: every completion) summed log-probs, policy and reference
    torch.testing.assert_close(results["packed"][2], policy, atol=1e-5, rtol=0)
    torch.testing.assert_close(results["packed"][3], reference, atol=1e-5, rtol=0)
    assert grads.keys() == results["packed"][4].keys() and len(grads) >= 4
    assert all("lora_" in name for name in grads)
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(results["packed"][4][name], grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_comparison_fails_when_attention_leaks_across_rows(model):
    """Control: the same bins and restarting positions, but a mask of ones, so each token also attends to
    the rows before it in its bin: the log-probs of rows placed after another move by far more than 1e-5."""
    padded, _ = _twins(model)
    ids, mask, prompt_len, response_len = _rows()
    layout = pack_layout(mask)
    with torch.no_grad():
        expected = padded.policy_logps(ids, mask, prompt_len, response_len)
        packed_ids = pack(ids, layout)
        hidden = trunk(padded.lm.model)(
            input_ids=packed_ids, attention_mask=torch.ones_like(packed_ids), position_ids=layout.position_ids
        ).last_hidden_state
        leaky = response_logps_from_hidden(unpack(hidden, layout), padded.lm.logits, ids, prompt_len, response_len)
    openers = layout.source[:, 0] // WIDTH  # rows that open a bin see nothing before them: unchanged
    followers = torch.ones(len(ROWS), dtype=torch.bool).index_fill(0, openers, False)
    assert int(followers.sum()) >= 2
    torch.testing.assert_close(leaky[openers], expected[openers], atol=1e-5, rtol=0)
    assert ((leaky - expected)[followers].abs() > 1e-3).all()


def test_the_reference_cache_key_names_the_row_layout():
    """An unpacked run keeps the key it had before packing existed (its caches stay valid); packing adds a part."""
    assert reference_numerics("32-true", "trimmed") == {"precision": "32-true", "trim_padding": True}
    assert reference_numerics("32-true", "padded") == {"precision": "32-true", "trim_padding": False}
    assert reference_numerics("bf16-mixed", "packed") == {
        "precision": "bf16-mixed",
        "trim_padding": False,
        "packing": True,
    }


def test_packing_must_be_a_bool():
    backbone = BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", lora=LoraSettings(r=4, alpha=8))
    with pytest.raises(ConfigError, match="packing must be true or false"):
        DPOModule(backbone, packing="yes")
