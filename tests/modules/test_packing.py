"""Padding-free packing (``packing: true``) gives the padded path's losses and gradients, SFT and reward.

Tiny GPT-2 and Llama models built from config, ragged rows (lengths 1..16, right and left padded). Stated
tolerance: 1e-5 absolute on losses and scores, 1e-4 relative on gradients (float32; the packed forward
sums in another order). A control shows the comparison can fail: the same bins with attention and positions
running across rows give another loss.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_lit.functional.losses import bt_pairwise_loss, sft_nll
from rlhf_lit.functional.packing import pack, pack_layout, packed_labels
from rlhf_lit.models import BackboneConfig
from rlhf_lit.modules import RewardModule, SFTModule
from tests.conftest import TINY_GPT2, TINY_LLAMA
from tests.tiny_runs import one_thread

MODELS = {"gpt2": TINY_GPT2, "llama": TINY_LLAMA}
TINY_BERT = {"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2}
LENGTHS = [9, 3, 14, 6, 11, 16, 1, 5]  # the longest (16) is the bin capacity; the others share bins


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _twins(cls, tiny: dict, **kwargs):
    """(padded, packed) modules of one class with the same weights."""
    torch.manual_seed(0)
    padded = cls(BackboneConfig(tiny=tiny, tokenizer="byte"), packing=False, **kwargs)
    packed = cls(BackboneConfig(tiny=tiny, tokenizer="byte"), packing=True, **kwargs)
    packed.load_state_dict(padded.state_dict())
    return padded, packed


def _ragged(lengths: list[int], width: int, side: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 250, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        if side == "right":
            mask[row, :n] = 1
        else:
            mask[row, width - n :] = 1
    return ids * mask, mask  # pad id 0


def _grads(module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad()
    return grads


def _assert_same_grads(packed: dict, padded: dict) -> None:
    assert packed.keys() == padded.keys() and len(padded) > 10
    for name, grad in padded.items():
        torch.testing.assert_close(packed[name], grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_sft_packed_loss_and_gradients_equal_the_padded_ones(model):
    padded, packed = _twins(SFTModule, MODELS[model])
    ids, mask = _ragged(LENGTHS, 16, "right", seed=1)
    labels = torch.where(mask.bool(), ids, -100)
    labels[:, :2] = -100  # a 2-token prompt; the 1-token row has no target at all
    labels[3] = torch.where(mask[3].bool(), ids[3], -100)  # no prompt: its first token follows row 0 in a bin
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    assert pack_layout(mask).source.shape == (5, 16)  # 16 | 14+1 | 11+5 | 9+6 | 3: rows share bins

    results = {}
    for name, module in (("padded", padded), ("packed", packed)):
        loss, num_tokens = module._loss(batch)
        loss.backward()
        results[name] = (loss.detach(), num_tokens, _grads(module))
    torch.testing.assert_close(results["packed"][0], results["padded"][0], atol=1e-5, rtol=0)
    # n - 2 targets per row, n - 1 in row 3 (nothing predicts a first token): 7 + 1 + 12 + 5 + 9 + 14 + 0 + 3
    assert int(results["packed"][1]) == int(results["padded"][1]) == 51
    _assert_same_grads(results["packed"][2], results["padded"][2])

    # control: the same bins with attention and positions running across rows give another loss
    layout = pack_layout(mask)
    with torch.no_grad():
        packed_ids = pack(ids, layout)
        hidden = packed.lm.hidden_states(packed_ids, torch.ones_like(packed_ids))
        leaky, _ = sft_nll(packed.lm.logits(hidden), packed_labels(labels, layout))
    assert abs(float(leaky) - float(results["padded"][0])) > 1e-3


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_reward_packed_scores_loss_and_gradients_equal_the_padded_ones(model, side):
    padded, packed = _twins(RewardModule, MODELS[model], head_init_std=1.0)
    ids, mask = _ragged(LENGTHS, 16, side, seed=2)
    half = len(LENGTHS) // 2  # chosen rows 0-3, rejected rows 4-7
    batch = {
        "chosen_input_ids": ids[:half],
        "chosen_attention_mask": mask[:half],
        "rejected_input_ids": ids[half:],
        "rejected_attention_mask": mask[half:],
    }
    results = {}
    for name, module in (("padded", padded), ("packed", packed)):
        chosen, rejected, hidden = module._score_pairs(batch, need_hidden=True)
        loss = bt_pairwise_loss(chosen, rejected).mean()  # Bradley-Terry, mean over the 4 pairs
        loss.backward()
        real_hidden = hidden.detach()[mask.bool()]  # (real tokens, H): what the heads and beta_rm read
        results[name] = (torch.cat([chosen, rejected]).detach(), loss.detach(), real_hidden, _grads(module))
    scores = results["padded"][0]
    assert scores.std() > 0.1  # distinct rewards, so a mix-up of rows would show
    torch.testing.assert_close(results["packed"][0], scores, atol=1e-5, rtol=0)
    torch.testing.assert_close(results["packed"][1], results["padded"][1], atol=1e-5, rtol=0)
    torch.testing.assert_close(results["packed"][2], results["padded"][2], atol=1e-5, rtol=1e-5)
    _assert_same_grads(results["packed"][3], results["padded"][3])


def test_reward_packing_is_refused_with_length_groups_or_an_encoder():
    with pytest.raises(ValueError, match="choose one"):
        RewardModule(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"), packing=True, length_groups=2)
    with pytest.raises(ValueError, match="an encoder has no packed path"):
        RewardModule(BackboneConfig(tiny=TINY_BERT, tokenizer="byte"), packing=True)


@pytest.mark.parametrize(
    "tiny, length_groups, expected",
    [(TINY_GPT2, 1, True), (TINY_LLAMA, 1, True), (TINY_GPT2, 4, False), (TINY_BERT, 1, False)],
    ids=["gpt2", "llama", "gpt2-length_groups", "bert"],
)
def test_reward_packing_by_default_where_the_model_has_a_packed_path(tiny, length_groups, expected):
    module = RewardModule(BackboneConfig(tiny=tiny, tokenizer="byte"), length_groups=length_groups)
    assert module.packing is expected


def test_sft_packs_by_default():
    assert SFTModule(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte")).packing is True
