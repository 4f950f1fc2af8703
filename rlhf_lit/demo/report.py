"""The demo's report: ``report.md`` / ``report.json`` of one seed, ``seeds.md`` / ``seeds.json`` across seeds."""

from __future__ import annotations

import json
import math
import os

from rlhf_lit.data.demo_task import prompt_rows
from rlhf_lit.demo.evaluate import PolicyEval, evaluate_policy, reward_model_accuracy
from rlhf_lit.demo.stages import (
    DEFAULT_OUT,
    METHOD_STAGES,
    METHOD_TITLES,
    METHODS,
    OVEROPTIMIZED,
    config_path,
)
from rlhf_lit.functional.summary import mean_se
from rlhf_lit.models.export import read_meta
from rlhf_lit.outputs import replace_file
from rlhf_lit.rl.generation import SamplingConfig

__all__ = ["seeds_summary", "write_report", "write_seeds_report"]


def write_report(
    out_dir: str = DEFAULT_OUT,
    n_prompts: int = 256,
    seed: int = 0,
    stage_seconds: dict[str, float] | None = None,
    method: str = "ppo",
) -> dict:
    """Evaluate the demo's exports and write ``report.md``, ``report.json`` and PNGs into ``out_dir``.

    ``method`` (``METHOD_STAGES``): ``ppo`` compares the PPO policy with the SFT policy and evaluates the reward
    model; ``dpo`` compares the DPO policy with the SFT policy, sampled as PPO samples and held to PPO's KL
    budget (``configs/demo/ppo.yaml``'s ``sampling`` and ``kl.target_kl``), so the two methods' reports compare.

    Raises:
        ValueError: for an unknown ``method``.
    """
    if method not in METHOD_STAGES:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    policy = _policy_stage(method)
    sft_dir, policy_dir = os.path.join(out_dir, "sft", "hf"), os.path.join(out_dir, policy, "hf")
    rm_dir = os.path.join(out_dir, "reward", "hf") if "reward" in METHOD_STAGES[method] else None
    no_kl_dir = os.path.join(out_dir, OVEROPTIMIZED, "hf")
    sampling, target_kl = _evaluation_settings(method, policy_dir)
    prompts = [r["prompt"] for r in prompt_rows(n_prompts, seed=seed, split="test")]
    evals = {"sft": evaluate_policy(sft_dir, sft_dir, rm_dir, prompts, sampling, seed)}
    evals[policy] = evaluate_policy(policy_dir, sft_dir, rm_dir, prompts, sampling, seed)
    if method == "ppo" and os.path.isdir(no_kl_dir):
        evals[OVEROPTIMIZED] = evaluate_policy(no_kl_dir, sft_dir, rm_dir, prompts, sampling, seed)

    summary = {"method": method, "seed": seed, "held_out_prompts": n_prompts, "target_kl": target_kl}
    if rm_dir is not None:
        rm_meta = read_meta(rm_dir)
        with open(os.path.join(rm_dir, "eval_results.json")) as f:
            rm_eval = json.load(f)
        summary["reward_model"] = {
            **reward_model_accuracy(rm_dir, seed=seed),
            **{
                key: rm_eval["metrics"].get(f"reward/{key}")
                for key in ("ece", "ece_calibrated", "nll", "nll_calibrated")
            },
            "temperature": rm_meta.get("temperature"),
        }
    summary["stage_seconds"] = stage_seconds or {}
    for name, ev in evals.items():
        summary[name] = {
            "gold": mean_se(ev.gold),
            **({"rm": mean_se(ev.rm)} if ev.rm else {}),
            "kl": mean_se(ev.kl),
        }
        if name != "sft":
            summary[name].update(_change_from_sft(ev, evals["sft"]))
            if method == "ppo":
                summary[name]["monitor_flagged_iterations"] = _flagged_iterations(os.path.join(out_dir, name))
    trained = summary[policy]
    summary["gold_gain"], summary["gold_gain_in_se"] = trained["gold_change"], trained["gold_change_in_se"]
    summary["kl_under_target"] = target_kl is None or trained["kl"][0] < target_kl
    # the reward-hacking guard: the policy must not raise the RM score while the gold score falls (None: no RM)
    summary["reward_hacking"] = (
        trained["rm_change"] > 0 and trained["gold_change"] < 0 if "rm_change" in trained else None
    )

    os.makedirs(out_dir, exist_ok=True)
    # the figures the runs wrote: the reward-hacking monitor's frontiers (RM and gold score against KL)
    # and the reward model's reliability diagram
    figures = {
        os.path.join(policy_dir, "score_kl_frontier.png"): "frontier.png",
        os.path.join(no_kl_dir, "score_kl_frontier.png"): "frontier_no_kl.png",
    }
    if rm_dir is not None:
        figures[os.path.join(rm_dir, "reliability.png")] = "reliability.png"
    for source, name in figures.items():
        if os.path.exists(source):
            with open(source, "rb") as f:
                replace_file(os.path.join(out_dir, name), f.read())
    replace_file(os.path.join(out_dir, "report.json"), json.dumps(summary, indent=2))
    replace_file(
        os.path.join(out_dir, "report.md"),
        _markdown(summary, prompts, evals, os.path.exists(os.path.join(out_dir, "frontier.png"))),
    )
    return summary


def _policy_stage(method: str) -> str:
    """The stage that trains the method's policy (its last): ``ppo`` or ``dpo``."""
    return METHOD_STAGES[method][-1]


def _evaluation_settings(method: str, policy_dir: str) -> tuple[SamplingConfig, float | None]:
    """How the held-out responses are sampled, and the KL budget (nats per response) they are held to: PPO's,
    from its export (the values it trained with); for another method, from the PPO demo config, so both
    methods are sampled alike and judged against one budget."""
    if method == "ppo":
        meta = read_meta(policy_dir)
        return SamplingConfig(**meta["sampling"]), meta.get("target_kl")
    from rlhf_lit.lightning_cli import parse_config

    init = parse_config([config_path("ppo")])["model"]["init_args"]
    return SamplingConfig(**init["sampling"]), init["kl"]["target_kl"]


def _change_from_sft(policy: PolicyEval, sft: PolicyEval) -> dict[str, float]:
    """Gold (and, with a reward model, RM) score change from the SFT policy on the same prompts; the gold change
    in standard errors (independent samples: se = hypot(se_policy, se_sft))."""
    (gold, gold_se), (sft_gold, sft_se) = mean_se(policy.gold), mean_se(sft.gold)
    se = math.hypot(gold_se, sft_se)
    change = {
        "gold_change": gold - sft_gold,
        "gold_change_in_se": (gold - sft_gold) / se if se > 0 else float("inf"),
    }
    if policy.rm and sft.rm:
        change["rm_change"] = mean_se(policy.rm)[0] - mean_se(sft.rm)[0]
    return change


def _flagged_iterations(run_dir: str) -> list[int]:
    """Iterations at which the run's reward-hacking monitor flagged over-optimisation (its history.json)."""
    path = os.path.join(run_dir, "history.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [h["iteration"] for h in json.load(f) if h.get("overoptimization")]


def _fmt(pair) -> str:
    return f"{pair[0]:.3f} ± {pair[1]:.3f}"


def _overoptimized_lines(no_kl: dict) -> list[str]:
    """The report's section on the PPO run without its KL penalty."""
    flagged = no_kl["monitor_flagged_iterations"]
    return [
        "## Over-optimisation on purpose: PPO without its KL penalty",
        "",
        f"The same PPO config with `kl.kl_coef: 0` and `optimizer.lr: 1e-3`: RM score {no_kl['rm_change']:+.3f} from SFT, gold "
        f"{no_kl['gold_change']:+.3f} ({no_kl['gold_change_in_se']:.1f} standard errors), KL "
        f"{no_kl['kl'][0]:.2f} nats. The reward-hacking monitor flagged "
        + (f"{len(flagged)} iterations, first at iteration {flagged[0]}." if flagged else "no iteration."),
        "",
        "![frontier without KL penalty](frontier_no_kl.png)",
        "",
    ]


def _reward_model_lines(rm: dict) -> list[str]:
    """The report's section on the reward model."""
    return [
        "## Reward model",
        "",
        f"- accuracy on {rm['pairs']} held-out pairs: **{rm['accuracy_noisy_labels']:.3f}** against the noisy "
        f"labels (their disagreement with gold: {rm['label_noise_rate']:.1%}), **{rm['accuracy_gold']:.3f}** "
        f"against the gold scorer ({rm['gold_decided_pairs']} pairs with a gold difference)",
        (
            f"- temperature scaling (T = {rm['temperature']:.3f}, fitted on the validation pairs): ECE "
            f"{rm['ece']:.4f} -> {rm['ece_calibrated']:.4f}, NLL {rm['nll']:.4f} -> {rm['nll_calibrated']:.4f} nats"
        )
        if rm["ece_calibrated"] is not None
        else f"- ECE {rm['ece']} (temperature 1: no calibration)",
        "",
        "![reliability diagram](reliability.png)",
        "",
    ]


def _markdown(s: dict, prompts, evals: dict[str, PolicyEval], has_frontier: bool) -> str:
    method = s["method"]
    policy = _policy_stage(method)
    name = policy.upper()
    rm = s.get("reward_model")
    labels = {"sft": "SFT", policy: name, OVEROPTIMIZED: "PPO without KL penalty (kl_coef 0, lr 1e-3)"}
    budget = "kl.target_kl" if method == "ppo" else f"the PPO demo's kl.target_kl, {config_path('ppo')}"
    lines = [
        f"# rlhf_lit demo report: echo task, {METHOD_TITLES[method]} (seed {s.get('seed', 0)})",
        "",
        f"Method: **{method}**. Held-out prompts: {s['held_out_prompts']} (none seen in training). "
        "Mean ± standard error.",
        "",
    ]
    if rm is None:
        lines += [
            f"{name} trained on the task's noisy preference pairs ({config_path(policy)}); no reward model. Its "
            f"responses are sampled as PPO's are ({config_path('ppo')}'s sampling) and judged by the same gold "
            "scorer.",
            "",
            "| policy | gold score | KL to reference (nats/response) |",
            "|---|---|---|",
        ]
        lines += [f"| {labels[k]} | {_fmt(s[k]['gold'])} | {_fmt(s[k]['kl'])} |" for k in evals]
    else:
        lines += [
            "| policy | gold score | RM score (calibrated) | KL to reference (nats/response) |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {labels[k]} | {_fmt(s[k]['gold'])} | {_fmt(s[k]['rm'])} | {_fmt(s[k]['kl'])} |" for k in evals
        ]
    gain = (
        f"Gold gain of {name} over SFT: **{s['gold_gain']:+.3f}** ({s['gold_gain_in_se']:.1f} standard errors). "
        f"KL budget ({budget}): {s['target_kl']} nats; {name}'s KL is "
        f"{'under' if s['kl_under_target'] else 'OVER'} it."
    )
    if s["reward_hacking"] is not None:
        gain += (
            " **Reward hacking: the RM score rose while the gold score fell.**"
            if s["reward_hacking"]
            else " The gold score did not fall while the RM score rose (no reward hacking)."
        )
    lines += ["", gain]
    if "monitor_flagged_iterations" in s[policy]:
        flagged = s[policy]["monitor_flagged_iterations"]
        lines.append(f"The reward-hacking monitor flagged {len(flagged)} of {name}'s iterations.")
    lines.append("")
    if OVEROPTIMIZED in evals:
        lines += _overoptimized_lines(s[OVEROPTIMIZED])
    if rm is not None:
        lines += _reward_model_lines(rm)
    if has_frontier:
        lines += [f"## {name}: gold and RM score against KL", "", "![frontier](frontier.png)", ""]
    sft, trained = evals["sft"], evals[policy]
    lines += [
        "## Samples (same prompts, same seed)",
        "",
        f"| prompt | SFT | gold | {name} | gold |",
        "|---|---|---|---|---|",
    ]
    for i in range(min(8, len(prompts))):
        lines.append(
            f"| `{prompts[i]}` | `{sft.responses[i]}` | {sft.gold[i]:.2f} | `{trained.responses[i]}` | {trained.gold[i]:.2f} |"
        )
    if s["stage_seconds"]:
        lines += [
            "",
            "Stage wall times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in s["stage_seconds"].items()),
        ]
    return "\n".join(lines) + "\n"


def _trained(s: dict) -> dict:
    """A report's figures of the method's trained policy (``s["ppo"]`` or ``s["dpo"]``)."""
    return s[_policy_stage(s.get("method", "ppo"))]


# Figures of a demo report that are summarised across seeds: (label, getter); ``{policy}`` in a label is the
# trained policy's name (PPO, DPO); a figure the method has not (None) is left out
_ACROSS_SEEDS = (
    ("SFT gold score", lambda s: s["sft"]["gold"][0]),
    ("{policy} gold score", lambda s: _trained(s)["gold"][0]),
    ("gold gain ({policy} - SFT)", lambda s: s["gold_gain"]),
    ("gold gain in standard errors", lambda s: s["gold_gain_in_se"]),
    ("{policy} KL to reference (nats/response)", lambda s: _trained(s)["kl"][0]),
    ("SFT RM score", lambda s: s["sft"].get("rm", [None])[0]),
    ("{policy} RM score", lambda s: _trained(s).get("rm", [None])[0]),
    ("RM accuracy vs noisy labels", lambda s: s.get("reward_model", {}).get("accuracy_noisy_labels")),
    ("RM accuracy vs gold", lambda s: s.get("reward_model", {}).get("accuracy_gold")),
    ("calibration temperature T", lambda s: s.get("reward_model", {}).get("temperature")),
    ("ECE before calibration", lambda s: s.get("reward_model", {}).get("ece")),
    ("ECE after calibration", lambda s: s.get("reward_model", {}).get("ece_calibrated")),
    ("no-KL run: gold change", lambda s: s.get(OVEROPTIMIZED, {}).get("gold_change")),
    ("no-KL run: RM score change", lambda s: s.get(OVEROPTIMIZED, {}).get("rm_change")),
    ("no-KL run: KL (nats/response)", lambda s: s.get(OVEROPTIMIZED, {}).get("kl", [None])[0]),
)


def seeds_summary(summaries: list[dict]) -> dict:
    """Mean and sample standard deviation across seeds of each figure in ``_ACROSS_SEEDS``, plus per-seed values."""
    methods = {s.get("method", "ppo") for s in summaries}
    if len(methods) != 1:
        raise ValueError(f"the reports are of different methods: {sorted(methods)}")
    method = methods.pop()
    out = {"method": method, "seeds": [s["seed"] for s in summaries], "figures": {}}
    for label, get in _ACROSS_SEEDS:
        values = [get(s) for s in summaries]
        if any(v is None for v in values):
            continue
        label = label.format(policy=_policy_stage(method).upper())
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        out["figures"][label] = {"mean": mean, "std": std, "values": values}
    out["every_seed_gains_over_3_se_within_kl_budget"] = all(
        s["gold_gain_in_se"] > 3 and s["kl_under_target"] for s in summaries
    )
    hacking = [s["reward_hacking"] for s in summaries]
    out["any_reward_hacking"] = None if None in hacking else any(hacking)  # None: no reward model
    return out


def write_seeds_report(out_dir: str, summaries: list[dict], machine: str | None = None) -> dict:
    """``seeds.md`` / ``seeds.json`` in ``out_dir``: each figure per seed, with mean and spread across seeds."""
    summary = seeds_summary(summaries)
    summary["machine"] = machine or _machine()
    seeds = summary["seeds"]
    lines = [
        f"# rlhf_lit demo ({METHOD_TITLES[summary['method']]}) across seeds {', '.join(map(str, seeds))}",
        "",
        f"Machine: {summary['machine']}. Each seed changes the generated data, the initialisation and the "
        "sampling; 256 held-out prompts per seed. Spread = sample standard deviation across seeds.",
        "",
        "| figure | " + " | ".join(f"seed {k}" for k in seeds) + " | mean ± spread |",
        "|---|" + "---|" * (len(seeds) + 1),
    ]
    for label, fig in summary["figures"].items():
        cells = " | ".join(f"{v:.3f}" for v in fig["values"])
        lines.append(f"| {label} | {cells} | {fig['mean']:.3f} ± {fig['std']:.3f} |")
    verdict = (
        "Every seed: gold gain > 3 standard errors within the KL budget: "
        f"**{'yes' if summary['every_seed_gains_over_3_se_within_kl_budget'] else 'NO'}**"
    )
    if summary["any_reward_hacking"] is not None:
        verdict += (
            f"; reward hacking (RM up while gold down) on any seed: "
            f"**{'yes' if summary['any_reward_hacking'] else 'no'}**"
        )
    lines += ["", verdict + "."]
    os.makedirs(out_dir, exist_ok=True)
    replace_file(os.path.join(out_dir, "seeds.json"), json.dumps(summary, indent=2))
    replace_file(os.path.join(out_dir, "seeds.md"), "\n".join(lines) + "\n")
    return summary


def _machine() -> str:
    """The CPU (name, family, model) and core count, for reports that say where they were made."""
    from rlhf_lit.checks.hardware import cpu_name

    return f"{cpu_name()}, {os.cpu_count()} cores"
