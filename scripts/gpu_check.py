"""The GPU check's driver (``scripts/gpu_check.sh`` sets the environment and calls it; its header says how to
run it on a lent GPU, in how much device time).

On one CUDA GPU, for random-initialised Qwen2-shaped models of ~0.5B and ~1.5B parameters (the dimensions of
Qwen2.5-0.5B / 1.5B, built in code: no weights, no download) and the offline byte tokenizer, it measures:

* sampling tokens/s and peak GPU memory for each sampling backend, called directly with ``model.generate``:
  ``hf`` (dynamic KV cache, what ``rlhf_lit.rl.generation.sample_responses`` does), ``static``
  (``cache_implementation="static"``, not compiled), ``static_compiled`` (the same with the decode forward
  compiled by transformers' ``CompileConfig``; a compile failure is reported, not raised) and ``paged``
  (transformers continuous batching ``generate_batch``, or the reason it is unavailable);
* one PPO (GAE, critic adapter) and one GRPO iteration end to end through ``PPOModule`` and a Lightning
  ``Trainer`` (the second of two iterations; the first pays for warm-up): tokens/s (response tokens over the
  iteration's seconds), the phase split generation / experience / update from the module's ``perf/*``
  metrics (host clocks at the phase boundaries, as the module logs them), update MFU and peak GPU memory;
* the 4-bit NF4 base path (sampling and one GRPO iteration) when bitsandbytes is installed.

It writes ``<out>/gpu_check.json`` and ``<out>/gpu_check.md`` (a README-ready table). Every measurement is a
dict of numbers or one string that starts with ``skipped:``, ``unavailable:`` or ``failed:`` and says why.

Update MFU = 6 x N x T x passes / update seconds / peak, where N is the policy's parameter count (tied
embeddings counted once: they are the LM head's matmul), T the tokens (prompt + response) the update reads
over its epochs, passes 2 for PPO with a separate critic adapter (actor and critic backward run one after the
other) and 1 for GRPO; peak = 989 TFLOP/s, the H100 and H200 SXM's dense bf16 rate by the vendors' datasheets. 6N is the
full-training convention: LoRA computes no gradient for the frozen base weights (about 4N), so this MFU
overstates the useful work by up to 1.5x and is comparable between runs, not with full fine-tuning figures.

The PPO/GRPO iterations sample through the module's own samplers: ``hf`` on every size and ``static``
(``sampling.backend: static``; on CUDA transformers compiles its decoding step) on the sizes where the compiled
sampler is measured, and there ``vllm`` too (``sampling.vllm.mode: colocated``, the engine in the trainer's
process and dtype) when vLLM imports (it is not on the lent GPU machine: reported skipped); ``paged`` iterations are
reported unavailable (the module does not offer continuous
batching: ``rlhf_lit.rl.generation.SamplingConfig``'s ``backend`` says why).

    python scripts/gpu_check.py --out DIR [--sizes 0.5b,1.5b] [--budget-s 360] [--dry-run]

``--dry-run`` runs every step on the CPU with a tiny Qwen2-shaped model (2 layers, hidden 64) and tiny
workloads, in float32, to check the script without a GPU; it never imports ``datasets``, ``jsonargparse`` or
``docstring_parser`` (nor needs bitsandbytes), which the GPU machine lacks.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a file: the repository's rlhf_lit, not an installed copy
    sys.path.insert(0, str(REPO_ROOT))

PEAK_BF16_FLOPS = (
    989e12  # H100 and H200 SXM, dense bf16 (vendor datasheets); the cards measured ~790 here on random data
)
PEAK_NOTE = "989 TFLOP/s: H100 and H200 SXM dense bf16, vendor datasheets"
QWEN2_COMMON = {"model_type": "qwen2", "vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1e6}
# the dimensions of Qwen2.5-0.5B and Qwen2.5-1.5B (their config.json); weights are random
SIZES = {
    "0.5b": {
        **QWEN2_COMMON,
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "max_position_embeddings": 4096,
    },
    "1.5b": {
        **QWEN2_COMMON,
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
        "max_position_embeddings": 4096,
    },
}
TINY = {
    "model_type": "qwen2",
    "vocab_size": 512,
    "tie_word_embeddings": True,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
}
# workloads: sampling (prompts x prompt tokens -> new tokens), the PPO rollout (prompts), GRPO (prompts x group)
GPU_WORK = {
    "batch": 64,
    "prompt_len": 64,
    "new_tokens": 128,
    "ppo_prompts": 32,
    "grpo_prompts": 8,
    "group": 4,
}
DRY_WORK = {"batch": 4, "prompt_len": 8, "new_tokens": 6, "ppo_prompts": 4, "grpo_prompts": 2, "group": 2}
BACKENDS = ("hf", "static", "static_compiled", "paged")
ITERATION_BACKENDS = ("hf", "static", "vllm", "paged")
#: Why the vLLM iterations are not measured where vLLM does not import (the lent GPU machine has no network, and a
#: vLLM wheel is far larger than the 64 MiB a call carries).
VLLM_MISSING = "skipped: vllm not installed (pip install vllm where this runs to measure sampling.backend: vllm, colocated)"


class Clock:
    """Wall-clock budget: a measurement that would start after ``budget_s`` is skipped with its reason."""

    def __init__(self, budget_s: float) -> None:
        self.start, self.budget_s = time.perf_counter(), budget_s

    def used(self) -> float:
        return time.perf_counter() - self.start

    def over(self) -> str | None:
        if self.used() > self.budget_s:
            return f"skipped: time budget ({self.used():.0f} s used of {self.budget_s:.0f} s)"
        return None


def installed(name: str) -> bool:
    """Whether a package can be found (a blocking import hook that raises counts as absent)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _reset_peak(device: torch.device) -> None:
    gc.collect()  # models left by the previous measurement (transformers models hold reference cycles)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_mib(device: torch.device) -> float | str:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return "unavailable: no CUDA device (CPU dry run)"


def _failed(err: BaseException) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"failed: {type(err).__name__}: {first[:300]}"


def _guarded(clock: Clock, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or the reason it was skipped or failed (the traceback goes to stderr)."""
    reason = clock.over()
    if reason:
        return reason
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # a measurement that breaks is reported; the check goes on
        traceback.print_exc()
        return _failed(err)


# ---------------------------------------------------------------------------------------------- models
def build_causal_lm(spec: dict, dtype: torch.dtype, device: torch.device):
    """A random-initialised causal LM from a config dict, built directly on ``device`` (no CPU copy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    config = AutoConfig.for_model(
        spec.pop("model_type"), **spec, pad_token_id=1, eos_token_id=0, bos_token_id=0
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def update_mfu(params: int, update_tokens: int, passes: int, update_s: float) -> float:
    """Model FLOPs utilisation of an update: ``6 * params * update_tokens * passes / update_s`` over
    ``PEAK_BF16_FLOPS`` (a fraction; the 6N-per-token convention of Kaplan et al. 2020, forward 2N + backward 4N)."""
    return 6 * params * update_tokens * passes / update_s / PEAK_BF16_FLOPS


def count_params(model: torch.nn.Module) -> int:
    """Parameters counted once each (tied embedding and LM head are one tensor)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def synthetic_prompts(n: int, length: int, seed: int) -> torch.Tensor:
    """``(n, length)`` random byte-symbol ids (4..259 of the byte tokenizer), no padding."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, 260, (n, length), generator=gen)


# ---------------------------------------------------------------------------------------------- sampling
def _generation_config(work: dict, **extra):
    from transformers import GenerationConfig

    # min_new_tokens = max_new_tokens: every row samples exactly new_tokens, so backends do equal work
    return GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=None,
        top_p=None,
        max_new_tokens=work["new_tokens"],
        min_new_tokens=work["new_tokens"],
        eos_token_id=[0],
        pad_token_id=1,
        use_cache=True,
        **extra,
    )


def _compile_config(dry_run: bool):
    from transformers import CompileConfig

    if dry_run:  # the CPU dry run exercises the path with the cheap eager backend (no C++ build)
        config = CompileConfig(backend="eager", mode=None, fullgraph=False)
        config._compile_all_devices = True  # transformers compiles on CUDA only unless told otherwise
        return config
    return CompileConfig(fullgraph=False, mode="reduce-overhead")


def _timed_generate(model, work: dict, device: torch.device, gen_kwargs: dict, repeats: int = 2) -> dict:
    prompts = synthetic_prompts(work["batch"], work["prompt_len"], seed=1).to(device)
    mask = torch.ones_like(prompts)
    _reset_peak(device)
    t = time.perf_counter()
    model.generate(input_ids=prompts, attention_mask=mask, **gen_kwargs)  # warm-up (compile, allocator)
    _sync(device)
    warmup_s = time.perf_counter() - t
    times, new = [], 0
    for _ in range(repeats):
        t = time.perf_counter()
        out = model.generate(input_ids=prompts, attention_mask=mask, **gen_kwargs)
        _sync(device)
        times.append(time.perf_counter() - t)
        new = out[:, prompts.shape[1] :].numel()
    seconds = sorted(times)[len(times) // 2]
    return {
        "tokens_per_s": new / seconds,
        "seconds": seconds,
        "warmup_s": warmup_s,
        "new_tokens": new,
        "peak_gpu_memory_mib": _peak_mib(device),
    }


def sample_hf(model, work, device, dry_run):
    return _timed_generate(model, work, device, {"generation_config": _generation_config(work)})


def sample_static(model, work, device, dry_run):
    config = _generation_config(work, cache_implementation="static", disable_compile=True)
    return _timed_generate(model, work, device, {"generation_config": config})


def sample_static_compiled(model, work, device, dry_run):
    config = _generation_config(work, cache_implementation="static", compile_config=_compile_config(dry_run))
    try:
        return _timed_generate(model, work, device, {"generation_config": config})
    finally:
        torch._dynamo.reset()  # the compiled graphs hold the static cache's shapes; free them for what follows


def sample_paged(model, work, device, dry_run):
    """Continuous batching (``generate_batch``): a list of prompts in, one output per request back."""
    import transformers

    if not hasattr(model, "generate_batch"):
        return f"unavailable: transformers {transformers.__version__} has no generate_batch"
    prompts = synthetic_prompts(work["batch"], work["prompt_len"], seed=1).tolist()
    config = _generation_config(work)
    # a paged cache sized for the workload: left alone, transformers sizes it from free memory (slow on a CPU,
    # and on a GPU the cache, not the model, would set the peak memory)
    per_request = -(-(work["prompt_len"] + work["new_tokens"]) // 256)
    sizes = {
        "num_blocks": work["batch"] * per_request + 4,
        "max_batch_tokens": min(8192, work["batch"] * work["prompt_len"]),
    }
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        # the page's size is `page_size` in transformers 5.24 and `block_size` in 5.17 (the GPU image's)
        fields = inspect.signature(ContinuousBatchingConfig.__init__).parameters
        page = {"page_size" if "page_size" in fields else "block_size": 256}
        kwargs = {"continuous_batching_config": ContinuousBatchingConfig(**page, **sizes)}
    except ImportError:  # older transformers read the sizes from the generation config
        kwargs = {}
        for key, value in sizes.items():
            setattr(config, key, value)
    _reset_peak(device)
    t = time.perf_counter()
    model.generate_batch(inputs=prompts, generation_config=config, **kwargs)  # warm-up
    _sync(device)
    warmup_s = time.perf_counter() - t
    t = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config, **kwargs)
    _sync(device)
    seconds = time.perf_counter() - t
    new = sum(len(o.generated_tokens) for o in outputs.values())
    if len(outputs) != len(prompts) or new == 0:
        return f"failed: generate_batch returned {len(outputs)} outputs and {new} tokens for {len(prompts)} prompts"
    return {
        "tokens_per_s": new / seconds,
        "seconds": seconds,
        "warmup_s": warmup_s,
        "new_tokens": new,
        "peak_gpu_memory_mib": _peak_mib(device),
        # continuous batching may drop logits processors it does not support (min_new_tokens among them):
        # rows can stop early at EOS, so tokens/s counts the tokens it generated
        "paged_cache": sizes,
    }


SAMPLERS = {
    "hf": sample_hf,
    "static": sample_static,
    "static_compiled": sample_static_compiled,
    "paged": sample_paged,
}


# ---------------------------------------------------------------------------------------------- PPO / GRPO
class _Prompts(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}


def build_module(
    spec: dict, algorithm: str, work: dict, dry_run: bool, load_in_4bit: bool = False, backend: str = "hf"
):
    """A ``PPOModule`` in Python (no CLI): the Qwen2-shaped policy with LoRA, a random reward model of the
    same shape, PPO (GAE with a critic adapter) or GRPO (``advantage_estimator: grpo``, ``group`` samples
    per prompt), sampling with ``sampling.backend: backend``. Returns ``(module, rollout prompts)``."""
    from rlhf_lit.models import BackboneConfig, LoraSettings, RewardModelConfig
    from rlhf_lit.modules import PPOModule
    from rlhf_lit.rl.generation import SamplingConfig
    from rlhf_lit.rl.settings import CriticConfig, KLConfig, PPOConfig

    dtype = "float32" if dry_run else "bfloat16"
    lora = LoraSettings(r=16, alpha=32, target_modules="all-linear")
    grpo = algorithm == "grpo"
    prompts = work["grpo_prompts"] if grpo else work["ppo_prompts"]
    group = work["group"] if grpo else 1
    module = PPOModule(
        backbone=BackboneConfig(
            tiny=dict(spec), tokenizer="byte", dtype=dtype, lora=lora, load_in_4bit=load_in_4bit
        ),
        reward_model=RewardModelConfig(
            backbone=BackboneConfig(tiny=dict(spec), tokenizer="byte", seed=1, dtype=dtype)
        ),
        sampling=SamplingConfig(
            max_new_tokens=work["new_tokens"],
            # every response runs to max_new_tokens with no stop token (min_new_tokens would suppress the
            # stop tokens while sampling but not in the trainer's softmax: a real gap the guard reports)
            stop_at_eos=False,
            temperature=1.0,
            num_samples_per_prompt=group,
            backend=backend,
            # vllm: the engine in this process (sampling.vllm.mode: colocated), in the trainer's dtype
            **({"vllm": {"mode": "colocated", "dtype": dtype}} if backend == "vllm" else {}),
        ),
        ppo=PPOConfig(
            ppo_epochs=1,
            ppo_minibatch_size=prompts * group,
            total_iterations=2,
            advantage_estimator="grpo" if grpo else "gae",
        ),
        kl=KLConfig(kl_coef=0.05),
        critic=CriticConfig(lora=LoraSettings(r=16, alpha=32, target_modules="all-linear")),
        log_samples_every=0,
        rollout_batch_size=prompts,
    )
    return module, prompts


def run_iteration(
    spec: dict,
    algorithm: str,
    work: dict,
    device: torch.device,
    dry_run: bool,
    out: Path,
    load_in_4bit: bool = False,
    backend: str = "hf",
) -> dict:
    """Two iterations through a Lightning ``Trainer`` sampling with ``sampling.backend: backend``; the second
    one's ``perf/*`` metrics, MFU and peak memory."""
    import lightning as L

    from rlhf_lit import metrics as M

    _reset_peak(device)
    t = time.perf_counter()
    try:  # built on the GPU directly: no random initialisation on the CPU and no copy
        with torch.device(device) if device.type == "cuda" and not load_in_4bit else _nullcontext():
            module, prompts = build_module(spec, algorithm, work, dry_run, load_in_4bit, backend)
    except Exception:
        if device.type != "cuda" or load_in_4bit:
            raise
        traceback.print_exc()
        print("   building on the GPU failed (above); building on the CPU", flush=True)
        module, prompts = build_module(spec, algorithm, work, dry_run, load_in_4bit, backend)
    build_s = time.perf_counter() - t
    loader = torch.utils.data.DataLoader(
        _Prompts(synthetic_prompts(4 * prompts, work["prompt_len"], seed=2)),
        batch_size=prompts,
        shuffle=False,
    )
    trainer = L.Trainer(
        accelerator="cpu" if dry_run else "gpu",
        devices=1,
        precision="32-true" if dry_run else "bf16-mixed",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=tempfile.mkdtemp(
            prefix="gpu_check_"
        ),  # nothing extra under $OUT (8 files come back)
    )
    trainer.fit(module, train_dataloaders=loader)
    if len(module.history) < 2:
        return f"failed: {len(module.history)} iteration(s) ran, 2 expected"
    last = module.history[-1]
    params = count_params(
        module.policy.lm.get_base_model() if hasattr(module.policy.lm, "get_base_model") else module.policy.lm
    )
    seq_len = work["prompt_len"] + work["new_tokens"]
    sequences = prompts * (work["group"] if algorithm == "grpo" else 1)
    update_tokens = sequences * seq_len * module.ppo.ppo_epochs
    passes = 2 if module.policy.has_critic and not module.policy.shared_critic else 1
    update_s = last[M.PERF_UPDATE_S]
    mfu = update_mfu(params, update_tokens, passes, update_s)
    response_tokens = sequences * work["new_tokens"]
    result = {
        "iteration_s": last[M.PERF_ITERATION_S],
        "tokens_per_s": response_tokens / last[M.PERF_ITERATION_S],
        "generation_s": last[M.PERF_GENERATION_S],
        "experience_s": last[M.PERF_EXPERIENCE_S],
        "update_s": update_s,
        "generation_tokens_per_s": last[M.PERF_GENERATION_TOKENS_PER_S],
        "update_mfu": mfu,
        "first_iteration_s": module.history[0][M.PERF_ITERATION_S],
        "build_s": build_s,
        "sequences": sequences,
        "response_tokens": response_tokens,
        "update_tokens": update_tokens,
        "update_passes": passes,
        "policy_params": params,
        "peak_gpu_memory_mib": _peak_mib(device),
    }
    del module, trainer
    return result


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------------------- one size
def measure_size(
    name: str,
    spec: dict,
    work: dict,
    device: torch.device,
    dry_run: bool,
    clock: Clock,
    out: Path,
    compile_sizes: set[str],
    nf4_sizes: set[str],
    sampling_backends: tuple[str, ...] = BACKENDS,
) -> dict:
    dtype = torch.float32 if dry_run else torch.bfloat16
    print(f"== {name}: building the random Qwen2-shaped model", flush=True)
    t = time.perf_counter()
    model = build_causal_lm(spec, dtype, device)
    result: dict = {"config": spec, "params": count_params(model), "build_s": time.perf_counter() - t}
    sampling: dict = {}
    for backend in BACKENDS:
        if backend not in sampling_backends:
            sampling[backend] = "skipped: not asked for (--sampling-backends)"
            continue
        print(f"== {name}: sampling with {backend} ({clock.used():.0f} s so far)", flush=True)
        if backend == "static_compiled" and name not in compile_sizes:
            sampling[backend] = (
                f"skipped: compile measured on {', '.join(sorted(compile_sizes))} only (time budget)"
            )
            continue
        sampling[backend] = _guarded(clock, SAMPLERS[backend], model, work, device, dry_run)
        print(f"   {backend}: {sampling[backend]}", flush=True)
    result["sampling"] = sampling
    del model
    _reset_peak(device)
    for algorithm in ("ppo", "grpo"):
        result[algorithm] = {
            "hf": _iteration(name, spec, algorithm, "hf", work, device, dry_run, clock, out),
            # after every size's hf iterations (main: static_iterations), so a slow compile costs only what follows
            "static": f"skipped: static-cache iterations measured on {', '.join(sorted(compile_sizes))} only "
            "(time budget)",
            "vllm": f"skipped: vLLM iterations measured on {', '.join(sorted(compile_sizes))} only (time budget)",
            "paged": f"unavailable: PPOModule's sampling.backend is {_module_backends()}; continuous batching "
            "(generate_batch) is not offered (rlhf_lit.rl.generation.SamplingConfig, backend)",
        }
    if name in nf4_sizes:
        result["nf4"] = measure_nf4(name, spec, work, device, dry_run, clock, out)
    else:
        reason = f"skipped: NF4 measured on {', '.join(sorted(nf4_sizes))} only (time budget)"
        result["nf4"] = {"sampling_hf": reason, "grpo_hf": reason}
    return result


def _module_backends() -> str:
    """The sampling backends PPOModule offers, read from ``SamplingConfig.backend``'s type: "hf, static or vllm"."""
    import typing

    from rlhf_lit.rl.generation import SamplingConfig

    names = typing.get_args(typing.get_type_hints(SamplingConfig)["backend"])
    return ", ".join(names[:-1]) + " or " + names[-1]


def static_iterations(name: str, spec: dict, work: dict, device, dry_run: bool, clock: Clock, out: Path, result):
    """One PPO and one GRPO iteration sampling with ``sampling.backend: static``, into ``result[algorithm]``;
    run after every size's ``hf`` iterations, so a slow compile costs only what comes after it."""
    for algorithm in ("ppo", "grpo"):
        result[algorithm]["static"] = _iteration(name, spec, algorithm, "static", work, device, dry_run, clock, out)


def vllm_iterations(name: str, spec: dict, work: dict, device, dry_run: bool, clock: Clock, out: Path, result):
    """One PPO and one GRPO iteration sampling with ``sampling.backend: vllm`` (colocated: the engine in this
    process), into ``result[algorithm]["vllm"]``, when vLLM imports; else :data:`VLLM_MISSING`."""
    for algorithm in ("ppo", "grpo"):
        result[algorithm]["vllm"] = (
            _iteration(name, spec, algorithm, "vllm", work, device, dry_run, clock, out)
            if installed("vllm")
            else VLLM_MISSING
        )


def _iteration(name: str, spec: dict, algorithm: str, backend: str, work: dict, device, dry_run: bool, clock, out):
    """:func:`run_iteration` under the time budget (``_guarded``), announced and reported on stdout."""
    print(f"== {name}: one {algorithm.upper()} iteration ({backend}; {clock.used():.0f} s so far)", flush=True)
    value = _guarded(clock, run_iteration, spec, algorithm, work, device, dry_run, out, backend=backend)
    print(f"   {algorithm} {backend}: {value}", flush=True)
    return value


def measure_nf4(name, spec, work, device, dry_run, clock, out) -> dict:
    """The 4-bit NF4 base (bitsandbytes, double quantization, bf16 compute): ``hf`` sampling and one GRPO
    iteration, through ``rlhf_lit.models.load_backbone`` (the path ``backbone.load_in_4bit`` takes)."""
    if not installed("bitsandbytes"):
        reason = "skipped: bitsandbytes not installed (carry its wheel: scripts/gpu_check.sh header)"
        return {"sampling_hf": reason, "grpo_hf": reason}
    try:
        import bitsandbytes  # noqa: F401  (present but broken, e.g. no CUDA build, is a reason too)
    except Exception as err:
        reason = f"skipped: bitsandbytes does not import ({_failed(err)})"
        return {"sampling_hf": reason, "grpo_hf": reason}

    def sample_nf4():
        from rlhf_lit.models import BackboneConfig, load_backbone
        from rlhf_lit.models.tokenizer import build_byte_tokenizer

        cfg = BackboneConfig(
            tiny=dict(spec), tokenizer="byte", dtype="float32" if dry_run else "bfloat16", load_in_4bit=True
        )
        model = load_backbone(cfg, build_byte_tokenizer()).eval()
        try:
            return sample_hf(model, work, device, dry_run)
        finally:
            del model

    print(f"== {name}: NF4 base ({clock.used():.0f} s so far)", flush=True)
    result = {"sampling_hf": _guarded(clock, sample_nf4)}
    result["grpo_hf"] = _guarded(clock, run_iteration, spec, "grpo", work, device, dry_run, out, True)
    print(f"   nf4: {result}", flush=True)
    return result


# ---------------------------------------------------------------------------------------------- report
def _cell(value, key: str, fmt: str) -> str:
    if isinstance(value, str):
        return value.split(":")[0]  # skipped / unavailable / failed: the JSON holds the reason
    number = value.get(key)
    if isinstance(number, str):
        return "n/a"
    return format(number, fmt)


def markdown(results: dict) -> str:
    """The README-ready tables: sampling per backend, then the PPO / GRPO iterations."""
    lines = [
        f"GPU check on {results['device']} ({'CPU dry run, tiny model: numbers are meaningless' if results['dry_run'] else 'random-initialised Qwen2-shaped models'}); "
        f"torch {results['versions']['torch']}, transformers {results['versions']['transformers']}; "
        f"MFU against {PEAK_NOTE}.",
        "",
        "| model | params | backend | sampling tokens/s | peak GPU MiB |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    for name, res in results["models"].items():
        if isinstance(res, str):
            lines.append(f"| {name} | | | {res} | |")
            continue
        for backend, value in res["sampling"].items():
            lines.append(
                f"| {name} | {res['params'] / 1e6:.0f}M | {backend} | {_cell(value, 'tokens_per_s', '.0f')} | "
                f"{_cell(value, 'peak_gpu_memory_mib', '.0f')} |"
            )
        nf4 = res["nf4"]["sampling_hf"]
        lines.append(
            f"| {name} | {res['params'] / 1e6:.0f}M | hf, NF4 base | {_cell(nf4, 'tokens_per_s', '.0f')} | "
            f"{_cell(nf4, 'peak_gpu_memory_mib', '.0f')} |"
        )
    lines += [
        "",
        "| model | iteration | sampling | s / iteration | tokens/s | generation s | experience s | update s | "
        "update MFU | peak GPU MiB |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, res in results["models"].items():
        if isinstance(res, str):
            continue
        rows = [(a.upper(), b, res[a][b]) for a in ("ppo", "grpo") for b in ITERATION_BACKENDS]
        rows.append(("GRPO", "hf, NF4 base", res["nf4"]["grpo_hf"]))
        for algo, backend, value in rows:
            if isinstance(value, str):
                lines.append(f"| {name} | {algo} | {backend} | {value.split(':')[0]} | | | | | | |")
                continue
            cells = [
                _cell(value, "iteration_s", ".2f"),
                _cell(value, "tokens_per_s", ".0f"),
                _cell(value, "generation_s", ".2f"),
                _cell(value, "experience_s", ".2f"),
                _cell(value, "update_s", ".2f"),
                _cell(value, "update_mfu", ".1%"),
                _cell(value, "peak_gpu_memory_mib", ".0f"),
            ]
            lines.append(f"| {name} | {algo} | {backend} | " + " | ".join(cells) + " |")
    w = results["workload"]
    lines += [
        "",
        f"Sampling: {w['batch']} prompts x {w['prompt_len']} tokens, {w['new_tokens']} new tokens each (median of 2 "
        f"after a warm-up). PPO: {w['ppo_prompts']} prompts; GRPO: {w['grpo_prompts']} prompts x {w['group']} "
        "samples; LoRA r=16 on all linear layers, a random reward model of the same shape, the second of two "
        "iterations. Reasons for skipped / unavailable / failed cells are in gpu_check.json.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", required=True, help="folder for gpu_check.json and gpu_check.md ($OUT there)"
    )
    parser.add_argument("--sizes", default="0.5b,1.5b", help=f"comma-separated, from {sorted(SIZES)}")
    parser.add_argument(
        "--compile-sizes", default="0.5b", help="sizes whose compiled static decode is measured"
    )
    parser.add_argument("--nf4-sizes", default="0.5b", help="sizes whose NF4 base is measured (bitsandbytes)")
    parser.add_argument(
        "--sampling-backends",
        default=",".join(BACKENDS),
        help="comma-separated backends whose sampling alone is measured (empty: none, iterations only)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=360.0,
        help="no measurement starts after this many seconds (the whole check stays under 8 min)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, tiny model: checks the script, not the GPU"
    )
    args = parser.parse_args(argv)

    import transformers

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (use --dry-run to check the script on a CPU)")
    device = torch.device("cpu" if dry else "cuda")
    if dry:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    sizes = {"tiny": TINY} if dry else {s: SIZES[s] for s in args.sizes.split(",") if s}
    compile_sizes = set(sizes) if dry else set(args.compile_sizes.split(","))
    nf4_sizes = set(sizes) if dry else set(args.nf4_sizes.split(","))
    work = DRY_WORK if dry else GPU_WORK
    sampling_backends = tuple(b for b in args.sampling_backends.split(",") if b)
    unknown = set(sampling_backends) - set(BACKENDS)
    if unknown:
        parser.error(f"--sampling-backends: unknown {sorted(unknown)}; choose from {list(BACKENDS)}")
    clock = Clock(args.budget_s)
    results: dict = {
        "device": "cpu (dry run)" if dry else torch.cuda.get_device_name(0),
        "dry_run": dry,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
        },
        "peak_flops_bf16": PEAK_BF16_FLOPS,
        "peak_flops_note": PEAK_NOTE,
        "mfu_formula": "6 x policy params x update tokens x passes / update_s / peak_flops_bf16",
        "workload": work,
        "backends": list(BACKENDS),
        "models": {},
    }
    for name, spec in sizes.items():
        try:
            results["models"][name] = measure_size(
                name, spec, work, device, dry, clock, out, compile_sizes, nf4_sizes, sampling_backends
            )
        except Exception as err:  # e.g. out of memory building the model: the other sizes still run
            traceback.print_exc()
            results["models"][name] = _failed(err)
        _reset_peak(device)
    for name, spec in sizes.items():
        if name in compile_sizes and isinstance(results["models"][name], dict):
            static_iterations(name, spec, work, device, dry, clock, out, results["models"][name])
            _reset_peak(device)
            vllm_iterations(name, spec, work, device, dry, clock, out, results["models"][name])
            _reset_peak(device)
    results["elapsed_s"] = clock.used()
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=_json_default))
    table = markdown(results)
    (out / "gpu_check.md").write_text(table)
    print("\n" + table + f"\ngpu_check: {results['elapsed_s']:.0f} s; {out}/gpu_check.json, gpu_check.md")
    return results


def _json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value)


if __name__ == "__main__":
    main()
