"""Figures written to TensorBoard and to PNG files (matplotlib, headless Agg backend)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402


def reliability_figure(curves: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], title: str):
    """Reliability diagram: mean predicted probability vs observed frequency per bin, with y = x.

    Args:
        curves: label -> ``(mean_confidence, accuracy, counts)`` per bin (from
            ``rlhf_lit.functional.calibration.reliability_bins``); empty bins are not drawn.
        title: figure title.
    """
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfect calibration (y = x)")
    for (label, (conf, acc, counts)), marker in zip(curves.items(), "os^v"):
        keep = counts > 0
        ax.plot(conf[keep].numpy(), acc[keep].numpy(), marker=marker, label=label)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("mean predicted P(preferred)")
    ax.set_ylabel("observed frequency preferred")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig


def scatter_by_step_figure(x: Sequence[float], series: dict[str, Sequence[float]], xlabel: str, title: str):
    """One panel per series: points (x, y) coloured by their index (e.g. the PPO iteration)."""
    fig, axes = plt.subplots(1, len(series), figsize=(4.8 * len(series), 3.8), squeeze=False)
    for ax, (name, values) in zip(axes[0], series.items()):
        points = ax.scatter(list(x)[: len(values)], list(values), c=range(len(values)), cmap="viridis", s=18)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    fig.colorbar(points, ax=list(axes[0]), label="iteration")
    fig.suptitle(title)
    return fig


def curves_figure(x: Sequence[float], series: dict[str, Sequence[float]], xlabel: str, title: str):
    """Line plot of several series against one x axis (one panel per series)."""
    fig, axes = plt.subplots(1, len(series), figsize=(4.5 * len(series), 3.5), squeeze=False)
    for ax, (name, values) in zip(axes[0], series.items()):
        ax.plot(list(x)[: len(values)], list(values), marker=".")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def save_figure(fig, path: str) -> str:
    """Write a figure to ``path`` (PNG), creating the folder; closes the figure. Inside an export folder whose
    transaction is open, the file goes to its staging folder (``rlhf_lit.outputs.staged``); returns ``path``."""
    from rlhf_lit.outputs import staged

    target = staged(path)
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return path
