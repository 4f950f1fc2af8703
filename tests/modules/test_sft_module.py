"""SFTModule on tiny models: what trains, what stays frozen, what is logged, the loss, and the HF export.

Two runs are shared by the tests (each a few optimizer steps):

* ``lora_run``: SFTModule + SFTDataModule built directly, a 2-layer 32-dim GPT-2 with LoRA on every linear
  layer, explicit prompt/response rows written to a tmp file;
* the ``configs/sft/tiny.yaml`` run through the CLI (full fine-tuning, real GSM8K rows), 2 steps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from safetensors.torch import load_file

from rlhf_lit import metrics as M
from rlhf_lit.data import SFTDataModule
from rlhf_lit.models import BackboneConfig, LoraSettings, load_backbone, load_tokenizer
from rlhf_lit.modules import SFTModule
from rlhf_lit.modules.common import OptimizerConfig
from tests.conftest import TINY_GPT2
from tests.tiny_runs import one_thread, read_scalars, run_tiny

PROMPT = "\n\nHuman: What is {a} plus {b}?\n\nAssistant:"
LORA = LoraSettings(r=4, alpha=8)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread (see ``tests.tiny_runs.one_thread``); overrides the conftest's two."""
    with one_thread():
        yield


def _write_rows(path: Path, n: int) -> str:
    rows = [{"prompt": PROMPT.format(a=i, b=i + 2), "response": f" It is {2 * i + 2}."} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> SimpleNamespace:
    """Fit SFTModule with LoRA for 3 steps (+ validation); export to ``<tmp>/hf``."""
    root = tmp_path_factory.mktemp("sft_lora")
    L.seed_everything(0, verbose=False)
    module = SFTModule(
        BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", lora=LORA),
        optimizer=OptimizerConfig(lr=1e-2),
        export_dir=str(root / "hf"),
    )
    data = SFTDataModule(
        train_files=_write_rows(root / "sft.jsonl", 20),
        format="explicit",
        val_size=4,
        max_length=96,
        batch_size=4,
        tokenizer=module.tokenizer,
    )
    before = _snapshot(module)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=3,
        log_every_n_steps=1,
        logger=TensorBoardLogger(str(root), name="tb"),
        default_root_dir=str(root),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with one_thread():
        trainer.fit(module, datamodule=data)
    module.eval()
    return SimpleNamespace(module=module, before=before, trainer=trainer, export_dir=root / "hf", root=root)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return run_tiny("configs/sft/tiny.yaml", tmp_path_factory)


def _probe_batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, right-padded to one length: ``(ids, mask)`` (B=2, T)."""
    texts = [PROMPT.format(a=3, b=4) + " It is", PROMPT.format(a=10, b=20)]
    enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    assert tokenizer.padding_side == "right" and enc["attention_mask"][1, -1] == 0
    return enc["input_ids"], enc["attention_mask"]


# -- what trains ------------------------------------------------------------------------------------------
def test_full_finetuning_changes_every_parameter(full_run):
    """The tiny config trains the whole model: every parameter requires grad and moved from its init."""
    module = full_run.cli.model
    assert full_run.cli.trainer.global_step == 2
    init = load_backbone(module.backbone_cfg, module.tokenizer)
    init_params = dict(init.named_parameters())
    trained = dict(module.lm.model.named_parameters())
    assert trained.keys() == init_params.keys()
    assert all(p.requires_grad for p in trained.values())
    unchanged = [n for n, p in trained.items() if torch.equal(p.detach(), init_params[n].detach())]
    assert unchanged == []


def test_lora_trains_only_adapter_parameters(lora_run):
    module = lora_run.module
    named = dict(module.named_parameters())
    lora = {n for n in named if "lora_" in n}
    assert lora, "no LoRA parameters were added"
    assert {n for n, p in named.items() if p.requires_grad} == lora
    # Every LoRA tensor moved (lora_B starts at 0; lora_A gets a gradient once lora_B is non-zero).
    unchanged = [n for n in lora if torch.equal(named[n].detach(), lora_run.before[n])]
    assert unchanged == []


def test_lora_leaves_the_base_weights_bit_identical(lora_run):
    module = lora_run.module
    changed = [
        n
        for n, p in module.named_parameters()
        if "lora_" not in n and not torch.equal(p.detach(), lora_run.before[n])
    ]
    assert changed == []
    # ... and identical to a freshly built base (same config, same seed): nothing touched them before fit.
    fresh = load_backbone(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"), module.tokenizer).state_dict()
    base = {
        name.replace(".base_layer.", "."): value
        for name, value in module.lm.model.get_base_model().state_dict().items()
        if "lora_" not in name
    }
    assert base.keys() == fresh.keys()
    assert [name for name, value in fresh.items() if not torch.equal(base[name], value)] == []


# -- what is logged ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("run_name", ["lora_run", "full_run"])
def test_losses_and_perplexity_are_written_to_tensorboard(run_name, request):
    run = request.getfixturevalue(run_name)
    log_dir = run.trainer.logger.log_dir if run_name == "lora_run" else run.log_dir
    scalars = read_scalars(log_dir)
    assert {M.TRAIN_LOSS, M.VAL_LOSS, M.VAL_PERPLEXITY} <= scalars.keys()
    train_steps = [step for step, _ in scalars[M.TRAIN_LOSS]]
    assert len(train_steps) == len(set(train_steps)) >= 2  # log_every_n_steps=1: one value per step
    loss = dict(scalars[M.VAL_LOSS])
    ppl = dict(scalars[M.VAL_PERPLEXITY])
    assert loss.keys() == ppl.keys() and loss
    for step, value in loss.items():
        assert math.isfinite(value) and value > 0
        assert ppl[step] == pytest.approx(math.exp(value), rel=1e-5)


# -- the loss ---------------------------------------------------------------------------------------------
def test_loss_is_the_mean_nll_of_the_response_tokens_only(tmp_path, monkeypatch):
    """One real row through SFTDataModule's collator; loss = -mean log p(response token | everything before).

    The hand computation uses the plain HF forward and log_softmax, and the response ids encoded on their
    own plus EOS, so it depends on neither the batch's labels nor rlhf_lit's loss code.
    """
    module = SFTModule(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"))
    monkeypatch.setattr(module, "log", lambda *args, **kwargs: None)  # no Trainer attached
    tok = module.tokenizer
    prompt, response = PROMPT.format(a=2, b=5), " It is 7."
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "response": response}) + "\n", encoding="utf-8")
    data = SFTDataModule(train_files=str(path), format="explicit", val_size=0, batch_size=1, tokenizer=tok)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))

    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([prompt_ids + response_ids])
    assert torch.equal(batch["input_ids"], ids)
    with torch.no_grad():
        logprobs = torch.log_softmax(module.lm.model(input_ids=ids).logits.double(), dim=-1)[0]
        p = len(prompt_ids)
        # token ids[0, t] is predicted at position t - 1
        response_nll = -torch.stack([logprobs[t - 1, ids[0, t]] for t in range(p, ids.shape[1])])
        all_nll = -torch.stack([logprobs[t - 1, ids[0, t]] for t in range(1, ids.shape[1])])
        loss = module.training_step(batch, 0)
    assert loss.dim() == 0
    torch.testing.assert_close(loss.double(), response_nll.mean(), atol=1e-5, rtol=1e-5)
    # the check can tell: including the prompt tokens gives another number
    assert abs(float(all_nll.mean()) - float(response_nll.mean())) > 1e-3


def test_padding_rows_do_not_change_the_loss(tmp_path, monkeypatch):
    """A row's loss tokens are the same whether it is alone or right-padded next to a longer row."""
    module = SFTModule(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"))
    monkeypatch.setattr(module, "log", lambda *args, **kwargs: None)  # no Trainer attached
    tok = module.tokenizer
    short = {"prompt": PROMPT.format(a=1, b=1), "response": " 2"}
    long = {"prompt": PROMPT.format(a=123, b=456), "response": " It is 579, I am sure of that."}
    path = tmp_path / "two.jsonl"
    path.write_text(json.dumps(short) + "\n" + json.dumps(long) + "\n", encoding="utf-8")
    data = SFTDataModule(
        train_files=str(path), format="explicit", val_size=0, batch_size=2, shuffle=False, tokenizer=tok
    )
    data.setup("fit")
    both = next(iter(data.train_dataloader()))
    with torch.no_grad():
        _, n_both = module._loss(both)
        loss_both = module.training_step(both, 0)
        single = {k: v[:1, : int(both["attention_mask"][0].sum())] for k, v in both.items() if v.dim() == 2}
        loss_short, n_short = module._loss(single)
        single = {k: v[1:] for k, v in both.items() if v.dim() == 2}
        loss_long, n_long = module._loss(single)
    assert n_both == n_short + n_long
    expected = (loss_short * n_short + loss_long * n_long) / n_both  # a per-token mean, not a mean of rows
    torch.testing.assert_close(loss_both, expected, atol=1e-5, rtol=1e-5)


# -- the export -------------------------------------------------------------------------------------------
def test_export_folder_holds_merged_weights_adapter_tokenizer_and_meta(lora_run):
    out = lora_run.export_dir
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "rlhf_lit.json",
    ):
        assert (out / name).is_file(), name
    assert (out / "adapter" / "adapter_config.json").is_file()
    merged = load_file(str(out / "model.safetensors"))
    assert not [k for k in merged if "lora_" in k or "base_layer" in k]
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)  # only adapter tensors (STYLE habit 10)
    meta = json.loads((out / "rlhf_lit.json").read_text())
    assert meta["kind"] == "policy" and meta["stage"] == "sft"
    assert meta["weights"] == "merged" and meta["has_adapter"] is True


def test_merged_export_loads_with_plain_transformers_and_gives_the_same_logits(lora_run):
    from transformers import AutoModelForCausalLM

    module = lora_run.module
    ids, mask = _probe_batch(module.tokenizer)
    reloaded = AutoModelForCausalLM.from_pretrained(str(lora_run.export_dir)).eval()
    assert not any("lora_" in n for n, _ in reloaded.named_parameters())
    with torch.no_grad():
        expected = module(ids, mask)
        got = reloaded(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
    # the adapter mattered: the merged model is not the untrained base
    base = load_backbone(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"), module.tokenizer).eval()
    with torch.no_grad():
        assert not torch.allclose(
            base(input_ids=ids, attention_mask=mask).logits[real], expected[real], atol=1e-3
        )


def test_adapter_export_loads_with_peft_onto_a_fresh_base(lora_run):
    from peft import PeftModel

    module = lora_run.module
    ids, mask = _probe_batch(module.tokenizer)
    base = load_backbone(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"), module.tokenizer)
    reloaded = PeftModel.from_pretrained(base, str(lora_run.export_dir / "adapter")).eval()
    with torch.no_grad():
        expected = module(ids, mask)
        got = reloaded(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


def test_exported_model_generates_after_reload(lora_run):
    """The reloaded HF model + tokenizer generate, greedily, exactly what the trained module generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module = lora_run.module
    tokenizer = AutoTokenizer.from_pretrained(str(lora_run.export_dir))
    assert tokenizer("3 + 4")["input_ids"] == load_tokenizer("byte")("3 + 4")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(lora_run.export_dir)).eval()
    prompt = tokenizer(PROMPT.format(a=3, b=4), return_tensors="pt")
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        out = model.generate(**prompt, **kwargs)
        expected = module.lm.generation_model().generate(**prompt, **kwargs)
    n = prompt["input_ids"].shape[1]
    assert out.shape[1] > n
    assert torch.equal(out[:, :n], prompt["input_ids"])
    assert torch.equal(out, expected)
    assert isinstance(tokenizer.decode(out[0, n:], skip_special_tokens=True), str)


def test_validation_metrics_are_logged_with_sync_dist():
    """``val/loss`` and ``val/perplexity`` are epoch-level metrics: without ``sync_dist=True`` Lightning warns
    under FSDP2 / several devices. ``val_nll`` already holds every rank's tokens, so the reduction is a mean of
    equal values and the numbers do not move."""
    module = SFTModule(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"))
    module.val_nll.update(torch.tensor([1.0, 4.0]), weight=torch.tensor([2.0, 1.0]))  # (1*2 + 4*1) / 3 = 2
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, (float(value), kwargs))
    module.on_validation_epoch_end()
    assert sorted(logged) == sorted([M.VAL_LOSS, M.VAL_PERPLEXITY])
    assert logged[M.VAL_LOSS][0] == pytest.approx(2.0)
    assert logged[M.VAL_PERPLEXITY][0] == pytest.approx(math.exp(2.0))  # 7.389056
    assert {name: kwargs.get("sync_dist") for name, (_, kwargs) in logged.items()} == {
        M.VAL_LOSS: True,
        M.VAL_PERPLEXITY: True,
    }
