"""Reward-source lists in PPO: the prompt rows' fields reach a reward function, the weighted sum is the
score, each source is logged, and the tiny GRPO config with verifiable rewards runs from the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_lit import metrics as M
from rlhf_lit.data import PromptDataModule
from rlhf_lit.rewards import RewardSourceConfig
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.settings import PPOConfig
from tests.conftest import TINY_GPT2
from tests.ppo.helpers import make_module, make_trainer
from tests.tiny_runs import run_tiny

SEEN: list = []


def record_fields(prompts, responses, fields):
    """A reward function that records what it was called with and scores each response's length."""
    SEEN.append((list(prompts), list(responses), [dict(f) for f in fields]))
    return [float(len(r)) for r in responses]


def test_fields_reach_the_function_and_each_source_is_logged(tmp_path):
    rows = [
        {"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(4)
    ]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.manual_seed(0)
    SEEN.clear()
    module = make_module(
        reward_model=[
            RewardSourceConfig(
                name="length", function="tests.ppo.test_reward_sources:record_fields", weight=0.5
            ),
            RewardSourceConfig(name="answer", function="rlhf_lit.rewards:gsm8k_answer_match", weight=2.0),
            {
                "name": "rm",
                "model": {"backbone": {"tiny": TINY_GPT2, "tokenizer": "byte", "seed": 1}},
                "weight": 1.0,
            },
        ],
        sampling=SamplingConfig(max_new_tokens=6, temperature=0.7, num_samples_per_prompt=2),
        ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=4, total_iterations=1, advantage_estimator="rloo"),
    )
    scores = {}
    real = module.reward_source.score

    def spy(*args, **kwargs):
        scores["total"] = real(*args, **kwargs).clone()
        scores["parts"] = dict(module.reward_source.last_components)
        return scores["total"]

    module.reward_source.score = spy
    data = PromptDataModule(
        train_files=[str(path)], format="gsm8k", val_size=0, batch_size=2, tokenizer=module.tokenizer
    )
    make_trainer(tmp_path).fit(module, datamodule=data)
    prompts, responses, fields = SEEN[0]
    assert len(responses) == 4  # 2 prompts x 2 samples
    # each prompt row's fields, repeated for its 2 samples: the row as read plus the reference
    assert fields[0] == fields[1] and fields[0]["reference"] == fields[0]["answer"].rsplit("#### ", 1)[1]
    assert fields[0]["question"] in str(prompts[0])
    parts = scores["parts"]
    assert set(parts) == {"length", "answer", "rm"}
    torch.testing.assert_close(parts["length"], torch.tensor([float(len(r)) for r in responses]))
    torch.testing.assert_close(scores["total"], 0.5 * parts["length"] + 2.0 * parts["answer"] + parts["rm"])
    logged = module.history[-1]
    for name in ("length", "answer", "rm"):
        key = M.ROLLOUT_SOURCE_SCORE.format(name=name)
        assert M.is_known(key)
        assert logged[key] == pytest.approx(float(parts[name].mean()), rel=1e-5, abs=1e-6)
    assert logged[M.ROLLOUT_SCORE_MEAN] == pytest.approx(float(scores["total"].mean()), rel=1e-5, abs=1e-6)
    assert module.hparams["reward_model"][0]["function"].endswith(":record_fields")  # a plain list of dicts


def test_the_tiny_grpo_config_runs_critic_free(tmp_path_factory):
    run = run_tiny("configs/ppo/tiny_grpo.yaml", tmp_path_factory)
    module = run.cli.model
    assert module.iteration == 2 and module.policy.value_head is None
    assert module.estimator.kind == "grpo" and module.ppo.kl_in_loss()
    names = set(run.scalars())
    assert {"rollout/score/constraints", "rollout/score/ends_with_period", M.PPO_KL_LOSS} <= names
    assert not any(name.startswith("critic/") or name == M.PPO_VALUE_LOSS for name in names)


def test_the_smollm2_grpo_constraints_config_wiring_runs_on_a_tiny_model(tmp_path):
    """``configs/ppo/smollm2_grpo_constraints.yaml`` as shipped (real prompts, the constraint reward, GRPO's
    settings, held-out prompts), with only the model swapped for a tiny GPT-2 and the outputs sent to tmp."""
    from rlhf_lit.cli import cli_main
    from tests.tiny_runs import in_repo_root, one_thread

    backbone = (
        "{name_or_path: null, gguf_file: null, tokenizer: byte, lora: {r: 4, alpha: 8, target_modules: [c_attn]},"
        " tiny: {model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 2, n_positions: 512}}"
    )
    args = [
        "fit",
        "--config=configs/ppo/smollm2_grpo_constraints.yaml",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.callbacks=[]",
        "--model.init_args.export_dir=null",
        "--model.init_args.ppo.total_iterations=1",
        f"--model.init_args.backbone={backbone}",
        "--data.init_args.chat_template=false",  # the byte tokenizer has no chat template
    ]
    with in_repo_root(), one_thread():
        cli = cli_main(args)
    module = cli.model
    assert module.iteration == 1 and module.policy.value_head is None
    assert module.sampling.num_samples_per_prompt == 4 and module.estimator.kind == "grpo"
    assert module.ppo.aggregation() == "seq_mean_token_mean" and module.ppo.kl_in_loss()
    assert len(module.last_rollout["response_text"]) == 16  # 4 prompts x 4 responses
    scores = module.history[-1]["rollout/score/constraints"]
    assert 0.0 <= scores <= 1.0
    assert "val/score_mean" in cli.trainer.callback_metrics  # the 50 held-out prompts were scored
