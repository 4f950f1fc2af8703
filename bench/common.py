"""What every bench workload shares: paths, the shared workload module, child processes, result lines.

The shared workload lives in ``../shared/bench`` (beside the repository). ``W`` is its ``workload.py``,
imported unchanged; ``trl_baseline()`` imports its ``trl_baseline.py`` (also unchanged) for the path of the
trl 1.12.0 side install. Every repetition runs in a fresh Python process (``run_child``), which prints one
``BENCH_RESULT {json}`` line, exactly like the TRL harness, so peak RSS is that process's ``ru_maxrss``.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

T_PROCESS_START = time.perf_counter()

REPO = Path(__file__).resolve().parent.parent
SHARED_BENCH = Path(os.environ.get("BENCH_SHARED_DIR") or REPO.parent / "shared" / "bench").resolve()
sys.path.insert(0, str(SHARED_BENCH))
import workload as W  # noqa: E402  (the shared workload definition, unchanged)

RESULT_TAG = "BENCH_RESULT "
#: The vLLM engine's longest prompt + response in every bench that starts one (the servers, the GRPO bench's
#: colocated engine, TRL's colocated engine in bench/trl_vllm_probe.py).
MAX_MODEL_LEN = 512
SYSTEM = "rlhf_lit"


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def trl_baseline():
    """The shared TRL harness module (for ``ppo_trl_dir`` / ``ensure_ppo_trl``); imported, never copied."""
    import trl_baseline as T

    return T


# ------------------------------------------------------------------------------------------ measurement
def peak_rss_mb() -> float:
    """Peak resident set of this process in MiB (Linux ``ru_maxrss`` is in KiB), as the TRL harness."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def tree_peak_rss_mb(pid: int) -> dict[str, float]:
    """Peak resident memory (``VmHWM``, MB) of process ``pid`` and of each of its descendants, by
    ``"<pid> <name>"`` (Linux ``/proc``); read before the processes end. Their sum bounds the tree's peak from
    above (each process's own peak, whenever it happened)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, up in parent.items() if up in frontier]
        tree += frontier
    peaks = {}
    for member in tree:
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{member}/status").read_text().splitlines())
        except OSError:
            continue
        peaks[f"{member} {status['Name'].strip()}"] = int(status["VmHWM"].split()[0]) / 1024
    return peaks


def setup_child(threads: int) -> None:
    """Environment of a measured process: offline, quiet, ``torch.set_num_threads(threads)``."""
    for key, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("HF_DATASETS_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
        ("TRL_EXPERIMENTAL_SILENCE", "1"),
        ("WANDB_DISABLED", "true"),
    ):
        os.environ.setdefault(key, value)
    import logging
    import warnings

    import torch

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "rlhf_lit", "rlhf_lit.data"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def env_info(threads: int) -> dict:
    """Library versions and the machine, as in the TRL harness (plus lightning, peft, rlhf_lit)."""
    import accelerate
    import datasets
    import lightning
    import peft
    import torch
    import transformers

    import rlhf_lit

    return dict(
        torch=torch.__version__, transformers=transformers.__version__, accelerate=accelerate.__version__,
        datasets=datasets.__version__, lightning=lightning.__version__, peft=peft.__version__,
        rlhf_lit=rlhf_lit.__version__, python=platform.python_version(), cpu=cpu_model(), nproc=os.cpu_count(),
        torch_threads=torch.get_num_threads(), requested_threads=threads,
        malloc_env={k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},  # glibc allocator settings
    )


def cpu_model() -> str:
    """The CPU with its family and model (``rlhf_lit.checks.hardware.cpu_name``), as every bench line records it."""
    from rlhf_lit.checks.hardware import cpu_name

    return cpu_name()


def stats(values) -> dict | None:
    """``{median, min, max}`` of the numeric values (None when there are none)."""
    vals = [v for v in values if isinstance(v, (int, float)) and v == v]
    if not vals:
        return None
    return dict(median=statistics.median(vals), min=min(vals), max=max(vals))


def show_path(path) -> str:
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------------------ processes
def child_env() -> dict:
    """The environment of a child: same data file and artefact folder as this process, repo importable."""
    env = dict(os.environ, BENCH_ARTIFACTS=str(W.ARTIFACTS), BENCH_HH_FILE=str(W.HH_FILE), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def run_result_process(cmd: list[str], logfile: Path, label: str) -> dict:
    """Run ``cmd``, keep its output in ``logfile`` and return its last ``BENCH_RESULT`` JSON."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=Path.cwd())
    logfile.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed (rc={proc.returncode}); see {logfile}\n{proc.stderr[-3000:]}")
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith(RESULT_TAG)), None)
    if line is None:
        raise RuntimeError(f"{label}: no {RESULT_TAG.strip()} line; see {logfile}")
    result = json.loads(line[len(RESULT_TAG):])
    result["process_s"] = time.perf_counter() - t
    return result


def run_child(workload: str, rep: int, args, extra: list[str] | None = None, python: str | None = None) -> dict:
    """One repetition of one of our workloads in a fresh process (``bench/run.py --_child``), with ``python``
    (default this interpreter)."""
    cmd = [python or sys.executable, str(REPO / "bench" / "run.py"), "--_child", workload, "--threads", str(args.threads),
           "--ppo-iterations", str(args.ppo_iterations), "--grpo-model", getattr(args, "grpo_model", "tiny"),
           *(extra or [])]
    logfile = W.ARTIFACTS / "logs" / f"rlhf_lit_{workload}_run{rep}.log"
    return run_result_process(cmd, logfile, f"rlhf_lit {workload} run {rep}")


def emit_child_result(result: dict) -> None:
    print(RESULT_TAG + json.dumps(result, default=str), flush=True)


# ------------------------------------------------------------------------------------------ result lines
def workload_config(workload: str, fingerprint: dict, args, details: dict, trainer: str) -> dict:
    """``config`` of a result line, with the fields of the TRL harness's lines."""
    config = dict(
        tokenizer=dict(W.TOKENIZER, path=show_path(W.tokenizer_dir())),
        model=dict(W.MODEL, vocab_size=json.loads((W.base_dir() / "config.json").read_text())["vocab_size"],
                   base_path=show_path(W.base_dir()), rm_path=show_path(W.rm_dir()),
                   base_init_seed=W.BASE_INIT_SEED, rm_head_seed=W.RM_HEAD_SEED),
        data=W.HH_SOURCE,
        workload=details.get("workload")
        or (W.RM if workload == "rm" else dict(W.PPO, iterations=args.ppo_iterations)),
        artifact_sha256_16=fingerprint,
        threads=args.threads,
        repeats=args.repeats,
        variant="anchor",
        trainer=trainer,
        effective=details.get("effective", {}),
        rlhf_lit_version=details.get("env", {}).get("rlhf_lit"),
        env=details.get("env"),
    )
    return config


def result_line(system: str, workload: str, runs: list[dict], config: dict) -> dict:
    """One JSON line in the TRL harness's format: medians, extremes, ``metrics`` as {median, min, max}."""
    wall, thr, rss = (stats([r[k] for r in runs]) for k in ("wall_s", "throughput", "peak_rss_mb"))
    metric_keys = list(runs[0]["metrics"].keys())
    return dict(
        system=system,
        workload=workload,
        wall_s=wall["median"],
        throughput=thr["median"],
        unit=runs[0]["unit"],
        peak_rss_mb=rss["median"],
        wall_s_min=wall["min"], wall_s_max=wall["max"],
        throughput_min=thr["min"], throughput_max=thr["max"],
        peak_rss_mb_min=rss["min"], peak_rss_mb_max=rss["max"],
        metrics={k: stats([r["metrics"].get(k) for r in runs]) for k in metric_keys},
        config=config,
        runs=[dict(wall_s=r["wall_s"], throughput=r["throughput"], peak_rss_mb=r["peak_rss_mb"],
                   process_s=r.get("process_s"), metrics=r["metrics"],
                   **({"per_iteration": r["details"]["per_iteration"]} if "per_iteration" in r.get("details", {})
                      else {}))
              for r in runs],
        details={k: v for k, v in runs[0].get("details", {}).items() if k not in ("env", "per_iteration")},
    )


def print_line(line: dict, out: Path | None) -> None:
    text = json.dumps(line, default=str)
    print(text, flush=True)
    if out is not None:
        with open(out, "a") as f:
            f.write(text + "\n")


TRAINERS = {
    "rm": "rlhf_lit.modules.RewardModule under lightning.Trainer.fit",
    "ppo": "rlhf_lit.modules.PPOModule under lightning.Trainer.fit (manual optimization)",
    "grpo": "rlhf_lit.modules.PPOModule(ppo.advantage_estimator=grpo) under lightning.Trainer.fit",
    "grpo_trl": "trl.GRPOTrainer.train() (trl 1.16, transformers generation)",
}


def ours_line(wl: str, runs: list[dict], args, fingerprint: dict) -> dict:
    return result_line(SYSTEM, wl, runs, workload_config(wl, fingerprint, args, runs[0]["details"], TRAINERS[wl]))


def log_run(system: str, r: dict) -> None:
    log(f"[bench]   {system}: wall={r['wall_s']:.2f}s throughput={r['throughput']:.3f} {r['unit']} "
        f"peak_rss={r['peak_rss_mb']:.0f}MB")
