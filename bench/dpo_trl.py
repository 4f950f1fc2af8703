"""TRL's side of the ``dpo`` workload: ``trl.DPOTrainer`` (trl 1.16) in a fresh process, on the workload of
``bench/dpo_workload.py``. trl is imported here at run time only; no TRL code is part of the repository.

Two variants: ``lora`` (``peft_config`` with the workload's LoRA: TRL then uses the same model with the
adapter disabled as the reference, as rlhf_lit does) and ``full`` (no peft, full fine-tuning: TRL's default
without peft, which loads a second copy of the model as the reference). DPOConfig is TRL's default except
where the workload fixes a value: 8 pairs per step, no accumulation, lr 1e-4, beta 0.1, ``loss_type`` sigmoid,
``max_length`` 256, one epoch (16 steps), ``train_sampling_strategy="sequential"`` (file order, as ours),
seed 42, and, as the shared harness does for a CPU: ``bf16=False, use_cpu=True``, ``report_to="none"``,
``save_strategy="no"``, ``disable_tqdm=True``. TRL's ``disable_dropout`` (default on) turns the base's dropout
off, as rlhf_lit does.

Instrumentation (TRL's code is not modified): a ``TrainerCallback`` times every step (``on_step_begin`` to
``on_step_end``) and the instance's ``compute_loss`` is wrapped to record every step's loss. The tokenized
dataset TRL builds is asserted equal to the workload's ids (the same tokens on both sides).
"""

from __future__ import annotations

import time

from bench.common import T_PROCESS_START, W, current_rss_mb, setup_child
from bench.dpo import step_summary
from bench.dpo_workload import DPO, LORA, load_dpo_pairs


def dpo_config(variant: str):
    from trl import DPOConfig

    return DPOConfig(
        output_dir=str(W.ARTIFACTS / "trainer_output" / f"dpo_{variant}"),
        per_device_train_batch_size=DPO["batch_size"],
        gradient_accumulation_steps=1,
        num_train_epochs=1,
        learning_rate=DPO["learning_rate"],
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=DPO["max_grad_norm"],
        beta=DPO["beta"],
        loss_type=[DPO["loss_type"]],
        max_length=DPO["max_length"],
        train_sampling_strategy="sequential",
        seed=DPO["seed"],
        data_seed=DPO["seed"],
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def child_dpo_trl(threads: int, variant: str) -> dict:
    setup_child(threads)
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOTrainer

    from bench.common import cpu_model

    transformers.set_seed(DPO["seed"])
    tok = AutoTokenizer.from_pretrained(W.tokenizer_dir())
    pairs = load_dpo_pairs(tok)
    dataset = Dataset.from_dict({k: [p[k] for p in pairs] for k in ("prompt", "chosen", "rejected")})
    model = AutoModelForCausalLM.from_pretrained(W.base_dir(), dtype=torch.float32)
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["target_modules"], task_type="CAUSAL_LM") if variant == "lora" else None
    marks: dict = {"t": None, "step_s": [], "loss": []}

    class Marks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            marks["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            marks["step_s"].append(time.perf_counter() - marks["t"])

    trainer = DPOTrainer(model=model, args=dpo_config(variant), train_dataset=dataset, processing_class=tok,
                         peft_config=lora, callbacks=[Marks()])
    ds = trainer.train_dataset
    for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert ds[key] == [p[key] for p in pairs], f"TRL's {key} differ from the workload's"
    compute_loss = trainer.compute_loss

    def recorded(*args, **kwargs):
        out = compute_loss(*args, **kwargs)
        loss = out[0] if isinstance(out, tuple) else out
        if torch.is_grad_enabled():
            marks["loss"].append(float(loss.detach()))
        return out

    trainer.compute_loss = recorded
    rss_before = current_rss_mb()
    setup_s = time.perf_counter() - T_PROCESS_START
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    assert trainer.state.global_step == DPO["steps"] == len(marks["step_s"]), (trainer.state.global_step,)
    out = step_summary(marks["step_s"], marks["loss"], wall, setup_s, rss_before)
    opt = trainer.optimizer
    out["details"] = dict(
        driver=f"trl.DPOTrainer.train() ({variant}; report_to=none, save_strategy=no, disable_tqdm)",
        variant=variant,
        step_s=marks["step_s"],
        step_losses=marks["loss"],
        optimizer=type(opt).__name__,
        optimizer_steps=trainer.state.global_step,
        trainable_params=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        total_params=sum(p.numel() for p in trainer.model.parameters())
        + (sum(p.numel() for p in trainer.ref_model.parameters()) if trainer.ref_model is not None else 0),
        reference="separate model copy" if trainer.ref_model is not None else "adapter disabled (peft)",
        workload=DPO,
        effective=dict(optim=str(trainer.args.optim), lr_scheduler_type=str(trainer.args.lr_scheduler_type),
                       disable_dropout=trainer.args.disable_dropout,
                       precompute_ref_log_probs=trainer.args.precompute_ref_log_probs,
                       train_sampling_strategy=trainer.args.train_sampling_strategy),
        env=dict(trl=trl.__version__, cpu=cpu_model(), threads=threads),
    )
    return out
