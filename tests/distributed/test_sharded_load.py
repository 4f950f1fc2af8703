"""FSDP2 without any rank holding the whole base: 2 CPU processes (gloo), SFT on a saved ~6 MB tiny Llama.

One worker launch (``worker.py fsdp2 <out> sharded_sft``; ``sharded_load.py`` says what runs and exactly
what is measured) runs one SFT optimizer step twice: with the base loaded whole on every rank and then
sharded (how a module built outside ``trainer.init_module(empty_init=True)`` loads), and built on the meta
device and filled shard by shard; then one reward-model step built on the meta device. Checked:

* each rank's peak parameter bytes stay below the whole base when built on meta (SFT and reward), and reach
  it when loaded whole (the measurement sees the whole-base case);
* the reward model's first scores equal the whole, unsharded model's;
* the rank's first loss equals the whole, unsharded model's on the same rows (no FSDP, this process);
* after the step, every parameter equals the one of the run that loaded the base whole.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import REPO_ROOT
from tests.distributed import sharded_load as SL
from tests.distributed.test_two_processes import _launch

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sharded_sft")
    full_bytes = SL.save_base(out / "base")
    config = yaml.safe_load((REPO_ROOT / "configs/sft/tiny.yaml").read_text())
    config["model"]["init_args"]["backbone"] = {"name_or_path": str(out / "base"), "tokenizer": "byte"}
    config["data"]["init_args"].update(max_length=128, val_size=8, batch_size=4)  # the base has 128 positions
    (out / "sft.yaml").write_text(yaml.safe_dump(config))
    _launch("fsdp2", out, ["sharded_sft", "sft_cli_sharded"])
    ranks = [torch.load(out / f"sharded_sft_rank{r}.pt", weights_only=False) for r in (0, 1)]
    return {"full_bytes": full_bytes, "ranks": ranks, "base": out / "base", "out": out}


def test_rlhf_lit_fit_under_fsdp2_fills_the_shards_on_every_rank(result):
    """``rlhf-lit fit`` with ``FSDP2Strategy`` builds the SFT module with its base on meta; each rank read its
    shards in ``configure_model`` (every base parameter was still on meta then), trained and exported."""
    out = result["out"]
    run = json.loads((out / "sft_cli.json").read_text())
    assert run["finished"] and run["world_size"] == 2 and run["global_step"] == 2
    assert {"model.safetensors.index.json", "config.json", "rlhf_lit.json"} <= set(run["export"])  # streamed
    base = load_file(result["base"] / "model.safetensors")
    for rank in (0, 1):
        fills = json.loads((out / f"sft_cli_rank{rank}.json").read_text())["fills"]
        assert fills == [len(base)]  # once, with every base tensor left to read
    exported = {}
    for name in run["export"]:  # one file per FSDP unit
        if name.startswith("model-"):
            exported.update(load_file(out / "sft_cli" / "hf" / name))
    assert set(base) <= set(exported)
    assert any(not torch.equal(exported[k], v) for k, v in base.items())  # trained


def test_no_rank_holds_the_whole_base_when_built_on_meta(result):
    full = result["full_bytes"]
    assert full > 5 * 2**20
    for rank in result["ranks"]:
        empty, whole = rank["empty"], rank["whole"]
        assert empty["world_size"] == 2
        reward = rank["reward_empty"]  # the reward model: the same base, plus a (sharded) head
        hidden = SL.TINY_LLAMA["hidden_size"]
        assert reward["samples"]["init"] == (hidden + 1) * 4  # only the head, float32: built for real
        assert reward["peak_param_bytes"] < full, reward["samples"]
        assert empty["samples"]["init"] == 0  # nothing materialised before sharding
        # the rank's shards are about half the base (FSDP2 pads dim 0 to a multiple of 2 ranks)
        assert 0.45 * full < empty["shard_bytes"] < 0.55 * full
        assert len(empty["samples"]) > 4 + 6  # init, configure_model, and the blocks' forwards
        assert empty["peak_param_bytes"] < full, empty["samples"]
        # the loading itself was seen (shards allocated, rows read in configure_model), and stayed below the base
        assert 0.25 * full < empty["samples"]["configure_model_tensors"] < full
        # the measurement sees a whole base: loaded whole, each rank held all of it before sharding
        assert whole["samples"]["init"] == full
        assert whole["peak_param_bytes"] >= full


def test_reward_model_built_on_meta_scores_as_the_whole_unsharded_one(result):
    for rank in result["ranks"]:
        first = rank["reward_empty"]["first_loss"]
        chosen, rejected = SL.reference_scores(result["base"], first["input_ids"])
        torch.testing.assert_close(first["chosen"], chosen, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(first["rejected"], rejected, rtol=1e-5, atol=1e-6)
        assert first["chosen"] != first["rejected"]


def test_sharded_loading_gives_the_same_loss_and_update(result):
    for rank in result["ranks"]:
        first = rank["empty"]["first_loss"]
        reference = SL.reference_loss(result["base"], first["input_ids"])
        assert first["loss"] == pytest.approx(reference, rel=1e-6)
        assert first == rank["whole"]["first_loss"]
        after_empty, after_whole = rank["empty"]["after"], rank["whole"]["after"]
        assert set(after_empty) == set(after_whole) and len(after_empty) > 10
        for name, value in after_whole.items():
            torch.testing.assert_close(after_empty[name], value, rtol=1e-6, atol=1e-7, msg=name)
    # the step moved the weights (every rank gathered the same ones)
    base = load_file(result["base"] / "model.safetensors")
    after = result["ranks"][0]["empty"]["after"]
    moved = [float((after[f"lm.model.{k}"] - v).abs().max()) for k, v in base.items()]
    assert min(moved) > 0, moved
    for name, value in result["ranks"][1]["empty"]["after"].items():
        assert torch.equal(value, after[name]), name
