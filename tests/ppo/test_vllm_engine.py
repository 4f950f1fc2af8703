"""``sampling.backend: vllm`` with the real engine: ``rlhf-lit vllm-serve`` in the vLLM virtual environment.

Skipped unless ``RLHF_LIT_VLLM_PYTHON`` names that environment's python (install: ``rlhf_lit.vllm_server.
INSTALL_HINT``; the README's vLLM section). One server (the tiny PPO config's GPT-2 architecture, float32, on
CPU) serves the merged-weights tests of this module: the engine draws from the pushed policy (its log-probs match
the trainer's float32 recomputation), an update it missed fires the rollout-policy guard, and a tiny PPO and a tiny
GRPO run go through ``rlhf-lit fit`` end to end. A second one, ``--enable-lora`` on a tiny Llama (vLLM serves no
LoRA on GPT-2), serves ``sampling.vllm.weight_sync: lora``: the same two checks with the actor adapter as a LoRA
request; it also loads an FSDP2-sharded push through its index (``vllm_sharded_push.py``). An engine that does not start (GPT-2 with ``--enable-lora``) ends ``vllm-serve`` with its own reason in
one line, exit 2.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch

from rlhf_lit import metrics as M
from rlhf_lit.models import BackboneConfig, LoraSettings, load_backbone
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.sampler import adapter_fingerprint
from rlhf_lit.rl.vllm_sampler import VLLMSampler
from rlhf_lit.vllm_server import INSTALL_HINT
from tests.cli.helpers import run_cli
from tests.conftest import REPO_ROOT
from tests.ppo.helpers import make_module
from tests.ppo.test_sampler_guard import _guard_warnings
from tests.ppo.test_vllm_backend import _free_port, _run, skip_one_sync

VLLM_PYTHON = os.environ.get("RLHF_LIT_VLLM_PYTHON")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not VLLM_PYTHON, reason=f"set RLHF_LIT_VLLM_PYTHON to the vLLM environment's python ({INSTALL_HINT})"
    ),
]
# the tiny PPO config's architecture (configs/ppo/tiny.yaml): head_dim 32 (vLLM's CPU attention refuses 16)
ARCH = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 512}
LORA = LoraSettings(r=4, alpha=8, target_modules=["c_attn", "c_fc"])
# a tiny Llama for LoRA requests (head_dim 32), its adapter on attention and MLP projections
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 512}
LLAMA_LORA = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    """``http://127.0.0.1:<port>`` of ``rlhf-lit vllm-serve`` on a saved tiny GPT-2 (stopped afterwards), with a
    64 MiB KV cache instead of vLLM's 1 GiB on CPU."""
    with _serving(tmp_path_factory.mktemp("vllm_model"), ARCH, "--kv-cache-mib", "64") as url:
        yield url


@pytest.fixture(scope="module")
def lora_engine_url(tmp_path_factory):
    """The same with ``--enable-lora --max-lora-rank 8`` on a saved tiny Llama, and vLLM's engine core in child
    processes (``--no-in-process``, the default where CUDA is available) so that path runs here too."""
    flags = ("--enable-lora", "--max-lora-rank", "8", "--no-in-process")
    with _serving(tmp_path_factory.mktemp("vllm_lora_model"), LLAMA, *flags) as url:
        yield url


@contextmanager
def _serving(folder, arch: dict, *flags: str):
    load_backbone(BackboneConfig(tiny=arch, tokenizer="byte")).save_pretrained(folder)
    port = _free_port()
    log = folder / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "rlhf_lit", "vllm-serve", "--python", VLLM_PYTHON, "--model", str(folder),
             "--port", str(port), *flags],
            cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    try:
        deadline = time.monotonic() + 900
        while "ready on" not in log.read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not start: {log.read_text()[-3000:]}")
            time.sleep(2)
        # vLLM took our size, not VLLM_CPU_KVCACHE_SPACE's GiB; without --kv-cache-mib the engine's 1 GiB
        mib = int(flags[flags.index("--kv-cache-mib") + 1]) if "--kv-cache-mib" in flags else 1024
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ or "--kv-cache-mib" in flags:
            assert f"Explicitly set ({round(mib / 1024, 2)}/" in log.read_text(), log.read_text()[-3000:]
        engine_processes = _descendants(server.pid)  # vLLM's engine core, its worker, multiprocessing's tracker
        if "--no-in-process" in flags:
            assert engine_processes, "vLLM runs its engine core in a child process"
        else:  # the CPU default: the engine core and worker in the server's own process, nothing left behind
            assert engine_processes == [], engine_processes
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        code = server.wait(60)
    # a SIGTERM ends the server through vLLM's own shutdown: none of its processes outlives it
    deadline = time.monotonic() + 60
    while (left := [pid for pid in engine_processes if os.path.exists(f"/proc/{pid}")]) and time.monotonic() < deadline:
        time.sleep(1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert (code, left) == (0, []), f"exit {code}; still running after the server: {left}"


def _descendants(pid: int) -> list[int]:
    """The process ids under ``pid`` (Linux ``/proc/<pid>/task/<tid>/children``)."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:  # the process ended meanwhile
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = list(map(int, f.read().split()))
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


def _models(weight_sync: str) -> dict:
    arch, lora = (ARCH, LORA) if weight_sync == "merged" else (LLAMA, LLAMA_LORA)
    return dict(backbone=BackboneConfig(tiny=arch, tokenizer="byte", lora=lora),
                reward_model={"backbone": BackboneConfig(tiny=arch, tokenizer="byte", seed=1)}, critic={"lora": lora})


def _module(url: str, weight_sync: str = "merged"):
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, backend="vllm",
                              vllm={"url": url, "weight_sync": weight_sync})
    return make_module(sampling=sampling, **_models(weight_sync))


@pytest.fixture(params=["merged", "lora"])
def engine(request):
    """``(weight_sync, url)``: each test runs against the merged-weights server and the LoRA one."""
    return request.param, request.getfixturevalue("engine_url" if request.param == "merged" else "lora_engine_url")


def test_the_engine_draws_from_the_pushed_policy(engine):
    weight_sync, url = engine
    module = _module(url, weight_sync)
    policy = module.policy
    with torch.no_grad():  # a trained-looking actor
        for p in policy.actor_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    sampler = module.sampler
    assert isinstance(sampler, VLLMSampler)
    ids = torch.tensor([[0, 0, 70, 71, 72, 73], [60, 61, 62, 63, 64, 65]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    torch.manual_seed(0)
    response, response_mask, _ = sampler.sample(policy, ids, mask)
    record = sampler.last_record
    assert record.fingerprint == adapter_fingerprint(policy.actor_parameters())
    full = torch.cat([ids, response], 1)
    full_mask = torch.cat([mask, response_mask.long()], 1)
    with torch.no_grad():
        trainer = policy(full, full_mask, ids.shape[1], 0.7, want_values=False).logprobs
    gap = (record.logprobs - trainer)[response_mask].abs()
    assert gap.max() < 1e-4, gap  # float32 engine against the float32 trainer at the same temperature
    # the same seed gives the same draws; the engine really holds the pushed actor (the base scores otherwise)
    torch.manual_seed(0)
    again, _, _ = sampler.sample(policy, ids, mask)
    assert torch.equal(again, response)
    with torch.no_grad():
        base = policy.reference_logprobs(full, full_mask, ids.shape[1], 0.7)
    assert (record.logprobs - base)[response_mask].abs().max() > 1e-3
    assert sampler.sync_s > 0
    if weight_sync == "lora":  # the base went once, the adapter as a LoRA request
        assert sampler.pushed[0].startswith(f"{sampler.base_pushed}+") and sampler.adapters == 1


def test_an_update_the_real_engine_missed_fires_the_guard(engine, tmp_path, caplog):
    weight_sync, url = engine
    with caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        module = _run(tmp_path, url, sampler=skip_one_sync, module_overrides=_models(weight_sync),
                      weight_sync=weight_sync)
    warnings = _guard_warnings(caplog)
    assert len(warnings) == 1 and "PPO iteration 2" in warnings[0] and "not the policy's" in warnings[0]
    gaps = [stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP] for stats in module.history]
    assert gaps[0] < 1e-4 and gaps[2] < 1e-4 < gaps[1], gaps


def test_the_real_engine_loads_a_sharded_push_through_its_index(lora_engine_url, tmp_path):
    """An FSDP2-sharded policy's push (one unit per file, ``model.safetensors.index.json``) reaches vLLM's model:
    the engine reports the digest pushed and samples with the merged actor's log-probs, not the base's
    (``vllm_sharded_push.py``, in its own process for its process group)."""
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "tests.ppo.vllm_sharded_push", lora_engine_url, str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    units = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]  # the root and 2 blocks
    assert result["files"] == [*units, "model.safetensors.index.json"] and result["digest_matched"]
    assert result["gap"] < 1e-4 and result["base_gap"] > 1e-3, result


@pytest.mark.parametrize("config", ["configs/ppo/tiny.yaml", "configs/ppo/tiny_grpo.yaml"])
def test_a_tiny_fit_samples_with_vllm_end_to_end(engine_url, tmp_path, config):
    result = run_cli(
        "fit", "--config", config, f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
        "--model.init_args.export_dir=null", "--model.init_args.ppo.total_iterations=2",
        "--model.init_args.sampling.backend=vllm", f"--model.init_args.sampling.vllm.url={engine_url}",
        "--model.init_args.sampling.strict_sync=true",  # the guard stops the run if the engine is not the policy
        "--data.init_args.train_files=[demo:prompts?n=32&seed=0&split=train]",
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "last.ckpt").exists() or any(tmp_path.rglob("*.ckpt"))



@pytest.mark.parametrize("where", ["--no-in-process", "--in-process"])
def test_an_engine_that_does_not_start_ends_the_server_with_its_own_reason(tmp_path, where):
    # vLLM serves no LoRA on GPT-2: its worker refuses; in a child process only the children's log says why
    load_backbone(BackboneConfig(tiny=ARCH, tokenizer="byte")).save_pretrained(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "rlhf_lit", "vllm-serve", "--python", VLLM_PYTHON, "--model", str(tmp_path),
         "--port", "0", "--enable-lora", where],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    err = result.stderr.splitlines()
    assert err[-1] == ("rlhf-lit: error: the vLLM engine did not start: GPT2LMHeadModel does not support LoRA yet. "
                       "(vLLM's log is above)")
    assert [line for line in err if "rlhf-lit: error:" in line] == [err[-1]]
    assert "Engine core initialization failed" not in result.stderr  # the parent's wrapper and its traceback
    if where == "--no-in-process":
        assert "ValueError: GPT2LMHeadModel does not support LoRA yet." in result.stdout  # vLLM's own log, kept
