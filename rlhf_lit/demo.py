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
import shutil
import time
from dataclasses import dataclass

import lightning as L
import torch

from rlhf_lit.data.demo_task import gold_score, label_noise_rate, preference_rows, prompt_rows
from rlhf_lit.functional.sequence import gather_logprobs, position_ids_from_mask
from rlhf_lit.generation import SamplingConfig, resolve_stop_ids, sample_responses
from rlhf_lit.metrics import DEMO_GOLD_SCORE
from rlhf_lit.models.export import load_reward_model, read_meta
from rlhf_lit.models.tokenizer import load_tokenizer
from rlhf_lit.plots import save_figure, scatter_by_step_figure

log = logging.getLogger("rlhf_lit")

STAGES = ("sft", "reward", "ppo")
DEFAULT_OUT = "checkpoints/demo"  # where configs/demo/*.yaml write


class GoldScoreCallback(L.Callback):
    """Logs the gold score of each PPO iteration's samples (evaluation only) and writes a history file.

    Args:
        history_file: JSON file with one record per iteration (iteration, gold score, RM score, KL);
            default: ``history.json`` in the trainer's ``default_root_dir``.
    """

    def __init__(self, history_file: str | None = None) -> None:
        self.history_file = history_file
        self.records: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sample = getattr(pl_module, "last_rollout", None)
        if not sample or not trainer.is_global_zero:
            return
        gold = [gold_score(p, r) for p, r in zip(sample["prompt_text"], sample["response_text"])]
        stats = pl_module.history[-1]
        record = {
            "iteration": pl_module.iteration,
            "gold_score": sum(gold) / len(gold),
            "rm_score": stats["rollout/score_mean"],
            "kl": stats["rollout/kl_ref"],
        }
        self.records.append(record)
        for logger in trainer.loggers:
            logger.log_metrics({DEMO_GOLD_SCORE: record["gold_score"]}, step=pl_module.iteration)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            path = self.history_file or os.path.join(trainer.default_root_dir, "history.json")
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(self.records, f, indent=1)


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


def stage_args(stage: str, out: str = DEFAULT_OUT, fast: bool = False) -> list[str]:
    """The ``rlhf-lit fit`` arguments of a demo stage, with every output under ``out``."""
    args = ["fit", "--config", _config(stage)]
    if out != DEFAULT_OUT:
        root = os.path.join(out, stage)
        args += [
            f"--trainer.default_root_dir={root}",
            f"--trainer.logger.init_args.save_dir={root}",
            f"--model.init_args.export_dir={root}/hf",
        ]
        if stage in ("reward", "ppo"):
            args.append(f"--model.init_args.backbone.name_or_path={out}/sft/hf")
        if stage == "ppo":
            args.append(f"--model.init_args.reward_model.path={out}/reward/hf")
    return args + (FAST_OVERRIDES[stage] if fast else [])


def run_stages(out: str = DEFAULT_OUT, fast: bool = False, stages=STAGES) -> dict[str, float]:
    """Run the demo stages in order, each as ``rlhf-lit fit --config configs/demo/<stage>.yaml``."""
    from rlhf_lit.cli import cli_main

    seconds = {}
    for stage in stages:
        t0 = time.perf_counter()
        log.info("demo: stage %s (%s)", stage, _config(stage))
        cli_main(stage_args(stage, out, fast))
        seconds[stage] = time.perf_counter() - t0
    return seconds


def write_report(
    out_dir: str = DEFAULT_OUT,
    n_prompts: int = 256,
    seed: int = 0,
    stage_seconds: dict[str, float] | None = None,
) -> dict:
    """Evaluate the demo's exports and write ``report.md``, ``report.json`` and PNGs into ``out_dir``."""
    sft_dir, rm_dir, ppo_dir = (os.path.join(out_dir, s, "hf") for s in STAGES)
    ppo_meta = read_meta(ppo_dir)
    rm_meta = read_meta(rm_dir)
    sampling = SamplingConfig(**{k: v for k, v in ppo_meta["sampling"].items()})
    prompts = [r["prompt"] for r in prompt_rows(n_prompts, seed=seed, split="test")]
    sft = evaluate_policy(sft_dir, sft_dir, rm_dir, prompts, sampling, seed)
    ppo = evaluate_policy(ppo_dir, sft_dir, rm_dir, prompts, sampling, seed)
    with open(os.path.join(rm_dir, "eval_results.json")) as f:
        rm_eval = json.load(f)
    rm_acc = reward_model_accuracy(rm_dir, seed=seed)
    history_file = os.path.join(out_dir, "ppo", "history.json")
    history = json.load(open(history_file)) if os.path.exists(history_file) else []
    target_kl = ppo_meta.get("target_kl")

    summary = {
        "held_out_prompts": n_prompts,
        "sft": {"gold": _mean_se(sft.gold), "rm": _mean_se(sft.rm), "kl": _mean_se(sft.kl)},
        "ppo": {"gold": _mean_se(ppo.gold), "rm": _mean_se(ppo.rm), "kl": _mean_se(ppo.kl)},
        "target_kl": target_kl,
        "reward_model": {
            **rm_acc,
            **{
                key: rm_eval["metrics"].get(f"reward/{key}")
                for key in ("ece", "ece_calibrated", "nll", "nll_calibrated")
            },
            "temperature": rm_meta.get("temperature"),
        },
        "stage_seconds": stage_seconds or {},
    }
    gain = summary["ppo"]["gold"][0] - summary["sft"]["gold"][0]
    se = math.hypot(summary["ppo"]["gold"][1], summary["sft"]["gold"][1])
    summary["gold_gain"] = gain
    summary["gold_gain_in_se"] = gain / se if se > 0 else float("inf")
    summary["kl_under_target"] = target_kl is None or summary["ppo"]["kl"][0] < target_kl

    os.makedirs(out_dir, exist_ok=True)
    if history:
        kls = [h["kl"] for h in history]
        fig = scatter_by_step_figure(
            kls,
            {
                "gold score": [h["gold_score"] for h in history],
                "RM score (calibrated)": [h["rm_score"] for h in history],
            },
            "KL(policy || reference), nats per response",
            "PPO iterations: score against KL (Gao et al. 2022 frontier)",
        )
        save_figure(fig, os.path.join(out_dir, "frontier.png"))
    if os.path.exists(os.path.join(rm_dir, "reliability.png")):
        shutil.copyfile(os.path.join(rm_dir, "reliability.png"), os.path.join(out_dir, "reliability.png"))
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(_markdown(summary, prompts, sft, ppo, bool(history)))
    return summary


def _fmt(pair) -> str:
    return f"{pair[0]:.3f} ± {pair[1]:.3f}"


def _markdown(s: dict, prompts, sft: PolicyEval, ppo: PolicyEval, has_history: bool) -> str:
    rm = s["reward_model"]
    lines = [
        "# rlhf_lit demo report: echo task, SFT -> reward model -> PPO",
        "",
        f"Held-out prompts: {s['held_out_prompts']} (none seen in training). Mean ± standard error.",
        "",
        "| policy | gold score | RM score (calibrated) | KL to reference (nats/response) |",
        "|---|---|---|---|",
        f"| SFT | {_fmt(s['sft']['gold'])} | {_fmt(s['sft']['rm'])} | {_fmt(s['sft']['kl'])} |",
        f"| PPO | {_fmt(s['ppo']['gold'])} | {_fmt(s['ppo']['rm'])} | {_fmt(s['ppo']['kl'])} |",
        "",
        f"Gold gain of PPO over SFT: **{s['gold_gain']:+.3f}** ({s['gold_gain_in_se']:.1f} standard errors). "
        f"KL budget (kl.target_kl): {s['target_kl']} nats; PPO's KL is "
        f"{'under' if s['kl_under_target'] else 'OVER'} it.",
        "",
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
    if has_history:
        lines += ["## PPO: gold and RM score against KL", "", "![frontier](frontier.png)", ""]
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


def main(args: list[str]) -> None:
    """``rlhf-lit demo [--fast] [--report-only] [--out DIR]``: run the three stages, then write the report."""
    import argparse

    parser = argparse.ArgumentParser(prog="rlhf-lit demo", description=__doc__.split("\n")[0])
    parser.add_argument("--fast", action="store_true", help="shortened stages (the CI test uses this)")
    parser.add_argument("--report-only", action="store_true", help="only evaluate the existing exports")
    parser.add_argument("--out", default=DEFAULT_OUT, help="output folder of the stages and the report")
    ns = parser.parse_args(args)
    out = ns.out
    seconds = None if ns.report_only else run_stages(out, fast=ns.fast)
    summary = write_report(out, stage_seconds=seconds)
    print(open(os.path.join(out, "report.md")).read())
    print(f"report: {os.path.join(out, 'report.md')}")
    if summary["gold_gain_in_se"] <= 3 or not summary["kl_under_target"]:
        log.warning("the PPO policy did not beat the SFT policy by > 3 standard errors within the KL budget")
