"""The held-out experiment's report: before/after statistics paired by prompt, the verdict, markdown."""

from __future__ import annotations

import json
import logging
import math
import os

import torch

from rlhf_lit.functional.length_bias import length_adjusted_change, score_length_spearman
from rlhf_lit.functional.summary import mean_se
from rlhf_lit.outputs import replace_file

log = logging.getLogger("rlhf_lit")

FIELDS = ("rm_a", "rm_b", "kl_k1", "kl_k3", "length", "stopped")
LABELS = {
    "rm_a": "RM-A score (PPO's reward model)",
    "rm_b": "RM-B score (held out)",
    "kl_k1": "KL to reference, k1 (nats/response)",
    "kl_k3": "KL to reference, k3 (nats/response)",
    "length": "response length (tokens)",
    "stopped": "responses that stopped (fraction)",
}


def record_batch(
    out: dict[str, list], scores: dict[str, torch.Tensor], logprobs, ref_logprobs, batch, sample, tokenizer
) -> None:
    """Append one evaluation batch's per-response figures to ``out`` (``FIELDS`` plus ``prompt`` and
    ``response``): the reward models' ``scores`` (``rm_a``, ``rm_b``), the KL to the reference (sum over the
    response's tokens of the k1 and k3 estimators, nats), the length (tokens, stop token included), whether it
    stopped, and the decoded texts. ``sample``: ``(prompt_ids, response_ids, response_mask, has_stop)``;
    ``logprobs`` / ``ref_logprobs``: ``(B, R)`` of the sampled tokens."""
    from rlhf_lit.functional.kl import kl_per_token

    ids, response_ids, response_mask, has_stop = sample
    real = response_mask.float()
    for key, value in scores.items():
        out[key] += value.tolist()
    out["kl_k1"] += (kl_per_token(logprobs, ref_logprobs, "k1") * real).sum(-1).tolist()
    out["kl_k3"] += (kl_per_token(logprobs, ref_logprobs, "k3") * real).sum(-1).tolist()
    out["length"] += response_mask.sum(-1).float().tolist()
    out["stopped"] += has_stop.float().tolist()
    out["prompt"] += list(batch.get("prompt_text") or [""] * ids.shape[0])
    out["response"] += [
        tokenizer.decode(r[m], skip_special_tokens=True) for r, m in zip(response_ids, response_mask)
    ]


def summarize(before: dict[str, list[float]], after: dict[str, list[float]], num_se: float = 2.0) -> dict:
    """Before/after statistics of a held-out evaluation (lists of per-response values, paired by prompt).

    Returns:
        ``prompts``; ``metrics``: for each recorded field, ``before`` / ``after`` (mean, se) and ``change``
        (paired mean, se); ``length_control``: for ``rm_a`` and ``rm_b``, ``length_adjusted_change`` and the
        Spearman correlation of the score with length over all responses; and ``verdict``, one sentence on
        RM-B: a change within ``num_se`` standard errors is "no significant change"; a rise whose
        length-adjusted part is within ``num_se`` SE is "only a length gain".
    """
    n = len(before["rm_b"])
    if len(after["rm_b"]) != n:
        raise ValueError(f"before and after hold {n} and {len(after['rm_b'])} responses; they must be paired")
    t = {
        when: {k: torch.tensor(ev[k], dtype=torch.float64) for k in FIELDS}
        for when, ev in (("before", before), ("after", after))
    }
    metrics = {}
    for key in FIELDS:
        b, a = t["before"][key], t["after"][key]
        diff = mean_se(a - b)
        metrics[key] = {"before": mean_se(b), "after": mean_se(a), "change": diff}
    control = {}
    for key in ("rm_a", "rm_b"):
        change = length_adjusted_change(
            t["before"][key], t["after"][key], t["before"]["length"], t["after"]["length"]
        )
        scores = torch.cat([t["before"][key], t["after"][key]])
        lengths = torch.cat([t["before"]["length"], t["after"]["length"]])
        change["score_length_spearman"] = score_length_spearman(scores, lengths)
        control[key] = change
    return {
        "prompts": n,
        "metrics": metrics,
        "length_control": control,
        "verdict": verdict(control["rm_b"], num_se),
    }


def verdict(change: dict, num_se: float = 2.0) -> str:
    """One sentence on a reward model's paired change (``length_adjusted_change``'s output)."""
    raw, raw_se = change["change"], change["change_se"]
    adj, adj_se = change["adjusted_change"], change["adjusted_change_se"]

    def beyond(value, se):
        return se > 0 and abs(value) > num_se * se or (se == 0 and value != 0)

    if not beyond(raw, raw_se):
        return f"RM-B sees no significant change ({raw:+.3f} +- {raw_se:.3f}, within {num_se:g} SE)"
    if raw < 0:
        return f"RM-B scores the policy LOWER ({raw:+.3f} +- {raw_se:.3f}): RM-A (or its pairs) was over-optimised"
    if not beyond(adj, adj_se) or adj < 0:
        return (
            f"RM-B agrees the score rose ({raw:+.3f} +- {raw_se:.3f}), but it is only a length gain: with length "
            f"held fixed the change is {adj:+.3f} +- {adj_se:.3f}"
        )
    return (
        f"RM-B agrees the policy improved ({raw:+.3f} +- {raw_se:.3f}), beyond length: {adj:+.3f} +- "
        f"{adj_se:.3f} with length held fixed"
    )


def _fmt(pair) -> str:
    mean, se = pair
    return "n/a" if math.isnan(mean) else f"{mean:.3f} ± {se:.3f}" if not math.isnan(se) else f"{mean:.3f}"


def report_markdown(report: dict) -> str:
    """The report as a markdown table (what ``write_report`` puts in ``heldout_report.md``)."""
    lines = [
        f"Held-out evaluation on {report['prompts']} prompts, before and after {report.get('iterations', '?')} PPO "
        "iterations (mean ± standard error; change: paired by prompt).",
        "",
        "| | before PPO | after PPO | change |",
        "|---|---|---|---|",
    ]
    for key in FIELDS:
        m = report["metrics"][key]
        lines.append(f"| {LABELS[key]} | {_fmt(m['before'])} | {_fmt(m['after'])} | {_fmt(m['change'])} |")
    lines += ["", "| length control | RM-A | RM-B |", "|---|---|---|"]
    ctl = report["length_control"]
    rows = [
        ("score change", lambda c: _fmt((c["change"], c["change_se"]))),
        ("score per token (within-policy slope)", lambda c: f"{c['slope']:.4f}"),
        ("part explained by the length change", lambda c: f"{c['length_part']:+.3f}"),
        ("change with length held fixed", lambda c: _fmt((c["adjusted_change"], c["adjusted_change_se"]))),
        ("Spearman(score, length)", lambda c: f"{c['score_length_spearman']:.3f}"),
    ]
    for label, cell in rows:
        lines.append(f"| {label} | {cell(ctl['rm_a'])} | {cell(ctl['rm_b'])} |")
    lines += ["", f"Verdict: {report['verdict']}."]
    if "monitor_flagged_iterations" in report:
        lines.append(
            f"Reward-hacking monitor: over-optimisation flagged at {report['monitor_flagged_iterations']} iterations."
        )
    return "\n".join(lines) + "\n"


def write_report(report: dict, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    replace_file(os.path.join(folder, "heldout_report.json"), json.dumps(report, indent=1))
    replace_file(os.path.join(folder, "heldout_report.md"), report_markdown(report))
