"""Analytic FLOPs of the reward-model training step, and this machine's measured fp32 matmul throughput.

FLOP count of one RM optimizer step (8 pairs = one forward and backward over 16 sequences, all right-padded
to the batch maximum T), full fine-tuning of the 4-layer GPT-2 (d = 256, d_ff = 1024):

    F_step = 16 * ( 6 * N_matmul * T  +  12 * n_layer * T^2 * d )

* ``6 * N * T``: a matmul with N weights costs 2 N FLOPs per token forward and 4 N backward (grads of the
  inputs and of the weights). ``N_matmul = n_layer * (4 d^2 + 2 d d_ff) = 3,145,728``: the attention
  qkv/out projections and the MLP. The token embedding is a gather and the RM reads no vocabulary logits,
  so the 1.05M embedding weights do no matmul work; the scalar head and biases are negligible (< 0.1%).
* ``12 * n_layer * T^2 * d``: QK^T and attention x V, 2 T^2 d each forward (4 T^2 d), times 3 with the
  backward; the full T x T square is counted, as the padded batch runs it (SDPA gets an explicit mask).
* Padded positions are counted where they are computed. TRL runs each step as one batch padded to the
  longest sequence (221,552 positions over the run vs 118,630 real ones); rlhf_lit's ``RewardModule`` packs
  the 16 sequences end to end into bins no longer than the longest (``packing``, its default on a causal LM),
  or with ``length_groups`` runs them as forwards of similar length, each cut to its own longest sequence
  (``flops`` counts those widths; ``flops_padded`` is TRL's count, used for TRL's achieved FLOP/s).

The simpler "6 * params * tokens" with all 4.34M parameters and real tokens is also reported
(``flops_simple``) but is not what the hardware executes.
"""

from __future__ import annotations

import time


def rm_flops(pairs: list[dict], model_cfg: dict, batch_size: int, length_groups: int = 1,
             packing: bool = False) -> dict:
    """Total training FLOPs over all RM steps for the workload's pairs, batched in file order.

    ``flops``: as rlhf_lit computes them: with ``packing``, one forward over the step's bins as
    ``rlhf_lit.functional.packing.pack_layout`` cuts them (every bin as wide as the fullest, attention over each
    bin's whole square, as the block-diagonal mask runs it); else ``length_groups`` forwards per step, each over its own width; ``flops_padded``: one
    forward per step padded to the step's longest sequence (TRL).
    """
    import torch

    from rlhf_lit.functional.packing import pack_layout

    d = model_cfg["n_embd"]
    d_ff = model_cfg.get("n_inner") or 4 * d
    n_layer = model_cfg["n_layer"]
    n_matmul = n_layer * (4 * d * d + 2 * d * d_ff)
    import numpy as np

    def cost(n_seq: int, width: int) -> float:
        return n_seq * (6 * n_matmul * width + 12 * n_layer * width * width * d)

    total = padded = 0.0
    real_tokens = 0
    for start in range(0, len(pairs), batch_size):
        batch = pairs[start : start + batch_size]
        lengths = sorted([len(p["chosen_ids"]) for p in batch] + [len(p["rejected_ids"]) for p in batch])
        padded += cost(len(lengths), max(lengths))
        if packing:
            mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
            total += cost(*pack_layout(mask).valid.shape)  # (bins, widest bin)
        else:
            groups = length_groups if len(lengths) >= 2 * length_groups else 1
            total += sum(cost(len(g), max(g)) for g in np.array_split(np.array(lengths), groups))
        real_tokens += sum(lengths)
    return dict(flops=total, flops_padded=padded, n_matmul_params=n_matmul,
                flops_simple=6 * 4.34e6 * real_tokens,
                formula="sum over forwards of n_seq * (6 * N_matmul * T + 12 * n_layer * T^2 * d), T = the "
                        "forward's padded width (packed: n_seq = bins, T = the widest bin)")


def matmul_throughput(threads: int, sizes=(1024, 2048), model_shape=(4096, 256, 1024), repeats: int = 5) -> dict:
    """Best fp32 ``torch.matmul`` FLOP/s over a few square sizes, and for one RM-shaped product.

    ``peak_flops`` is the best square result (the machine's fp32 matmul ceiling as torch sees it);
    ``model_shaped_flops`` is (M, K) x (K, N) = (16 * 256 tokens, d) x (d, d_ff), the MLP product.
    """
    import torch

    torch.set_num_threads(threads)
    results = {}

    def best(a, b, flops):
        torch.matmul(a, b)  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - t)
        return flops / min(times)

    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        results[f"square_{n}"] = best(a, b, 2.0 * n**3)
    m, k, n = model_shape
    results["model_shaped"] = best(torch.randn(m, k), torch.randn(k, n), 2.0 * m * k * n)
    peak = max(v for key, v in results.items() if key.startswith("square"))
    return dict(peak_flops=peak, model_shaped_flops=results["model_shaped"], all=results, threads=threads)
