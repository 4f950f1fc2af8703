"""Guards of the PPO run: non-finite scores and gradients never reach the weights or an export, and settings
under which the PPO ratio or KL would be wrong are refused before any model loads."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from safetensors.torch import load_file

import rlhf_lit.rl.loading as ppo_build
from rlhf_lit import metrics as M
from rlhf_lit.errors import NonFiniteError
from rlhf_lit.models import BackboneConfig
from rlhf_lit.models.export import save_causal_lm, save_reward_head
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.settings import PPOConfig, RewardShapingConfig
from tests.conftest import TINY_GPT2
from tests.ppo.helpers import LORA, RecordingReward, RecordingUpdater, make_data, make_module, make_trainer


def _score_with(module, index: int, value: float) -> None:
    """The module's own reward model, except that response ``index`` of every batch scores ``value``."""

    def replace(scores):
        scores = scores.clone()
        scores[index] = value
        return scores

    module.collector.reward_fn = RecordingReward(module.collector.reward_fn, replace)


def _spy_update(module) -> list[dict]:
    seen: list[dict] = []

    def record(batch):
        seen.append(
            {"mask": batch.mask.clone(), "advantages": batch.advantages.clone(), "returns": batch.returns.clone()}
        )

    module.updater = RecordingUpdater(module.updater, on_update=record)
    return seen


def _fit(module, tmp_path, iterations=None):
    trainer = make_trainer(tmp_path)
    trainer.fit(module, datamodule=make_data(module, batch_size=4))
    return trainer


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_score_stops_the_run_naming_the_response_and_the_reward_model(
    value, tmp_path
):
    # reward.clip would have turned +inf into +5, the best reward there is
    module = make_module(reward=RewardShapingConfig(clip=5.0), export_dir=str(tmp_path / "hf"))
    _score_with(module, 2, value)
    with pytest.raises(NonFiniteError) as error:
        _fit(module, tmp_path)
    message = str(error.value)
    assert "PPO iteration 1" in message and f"response 2 of the batch {value}" in message
    assert "reward_model.backbone" in message and "reward.skip_non_finite" in message
    assert "\n" not in message  # one line
    assert module.iteration == 0 and not os.path.exists(tmp_path / "hf")  # no update, no export


def test_skip_non_finite_drops_the_response_from_the_update_and_counts_it(tmp_path):
    module = make_module(
        reward=RewardShapingConfig(skip_non_finite=True, normalize=True, clip=5.0),
        ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=2, total_iterations=2),
        export_dir=str(tmp_path / "hf"),
    )
    _score_with(module, 1, float("inf"))
    seen = _spy_update(module)
    _fit(module, tmp_path)
    assert module.iteration == 2
    for update in seen:
        mask = update["mask"]
        assert not mask[1].any() and mask[[0, 2, 3]].any(dim=-1).all()  # row 1 has no token in the update
        assert torch.isfinite(update["advantages"]).all() and torch.isfinite(update["returns"]).all()
        assert (update["advantages"][1] == 0).all()  # whitened over the kept tokens only
    for h in module.history:
        assert h[M.ROLLOUT_NON_FINITE_SCORES] == 1.0
        assert torch.isfinite(
            torch.tensor([h[M.ROLLOUT_SCORE_MEAN], h[M.PPO_POLICY_LOSS], h[M.PPO_GRAD_NORM]])
        ).all()
    assert module.score_stats.count == 2 * 3  # 3 finite scores per iteration entered the normaliser
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_skip_non_finite_still_stops_when_every_score_is_non_finite(tmp_path):
    module = make_module(reward=RewardShapingConfig(skip_non_finite=True))
    module.collector.reward_fn = RecordingReward(module.collector.reward_fn, lambda s: torch.full((4,), float("nan")))
    with pytest.raises(NonFiniteError, match="every reward-model score of the batch is inf or nan"):
        _fit(module, tmp_path)


def _nan_gradients_on(module, steps: set[int]):
    """Make the value head's gradient NaN in the backward passes of the given optimizer steps (0-based)."""
    calls = {"step": 0}
    real_clip = module.updater.clip

    def clip(opt):
        norm = real_clip(opt)
        calls["step"] += 1
        return norm

    def hook(grad):
        return grad * float("nan") if calls["step"] in steps else grad

    module.policy.value_head.linear.weight.register_hook(hook)
    module.updater.clip = clip


def test_a_step_with_a_non_finite_gradient_norm_is_skipped_and_counted(tmp_path):
    torch.manual_seed(0)
    module = make_module(ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=2, total_iterations=2))
    _nan_gradients_on(module, {0})  # the first of 2 x 2 optimizer steps
    initial = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    trainer = _fit(module, tmp_path)
    assert [h[M.PPO_SKIPPED_STEPS] for h in module.history] == [1.0, 0.0]
    assert trainer.global_step == 3  # 4 minibatches, 3 optimizer steps
    assert module.updater.consecutive_skips == 0
    for n, p in module.named_parameters():
        if n in initial:
            assert torch.isfinite(p).all(), n
    assert any(not torch.equal(p, initial[n]) for n, p in module.named_parameters() if n in initial)
    for state in trainer.optimizers[0].state.values():
        assert torch.isfinite(state["exp_avg"]).all() and torch.isfinite(state["exp_avg_sq"]).all()
    assert all(torch.isfinite(torch.tensor(h[M.PPO_GRAD_NORM])) for h in module.history)


def test_consecutive_non_finite_steps_abort_with_a_clear_message(tmp_path):
    torch.manual_seed(0)
    module = make_module(
        ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=2, total_iterations=3, max_consecutive_skips=3)
    )
    _nan_gradients_on(module, set(range(100)))
    initial = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    with pytest.raises(NonFiniteError, match=r"iteration 2: 3 optimizer steps in a row had a non-finite"):
        _fit(module, tmp_path)
    for n, p in module.named_parameters():
        if n in initial:
            assert torch.equal(p, initial[n]), n  # no step was applied


def test_exports_refuse_non_finite_weights_and_write_nothing(tmp_path):
    module = make_module()
    lm = module.policy.lm
    actor = lm.adapter_parameters("actor")
    with torch.no_grad():
        actor[0][0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"refusing to export .* 1 tensor\(s\) hold inf or nan.*actor"):
        save_causal_lm(
            lm, module.tokenizer, str(tmp_path / "policy"), module.backbone_cfg, adapter_name="actor"
        )
    assert not os.path.exists(tmp_path / "policy")
    # the critic adapter is not part of a policy export, so a NaN there does not block it
    with torch.no_grad():
        actor[0][0, 0] = 0.0
        lm.adapter_parameters("critic")[0][0, 0] = float("inf")
    save_causal_lm(lm, module.tokenizer, str(tmp_path / "policy"), module.backbone_cfg, adapter_name="actor")
    assert (tmp_path / "policy" / "model.safetensors").is_file()
    head = copy.deepcopy(module.policy.value_head)
    with torch.no_grad():
        head.linear.bias.fill_(float("inf"))
    with pytest.raises(ValueError, match="refusing to export"):
        save_reward_head(head, str(tmp_path))
    assert not (tmp_path / "reward_head.safetensors").exists()


def _no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(ppo_build, "build_base", refuse)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            dict(backbone=BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", lora=LORA, disable_dropout=False)),
            r"PPO needs backbone.disable_dropout: true.*first PPO ratio is not 1",
        ),
        (dict(sampling=SamplingConfig(max_new_tokens=8, do_sample=False)), r"do_sample: false.*off-policy"),
        (dict(sampling=SamplingConfig(max_new_tokens=8, top_k=5)), r"top_k=5.*off-policy"),
        (dict(sampling=SamplingConfig(max_new_tokens=8, top_p=0.9)), r"top_p=0.9.*off-policy"),
        (
            dict(
                sampling=SamplingConfig(max_new_tokens=8, stop_at_eos=False),
                reward=RewardShapingConfig(missing_eos_penalty=1.0),
            ),
            r"missing_eos_penalty=1.0 needs a stop token",
        ),
    ],
    ids=["dropout_on", "greedy", "top_k", "top_p", "eos_penalty_without_stop_token"],
)
def test_settings_that_break_the_ratio_or_kl_are_refused_before_any_model_loads(
    overrides, match, monkeypatch
):
    _no_model_load(monkeypatch)
    with pytest.raises(ValueError, match=match):
        make_module(**overrides)


def test_missing_eos_penalty_with_a_stop_token_is_accepted():
    module = make_module(
        sampling=SamplingConfig(max_new_tokens=8, stop_at_eos=False, stop_token_ids=[3]),
        reward=RewardShapingConfig(missing_eos_penalty=1.0),
    )
    assert module.stop_ids == [3]


def test_the_prompt_data_module_holds_no_validation_split_by_default():
    """PPO never validates, so the prompts are not cut by a silent 5% hold-out."""
    from rlhf_lit.data import PromptDataModule
    from rlhf_lit.models.tokenizer import build_byte_tokenizer

    dm = PromptDataModule(
        train_files=["demo:prompts?n=40&seed=0&split=train"], tokenizer=build_byte_tokenizer()
    )
    dm.setup("fit")
    assert len(dm.train_dataset) == 40 and not dm.val_dataset


def test_a_refused_export_is_a_one_line_user_error_naming_the_export_folder(tmp_path):
    """A diverged run's export is refused as a UserError (the command prints one line, exit 2) that names the
    export folder, not the hidden staging sibling it was being written into."""
    from rlhf_lit.errors import DivergedExportError, UserError
    from rlhf_lit.models.export import check_finite

    staging = tmp_path / ".hf.partial-4242-ab_c9x"
    with pytest.raises(DivergedExportError) as info:
        check_finite({"w": torch.tensor([1.0, float("nan")]), "ids": torch.tensor([1, 2])}, str(staging))
    message = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in message
    assert message.startswith(f"refusing to export to {tmp_path / 'hf'}: 1 tensor(s) hold inf or nan, e.g. ['w']")
    assert "partial" not in message and "ppo/" not in message
    with pytest.raises(DivergedExportError, match=f"refusing to export to {tmp_path / 'plain'}:"):
        check_finite({"w": torch.tensor([float("inf")])}, str(tmp_path / "plain"))
