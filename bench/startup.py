"""Start-up time of the ``rlhf-lit`` command: medians of fresh processes, printed as a Markdown table.

    python bench/startup.py [--repeats 3] [--json bench/results/startup.jsonl]

Measures (wall seconds, each command a fresh process, run from the repository root, one thread, offline):
``rlhf-lit --help``, ``demo --help``, ``plan --help``, ``fit --help``, a bad-config exit (a misspelled key in
``configs/sft/tiny.yaml``: exit 2 after the parse) and, for reference, ``python -c 'import lightning.pytorch'``.
The commands run round-robin (one of each, then the next repeat), so a change in the machine's load falls on
all of them alike. Targets (issue 19): the three light ``--help`` <= 2 s; ``fit --help`` and the bad-config
exit <= the Lightning import + 2 s. A timing is a measurement, not a test: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "rlhf_lit"]
COMMANDS = {
    "rlhf-lit --help": [*CLI, "--help"],
    "rlhf-lit demo --help": [*CLI, "demo", "--help"],
    "rlhf-lit plan --help": [*CLI, "plan", "--help"],
    "rlhf-lit fit --help": [*CLI, "fit", "--help"],
    "bad-config exit (misspelled key)": [
        *CLI,
        "fit",
        "--config",
        "configs/sft/tiny.yaml",
        "--model.init_args.optimizer.lrr=1e-4",
    ],
    "python -c 'import lightning.pytorch'": [sys.executable, "-c", "import lightning.pytorch"],
}
EXPECTED_EXIT = {"bad-config exit (misspelled key)": 2}


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    return env


def time_once(argv: list[str]) -> tuple[float, int]:
    """Wall seconds and exit code of one fresh process."""
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True)
    return time.perf_counter() - start, done.returncode


def cpu_model() -> str:
    from rlhf_lit.checks.hardware import cpu_name

    return f"{cpu_name()}, {os.cpu_count()} logical CPUs"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="append the raw timings to this JSON-lines file")
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, command in COMMANDS.items():
            seconds, code = time_once(command)
            if code != EXPECTED_EXIT.get(name, 0):
                raise SystemExit(f"{name}: exit {code}, expected {EXPECTED_EXIT.get(name, 0)}")
            times[name].append(seconds)
    lightning = statistics.median(times["python -c 'import lightning.pytorch'"])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"CPU: {cpu_model()}; load average at the end {load:.2f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print(f"medians of {args.repeats} fresh processes (seconds)\n")
    print("| command | median (s) | runs (s) | target |")
    print("|---|---|---|---|")
    for name, runs in times.items():
        median = statistics.median(runs)
        if name.endswith(("rlhf-lit --help", "demo --help", "plan --help")):
            target = f"<= 2 s: {'met' if median <= 2 else 'not met'}"
        elif name.startswith(("rlhf-lit fit", "bad-config")):
            target = f"<= Lightning import + 2 s ({lightning + 2:.1f}): {'met' if median <= lightning + 2 else 'not met'}"
        else:
            target = "reference"
        print(f"| `{name}` | {median:.2f} | {', '.join(f'{t:.2f}' for t in runs)} | {target} |")
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps({"cpu": cpu_model(), "load": load, "times": times}) + "\n")


if __name__ == "__main__":
    main()
