"""Sampling from a separate copy of the policy (``sampling.copy_dtype``, ``rlhf_lit.rl.sampler.CopySampler``).

The copy holds the policy's weights with the actor adapter, and any frozen SFT adapter beneath it, merged in;
in float32 it samples what the policy samples, token for token; every update reaches it (``sync``), and a copy
that misses one is caught by the rollout-policy guard on every iteration after the first; a bf16 copy's gap
stays within its stated tolerance; impossible settings are refused.
"""

from __future__ import annotations

import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model

from rlhf_lit import metrics as M
from rlhf_lit.cli import cli_main
from rlhf_lit.errors import ConfigError, SamplerSyncError
from rlhf_lit.models import AdaptedLM, BackboneConfig, LoraSettings, load_backbone
from rlhf_lit.models.inference_copy import build_inference_copy, load_merged_weights
from rlhf_lit.modules.common import OptimizerConfig
from rlhf_lit.rl.generation import GAP_TOLERANCE, SamplingConfig
from rlhf_lit.rl.sampler import CopySampler, HFSampler, adapter_fingerprint, build_sampler
from rlhf_lit.rl.settings import PPOConfig, refuse_impossible_settings
from tests.conftest import TINY_GPT2, TINY_LLAMA
from tests.ppo.helpers import make_data, make_module, make_trainer
from tests.ppo.test_sampler_guard import FIRES, _guard_warnings, _run
from tests.tiny_runs import in_repo_root

ACTOR = {
    "gpt2": LoraSettings(r=4, alpha=8, target_modules=["c_attn", "c_fc", "c_proj"]),  # Conv1D: fan_in_fan_out
    "llama": LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]),
}


def _nudge(lm: AdaptedLM, seed: int) -> None:
    """A trained-looking adapter (lora_B starts at 0, which would merge to nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3, generator=generator)


def _adapted(arch: str, base_adapter: bool = False) -> AdaptedLM:
    torch.manual_seed(0)
    base = load_backbone(BackboneConfig(tiny=TINY_GPT2 if arch == "gpt2" else TINY_LLAMA, tokenizer="byte"))
    if base_adapter:  # an adapter-only SFT export: its adapter belongs to the base and stays on
        targets = ["c_attn"] if arch == "gpt2" else ["q_proj", "o_proj"]
        base = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=targets), adapter_name="sft")
    lm = AdaptedLM(base, {"actor": ACTOR[arch]})
    _nudge(lm, seed=1)
    return lm


class _Policy:
    """What a sampler reads of an ``ActorCritic``: its ``lm`` and the actor adapter's parameters."""

    def __init__(self, lm: AdaptedLM) -> None:
        self.lm = lm

    def actor_parameters(self):
        return self.lm.adapter_parameters("actor")


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 200, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0  # one left-padded row
    return ids, mask


@pytest.mark.parametrize("base_adapter", [False, True], ids=["actor", "sft+actor"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_float32_copy_computes_the_policys_logits(arch, base_adapter):
    lm = _adapted(arch, base_adapter)
    copy = build_inference_copy(lm, torch.float32)
    load_merged_weights(lm, "actor", copy)
    if copy.config.tie_word_embeddings:  # built on the meta device: the tie must survive materialising it
        assert copy.get_output_embeddings().weight is copy.get_input_embeddings().weight
    ids, mask = _prompts()
    with torch.no_grad(), lm.adapter("actor"):
        want = lm.logits(lm.hidden_states(ids, mask))
        bare = copy(input_ids=ids, attention_mask=mask).logits  # positions from the mask (transformers)
    got = copy(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=0)
    assert bare.shape == want.shape
    # the control: without the adapters the copy is the base, which the test tells apart
    with torch.no_grad(), lm.reference():
        base_logits = lm.logits(lm.hidden_states(ids, mask))
    assert (base_logits - want)[mask.bool()].abs().max() > 1e-2
    if base_adapter:  # and the frozen SFT adapter is in the copy, not only the actor
        with torch.no_grad():
            for name, p in lm.model.named_parameters():
                if ".sft." in name and "lora_B" in name:
                    p.zero_()
        load_merged_weights(lm, "actor", copy)
        without_sft = copy(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        )
        assert (without_sft.logits - got)[mask.bool()].abs().max() > 1e-2


def test_the_policy_is_untouched_and_a_sync_follows_the_adapter():
    lm = _adapted("gpt2")
    before = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    sampler = CopySampler(SamplingConfig(max_new_tokens=4, copy_dtype="float32"), [], 0)
    policy = _Policy(lm)
    ids, mask = _prompts()
    sampler.sample(policy, ids, mask)
    assert all(torch.equal(p, before[n]) for n, p in lm.model.named_parameters())
    first = sampler.last_record.fingerprint
    assert first == adapter_fingerprint(policy.actor_parameters())
    _nudge(lm, seed=3)  # an update
    sampler.sample(policy, ids, mask)
    assert sampler.last_record.fingerprint == first  # no sync yet: the copy is the old policy
    sampler.sync(policy)
    sampler.sample(policy, ids, mask)
    assert sampler.last_record.fingerprint == adapter_fingerprint(policy.actor_parameters()) != first


def test_a_float32_copy_draws_the_tokens_the_policy_draws():
    """Same seed: HFSampler on the policy and a float32 CopySampler give the same responses, and the
    log-probs each records agree."""
    lm = _adapted("llama")

    ids, mask = _prompts()
    out, records = {}, {}
    for name, cls in (("hf", HFSampler), ("copy", CopySampler)):
        sampler = cls(SamplingConfig(max_new_tokens=10, temperature=0.7, copy_dtype="float32"), [], 0)
        torch.manual_seed(5)
        out[name] = sampler.sample(_Policy(lm), ids, mask)
        records[name] = sampler.last_record.logprobs
    assert torch.equal(out["hf"][0], out["copy"][0]) and out["hf"][0].shape == (3, 10)
    torch.testing.assert_close(records["copy"], records["hf"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ppo_samples_from_a_copy_with_the_gap_within_its_tolerance(tmp_path, caplog, dtype):
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, copy_dtype=dtype)
    with caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        module = _run(tmp_path, lr=1e-2, sampling=sampling)  # a large lr: the actor moves every iteration
    assert isinstance(module.sampler, CopySampler) and module.sampler.copy.dtype == getattr(torch, dtype)
    gaps = [stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP] for stats in module.history]
    assert len(gaps) == 3
    if dtype == "float32":
        assert max(gaps) < 1e-5
    else:  # bf16 rounding is visible, within the stated tolerance
        assert 1e-4 < min(gaps) and max(gaps) < GAP_TOLERANCE["bfloat16"] == sampling.gap_tolerance()
    assert module.history[-1][M.ROLLOUT_KL_REF] != 0.0  # the actor moved: the copy kept up with it
    assert _guard_warnings(caplog) == []


def _tis_run(tmp_path, sampling, tis_cap):
    """Two PPO iterations with ``ppo.tis_cap``; the importance weights of every policy loss are recorded."""
    torch.manual_seed(0)
    ppo = PPOConfig(ppo_epochs=1, ppo_minibatch_size=4, total_iterations=2, tis_cap=tis_cap)
    module = make_module(ppo=ppo, optimizer=OptimizerConfig(lr=1e-2), sampling=sampling)
    seen, loss = [], module.objective.loss

    def recording(out, mb, terms):
        if "policy" in terms:
            seen.append((mb.is_weights, mb.mask))
        return loss(out, mb, terms)

    module.objective.loss = recording
    make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=4))
    return module, seen


def test_truncated_importance_sampling_weighs_the_tokens_of_a_bf16_copy(tmp_path):
    cap = 1.001  # bf16 rounding moves the weights by ~1e-3: some are capped
    bf16 = SamplingConfig(max_new_tokens=8, temperature=0.7, copy_dtype="bfloat16")
    module, seen = _tis_run(tmp_path / "bf16", bf16, cap)
    assert len(module.history) == 2 and len(seen) == 2  # 4 responses a rollout: one minibatch an iteration
    weights = torch.cat([w[m] for w, m in seen])
    assert weights.max() <= cap and (weights - 1).abs().max() > 1e-4  # bf16 rounding reaches the loss
    # the logged figures are those of the weights the loss used (one epoch: every update token once)
    for stats, (w, m) in zip(module.history, seen, strict=True):
        assert stats[M.ROLLOUT_TIS_WEIGHT] == pytest.approx(float(w[m].mean()), rel=1e-5)
        assert stats[M.ROLLOUT_TIS_CAPPED_FRAC] == pytest.approx(float((w[m] == cap).float().mean()), rel=1e-5)
    assert 0.0 < max(stats[M.ROLLOUT_TIS_CAPPED_FRAC] for stats in module.history) < 1.0
    # a float32 sampler is the trainer's policy: every weight is 1 up to float rounding
    module, seen = _tis_run(tmp_path / "fp32", SamplingConfig(max_new_tokens=8, temperature=0.7), 2.0)
    assert (torch.cat([w[m] for w, m in seen]) - 1).abs().max() < 1e-5
    assert module.history[0][M.ROLLOUT_TIS_CAPPED_FRAC] == 0.0
    # off by default: no weights, no metric
    module, seen = _tis_run(tmp_path / "off", SamplingConfig(max_new_tokens=8, temperature=0.7), None)
    assert all(w is None for w, _ in seen) and M.ROLLOUT_TIS_WEIGHT not in module.history[0]


def missed_sync_sampler(sampling, stop_ids, pad_token_id):
    """A copy that receives the first weights and never an update (the inference-engine failure)."""

    class MissedSync(CopySampler):
        def sync(self, policy):
            if self.copy is None:
                super().sync(policy)

    return MissedSync(sampling, stop_ids, pad_token_id)


def test_a_copy_that_misses_its_updates_is_caught_on_every_later_iteration(tmp_path, caplog):
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, copy_dtype="bfloat16")
    with caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        _run(tmp_path, lr=1e-2, sampling=sampling, sampler=missed_sync_sampler)
    warnings = _guard_warnings(caplog)
    assert [w.split(":")[0] for w in warnings] == ["PPO iteration 2", "PPO iteration 3"]
    assert all("the actor adapter weights that sampled are not the policy's" in w for w in warnings)
    strict = SamplingConfig(max_new_tokens=8, temperature=0.7, copy_dtype="bfloat16", strict_sync=True)
    with pytest.raises(SamplerSyncError, match="PPO iteration 2: " + FIRES):
        _run(tmp_path, lr=1e-2, sampling=strict, sampler=missed_sync_sampler)


def test_the_settings_of_a_copy():
    assert SamplingConfig().gap_tolerance() == 1e-3 == GAP_TOLERANCE["float32"]
    assert SamplingConfig(copy_dtype="float32").gap_tolerance() == 1e-3
    assert SamplingConfig(copy_dtype="bfloat16").gap_tolerance() == 0.1
    assert SamplingConfig(copy_dtype="bfloat16", logprob_gap_tolerance=0.02).gap_tolerance() == 0.02
    # a float32 copy checked against a bf16 trainer: the trainer's rounding sets the tolerance
    assert SamplingConfig(copy_dtype="float32").gap_tolerance("bfloat16") == 0.1
    assert SamplingConfig(logprob_gap_tolerance=0.02).gap_tolerance("bfloat16") == 0.02
    assert type(build_sampler(SamplingConfig(), [], 0)) is HFSampler
    assert type(build_sampler(SamplingConfig(copy_dtype="bfloat16"), [], 0)) is CopySampler
    with pytest.raises(ConfigError, match="sampling.copy_dtype cannot copy a 4-bit base"):
        refuse_impossible_settings(
            BackboneConfig(tiny=TINY_GPT2, load_in_4bit=True), SamplingConfig(copy_dtype="bfloat16")
        )
    refuse_impossible_settings(
        BackboneConfig(tiny=TINY_GPT2, load_in_4bit=True), SamplingConfig()
    )  # no copy: fine


def test_a_copy_under_fsdp_is_refused_from_the_config_before_any_process_starts(tmp_path):
    """The strategy is in the config: the refusal comes while the command line is checked (no model built, no
    process launched, so one line, not one per rank); ``configure_model`` refuses it too, for Python users."""
    args = ["--config", "configs/ppo/tiny.yaml", "--config", "configs/trainer/cpu_fsdp2.yaml"]
    args += [f"--trainer.default_root_dir={tmp_path}", "--model.init_args.sampling.copy_dtype=bfloat16"]
    with in_repo_root(), pytest.raises(ConfigError, match="^sampling.copy_dtype needs the whole weights"):
        cli_main(args, run=False)
