"""PPO judged by a reward model it never saw: RM-A trains the policy, RM-B (trained on the other half of the
preference pairs) judges it on held-out prompts, before and after.

A reward model's score rising under PPO only says that PPO optimises what it is given (Gao et al. 2022,
"Scaling Laws for Reward Model Overoptimization", use a second, "gold" model for this reason). Here the
second opinion is a reward model of the same recipe trained on disjoint pairs: if RM-B also scores the PPO
policy higher on prompts neither PPO nor either reward model trained on, the gain is not an artefact of
RM-A alone; if the gain is only in length (RM-B scores longer responses higher), the report says so.

``HeldOutRewardCallback`` (a Lightning callback on a ``PPOModule`` fit):

* before the first PPO iteration and after the last, samples one response per evaluation prompt with the
  actor (the same seeds both times, so responses are paired by prompt), and records per response: RM-A's
  and RM-B's calibrated scores, the KL to the reference (sum over the response's tokens of the k1 and k3
  estimators, nats, at the sampling temperature), the response length (tokens, stop token included) and
  whether it stopped. Before any update the actor IS the reference, so the KL before is 0 exactly.
  Sampling runs under a forked RNG, so the PPO run itself is the one it would be without the callback.
* every iteration, scores the iteration's rollout responses with RM-B too (the same inputs PPO gave RM-A,
  rebuilt for RM-B's tokenizer by ``RewardSource``) and puts the mean into the iteration's history as
  ``heldout/rm_score``, where ``RewardHackingMonitor`` reads it as a held-out signal (``monitor.heldout``).
* at the end writes ``heldout_report.json`` and ``heldout_report.md``: means with standard errors before and
  after, the paired change with its SE, and for both reward models the change that length does not explain
  (``rlhf_lit.functional.length_bias.length_adjusted_change``), with a one-line verdict on RM-B.

``main`` (``python -m rlhf_lit.heldout_rm`` or ``scripts/heldout_rm_ppo.py``) runs the whole experiment from
two reward-model exports: it checks from their records that they share one validation split and were trained
on disjoint parts, writes the PPO training prompts (the HH prompts of the training pairs) and the evaluation
prompts (those of the validation pairs, which no reward model and no PPO iteration saw), and runs
``rlhf-lit fit`` on the PPO config with RM-A as the reward model and this callback attached.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time

import lightning as L
import torch

from rlhf_lit import metrics as M
from rlhf_lit.functional.kl import kl_per_token
from rlhf_lit.functional.length_bias import length_adjusted_change, mean_and_se, score_length_spearman
from rlhf_lit.functional.sequence import trim_left_padding
from rlhf_lit.generation import sample_responses
from rlhf_lit.models.reward_source import RewardModelConfig, RewardSource

log = logging.getLogger("rlhf_lit")

FIELDS = ("rm_a", "rm_b", "kl_k1", "kl_k3", "length", "stopped")
NUM_SAMPLES = 6  # prompts whose responses (before and after) the report shows
LABELS = {
    "rm_a": "RM-A score (PPO's reward model)",
    "rm_b": "RM-B score (held out)",
    "kl_k1": "KL to reference, k1 (nats/response)",
    "kl_k3": "KL to reference, k3 (nats/response)",
    "length": "response length (tokens)",
    "stopped": "responses that stopped (fraction)",
}


class HeldOutRewardCallback(L.Callback):
    """Scores a PPO run with a held-out reward model (module docstring).

    Args:
        reward_model: RM-B's export folder (any reward model ``RewardSource`` can load).
        eval_prompts: a prompt file (any ``PromptDataModule`` format) of held-out prompts; read with the
            training data module's settings (format, chat template, prompt length).
        num_eval_prompts: how many of them to evaluate (the first ones; rounded down to whole batches).
        eval_batch_size: prompts per sampling batch.
        report_dir: where the report goes (default: the trainer's ``default_root_dir``).
        seed: sampling seed of the evaluation batches (the same before and after).
    """

    def __init__(
        self,
        reward_model: str,
        eval_prompts: str,
        num_eval_prompts: int = 96,
        eval_batch_size: int = 16,
        report_dir: str | None = None,
        seed: int = 1234,
    ) -> None:
        if num_eval_prompts < eval_batch_size:
            raise ValueError(
                f"num_eval_prompts ({num_eval_prompts}) must be >= eval_batch_size ({eval_batch_size})"
            )
        self.reward_model = reward_model
        self.eval_prompts = eval_prompts
        self.num_eval_prompts = num_eval_prompts
        self.eval_batch_size = eval_batch_size
        self.report_dir = report_dir
        self.seed = seed
        self.source: RewardSource | None = None
        self.evaluations: dict[str, dict[str, list[float]]] = {}
        self.timings: dict[str, float] = {}
        self._rollout_scores: torch.Tensor | None = None
        self._observed = None

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.source is None:
            self.source = RewardSource(RewardModelConfig(path=self.reward_model), pl_module.tokenizer)
        self.source.to(pl_module.device)
        rm_a = pl_module.reward_source
        if self._observed is None:
            original = rm_a.score

            def score_and_observe(*args, **kwargs):
                scores = original(*args, **kwargs)
                self._rollout_scores = self.source.score(*args, **kwargs)
                return scores

            self._observed = original
            rm_a.score = score_and_observe  # an instance attribute: the PPO module calls this one

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._observed is not None:
            del pl_module.reward_source.score  # back to the class's method
            self._observed = None

    def _eval_loader(self, trainer, pl_module):
        from rlhf_lit.data import PromptDataModule

        dm = trainer.datamodule
        data = PromptDataModule(
            train_files=self.eval_prompts,
            format=getattr(dm, "format", "auto"),
            hh_first_turn_only=getattr(dm, "hh_first_turn_only", False),
            chat_template=getattr(dm, "chat_template", False),
            max_prompt_length=getattr(dm, "max_prompt_length", None),
            val_size=0,
            batch_size=self.eval_batch_size,
            shuffle=False,
            tokenizer=pl_module.tokenizer,
        )
        data.setup("fit")
        return data.train_dataloader()

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, trainer, pl_module) -> dict[str, list[float]]:
        """One response per evaluation prompt from the current actor, and what is recorded about it."""
        out = {k: [] for k in FIELDS}
        out["prompt"], out["response"] = [], []
        batches = self.num_eval_prompts // self.eval_batch_size
        policy, T = pl_module.policy, pl_module.sampling.temperature
        for index, batch in enumerate(self._eval_loader(trainer, pl_module)):
            if index >= batches:
                break
            batch = {k: v.to(pl_module.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            ids, mask, _ = trim_left_padding(
                batch["input_ids"], batch["attention_mask"], batch["input_ids"].shape[1]
            )
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed + index)
                with policy.lm.adapter("actor"):
                    response_ids, response_mask, has_stop = sample_responses(
                        policy.lm,
                        ids,
                        mask,
                        pl_module.sampling,
                        pl_module.stop_ids,
                        pl_module.tokenizer.pad_token_id,
                    )
            full = torch.cat([ids, response_ids], 1)
            full_mask = torch.cat([mask.long(), response_mask.long()], 1)
            P = ids.shape[1]
            logprobs = policy(full, full_mask, P, T, want_values=False).logprobs
            ref = policy.reference_logprobs(full, full_mask, P, T)
            real = response_mask.float()
            args = (ids, mask, response_ids, response_mask, has_stop, batch.get("prompt"))
            rm_a = self._observed if self._observed is not None else pl_module.reward_source.score
            out["rm_a"] += rm_a(*args).tolist()
            out["rm_b"] += self.source.score(*args).tolist()
            out["kl_k1"] += (kl_per_token(logprobs, ref, "k1") * real).sum(-1).tolist()
            out["kl_k3"] += (kl_per_token(logprobs, ref, "k3") * real).sum(-1).tolist()
            out["length"] += response_mask.sum(-1).float().tolist()
            out["stopped"] += has_stop.float().tolist()
            out["prompt"] += list(batch.get("prompt_text") or [""] * ids.shape[0])
            out["response"] += [
                pl_module.tokenizer.decode(r[m], skip_special_tokens=True)
                for r, m in zip(response_ids, response_mask)
            ]
        return out

    def on_train_start(self, trainer, pl_module) -> None:
        if "before" not in self.evaluations:
            t0 = time.perf_counter()
            self.evaluations["before"] = self.evaluate(trainer, pl_module)
            self.timings["eval_before_s"] = time.perf_counter() - t0
            self._log_summary("before")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        history = getattr(pl_module, "history", None)
        if self._rollout_scores is None or not history:
            return
        value = float(self._rollout_scores.float().mean())
        self._rollout_scores = None
        history[-1][M.HELDOUT_RM_SCORE] = value
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({M.HELDOUT_RM_SCORE: value}, step=pl_module.iteration)

    def on_train_end(self, trainer, pl_module) -> None:
        t0 = time.perf_counter()
        self.evaluations["after"] = self.evaluate(trainer, pl_module)
        self.timings["eval_after_s"] = time.perf_counter() - t0
        self._log_summary("after")
        if trainer.is_global_zero:
            report = self.report(pl_module)
            folder = self.report_dir or trainer.default_root_dir
            write_report(report, folder)
            log.info("held-out RM: %s (report in %s)", report["verdict"], os.path.abspath(folder))

    def _log_summary(self, when: str) -> None:
        ev = self.evaluations[when]
        log.info(
            "held-out RM, %s PPO: %d prompts, RM-A %.3f, RM-B %.3f, KL(k3) %.3f nats, length %.1f tokens",
            when,
            len(ev["rm_b"]),
            *(mean_and_se(torch.tensor(ev[k]))[0] for k in ("rm_a", "rm_b", "kl_k3", "length")),
        )

    # ------------------------------------------------------------------ report
    def report(self, pl_module) -> dict:
        """The numbers of the report (see ``summarize``), with the run's history and settings."""
        before, after = self.evaluations["before"], self.evaluations["after"]
        report = summarize(before, after)
        report["samples"] = [
            {
                "prompt": before["prompt"][i][-300:],
                "before": {
                    "response": before["response"][i],
                    "rm_a": before["rm_a"][i],
                    "rm_b": before["rm_b"][i],
                },
                "after": {
                    "response": after["response"][i],
                    "rm_a": after["rm_a"][i],
                    "rm_b": after["rm_b"][i],
                },
            }
            for i in range(min(NUM_SAMPLES, report["prompts"]))
        ]
        history = getattr(pl_module, "history", [])
        report["iterations"] = len(history)
        report["history"] = [
            {
                "iteration": int(h.get(M.PPO_ITERATION, i + 1)),
                "rm_a": h.get(M.ROLLOUT_SCORE_MEAN),
                "rm_b": h.get(M.HELDOUT_RM_SCORE),
                "kl": h.get(M.ROLLOUT_KL_REF),
                "response_len": h.get(M.ROLLOUT_RESPONSE_LEN),
                "overoptimization": bool(h.get(M.MONITOR_OVEROPTIMIZATION)),
            }
            for i, h in enumerate(history)
        ]
        report["monitor_flagged_iterations"] = sum(r["overoptimization"] for r in report["history"])
        report["reward_models"] = {"rm_a": _rm_path(pl_module), "rm_b": os.path.abspath(self.reward_model)}
        report["timings"] = dict(self.timings)
        return report


def _rm_path(pl_module) -> str | None:
    path = getattr(pl_module.reward_model_cfg, "path", None)
    return os.path.abspath(path) if path else None


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
        diff = mean_and_se(a - b)
        metrics[key] = {"before": mean_and_se(b), "after": mean_and_se(a), "change": diff}
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
        return f"RM-B scores the PPO policy LOWER ({raw:+.3f} +- {raw_se:.3f}): RM-A was over-optimised"
    if not beyond(adj, adj_se) or adj < 0:
        return (
            f"RM-B agrees the score rose ({raw:+.3f} +- {raw_se:.3f}), but it is only a length gain: with length "
            f"held fixed the change is {adj:+.3f} +- {adj_se:.3f}"
        )
    return (
        f"RM-B agrees PPO improved the policy ({raw:+.3f} +- {raw_se:.3f}), beyond length: {adj:+.3f} +- "
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
    with open(os.path.join(folder, "heldout_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(folder, "heldout_report.md"), "w") as f:
        f.write(report_markdown(report))


# ---------------------------------------------------------------------- the experiment from two exports
def _data_record(export: str) -> dict:
    from rlhf_lit.models.export import read_meta

    record = read_meta(export).get("data")
    if not record:
        raise ValueError(f"{export!r} records no training data (exported by an older rlhf_lit?); retrain it")
    return record


def check_disjoint(record_a: dict, record_b: dict) -> None:
    """Refuse two reward models that do not share one validation split or whose training pairs overlap.

    Raises:
        ValueError: naming the setting that differs.
    """
    split = ("train_files", "val_files", "val_size", "seed", "format", "max_length", "min_prompt_tokens")
    for key in split:
        if record_a.get(key) != record_b.get(key):
            raise ValueError(
                f"RM-A and RM-B were not split alike: {key} is {record_a.get(key)!r} vs {record_b.get(key)!r}"
            )
    a, b = record_a.get("train_part"), record_b.get("train_part")
    if a is None or b is None or a[1] != b[1] or a[0] == b[0]:
        raise ValueError(
            f"RM-A and RM-B must be trained on different parts of one split (data.train_part), got {a} and {b}"
        )
    if record_a.get("max_train_samples_per_file") != record_b.get("max_train_samples_per_file"):
        raise ValueError("RM-A and RM-B use different max_train_samples_per_file")


def write_prompt_files(export_a: str, out: str, num_eval: int, seed: int = 0) -> tuple[str, str, dict]:
    """The PPO training prompts (of the training pairs, all parts) and ``num_eval`` evaluation prompts (of
    the validation pairs, the same number from each file, a seeded sample) as JSONL files in ``out``.

    The split is rebuilt with the preference data module and RM-A's recorded settings; each line holds the
    pair's chosen transcript (``{"chosen": ...}``, the ``hh`` prompt format, whose prompt is the transcript up
    to its last ``"\n\nAssistant:"``: the pair's prompt). Returns the two paths and counts.
    """
    from rlhf_lit.data import PreferenceDataModule
    from rlhf_lit.data.formats import Fields
    from rlhf_lit.data.loading import load_rows
    from rlhf_lit.data.preference_formats import preference_records
    from rlhf_lit.models.tokenizer import load_tokenizer

    record = dict(_data_record(export_a))
    record["train_part"] = None  # every training pair's prompt may serve PPO
    data = PreferenceDataModule(**record, tokenizer=load_tokenizer(export_a))
    data.setup("fit")
    if data.format not in ("hh", "auto"):
        raise ValueError(
            f"the held-out experiment reads HH transcripts; RM-A was trained on {data.format!r} data"
        )
    prompts: dict[tuple[int, int], str] = {}
    for source, path in enumerate(data._source_specs):
        rows = load_rows(path)
        for _, rec in preference_records(rows, "hh", Fields(), False, source, path):
            if not isinstance(rec, str):
                prompts[(source, rec["row"])] = rows[rec["row"]]["chosen"]
    train = sorted({(e["source"], e["row"]) for e in data.train_dataset.examples})
    val = sorted({(e["source"], e["row"]) for e in data.val_dataset.examples})
    if set(train) & set(val):
        raise AssertionError("training and validation pairs overlap")  # split_examples guarantees they do not
    g = torch.Generator().manual_seed(seed)
    per_file = {}
    for key in val:
        per_file.setdefault(key[0], []).append(key)
    take = num_eval // max(1, len(per_file))
    chosen = []
    for keys in per_file.values():
        order = torch.randperm(len(keys), generator=g).tolist()[:take]
        chosen += [keys[i] for i in order]
    # interleave the files so that the first batches already mix them
    chosen = [k for group in zip(*[[k for k in chosen if k[0] == s] for s in per_file]) for k in group]
    os.makedirs(out, exist_ok=True)
    paths = (os.path.join(out, "prompts_train.jsonl"), os.path.join(out, "prompts_eval.jsonl"))
    for path, keys in zip(paths, (train, chosen)):
        with open(path, "w") as f:
            f.writelines(json.dumps({"chosen": prompts[k]}) + "\n" for k in keys)
    return (
        paths[0],
        paths[1],
        {"train_prompts": len(train), "eval_prompts": len(chosen), "val_pairs": len(val)},
    )


def main(argv: list[str] | None = None) -> dict:
    """Run the experiment (see the module docstring); extra arguments after ``--`` go to ``rlhf-lit fit``."""
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_lit.heldout_rm",
        description="PPO against reward model A, judged before and after on held-out prompts by reward model B.",
    )
    parser.add_argument("--rm-a", required=True, help="export folder of the reward model PPO optimises")
    parser.add_argument("--rm-b", required=True, help="export folder of the held-out reward model")
    parser.add_argument("--config", default="configs/ppo/smollm2_heldout_rm.yaml", help="the PPO config")
    parser.add_argument("--out", default="checkpoints/heldout_rm", help="output folder")
    parser.add_argument("--eval-prompts", type=int, default=96, help="held-out evaluation prompts")
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("fit_args", nargs=argparse.REMAINDER, help="-- then overrides for rlhf-lit fit")
    args = parser.parse_args(argv)
    extra = [a for a in args.fit_args if a != "--"]
    from rlhf_lit.cli import cli_main

    t0 = time.perf_counter()
    try:
        check_disjoint(_data_record(args.rm_a), _data_record(args.rm_b))
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    train_file, eval_file, counts = write_prompt_files(args.rm_a, args.out, args.eval_prompts)
    out = os.path.abspath(args.out)
    cli = cli_main(
        [
            "--config",
            args.config,
            f"--model.init_args.reward_model.path={args.rm_a}",
            f"--data.init_args.train_files=[{train_file}]",
            f"--trainer.default_root_dir={out}/ppo",
            f"--trainer.logger.init_args.save_dir={out}/ppo",
            f"--model.init_args.export_dir={out}/ppo/hf",
            *extra,
        ],
        run=False,
    )
    callback = HeldOutRewardCallback(
        args.rm_b, eval_file, args.eval_prompts, args.eval_batch_size, report_dir=out
    )
    cli.trainer.callbacks.append(callback)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    report = json.load(open(os.path.join(out, "heldout_report.json")))
    report["prompt_files"] = counts
    report["timings"]["total_s"] = time.perf_counter() - t0
    report["load_average"] = list(os.getloadavg())
    write_report(report, out)
    print(report_markdown(report))
    return report


if __name__ == "__main__":
    main()
