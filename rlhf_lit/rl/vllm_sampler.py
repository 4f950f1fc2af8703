"""Step 1 of an iteration with ``sampling.backend: vllm``: responses from a vLLM engine, in its own process or in
this one.

:class:`VLLMSampler` is the :class:`~rlhf_lit.rl.sampler.Sampler` that asks the engine's server
(``rlhf_lit.vllm_server``, through ``rl.vllm_client``), or the engine it built in this process
(``sampling.vllm.mode: colocated``), for the rollouts and pushes the policy's weights to it at every ``sync`` (its
docstring). Notation: B rows, R response width (right padded).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time

import numpy as np
import torch

from rlhf_lit.errors import SamplerEngineError
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.sample_record import SampleRecord, adapter_fingerprint

__all__ = ["VLLMSampler"]


class VLLMSampler:
    """Responses from a vLLM engine (``sampling.backend: vllm``): a server (``rlhf_lit.vllm_server``) or colocated.

    ``sample`` sends the prompts as token ids (each row without its left padding) with the temperature, the
    lengths, the stop tokens and a seed drawn from torch's generator (so a seeded run, and validation under its
    forked generator, asks for the same draws); row i is seeded ``seed + i``. The replies are laid out as
    :func:`~rlhf_lit.rl.generation.sample_responses` lays out ``generate``'s: R = the longest response, right
    padded with ``pad_token_id``, the mask True up to and including the first stop token
    (``truncate_after_stop``), so the rollout is the one the ``hf`` backend builds for the same tokens.

    ``sync`` (``sampling.vllm.weight_sync: merged``) writes the policy's weights with the actor adapter merged
    (in ``sampling.vllm.dtype``) to a folder ``weights-<n>/`` in ``sampling.vllm.weights_dir`` (renamed into
    place when complete) one transformer block at a time (Hugging Face sharded safetensors and their index, the
    export's walk: never a merged copy of the whole model), and asks the engine to load it through the index;
    the first ``sample`` syncs first. With ``weight_sync: lora`` the first ``sync`` pushes the base that way
    (the reference weights: every frozen base adapter merged, the actor off), and every ``sync`` writes the
    actor adapter alone as a peft folder ``adapter-<n>`` (renamed into place when complete) and asks the engine
    to load it as its LoRA request (``/load_lora``); the rollouts then ask for it (``lora: true``). The engine
    answers every request with the sha256 of the bytes it last loaded (``<weights>+<adapter>`` with the adapter); the
    :class:`SampleRecord`'s fingerprint is the adapter's at the last push when that digest is the one of the
    bytes pushed, else ``engine:<digest>``, which never matches the policy's: an engine that missed a push (a
    skipped ``sync``, a restarted server) is caught by the rollout-policy guard on the next iteration (a
    restarted server asked for an adapter it never loaded refuses the request: one line, the run stops). The
    record's log-probs are the engine's after the temperature (vLLM's ``processed_logprobs``), for the guard and
    ``ppo.tis_cap``.

    Under several training processes every rank sends its own prompts to the one server (sampling runs no
    forward of the policy, so no rank waits on another's), and ``sync`` is a collective: rank 0 pushes and
    loads, then broadcasts the digest it expects and the engine's reply to every rank (an engine failure raises
    on every rank). Under FSDP2 the weights are gathered one FSDP unit at a time on every rank, the walk of the
    streamed export (``models.streamed_export``), and rank 0 writes them as Hugging Face sharded safetensors
    (``weights-<n>/``, one file per unit and ``model.safetensors.index.json``), which the engine loads through
    the index: no rank ever holds the whole model. Under DDP rank 0 pushes its own copy. With ``lora``, the
    adapter's matrices are gathered whole on every rank (they are small) and written by rank 0.

    With ``sampling.vllm.mode: colocated`` the engine is built in this process (vLLM's engine core too, no child
    process; the random states of torch, ``random`` and numpy, which vLLM reseeds, kept) at the first push, from
    its folder (``config.json`` written beside the merged weights; with ``lora``, the reference weights, served
    rank ``vllm_protocol.served_lora_rank(backbone.lora.r)``), which it then loads again as every push (the
    protocol's digest); it answers through ``rl.vllm_client.LocalVLLMClient``: the same requests, digests and
    checks without HTTP (the engine's start failure is one line, its own reason). It is closed (vLLM's
    engine-core shutdown) by :meth:`close`, when the sampler is garbage collected, or at exit. Refused under
    several training processes (each would need its own engine).

    Args:
        sampling: the sampling settings (``sampling.vllm``: where the engine runs).
        stop_ids: token ids that end a response.
        pad_token_id: the id responses are padded with after their stop token.
        client: the protocol client; default a ``rl.vllm_client.VLLMClient`` on ``sampling.vllm.url``
            (``colocated``: built with the engine).
        engine_factory: ``colocated``: builds the engine as ``factory(model_folder, dtype, max_model_len,
            gpu_memory_utilization, max_lora_rank=..., kv_cache_mib=..., in_process=True)`` (default
            ``rlhf_lit.vllm_engine.VLLMEngine``).

    Attributes:
        sync_s: seconds of the latest ``sync`` (merge or adapter state, write, the engine's load); ``load_s`` the
            engine's part.
        start_s: ``colocated``: seconds the engine took to start (part of the first ``sync``); 0 otherwise.
    """

    def __init__(self, sampling: SamplingConfig, stop_ids: list[int], pad_token_id: int, client=None,
                 engine_factory=None) -> None:
        from rlhf_lit.rl.vllm_client import VLLMClient

        self.sampling, self.stop_ids, self.pad_token_id = sampling, list(stop_ids), pad_token_id
        settings = sampling.vllm
        self.colocated, self.engine_factory = settings.mode == "colocated", engine_factory
        if client is None and not self.colocated:
            client = VLLMClient(settings.url, settings.timeout_s)
        self.client = client  # colocated: built with the engine at the first push
        self._finalizer = None  # colocated: closes the engine (at close(), garbage collection or exit)
        self._tmp = None
        if settings.weights_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rlhf_lit_vllm_")
        self.weights_dir = settings.weights_dir or self._tmp.name
        self.dtype = getattr(torch, settings.dtype)
        self.lora = settings.weight_sync == "lora"
        self.last_record: SampleRecord | None = None
        self.pushed: tuple[str, str] | None = None  # (the digest the engine should report, adapter fingerprint)
        self.base_pushed: str | None = None  # weight_sync lora: the digest of the base weights pushed
        self.adapters = 0  # weight_sync lora: adapter folders written
        self.pushes = 0  # sharded weight folders written
        self.sync_s = self.load_s = self.start_s = 0.0

    def close(self) -> None:
        """``colocated``: stop the in-process engine now (vLLM's engine-core shutdown); nothing otherwise."""
        if self._finalizer is not None:
            self._finalizer()

    def sample(self, policy, prompt_ids, prompt_mask, *, synced_gpus=False, merge=False):
        from rlhf_lit.functional.sequence import truncate_after_stop

        if self.pushed is None:
            self.sync(policy)
        cfg = self.sampling
        prompts = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        seed = int(torch.randint(0, 2**31 - 1 - len(prompts), (1,)))
        out = self.client.generate(
            prompts, cfg.temperature, cfg.max_new_tokens, cfg.min_new_tokens, self.stop_ids, seed, self.lora
        )
        width = max(len(tokens) for tokens in out["tokens"])
        response = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(prompts), width), dtype=torch.float32)
        for i, (tokens, lps) in enumerate(zip(out["tokens"], out["logprobs"])):
            response[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logprobs[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        response = response.to(prompt_ids.device)
        digest, fingerprint = self.pushed
        held = out["weights"]
        self.last_record = SampleRecord(response, logprobs, fingerprint if held == digest else f"engine:{held}")
        if not self.stop_ids:
            mask = torch.ones_like(response, dtype=torch.bool)
            return response, mask, torch.zeros(response.shape[0], dtype=torch.bool, device=response.device)
        return truncate_after_stop(response, self.stop_ids, self.pad_token_id)

    def sync(self, policy) -> None:
        """Push the policy's current weights to the engine: merged, or the base once and the actor adapter (see the
        class docstring). Under several processes a collective: every rank calls it at the same point.

        Raises:
            SamplerEngineError: the engine refused or failed the load (on every rank, when rank 0's call failed).
        """
        import torch.distributed as dist

        t0 = time.perf_counter()
        rank, world_size = _rank_and_world()
        if self.colocated and world_size > 1:
            from rlhf_lit.errors import ConfigError

            raise ConfigError(
                f"sampling.vllm.mode: colocated runs one engine in one training process; this run has {world_size}. "
                "Start one server (rlhf-lit vllm-serve) for all ranks and use mode: server"
            )
        outcome, error = (None, None, 0.0), None
        try:
            outcome = self._push(policy.lm, writer=rank == 0)
        except Exception as err:  # every rank must reach the broadcast below, whatever rank 0 met
            if world_size == 1:
                raise
            error = err
        if world_size > 1:  # what rank 0 pushed and the engine answered, to every rank
            message = None if error is None else f"{type(error).__name__}: {error}".splitlines()[0]
            box = [(outcome, message)]
            dist.broadcast_object_list(box, src=0)
            outcome, message = box[0]
            if error is not None:
                raise error
            if message is not None:
                raise SamplerEngineError(f"rank 0's weight push to the vLLM engine failed: {message}")
        expected, self.base_pushed, load_s = outcome
        self.pushed = (expected, adapter_fingerprint(policy.actor_parameters()))
        self.load_s, self.sync_s = load_s, time.perf_counter() - t0

    def _push(self, lm, writer: bool) -> tuple[str | None, str | None, float]:
        """The pushes of one ``sync``: ``(the digest the engine should report, the base's digest (lora), the
        engine's load seconds)`` on the ``writer``; ``(None, None, 0.0)`` on the other ranks."""
        if self.lora:
            load_s, base = 0.0, self.base_pushed
            if base is None:
                base, load_s = self._push_weights(lm, None, writer)  # the reference weights
            adapter, adapter_load_s = self._push_adapter(lm, writer)
            expected = f"{base}+{adapter}" if writer else None
            return expected, base, load_s + adapter_load_s
        expected, load_s = self._push_weights(lm, "actor" if lm.is_peft else None, writer)
        return expected, None, load_s

    def _push_weights(self, lm, name: str | None, writer: bool) -> tuple[str | None, float]:
        """The weights with adapter ``name`` (None: the reference weights) merged, to the engine: ``(digest of
        the bytes, the engine's load seconds)`` on the writer, ``(None, 0.0)`` elsewhere. They are walked one
        unit at a time (``models.streamed_export.unit_weights``, the export's walk: an FSDP unit, gathered on
        every rank, or a transformer block of a model that is not sharded) and written by the writer as Hugging
        Face sharded safetensors in ``weights-<n>`` (``.partial`` until complete), which the engine loads
        through its index; the previous folder is then removed. No process holds more than its weights (its
        shards) and one unit's gathered and merged weights: not a merged copy of the whole model. Under DDP
        every rank holds the same whole weights and rank 0 alone pushes them."""
        from contextlib import nullcontext

        from rlhf_lit.models.streamed_export import INDEX_FILE, save_config, unit_weights, write_weight_files
        from rlhf_lit.parallel.fsdp import is_sharded
        from rlhf_lit.vllm_protocol import digest_of, read_bytes

        if not writer and not is_sharded(lm):  # DDP: rank 0's walk is no collective
            return None, 0.0
        self.pushes += 1
        folder = os.path.join(self.weights_dir, f"weights-{self.pushes}")
        partial = folder + ".partial"
        if writer:
            for stale in (partial, folder):  # left by a run that used this folder before
                shutil.rmtree(stale, ignore_errors=True)
            os.makedirs(partial)
        adapters = nullcontext() if not lm.is_peft else lm.adapter(name) if name else lm.reference()
        with adapters:  # the merge is over the active adapters
            walk = unit_weights(lm, None, write_merged=True, write_adapter=False)
            written = write_weight_files(walk, partial, writer, dtype=self.dtype)  # the files, then the index
        if not writer:
            return None, 0.0
        digest = digest_of(read_bytes(file) for file in written)  # one file at a time, as the server reads them
        if self.client is None:  # colocated: the engine starts from this folder
            save_config(lm.model.get_base_model() if lm.is_peft else lm.model, partial, [])
        os.replace(partial, folder)
        if self.client is None:
            self._start_engine(lm, folder)
        reply = self.client.load_weights(os.path.join(folder, INDEX_FILE))
        shutil.rmtree(os.path.join(self.weights_dir, f"weights-{self.pushes - 1}"), ignore_errors=True)
        return digest, float(reply.get("load_s", 0.0))

    def _start_engine(self, lm, folder: str) -> None:
        """``colocated``: build the engine in this process on ``folder`` (a Hugging Face folder: the first push and
        its ``config.json``) with ``sampling.vllm``'s options, and the client that asks it.

        Raises:
            SamplerEngineError: the engine did not start (its own reason, ``rlhf_lit.vllm_start``).
        """
        import weakref

        from rlhf_lit.rl.vllm_client import LocalVLLMClient
        from rlhf_lit.vllm_protocol import EngineService, served_lora_rank
        from rlhf_lit.vllm_start import EngineStartError, start_engine

        settings, factory = self.sampling.vllm, self.engine_factory
        if factory is None:
            from rlhf_lit.vllm_engine import VLLMEngine as factory
        rank = served_lora_rank(lm.model.peft_config["actor"].r) if self.lora else None
        states, t0 = (random.getstate(), np.random.get_state()), time.perf_counter()
        try:  # vLLM seeds torch, random and numpy of the process that builds it: the run's draws must not move
            with torch.random.fork_rng():
                engine = start_engine(factory, folder, settings.dtype, settings.max_model_len,
                                      settings.gpu_memory_utilization, max_lora_rank=rank,
                                      kv_cache_mib=settings.kv_cache_mib, in_process=True)
        except EngineStartError as err:
            raise SamplerEngineError(f"the vLLM engine did not start: {err} (vLLM's log is above)") from None
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
        self.start_s = time.perf_counter() - t0
        # engines without a close() hold no processes
        self._finalizer = weakref.finalize(self, getattr(engine, "close", lambda: None))
        self.client = LocalVLLMClient(EngineService(engine))

    def _push_adapter(self, lm, writer: bool) -> tuple[str | None, float]:
        """Write the actor adapter as a peft folder ``adapter-<n>`` (renamed into place when complete), have the
        engine load it, remove the previous folder: ``(adapter digest, the engine's load seconds)`` on the writer,
        ``(None, 0.0)`` elsewhere. Sharded (FSDP2): every rank gathers each LoRA matrix whole (they are small).

        Raises:
            ValueError: the policy has no actor LoRA adapter.
        """
        from peft import get_peft_model_state_dict
        from safetensors.torch import save

        from rlhf_lit.vllm_protocol import ADAPTER_FILES, adapter_digest

        if not lm.is_peft or "actor" not in lm.model.peft_config:
            raise ValueError("sampling.vllm.weight_sync: lora needs a LoRA actor adapter (backbone.lora)")
        config = {**lm.model.peft_config["actor"].to_dict(), "inference_mode": True}
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}  # as peft saves it
        config_bytes = json.dumps(config, indent=2, sort_keys=True).encode()
        tensors = get_peft_model_state_dict(lm.model, adapter_name="actor")
        # DTensor shards (FSDP2): one all-gather per matrix, in the same order on every rank
        tensors = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in tensors.items()}
        if not writer:
            return None, 0.0
        weights = save({k: v.detach().to(device="cpu", dtype=self.dtype).contiguous() for k, v in tensors.items()})
        self.adapters += 1
        folder = os.path.join(self.weights_dir, f"adapter-{self.adapters}")
        partial = folder + ".partial"
        for stale in (partial, folder):  # left by a run that used this folder before
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(partial)
        for name, data in zip(ADAPTER_FILES, (config_bytes, weights)):
            with open(os.path.join(partial, name), "wb") as f:
                f.write(data)
        os.replace(partial, folder)
        reply = self.client.load_lora(folder)
        shutil.rmtree(os.path.join(self.weights_dir, f"adapter-{self.adapters - 1}"), ignore_errors=True)
        return adapter_digest(config_bytes, weights), float(reply.get("load_s", 0.0))


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of training processes (the default process group's; ``(0, 1)``
    without one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1

