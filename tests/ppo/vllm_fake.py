"""Engines that serve ``rlhf_lit.vllm_server``'s protocol in this process, without vLLM.

:func:`serving` runs the real server code (``make_server``) in a thread on a free port around any engine;
:class:`TransformersEngine` samples with transformers ``generate`` (``generation.sample_responses``, the ``hf``
backend's function) on its own model, loads pushed weights into it and pushed peft adapters onto it (with peft,
as a LoRA request puts an adapter on vLLM's model), and so is a faithful stand-in for vLLM on the tiny test
models; :class:`ScriptedEngine` returns given responses.
"""

from __future__ import annotations

import copy
import os
import threading
from contextlib import contextmanager

import torch

from rlhf_lit.rl.generation import SampledLogprobs, SamplingConfig, sample_responses
from rlhf_lit.vllm_server import make_server


@contextmanager
def serving(engine):
    """``http://127.0.0.1:<port>`` of a server of ``engine`` running in a thread while inside."""
    server = make_server(engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class TransformersEngine:
    """``generate`` on ``model`` (a transformers causal LM) with the request's settings, row i seeded
    ``seed + i`` (each row drawn alone, as vLLM draws each request with its own generator); with
    ``max_lora_rank``, adapters up to that rank are served (read when loaded, put on the model per request)."""

    name = "transformers (test stand-in)"
    model = "<in process>"

    def __init__(self, model: torch.nn.Module, pad_token_id: int = 0, max_lora_rank: int | None = None) -> None:
        self.lm, self.pad_token_id, self.max_lora_rank = model, pad_token_id, max_lora_rank
        self.requests, self.loads, self.lora_loads = [], 0, 0
        self.adapter = None  # (peft LoraConfig, tensors) of the last load_lora

    def _with_adapter(self) -> torch.nn.Module:
        """A copy of the model with the loaded adapter on it (every adapter key must fit the model)."""
        from peft import get_peft_model, set_peft_model_state_dict

        config, tensors = self.adapter
        with torch.random.fork_rng(devices=[]):  # peft initialises the adapter from the global generator
            model = get_peft_model(copy.deepcopy(self.lm), copy.deepcopy(config))
        result = set_peft_model_state_dict(model, tensors)
        missing = [k for k in result.missing_keys if "lora_" in k]
        assert not result.unexpected_keys and not missing, (result.unexpected_keys, missing)
        return model.get_base_model().eval()

    def generate(self, request):
        self.requests.append(request)
        model = self._with_adapter() if request.lora else self.lm
        cfg = SamplingConfig(
            max_new_tokens=request.max_new_tokens,
            min_new_tokens=request.min_new_tokens,
            temperature=request.temperature,
        )
        tokens, logprobs = [], []
        for i, prompt in enumerate(request.prompts):
            ids = torch.tensor([prompt])
            recorder = SampledLogprobs(cfg)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(request.seed + i)
                response, mask, _ = sample_responses(
                    model, ids, torch.ones_like(ids), cfg, request.stop_token_ids, self.pad_token_id,
                    logprobs=recorder,
                )
            drawn = recorder.finish(response)
            n = int(mask[0].sum())
            tokens.append(response[0, :n].tolist())
            logprobs.append(drawn[0, :n].tolist())
        return tokens, logprobs

    def load(self, files: list[str]) -> None:
        from safetensors.torch import load_file

        tensors = {}
        for file in files:
            part = load_file(file)
            assert not set(part) & set(tensors), "a tensor in two files"
            tensors.update(part)
        missing, unexpected = self.lm.load_state_dict(tensors, strict=False)
        tied = {"lm_head.weight"} if self.lm.config.tie_word_embeddings else set()
        assert not unexpected and set(missing) <= tied, (missing, unexpected)
        self.loads += 1

    def load_lora(self, path: str) -> None:
        from peft import LoraConfig
        from safetensors.torch import load_file

        config = LoraConfig.from_pretrained(path)
        if config.r > self.max_lora_rank:
            raise ValueError(f"LoRA rank {config.r} is greater than max_lora_rank {self.max_lora_rank}")
        self.adapter = (config, load_file(os.path.join(path, "adapter_model.safetensors")))
        self.lora_loads += 1


class ScriptedEngine:
    """Returns ``responses`` (a list of ``(tokens, logprobs)`` per row) to every ``/generate``; loads nothing
    (records the files it was given)."""

    name = "scripted (test stand-in)"
    model = "<in process>"
    max_lora_rank = None

    def __init__(self, responses) -> None:
        self.responses, self.requests, self.loads = responses, [], 0
        self.loaded: list[list[str]] = []  # the files of each load

    def generate(self, request):
        self.requests.append(request)
        return [list(t) for t, _ in self.responses], [list(lp) for _, lp in self.responses]

    def load(self, files: list[str]) -> None:
        self.loaded.append(list(files))
        self.loads += 1
