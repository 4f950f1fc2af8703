"""The estimate as text (``rlhf-lit plan``) or JSON, and the command's entry point."""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf_lit.planner.estimate import Estimate
    from rlhf_lit.planner.settings import RunSettings

from rlhf_lit.planner.formulas import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT_BYTES,
    HOST_PROCESS_BYTES,
    GiB,
    MiB,
    needed_bytes,
)

# the command's --help and its argument errors import nothing heavy: the estimate's modules (which read model
# configs through transformers) are imported when a plan is made

_DESCRIPTION = (
    "Memory planner: the peak accelerator memory of a run, estimated from its configs before anything loads. "
    "Stack configs as fit does (--config a.yaml --config b.yaml); --key=value overrides as fit takes them "
    "(e.g. --data.init_args.batch_size=4)."
)

__all__ = ["fit_verdict", "main", "plan", "report"]


def _fmt(nbytes: float) -> str:
    return f"{nbytes / GiB:8.3f} GiB" if nbytes >= 0.1 * GiB else f"{nbytes / MiB:8.2f} MiB"


def report(est: Estimate, device_memory_gb: float | None = None) -> str:
    """The breakdown table, the phase peaks and (with ``device_memory_gb``) whether the run fits."""
    s, shape = est.settings, est.shape
    lines = [
        f"rlhf-lit plan: {s.stage} stage, model {shape.name} ({shape.source})",
        f"  {shape.num_params / 1e6:,.1f} M params, L={shape.num_layers} H={shape.hidden} I={shape.intermediate} "
        f"kv={shape.kv} V={shape.vocab}; precision {s.precision}; {s.world_size} device(s)"
        + (" sharded (FSDP)" if s.sharded else ""),
        "",
        f"  {'component':<36} {'memory':>12}   note",
        f"  {'-' * 36} {'-' * 12}   {'-' * 30}",
    ]
    for name, nbytes, note in est.rows:
        lines.append(f"  {name:<36} {_fmt(nbytes):>12}   {note}")
    lines.append(f"  {'-' * 36} {'-' * 12}")
    lines.append(f"  {'static (weights, adapters, optimizer)':<36} {_fmt(est.static):>12}")
    for phase, nbytes in est.phases.items():
        lines.append(
            f"  {'+ ' + phase:<36} {_fmt(nbytes):>12}   peak in this phase {_fmt(est.static + nbytes).strip()}"
        )
    lines.append(f"  {'estimated peak':<36} {_fmt(est.peak):>12}")
    for note in est.notes:
        lines.append(f"  note: {note}")
    if device_memory_gb:
        need, fits = fit_verdict(est, device_memory_gb)
        lines.append(
            f"  {'fits' if fits else 'does NOT fit'} in {device_memory_gb:g} GiB: needs ~{need / GiB:.2f} GiB "
            f"with {ALLOCATOR_SLACK * 100:g} % allocator slack"
            + (
                f" + {HOST_PROCESS_BYTES / GiB:g} GiB host process (interpreter, libraries, tokenizer, data)"
                if est.settings.accelerator == "cpu"
                else f" + {CUDA_CONTEXT_BYTES / GiB:g} GiB CUDA context"
            )
        )
    return "\n".join(lines)


def fit_verdict(est: Estimate, device_memory_gb: float) -> tuple[float, bool]:
    """``(needed bytes, fits)``: the estimated peak plus 10 % allocator slack, plus the CUDA context
    (``CUDA_CONTEXT_BYTES``) on a GPU, or the host process (``HOST_PROCESS_BYTES``) when the config's
    ``trainer.accelerator`` is the CPU (tensors in host memory beside the interpreter), against
    ``device_memory_gb`` GiB."""
    need = needed_bytes(est.peak, est.settings.accelerator == "cpu")
    return need, need <= device_memory_gb * GiB


def plan(
    configs: list[str],
    model_config: str | None = None,
    overrides: dict | None = None,
    cli_overrides: list[str] | None = None,
    response_len: int | None = None,
) -> Estimate:
    """Estimate the run that ``rlhf-lit fit --config <configs...> <cli_overrides...>`` would start
    (``cli_overrides``: ``--key=value`` arguments as ``fit`` takes them; ``overrides``: fields of
    :class:`~rlhf_lit.planner.settings.RunSettings` to set after reading the configs; ``response_len``: ``plan
    --response-len``, DPO/KTO's response tokens per row, checked by :func:`_check_response_len`)."""
    from rlhf_lit.planner.estimate import estimate
    from rlhf_lit.planner.settings import read_settings
    from rlhf_lit.planner.shapes import model_shape

    settings = read_settings(configs, cli_overrides)
    _check_response_len(settings, response_len)
    for key, value in (overrides or {}).items():
        setattr(settings, key, value)
    if response_len is not None:
        settings.response_len = response_len
    shape = model_shape(settings.backbone, model_config)
    reward_shape = None
    if (
        settings.stage == "ppo"
        and settings.reward_mode == "separate"
        and settings.reward_backbone is not None
    ):
        reward_shape = model_shape(settings.reward_backbone)
    return estimate(settings, shape, reward_shape)


def _check_response_len(settings: RunSettings, response_len: int | None) -> None:
    """``--response-len`` plans DPO/KTO's response logits (rows x R x V) for ``R`` tokens per row, which the data
    decides; other stages fix R themselves (PPO: ``sampling.max_new_tokens``; SFT and reward: every position).

    Raises:
        ConfigError: for another stage, or an R the rows cannot hold (above ``max_length - 1``).
    """
    if response_len is None:
        return
    from rlhf_lit.errors import ConfigError

    if settings.stage != "dpo":
        raise ConfigError(
            f"plan --response-len: only DPO/KTO configs take it; this config is the {settings.stage} stage "
            "(PPO plans sampling.max_new_tokens, SFT and reward every position)"
        )
    if response_len > settings.seq_len - 1:
        raise ConfigError(
            f"plan --response-len={response_len}: above max_length - 1 = {settings.seq_len - 1}, the most "
            "response tokens a row holds"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlhf-lit plan", description=_DESCRIPTION)
    parser.add_argument("--config", action="append", required=True, help="a config; repeat to stack them")
    parser.add_argument(
        "--device-memory-gb", type=float, default=None, help="memory of one device in GiB: say whether the run fits"
    )
    parser.add_argument("--model-config", default=None, help="a config.json (or its folder) for the model")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="processes (default: trainer.devices x num_nodes; -1 counts as 1)",
    )
    parser.add_argument(
        "--response-len",
        type=int,
        default=None,
        help="DPO/KTO: response tokens per row in your data (default: unknown, bounded by max_length - 1, "
        "the worst case)",
    )
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    args, cli_overrides = parser.parse_known_args(argv)  # the rest: --key=value overrides, as fit takes them
    from rlhf_lit.checks.rules import PLAN_RULES, check_ranges

    options = {
        "device-memory-gb": args.device_memory_gb,
        "world-size": args.world_size,
        "response-len": args.response_len,
    }
    check_ranges({k: v for k, v in options.items() if v is not None}, PLAN_RULES, "plan --")
    for config in args.config:
        if not os.path.isfile(config):
            from rlhf_lit.errors import ConfigError

            raise ConfigError(
                f"plan: --config {config}: no such config file (resolved to {os.path.abspath(config)})"
            )
    est = plan(
        args.config,
        args.model_config,
        {"world_size": args.world_size} if args.world_size else None,
        cli_overrides,
        args.response_len,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "peak_bytes": est.peak,
                    "static_bytes": est.static,
                    "phases": est.phases,
                    "stage": est.settings.stage,
                    "packing": est.settings.packing,
                    "rows": [{"component": n, "bytes": b, "note": t} for n, b, t in est.rows],
                    **_verdict_json(est, args.device_memory_gb),
                },
                indent=2,
            )
        )
    else:
        print(report(est, args.device_memory_gb))


def _verdict_json(est: Estimate, device_memory_gb: float | None) -> dict:
    """``--json``'s fit verdict, with ``--device-memory-gb`` only."""
    if not device_memory_gb:
        return {}
    need, fits = fit_verdict(est, device_memory_gb)
    return {"device_memory_gb": device_memory_gb, "needed_bytes": need, "fits": fits}
