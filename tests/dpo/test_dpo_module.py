"""DPOModule on a tiny GPT-2 with LoRA: the assembled loss equals a plain recomputation, training moves only
the adapter, the reference stays put, the export loads with plain transformers, KTO runs on odd batches."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_lit import metrics as M
from rlhf_lit.modules.dpo import sequences
from tests.dpo.helpers import (
    make_data,
    make_module,
    make_trainer,
    plain_response_logps,
    write_pairs,
    write_unpaired,
)
from tests.tiny_runs import run_tiny


def _randomise_adapter(module, std: float = 0.2, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.lm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=std, generator=generator)


def _first_batch(module, tmp_path, **kw):
    data = make_data(module, write_pairs(tmp_path / "pairs.jsonl"), shuffle=False, **kw)
    data.setup("fit")
    return data, next(iter(data.train_dataloader()))


def test_a_fresh_adapter_starts_at_log2(tmp_path):
    module = make_module(loss_type="sigmoid")
    _, batch = _first_batch(module, tmp_path)
    loss, n = module._loss(batch, "train")
    # lora_B = 0: policy == reference, h = 0 for every pair, -log sigmoid(0) = log 2
    assert n == batch["chosen_input_ids"].shape[0]
    assert loss.item() == pytest.approx(math.log(2.0), abs=1e-6)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_the_loss_equals_a_plain_recomputation_from_hugging_face_forwards(tmp_path, loss_type):
    module = make_module(loss_type=loss_type, nll_coef=0.3, simpo_gamma=0.2)
    _randomise_adapter(module)
    _, batch = _first_batch(module, tmp_path)
    ids, mask, prompt_len, response_len = sequences(batch)
    n = ids.shape[0] // 2
    peft_model = module.lm.model
    policy = plain_response_logps(peft_model, ids, mask, prompt_len, response_len)
    with peft_model.disable_adapter():
        ref = plain_response_logps(peft_model, ids, mask, prompt_len, response_len)
    assert (policy - ref).abs().max() > 1e-3  # the adapter matters, so a reference mix-up would show
    beta, lengths = 0.5, response_len.float()
    if loss_type == "sigmoid":
        h = (policy[:n] - ref[:n]) - (policy[n:] - ref[n:])
        losses = torch.log1p(torch.exp(-beta * h))
    elif loss_type == "ipo":
        h = (policy[:n] - ref[:n]) / lengths[:n] - (policy[n:] - ref[n:]) / lengths[n:]
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        m = beta * policy[:n] / lengths[:n] - beta * policy[n:] / lengths[n:]
        losses = torch.log1p(torch.exp(-(m - 0.2)))
    nll = -policy[:n].sum() / lengths[:n].sum()
    expected = losses.mean() + 0.3 * nll
    loss, _ = module._loss(batch, "train")
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-5)


def test_training_moves_only_the_adapter_and_leaves_the_reference_unchanged(tmp_path):
    module = make_module(optimizer={"lr": 1e-2}, export_dir=str(tmp_path / "hf"))
    data, batch = _first_batch(module, tmp_path)
    ids, mask, prompt_len, response_len = sequences(batch)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    ref_before = module.run_reference(ids, mask, prompt_len, response_len)
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and ".default." in n for n in trainable)

    make_trainer(tmp_path, max_steps=3).fit(module, datamodule=data)

    changed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= set(trainable)
    assert any("lora_B" in n for n in changed)
    assert torch.equal(module.run_reference(ids, mask, prompt_len, response_len), ref_before)
    assert not torch.equal(module.policy_logps(ids, mask, prompt_len, response_len).detach(), ref_before)

    # the export is the trained policy, loaded by plain transformers (merged weights)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    got = plain_response_logps(exported, ids, mask, prompt_len, response_len)
    want = module.policy_logps(ids, mask, prompt_len, response_len).detach()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_load_from_checkpoint_rebuilds_the_trained_policy_and_its_reference(tmp_path):
    """The checkpoint holds the adapter only; ``load_from_checkpoint`` rebuilds the base from ``backbone`` (no
    trainer: loaded whole) and gives the trained policy's and the reference's log-probs, bit for bit."""
    from rlhf_lit.modules import DPOModule

    torch.manual_seed(0)
    module = make_module(optimizer={"lr": 1e-2})
    data, batch = _first_batch(module, tmp_path)
    ids, mask, prompt_len, response_len = sequences(batch)
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(tmp_path / "dpo.ckpt")

    loaded = DPOModule.load_from_checkpoint(tmp_path / "dpo.ckpt")
    want = module.policy_logps(ids, mask, prompt_len, response_len).detach()
    assert not torch.equal(want, module.run_reference(ids, mask, prompt_len, response_len))  # it trained
    assert torch.equal(loaded.policy_logps(ids, mask, prompt_len, response_len).detach(), want)
    assert torch.equal(
        loaded.run_reference(ids, mask, prompt_len, response_len),
        module.run_reference(ids, mask, prompt_len, response_len),
    )


def test_kto_trains_on_odd_batches_and_a_batch_of_one(tmp_path):
    module = make_module(loss_type="kto", desirable_weight=1.0, undesirable_weight=1.3)
    data = make_data(module, write_unpaired(tmp_path / "kto.jsonl", n=10), batch_size=3, val_size=0)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append((batch["input_ids"].shape[0], outputs["loss"].item()))

    make_trainer(tmp_path, callbacks=[Record()]).fit(module, datamodule=data)
    assert [size for size, _ in losses] == [3, 3, 3, 1]  # 10 rows: three odd batches and one of size 1
    assert all(math.isfinite(loss) for _, loss in losses)


def test_the_tiny_config_logs_trls_metric_names_per_split(tmp_path_factory):
    run = run_tiny("configs/dpo/tiny.yaml", tmp_path_factory)
    names = set(run.scalars())
    for split in ("train", "val"):
        for name in (
            M.PREF_REWARDS_CHOSEN,
            M.PREF_REWARDS_REJECTED,
            M.PREF_REWARDS_MARGINS,
            M.PREF_REWARDS_ACCURACIES,
            M.PREF_LOGPS_CHOSEN,
            M.PREF_LOGPS_REJECTED,
            M.PREF_NLL_LOSS,
        ):
            assert name.format(split=split) in names
    assert {M.TRAIN_LOSS, M.VAL_LOSS} <= names
    assert (run.export_dir / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(str(run.export_dir))


def _step_peak_bytes(module, batch) -> int:
    """Peak bytes of live tensors during one training step's loss and backward (the weights excluded)."""
    from tests.memory_tracker import TensorMemoryTracker

    weights = [p for p in module.parameters()] + [b for b in module.buffers()]
    with TensorMemoryTracker(ignore=weights) as tracker:
        loss, _ = module._loss(batch, "train")
        loss.backward()
    module.zero_grad(set_to_none=True)
    return tracker.peak


def test_the_reference_forward_adds_no_peak_memory_to_a_step(tmp_path):
    """The reference (adapter off) runs before the policy's forward, so a DPO step peaks no higher than a
    reference-free step (SimPO) on the same batch; run after the policy forward, the reference's activations
    would sit on top of the policy's graph."""
    peaks = {}
    for loss_type in ("sigmoid", "simpo"):  # the same weights and batch; SimPO runs no reference
        torch.manual_seed(0)
        module = make_module(loss_type=loss_type)
        _randomise_adapter(module)
        _, batch = _first_batch(module, tmp_path, batch_size=8)
        module.train()
        peaks[loss_type] = _step_peak_bytes(module, batch)
    assert peaks["sigmoid"] <= peaks["simpo"] * 1.01, peaks


def test_trimmed_padding_gives_the_padded_loss_and_gradients_at_a_lower_peak(tmp_path):
    """``trim_padding`` (without ``packing``) runs rows of similar length together, each cut to its longest row:
    the same loss and adapter gradients as one padded forward, with less memory alive at the step's peak."""
    results = {}
    for trim in (True, False):
        torch.manual_seed(0)
        module = make_module(trim_padding=trim, packing=False)
        _randomise_adapter(module)
        _, batch = _first_batch(module, tmp_path, batch_size=8)
        module.train()
        lengths = batch["prompt_len"] + batch["chosen_response_len"]
        assert int(lengths.min()) < 0.9 * int(lengths.max())  # rows in more than one group
        loss, _ = module._loss(batch, "train")
        loss.backward()
        grads = [p.grad.clone() for p in module.parameters() if p.requires_grad]
        module.zero_grad(set_to_none=True)
        results[trim] = (loss.detach(), grads, _step_peak_bytes(module, batch))
    (loss_t, grads_t, peak_t), (loss_p, grads_p, peak_p) = results[True], results[False]
    torch.testing.assert_close(loss_t, loss_p, atol=1e-6, rtol=1e-6)
    for a, b in zip(grads_t, grads_p):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert peak_t < 0.9 * peak_p, (peak_t, peak_p)

