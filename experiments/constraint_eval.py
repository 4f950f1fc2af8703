"""Evaluation and report of ``experiments/constraint_proof.py``: held-out constraint pass rate (with standard
errors) and KL to the reference of a policy (the start, or the start plus a trained LoRA adapter), the
training curves from the runs' CSV logs, the mean of a run over its seeds, and ``report.json`` / ``report.md`` /
``curves.png``.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

from rlhf_lit.functional.summary import mean_se
from rlhf_lit.outputs import replace_file

NUM_SE = 3.0  # the acceptance bar: the pass rate must rise by more than this many standard errors


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def passes(text: str, has_stop: bool, max_words: int) -> bool:
    """A response meets "answer in at most N words" when it ended (a stop token, not cut at
    ``max_new_tokens``) and has at most N whitespace-separated words."""
    return bool(has_stop) and len(text.split()) <= max_words


def _models(config: dict, adapter_dir: Path | None):
    """``(tokenizer, policy, reference context)``: the config's base, plus the adapter when given."""
    import contextlib

    from rlhf_lit.models.backbone import BackboneConfig, load_backbone, load_backbone_tokenizer

    spec = dict(config["model"]["init_args"]["backbone"])
    spec.pop("lora", None)
    cfg = BackboneConfig(**spec)
    tokenizer = load_backbone_tokenizer(cfg)
    model = load_backbone(cfg, tokenizer)
    if adapter_dir is None:
        return tokenizer, model, None
    from peft import PeftModel

    policy = PeftModel.from_pretrained(model, str(Path(adapter_dir) / "adapter"))  # export_mode: adapter
    policy.eval()
    return (
        tokenizer,
        policy,
        (policy.disable_adapter if hasattr(policy, "disable_adapter") else contextlib.nullcontext),
    )


def _prompt_batches(config: dict, tokenizer, heldout_file: Path, batch_size: int):
    """The held-out prompts rendered and tokenised exactly as in training (the run's PromptDataModule
    settings, ``train_files`` replaced), in file order."""
    from rlhf_lit.data import PromptDataModule

    data = dict(config["data"]["init_args"])
    data.update(
        train_files=[str(heldout_file)], val_files=None, val_size=0, batch_size=batch_size, shuffle=False
    )
    data.pop("val_batch_size", None)
    module = PromptDataModule(**data, tokenizer=tokenizer)
    module.setup("fit")
    return list(module.train_dataloader())


def _response_logprobs(model, input_ids, attention_mask, response_ids, response_mask, temperature: float):
    """``(B, R)`` log-probs of the response tokens at ``temperature`` (0 off the mask)."""
    import torch

    from rlhf_lit.functional.sequence import position_ids_from_mask

    ids = torch.cat([input_ids, response_ids], dim=1)
    mask = torch.cat([attention_mask, response_mask.long()], dim=1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    P = input_ids.shape[1]
    logp = torch.log_softmax(logits[:, P - 1 : -1].float() / temperature, dim=-1)
    return logp.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1) * response_mask


def evaluate(
    config: dict,
    adapter_dir: Path | None,
    heldout_file: Path,
    samples: int,
    batch_size: int,
    seed: int,
    threads: int,
) -> dict:
    """Held-out pass rate and KL to the reference of the start policy (``adapter_dir`` None) or of the
    start plus the adapter in ``adapter_dir``; ``samples`` responses per prompt at the config's sampling
    settings (seeded). KL: k1 sum over response tokens, nats per response, exactly 0 for the start policy."""
    import torch

    from rlhf_lit.rl.generation import SamplingConfig, resolve_stop_ids, sample_responses

    torch.set_num_threads(threads)
    tokenizer, policy, reference = _models(config, adapter_dir)
    sampling = SamplingConfig(
        **{k: v for k, v in config["model"]["init_args"]["sampling"].items() if k != "num_samples_per_prompt"}
    )
    stop_ids = resolve_stop_ids(sampling, tokenizer)
    passed, kls, words, ended, examples, prompt_of = [], [], [], [], [], []
    torch.manual_seed(seed)
    with torch.no_grad():
        for batch in _prompt_batches(config, tokenizer, heldout_file, batch_size):
            for _ in range(samples):
                ids, mask = batch["input_ids"], batch["attention_mask"]
                resp, resp_mask, has_stop = sample_responses(
                    policy, ids, mask, sampling, stop_ids, tokenizer.pad_token_id
                )
                if reference is None:
                    kl = torch.zeros(resp.shape[0])
                else:
                    lp = _response_logprobs(policy, ids, mask, resp, resp_mask, sampling.temperature)
                    with reference():
                        ref = _response_logprobs(policy, ids, mask, resp, resp_mask, sampling.temperature)
                    kl = (lp - ref).sum(-1)
                for i in range(resp.shape[0]):
                    text = tokenizer.decode(resp[i][resp_mask[i]], skip_special_tokens=True)
                    limit = int(batch["fields"][i]["constraints"]["max_words"])
                    passed.append(float(passes(text, bool(has_stop[i]), limit)))
                    prompt_of.append(int(batch["prompt_index"][i]))
                    kls.append(float(kl[i]))
                    words.append(float(len(text.split())))
                    ended.append(float(has_stop[i]))
                    if len(examples) < 6:
                        examples.append(
                            dict(limit=limit, ended=bool(has_stop[i]), passed=bool(passed[-1]), response=text)
                        )
    (p, p_se), (k, k_se) = mean_se(passed), mean_se(kls)
    per_prompt: dict[int, list[float]] = {}
    for index, value in zip(prompt_of, passed):
        per_prompt.setdefault(index, []).append(value)
    return dict(
        pass_rate=p,
        pass_rate_se=p_se,
        kl=k,
        kl_se=k_se,
        n=len(passed),
        mean_words=mean_se(words)[0],
        eos_rate=mean_se(ended)[0],
        examples=examples,
        per_prompt_pass=[sum(v) / len(v) for _, v in sorted(per_prompt.items())],
    )


def training_history(run_dir: Path) -> list[dict]:
    """Per-iteration rows of the run's CSV log (``<run>/csv/version_*/metrics.csv``) that have a score."""
    files = sorted(run_dir.glob("csv/version_*/metrics.csv"))
    if not files:
        return []
    with open(files[-1]) as f:
        rows = list(csv.DictReader(f))
    keep = ("rollout/score_mean", "rollout/kl_ref", "rollout/response_len", "rollout/no_eos_frac")
    # logged only with ppo.dynamic_sampling (DAPO): its filtered groups and extra rounds, i.e. its extra sampling
    keep += ("rollout/filtered_groups", "rollout/dynamic_sampling_rounds")
    out = []
    for row in rows:
        if row.get("rollout/score_mean"):
            out.append({k: float(row[k]) for k in keep if row.get(k)} | {"iteration": len(out) + 1})
    return out


def _in_se(value: float, se: float) -> float | None:
    """``value / se``; None (JSON null, shown "n/a") when the SE is 0 (e.g. identical before and after)."""
    return value / se if se > 0 else None


def _se_text(in_se: float | None) -> str:
    return "n/a SE" if in_se is None else f"{in_se:.1f} SE"


def _budget_text(budget, under: bool | None) -> str:
    """The KL budget cell: ``<budget>; under`` / ``OVER``, or ``no budget`` (no ``kl.target_kl``)."""
    return "no budget" if under is None else f"{budget}; {'under' if under else 'OVER'}"


def run_summary(config: dict, run_dir: Path, wall_s: float, before: dict, after: dict) -> dict:
    """One run's figures: before / after, the rise in standard errors, KL against the budget."""
    init = config["model"]["init_args"]
    rise = after["pass_rate"] - before["pass_rate"]
    se = math.sqrt(before["pass_rate_se"] ** 2 + after["pass_rate_se"] ** 2)
    budget = (init.get("kl") or {}).get("target_kl")
    diffs = [a - b for a, b in zip(after["per_prompt_pass"], before["per_prompt_pass"])]
    paired_se = mean_se(diffs)[1]
    return dict(
        estimator=(init.get("ppo") or {}).get("advantage_estimator", "gae"),
        fit_minutes=wall_s / 60,
        after=after,
        rise=rise,
        rise_se=se,
        rise_in_se=_in_se(rise, se),
        rise_above_3se=rise > NUM_SE * se,
        kl_budget=budget,
        paired_rise_se=paired_se,
        paired_rise_in_se=_in_se(rise, paired_se),
        kl_under_budget=None if budget is None else after["kl"] < budget,
        history=training_history(run_dir),
        config=str(run_dir / "config.yaml"),
    )


def _mean_and_ses(values: list[float], eval_ses: list[float]) -> tuple[float, float | None, float]:
    """``(mean, SE over seeds, SE of the evaluation)`` of one figure of S seeds' runs: the SE over seeds is
    ``s / sqrt(S)`` of the S values (None for one seed); the evaluation's is ``sqrt(sum SE_s^2) / S``, the
    sampling noise of the held-out evaluation alone."""
    mean, seed_se = mean_se(values)
    eval_se = math.sqrt(sum(se**2 for se in eval_ses)) / len(eval_ses)
    return mean, (None if len(values) < 2 else seed_se), eval_se


def method_summary(before: dict, runs: list[dict]) -> dict:
    """One run (method) over its seeds: the means of its seeds' figures (``run_summary`` dicts ``runs``, each
    with its ``seed``), each with two standard errors, and the headline SE, the larger of the two.

    The SE over seeds (``s / sqrt(S)``) holds the training's seed-to-seed variation and, in expectation, the
    evaluation's noise, but with two seeds it rests on one degree of freedom and can come out small by chance;
    the evaluation's SE (``sqrt(sum SE_s^2) / S``) is a floor. The pass-rate change is the mean pass rate after
    minus the start's, which every seed shares: its SE adds the start's, ``sqrt(SE_after^2 + SE_start^2)``.
    E.g. after 0.7 +- 0.03 and 0.5 +- 0.04 from 0.3 +- 0.03: mean 0.6, SE over seeds 0.1 (half the spread of two
    values), of the evaluation 0.025; change +0.3 +- sqrt(0.1^2 + 0.03^2) = 0.104.
    """
    afters = [r["after"] for r in runs]
    p, p_seeds, p_eval = _mean_and_ses([a["pass_rate"] for a in afters], [a["pass_rate_se"] for a in afters])
    kl, kl_seeds, kl_eval = _mean_and_ses([a["kl"] for a in afters], [a["kl_se"] for a in afters])
    b_se = before["pass_rate_se"]
    p_se = p_eval if p_seeds is None else max(p_seeds, p_eval)
    rise = p - before["pass_rate"]
    rise_se = math.sqrt(p_se**2 + b_se**2)
    budget = runs[0]["kl_budget"]
    return dict(
        seeds=[r.get("seed") for r in runs],
        estimator=runs[0]["estimator"],
        pass_rate=p,
        pass_rate_se=p_se,
        pass_rate_se_seeds=p_seeds,
        pass_rate_se_eval=p_eval,
        rise=rise,
        rise_se=rise_se,
        rise_se_seeds=None if p_seeds is None else math.sqrt(p_seeds**2 + b_se**2),
        rise_se_eval=math.sqrt(p_eval**2 + b_se**2),
        rise_in_se=_in_se(rise, rise_se),
        rise_above_3se=rise > NUM_SE * rise_se,
        kl=kl,
        kl_se=kl_eval if kl_seeds is None else max(kl_seeds, kl_eval),
        kl_se_seeds=kl_seeds,
        kl_se_eval=kl_eval,
        kl_budget=budget,
        kl_under_budget=None if budget is None else kl < budget,
        mean_words=mean_se([a["mean_words"] for a in afters])[0],
        eos_rate=mean_se([a["eos_rate"] for a in afters])[0],
        fit_minutes=mean_se([r["fit_minutes"] for r in runs])[0],
    )


def method_summaries(report: dict) -> dict:
    """``{run: method_summary}`` over the seeded runs of ``report["runs"]`` (keys ``<run>/seed<s>``, in order of
    first appearance), each with ``vs``: its mean pass rate minus the first run's, and that difference's SE
    ``sqrt(SE_a^2 + SE_b^2)`` (the start's SE cancels: both are measured from the same start); None for the
    first.
    """
    groups: dict[str, list[dict]] = {}
    for key, run in report["runs"].items():
        if "seed" in run:
            groups.setdefault(key.rsplit("/seed", 1)[0], []).append(run)
    out = {name: method_summary(report["before"], runs) for name, runs in groups.items()}
    names = list(out)
    for i, m in enumerate(out.values()):
        if i == 0:
            m["vs"] = None
            continue
        ref = out[names[0]]
        diff = m["pass_rate"] - ref["pass_rate"]
        se = math.sqrt(m["pass_rate_se"] ** 2 + ref["pass_rate_se"] ** 2)
        m["vs"] = dict(run=names[0], diff=diff, diff_se=se, diff_in_se=_in_se(diff, se))
    return out


def _methods_markdown(report: dict) -> list[str]:
    """The per-run table over seeds (``report["methods"]``)."""
    first = next(iter(report["methods"]))
    lines = [
        "",
        f"## Mean over seeds {report['seeds']}",
        "",
        "SE: the larger of the SE over seeds and the evaluation's alone (both given, seeds / evaluation); the "
        "change adds the start's SE; the difference to the first run does not (the same start).",
        "",
        f"| run | held-out pass rate +- SE | change +- SE (in SE) | vs {first} +- SE | KL to reference, "
        "nats/response +- SE (budget) | mean words | EOS rate | fit minutes (mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def ses(seeds, evaluation):
        return f"{'-' if seeds is None else f'{seeds:.3f}'} / {evaluation:.3f}"

    for name, m in report["methods"].items():
        v = m["vs"]
        vs = "" if v is None else f"{v['diff']:+.3f} +- {v['diff_se']:.3f} ({_se_text(v['diff_in_se'])})"
        p_ses = ses(m["pass_rate_se_seeds"], m["pass_rate_se_eval"])
        lines.append(
            f"| {name} | {m['pass_rate']:.3f} +- {m['pass_rate_se']:.3f} ({p_ses}) "
            f"| {m['rise']:+.3f} +- {m['rise_se']:.3f} ({_se_text(m['rise_in_se'])}, "
            f"{'>' if m['rise_above_3se'] else 'NOT >'} 3 SE) | {vs} "
            f"| {m['kl']:.3f} +- {m['kl_se']:.3f} ({ses(m['kl_se_seeds'], m['kl_se_eval'])}; "
            f"{_budget_text(m['kl_budget'], m['kl_under_budget'])}) | {m['mean_words']:.1f} | {m['eos_rate']:.2f} "
            f"| {m['fit_minutes']:.1f} |"
        )
    return lines


def markdown(report: dict) -> str:
    b = report["before"]
    lines = [
        "# Constraint proof: held-out pass rate before / after",
        "",
        f"{report['n_heldout']} held-out prompts x {report['samples_per_prompt']} samples; "
        f"{report['n_train']} training prompts; word limits {report['limits']}. Command: `{report['command']}`",
        "",
        "| policy | pass rate +- SE | rise (in SE) | KL to reference, nats/response +- SE (budget) | "
        "mean words | EOS rate | fit minutes |",
        "|---|---|---|---|---|---|---|",
        f"| start | {b['pass_rate']:.3f} +- {b['pass_rate_se']:.3f} | | 0 | {b['mean_words']:.1f} | "
        f"{b['eos_rate']:.2f} | |",
    ]
    for name, r in report["runs"].items():
        a = r["after"]
        lines.append(
            f"| {name} | {a['pass_rate']:.3f} +- {a['pass_rate_se']:.3f} | {r['rise']:+.3f} ({_se_text(r['rise_in_se'])}, "
            f"{'>' if r['rise_above_3se'] else 'NOT >'} 3 SE; paired by prompt {_se_text(r['paired_rise_in_se'])}) | {a['kl']:.3f} +- {a['kl_se']:.3f} "
            f"({_budget_text(r['kl_budget'], r['kl_under_budget'])}) | {a['mean_words']:.1f} | "
            f"{a['eos_rate']:.2f} | {r['fit_minutes']:.1f} |"
        )
    if report.get("methods"):
        lines += _methods_markdown(report)
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, r in report["runs"].items():
        h = r["history"]
        if h:
            axes[0].plot([x["iteration"] for x in h], [x["rollout/score_mean"] for x in h], label=name)
            axes[1].plot([x["iteration"] for x in h], [x.get("rollout/kl_ref", 0.0) for x in h], label=name)
    axes[0].set(title="training reward (rollout/score_mean)", xlabel="iteration")
    axes[1].set(title="KL to reference (rollout/kl_ref, nats)", xlabel="iteration")
    names = ["start", *report["runs"]]
    rates = [report["before"]] + [r["after"] for r in report["runs"].values()]
    axes[2].bar(names, [x["pass_rate"] for x in rates], yerr=[x["pass_rate_se"] for x in rates], capsize=6)
    axes[2].set(title="held-out pass rate (+- 1 SE)", ylim=(0, 1))
    if report.get("methods"):  # several seeds: long run names
        axes[2].tick_params(axis="x", labelrotation=45)
    for ax in axes[:2]:
        if ax.get_legend_handles_labels()[0]:  # no curves without CSV logs
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    replace_file(str(out / "report.json"), json.dumps(report, indent=2))
    replace_file(str(out / "report.md"), markdown(report))
    plot(report, out / "curves.png")
