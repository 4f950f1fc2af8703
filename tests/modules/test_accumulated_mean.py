"""Gradient accumulation gives the gradient of one big batch: SFT per token, the reward model per pair.

Lightning divides each micro-batch loss by ``accumulate_grad_batches``, so an unweighted per-micro-batch
mean would make the optimizer step see a mean of means; with uneven response lengths that over-weights the
tokens of short micro-batches. ``AccumulatedMean`` weights each micro-batch by its share of the window.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from rlhf_lit.data import PreferenceDataModule, SFTDataModule
from rlhf_lit.functional.losses import sft_nll
from rlhf_lit.models import BackboneConfig, LoraSettings
from rlhf_lit.modules import RewardModule, SFTModule
from rlhf_lit.modules.common import OptimizerConfig
from tests.conftest import TINY_GPT2
from tests.tiny_runs import one_thread

LORA = LoraSettings(r=4, alpha=8, target_modules=["c_attn"])


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _step_gradients(module: L.LightningModule, data, accumulate: int) -> dict[str, torch.Tensor]:
    """The gradients the first optimizer step would apply (after the module's rescaling, before clipping); taken
    before that step, so the learning rate (which must be > 0) plays no part."""
    grads: dict[str, torch.Tensor] = {}

    def snapshot(optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        for name, p in module.named_parameters():
            if p.grad is not None:
                grads[name] = p.grad.detach().clone()

    module.configure_gradient_clipping = snapshot  # Lightning calls it right after on_before_optimizer_step
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=data)
    assert grads, "no gradient was captured"
    return grads


def _sft_rows(path: Path) -> str:
    # responses of very different lengths: 1 + 1 tokens (with EOS) in the first micro-batch, ~30 in the second
    rows = [
        {"prompt": "Q: a?\nA:", "response": " x"},
        {"prompt": "Q: b?\nA:", "response": " y"},
        {"prompt": "Q: c?\nA:", "response": " a much longer answer with many tokens in it"},
        {"prompt": "Q: d?\nA:", "response": " another long answer, also with many tokens"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _sft(tmp_path: Path, batch_size: int):
    torch.manual_seed(0)
    module = SFTModule(
        BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", lora=LORA), optimizer=OptimizerConfig(lr=1e-3)
    )
    with torch.no_grad():  # lora_B = 0 would give the LoRA A matrices no gradient
        for name, p in module.lm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(1))
    data = SFTDataModule(
        train_files=_sft_rows(tmp_path / "sft.jsonl"),
        format="explicit",
        val_size=0,
        batch_size=batch_size,
        shuffle=False,
        tokenizer=module.tokenizer,
    )
    return module, data


def test_sft_accumulating_two_micro_batches_equals_one_batch_of_the_same_tokens(tmp_path):
    one, data_one = _sft(tmp_path, batch_size=4)
    two, data_two = _sft(tmp_path, batch_size=2)
    full = _step_gradients(one, data_one, accumulate=1)
    accumulated = _step_gradients(two, data_two, accumulate=2)
    assert full.keys() == accumulated.keys() and len(full) == 4  # lora_A and lora_B of c_attn, 2 layers
    for name in full:
        torch.testing.assert_close(accumulated[name], full[name], rtol=1e-4, atol=1e-7, msg=name)

    # The case is not trivial: the mean of the two micro-batch means (what plain accumulation gives) is far
    # from the token mean. Recomputed here by hand from the same model.
    data_two.setup("fit")
    batches = list(data_two.train_dataloader())
    tokens = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    assert tokens[0] * 5 < tokens[1]
    fresh, _ = _sft(tmp_path, batch_size=2)  # the same seeded start: `two` has taken its optimizer step
    params = [p for p in fresh.parameters() if p.requires_grad]
    means = []
    for b in batches:
        loss, _ = sft_nll(fresh(b["input_ids"], b["attention_mask"]), b["labels"])
        means.append(torch.autograd.grad(loss, params))
    mean_of_means = torch.cat([((g0 + g1) / 2).flatten() for g0, g1 in zip(*means)])
    token_mean = torch.cat(
        [((tokens[0] * g0 + tokens[1] * g1) / sum(tokens)).flatten() for g0, g1 in zip(*means)]
    )
    full_flat = torch.cat([full[n].flatten() for n, p in fresh.named_parameters() if p.requires_grad])
    torch.testing.assert_close(full_flat, token_mean, rtol=1e-4, atol=1e-7)
    assert (mean_of_means - token_mean).norm() > 0.2 * token_mean.norm()


def _pairs(path: Path, n: int) -> str:
    rows = [
        {"prompt": f"Q{i}: pick", "chosen": f" yes {'!' * (i % 4)}", "rejected": f" no{'.' * (3 * i % 7)}"}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _reward(tmp_path: Path, batch_size: int, n: int):
    torch.manual_seed(0)
    module = RewardModule(
        BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", lora=LORA),
        optimizer=OptimizerConfig(lr=1e-3),
        calibrate=False,
    )
    data = PreferenceDataModule(
        train_files=_pairs(tmp_path / "pairs.jsonl", n),
        format="explicit",
        val_size=0,
        batch_size=batch_size,
        shuffle=False,
        tokenizer=module.tokenizer,
    )
    return module, data


@pytest.mark.parametrize(
    ("n", "micro"),
    [(4, 2), (3, 2)],  # 2 + 2 pairs; 2 + 1 pairs (an epoch's short last batch in the window)
)
def test_reward_accumulation_weighs_every_pair_the_same(tmp_path, n, micro):
    one, data_one = _reward(tmp_path, batch_size=n, n=n)
    two, data_two = _reward(tmp_path, batch_size=micro, n=n)
    full = _step_gradients(one, data_one, accumulate=1)
    accumulated = _step_gradients(two, data_two, accumulate=2)
    assert "head.linear.weight" in full and full.keys() == accumulated.keys()
    for name in full:
        torch.testing.assert_close(accumulated[name], full[name], rtol=1e-4, atol=1e-7, msg=name)


def test_ranked_pair_weights_survive_gradient_accumulation(tmp_path):
    """With ``weight_ranked_pairs`` a step's gradient is that of sum(w * loss) / sum(w) over the whole step,
    whichever micro-batches hold the pairs: 2 micro-batches of 2 pairs (weights 1/3, 1/3 | 1/3, 1) equal
    one batch of the 4 pairs."""
    rows = [
        {"prompt": "R:", "responses": [" a", " bb", " ccc"], "ranks": [1, 2, 3]},  # 3 pairs of weight 1/3
        {"prompt": "S:", "responses": [" yes", " no"], "ranks": [1, 2]},  # 1 pair of weight 1
    ]
    path = tmp_path / "ranked.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def build(batch_size: int):
        torch.manual_seed(0)
        module = RewardModule(
            BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", lora=LORA),
            optimizer=OptimizerConfig(lr=1e-3),
            calibrate=False,
        )
        data = PreferenceDataModule(
            train_files=str(path),
            format="ranked",
            val_size=0,
            batch_size=batch_size,
            shuffle=False,
            weight_ranked_pairs=True,
            tokenizer=module.tokenizer,
        )
        return module, data

    full = _step_gradients(*build(4), accumulate=1)
    accumulated = _step_gradients(*build(2), accumulate=2)
    assert "head.linear.weight" in full and full.keys() == accumulated.keys()
    for name in full:
        torch.testing.assert_close(accumulated[name], full[name], rtol=1e-4, atol=1e-7, msg=name)
