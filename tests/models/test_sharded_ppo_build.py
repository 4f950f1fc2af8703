"""PPO/GRPO built with the base's weights deferred (what ``rlhf-lit fit`` does under FSDP2): the policy's base
stays on the meta device through ``__init__`` (only the LoRA matrices and the value head are real) and
``configure_model`` reads it from the checkpoint; the policy then computes what the module loaded whole
computes. One process here (no mesh: ``configure_model`` fills the whole tensors); the sharded fill itself is
``fill_from_checkpoint``'s, tested on two ranks in ``tests/distributed``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf_lit.models import BackboneConfig, LoraSettings, RewardModelConfig
from rlhf_lit.models.sharded_load import deferred_weights
from rlhf_lit.modules import PPOModule
from rlhf_lit.rewards import RewardSourceConfig
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.settings import CriticConfig, PPOConfig
from tests.distributed import sharded_load as SL
from tests.tiny_runs import one_thread

LORA = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"])


def response_length(prompts, responses, fields):
    """A reward function: each response's length in characters."""
    return [float(len(r)) for r in responses]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    SL.save_base(folder)
    return folder


def _module(base, estimator: str, reward="function") -> PPOModule:
    rewards = {
        "function": [RewardSourceConfig(name="len", function=f"{__name__}:response_length")],
        "separate": RewardModelConfig(backbone=BackboneConfig(name_or_path=str(base), tokenizer="byte")),
    }[reward]
    torch.manual_seed(0)  # the LoRA and value-head initialisation: the same in every build
    return PPOModule(
        backbone=BackboneConfig(name_or_path=str(base), tokenizer="byte", lora=copy.deepcopy(LORA)),
        reward_model=rewards,
        sampling=SamplingConfig(max_new_tokens=4, num_samples_per_prompt=2 if estimator == "grpo" else 1),
        ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=2, total_iterations=1, advantage_estimator=estimator),
        critic=CriticConfig(lora=copy.deepcopy(LORA)),
        log_samples_every=0,
    )


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 250, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    return ids * mask, mask


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_the_base_waits_on_meta_for_configure_model_and_then_equals_whole_loading(base, estimator):
    with one_thread():
        whole = _module(base, estimator)
        with deferred_weights():
            deferred = _module(base, estimator)
        lm = deferred.policy.lm
        on_meta = [n for n, p in lm.named_parameters() if p.is_meta]
        real = [n for n, p in lm.named_parameters() if not p.is_meta]
        assert on_meta and all("lora_" not in n for n in on_meta)  # the base's weights: none read yet
        assert real and all("lora_" in n for n in real)  # the adapters are built for real
        assert all(not p.is_meta for p in lm.buffers())  # rotary frequencies computed
        assert not any(p.is_meta for p in whole.policy.parameters())
        deferred.configure_model()  # no mesh: the whole tensors are read
        assert not any(p.is_meta for p in deferred.policy.parameters())
        whole_state, deferred_state = whole.policy.state_dict(), deferred.policy.state_dict()
        assert whole_state.keys() == deferred_state.keys()
        for name, value in whole_state.items():
            if "lora_A" not in name:  # A is drawn on another path (B is zero: the same function)
                assert torch.equal(deferred_state[name], value), name
        ids, mask = _rows()
        with torch.no_grad():
            for module in (whole, deferred):  # make the adapters act, the same in both
                for name, p in module.policy.named_parameters():
                    if "lora_" in name:
                        p.copy_(torch.full_like(p, 0.01))
            outs = [m.policy(ids, mask, 5, temperature=1.0) for m in (whole, deferred)]
            refs = [m.policy.reference_logprobs(ids, mask, 5, temperature=1.0) for m in (whole, deferred)]
        torch.testing.assert_close(outs[1].logprobs, outs[0].logprobs, rtol=0, atol=0)
        torch.testing.assert_close(refs[1], refs[0], rtol=0, atol=0)
        if estimator == "gae":
            torch.testing.assert_close(outs[1].values, outs[0].values, rtol=0, atol=0)
        assert not torch.allclose(outs[0].logprobs, refs[0])  # the adapters act


def test_a_separate_reward_model_waits_too_and_then_scores_as_loaded_whole(base):
    """A separate reward model on a folder of safetensors (here an untrained head on the base) is built on meta
    beside the policy (its head is real) and read in ``configure_model``; it then scores as loaded whole."""
    with one_thread():
        whole = _module(base, "gae", reward="separate")
        with deferred_weights():
            deferred = _module(base, "gae", reward="separate")
        scorer = deferred.reward_source.scorer
        assert any(p.is_meta for p in deferred.policy.parameters())
        assert any(p.is_meta for p in scorer.lm.parameters()) and not any(
            p.is_meta for p in scorer.head.parameters()
        )
        deferred.configure_model()
        assert not any(p.is_meta for p in deferred.parameters())
        ids, mask = _rows()
        got, expected = scorer.score(ids, mask), whole.reward_source.scorer.score(ids, mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert expected.abs().max() > 0


def test_outside_fsdp2_nothing_waits(base):
    with one_thread():
        module = _module(base, "gae")
    assert not any(p.is_meta for p in module.policy.parameters())
    state = {k: v.clone() for k, v in module.policy.state_dict().items()}
    module.configure_model()  # no mesh, nothing deferred: a no-op
    assert all(torch.equal(v, state[k]) for k, v in module.policy.state_dict().items())


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_a_merged_reward_export_loads_on_meta_then_scores_as_loaded_whole(model, tmp_path):
    """``load_reward_model(..., deferred=True)`` on a merged causal-LM export: the backbone on meta (head real),
    ``checkpoint_files`` named; filled, it scores what the ordinary load scores, bit for bit (GPT-2 keeps its
    written GELU, as ``from_pretrained`` builds it)."""
    from rlhf_lit.models.export import load_reward_model
    from rlhf_lit.models.sharded_load import fill_from_checkpoint
    from rlhf_lit.modules import RewardModule
    from tests.conftest import TINY_GPT2, TINY_LLAMA

    tiny = {"gpt2": TINY_GPT2, "llama": TINY_LLAMA}[model]
    with one_thread():
        torch.manual_seed(0)
        module = RewardModule(BackboneConfig(tiny=tiny, tokenizer="byte"), export_mode="merged")
        with torch.no_grad():
            module.head.linear.weight.normal_()
        module.export(str(tmp_path / "rm"))
        whole = load_reward_model(str(tmp_path / "rm"))
        deferred = load_reward_model(str(tmp_path / "rm"), deferred=True)
        assert whole.checkpoint_files is None and deferred.checkpoint_files == [
            str(tmp_path / "rm" / "model.safetensors")
        ]
        assert all(p.is_meta for p in deferred.lm.parameters()) and not any(
            p.is_meta for p in deferred.head.parameters()
        )
        fill_from_checkpoint(deferred.lm, deferred.checkpoint_files)
        ids, mask = _rows()
        torch.testing.assert_close(deferred.score(ids, mask), whole.score(ids, mask), rtol=0, atol=0)


@pytest.mark.parametrize("listed", [False, True])
def test_a_reward_adapter_on_the_base_keeps_the_policy_loaded_whole(listed):
    """peft would load a reward adapter onto the meta base's device: with one (alone or in a ``reward_model``
    list) the policy's base is loaded whole even under FSDP2."""
    from rlhf_lit.rl.loading import reward_adapter_on_base

    adapter = RewardModelConfig(path="rm", mode="adapter")
    separate = RewardModelConfig(path="rm")
    if listed:
        fn = RewardSourceConfig(function=f"{__name__}:response_length")
        assert reward_adapter_on_base([fn, RewardSourceConfig(model={"path": "rm", "mode": "adapter"})])
        assert not reward_adapter_on_base([fn, RewardSourceConfig(model={"path": "rm"})])
    else:
        assert reward_adapter_on_base(adapter) and not reward_adapter_on_base(separate)
