"""The rollout-policy guard (rlhf_lit.rl.guard): the sampler is the policy being trained.

Its statistic by hand, the log-probs the sampler records while it draws, the adapter fingerprint; on tiny PPO
runs the gap is ~0 on every iteration (adapter merged or not), a planted stale sampler (a frozen copy of the
pre-update adapter) and a sampler that never received the adapter (adapters off) make it fire (a warning, or an
error with ``sampling.strict_sync``); and the merged-adapter path restores the base bit for bit over 10 cycles.
"""

from __future__ import annotations

import hashlib
import logging
import math

import pytest
import torch

from rlhf_lit import metrics as M
from rlhf_lit.errors import ConfigError, SamplerSyncError, UserError
from rlhf_lit.functional.sampler_gap import logprob_gap
from rlhf_lit.models import AdaptedLM, BackboneConfig, LoraSettings, load_backbone
from rlhf_lit.modules.common import OptimizerConfig
from rlhf_lit.rl.generation import (
    SampledLogprobs,
    SamplingConfig,
    bucket_length,
    compute_dtype,
    sample_responses,
)
from rlhf_lit.rl.sampler import HFSampler, adapter_fingerprint
from rlhf_lit.rl.settings import PPOConfig
from tests.conftest import TINY_GPT2
from tests.ppo.helpers import make_data, make_module, make_trainer

FIRES = "the sampler is not the policy being trained"


# ---------------------------------------------------------------------------------------------- the pieces
def test_logprob_gap_by_hand():
    sampler = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, float("-inf"), 0.0]])
    trainer = torch.tensor([[-1.5, -2.0, -9.0], [-0.4, -3.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    total, count, largest = logprob_gap(sampler, trainer, mask)
    # |-1 - -1.5| = 0.5, |-2 - -2| = 0, |-0.1 - -0.4| = 0.3; the masked -9 and -inf never enter
    assert float(count) == 3.0
    assert float(total) == pytest.approx(0.8)
    assert float(largest) == pytest.approx(0.5)
    total, count, largest = logprob_gap(sampler, trainer, torch.zeros_like(mask))  # nothing compared
    assert (float(total), float(count), float(largest)) == (0.0, 0.0, 0.0)


def test_sampled_logprobs_reads_each_drawn_token_under_the_warped_scores():
    recorder = SampledLogprobs(SamplingConfig(temperature=0.5))
    ln3 = math.log(3.0)
    # step 0 scores (0, ln 3) at T = 0.5 -> (0, 2 ln 3) -> probabilities (1/10, 9/10); token 1 is drawn
    assert torch.equal(recorder(torch.tensor([[7]]), torch.tensor([[0.0, ln3]])), torch.tensor([[0.0, ln3]]))
    # step 1 scores (ln 3, 0) -> probabilities (9/10, 1/10); token 0 is drawn, seen only by finish()
    recorder(torch.tensor([[7, 1]]), torch.tensor([[ln3, 0.0]]))
    logprobs = recorder.finish(torch.tensor([[1, 0]]))
    torch.testing.assert_close(logprobs, torch.tensor([[math.log(0.9), math.log(0.9)]]))
    # a recorder that saw fewer steps than the response has (generate ran other processors) reports nothing
    short = SampledLogprobs(SamplingConfig(temperature=0.5))
    short(torch.tensor([[7]]), torch.tensor([[0.0, ln3]]))
    assert short.finish(torch.tensor([[1, 0, 0]])) is None


def test_the_fingerprint_follows_every_change_of_the_weights():
    a, b = torch.arange(6.0).reshape(2, 3), torch.zeros(3, 2)
    first = adapter_fingerprint([a, b])
    assert adapter_fingerprint([a.clone(), b.clone()]) == first  # the same weights, the same digest
    nudged = b.clone()
    nudged[1, 0] = 1e-6  # one element moves (as after an optimizer step from lora_B = 0)
    assert adapter_fingerprint([a, nudged]) != first
    assert adapter_fingerprint([a.reshape(3, 2), b]) != first  # shapes count
    assert adapter_fingerprint([b, a]) != first  # and the order of the tensors
    # its blind spot: sums ignore the order of the elements inside a tensor (no optimizer step permutes them)
    assert adapter_fingerprint([a.flip(0), b]) == first


def test_the_tolerance_is_range_checked():
    with pytest.raises(ConfigError, match="sampling.logprob_gap_tolerance"):
        SamplingConfig(logprob_gap_tolerance=0.0)
    assert SamplingConfig().strict_sync is False


# ------------------------------------------------------------------------------------------- tiny PPO runs
def _run(tmp_path, iterations: int = 3, lr: float = 1e-5, **overrides):
    torch.manual_seed(0)
    ppo = PPOConfig(ppo_epochs=1, ppo_minibatch_size=4, total_iterations=iterations)
    module = make_module(ppo=ppo, optimizer=OptimizerConfig(lr=lr), **overrides)
    make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=4))
    return module


def _guard_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if FIRES in r.getMessage()]


@pytest.mark.parametrize(
    ("merge", "backend"),
    [(False, "hf"), (True, "hf"), (False, "static")],
    ids=["adapter", "merged", "static"],
)
def test_the_gap_is_zero_within_tolerance_on_every_iteration(tmp_path, caplog, merge, backend):
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, merge_adapter=merge, backend=backend)
    with caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        module = _run(tmp_path, lr=1e-2, sampling=sampling)  # a large lr: the actor moves every iteration
    assert len(module.history) == 3
    for stats in module.history:
        # float32 on CPU: ~2e-7 mean, ~1e-6 max (KV-cache decoding against one full forward)
        assert 0.0 <= stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP] < 1e-5 < sampling.gap_tolerance()
        assert stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP_MAX] < 1e-4
    assert (
        module.history[-1][M.ROLLOUT_KL_REF] != 0.0
    )  # the actor moved away from the base: the gap has teeth
    assert _guard_warnings(caplog) == []


def stale_sampler(sampling, stop_ids, pad_token_id):
    """A sampler that draws from a frozen copy of the adapter it first saw (the pre-update weights), like an
    inference engine that never receives the updates: it swaps the copy in around each ``sample``."""

    class Stale(HFSampler):
        frozen: list[torch.Tensor] | None = None

        def sample(self, policy, prompt_ids, prompt_mask, **kwargs):
            params = policy.actor_parameters()
            if self.frozen is None:
                self.frozen = [p.detach().clone() for p in params]
            live = [p.detach().clone() for p in params]
            with torch.no_grad():
                for p, old in zip(params, self.frozen):
                    p.copy_(old)
            try:
                return super().sample(policy, prompt_ids, prompt_mask, **kwargs)
            finally:
                with torch.no_grad():
                    for p, now in zip(params, live):
                        p.copy_(now)

    return Stale(sampling, stop_ids, pad_token_id)


def adapterless_sampler(sampling, stop_ids, pad_token_id):
    """A sampler that samples from the base with the adapter switched off (an adapter never delivered) while
    the adapter it reports is the live one: only the log-prob gap can see it."""

    class Adapterless(HFSampler):
        def sample(self, policy, prompt_ids, prompt_mask, **kwargs):
            with policy.lm.reference():
                return super().sample(policy, prompt_ids, prompt_mask, **kwargs)

    return Adapterless(sampling, stop_ids, pad_token_id)


@pytest.mark.parametrize("backend", ["hf", "static"])
def test_a_stale_sampler_makes_the_guard_warn(tmp_path, caplog, backend):
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, backend=backend)
    with caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        module = _run(tmp_path, lr=1e-2, sampling=sampling, sampler=stale_sampler)
    warnings = _guard_warnings(caplog)
    # iteration 1 samples the weights it trains (the copy is fresh); iterations 2 and 3 the stale copy
    assert [w.split(":")[0] for w in warnings] == ["PPO iteration 2", "PPO iteration 3"]
    assert all("the actor adapter weights that sampled are not the policy's" in w for w in warnings)
    assert all("sampling.logprob_gap_tolerance=0.001" in w for w in warnings)  # the gap fires too
    gaps = [stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP] for stats in module.history]
    assert gaps[0] < 1e-5 and min(gaps[1:]) > 1e-3


def test_a_stale_sampler_after_a_small_step_is_caught_by_the_fingerprint(tmp_path, caplog):
    """At lr 1e-5 one stale update moves the log-probs by ~2e-5 nats, under any tolerance float noise allows in
    bf16; the fingerprint still sees the weights differ."""
    with caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        module = _run(tmp_path, iterations=2, sampler=stale_sampler)
    assert module.history[1][M.ROLLOUT_SAMPLER_LOGPROB_GAP] < 1e-3
    (warning,) = _guard_warnings(caplog)
    assert warning.startswith("PPO iteration 2") and "not the policy's" in warning
    assert "logprob_gap_tolerance" not in warning


def test_strict_sync_stops_a_stale_sampler_with_a_one_line_error(tmp_path):
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, strict_sync=True)
    with pytest.raises(SamplerSyncError) as caught:
        _run(tmp_path, lr=1e-2, sampling=sampling, sampler=stale_sampler)
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and "\n" not in message  # printed as rlhf-lit: error: ...
    assert message.startswith("PPO iteration 2: " + FIRES)
    assert "nats per token" in message and "> sampling.logprob_gap_tolerance=0.001" in message


def test_a_sampler_without_the_adapter_is_caught_by_the_gap(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        module = _run(tmp_path, lr=1e-2, sampler=adapterless_sampler)
    warnings = _guard_warnings(caplog)
    assert [w.split(":")[0] for w in warnings] == ["PPO iteration 2", "PPO iteration 3"]
    assert all("not the policy's" not in w and "logprob_gap_tolerance" in w for w in warnings)
    assert module.history[0][M.ROLLOUT_SAMPLER_LOGPROB_GAP] < 1e-5  # the actor starts as the base
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, strict_sync=True)
    with pytest.raises(SamplerSyncError, match="PPO iteration 2: "):
        _run(tmp_path, lr=1e-2, sampling=sampling, sampler=adapterless_sampler)


def test_compute_dtype_by_hand():
    assert compute_dtype("32-true", "float32") == "float32"
    assert compute_dtype("bf16-mixed", "float32") == compute_dtype("bf16-true", "float32") == "bfloat16"
    assert compute_dtype("16-mixed", "float32") == "float16"
    assert compute_dtype(None, "bfloat16") == compute_dtype("32-true", "bfloat16") == "bfloat16"
    assert compute_dtype(None, "float16") == "float16"


@pytest.mark.parametrize(
    ("precision", "dtype", "tolerance", "expected"),
    [
        ("32-true", "float32", None, 1e-3),
        ("bf16-mixed", "float32", None, 0.1),
        ("32-true", "bfloat16", None, 0.1),
        ("bf16-mixed", "float32", 0.02, 0.02),
    ],
    ids=["fp32", "bf16-mixed", "bf16-weights", "set-by-user"],
)
def test_the_default_tolerance_follows_the_dtype_the_run_computes_in(tmp_path, precision, dtype, tolerance, expected):
    """16-bit forwards make the sampler's KV-cache decoding and the trainer's full forward round differently
    (SmolLM2-135M under bf16-mixed: 0.033 nats per token, far above float32's 1e-3), so the guard's default
    tolerance is resolved at each rollout from the trainer's precision and the weights' dtype; a set value is kept."""
    torch.manual_seed(0)
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.7, logprob_gap_tolerance=tolerance)
    module = make_module(
        backbone=BackboneConfig(
            tiny=TINY_GPT2, tokenizer="byte", dtype=dtype, lora=LoraSettings(r=4, alpha=8, target_modules=["c_attn"])
        ),
        sampling=sampling,
        ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=4, total_iterations=1),
    )
    trainer = make_trainer(tmp_path, precision=precision)
    trainer.fit(module, datamodule=make_data(module, batch_size=4))
    assert module.collector.settings.gap_tolerance(trainer.precision) == expected  # what the guard reads at rollout


# -------------------------------------------------------------------------------------------- the backends
def test_bucket_length_by_hand():
    assert [bucket_length(n) for n in (1, 16, 17, 31, 32, 33, 100)] == [16, 16, 32, 32, 32, 64, 128]
    assert bucket_length(5, minimum=4) == 8 and bucket_length(4, minimum=4) == 4


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_the_static_backend_draws_what_hf_draws(do_sample):
    """Same weights, same seed: the static cache (prompts padded from 11 to 16 tokens, masked) gives the hf
    backend's responses token for token, and the log-probs it records are the trainer's."""
    torch.manual_seed(0)
    base = load_backbone(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"))
    lm = AdaptedLM(base, {"actor": LoraSettings(r=4, alpha=8, target_modules=["c_attn", "c_fc"])})
    with torch.no_grad():  # a non-zero adapter, so the adapter's path is exercised
        for name, p in lm.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids = torch.randint(3, 200, (3, 11))
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0  # one left-padded row
    out, records = {}, {}
    for backend in ("hf", "static"):
        cfg = SamplingConfig(max_new_tokens=10, temperature=0.7, do_sample=do_sample, backend=backend)
        recorder = SampledLogprobs(cfg)
        torch.manual_seed(1)
        with lm.adapter("actor"):
            out[backend] = sample_responses(lm.model, ids, mask, cfg, [], 0, logprobs=recorder)
        records[backend] = recorder.finish(out[backend][0])
    assert torch.equal(out["hf"][0], out["static"][0]) and out["hf"][0].shape == (3, 10)
    torch.testing.assert_close(records["static"], records["hf"], atol=1e-5, rtol=0)


def test_the_lm_head_sees_contiguous_inputs_while_sampling_and_the_hook_is_removed():
    """generate slices the last hidden states for the LM head (a strided view); sample_responses hands the head
    a contiguous copy (a frozen 16-bit head on a CPU is slow on a strided input:
    generation.contiguous_head_inputs), with the same tokens, and leaves no hook behind."""
    torch.manual_seed(0)
    base = load_backbone(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte")).requires_grad_(False)
    lm = AdaptedLM(base, {"actor": LoraSettings(r=4, alpha=8, target_modules=["c_attn"])})
    head = lm.model.get_output_embeddings()
    seen: list[bool] = []
    watch = head.register_forward_hook(lambda module, args, output: seen.append(args[0].is_contiguous()))
    ids = torch.randint(3, 200, (3, 9))
    mask = torch.ones_like(ids)
    cfg = SamplingConfig(max_new_tokens=4, temperature=0.7)
    with lm.adapter("actor"):
        torch.manual_seed(1)
        plain = lm.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=True, temperature=0.7, top_k=0,
            pad_token_id=0, eos_token_id=[],
        )
        assert seen and not all(seen)  # without it, the prefill's slice is strided
        seen.clear()
        torch.manual_seed(1)
        response, _, _ = sample_responses(lm.model, ids, mask, cfg, [], 0)
    watch.remove()
    assert len(seen) == 4 and all(seen)
    assert torch.equal(response, plain[:, 9:])
    assert not head._forward_pre_hooks


# ------------------------------------------------------------------------------- the merged-adapter path
def _base_hash(lm: AdaptedLM) -> str:
    """sha256 of every base tensor's bytes (LoRA tensors excluded), by name."""
    digest = hashlib.sha256()
    for name, tensor in sorted(lm.model.get_base_model().state_dict().items()):
        if "lora_" not in name:
            digest.update(name.encode())
            digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _adapted(dtype: torch.dtype) -> AdaptedLM:
    base = load_backbone(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte")).to(dtype)
    lm = AdaptedLM(base, {"actor": LoraSettings(r=4, alpha=8, target_modules=["c_attn", "c_fc"])})
    with torch.no_grad():
        for p in lm.adapter_parameters("actor"):
            p.normal_(0.0, 0.3)  # a trained-looking adapter: merging moves every adapted weight
    return lm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merged_restores_the_base_bit_for_bit_over_ten_cycles(dtype):
    lm = _adapted(dtype)
    before = _base_hash(lm)
    ids = torch.tensor([[5, 6, 7, 8]])
    for _ in range(10):
        with lm.merged("actor"):
            assert _base_hash(lm) != before  # the adapter really is folded in
            lm.hidden_states(ids, torch.ones_like(ids))
    assert _base_hash(lm) == before
    # the control: merging and unmerging alone drifts the base (float rounding), so the hash has teeth
    for _ in range(10):
        lm.model.merge_adapter()
        lm.model.unmerge_adapter()
    assert _base_hash(lm) != before


def test_ten_merged_samples_leave_the_base_and_the_reference_unchanged():
    module = make_module(sampling=SamplingConfig(max_new_tokens=8, temperature=0.7, merge_adapter=True))
    lm = module.policy.lm
    with torch.no_grad():
        for p in module.policy.actor_parameters():
            p.normal_(0.0, 0.3)
    before = _base_hash(lm)
    prompt = torch.tensor([[0, 70, 71, 72], [73, 74, 75, 76]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    for _ in range(10):
        module.sampler.sample(module.policy, prompt, mask, merge=True)
        assert module.sampler.last_record.logprobs is not None
    assert _base_hash(lm) == before
