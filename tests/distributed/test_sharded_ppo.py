"""PPO under FSDP2 without any rank holding the policy's whole base: 2 CPU processes (gloo), the saved ~6 MB
tiny Llama of ``test_sharded_load.py``, a reward function (no reward model).

One worker launch (``worker.py fsdp2 <out> sharded_ppo``) runs one PPO iteration (GAE, actor and critic LoRA
adapters, 2 prompts per rank, sampling with synchronised ranks), and one GRPO iteration (2 responses per prompt,
no critic), each twice: the module built with the base loaded
whole on every rank, then built under ``trainer.init_module(empty_init=True)``. Checked:

* built on meta, nothing of the base is real after ``__init__`` (the adapters and the value head only), and the
  rank's peak parameter bytes through sampling, the experience pass and the update stay below the whole base;
  so do its shards plus what it holds during the policy's export at the end of fit (``sharded_load.HeldBytes``);
* the iteration logs what the whole-loaded run logs (reference perplexity, entropy, value loss, scores, ...: all
  computed before its one optimizer step): the same weights, read shard by shard (the LoRA A matrices are drawn
  on another path, B is zero: the same function until the first update);
* ``rlhf-lit fit`` of a PPO config (packing on) under FSDP2 reads the policy's and the reward model's shards on
  every rank and exports.
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
    out = tmp_path_factory.mktemp("sharded_ppo")
    full_bytes = SL.save_base(out / "base")
    config = yaml.safe_load((REPO_ROOT / "configs/ppo/tiny.yaml").read_text())
    init = config["model"]["init_args"]
    init["backbone"] = {**init["backbone"], "name_or_path": str(out / "base"), "tiny": None}
    init["backbone"]["lora"] = dict(SL.LORA)
    init["reward_model"] = {"backbone": {"name_or_path": str(out / "base"), "tokenizer": "byte", "seed": 1}}
    init["ppo"].update(total_iterations=2, checkpoint_every=None)
    init["packing"] = True
    init["sampling"]["max_new_tokens"] = 8
    (out / "ppo.yaml").write_text(yaml.safe_dump(config))
    _launch("fsdp2", out, ["sharded_ppo", "ppo_cli_sharded"])
    ranks = [torch.load(out / f"sharded_ppo_rank{r}.pt", weights_only=False) for r in (0, 1)]
    return {"full_bytes": full_bytes, "ranks": ranks, "out": out, "base": out / "base"}


def test_rlhf_lit_fit_under_fsdp2_fills_the_policy_and_the_reward_model_on_every_rank(result):
    """``rlhf-lit fit`` of a PPO config (packing on) with ``FSDP2Strategy``: the policy's base and the separate
    reward model are built on meta; each rank reads its shards of both in ``configure_model`` (every base tensor
    still on meta then), runs its iterations and exports."""
    out = result["out"]
    run = json.loads((out / "ppo_cli.json").read_text())
    assert run["finished"] and run["world_size"] == 2 and run["iteration"] == 2 and run["packing"] is True
    assert {"model.safetensors.index.json", "config.json", "rlhf_lit.json"} <= set(run["export"])  # streamed
    base = load_file(result["base"] / "model.safetensors")
    for rank in (0, 1):
        fills = json.loads((out / f"ppo_cli_rank{rank}.json").read_text())["fills"]
        assert fills == [len(base), len(base)]  # the policy's base, then the reward model's: every tensor


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_no_rank_holds_the_policys_whole_base(result, estimator):
    full = result["full_bytes"]
    assert full > 5 * 2**20
    for rank in result["ranks"]:
        whole, empty = rank[estimator]["whole"], rank[estimator]["empty"]
        assert whole["world_size"] == empty["world_size"] == 2
        assert whole["samples"]["init"] > full  # loaded whole: the base and the adapters
        assert empty["samples"]["init"] < 0.05 * full  # on meta: the adapters (and the value head) only
        assert 0.45 * full < empty["shard_bytes"] < 0.6 * full  # about half the base (+ adapters, head)
        assert len(empty["samples"]) == 2 + 2 * 6  # init, configure_model, and the 6 blocks' forwards
        assert empty["peak_param_bytes"] < full, empty["samples"]


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_no_rank_holds_the_whole_policy_during_the_export(result, estimator):
    """The policy built on meta is exported at the end of fit one FSDP unit at a time (``models.streamed_export``):
    a block gathered and its actor adapter merged, never the whole base; the critic adapter is not exported."""
    full = result["full_bytes"]
    for rank in result["ranks"]:
        empty = rank[estimator]["empty"]
        held, shards = empty["export_held"], empty["shard_bytes"]
        assert 0.1 * full < held < 0.4 * full, (held, full)
        assert shards + held < 0.9 * full, (shards, held, full)
    exported = result["out"] / f"{estimator}_empty_export"
    assert {"model.safetensors.index.json", "config.json"} <= {p.name for p in exported.iterdir()}


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_the_first_iteration_logs_what_whole_loading_logs(result, estimator):
    """Every statistic but the timings and the gradient norm (the gradient of B depends on A) is computed
    before the iteration's one optimizer step: reference perplexity, entropy, value loss, scores, ..."""
    for rank in result["ranks"]:
        whole, empty = rank[estimator]["whole"]["history"], rank[estimator]["empty"]["history"]
        assert len(whole) == len(empty) == 1
        keys = [k for k in whole[0] if not k.startswith("perf/") and k != "ppo/grad_norm"]
        assert {"monitor/ref_perplexity", "ppo/entropy", "rollout/score_mean"} <= set(keys)
        assert ("ppo/value_loss" in keys) == (estimator == "gae")
        for key in keys:
            assert empty[0][key] == pytest.approx(whole[0][key], rel=1e-5, abs=1e-6), key
