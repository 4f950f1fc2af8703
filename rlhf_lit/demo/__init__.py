"""The embedded default: SFT -> reward model -> PPO on the echo task, offline, then a report that proves it.

``rlhf-lit demo`` runs ``configs/demo/{sft,reward,ppo}.yaml`` as ordinary ``rlhf-lit fit`` stages (each also
runs on its own) and then evaluates, on held-out prompts that no stage trained on:

* the SFT policy and the PPO policy: gold score and reward-model score (mean +- standard error), KL to the
  reference (the SFT policy), and a few sample responses;
* the reward model: accuracy against the noisy labels and against the gold scorer, ECE before and after
  temperature scaling, the reliability diagram;
* the PPO run: gold and RM score of each iteration's samples against their KL (the over-optimisation
  frontier of Gao et al. 2022).

The gold scorer (``rlhf_lit.data.demo_task.gold_score``) is used here, for evaluation, and by
``GoldScoreCallback`` (which only logs); never by the reward model or PPO.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
from dataclasses import dataclass

import torch
import yaml

from rlhf_lit.callbacks.gold_score import GoldScoreCallback  # noqa: F401  (configs name rlhf_lit.demo.GoldScoreCallback)
from rlhf_lit.data.demo_task import gold_score, label_noise_rate, preference_rows, prompt_rows
from rlhf_lit.functional.sequence import gather_logprobs, position_ids_from_mask
from rlhf_lit.generation import SamplingConfig, resolve_stop_ids, sample_responses
from rlhf_lit.models.export import load_reward_model, read_meta
from rlhf_lit.models.tokenizer import load_tokenizer

log = logging.getLogger("rlhf_lit")

STAGES = ("sft", "reward", "ppo")
DEFAULT_OUT = "checkpoints/demo"  # where configs/demo/*.yaml write


@dataclass
class PolicyEval:
    gold: list[float]
    rm: list[float]
    kl: list[float]
    responses: list[str]


def _mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, math.sqrt(var / n)


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


@torch.no_grad()
def _response_logprob_sums(
    model, ids, mask, prompt_len, response_ids, response_mask, temperature
) -> torch.Tensor:
    full = torch.cat([ids, response_ids], 1)
    full_mask = torch.cat([mask, response_mask.long()], 1)
    logits = model(
        input_ids=full, attention_mask=full_mask, position_ids=position_ids_from_mask(full_mask)
    ).logits
    logprobs = gather_logprobs(logits[:, prompt_len - 1 : -1], response_ids, temperature)
    return (logprobs * response_mask).sum(-1)


@torch.no_grad()
def evaluate_policy(
    policy_dir: str,
    reference_dir: str,
    reward_dir: str,
    prompts: list[str],
    sampling: SamplingConfig,
    seed: int = 0,
    batch_size: int = 64,
) -> PolicyEval:
    """Sample one response per prompt from an exported policy; score it with gold, the RM and KL.

    KL is the sampled estimate of KL(policy || reference) per response, in nats (sum over its tokens of
    ``log pi(y_t) - log pi_ref(y_t)`` at the sampling temperature).
    """
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    reference = (
        AutoModelForCausalLM.from_pretrained(reference_dir).eval() if reference_dir != policy_dir else None
    )
    scorer = load_reward_model(reward_dir)
    stop_ids = resolve_stop_ids(sampling, tokenizer)
    out = PolicyEval([], [], [], [])
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for start in range(0, len(prompts), batch_size):
            texts = prompts[start : start + batch_size]
            ids, mask = _left_pad(
                [tokenizer.encode(t, add_special_tokens=False) for t in texts], tokenizer.pad_token_id
            )
            response_ids, response_mask, _ = sample_responses(
                policy, ids, mask, sampling, stop_ids, tokenizer.pad_token_id
            )
            responses = [
                tokenizer.decode(r[m], skip_special_tokens=True) for r, m in zip(response_ids, response_mask)
            ]
            out.responses += responses
            out.gold += [gold_score(p, r) for p, r in zip(texts, responses)]
            full = torch.cat([ids, response_ids], 1)
            out.rm += scorer.score(full, torch.cat([mask, response_mask.long()], 1)).tolist()
            if reference is None:
                out.kl += [0.0] * len(texts)
            else:
                P = ids.shape[1]
                lp = _response_logprob_sums(
                    policy, ids, mask, P, response_ids, response_mask, sampling.temperature
                )
                ref = _response_logprob_sums(
                    reference, ids, mask, P, response_ids, response_mask, sampling.temperature
                )
                out.kl += (lp - ref).tolist()
    finally:
        torch.random.set_rng_state(state)
    return out


@torch.no_grad()
def reward_model_accuracy(reward_dir: str, n: int = 512, seed: int = 0) -> dict:
    """RM accuracy on held-out demo pairs, against the noisy labels and against the gold scorer."""
    scorer = load_reward_model(reward_dir)
    tok = scorer.tokenizer
    rows = preference_rows(n, seed=seed, split="val")

    def scores(texts: list[tuple[str, str]]) -> torch.Tensor:
        seqs = [
            tok.encode(p, add_special_tokens=False)
            + tok.encode(r, add_special_tokens=False)
            + [tok.eos_token_id]
            for p, r in texts
        ]
        ids, mask = _left_pad(seqs, tok.pad_token_id)
        return scorer.score(ids, mask, calibrated=False)

    chosen = scores([(r["prompt"], r["chosen"]) for r in rows])
    rejected = scores([(r["prompt"], r["rejected"]) for r in rows])
    margin = chosen - rejected
    gold_margin = torch.tensor([r["gold_chosen"] - r["gold_rejected"] for r in rows])
    decided = gold_margin != 0
    return {
        "pairs": n,
        "accuracy_noisy_labels": float((margin > 0).float().mean()),
        "accuracy_gold": float(((margin > 0) == (gold_margin > 0))[decided].float().mean()),
        "gold_decided_pairs": int(decided.sum()),
        "label_noise_rate": label_noise_rate(rows),
    }


def _config(name: str) -> str:
    return os.path.join("configs", "demo", f"{name}.yaml")


# The CI test's shortened pipeline: fewer SFT epochs and PPO iterations, the same data and models.
FAST_OVERRIDES = {
    "sft": ["--trainer.max_epochs=6"],
    "reward": [],
    "ppo": ["--model.init_args.ppo.total_iterations=20"],
}


def _reseeded_data_args(stage: str, seed: int) -> list[str]:
    """``--data`` overrides that give the stage config's ``demo:...`` data specs another ``seed=``."""
    with open(_config(stage)) as f:
        data = yaml.safe_load(f)["data"]["init_args"]
    args = []
    for key in ("train_files", "val_files"):
        if data.get(key):
            specs = [re.sub(r"seed=\d+", f"seed={seed}", spec) for spec in data[key]]
            args.append(f"--data.init_args.{key}=[{','.join(specs)}]")
    return args


# The deliberately over-optimised run: the demo's PPO config without its KL penalty and at the learning rate
# the demo reward-hacked at before (1e-3), for 40 iterations in the shortened pipeline. The reward-hacking
# monitor (RewardHackingMonitor) should flag it; the report shows what it did to the gold score.
OVEROPTIMIZED = "ppo_no_kl"
OVEROPTIMIZED_OVERRIDES = [
    "--model.init_args.kl.kl_coef=0",
    "--model.init_args.kl.adaptive=false",
    "--model.init_args.optimizer.lr=1e-3",
]
OVEROPTIMIZED_FAST_OVERRIDES = ["--model.init_args.ppo.total_iterations=40"]


def stage_args(
    stage: str, out: str = DEFAULT_OUT, fast: bool = False, seed: int = 0, folder: str | None = None
) -> list[str]:
    """The ``rlhf-lit fit`` arguments of a demo stage, with every output under ``out/<folder>``.

    ``stage`` names the config (``configs/demo/<stage>.yaml``); ``folder`` (default: ``stage``) the output
    folder. ``seed`` != 0 changes everything random in the stage: ``seed_everything`` (initialisation,
    sampling, shuffles) and the seed of the generated data (other words, other demonstrations, other label
    noise).
    """
    folder = folder or stage
    args = ["fit", "--config", _config(stage)]
    if seed != 0:
        args += [f"--seed_everything={seed}", *_reseeded_data_args(stage, seed)]
    if out != DEFAULT_OUT or folder != stage:
        root = os.path.join(out, folder)
        args += [
            f"--trainer.default_root_dir={root}",
            f"--trainer.logger.init_args.save_dir={root}",
            f"--model.init_args.export_dir={root}/hf",
        ]
        if stage in ("reward", "ppo"):
            args.append(f"--model.init_args.backbone.name_or_path={out}/sft/hf")
        if stage == "ppo":
            args.append(f"--model.init_args.reward_model.path={out}/reward/hf")
    args += FAST_OVERRIDES[stage] if fast else []
    if folder == OVEROPTIMIZED:
        args += OVEROPTIMIZED_OVERRIDES + (OVEROPTIMIZED_FAST_OVERRIDES if fast else [])
    return args


def run_stages(
    out: str = DEFAULT_OUT,
    fast: bool = False,
    stages=STAGES,
    seed: int = 0,
    extra: dict | None = None,
    overoptimized: bool = False,
) -> dict[str, float]:
    """Run the demo stages in order, each as ``rlhf-lit fit --config configs/demo/<stage>.yaml``.

    Args:
        out: output folder (``<out>/<stage>/``).
        fast: the shortened stages of the CI test (``FAST_OVERRIDES``).
        stages: which stages to run.
        seed: the demo seed (see ``stage_args``).
        extra: more ``rlhf-lit fit`` arguments per stage name, e.g. ``{"ppo": ["--model.init_args..."]}``.
        overoptimized: also run PPO without its KL penalty into ``<out>/ppo_no_kl`` (``OVEROPTIMIZED``).

    Returns:
        Wall seconds per run.
    """
    from rlhf_lit.lightning_cli import cli_main

    runs = [(stage, stage) for stage in stages]
    if overoptimized:
        runs.append(("ppo", OVEROPTIMIZED))
    seconds = {}
    for stage, folder in runs:
        t0 = time.perf_counter()
        log.info("demo: %s (%s), seed %d", folder, _config(stage), seed)
        cli_main(stage_args(stage, out, fast, seed, folder) + list((extra or {}).get(stage, [])))
        seconds[folder] = time.perf_counter() - t0
    return seconds


def write_report(
    out_dir: str = DEFAULT_OUT,
    n_prompts: int = 256,
    seed: int = 0,
    stage_seconds: dict[str, float] | None = None,
) -> dict:
    """Evaluate the demo's exports and write ``report.md``, ``report.json`` and PNGs into ``out_dir``."""
    sft_dir, rm_dir, ppo_dir = (os.path.join(out_dir, s, "hf") for s in STAGES)
    no_kl_dir = os.path.join(out_dir, OVEROPTIMIZED, "hf")
    ppo_meta = read_meta(ppo_dir)
    rm_meta = read_meta(rm_dir)
    sampling = SamplingConfig(**{k: v for k, v in ppo_meta["sampling"].items()})
    prompts = [r["prompt"] for r in prompt_rows(n_prompts, seed=seed, split="test")]
    evals = {"sft": evaluate_policy(sft_dir, sft_dir, rm_dir, prompts, sampling, seed)}
    evals["ppo"] = evaluate_policy(ppo_dir, sft_dir, rm_dir, prompts, sampling, seed)
    if os.path.isdir(no_kl_dir):
        evals[OVEROPTIMIZED] = evaluate_policy(no_kl_dir, sft_dir, rm_dir, prompts, sampling, seed)
    with open(os.path.join(rm_dir, "eval_results.json")) as f:
        rm_eval = json.load(f)
    target_kl = ppo_meta.get("target_kl")

    summary = {
        "seed": seed,
        "held_out_prompts": n_prompts,
        "target_kl": target_kl,
        "reward_model": {
            **reward_model_accuracy(rm_dir, seed=seed),
            **{
                key: rm_eval["metrics"].get(f"reward/{key}")
                for key in ("ece", "ece_calibrated", "nll", "nll_calibrated")
            },
            "temperature": rm_meta.get("temperature"),
        },
        "stage_seconds": stage_seconds or {},
    }
    for name, ev in evals.items():
        summary[name] = {"gold": _mean_se(ev.gold), "rm": _mean_se(ev.rm), "kl": _mean_se(ev.kl)}
        if name != "sft":
            summary[name].update(_change_from_sft(ev, evals["sft"]))
            summary[name]["monitor_flagged_iterations"] = _flagged_iterations(os.path.join(out_dir, name))
    ppo = summary["ppo"]
    summary["gold_gain"], summary["gold_gain_in_se"] = ppo["gold_change"], ppo["gold_change_in_se"]
    summary["kl_under_target"] = target_kl is None or ppo["kl"][0] < target_kl
    # the reward-hacking guard: PPO must not raise the RM score while the gold score falls
    summary["reward_hacking"] = ppo["rm_change"] > 0 and ppo["gold_change"] < 0

    os.makedirs(out_dir, exist_ok=True)
    # the figures the runs wrote: the reward-hacking monitor's frontiers (RM and gold score against KL)
    # and the reward model's reliability diagram
    figures = {
        os.path.join(ppo_dir, "score_kl_frontier.png"): "frontier.png",
        os.path.join(no_kl_dir, "score_kl_frontier.png"): "frontier_no_kl.png",
        os.path.join(rm_dir, "reliability.png"): "reliability.png",
    }
    for source, name in figures.items():
        if os.path.exists(source):
            shutil.copyfile(source, os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(_markdown(summary, prompts, evals, os.path.exists(os.path.join(out_dir, "frontier.png"))))
    return summary


def _change_from_sft(policy: PolicyEval, sft: PolicyEval) -> dict[str, float]:
    """Gold and RM score change from the SFT policy on the same prompts; the gold change in standard errors
    (independent samples: se = hypot(se_policy, se_sft))."""
    (gold, gold_se), (sft_gold, sft_se) = _mean_se(policy.gold), _mean_se(sft.gold)
    se = math.hypot(gold_se, sft_se)
    return {
        "gold_change": gold - sft_gold,
        "gold_change_in_se": (gold - sft_gold) / se if se > 0 else float("inf"),
        "rm_change": _mean_se(policy.rm)[0] - _mean_se(sft.rm)[0],
    }


def _flagged_iterations(run_dir: str) -> list[int]:
    """Iterations at which the run's reward-hacking monitor flagged over-optimisation (its history.json)."""
    path = os.path.join(run_dir, "history.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [h["iteration"] for h in json.load(f) if h.get("overoptimization")]


def _fmt(pair) -> str:
    return f"{pair[0]:.3f} ± {pair[1]:.3f}"


def _markdown(s: dict, prompts, evals: dict[str, PolicyEval], has_frontier: bool) -> str:
    rm = s["reward_model"]
    labels = {"sft": "SFT", "ppo": "PPO", OVEROPTIMIZED: "PPO without KL penalty (kl_coef 0, lr 1e-3)"}
    lines = [
        f"# rlhf_lit demo report: echo task, SFT -> reward model -> PPO (seed {s.get('seed', 0)})",
        "",
        f"Held-out prompts: {s['held_out_prompts']} (none seen in training). Mean ± standard error.",
        "",
        "| policy | gold score | RM score (calibrated) | KL to reference (nats/response) |",
        "|---|---|---|---|",
    ]
    for name in evals:
        lines.append(f"| {labels[name]} | {_fmt(s[name]['gold'])} | {_fmt(s[name]['rm'])} | {_fmt(s[name]['kl'])} |")
    lines += [
        "",
        f"Gold gain of PPO over SFT: **{s['gold_gain']:+.3f}** ({s['gold_gain_in_se']:.1f} standard errors). "
        f"KL budget (kl.target_kl): {s['target_kl']} nats; PPO's KL is "
        f"{'under' if s['kl_under_target'] else 'OVER'} it. "
        + (
            "**Reward hacking: the RM score rose while the gold score fell.**"
            if s["reward_hacking"]
            else "The gold score did not fall while the RM score rose (no reward hacking)."
        ),
        f"The reward-hacking monitor flagged {len(s['ppo']['monitor_flagged_iterations'])} of PPO's iterations.",
        "",
    ]
    if OVEROPTIMIZED in evals:
        no_kl = s[OVEROPTIMIZED]
        flagged = no_kl["monitor_flagged_iterations"]
        lines += [
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
    lines += [
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
    if has_frontier:
        lines += ["## PPO: gold and RM score against KL", "", "![frontier](frontier.png)", ""]
    sft, ppo = evals["sft"], evals["ppo"]
    lines += [
        "## Samples (same prompts, same seed)",
        "",
        "| prompt | SFT | gold | PPO | gold |",
        "|---|---|---|---|---|",
    ]
    for i in range(min(8, len(prompts))):
        lines.append(
            f"| `{prompts[i]}` | `{sft.responses[i]}` | {sft.gold[i]:.2f} | `{ppo.responses[i]}` | {ppo.gold[i]:.2f} |"
        )
    if s["stage_seconds"]:
        lines += [
            "",
            "Stage wall times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in s["stage_seconds"].items()),
        ]
    return "\n".join(lines) + "\n"


# Figures of a demo report that are summarised across seeds: (label, getter)
_ACROSS_SEEDS = (
    ("SFT gold score", lambda s: s["sft"]["gold"][0]),
    ("PPO gold score", lambda s: s["ppo"]["gold"][0]),
    ("gold gain (PPO - SFT)", lambda s: s["gold_gain"]),
    ("gold gain in standard errors", lambda s: s["gold_gain_in_se"]),
    ("PPO KL to reference (nats/response)", lambda s: s["ppo"]["kl"][0]),
    ("SFT RM score", lambda s: s["sft"]["rm"][0]),
    ("PPO RM score", lambda s: s["ppo"]["rm"][0]),
    ("RM accuracy vs noisy labels", lambda s: s["reward_model"]["accuracy_noisy_labels"]),
    ("RM accuracy vs gold", lambda s: s["reward_model"]["accuracy_gold"]),
    ("calibration temperature T", lambda s: s["reward_model"]["temperature"]),
    ("ECE before calibration", lambda s: s["reward_model"]["ece"]),
    ("ECE after calibration", lambda s: s["reward_model"]["ece_calibrated"]),
    ("no-KL run: gold change", lambda s: s.get(OVEROPTIMIZED, {}).get("gold_change")),
    ("no-KL run: RM score change", lambda s: s.get(OVEROPTIMIZED, {}).get("rm_change")),
    ("no-KL run: KL (nats/response)", lambda s: s.get(OVEROPTIMIZED, {}).get("kl", [None])[0]),
)


def seeds_summary(summaries: list[dict]) -> dict:
    """Mean and sample standard deviation across seeds of each figure in ``_ACROSS_SEEDS``, plus per-seed values."""
    out = {"seeds": [s["seed"] for s in summaries], "figures": {}}
    for label, get in _ACROSS_SEEDS:
        values = [get(s) for s in summaries]
        if any(v is None for v in values):
            continue
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        out["figures"][label] = {"mean": mean, "std": std, "values": values}
    out["every_seed_gains_over_3_se_within_kl_budget"] = all(
        s["gold_gain_in_se"] > 3 and s["kl_under_target"] for s in summaries
    )
    out["any_reward_hacking"] = any(s["reward_hacking"] for s in summaries)
    return out


def write_seeds_report(out_dir: str, summaries: list[dict], machine: str | None = None) -> dict:
    """``seeds.md`` / ``seeds.json`` in ``out_dir``: each figure per seed, with mean and spread across seeds."""
    summary = seeds_summary(summaries)
    summary["machine"] = machine or _machine()
    seeds = summary["seeds"]
    lines = [
        f"# rlhf_lit demo across seeds {', '.join(map(str, seeds))}",
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
    lines += [
        "",
        "Every seed: gold gain > 3 standard errors within the KL budget: "
        f"**{'yes' if summary['every_seed_gains_over_3_se_within_kl_budget'] else 'NO'}**; reward hacking "
        f"(RM up while gold down) on any seed: **{'yes' if summary['any_reward_hacking'] else 'no'}**.",
    ]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "seeds.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(out_dir, "seeds.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return summary


def _machine() -> str:
    """The CPU model name (``/proc/cpuinfo``) and core count, for reports that say where they were made."""
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        import platform

        name = platform.processor() or name
    return f"{name}, {os.cpu_count()} cores"


def main(args: list[str]) -> None:
    """``rlhf-lit demo [--fast] [--seeds 0,1,2] [--report-only] [--no-overoptimized] [--out DIR]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="rlhf-lit demo", description=__doc__.split("\n")[0])
    parser.add_argument("--fast", action="store_true", help="shortened stages (the CI test uses this)")
    parser.add_argument(
        "--seeds",
        default="0",
        help="comma-separated demo seeds, e.g. 0,1,2: the pipeline runs once per seed (into <out>/seed_<k> "
        "when there are several) and seeds.md reports each figure's mean and spread across seeds",
    )
    parser.add_argument("--report-only", action="store_true", help="only evaluate the existing exports")
    parser.add_argument(
        "--no-overoptimized",
        action="store_true",
        help="skip the deliberately over-optimised PPO run (kl_coef 0) that shows the reward-hacking monitor",
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help="output folder of the stages and the report")
    ns = parser.parse_args(args)
    try:
        seeds = [int(k) for k in ns.seeds.split(",") if k.strip()]
    except ValueError:
        parser.error(f"--seeds: expected comma-separated integers, got {ns.seeds!r}")
    if not seeds:
        parser.error("--seeds: give at least one seed")
    summaries = []
    for seed in seeds:
        out = ns.out if len(seeds) == 1 else os.path.join(ns.out, f"seed_{seed}")
        seconds = None
        if not ns.report_only:
            seconds = run_stages(out, fast=ns.fast, seed=seed, overoptimized=not ns.no_overoptimized)
        summary = write_report(out, seed=seed, stage_seconds=seconds)
        summaries.append(summary)
        print(open(os.path.join(out, "report.md")).read())
        print(f"report: {os.path.join(out, 'report.md')}")
        if summary["gold_gain_in_se"] <= 3 or not summary["kl_under_target"]:
            log.warning(
                "seed %d: the PPO policy did not beat the SFT policy by > 3 standard errors within the KL budget",
                seed,
            )
    if len(seeds) > 1:
        write_seeds_report(ns.out, summaries)
        print(open(os.path.join(ns.out, "seeds.md")).read())
        print(f"across seeds: {os.path.join(ns.out, 'seeds.md')}")
