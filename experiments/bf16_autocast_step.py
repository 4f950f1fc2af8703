"""One training step of a SmolLM2-135M-shaped causal LM in float32 and under bf16 autocast, alternated.

    OMP_NUM_THREADS=1 python -m experiments.bf16_autocast_step [--rounds 2] [--batch 4] [--seq 256]

The model is built from config (random weights, no download): Llama, 30 layers, hidden 576, intermediate 1,536,
9 heads / 3 KV heads, vocabulary 49,152, tied embeddings: SmolLM2-135M's shape. A step is the forward with the
language-modelling loss and its backward on ``batch`` x ``seq`` random tokens (no optimizer: the question is
the matrix products). Prints one line per step, the CPU's name and its bf16 flags. Report:
docs/experiments/bf16_cpu.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from bf16_cpu_check import cpu_description  # noqa: E402  (the CPU's name and bf16 flags, as that check prints them)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    name, flags = cpu_description()
    print(f"cpu: {name}, bf16 flags: {flags or 'none'}, "
          f"threads: {torch.get_num_threads()}, torch {torch.__version__}")  # fmt: skip
    for _ in range(args.rounds):
        for bf16 in (False, True):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            print(
                f"{'bf16 autocast' if bf16 else 'float32':>13}: {time.perf_counter() - start:7.2f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
