"""The FSDP2 export streamed one unit at a time (``rlhf_lit.models.streamed_export``) on one process: a gloo
group of world size 1, so ``fully_shard`` applies and every unit is gathered and resharded as on several ranks.
Checked: which unit owns which module, and that the sharded export (merged weights in one safetensors file per
unit + index, the adapter, the config) equals the plain single-process export bit for bit and loads with plain
transformers; a non-finite weight leaves nothing written. The 2-rank case (each rank holds half, the peak per
rank) is ``tests/distributed/test_sharded_dpo.py``."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rlhf_lit.errors import DivergedExportError
from rlhf_lit.models.adapters import AdaptedLM
from rlhf_lit.models.backbone import BackboneConfig, LoraSettings, load_backbone
from rlhf_lit.models.export import save_causal_lm
from rlhf_lit.models.tokenizer import load_tokenizer
from rlhf_lit.parallel import fsdp_units, shard_lm, transformer_blocks
from tests.conftest import TINY_GPT2, TINY_LLAMA

LORA = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
TIED_LLAMA = {**TINY_LLAMA, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from torch.distributed.device_mesh import init_device_mesh

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _lm(spec: dict, adapter: str | None = "default") -> tuple[AdaptedLM, BackboneConfig]:
    """A tiny LM (seed 0) with a LoRA adapter whose B matrices are random (a zero B merges to the base)."""
    cfg = BackboneConfig(tiny=spec, tokenizer="byte")
    torch.manual_seed(0)
    lm = AdaptedLM(load_backbone(cfg, load_tokenizer("byte")), {adapter: LORA} if adapter else None)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return lm, cfg


def _weights(folder) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return load_file(folder / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    out = {}
    for name in sorted(set(weight_map.values())):
        tensors = load_file(folder / name)
        assert {k for k, v in weight_map.items() if v == name} == set(tensors)
        out.update(tensors)
    return out


def test_each_module_belongs_to_its_innermost_unit(mesh):
    lm, _ = _lm(TIED_LLAMA)
    blocks = transformer_blocks(lm.model)
    shard_lm(lm, mesh)
    units, owner = fsdp_units(lm)
    assert units == [lm, *blocks]  # module order: the root first
    base = lm.model.get_base_model()
    assert owner[id(base.model.embed_tokens)] is lm and owner[id(base.lm_head)] is lm
    assert owner[id(base.model.norm)] is lm
    for block in blocks:
        assert all(owner[id(m)] is block for m in block.modules())  # LoRA matrices included
    assert owner[id(lm)] is lm and len(owner) == len(list(lm.modules()))


@pytest.mark.parametrize(
    "spec, adapter, mode",
    [(TIED_LLAMA, "actor", "auto"), (TINY_GPT2, None, "auto"), (TIED_LLAMA, "default", "adapter")],
    ids=["tied_llama_lora", "gpt2_full", "adapter_only"],
)
def test_the_streamed_export_equals_the_single_process_one(mesh, tmp_path, spec, adapter, mode):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer("byte")
    plain, cfg = _lm(spec, adapter)
    save_causal_lm(plain, tok, str(tmp_path / "plain"), cfg, mode)
    sharded, _ = _lm(spec, adapter)
    shard_lm(sharded, mesh)
    save_causal_lm(sharded, tok, str(tmp_path / "sharded"), cfg, mode)
    one, many = tmp_path / "plain", tmp_path / "sharded"
    expected = sorted(os.listdir(one))
    if mode != "adapter":
        units = len(fsdp_units(sharded)[0])  # the root and one per block (2)
        files = [f"model-{i:05d}-of-{units:05d}.safetensors" for i in range(1, units + 1)]
        expected = sorted({*expected, *files, "model.safetensors.index.json"} - {"model.safetensors"})
        a, b = _weights(one), _weights(many)
        assert list(a) and set(a) == set(b)  # a tied LM head written once, under the same name
        for key, value in a.items():
            assert torch.equal(value, b[key]), key
        index = json.loads((many / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in a.values())
        for name in ("config.json", "generation_config.json"):
            assert (one / name).read_text() == (many / name).read_text()
        loaded = AutoModelForCausalLM.from_pretrained(many).state_dict()
        for key, value in a.items():
            assert torch.equal(loaded[key], value), key
    assert sorted(os.listdir(many)) == expected
    if adapter is not None:
        assert sorted(os.listdir(one / "adapter")) == sorted(os.listdir(many / "adapter"))
        a, b = (load_file(f / "adapter" / "adapter_model.safetensors") for f in (one, many))
        assert list(a) and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        config = "adapter/adapter_config.json"
        assert (one / config).read_text() == (many / config).read_text()
    assert (one / "rlhf_lit.json").read_text() == (many / "rlhf_lit.json").read_text()


def test_a_non_finite_weight_in_the_last_unit_leaves_nothing_written(mesh, tmp_path):
    lm, cfg = _lm(TIED_LLAMA)
    last = transformer_blocks(lm.model)[-1]  # found by class name: before FSDP2 renames them
    shard_lm(lm, mesh)
    with torch.no_grad():
        last.mlp.down_proj.weight.to_local()[0, 0] = float("inf")
    with pytest.raises(DivergedExportError, match="inf or nan"):
        save_causal_lm(lm, load_tokenizer("byte"), str(tmp_path / "hf"), cfg)
    assert os.listdir(tmp_path / "hf") == []  # the first units' files, written before, were removed


def test_an_encoder_trunk_is_streamed_too(mesh, tmp_path):
    """A BERT-style trunk (an encoder reward model's): its embeddings and each layer are units of their own."""
    from transformers import AutoModel, BertConfig, BertModel

    config = BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=260
    )
    tok, cfg = load_tokenizer("byte"), BackboneConfig(tiny={"model_type": "bert"}, tokenizer="byte")
    lms = []
    for _ in range(2):
        torch.manual_seed(0)
        lms.append(AdaptedLM(BertModel(config)))
    save_causal_lm(lms[0], tok, str(tmp_path / "plain"), cfg)
    shard_lm(lms[1], mesh)
    assert len(fsdp_units(lms[1])[0]) == 1 + 1 + 2  # the root (pooler), the embeddings, 2 layers
    save_causal_lm(lms[1], tok, str(tmp_path / "sharded"), cfg)
    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "sharded")
    assert list(a) and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "plain" / "config.json").read_text() == (tmp_path / "sharded" / "config.json").read_text()
    loaded = AutoModel.from_pretrained(tmp_path / "sharded").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in a.items())


def test_a_failed_write_raises_and_removes_the_files_written_before(mesh, tmp_path):
    lm, cfg = _lm(TIED_LLAMA)
    shard_lm(lm, mesh)
    folder = tmp_path / "hf"
    (folder / "model-00002-of-00003.safetensors").mkdir(parents=True)  # the second unit's file cannot be written
    with pytest.raises(Exception, match="Is a directory"):  # safetensors' SafetensorError
        save_causal_lm(lm, load_tokenizer("byte"), str(folder), cfg)
    assert os.listdir(folder) == ["model-00002-of-00003.safetensors"]  # the first unit's file removed


@pytest.mark.parametrize("weight_sync", ["merged", "lora"])
def test_the_vllm_push_of_a_sharded_policy_loads_its_merged_weights(mesh, tmp_path, weight_sync):
    """``VLLMSampler.sync`` of an FSDP2-sharded policy walks the units like the export: the engine (transformers
    behind the real server) ends up holding ``merged_weights`` of the same policy unsharded, bit for bit (``merged``:
    the actor merged; ``lora``: the reference weights, then the actor's LoRA matrices), and reports the digest of
    the bytes pushed."""
    from peft import get_peft_model_state_dict

    from rlhf_lit.models.inference_copy import merged_weights
    from rlhf_lit.rl.generation import SamplingConfig
    from rlhf_lit.rl.vllm_client import VLLMClient
    from rlhf_lit.rl.vllm_sampler import VLLMSampler
    from tests.ppo.vllm_fake import TransformersEngine, serving

    plain, cfg = _lm(TIED_LLAMA, "actor")
    expected = merged_weights(plain, "actor" if weight_sync == "merged" else None)
    assert not torch.equal(expected["model.layers.0.self_attn.q_proj.weight"],
                           merged_weights(plain, "actor" if weight_sync == "lora" else None)[
                               "model.layers.0.self_attn.q_proj.weight"])  # the adapter moves the weights
    sharded, _ = _lm(TIED_LLAMA, "actor")
    shard_lm(sharded, mesh)

    class Policy:
        lm = sharded

        def actor_parameters(self):
            return sharded.adapter_parameters("actor")

    torch.manual_seed(1)
    engine = TransformersEngine(load_backbone(cfg, load_tokenizer("byte")), max_lora_rank=8)
    with torch.no_grad():
        for p in engine.lm.parameters():
            p.zero_()  # nothing of the policy before the push
    with serving(engine) as url:
        sampling = SamplingConfig(
            backend="vllm", vllm={"url": url, "weights_dir": str(tmp_path), "weight_sync": weight_sync}
        )
        sampler = VLLMSampler(sampling, [], 0)
        sampler.sync(Policy())
        health = VLLMClient(url).health()
    held = engine.lm.state_dict()
    assert list(expected) and all(torch.equal(held[k], v) for k, v in expected.items())
    folder = tmp_path / "weights-1"
    units = len(fsdp_units(sharded)[0])
    assert sorted(os.listdir(folder)) == sorted(
        [*(f"model-{i:05d}-of-{units:05d}.safetensors" for i in range(1, units + 1)), "model.safetensors.index.json"]
    )
    assert set(_weights(folder)) == set(expected)  # the tied head once
    digest = sampler.pushed[0]
    assert engine.loads == 1 and health["weights"] == digest.split("+")[0] and len(digest.split("+")[0]) == 16
    if weight_sync == "lora":
        adapter = get_peft_model_state_dict(plain.model, adapter_name="actor")
        assert list(adapter) and all(torch.equal(engine.adapter[1][k], v) for k, v in adapter.items())
        assert engine.lora_loads == 1 and digest == f"{health['weights']}+{health['lora']}"
