"""Workload (a): reward-model training with rlhf_lit's ``RewardModule`` under ``lightning.Trainer.fit``.

Matches the TRL anchor (``W.RM``): the ``gpt2-tiny-rm`` artefact (base trunk + its seed-1 ``score`` head),
the 512 pairs of ``W.load_rm_pairs`` in file order, 8 pairs per step as one forward of 16 sequences
(8 chosen, then 8 rejected) right-padded to the batch maximum, AdamW lr 1e-4 (0.9, 0.999) eps 1e-8 wd 0,
linear decay to 0 over 64 steps, grad-norm clipping 1.0, fp32, seed 42.

What a user gets is measured: ``Trainer.fit`` (Lightning's loop, logging calls, clipping) around
``RewardModule.training_step``; ``wall_s`` is the ``fit`` call. The pairs are batched by rlhf_lit's own
``PreferenceCollator`` from the workload's token ids (not re-tokenised by ``PreferenceDataModule``, which
splits each transcript into prompt and response and could tokenise the boundary differently).

Differences from TRL's run (also in ``details.differences``):

* our ``ScalarHead`` has a bias; it is held at 0 and frozen, so the model equals TRL's bias-free ``score``;
* rlhf_lit's speed-ups, all exact (tests in ``tests/``): the 16 sequences of a step are packed padding-free
  (``RewardModule``'s default on a causal LM: end to end in bins no longer than the longest, position ids
  restarting, attention confined to each sequence) instead of one forward padded to the longest of the 16;
  the GPT-2 tanh-GELU runs as one fused kernel; AdamW is fused in both. ``BENCH_RM_LENGTH_GROUPS=4`` runs the
  earlier cut (4 forwards of similar length, each cut to its own longest sequence); ``BENCH_RM_PACKING=0``
  (with ``length_groups`` 1) TRL's single padded forward;
* our backbone is loaded as ``AutoModelForCausalLM`` (the tied LM head is never run: the RM reads the
  trunk's hidden states), TRL's as ``GPT2ForSequenceClassification`` (which scores every position).
"""

from __future__ import annotations

import os
import statistics
import time

from bench.common import (
    T_PROCESS_START,
    W,
    current_rss_mb,
    env_info,
    peak_rss_mb,
    setup_child,
)
from bench.flops import rm_flops

N_HELDOUT = 128  # validation pairs: the next pairs after the 512 training pairs that pass the same filter


def load_heldout_pairs(tokenizer, n: int = N_HELDOUT) -> list[dict]:
    """The first ``n`` records after the training pairs whose chosen+EOS and rejected+EOS fit max_length."""
    last = W.load_rm_pairs(tokenizer)[-1]["record_index"]
    eos = tokenizer.eos_token
    out = []
    for idx, rec in enumerate(W.load_hh_records()):
        if idx <= last:
            continue
        c_ids = tokenizer(rec["chosen"] + eos, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(rec["rejected"] + eos, add_special_tokens=False)["input_ids"]
        if len(c_ids) <= W.RM["max_length"] and len(r_ids) <= W.RM["max_length"]:
            out.append(dict(record_index=idx, chosen_ids=c_ids, rejected_ids=r_ids))
            if len(out) == n:
                break
    return out


def pair_loader(pairs: list[dict], pad_token_id: int, batch_size: int):
    """Batches of rlhf_lit's ``PreferenceCollator``: whole transcripts as the response, empty prompt."""
    from torch.utils.data import DataLoader

    from rlhf_lit.data.collate import PreferenceCollator

    examples = [
        dict(prompt_ids=[], chosen_ids=p["chosen_ids"], rejected_ids=p["rejected_ids"], source=0) for p in pairs
    ]
    return DataLoader(examples, batch_size=batch_size, shuffle=False, collate_fn=PreferenceCollator(pad_token_id))


def build_module():
    """``RewardModule`` on the rm artefact, with the artefact's score head copied in (bias 0, frozen)."""
    import torch
    from safetensors.torch import load_file

    from rlhf_lit.models.backbone import BackboneConfig
    from rlhf_lit.modules import RewardModule
    from rlhf_lit.modules.common import OptimizerConfig

    cfg = W.RM
    module = RewardModule(
        backbone=BackboneConfig(name_or_path=str(W.rm_dir()), dtype="float32", gradient_checkpointing=False),
        optimizer=OptimizerConfig(lr=cfg["learning_rate"], weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                                  scheduler="linear", warmup_steps=0),
        calibrate=False,  # TRL does not calibrate; calibration is a separate pass after fit anyway
        # the module's default: a causal LM packs each step's 16 sequences padding-free (packing: null);
        # BENCH_RM_LENGTH_GROUPS=4: 4 forwards of similar length instead, each cut to its own longest sequence;
        # BENCH_RM_PACKING=0 with BENCH_RM_LENGTH_GROUPS=1: TRL's single padded forward
        length_groups=int(os.environ.get("BENCH_RM_LENGTH_GROUPS", "1")),
        packing=None if os.environ.get("BENCH_RM_PACKING", "1") == "1" else False,
    )
    score = load_file(str(W.rm_dir() / "model.safetensors"))["score.weight"]
    with torch.no_grad():
        module.head.linear.weight.copy_(score.float())
        module.head.linear.bias.zero_()
    module.head.linear.bias.requires_grad_(False)
    return module


def child_rm(threads: int) -> dict:
    setup_child(threads)
    import lightning as L
    import torch
    from transformers import AutoTokenizer

    cfg = W.RM
    L.seed_everything(cfg["seed"], verbose=False)
    tok = AutoTokenizer.from_pretrained(W.tokenizer_dir())
    pairs = W.load_rm_pairs(tok)
    heldout = load_heldout_pairs(tok)
    train_loader = pair_loader(pairs, tok.pad_token_id, cfg["batch_size"])
    module = build_module()
    assert module.tokenizer.get_vocab() == tok.get_vocab(), "the rm artefact's tokenizer differs"

    class StepTimer(L.Callback):
        def __init__(self):
            self.ends: list[float] = []
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())
            self.losses.append(float(outputs["loss"]))

    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="32-true", max_epochs=cfg["epochs"],
        gradient_clip_val=cfg["max_grad_norm"], gradient_clip_algorithm="norm",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer],
    )
    n_tokens = sum(len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs)
    flops = rm_flops(pairs, W.MODEL, cfg["batch_size"], module.hparams.length_groups, module.packing)
    padded = 0
    for i in range(0, len(pairs), cfg["batch_size"]):
        b = pairs[i : i + cfg["batch_size"]]
        padded += 2 * len(b) * max(max(len(p["chosen_ids"]), len(p["rejected_ids"])) for p in b)

    rss_before = current_rss_mb()
    setup_s = time.perf_counter() - T_PROCESS_START
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=train_loader)
    wall = time.perf_counter() - t0
    peak = peak_rss_mb()  # before the held-out evaluation, which is not part of TRL's run

    # held-out accuracy and loss of the trained model (after the timed region; TRL's run has no evaluation)
    margins = module.collect_margins(pair_loader(heldout, tok.pad_token_id, 16))[0]
    val_accuracy = float((margins > 0).float().mean())
    val_loss = float(torch.nn.functional.softplus(-margins).mean())

    ends = [t0] + timer.ends
    step_s = [b - a for a, b in zip(ends[1:], ends[2:])]  # steps 2..64 (the first includes fit's set-up)
    steady = (len(timer.ends) - 1) * cfg["batch_size"] / (timer.ends[-1] - timer.ends[0])
    opt = trainer.optimizers[0]
    return dict(
        wall_s=wall,
        throughput=cfg["n_pairs"] * cfg["epochs"] / wall,
        unit="pairs/s",
        peak_rss_mb=peak,
        metrics=dict(
            steady_pairs_per_s=steady,
            median_step_pairs_per_s=cfg["batch_size"] / statistics.median(step_s),
            step_s_median=statistics.median(step_s),
            step_s_max=max(step_s),
            first_step_s=timer.ends[0] - t0,  # includes Trainer.fit's set-up
            tokens_per_s=n_tokens / wall,
            padded_tokens_per_s=padded / wall,
            setup_s=setup_s,
            rss_before_train_mb=rss_before,
            train_loss=statistics.fmean(timer.losses),  # mean over the 64 steps, as TRL's training_loss
            final_step_loss=timer.losses[-1],
            val_accuracy=val_accuracy,
            val_loss=val_loss,
            achieved_flops_per_s=flops["flops"] / wall,
        ),
        details=dict(
            optimizer_steps=trainer.global_step, real_tokens=n_tokens, padded_positions=padded,
            train_flops=flops["flops"], train_flops_padded=flops["flops_padded"],
            length_groups=module.hparams.length_groups, packing=module.packing, flops_formula=flops["formula"], n_matmul_params=flops["n_matmul_params"],
            heldout_pairs=len(heldout), heldout_records=[heldout[0]["record_index"], heldout[-1]["record_index"]],
            optimizer=f"{type(opt).__name__}(fused={opt.defaults.get('fused')}, foreach={opt.defaults.get('foreach')})",
            driver="lightning.Trainer.fit(RewardModule) (logger off, checkpointing off, as TRL's report_to=none)",
            trainable_params=sum(p.numel() for p in module.parameters() if p.requires_grad),
            first_record=pairs[0]["record_index"], last_record=pairs[-1]["record_index"],
            effective=dict(precision=str(trainer.precision), gradient_checkpointing=False,
                           optimizer=f"{type(opt).__name__}(fused={opt.defaults.get('fused')})",
                           grad_clip=f"norm {cfg['max_grad_norm']}"),
            differences=[
                "ScalarHead has a bias: held at 0 and frozen, so the model equals TRL's bias-free score head",
                ("rlhf_lit speed-ups (exact): the 16 sequences of a step packed padding-free into bins "
                 if module.packing else f"rlhf_lit speed-ups (exact): {module.hparams.length_groups} length "
                 "groups per step, each cut to its own longest sequence ")
                + "(TRL: one forward padded to the longest of 16); fused tanh-GELU; AdamW fused in both",
                "backbone is AutoModelForCausalLM with the tied LM head unused; TRL's "
                "GPT2ForSequenceClassification also scores every position (negligible)",
                "driven by Lightning's Trainer (what users run), not transformers' Trainer",
            ],
            env=env_info(threads),
        ),
    )
