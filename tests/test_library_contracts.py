"""The private APIs of other libraries that rlhf_lit reaches, each checked here against the behaviour the
adapter module relies on, so an upgrade that changes one fails HERE with the adapter's name, not deep inside
a training run. Adapters: ``rlhf_lit.parallel.fsdp`` (torch, transformers), ``rlhf_lit.models.sharded_load``
(transformers' ``_init_weights``), ``rlhf_lit.parallel.strategy``
(Lightning), ``rlhf_lit.models.streamed_export`` (transformers' save-time name handling),
``rlhf_lit.models.peft_compat`` (peft), ``rlhf_lit.cli_messages`` (jsonargparse message text, argparse's option
list; its own test file is tests/cli/test_cli_messages.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


# ---------------------------------------------------------------- torch (rlhf_lit.parallel.fsdp)
def test_torch_module_registries_that_plain_state_dict_reads():
    """``plain_state_dict`` walks ``_parameters``, ``_buffers`` and ``_non_persistent_buffers_set``."""
    m = nn.BatchNorm1d(3)
    m.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert set(m._parameters) == {"weight", "bias"}
    assert {"running_mean", "running_var", "num_batches_tracked", "scratch"} <= set(m._buffers)
    assert m._non_persistent_buffers_set == {"scratch"}
    from rlhf_lit.parallel.fsdp import plain_state_dict

    assert set(plain_state_dict(m)) == set(m.state_dict())  # not sharded: the ordinary state dict


def test_torch_fsdp2_entry_points_exist():
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    assert callable(fully_shard) and callable(register_fsdp_forward_method)
    assert hasattr(FSDPModule, "unshard") and hasattr(FSDPModule, "reshard")


# ---------------------------------------------------------------- transformers (rlhf_lit.parallel.fsdp)
def test_transformers_no_split_modules_names_the_blocks():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from rlhf_lit.parallel.fsdp import no_split_module_names, transformer_blocks

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    assert no_split_module_names(gpt2) == {"GPT2Block"}
    assert len(transformer_blocks(gpt2)) == 2
    llama = LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=3,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=32,
        )
    )
    assert no_split_module_names(llama) == {"LlamaDecoderLayer"}
    assert len(transformer_blocks(llama)) == 3


# ---------------------------------------------------------------- transformers (rlhf_lit.models.sharded_load)
def test_transformers_init_weights_computes_rotary_buffers_of_a_meta_model():
    """``empty_backbone`` builds a model on meta and computes its buffers (Llama's rotary frequencies) with
    ``PreTrainedModel._init_weights``, module by module, as ``from_pretrained`` does for missing buffers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_lit.models.sharded_load import _init_buffers

    config = LlamaConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=32
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert {n for n, _ in model.named_buffers()} == {
        "model.rotary_emb.inv_freq",
        "model.rotary_emb.original_inv_freq",
    }
    assert _init_buffers(model)
    expected = LlamaForCausalLM(config).model.rotary_emb
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, expected.inv_freq, rtol=0, atol=0)
    torch.testing.assert_close(
        model.model.rotary_emb.original_inv_freq, expected.original_inv_freq, rtol=0, atol=0
    )


# ---------------------------------------------------------------- Lightning (rlhf_lit.parallel.strategy)
def test_lightning_sharded_checkpoint_helpers(tmp_path):
    """``FSDP2Strategy.load_checkpoint`` tells a sharded checkpoint (a folder with the metadata file) from a
    full one with Lightning's private helper, and reads the metadata file by Lightning's private name."""
    from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    assert _METADATA_FILENAME == "meta.pt"
    folder = tmp_path / "sharded.ckpt"
    folder.mkdir()
    (folder / _METADATA_FILENAME).write_bytes(b"")
    assert _is_sharded_checkpoint(folder)
    full = tmp_path / "full.ckpt"
    full.write_bytes(b"")
    assert not _is_sharded_checkpoint(full)


def test_lightning_model_parallel_strategy_keeps_data_parallel_size_privately():
    """``FSDP2Strategy.setup_environment`` resolves ``_data_parallel_size="auto"`` itself."""
    from rlhf_lit.parallel.strategy import FSDP2Strategy

    strategy = FSDP2Strategy()
    assert strategy._data_parallel_size == "auto"
    assert strategy._tensor_parallel_size == 1


def test_importing_parallel_does_not_import_lightning():
    """``rlhf_lit.models`` uses ``rlhf_lit.parallel.fsdp``; only ``rlhf_lit.parallel.strategy`` needs Lightning."""
    import subprocess
    import sys

    code = (
        "import sys; import rlhf_lit.parallel; a = 'lightning' in sys.modules; "
        "import rlhf_lit.parallel.strategy; print(a, 'lightning' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


# ---------------------------------------------------------------- peft (rlhf_lit.models.peft_compat)
def test_peft_switches_a_list_of_adapters_on_and_keeps_dropouts_per_adapter():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlhf_lit.models.peft_compat import activate_adapters, zero_adapter_dropout

    base = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    config = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.5, target_modules=["c_attn"], fan_in_fan_out=True)
    model = get_peft_model(base, config, adapter_name="a")
    model.add_adapter("b", config)
    activate_adapters(model, ["a", "b"])
    layer = next(m for m in model.modules() if hasattr(m, "lora_dropout"))
    assert list(layer.active_adapters) == ["a", "b"]
    # inference_mode=True freezes the activated adapters; AdaptedLM restores its trainable ones afterwards
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    assert isinstance(layer.lora_dropout, torch.nn.ModuleDict) and set(layer.lora_dropout) == {"a", "b"}
    zero_adapter_dropout(model, "b")
    assert layer.lora_dropout["b"].p == 0.0 and layer.lora_dropout["a"].p == 0.5


def test_peft_merge_adds_the_delta_of_each_active_adapter_as_merged_lora_weight_does():
    """``merged_lora_weight`` repeats ``merge_adapter``'s arithmetic out of place: bit for bit, two adapters."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlhf_lit.models.peft_compat import activate_adapters, merged_lora_weight

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True)
    model = get_peft_model(base, config, adapter_name="a")
    model.add_adapter("b", config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    activate_adapters(model, ["a", "b"])
    layer = next(m for m in model.modules() if hasattr(m, "lora_dropout"))
    before = layer.get_base_layer().weight.detach().clone()
    expected = merged_lora_weight(layer)
    assert torch.equal(layer.get_base_layer().weight, before)  # out of place
    model.merge_adapter()
    assert torch.equal(layer.get_base_layer().weight, expected) and not torch.equal(expected, before)


# ---------------------------------------------------------------- transformers (rlhf_lit.models.streamed_export)
def test_transformers_save_time_name_handling_applies_to_a_part_of_a_state_dict():
    """``remove_tied_weights_from_state_dict`` keeps the input embedding of a tied pair (what ``save_pretrained``
    writes); ``revert_weight_conversion`` returns the names of a model without conversions unchanged."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    config = LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    part = {
        k: v for k, v in model.state_dict().items() if "layers" not in k
    }  # one unit: embeddings, norm, head
    kept = remove_tied_weights_from_state_dict(part, model)
    assert set(kept) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert list(revert_weight_conversion(model, kept)) == list(kept)


def test_lightning_module_trainer_attribute_is_none_until_attached():
    """``modules.common.attached_trainer`` reads ``LightningModule._trainer`` (``.trainer`` raises unattached)."""
    import lightning as L

    from rlhf_lit.modules.common import attached_trainer

    module = L.LightningModule()
    assert attached_trainer(module) is None
    with pytest.raises(RuntimeError, match="not attached to a `Trainer`"):
        module.trainer  # noqa: B018


def test_only_the_global_zero_rank_writes_exports():
    """``modules.common.writes_exports``: no trainer (an export by hand) writes; an attached trainer writes on its
    global-zero rank only (every rank still calls ``export`` for the collective gathers)."""
    import lightning as L

    from rlhf_lit.modules.common import writes_exports

    class RankOneTrainer(L.Trainer):
        is_global_zero = property(lambda self: False)

    module = L.LightningModule()
    assert writes_exports(module) is True
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert writes_exports(module) is True
    module.trainer = RankOneTrainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert writes_exports(module) is False
