"""What a reward model's evaluation and export report, apart from the training loop (``RewardModule``).

* :func:`evaluate_pairs`: accuracy (pooled and per file), margin, ECE and NLL before and after the
  temperature, the length rule and the length-bias diagnostics (``rlhf_lit.functional.length_bias``) of a
  set of scored pairs;
* :func:`report_calibration`: the calibration's log line, its metrics and reliability diagram to every
  logger, and ``reliability.png``;
* :func:`export_meta`: the record ``rlhf_lit.json`` carries (architecture, pooling, temperature, how the
  training inputs were built, which pairs trained and validated it).
"""

from __future__ import annotations

import logging
import os

import torch

from rlhf_lit import metrics as M
from rlhf_lit.functional.calibration import (
    TEMPERATURE_BOUNDS,
    binary_nll,
    expected_calibration_error,
    fit_temperature,
    pairwise_calibration_inputs,
    reliability_bins,
)
from rlhf_lit.functional.length_bias import LENGTH_DIFF_BUCKETS, length_bias_report
from rlhf_lit.functional.shift import response_summary
from rlhf_lit.plots import reliability_figure, save_figure

log = logging.getLogger("rlhf_lit")

__all__ = [
    "calibration_batches",
    "data_record",
    "evaluate_pairs",
    "export_meta",
    "fit_calibration",
    "report_calibration",
]

_DATA_RECORD = (
    "train_files",
    "val_files",
    "val_size",
    "max_train_samples_per_file",
    "train_part",
    "format",
    "chat_template",
    "max_length",
    "max_prompt_length",
    "min_prompt_tokens",
    "append_eos",
    "seed",
)

_SCORE_POSITIONS = {
    "last": "last real token (attention_mask == 1)",
    "mean": "mean over the real tokens (attention_mask == 1)",
    "first": "first real token (attention_mask == 1)",
}


def data_record(datamodule) -> dict | None:
    """Which pairs a reward model was trained and validated on (the preference data module's split settings;
    local files as absolute paths), so that a later step can rebuild the same split: e.g. the held-out-RM
    experiment (``experiments/heldout_rm``) takes its evaluation prompts from the validation pairs and checks
    that two reward models were trained on disjoint parts. None for another kind of data module."""
    if datamodule is None or not all(hasattr(datamodule, k) for k in _DATA_RECORD):
        return None
    record = {k: getattr(datamodule, k) for k in _DATA_RECORD}
    for key in ("train_files", "val_files"):
        if record[key]:
            record[key] = [os.path.abspath(f) if os.path.exists(f) else f for f in record[key]]
    if record["train_part"] is not None:
        record["train_part"] = list(record["train_part"])
    return record


def evaluate_pairs(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    sources: torch.Tensor,
    len_c: torch.Tensor,
    len_r: torch.Tensor,
    temperature: float,
    bins: int,
    source_names: list[str],
) -> dict:
    """The evaluation of ``N`` scored pairs.

    Args:
        chosen, rejected: ``(N,)`` uncalibrated scores.
        sources: ``(N,)`` index of each pair's file in ``source_names``.
        len_c, len_r: ``(N,)`` response lengths in tokens.
        temperature: the calibration temperature; the calibrated ECE / NLL are added when it is not 1.
        bins: equal-width bins of the ECE.
        source_names: the files' names (per-file entries for those with pairs).

    Returns:
        ``{"pairs", "metrics" (metric name -> float, the names of rlhf_lit.metrics), "length_bias",
        "per_file", "chance_accuracy"}``.
    """
    margins = chosen - rejected
    probs, labels = pairwise_calibration_inputs(margins)
    bias = length_bias_report(margins, len_c, len_r, chosen, rejected)
    metrics = {
        M.REWARD_ACCURACY: bias["accuracy"],
        M.REWARD_MARGIN: float(margins.mean()),
        M.REWARD_LENGTH_RULE_ACCURACY: bias["length_rule_accuracy"],
        M.REWARD_VS_LENGTH_RULE_SE: bias["vs_length_rule"]["z"],
        M.REWARD_LENGTH_MATCHED_ACCURACY: bias["length_matched"]["accuracy"],
        M.REWARD_LENGTH_MATCHED_LENGTH_RULE: bias["length_matched"]["length_rule_accuracy"],
        M.REWARD_LENGTH_MATCHED_FRACTION: bias["length_matched"]["fraction"],
        M.REWARD_SCORE_LENGTH_SPEARMAN: bias["score_length_spearman"],
        M.REWARD_ECE: float(expected_calibration_error(probs, labels, n_bins=bins)),
        M.REWARD_NLL: float(binary_nll(margins, torch.ones_like(margins))),
    }
    for name in LENGTH_DIFF_BUCKETS:
        bucket = bias["by_length_diff"][name]
        if bucket["pairs"]:
            metrics[M.REWARD_ACCURACY_BY_LENGTH_DIFF.format(bucket=name)] = bucket["accuracy"]
            metrics[M.REWARD_LENGTH_RULE_BY_LENGTH_DIFF.format(bucket=name)] = bucket["length_rule_accuracy"]
    if temperature != 1.0:
        probs_t, labels_t = pairwise_calibration_inputs(margins, temperature)
        metrics[M.REWARD_ECE_CALIBRATED] = float(expected_calibration_error(probs_t, labels_t, n_bins=bins))
        metrics[M.REWARD_NLL_CALIBRATED] = float(binary_nll(margins, torch.ones_like(margins), temperature))
    per_file = {}
    for index, name in enumerate(source_names):
        keep = sources == index
        if keep.any():
            file_bias = length_bias_report(
                margins[keep], len_c[keep], len_r[keep], chosen[keep], rejected[keep]
            )
            per_file[name] = {"pairs": int(keep.sum()), **file_bias}
            metrics[f"{M.REWARD_ACCURACY}/{name}"] = file_bias["accuracy"]
            metrics[f"{M.REWARD_LENGTH_RULE_ACCURACY}/{name}"] = file_bias["length_rule_accuracy"]
    return {
        "pairs": int(margins.numel()),
        "metrics": metrics,
        "length_bias": bias,
        "per_file": per_file,
        "chance_accuracy": 0.5,
        "summary": response_summary(chosen, rejected, len_c, len_r),
    }


def calibration_batches(limit: int | float | None, dataloader) -> int | None:
    """How many batches of ``dataloader`` calibration scores: ``trainer.limit_val_batches`` (``limit``; an
    int is a batch count, a float a fraction, None = all) applied to the loader's length; None = all of it."""
    limit = 1.0 if limit is None else limit
    try:
        total = len(dataloader)
    except TypeError:  # an iterable without a length: only an int limit can apply
        return int(limit) if isinstance(limit, int) else None
    if isinstance(limit, int):
        return min(total, limit)
    return total if limit >= 1.0 else max(1, int(total * limit)) if limit > 0 else 0


def fit_calibration(margins: torch.Tensor, bins: int) -> tuple[float, bool, dict]:
    """Fit the temperature on validation margins ``(N,)`` (Guo et al. 2017; ``fit_temperature`` in
    :data:`TEMPERATURE_BOUNDS`) and bin the reliability diagram before and after it.

    Returns:
        ``(T, at_bound, {"uncalibrated": bins, "calibrated": bins})``; a T at a bound of the search interval
        is logged as a warning (the calibrated probabilities are then unreliable).
    """
    temperature = fit_temperature(margins, torch.ones_like(margins), *TEMPERATURE_BOUNDS)
    at_bound = temperature in TEMPERATURE_BOUNDS
    if at_bound:
        log.warning(
            "reward model: the fitted temperature T=%g is at a bound of its search interval %s: the "
            "validation margins %s; the calibrated probabilities are unreliable",
            temperature,
            list(TEMPERATURE_BOUNDS),
            "carry almost no information about the labels"
            if temperature == TEMPERATURE_BOUNDS[1]
            else "separate the pairs perfectly (or nearly)",
        )
    reliability = {
        "uncalibrated": reliability_bins(*pairwise_calibration_inputs(margins), n_bins=bins),
        "calibrated": reliability_bins(*pairwise_calibration_inputs(margins, temperature), n_bins=bins),
    }
    return temperature, at_bound, reliability


def calibration_figure(results: dict):
    """The reliability diagram of a calibration's results, before and after the temperature."""
    m = results["metrics"]
    rel = results["reliability"]
    after = m.get(M.REWARD_ECE_CALIBRATED, m[M.REWARD_ECE])
    curves = {
        f"uncalibrated (ECE {m[M.REWARD_ECE]:.3f})": rel["uncalibrated"],
        f"T = {results['temperature']:.2f} (ECE {after:.3f})": rel["calibrated"],
    }
    return reliability_figure(curves, f"reward model reliability, {results['pairs']} validation pairs")


def report_calibration(trainer, results: dict, folder: str, step: int) -> None:
    """Log the calibration (one line), send its metrics and reliability diagram to every logger at ``step``
    and write ``reliability.png`` into ``folder`` (rank 0 only); records the file as
    ``results["reliability_png"]``."""
    m = results["metrics"]
    log.info(
        "reward model: %d validation pairs, accuracy %.4f, ECE %.4f -> %.4f after temperature T=%.4f",
        results["pairs"],
        m[M.REWARD_ACCURACY],
        m[M.REWARD_ECE],
        m.get(M.REWARD_ECE_CALIBRATED, m[M.REWARD_ECE]),
        results["temperature"],
    )
    if not trainer.is_global_zero:
        return
    fig = calibration_figure(results)
    for logger in trainer.loggers:
        logger.log_metrics({M.REWARD_TEMPERATURE: results["temperature"], **m}, step=step)
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_figure"):
            experiment.add_figure("reward/reliability_diagram", fig, global_step=step, close=False)
    results["reliability_png"] = save_figure(fig, os.path.join(folder, "reliability.png"))


def export_meta(is_encoder: bool, hidden: int, temperature: float, pooling: str, datamodule) -> dict:
    """``rlhf_lit.json``'s reward-model record (docs/exports.md): ``kind``, ``architecture``,
    ``hidden_size``, ``temperature``, ``pooling`` and ``score_position``; with a preference data module also
    ``input_format`` (how the training sequences were built, so that PPO can rebuild them for another
    tokenizer) and ``data`` (:func:`data_record`)."""
    meta = {
        "kind": "reward_model",
        "architecture": "encoder" if is_encoder else "causal",
        "hidden_size": hidden,
        "temperature": float(temperature),
        "pooling": pooling,
        "score_position": _SCORE_POSITIONS[pooling],
    }
    if hasattr(datamodule, "chat_template") and hasattr(datamodule, "append_eos"):
        meta["input_format"] = {
            "chat_template": bool(datamodule.chat_template),
            "append_eos": bool(datamodule.append_eos),
            "max_length": getattr(datamodule, "max_length", None),
            "max_prompt_length": getattr(datamodule, "max_prompt_length", None),
        }
    data = data_record(datamodule)
    if data is not None:
        meta["data"] = data
    return meta
