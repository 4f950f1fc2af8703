"""One judge for every policy: ``python -m experiments.heldout_rm.judge``.

Samples one response per held-out evaluation prompt from the reference (the starting policy: for the shipped
configs SmolLM2-135M-Instruct itself, which is also what "SFT" means in this experiment) and from each policy
export given with ``--policy NAME=FOLDER`` (the DPO and PPO arms' HF exports), with the same sampling settings,
prompt rendering and seeds for every policy (batch ``i`` is sampled after ``torch.manual_seed(seed + i)``, as
the PPO arm's callback does). Each response gets RM-A's and RM-B's calibrated scores, its KL to the reference
(sum over its tokens of the k1 and k3 estimators, nats, at the sampling temperature), its length (tokens, stop
token included) and whether it stopped. Each policy is then compared with the reference by
``experiments.heldout_rm.report.summarize``, paired by prompt, with the change that length does not explain.

The sampling settings, the prompt rendering (format, chat template, prompt cut) and the reference backbone (its
LoRA settings dropped) are read from one fit config, by default the PPO arm's
``configs/ppo/smollm2_heldout_rm.yaml``, so the judge evaluates exactly as that run's callback does.
Writes ``judge_report.json`` (every response's figures, and each policy's summary) and ``judge_report.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time

import torch
import yaml

from experiments.heldout_rm.report import FIELDS, _fmt, record_batch, summarize
from rlhf_lit.outputs import replace_file

log = logging.getLogger("rlhf_lit")


def read_settings(config: str) -> dict:
    """The reference backbone, sampling settings and prompt rendering of a fit config (module docstring)."""
    from rlhf_lit.models import BackboneConfig
    from rlhf_lit.rl.generation import SamplingConfig

    with open(config) as f:
        spec = yaml.safe_load(f)
    init = spec["model"]["init_args"]
    backbone = dict(init["backbone"])
    backbone.pop("lora", None)
    data = spec["data"]["init_args"]
    rendering = {
        k: data[k]
        for k in ("format", "chat_template", "max_prompt_length", "hh_first_turn_only")
        if k in data
    }
    return {
        "backbone": BackboneConfig(**backbone),
        "sampling": SamplingConfig(**init.get("sampling", {})),
        "rendering": rendering,
    }


@torch.no_grad()
def response_logprobs(lm, ids, mask, response_ids, response_mask, temperature: float) -> torch.Tensor:
    """``(B, R)`` log-probs of the response tokens under ``lm`` at ``temperature`` (positions from the mask)."""
    from rlhf_lit.functional.sequence import gather_logprobs, position_ids_from_mask, response_positions

    full = torch.cat([ids, response_ids], 1)
    full_mask = torch.cat([mask.long(), response_mask.long()], 1)
    logits = lm(
        input_ids=full, attention_mask=full_mask, position_ids=position_ids_from_mask(full_mask)
    ).logits
    return gather_logprobs(response_positions(logits, ids.shape[1]), response_ids, temperature)


@torch.no_grad()
def evaluate(
    policy, reference, batches, tokenizer, sampling, stop_ids, scorers, seed: int
) -> dict[str, list]:
    """One response per prompt of ``batches`` from ``policy``, and its figures (module docstring)."""
    from rlhf_lit.functional.sequence import trim_left_padding
    from rlhf_lit.rl.generation import sample_responses

    out = {k: [] for k in (*FIELDS, "prompt", "response")}
    for index, batch in enumerate(batches):
        ids, mask, _ = trim_left_padding(
            batch["input_ids"], batch["attention_mask"], batch["input_ids"].shape[1]
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + index)
            response_ids, response_mask, has_stop = sample_responses(
                policy, ids, mask, sampling, stop_ids, tokenizer.pad_token_id
            )
        T = sampling.temperature
        logprobs = response_logprobs(policy, ids, mask, response_ids, response_mask, T)
        ref = response_logprobs(reference, ids, mask, response_ids, response_mask, T)
        args = (ids, mask, response_ids, response_mask, has_stop, batch.get("prompt"))
        scores = {key: scorer.score(*args) for key, scorer in scorers.items()}
        record_batch(
            out, scores, logprobs, ref, batch, (ids, response_ids, response_mask, has_stop), tokenizer
        )
    return out


def _batches(prompts: str, settings: dict, tokenizer, num_prompts: int, batch_size: int) -> list[dict]:
    from rlhf_lit.data import PromptDataModule

    data = PromptDataModule(
        train_files=prompts,
        val_size=0,
        batch_size=batch_size,
        shuffle=False,
        tokenizer=tokenizer,
        **settings["rendering"],
    )
    data.setup("fit")
    batches = []
    for batch in data.train_dataloader():
        if len(batches) >= num_prompts // batch_size:
            break
        batches.append(batch)
    return batches


def judge(
    policies: dict[str, str],
    rm_a: str,
    rm_b: str,
    prompts: str,
    config: str,
    num_prompts: int = 96,
    batch_size: int = 16,
    seed: int = 1234,
) -> dict:
    """Evaluate the reference and every policy export; returns the report (module docstring).

    Args:
        policies: name -> HF export folder (merged weights, or an adapter-only export) of a policy trained
            from the config's backbone.
        rm_a, rm_b: reward-model export folders.
        prompts: the evaluation prompt file (``prompts_eval.jsonl`` of the PPO or DPO arm).
        config: the fit config the settings are read from (``read_settings``).
        num_prompts: how many prompts (the first ones, rounded down to whole batches).
        batch_size: prompts per sampling batch.
        seed: batch ``i`` is sampled after ``torch.manual_seed(seed + i)``.
    """
    from rlhf_lit.models import BackboneConfig
    from rlhf_lit.models.backbone import load_backbone, load_backbone_tokenizer
    from rlhf_lit.models.reward_source import RewardModelConfig, RewardSource
    from rlhf_lit.rl.generation import resolve_stop_ids

    settings = read_settings(config)
    tokenizer = load_backbone_tokenizer(settings["backbone"])
    reference = load_backbone(settings["backbone"], tokenizer).eval()
    scorers = {
        key: RewardSource(RewardModelConfig(path=path), tokenizer)
        for key, path in (("rm_a", rm_a), ("rm_b", rm_b))
    }
    batches = _batches(prompts, settings, tokenizer, num_prompts, batch_size)
    stop_ids = resolve_stop_ids(settings["sampling"], tokenizer)
    timings, evaluations = {}, {}
    for name, folder in {"reference": None, **policies}.items():
        t0 = time.perf_counter()
        lm = (
            reference
            if folder is None
            else load_backbone(BackboneConfig(name_or_path=folder), tokenizer).eval()
        )
        evaluations[name] = evaluate(
            lm, reference, batches, tokenizer, settings["sampling"], stop_ids, scorers, seed
        )
        timings[name] = time.perf_counter() - t0
        log.info(
            "judge: %s evaluated on %d prompts in %.0f s", name, len(evaluations[name]["rm_b"]), timings[name]
        )
    return {
        "prompts": len(evaluations["reference"]["rm_b"]),
        "policies": {"reference": settings["backbone"].name_or_path or "tiny", **policies},
        "reward_models": {"rm_a": os.path.abspath(rm_a), "rm_b": os.path.abspath(rm_b)},
        "summaries": {
            name: summarize(evaluations["reference"], ev)
            for name, ev in evaluations.items()
            if name != "reference"
        },
        "evaluations": evaluations,
        "timings": timings,
        "sampling": dataclasses.asdict(settings["sampling"]),
        "config": config,
    }


def judge_markdown(report: dict) -> str:
    """The report as one table: a row per policy, each compared with the reference, paired by prompt."""
    ref = report["evaluations"]["reference"]
    lines = [
        f"Held-out judge on {report['prompts']} prompts (mean ± standard error; changes paired by prompt, against the "
        "reference).",
        "",
        "| policy | RM-B score | RM-B change | RM-B change, length held fixed | RM-A change | KL to reference, k3 "
        "(nats/response) | length (tokens) | length change |",
        "|---|---|---|---|---|---|---|---|",
    ]
    from rlhf_lit.functional.summary import mean_se

    lines.append(f"| reference | {_fmt(mean_se(ref['rm_b']))} | | | | 0 | {_fmt(mean_se(ref['length']))} | |")
    for name, s in report["summaries"].items():
        m, ctl = s["metrics"], s["length_control"]["rm_b"]
        lines.append(
            f"| {name} | {_fmt(m['rm_b']['after'])} | {_fmt(m['rm_b']['change'])} | "
            f"{_fmt((ctl['adjusted_change'], ctl['adjusted_change_se']))} | {_fmt(m['rm_a']['change'])} | "
            f"{_fmt(m['kl_k3']['after'])} | {_fmt(m['length']['after'])} | {_fmt(m['length']['change'])} |"
        )
    lines.append("")
    lines += [f"- {name}: {s['verdict']}." for name, s in report["summaries"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.heldout_rm.judge",
        description="Judge the reference and policy exports on held-out prompts with RM-A and RM-B.",
    )
    parser.add_argument(
        "--rm-a", required=True, help="export folder of the reward model the PPO arm optimised"
    )
    parser.add_argument(
        "--rm-b", required=True, help="export folder of the held-out reward model (the judge)"
    )
    parser.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME=FOLDER",
        help="a policy export to judge (repeat)",
    )
    parser.add_argument(
        "--prompts",
        default="checkpoints/heldout_rm/prompts_eval.jsonl",
        help="evaluation prompts, as the PPO or DPO arm writes them (default: %(default)s)",
    )
    parser.add_argument(
        "--config",
        default="configs/ppo/smollm2_heldout_rm.yaml",
        help="fit config whose reference backbone, sampling settings and prompt rendering are used "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--eval-prompts", type=int, default=96, help="prompts to judge (default: %(default)s)"
    )
    parser.add_argument(
        "--eval-batch-size", type=int, default=16, help="prompts per batch (default: %(default)s)"
    )
    parser.add_argument(
        "--out", default="checkpoints/heldout_rm", help="report folder (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    policies = {}
    for spec in args.policy:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not os.path.isfile(os.path.join(folder, "config.json")):
            parser.exit(
                2, f"error: --policy {spec!r}: give NAME=FOLDER, a policy export folder (with config.json)\n"
            )
        policies[name] = folder
    for flag, folder in (("--rm-a", args.rm_a), ("--rm-b", args.rm_b)):
        if not os.path.isfile(os.path.join(folder, "rlhf_lit.json")):
            parser.exit(2, f"error: {flag} {folder!r} is not a reward-model export (no rlhf_lit.json)\n")
    if not os.path.isfile(args.prompts):
        parser.exit(2, f"error: --prompts {args.prompts!r} does not exist (the PPO or DPO arm writes it)\n")
    t0 = time.perf_counter()
    report = judge(
        policies, args.rm_a, args.rm_b, args.prompts, args.config, args.eval_prompts, args.eval_batch_size
    )
    report["timings"]["total_s"] = time.perf_counter() - t0
    report["load_average"] = list(os.getloadavg())
    os.makedirs(args.out, exist_ok=True)
    replace_file(os.path.join(args.out, "judge_report.json"), json.dumps(report, indent=1))
    replace_file(os.path.join(args.out, "judge_report.md"), judge_markdown(report))
    print(judge_markdown(report))
    return report


if __name__ == "__main__":
    main()
