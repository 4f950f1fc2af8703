"""Gradient checkpointing on one base with several adapters: the gradients equal those without it.

The actor and critic adapters run through one base and are backpropagated together; a checkpointed layer is
recomputed during backward, and must be recomputed with the adapter its forward used, not the one active at
backward time. Same for a reference forward (adapters off) run between a policy forward and its backward.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_lit.models import BackboneConfig, LoraSettings, load_backbone
from rlhf_lit.models.policy import ActorCritic
from rlhf_lit.models.tokenizer import build_byte_tokenizer
from tests.conftest import TINY_GPT2, TINY_LLAMA


def _grads(tiny: dict, checkpointing: bool, shared_trunk: bool, with_reference: bool) -> dict[str, torch.Tensor]:
    tok = build_byte_tokenizer()
    torch.manual_seed(0)
    base = load_backbone(BackboneConfig(tiny=tiny, gradient_checkpointing=checkpointing), tok)
    lora = LoraSettings(r=4, alpha=8, target_modules="all-linear")
    torch.manual_seed(1)
    policy = ActorCritic(base, lora, None if shared_trunk else lora, True)
    with torch.no_grad():  # LoRA B starts at zero: move every adapter so each one changes the activations
        for p in policy.parameters():
            if p.requires_grad:
                p.normal_(std=0.05)
    policy.train()
    ids = torch.randint(3, 200, (3, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    out = policy(ids, mask, 5, 1.0, want_logprobs=True, want_values=True)
    loss = out.logprobs.sum() + out.values.pow(2).sum()
    if with_reference:  # adapters off between the forward and its backward (DPO without a reference cache)
        loss = loss + 0.0 * policy.reference_logprobs(ids, mask, 5, 1.0).sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tiny", [TINY_GPT2, TINY_LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("shared_trunk, with_reference", [(False, False), (False, True), (True, True)])
def test_actor_and_critic_gradients_are_the_same_with_checkpointing(tiny, shared_trunk, with_reference):
    plain = _grads(tiny, False, shared_trunk, with_reference)
    checkpointed = _grads(tiny, True, shared_trunk, with_reference)
    assert plain.keys() == checkpointed.keys()
    assert any(".critic." in n for n in plain) != shared_trunk  # both adapters were trained, or the one
    for name in plain:
        assert float(plain[name].abs().max()) > 0, name
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=1e-6, msg=name)
