"""The rollout engine's protocol, standard library only: what ``rlhf-lit vllm-serve`` (``rlhf_lit.vllm_server``)
answers over HTTP and the trainer's in-process engine (``sampling.vllm.mode: colocated``) answers in its own process,
both through :class:`EngineService`.

The protocol (JSON bodies; every error is ``{"error": "<one line>"}`` with status 400 for a bad request, 500 for
an engine failure):

* ``GET /health`` -> ``{"protocol": 3, "engine": "vllm 0.32.0", "model": <folder>, "weights": <digest>,
  "lora": <digest> | null, "max_lora_rank": <int> | null}`` (``max_lora_rank`` null: started without
  ``--enable-lora``).
* ``POST /generate`` ``{"prompts": [[token ids], ...], "temperature": t, "max_new_tokens": R,
  "min_new_tokens": m, "stop_token_ids": [...], "seed": s, "lora": false}`` -> ``{"tokens": [[ids], ...],
  "logprobs": [[nats], ...], "weights": <digest>}``: one response per prompt, drawn from the full softmax at
  temperature t (no top-k / top-p), ending at the first stop token (kept) or after R tokens; the stop tokens
  suppressed for the first m tokens; row i seeded with ``s + i``; each token's log-prob under the distribution
  it was drawn from. Prompts travel as token ids: nothing is re-tokenised. With ``"lora": true`` (optional,
  default false) every row is drawn with the adapter of the last ``/load_lora`` and ``weights`` is
  ``<weights digest>+<adapter digest>``.
* ``POST /load_weights`` ``{"path": <file>.safetensors | <folder>/<name>.safetensors.index.json}`` (a sharded
  folder: the files its ``weight_map`` names) -> ``{"weights": <digest>, "load_s": seconds}``: the engine loads
  those tensors (Hugging Face names) into its model. ``weights`` is :func:`digest_of` the bytes it read (the
  files in name order, then any index), which the client compares with the digest of the bytes it wrote (the
  rollout-policy guard); before any load it is ``"initial"``.
* ``POST /load_lora`` ``{"path": <folder>}`` -> ``{"lora": <digest>, "load_s": seconds}``: the engine loads the
  peft LoRA adapter in the folder (``adapter_config.json``, ``adapter_model.safetensors``) as a new vLLM
  ``LoRARequest``, replacing the previous one; ``lora`` is :func:`adapter_digest` of the two files' bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable

__all__ = [
    "ADAPTER_FILES",
    "ENGINE_RANGES",
    "GPU_MEMORY_UTILIZATION",
    "INITIAL_WEIGHTS",
    "PROTOCOL",
    "EngineService",
    "GenerateRequest",
    "RequestError",
    "adapter_digest",
    "digest_of",
    "file_digest",
    "parse_generate",
    "served_lora_rank",
    "weight_files",
]

PROTOCOL = 3  # 2: /load_lora; 3: /load_weights takes a sharded folder's index
#: ``weights`` before the first ``/load_weights``: the engine holds the folder it started from.
INITIAL_WEIGHTS = "initial"
#: The engine's options and their ranges (``rlhf_lit.ranges`` notation), one home for ``rlhf-lit vllm-serve``'s
#: command line and the trainer's in-process engine (``sampling.vllm``, mode ``colocated``; null: unset).
ENGINE_RANGES = {"max_model_len": "int >= 1", "gpu_memory_utilization": "(0, 1]", "kv_cache_mib": "int >= 1"}
#: The engine's default share of a GPU: the trainer shares it.
GPU_MEMORY_UTILIZATION = 0.3


def served_lora_rank(r: int) -> int:
    """The ``max_lora_rank`` to serve an adapter of rank ``r`` with: 8 for r <= 8, else the next power of two (vLLM
    accepts 1, 8, 16, 32, 64, ...; 8 also serves the rank-1 adapters 1 would)."""
    return 1 << max(3, (r - 1).bit_length())


class RequestError(ValueError):
    """A request the server refuses (status 400); the message is one line."""


def digest_of(pieces: Iterable[bytes]) -> str:
    """The weights digest of the protocol: sha256 of the pieces' bytes in order, 16 hex digits."""
    sha = hashlib.sha256()
    for piece in pieces:
        sha.update(piece)
    return sha.hexdigest()[:16]


def file_digest(data: bytes) -> str:
    """:func:`digest_of` one piece of bytes."""
    return digest_of([data])


INDEX_SUFFIX = ".safetensors.index.json"


def weight_files(path) -> list[str]:
    """The files ``/load_weights`` reads: ``path`` itself, or the files a sharded folder's index names, in name
    order; raises RequestError for another path, a missing file or index entry."""
    if not isinstance(path, str) or not path.endswith((".safetensors", INDEX_SUFFIX)):
        raise RequestError(f'load_weights needs {{"path": "<file>.safetensors" or "<folder>/<name>{INDEX_SUFFIX}"}}')
    if not os.path.isfile(path):
        raise RequestError(f"load_weights: no such file {path}")
    if path.endswith(".safetensors"):
        return [path]
    try:
        names = sorted(set(json.loads(read_bytes(path))["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise RequestError(f"load_weights: {path} is no safetensors index ({type(err).__name__}: {err})") from None
    files = [os.path.join(os.path.dirname(path), name) for name in names]
    if not files or (missing := [f for f in files if not os.path.isfile(f)]):
        raise RequestError(f"load_weights: {path} names no weight files, or missing ones: {files and missing}")
    return files


#: The files of a peft LoRA adapter folder, as ``/load_lora`` reads them.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_digest(config: bytes, weights: bytes) -> str:
    """The adapter digest of the protocol: :func:`file_digest` of ``adapter_config.json``'s bytes followed by
    ``adapter_model.safetensors``'."""
    return file_digest(config + weights)


class GenerateRequest:
    """A checked ``/generate`` body (see the module docstring for the fields)."""

    def __init__(self, prompts, temperature, max_new_tokens, min_new_tokens, stop_token_ids, seed,
                 lora: bool = False) -> None:
        self.lora: bool = lora
        self.prompts: list[list[int]] = prompts
        self.temperature: float = temperature
        self.max_new_tokens: int = max_new_tokens
        self.min_new_tokens: int = min_new_tokens
        self.stop_token_ids: list[int] = stop_token_ids
        self.seed: int = seed


def _int_list(value, what: str, allow_empty: bool) -> list[int]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise RequestError(f"{what} must be a {'' if allow_empty else 'non-empty '}list of token ids")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise RequestError(f"{what} must hold token ids (ints >= 0)")
    return value


def parse_generate(body: dict) -> GenerateRequest:
    """A ``/generate`` body as a :class:`GenerateRequest`.

    Raises:
        RequestError: a field is missing, unknown, of the wrong type or out of range (one line naming it).
    """
    fields = {"prompts", "temperature", "max_new_tokens", "min_new_tokens", "stop_token_ids", "seed"}
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    if unknown := sorted(set(body) - fields - {"lora"}):
        raise RequestError(f"unknown field(s) {unknown}; expected {sorted(fields)} and optionally 'lora'")
    lora = body.get("lora", False)
    if not isinstance(lora, bool):
        raise RequestError(f"lora must be true or false, got {lora!r}")
    if missing := sorted(fields - set(body)):
        raise RequestError(f"missing field(s) {missing}")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not prompts:
        raise RequestError("prompts must be a non-empty list of token-id lists")
    prompts = [_int_list(p, f"prompts[{i}]", allow_empty=False) for i, p in enumerate(prompts)]
    temperature = body["temperature"]
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise RequestError(f"temperature must be a number > 0, got {temperature!r}")
    numbers = {}
    for name, low in (("max_new_tokens", 1), ("min_new_tokens", 0), ("seed", 0)):
        value = body[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise RequestError(f"{name} must be an int >= {low}, got {value!r}")
        numbers[name] = value
    if numbers["min_new_tokens"] > numbers["max_new_tokens"]:
        raise RequestError(
            f"min_new_tokens={numbers['min_new_tokens']} > max_new_tokens={numbers['max_new_tokens']}"
        )
    stops = _int_list(body["stop_token_ids"], "stop_token_ids", allow_empty=True)
    return GenerateRequest(
        prompts, float(temperature), numbers["max_new_tokens"], numbers["min_new_tokens"], stops, numbers["seed"],
        lora,
    )


class EngineService:
    """The protocol on one engine, without HTTP: what the server answers (``make_server``) and what the trainer's
    in-process engine answers (``sampling.vllm.mode: colocated``, ``rlhf_lit.rl.vllm_client.LocalVLLMClient``).

    Args:
        engine: ``generate(GenerateRequest) -> (tokens, logprobs)``, ``load([<file>.safetensors, ...])``,
            ``load_lora(<folder>)``, ``name``, ``model``, ``max_lora_rank`` (``rlhf_lit.vllm_engine.VLLMEngine``).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.state = {"weights": INITIAL_WEIGHTS, "lora": None}

    def handle(self, method: str, path: str, body) -> tuple[int, dict]:
        """``(HTTP status, reply)`` to one request (the module docstring's protocol): 400 for a bad request, 404
        for no such endpoint, 500 for an engine failure, each as ``{"error": "<one line>"}``."""
        if method == "GET":
            if path != "/health":
                return 404, {"error": f"no such endpoint GET {path}; GET /health"}
            return 200, {"protocol": PROTOCOL, "engine": self.engine.name, "model": self.engine.model,
                         "weights": self.state["weights"], "lora": self.state["lora"],
                         "max_lora_rank": self.engine.max_lora_rank}
        try:
            if path == "/generate":
                request = parse_generate(body)
                if request.lora and self.state["lora"] is None:
                    raise RequestError("lora: true, but no adapter was loaded (POST /load_lora first)")
                tokens, logprobs = self.engine.generate(request)
                held = self.state["weights"] + (f"+{self.state['lora']}" if request.lora else "")
                return 200, {"tokens": tokens, "logprobs": logprobs, "weights": held}
            if path == "/load_weights":
                return 200, self._load(body)
            if path == "/load_lora":
                return 200, self._load_lora(body)
            return 404, {"error": f"no such endpoint POST {path}; /generate, /load_weights, /load_lora"}
        except RequestError as err:
            return 400, {"error": str(err)}
        except Exception as err:  # the engine failed: tell the client in one line, keep serving
            return 500, {"error": f"{type(err).__name__}: {err}".splitlines()[0]}

    def _load(self, body) -> dict:
        path = body.get("path") if isinstance(body, dict) else None
        files = weight_files(path)
        t0 = time.perf_counter()
        # what this load reads (the client replaces the file, or the folder, atomically)
        digest = digest_of(read_bytes(file) for file in (files if files == [path] else [*files, path]))
        self.engine.load(files)
        self.state["weights"] = digest
        return {"weights": self.state["weights"], "load_s": time.perf_counter() - t0}

    def _load_lora(self, body) -> dict:
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(path, str):
            raise RequestError("load_lora needs {\"path\": \"<peft adapter folder>\"}")
        if self.engine.max_lora_rank is None:
            raise RequestError("load_lora: this server was started without --enable-lora (rlhf-lit vllm-serve "
                               "--enable-lora --max-lora-rank <r>)")
        missing = [name for name in ADAPTER_FILES if not os.path.isfile(os.path.join(path, name))]
        if missing:
            raise RequestError(f"load_lora: {path} has no {' or '.join(missing)} (a peft adapter folder)")
        t0 = time.perf_counter()
        config, weights = (read_bytes(os.path.join(path, name)) for name in ADAPTER_FILES)
        self.engine.load_lora(path)
        self.state["lora"] = adapter_digest(config, weights)
        return {"lora": self.state["lora"], "load_s": time.perf_counter() - t0}


def read_bytes(path: str) -> bytes:
    """The whole file at ``path`` (the digests read a pushed file exactly as the engine's side does)."""
    with open(path, "rb") as f:
        return f.read()
