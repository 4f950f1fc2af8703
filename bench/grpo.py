"""Workload ``grpo``: rlhf_lit's ``PPOModule`` with ``ppo.advantage_estimator: grpo`` under
``lightning.Trainer.fit``, on the workload of ``bench/grpo_workload.py`` (TRL's side: ``bench/grpo_trl.py``).

The module is built the way a user's config would build it (no subclass): the base artefact with the
actor LoRA adapter (the reference = adapters off), no critic (GRPO builds none), the reward a
``reward_model`` list with one Python function (``bench.grpo_workload:rlhf_lit_reward``), 4 prompts x 4
samples per rollout (``sampling.num_samples_per_prompt``), the KL as a k3 loss term (beta 0.04), the token
mean over the minibatch as the loss aggregation (TRL's default ``dapo``), GRPO's group-std scaling, 4 epochs x
4 minibatches of 4, gradient clipping at 1.0, lr 3e-6 decayed linearly per optimizer step (the module's
schedule: the same as TRL's Trainer), 2 iterations, fp32, seed 42. ``model`` picks the base
(``grpo_workload.MODELS``: ``tiny`` or ``smollm2``) and ``backend`` the sampler's ``sampling.backend`` (``hf``, the
default, or ``static``), or ``bf16copy`` (``hf`` on a bf16 copy), or ``colocated`` (``vllm`` with
``sampling.vllm.mode: colocated``: the engine in this process, run by the vLLM environment's python with the same
options as the server below), or ``vllm``: the run starts ``rlhf-lit
vllm-serve`` on the same model folder in ``$RLHF_LIT_VLLM_PYTHON`` (float32, ``--max-model-len 512``, a 128 MiB KV
cache, ``--threads`` threads; its start is not timed and is reported as ``vllm_start_s``), samples through it with
``sampling.vllm.weight_sync: merged`` (the weights pushed after every update), and counts the server's processes
in ``peak_rss_mb`` (the sum of each one's peak, ``vllm_peak_rss_mb``, added to this process's).

Measured like the PPO workload (``bench/ppo.py``): ``iter_wall_s`` between iteration ends (the first from
``on_train_start``), phases from ``PPOModule.history`` (``perf/*``) and timers around the reference and
actor passes and the reward call; plus ``first_step_ratio_max_dev``: max |ratio - 1| over the response
tokens of the first minibatch of the first iteration, read from the objective's inputs (a wrapper; the
module's code is not modified). It must be 0.
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from bench.common import (
    T_PROCESS_START,
    W,
    current_rss_mb,
    env_info,
    peak_rss_mb,
    setup_child,
    tree_peak_rss_mb,
)
from bench.grpo_workload import GRPO, LORA, model_dir, steps_per_iteration, tokenizer_dir, workload
from bench.ppo import instrument, prompt_datamodule

#: The engine's KV cache, MiB, server and colocated alike (vLLM's 1 GiB default on CPU otherwise).
KV_CACHE_MIB = 128


def build_module(iterations: int, model: str = "tiny", backend: str = "hf", vllm_url: str | None = None):
    from rlhf_lit.models.backbone import BackboneConfig, LoraSettings
    from rlhf_lit.modules import PPOModule
    from rlhf_lit.modules.common import OptimizerConfig
    from rlhf_lit.rewards import RewardSourceConfig
    from rlhf_lit.rl.generation import SamplingConfig
    from rlhf_lit.rl.settings import KLConfig, PPOConfig, RewardShapingConfig

    g = GRPO
    return PPOModule(
        backbone=BackboneConfig(name_or_path=str(model_dir(model)), dtype="float32", lora=LoraSettings(**LORA)),
        reward_model=[RewardSourceConfig(name="short_words", function="bench.grpo_workload:rlhf_lit_reward")],
        sampling=SamplingConfig(
            max_new_tokens=g["max_new_tokens"],
            temperature=g["temperature"],
            top_k=g["top_k"],
            top_p=g["top_p"],
            stop_at_eos=True,
            num_samples_per_prompt=g["group_size"],
            merge_adapter=True,  # a speed knob, off by default (as in the PPO workload)
            backend={"bf16copy": "hf", "colocated": "vllm"}.get(backend, backend),  # hf (default), static, vllm
            copy_dtype="bfloat16" if backend == "bf16copy" else None,  # bf16copy: hf on a bf16 copy
            vllm=vllm_settings(backend, vllm_url),
        ),
        ppo=PPOConfig(
            advantage_estimator="grpo",
            scale_by_std=True,
            loss_aggregation="token_mean",
            kl_placement="loss",
            ppo_epochs=g["epochs"],
            ppo_minibatch_size=g["mini_batch_size"],
            clip_range=g["clip_range"],
            entropy_coef=0.0,
            max_grad_norm=g["max_grad_norm"],
            total_iterations=iterations,
            seed=g["seed"],
        ),
        kl=KLConfig(kl_coef=g["beta"], estimator="k3", adaptive=False),
        reward=RewardShapingConfig(normalize=False, clip=None, missing_eos_penalty=None),
        optimizer=OptimizerConfig(
            lr=g["learning_rate"],
            weight_decay=0.0,
            betas=(0.9, 0.999),
            eps=1e-8,
            scheduler="linear",
            warmup_steps=0,
        ),
        log_samples_every=0,
    )


def vllm_settings(backend: str, url: str | None):
    """``sampling.vllm`` of a backend: float32, merged weights; ``colocated``: the engine in this process, with the
    server's options (``--max-model-len 512``, a 128 MiB KV cache)."""
    from bench.common import MAX_MODEL_LEN
    from rlhf_lit.rl.generation import VLLMSettings

    if backend == "colocated":
        return VLLMSettings(mode="colocated", max_model_len=MAX_MODEL_LEN, kv_cache_mib=KV_CACHE_MIB)
    return VLLMSettings(url=url) if url else VLLMSettings()


def watch_first_ratio(module) -> dict:
    """Record max |exp(logp - old_logp) - 1| of the first minibatch the objective sees (a wrapper)."""
    import torch

    seen: dict = {}
    original = module.objective.loss

    def loss(out, mb, terms):
        if "max_dev" not in seen and out.logprobs is not None:
            with torch.no_grad():
                ratio = torch.exp(out.logprobs.detach() - mb.old_logprobs)
                seen["max_dev"] = float((ratio - 1).abs()[mb.mask.bool()].max())
                seen["tokens"] = int(mb.mask.sum())
        return original(out, mb, terms)

    module.objective.loss = loss
    return seen


@contextmanager
def vllm_server(model: str, threads: int):
    """``rlhf-lit vllm-serve`` on ``model_dir(model)`` in ``$RLHF_LIT_VLLM_PYTHON`` (see the module docstring):
    yields ``(url, server process, start seconds)``; stopped on exit."""
    import socket
    import tempfile

    from bench.vllm_sampling import start_server, wait_ready

    python = os.environ.get("RLHF_LIT_VLLM_PYTHON")
    if not python:
        raise SystemExit("--grpo-backends ...,vllm needs RLHF_LIT_VLLM_PYTHON (the vLLM environment's python)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_file = Path(tempfile.mkdtemp(prefix="grpo_vllm_")) / "server.log"
    t0 = time.perf_counter()
    server = start_server(SimpleNamespace(threads=threads, vllm_python=python), str(model_dir(model)), port,
                          log_file, "--kv-cache-mib", str(KV_CACHE_MIB))
    try:
        wait_ready(server, log_file)
        yield f"http://127.0.0.1:{port}", server, time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(60)


def child_grpo(threads: int, iterations: int, model: str = "tiny", backend: str = "hf") -> dict:
    if backend != "vllm":
        return _child_grpo(threads, iterations, model, backend)
    setup_child(threads)
    with vllm_server(model, threads) as (url, server, start_s):
        result = _child_grpo(threads, iterations, model, backend, url)
        peaks = tree_peak_rss_mb(server.pid)
    result["metrics"].update(vllm_start_s=start_s, vllm_peak_rss_mb=sum(peaks.values()),
                             trainer_peak_rss_mb=result["peak_rss_mb"])
    result["details"]["vllm_processes_peak_rss_mb"] = peaks
    result["peak_rss_mb"] += sum(peaks.values())  # all processes
    return result


def _child_grpo(threads: int, iterations: int, model: str, backend: str, vllm_url: str | None = None) -> dict:
    setup_child(threads)
    import lightning as L
    from transformers import AutoTokenizer

    from rlhf_lit import metrics as M

    L.seed_everything(GRPO["seed"], verbose=False)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(model), padding_side="left")
    datamodule = prompt_datamodule(tok, W.load_ppo_prompts(tok), GRPO["prompts_per_rollout"], GRPO["seed"])
    module = build_module(iterations, model, backend, vllm_url)
    assert module.tokenizer.get_vocab() == tok.get_vocab()
    assert not module.policy.has_critic, "GRPO must build no critic"
    timers = instrument(module)
    first_ratio = watch_first_ratio(module)
    marks: dict = {"train_begin": None, "ends": []}

    class Marks(L.Callback):
        def on_train_start(self, trainer, pl_module):
            marks["train_begin"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            marks["ends"].append(time.perf_counter())
            timers.close_iteration()

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_epochs=-1,
        limit_train_batches=iterations,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Marks()],
    )
    rss_before = current_rss_mb()
    setup_s = time.perf_counter() - T_PROCESS_START
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    # colocated: the engine starts inside the first rollout; like the server's start (vllm_start_s), not timed
    engine_start_s = getattr(module.sampler, "start_s", 0.0)
    wall = time.perf_counter() - t0 - engine_start_s

    hist = module.history
    assert len(hist) == iterations == len(marks["ends"]), (len(hist), len(marks["ends"]))
    starts = [marks["train_begin"]] + marks["ends"][:-1]
    it_wall = [e - s for s, e in zip(starts, marks["ends"])]
    it_wall[0] -= engine_start_s
    phase = timers.done
    sequences = GRPO["prompts_per_rollout"] * GRPO["group_size"]
    gen_tokens = [h[M.PERF_GENERATION_TOKENS_PER_S] * h[M.PERF_GENERATION_S] for h in hist]
    gen_s = [h[M.PERF_GENERATION_S] for h in hist]
    gen_s[0] -= engine_start_s
    mean = statistics.fmean
    return dict(
        wall_s=wall,
        throughput=iterations * sequences / wall,
        unit="episodes/s",
        peak_rss_mb=peak_rss_mb(),
        metrics=dict(
            iter_wall_s=mean(it_wall),
            iter2_wall_s=it_wall[-1],
            gen_tokens_per_s=sum(gen_tokens) / sum(gen_s),
            gen_tokens_per_iter=mean(gen_tokens),  # rows x decoding steps (B x R), as TRL's side counts them
            response_len_mean=mean(h[M.ROLLOUT_RESPONSE_LEN] for h in hist),
            gen_s_per_iter=mean(gen_s),
            experience_s_per_iter=mean(h[M.PERF_EXPERIENCE_S] for h in hist),
            update_s_per_iter=mean(h[M.PERF_UPDATE_S] for h in hist),
            sync_s_per_iter=mean(h[M.PERF_SYNC_S] for h in hist),  # part of update_s: the engine's weight push
            reference_s_per_iter=mean(p.get("reference_s", 0.0) for p in phase),
            old_logprobs_s_per_iter=mean(p.get("old_logprobs_values_s", 0.0) for p in phase),
            reward_s_per_iter=mean(p.get("reward_s", 0.0) for p in phase),
            update_forward_s_per_iter=mean(p.get("update_forward_s", 0.0) for p in phase),
            setup_s=setup_s,
            rss_before_train_mb=rss_before,
            reward_mean=mean(h[M.ROLLOUT_SCORE_MEAN] for h in hist),
            first_step_ratio_max_dev=first_ratio.get("max_dev"),
            kl_ref_iter1=hist[0][M.ROLLOUT_KL_REF],
            **({"vllm_start_s": engine_start_s} if backend == "colocated" else {}),
        ),
        details=details(trainer, module, iterations, it_wall, first_ratio, threads, model, backend),
    )


def details(
    trainer, module, iterations: int, it_wall: list[float], first_ratio: dict, threads: int, model: str, backend: str
) -> dict:
    opt = trainer.optimizers[0]
    return dict(
        per_iteration=[
            dict(iter_wall_s=w, **{k: v for k, v in h.items() if k.startswith(("perf/", "rollout/"))})
            for w, h in zip(it_wall, module.history)
        ],
        driver="lightning.Trainer.fit(PPOModule, advantage_estimator=grpo) (logger and checkpointing off)",
        optimizer=f"{type(opt).__name__}(fused={opt.defaults.get('fused')})",
        optimizer_steps=trainer.global_step,
        optimizer_steps_per_iteration=trainer.global_step // iterations,
        expected_steps_per_iteration=steps_per_iteration(),
        final_lr=opt.param_groups[0]["lr"],
        trainable_params=sum(p.numel() for p in module.policy.actor_parameters()),
        critic_params=sum(p.numel() for p in module.policy.critic_parameters()),
        first_step_ratio=first_ratio,
        workload=dict(workload(model), iterations=iterations),
        effective=dict(
            sampling_backend=backend,
            precision=str(trainer.precision),
            gradient_checkpointing=False,
            optimizer=f"{type(opt).__name__}(fused={opt.defaults.get('fused')})",
        ),
        env=env_info(threads),
    )
