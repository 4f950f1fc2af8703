"""PPO on two ranks with ``sampling.backend: vllm``: 2 CPU processes (gloo), the saved ~6 MB tiny Llama of
``test_sharded_load.py`` (under FSDP2 the policy built on meta, under DDP loaded whole), one server of the vLLM
protocol (the real server code around a transformers stand-in of the engine, ``tests/ppo/vllm_fake.py``) in this
test's process.

One worker launch per strategy (``worker.py <fsdp2|ddp> <out> sharded_vllm``, ``vllm_push.py``) runs two PPO
iterations. Checked: every rank samples its own prompts through the one server; each ``sync`` is pushed by rank 0
(FSDP2: gathered one FSDP unit at a time, the peak bytes a rank holds during a push far below the whole base), the
engine then holds the policy's merged weights bit for bit, and every rank expects the digest the engine reports
(the rollout-policy guard, strict here, finds no stale weights and a log-prob gap of float rounding only); a push
rank 0 cannot deliver raises on every rank; a colocated sampler is refused on every rank.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlhf_lit import metrics as M
from tests.distributed import sharded_load as SL
from tests.distributed.test_two_processes import _launch

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_ppo_on_two_ranks_samples_through_one_vllm_server(tmp_path, strategy):
    """FSDP2: the push gathered one unit at a time; DDP: rank 0 pushes its whole copy. Both: one push per sync,
    every rank told the digest, the engine holds the policy's merged weights."""
    from transformers import AutoModelForCausalLM

    from rlhf_lit.models.tokenizer import load_tokenizer
    from rlhf_lit.rl.vllm_client import VLLMClient
    from tests.ppo.vllm_fake import TransformersEngine, serving

    full = SL.save_base(tmp_path / "base")
    engine = TransformersEngine(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval(), load_tokenizer("byte").pad_token_id
    )
    base = {k: v.clone() for k, v in engine.lm.state_dict().items()}
    with serving(engine) as url:
        (tmp_path / "vllm_url").write_text(url)
        _launch(strategy, tmp_path, ["sharded_vllm"])
        health = VLLMClient(url).health()
    ranks = [torch.load(tmp_path / f"sharded_vllm_rank{r}.pt", weights_only=False) for r in (0, 1)]

    # the fit: 2 iterations; each rank sent its own 2 prompts per iteration to the one server
    for rank in ranks:
        assert rank["world_size"] == 2 and rank["iteration"] == 2 and len(rank["history"]) == 2
    assert [len(r.prompts) for r in engine.requests] == [2] * 4
    # 3 pushes (before the first sample, after each update), each loaded once, every rank told its digest
    assert engine.loads == 3
    digests = ranks[0]["digests"]
    assert ranks[1]["digests"] == digests and len(set(digests)) == 3 and digests[-1] == health["weights"]
    # the guard (strict_sync: a stale engine would have stopped the fit) saw the pushed adapter, no drift
    for rank in ranks:
        assert not rank["record_fingerprint"].startswith("engine:")
        for values in rank["history"]:
            assert values[M.ROLLOUT_SAMPLER_LOGPROB_GAP] < 1e-4, values
    # the engine holds the policy's merged weights after the last update (its streamed export), bit for bit
    folder = tmp_path / "vllm_policy"
    exported = {}
    if strategy == "ddp":  # not sharded: one file
        exported = load_file(folder / "model.safetensors")
    else:
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        for name in sorted(set(index.values())):
            exported.update(load_file(folder / name))
    held = engine.lm.state_dict()
    assert set(exported) == {k for k in base if k != "lm_head.weight"}  # the tied head once
    assert all(torch.equal(held[k], v) for k, v in exported.items())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(held[q], base[q])  # the updates moved the merged weights: the check has teeth
    # a push that fails on rank 0 (no server) raises on every rank, not only on the rank that pushed
    assert "http://127.0.0.1:9 (sampling.vllm.url) is not reachable" in ranks[0]["failure"]
    assert ranks[1]["failure"].startswith("rank 0's weight push to the vLLM engine failed: SamplerEngineError: ")
    assert "is not reachable" in ranks[1]["failure"]
    # sampling.vllm.mode: colocated is one engine in one process: refused on every rank, no engine started
    for rank in ranks:
        assert rank["colocated_refusal"].startswith(
            "sampling.vllm.mode: colocated runs one engine in one training process; this run has 2."
        ), rank["colocated_refusal"]
    # FSDP2: no rank held the whole base while pushing: its shards (not counted) plus about one unit gathered
    assert full > 5 * 2**20
    for rank in ranks:
        assert len(rank["push_peaks"]) == 3
        if strategy == "fsdp2":
            assert max(rank["push_peaks"]) < 0.5 * full, (rank["push_peaks"], full)
