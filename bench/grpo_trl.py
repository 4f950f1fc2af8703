"""TRL's side of the ``grpo`` workload: ``trl.GRPOTrainer`` (trl 1.16, transformers generation, no vLLM) in
a fresh process, on the workload of ``bench/grpo_workload.py``. trl is imported here at run time only; no TRL
code is part of the repository.

GRPOConfig is TRL's documented default except where the workload fixes a value: the sizes (4 prompts x
``num_generations`` 4 = 16 completions per generation: ``per_device_train_batch_size`` 4 x
``steps_per_generation`` 4, ``gradient_accumulation_steps`` 1, ``num_iterations`` 4 -> 16 optimizer steps per
generation), ``max_completion_length`` 48, temperature 0.7, lr 3e-6, ``beta`` 0.04, ``max_steps`` = iterations
x 16, seed 42, the LoRA (``peft_config``), and, as the shared harness does for a CPU: ``bf16=False,
use_cpu=True, gradient_checkpointing=False`` (fp32, no checkpointing), ``report_to="none"``,
``save_strategy="no"``, ``disable_tqdm=True``. ``model_name`` picks the base and tokenizer folder
(``grpo_workload.MODELS``: ``tiny`` or ``smollm2``); the prompts are strings, so TRL applies no chat template.

Instrumentation (TRL's code is not modified): a ``TrainerCallback`` marks iteration ends (every 16th
``on_step_end``) and keeps the logs; the trainer instance's ``_generate`` and
``_generate_and_score_completions`` are wrapped with timers (generation; experience = the rest of the latter:
old and reference log-probs, rewards, advantages); and ``_get_per_token_logps_and_entropies`` is wrapped to
read the first training forward's log-probs, from which ``first_step_ratio_max_dev`` = max |ratio - 1| over
the first minibatch's completion tokens is computed against the buffered ``old_per_token_logps``.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

from bench.common import MAX_MODEL_LEN, T_PROCESS_START, W, current_rss_mb, peak_rss_mb, setup_child
from bench.grpo_workload import (
    GRPO,
    LORA,
    model_dir,
    steps_per_iteration,
    tokenizer_dir,
    trl_reward,
    workload,
)

# TRL's own vLLM path (``use_vllm=True``, ``vllm_mode="colocate"``: the engine in the trainer's process), with the
# engine options our side's colocated engine gets (bench/grpo.py); vLLM's sleep mode is CUDA-only.
TRL_VLLM = {
    "use_vllm": True,
    "vllm_mode": "colocate",
    "vllm_max_model_length": MAX_MODEL_LEN,
    "vllm_gpu_memory_utilization": 0.3,
    "vllm_enable_sleep_mode": False,
}


def grpo_config(iterations: int, vllm: bool = False):
    """TRL's GRPOConfig for the workload; ``vllm``: sample with TRL's colocated vLLM engine (:data:`TRL_VLLM`)."""
    from trl import GRPOConfig

    g = GRPO
    return GRPOConfig(
        **(TRL_VLLM if vllm else {}),
        output_dir=str(W.ARTIFACTS / "trainer_output" / "grpo"),
        per_device_train_batch_size=g["mini_batch_size"],
        gradient_accumulation_steps=1,
        steps_per_generation=g["prompts_per_rollout"] * g["group_size"] // g["mini_batch_size"],
        num_generations=g["group_size"],
        num_iterations=g["epochs"],
        max_completion_length=g["max_new_tokens"],
        temperature=g["temperature"],
        top_k=g["top_k"],
        top_p=g["top_p"],
        learning_rate=g["learning_rate"],
        beta=g["beta"],
        max_steps=iterations * steps_per_iteration(),
        seed=g["seed"],
        data_seed=g["seed"],
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def completion_counts(completion_ids: list[list[int]]) -> dict:
    """``tokens``: rows x the longest completion = the rows x decoding steps that ``generate`` ran (what our
    side's sampling tokens/s counts: ``response_ids.numel()``); ``mean_len``: the mean completion length. TRL's
    ``_generate`` returns one id list per completion, cut after its EOS."""
    lengths = [len(ids) for ids in completion_ids]
    return dict(tokens=len(lengths) * max(lengths), mean_len=statistics.fmean(lengths))


class Probe:
    """Timers around three methods of one trainer instance and the first training step's ratio."""

    def __init__(self, trainer):
        import torch

        self.times: dict[str, list[float]] = defaultdict(list)
        self.ratio: dict = {}
        self.last_inputs = None
        self.completions: list[dict] = []
        self._wrap(trainer, "_generate", "gen_s", on_result=self._count_completions)
        self._wrap(trainer, "_generate_and_score_completions", "generate_and_score_s")
        compute_loss, logps = trainer._compute_loss, trainer._get_per_token_logps_and_entropies

        def first_compute_loss(model, inputs):
            self.last_inputs = inputs
            return compute_loss(model, inputs)

        def logps_probe(*args, **kwargs):
            out = logps(*args, **kwargs)
            inputs = self.last_inputs
            if not self.ratio and inputs is not None and torch.is_grad_enabled():
                with torch.no_grad():
                    old = inputs.get("old_per_token_logps")
                    mask = inputs["completion_mask"].bool()
                    ratio = torch.exp(out[0].detach() - (old if old is not None else out[0].detach()))
                    self.ratio.update(
                        max_dev=float((ratio - 1).abs()[mask].max()),
                        tokens=int(mask.sum()),
                        old_logps_given=old is not None,
                    )
            return out

        trainer._compute_loss, trainer._get_per_token_logps_and_entropies = first_compute_loss, logps_probe

    def _count_completions(self, out) -> None:
        self.completions.append(completion_counts(out[1]))  # _generate's 2nd item: the completions' ids

    def _wrap(self, owner, attr: str, name: str, on_result=None) -> None:
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                out = original(*args, **kwargs)
            finally:
                self.times[name].append(time.perf_counter() - t)
            if on_result is not None:
                on_result(out)
            return out

        setattr(owner, attr, timed)


def marks_callback(marks: dict):
    from transformers import TrainerCallback

    class Marks(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks["train_begin"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % steps_per_iteration() == 0:
                marks["ends"].append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            marks["logs"].append(dict(logs or {}, step=state.global_step))

    return Marks()


def child_grpo_trl(threads: int, iterations: int, model_name: str = "tiny", vllm: bool = False) -> dict:
    setup_child(threads)
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    transformers.set_seed(GRPO["seed"])
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(model_name), padding_side="left")
    prompts = W.load_ppo_prompts(tok)
    dataset = Dataset.from_dict({"prompt": [p["prompt"] for p in prompts]})
    model = AutoModelForCausalLM.from_pretrained(model_dir(model_name), dtype="float32")
    lora = LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=LORA["dropout"],
        target_modules=LORA["target_modules"],
        task_type="CAUSAL_LM",
    )
    marks: dict = {"train_begin": None, "ends": [], "logs": []}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[trl_reward],
        args=grpo_config(iterations, vllm),
        train_dataset=dataset,
        processing_class=tok,
        peft_config=lora,
        callbacks=[marks_callback(marks)],
    )
    probe = Probe(trainer)
    rss_before = current_rss_mb()
    setup_s = time.perf_counter() - T_PROCESS_START
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    return result(trainer, marks, probe, iterations, wall, setup_s, rss_before, threads, model_name)


def result(trainer, marks, probe, iterations, wall, setup_s, rss_before, threads, model_name="tiny") -> dict:
    import trl

    from bench.common import cpu_model

    assert len(marks["ends"]) == iterations, marks["ends"]
    starts = [marks["train_begin"]] + marks["ends"][:-1]
    it_wall = [e - s for s, e in zip(starts, marks["ends"])]
    gen, gas = probe.times["gen_s"], probe.times["generate_and_score_s"]
    assert len(gen) == len(gas) == iterations, (len(gen), len(gas))
    update = [w - a for w, a in zip(it_wall, gas)]
    logs = [e for e in marks["logs"] if "reward" in e]
    sequences = GRPO["prompts_per_rollout"] * GRPO["group_size"]
    mean = statistics.fmean
    opt = trainer.optimizer
    return dict(
        wall_s=wall,
        throughput=iterations * sequences / wall,
        unit="episodes/s",
        peak_rss_mb=peak_rss_mb(),
        metrics=dict(
            iter_wall_s=mean(it_wall),
            iter2_wall_s=it_wall[-1],
            gen_s_per_iter=mean(gen),
            gen_tokens_per_s=sum(c["tokens"] for c in probe.completions) / sum(gen),
            gen_tokens_per_iter=mean(c["tokens"] for c in probe.completions),
            response_len_mean=mean(c["mean_len"] for c in probe.completions),
            experience_s_per_iter=mean(a - g for a, g in zip(gas, gen)),
            update_s_per_iter=mean(update),
            setup_s=setup_s,
            rss_before_train_mb=rss_before,
            reward_mean=mean(e["reward"] for e in logs) if logs else None,
            first_step_ratio_max_dev=probe.ratio.get("max_dev"),
            kl_ref_iter1=logs[0].get("kl") if logs else None,
        ),
        details=dict(
            per_iteration=[
                dict(iter_wall_s=w, gen_s=g, generate_and_score_s=a) for w, g, a in zip(it_wall, gen, gas)
            ],
            driver="trl.GRPOTrainer.train() (report_to=none, save_strategy=no, disable_tqdm)",
            optimizer_steps=trainer.state.global_step,
            optimizer_steps_per_iteration=trainer.state.global_step // iterations,
            optimizer=f"{type(opt).__name__}",
            first_step_ratio=probe.ratio,
            trl_logs=marks["logs"],
            workload=dict(workload(model_name), iterations=iterations),
            trainable_params=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            effective=dict(
                bf16=trainer.args.bf16,
                gradient_checkpointing=trainer.args.gradient_checkpointing,
                loss_type=trainer.args.loss_type,
                scale_rewards=trainer.args.scale_rewards,
                max_grad_norm=trainer.args.max_grad_norm,
                optim=str(trainer.args.optim),
                lr_scheduler_type=str(trainer.args.lr_scheduler_type),
                use_bias_correction_kl=trainer.args.use_bias_correction_kl,
                shuffle_dataset=trainer.args.shuffle_dataset,
            ),
            env=dict(trl=trl.__version__, cpu=cpu_model(), threads=threads),
        ),
    )
