"""Padding-free packing in PPO/GRPO (``packing: true``): the policy's forwards give the padded path's log-probs,
values, entropies, reference log-probs and gradients; a whole iteration logs the same statistics.

Rows as PPO lays them out: a left-padded prompt block (width P) followed by right-padded responses of ragged
lengths, some ending early. Compared at real response tokens only (padding is masked by every loss). Stated
tolerance (float32; the packed forward sums in another order): 1e-5 absolute on log-probs, values and
entropies, 1e-4 of each gradient's largest element. A control shows the comparison can fail: the same bins with position ids
running on across rows give other log-probs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf_lit.functional.packing import pack, pack_layout, unpack
from rlhf_lit.functional.sequence import response_positions
from rlhf_lit.models import BackboneConfig, LoraSettings
from rlhf_lit.models.backbone import load_backbone, load_backbone_tokenizer
from rlhf_lit.models.policy import ActorCritic
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.settings import PPOConfig
from tests.conftest import TINY_GPT2, TINY_LLAMA
from tests.ppo.helpers import make_data, make_module, make_trainer
from tests.tiny_runs import one_thread

MODELS = {"gpt2": (TINY_GPT2, ["c_attn", "c_fc"]), "llama": (TINY_LLAMA, ["q_proj", "v_proj", "up_proj"])}
PROMPTS = [5, 2, 7, 3, 1, 6]  # real prompt tokens per row, left padded to P = 7
RESPONSES = [9, 1, 4, 9, 6, 2]  # real response tokens per row, right padded to R = 9
P, R = 7, 9


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _rows(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, response_mask): ``(6, P + R)``, ``(6, P + R)``, ``(6, R)``."""
    ids = torch.randint(3, 250, (len(PROMPTS), P + R), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros_like(ids)
    for row, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        mask[row, P - p : P + r] = 1
    return ids * mask, mask, mask[:, P:].bool()


def _policy(model: str, critic: str, packing: bool) -> ActorCritic:
    """An ActorCritic on a tiny base, its adapters and value head randomised (seeded: twins are equal)."""
    tiny, targets = MODELS[model]
    lora = LoraSettings(r=4, alpha=8, target_modules=targets, dropout=0.0)
    cfg = BackboneConfig(tiny=tiny, tokenizer="byte", lora=lora)
    torch.manual_seed(0)
    base = load_backbone(cfg, load_backbone_tokenizer(cfg))
    critic_lora = copy.deepcopy(lora) if critic == "separate" else None
    policy = ActorCritic(base, lora, critic_lora, with_critic=critic != "none", packing=packing)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:  # LoRA B starts at 0 and the value head at 0: make them matter
                p.copy_(torch.randn_like(p) * 0.2)
    return policy


@pytest.mark.parametrize("critic", ["separate", "shared", "none"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_packed_policy_outputs_and_gradients_equal_the_padded_ones(model, critic):
    ids, mask, real = _rows()
    assert pack_layout(mask).source.shape[0] < len(PROMPTS)  # rows share bins: the packed path is exercised
    results = {}
    for packing in (False, True):
        policy = _policy(model, critic, packing)
        out = policy(ids, mask, P, temperature=0.7, want_entropy=True)
        ref = policy.reference_logprobs(ids, mask, P, temperature=0.7)
        loss = (out.logprobs * real).sum() + (out.entropy * real).sum()
        if out.values is not None:
            loss = loss + (out.values * real).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results[packing] = (out, ref, grads)
    (padded, padded_ref, padded_grads), (packed, packed_ref, packed_grads) = results[False], results[True]
    for field in ("logprobs", "entropy", "values"):
        a, b = getattr(padded, field), getattr(packed, field)
        assert (a is None) == (b is None) == (field == "values" and critic == "none")
        if a is not None:
            assert a.shape == b.shape == (len(PROMPTS), R)
            torch.testing.assert_close(b[real], a[real], atol=1e-5, rtol=0, msg=field)
    torch.testing.assert_close(packed_ref[real], padded_ref[real], atol=1e-5, rtol=0)
    assert not torch.allclose(padded.logprobs[real], padded_ref[real], atol=1e-3)  # the adapters act
    assert packed_grads.keys() == padded_grads.keys() and len(padded_grads) >= 4
    for name, grad in padded_grads.items():
        assert grad.abs().max() > 0, name
        assert (packed_grads[name] - grad).abs().max() <= 1e-4 * grad.abs().max(), name


def test_the_comparison_fails_when_positions_run_across_rows():
    """The control: pack the same rows but let each bin's position ids run 0 .. L - 1 (one long sequence, as if
    rows attended to each other): log-probs at real tokens move far beyond the tolerance."""
    ids, mask, real = _rows()
    policy = _policy("llama", "none", packing=False)
    padded = policy(ids, mask, P, temperature=0.7).logprobs
    layout = pack_layout(mask)
    running = torch.arange(layout.position_ids.shape[1]).expand_as(layout.position_ids)
    with policy.lm.adapter("actor"):
        hidden = unpack(policy.lm.hidden_states(pack(ids, layout), None, running), layout)
    leaked = policy._logprob_outputs(response_positions(hidden, P), ids[:, P:], 0.7, False, None)[0]
    assert (leaked[real] - padded[real]).abs().max() > 1e-2


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_a_packed_iteration_logs_what_the_padded_one_does(estimator, tmp_path):
    """One whole iteration (rollout, experience pass, two update epochs) of the tiny PPO and GRPO runs: every
    logged statistic but the timings and memory equal to the padded run's within 1e-4 (relative) -- the samples
    are the same (the sampler does not pack) and the update sees the same numbers to float rounding."""
    ppo = PPOConfig(ppo_epochs=2, ppo_minibatch_size=4, total_iterations=1, advantage_estimator=estimator)
    sampling = SamplingConfig(
        max_new_tokens=8, temperature=0.7, num_samples_per_prompt=2 if estimator == "grpo" else 1
    )
    histories = {}
    for packing in (False, True):
        torch.manual_seed(0)
        module = make_module(ppo=copy.deepcopy(ppo), sampling=copy.deepcopy(sampling), packing=packing)
        assert module.policy.packing is packing
        make_trainer(tmp_path / str(packing), max_steps=-1).fit(module, datamodule=make_data(module))
        histories[packing] = module.history
    padded, packed = histories[False], histories[True]
    assert len(padded) == len(packed) == 1
    keys = [
        k for k in padded[0] if isinstance(padded[0][k], float) and not k.startswith("perf/")
    ]  # not timings
    assert len(keys) > 10 and any("loss" in k for k in keys), keys
    for key in keys:
        assert packed[0][key] == pytest.approx(padded[0][key], rel=1e-4, abs=1e-6), key
