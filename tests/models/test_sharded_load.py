"""``rlhf_lit.models.sharded_load`` on one process: a module built on the meta device loads, in
``configure_model``, exactly the weights ``load_backbone`` loads (no FSDP here: each tensor is read whole);
what cannot be loaded that way loads whole at construction, as before. The 2-process FSDP2 case (each rank
reads its rows only) is tests/distributed/test_sharded_load.py."""

from __future__ import annotations

import pytest
import torch
import yaml

from rlhf_lit.models.backbone import BackboneConfig, LoraSettings
from rlhf_lit.models.model_files import build_tiny
from rlhf_lit.models.sharded_load import checkpoint_files
from rlhf_lit.models.tokenizer import load_tokenizer
from rlhf_lit.modules.sft import SFTModule
from tests.conftest import TINY_GPT2, TINY_LLAMA


@pytest.fixture(scope="module", params=["llama_tied", "gpt2"])
def base(request, tmp_path_factory) -> str:
    spec = {**TINY_LLAMA, "tie_word_embeddings": True} if request.param == "llama_tied" else TINY_GPT2
    folder = tmp_path_factory.mktemp(request.param)
    build_tiny(BackboneConfig(tiny=spec, seed=3), load_tokenizer("byte")).save_pretrained(folder)
    return str(folder)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.arange(3, 27).reshape(2, 12)
    labels = ids.clone()
    labels[:, :4] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def test_built_on_meta_loads_the_same_weights_in_configure_model(base, caplog):
    cfg = BackboneConfig(name_or_path=base, tokenizer="byte")
    whole = SFTModule(cfg)
    with torch.device("meta"):
        empty = SFTModule(cfg)
    assert empty._checkpoint_files == checkpoint_files(cfg) and len(empty._checkpoint_files) == 1
    assert all(p.is_meta for p in empty.lm.parameters())
    assert not any(b.is_meta for b in empty.lm.buffers())  # rotary frequencies computed, not loaded
    assert not empty.val_nll.mean_value.is_meta  # everything but the base is built for real
    with caplog.at_level("INFO", logger="rlhf_lit"):
        empty.configure_model()
    assert empty._checkpoint_files is None
    # the log says it happened (one process reads every row: read = total)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sharded load:")]
    megabytes = sum(p.numel() * p.element_size() for p in empty.lm.model.parameters()) / 2**20
    assert f"read {megabytes:.1f} of the {megabytes:.1f} MB" in line, line
    expected, got = whole.lm.state_dict(), empty.lm.state_dict()
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    tied = whole.lm.model.get_output_embeddings().weight is whole.lm.model.get_input_embeddings().weight
    assert (
        empty.lm.model.get_output_embeddings().weight is empty.lm.model.get_input_embeddings().weight
    ) == tied
    assert empty.lm.training and empty.lm.model.training
    batch = _batch()
    assert torch.equal(empty._loss(batch)[0], whole._loss(batch)[0])


def test_lora_on_a_meta_base_starts_as_the_base(base):
    torch.manual_seed(0)
    cfg = BackboneConfig(name_or_path=base, tokenizer="byte", lora=LoraSettings(r=4, alpha=8))
    whole = SFTModule(cfg)
    with torch.device("meta"):
        empty = SFTModule(cfg)
    lora = {n: p for n, p in empty.lm.named_parameters() if "lora_" in n}
    assert lora and not any(p.is_meta for p in lora.values())
    assert all(
        float(p.detach().abs().max()) == 0 for n, p in lora.items() if "lora_B" in n
    )  # B = 0: the base
    assert all(float(p.detach().abs().max()) > 0 for n, p in lora.items() if "lora_A" in n)
    before = {n: p.detach().clone() for n, p in lora.items()}
    empty.configure_model()
    for name, p in empty.lm.named_parameters():
        if name in before:
            assert torch.equal(p, before[name]), name  # kept through to_empty
    assert sorted(n for n, p in empty.lm.named_parameters() if p.requires_grad) == sorted(before)
    batch = _batch()
    torch.testing.assert_close(empty._loss(batch)[0], whole._loss(batch)[0], rtol=1e-6, atol=0)


def test_what_cannot_be_read_shard_by_shard_loads_whole(base):
    tiny = BackboneConfig(tiny=TINY_GPT2, tokenizer="byte")
    assert checkpoint_files(tiny) is None
    with torch.device("meta"):
        module = SFTModule(tiny)
    assert module._checkpoint_files is None and not any(p.is_meta for p in module.parameters())
    assert checkpoint_files(BackboneConfig(name_or_path=base, tokenizer="byte", load_in_4bit=True)) is None


def test_a_buffer_init_weights_does_not_compute_is_refused():
    """A model whose meta buffers ``_init_weights`` leaves uncomputed cannot be built empty (``empty_backbone``
    then gives None and the module loads it whole); the rotary frequencies of Llama are computed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_lit.models.sharded_load import _init_buffers

    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=32)
    with torch.device("meta"):
        computed, untouched = LlamaForCausalLM(config), LlamaForCausalLM(config)
    untouched._init_weights = lambda module: None  # a model class that does not know its buffers
    assert _init_buffers(computed) is True
    torch.testing.assert_close(
        computed.model.rotary_emb.inv_freq, LlamaForCausalLM(config).model.rotary_emb.inv_freq
    )
    assert _init_buffers(untouched) is False


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, alpha=8)])
def test_reward_module_built_on_meta_scores_as_the_whole_one(base, lora):
    from rlhf_lit.modules.reward import RewardModule

    cfg = BackboneConfig(name_or_path=base, tokenizer="byte", lora=lora)
    freeze = 0 if lora else 1
    torch.manual_seed(0)
    whole = RewardModule(cfg, freeze_layers=freeze)
    torch.manual_seed(0)
    with torch.device("meta"):
        empty = RewardModule(cfg, freeze_layers=freeze)
    assert empty._checkpoint_files is not None and all(
        p.is_meta for n, p in empty.lm.named_parameters() if "lora_" not in n
    )
    assert not empty.temperature.is_meta and not any(p.is_meta for p in empty.head.parameters())
    assert empty.num_frozen == whole.num_frozen and (empty.num_frozen > 0) == (freeze > 0)
    empty.configure_model()
    if lora is None:  # the same seed, the same draw (loading the base draws nothing on either path)
        torch.testing.assert_close(empty.head.linear.weight, whole.head.linear.weight)
    else:  # the LoRA initialisation drew other numbers before the head's (sharded_load's docstring)
        empty.head.load_state_dict(whole.head.state_dict())
    batch = _batch()
    torch.testing.assert_close(
        empty.score(batch["input_ids"], batch["attention_mask"]),
        whole.score(batch["input_ids"], batch["attention_mask"]),
        rtol=1e-6,
        atol=1e-6,
    )
    trainable = sorted(n for n, p in empty.named_parameters() if p.requires_grad)
    assert trainable == sorted(n for n, p in whole.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("strategy", ["fsdp2", "auto"])
def test_the_cli_defers_the_weights_under_fsdp2_only(base, strategy, monkeypatch, tmp_path):
    """``rlhf-lit fit`` builds the model inside ``deferred_weights()`` when the trainer's strategy is a
    ``ModelParallelStrategy``: the base is left on meta for ``configure_model``; with any other strategy the
    module loads as before."""
    from rlhf_lit.lightning_cli import cli_main
    from tests.conftest import REPO_ROOT

    monkeypatch.chdir(REPO_ROOT)  # the config names its data as ../shared/data/...
    config = yaml.safe_load((REPO_ROOT / "configs/sft/tiny.yaml").read_text())
    config["model"]["init_args"]["backbone"] = {"name_or_path": base, "tokenizer": "byte"}
    config["data"]["init_args"]["max_length"] = 128  # the tiny bases' positions
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    args = ["--config", str(tmp_path / "sft.yaml")]  # run=False: no subcommand
    if strategy == "fsdp2":
        args.append('--trainer.strategy={"class_path": "rlhf_lit.parallel.strategy.FSDP2Strategy"}')
    cli = cli_main(args, run=False)
    deferred = cli.model._checkpoint_files is not None
    assert deferred == (strategy == "fsdp2")
    assert all(p.is_meta for p in cli.model.lm.parameters()) == deferred
    assert not any(p.is_meta for p in cli.model.lm.parameters()) == (not deferred)
    from rlhf_lit.models.sharded_load import weights_deferred

    assert not weights_deferred()  # the context ended with the instantiation
