"""Workload ``dpo``: rlhf_lit's ``DPOModule`` under ``lightning.Trainer.fit``, on the workload of
``bench/dpo_workload.py`` (TRL's side: ``bench/dpo_trl.py``).

The module is built as a user's config builds it: the base artefact with a LoRA adapter (the reference = the
same base with the adapter off: no second model copy), ``loss_type: sigmoid``, beta 0.1, AdamW with the
linear schedule; the batches are rlhf_lit's ``PreferenceCollator`` over the workload's token ids, 8 pairs
per step, in file order. A callback times every training batch (``on_train_batch_start`` to
``on_train_batch_end``: forward, reference forward, backward, clipping, optimizer step) and reads the first
step's loss from ``trainer.callback_metrics``.
"""

from __future__ import annotations

import statistics
import time

from bench.common import T_PROCESS_START, W, current_rss_mb, env_info, peak_rss_mb, setup_child
from bench.dpo_workload import DPO, LORA, load_dpo_pairs


def pair_loader(pairs: list[dict], pad_token_id: int):
    from torch.utils.data import DataLoader

    from rlhf_lit.data.collate import PreferenceCollator

    examples = [dict(prompt_ids=p["prompt_ids"], chosen_ids=p["chosen_ids"], rejected_ids=p["rejected_ids"])
                for p in pairs]
    return DataLoader(examples, batch_size=DPO["batch_size"], shuffle=False,
                      collate_fn=PreferenceCollator(pad_token_id))


def build_module():
    from rlhf_lit.models.backbone import BackboneConfig, LoraSettings
    from rlhf_lit.modules import DPOModule
    from rlhf_lit.modules.common import OptimizerConfig

    return DPOModule(
        backbone=BackboneConfig(name_or_path=str(W.base_dir()), dtype="float32", lora=LoraSettings(**LORA)),
        optimizer=OptimizerConfig(lr=DPO["learning_rate"], weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                                  scheduler="linear", warmup_steps=0),
        loss_type=DPO["loss_type"],
        beta=DPO["beta"],
    )


def step_summary(step_s: list[float], losses: list[float], wall: float, setup_s: float, rss_before: float) -> dict:
    """The per-run figures both sides report (``step_s`` and ``losses`` in step order)."""
    steady = step_s[1:]
    return dict(
        wall_s=wall,
        throughput=DPO["n_pairs"] / wall,
        unit="pairs/s",
        peak_rss_mb=peak_rss_mb(),
        metrics=dict(
            median_step_s=statistics.median(steady),
            first_step_s=step_s[0],
            mean_step_s=statistics.fmean(steady),
            first_step_loss=losses[0],
            final_step_loss=losses[-1],
            setup_s=setup_s,
            rss_before_train_mb=rss_before,
        ),
    )


def child_dpo(threads: int) -> dict:
    setup_child(threads)
    import lightning as L
    from transformers import AutoTokenizer

    from rlhf_lit import metrics as M

    L.seed_everything(DPO["seed"], verbose=False)
    tok = AutoTokenizer.from_pretrained(W.tokenizer_dir())
    pairs = load_dpo_pairs(tok)
    loader = pair_loader(pairs, tok.pad_token_id)
    module = build_module()
    assert module.tokenizer.get_vocab() == tok.get_vocab()
    marks: dict = {"t": None, "step_s": [], "loss": []}

    class Marks(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            marks["t"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            marks["step_s"].append(time.perf_counter() - marks["t"])
            marks["loss"].append(float(trainer.callback_metrics[M.TRAIN_LOSS]))

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_epochs=1,
        gradient_clip_val=DPO["max_grad_norm"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Marks()],
    )
    rss_before = current_rss_mb()
    setup_s = time.perf_counter() - T_PROCESS_START
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    wall = time.perf_counter() - t0
    assert trainer.global_step == DPO["steps"] == len(marks["step_s"]), (trainer.global_step, len(marks["step_s"]))
    out = step_summary(marks["step_s"], marks["loss"], wall, setup_s, rss_before)
    opt = trainer.optimizers[0]
    out["details"] = dict(
        driver="lightning.Trainer.fit(DPOModule) (logger, checkpointing, progress bar off)",
        step_s=marks["step_s"],
        step_losses=marks["loss"],
        optimizer=f"{type(opt).__name__}(fused={opt.defaults.get('fused')})",
        optimizer_steps=trainer.global_step,
        final_lr=opt.param_groups[0]["lr"],
        trainable_params=sum(p.numel() for p in module.parameters() if p.requires_grad),
        total_params=sum(p.numel() for p in module.parameters()),
        reference="adapter off on the one base (module.reference_lm is None: "
                  f"{module.reference_lm is None})",
        workload=DPO,
        record_indices=[p["record_index"] for p in pairs],
        env=env_info(threads),
    )
    return out
