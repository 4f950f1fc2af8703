"""The speed and memory changes must not change the algorithm: each is checked against the plain path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_lit.models import BackboneConfig, load_backbone
from rlhf_lit.models.tokenizer import build_byte_tokenizer
from rlhf_lit.models.trunk import fuse_gelu_tanh
from rlhf_lit.modules.common import OptimizerConfig, _fused_adamw_ok, build_optimizer
from rlhf_lit.rl.settings import PPOConfig
from tests.conftest import TINY_GPT2
from tests.ppo.helpers import make_data, make_module, make_trainer


def _trained_params(tmp_path, two_pass: bool, entropy_coef: float) -> tuple[dict, dict]:
    torch.manual_seed(0)
    module = make_module(
        ppo=PPOConfig(ppo_epochs=2, ppo_minibatch_size=2, entropy_coef=entropy_coef, total_iterations=2)
    )
    module.updater.settings.two_pass = two_pass
    initial = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    torch.manual_seed(123)
    make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=4))
    trained = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    return initial, trained


def test_sequential_actor_then_critic_backward_gives_the_combined_update(tmp_path):
    """Actor and critic adapters share no trainable parameter, so backward(policy) then backward(value)
    must equal backward(policy + vf_coef * value) -- after 2 iterations x 2 epochs x 2 minibatches."""
    for entropy_coef in (0.0, 0.01):  # without and with the entropy term in the loss
        initial, combined = _trained_params(tmp_path / f"one{entropy_coef}", False, entropy_coef)
        _, sequential = _trained_params(tmp_path / f"two{entropy_coef}", True, entropy_coef)
        moved = [n for n in initial if not torch.equal(combined[n], initial[n])]
        assert any("critic" in n for n in moved) and any("actor" in n for n in moved)
        assert any("value_head" in n for n in moved)
        for name in combined:
            torch.testing.assert_close(sequential[name], combined[name], atol=1e-6, rtol=1e-5)


def test_fused_gelu_swaps_every_gpt2_activation_and_keeps_the_outputs():
    tokenizer = build_byte_tokenizer()
    plain = load_backbone(
        BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", fused_activations=False), tokenizer
    )
    fused = load_backbone(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"), tokenizer)
    assert type(plain.transformer.h[0].mlp.act).__name__ == "NewGELUActivation"
    assert type(fused.transformer.h[0].mlp.act).__name__ == "GELUTanh"
    assert fuse_gelu_tanh(plain) == TINY_GPT2["n_layer"]  # one activation per block
    assert fuse_gelu_tanh(plain) == 0  # idempotent
    x = torch.linspace(-6, 6, 101)
    from transformers.activations import NewGELUActivation

    torch.testing.assert_close(
        fused.transformer.h[0].mlp.act(x), NewGELUActivation()(x), atol=1e-6, rtol=1e-6
    )
    ids = torch.tensor([[5, 9, 17, 33, 2, 8]])
    torch.testing.assert_close(plain(ids).logits, fused(ids).logits, atol=1e-5, rtol=1e-5)


def test_fused_adamw_is_used_for_plain_parameters_and_matches_the_loop():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(7, 5))
    assert _fused_adamw_ok([{"params": [w]}])
    assert not _fused_adamw_ok([{"params": []}])
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    fused = build_optimizer([{"params": [w]}], cfg)
    assert fused.defaults["fused"] is True
    w_ref = torch.nn.Parameter(w.detach().clone())
    loop = torch.optim.AdamW([w_ref], lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(3):
        grad = torch.full_like(w, 0.5) * (step + 1) - w.detach()
        w.grad, w_ref.grad = grad.clone(), grad.clone()
        fused.step()
        loop.step()
    assert not torch.equal(w_ref.detach(), torch.zeros_like(w_ref))
    torch.testing.assert_close(w.detach(), w_ref.detach(), atol=1e-6, rtol=1e-6)


def test_merged_adapter_samples_like_the_adapter_and_restores_the_base_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    module = make_module()
    lm = module.policy.lm
    with torch.no_grad():  # a non-zero actor adapter (LoRA B starts at 0)
        for p in lm.adapter_parameters("actor"):
            p.add_(0.05 * torch.randn_like(p))
    base = {
        n: p.detach().clone() for n, p in lm.model.get_base_model().named_parameters() if "lora_" not in n
    }
    ids = torch.tensor([[5, 9, 17, 33, 2, 8], [7, 7, 1, 40, 41, 42]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        with lm.adapter("actor"):
            expected = lm.logits(lm.hidden_states(ids, mask))
        with lm.merged("actor"):
            merged = lm.logits(lm.hidden_states(ids, mask))
        with lm.reference():
            reference = lm.logits(lm.hidden_states(ids, mask))
    assert (expected - reference).abs().max() > 1e-3  # the adapter matters
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)
    for n, p in lm.model.get_base_model().named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n  # exact, not merely close
    assert lm.active_adapter == "actor" and not any(
        getattr(m, "merged", False) for m in lm.model.modules() if hasattr(m, "merged_adapters")
    )


def test_a_run_that_samples_with_the_merged_adapter_keeps_the_reference_exact(tmp_path):
    torch.manual_seed(0)
    from rlhf_lit.rl.generation import SamplingConfig

    module = make_module(
        sampling=SamplingConfig(max_new_tokens=8, temperature=0.7, merge_adapter=True),
        ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=4, total_iterations=3),
    )
    base = {
        n: p.detach().clone()
        for n, p in module.policy.lm.model.get_base_model().named_parameters()
        if "lora_" not in n
    }
    make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=4))
    assert len(module.history) == 3
    assert module.history[0]["rollout/kl_ref"] == 0.0  # sampled from the merged actor = the base at step 0
    assert module.history[-1]["ppo/approx_kl"] < 1e-2
    for n, p in module.policy.lm.model.get_base_model().named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n


@pytest.mark.parametrize("config", ["configs/reward/tiny.yaml", "configs/sft/tiny.yaml"])
def test_bf16_mixed_with_gradient_clipping_trains_with_the_unfused_adamw(config, tmp_path):
    """Lightning's mixed-precision plugin refuses norm clipping with fused optimizers (they unscale
    gradients themselves), so under bf16-mixed AdamW must not be fused -- the SmolLM2 configs use both."""
    from rlhf_lit.cli import cli_main
    from tests.tiny_runs import in_repo_root, one_thread, tiny_overrides

    with in_repo_root(), one_thread():
        cli = cli_main(
            [
                "fit",
                "--config",
                config,
                *tiny_overrides(Path(config), tmp_path),
                "--trainer.precision=bf16-mixed",
                "--trainer.gradient_clip_val=1.0",
            ]
        )
    optimizer = cli.trainer.optimizers[0]
    assert not optimizer.defaults["fused"]
    assert cli.trainer.global_step == 2
