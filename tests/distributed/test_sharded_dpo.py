"""The preference stage under FSDP2 without any rank holding the whole base: 2 CPU processes (gloo), the
saved ~6 MB tiny Llama of ``test_sharded_load.py``.

One worker launch (``worker.py fsdp2 <out> sharded_dpo``; ``sharded_load.py`` says what is measured) runs one
optimizer step of each ``sharded_load.DPO_KINDS`` kind, built on the meta device
(``trainer.init_module(empty_init=True)``): DPO (sigmoid, LoRA, reference log-probs from a cache), KTO (LoRA,
the reference is the adapter switched off; exported at the end of fit) and full fine-tuning DPO with a frozen
reference copy. Checked:

* nothing of the base is built before sharding (only the LoRA matrices are real after ``__init__``), and
  each rank's peak parameter bytes stay below the whole base (with a reference copy: below the whole policy
  plus its copy, two bases);
* each rank's first loss equals the loss of the module loaded whole (no FSDP, this process) on the same rows,
  within rel 1e-6;
* the reference cache was keyed with the fingerprint of the whole reference weights, taken after the shards
  were filled;
* the KTO export at the end of fit holds every base tensor; those the adapter does not touch are the base's.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlhf_lit.models.reference_cache import tensor_fingerprint
from tests.distributed import sharded_load as SL
from tests.distributed.test_two_processes import _launch

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sharded_dpo")
    full_bytes = SL.save_base(out / "base")
    _launch("fsdp2", out, ["sharded_dpo"])
    ranks = [torch.load(out / f"sharded_dpo_rank{r}.pt", weights_only=False) for r in (0, 1)]
    return {"full_bytes": full_bytes, "ranks": ranks, "base": out / "base", "out": out}


@pytest.mark.parametrize("kind", list(SL.DPO_KINDS))
def test_no_rank_holds_the_whole_base(result, kind):
    full = result["full_bytes"]
    assert full > 5 * 2**20
    bases = 2 if kind == "dpo_copy" else 1  # the policy, and its reference copy
    lora = SL.LORA_BYTES if SL.DPO_KINDS[kind][0] else 0
    for rank in result["ranks"]:
        run = rank[kind]
        assert run["world_size"] == 2
        assert run["samples"]["init"] == lora  # only the LoRA matrices were built for real
        # the rank's shards: about half of each base (FSDP2 pads dim 0 to a multiple of 2 ranks)
        assert 0.45 * bases * full < run["shard_bytes"] - lora < 0.55 * bases * full
        assert len(run["samples"]) > 4 + 6 * bases  # init, configure_model, and the blocks' forwards
        assert run["peak_param_bytes"] < bases * full, run["samples"]
        # the loading itself was seen (shards allocated, rows read in configure_model), below the bases
        assert 0.25 * bases * full < run["samples"]["configure_model_tensors"] < bases * full


@pytest.mark.parametrize("kind", list(SL.DPO_KINDS))
def test_the_first_loss_is_whole_loadings(result, kind):
    losses = []
    for rank in result["ranks"]:
        first = rank[kind]["first_loss"]
        whole = SL.dpo_reference_loss(result["base"], kind, first["input_ids"])
        assert first["loss"] == pytest.approx(whole, rel=1e-6)
        losses.append(first["loss"])
    # the ranks' rows differ, and so do their losses (the NLL term sees the weights)
    assert losses[0] != pytest.approx(losses[1], rel=1e-3)


def test_the_reference_cache_is_keyed_with_the_filled_whole_weights(result):
    whole = SL.whole_dpo(result["base"], "dpo")
    expected = tensor_fingerprint(whole._reference_weights())
    for rank in result["ranks"]:
        assert rank["dpo"]["reference_key"] == expected
    assert len(list((result["out"] / "ref_cache").glob("ref_logps-*.pt"))) == 1  # both ranks: one key
    for kind in ("kto", "dpo_copy"):  # no cache: nothing keyed
        assert result["ranks"][0][kind]["reference_key"] is None


def test_the_kto_export_holds_the_trained_model_over_the_filled_base(result):
    base = load_file(result["base"] / "model.safetensors")
    exported = load_file(result["out"] / "kto_export" / "model.safetensors")
    assert set(base) <= set(exported)
    adapted = [k for k in base if any(f".{m}." in k for m in SL.LORA["target_modules"])]
    assert len(adapted) == 2 * SL.TINY_LLAMA["num_hidden_layers"]
    for key, value in base.items():
        if key not in adapted:
            assert torch.equal(exported[key], value), key
    assert any(not torch.equal(exported[k], base[k]) for k in adapted)  # the merged, trained adapter
