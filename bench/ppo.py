"""Workload (b): PPO with rlhf_lit's ``PPOModule`` under ``lightning.Trainer.fit``.

Matches the TRL anchor (``W.PPO``) where rlhf_lit can: prompts of ``W.load_ppo_prompts`` left-padded to 64,
16 per rollout, exactly 48 sampled tokens (no stop token: ``sampling.stop_at_eos: false``), temperature 0.7,
top_k 0, top_p 1; the rm artefact as the frozen reward model (a Hugging Face ``*ForSequenceClassification``
folder, ``reward_model.mode: separate``); KL k1 with a fixed coefficient 0.05 in the reward; GAE gamma 1,
lambda 0.95; advantage whitening; clipped policy loss (0.2) and clipped value loss (0.2, vf_coef 0.1, no
entropy bonus); 4 epochs x 4 shuffled mini-batches of 4 = 16 AdamW steps per iteration; lr 3e-6 decayed
linearly per iteration; no gradient clipping; 2 iterations; fp32; seed 42.

Per-phase times come from ``PPOModule.history`` (``perf/*``, recorded by the module itself) and from timers
wrapped around three of its calls (reference pass, actor/critic pass, reward pass), the way the TRL harness
wraps two TRL functions; rlhf_lit's code is not modified.

Differences from TRL's run that remain (also in ``details.differences``):

* actor = a LoRA adapter on the base, reference = the same base with adapters off (TRL: the full policy is
  trained and the reference is a second copy);
* the "separate value model" is a separate critic LoRA adapter on the same base plus a value head
  initialised from the rm artefact's head (``critic.init_from_reward``); TRL's value model is a full copy of
  the rm artefact, trained in full. At step 0 both compute the same values (LoRA B = 0);
* old log-probs are recomputed by an actor forward pass after generation (TRL takes them from the
  generation scores); this extra pass is inside our ``experience`` time and reported on its own;
* rlhf_lit's own speed-ups, all exact (each has a test in ``tests/``): the GPT-2 tanh-GELU runs as one
  fused kernel (``backbone.fused_activations``), prompt columns that are padding in every row of a rollout
  or of an update micro-batch are dropped (position ids come from the mask), the actor's backward runs
  before the critic's forward, and the logged entropy has no autograd graph (``entropy_coef: 0``);
* ``sampling.merge_adapter: true`` (off by default): the actor adapter is folded into the base weights while
  sampling and the exact base weights are put back afterwards (TRL samples from its full policy, which has no
  adapter to apply);
* the clipping norm is still computed (``max_grad_norm: null`` clips at +inf), TRL computes none;
* ``optimizer.scheduler`` is stepped per optimizer step in rlhf_lit; the bench's module subclass replaces
  the schedule with a per-step ``LambdaLR`` that is constant within an iteration, which reproduces TRL's
  per-iteration linear decay exactly (iteration 1: 3e-6, iteration 2: 1.5e-6);
* AdamW is fused in both (rlhf_lit picks torch's fused kernel whenever the parameters allow it);
* the prompts drawn (a seeded shuffle of the 64) are not the ones TRL's accelerate sampler draws; every
  rollout has the shape [16, 64] + 48 either way;
* TRL masks a sampled ``<|pad|>`` token (id 1) as padding (``id != pad``); rlhf_lit keeps it as a real
  token (masks come from stop tokens, never from pad ids).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

from bench.common import T_PROCESS_START, W, current_rss_mb, env_info, peak_rss_mb, setup_child

LORA = dict(r=8, alpha=16, dropout=0.0, target_modules="all-linear")


def prompt_datamodule(tokenizer, prompts: list[dict], batch_size: int, seed: int):
    """A minimal data module over the workload's prompts, batched by rlhf_lit's ``PromptCollator``.

    It exposes ``batch_size`` like ``PromptDataModule`` does (PPOModule reads it for the schedule length and
    the batch-size checks). ``PromptDataModule`` itself is not used because it would re-select and
    re-tokenise the prompts from the file (and cut long ones instead of skipping them).
    """
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from rlhf_lit.data.collate import PromptCollator

    examples = [dict(prompt_ids=p["prompt_ids"], prompt_index=i, prompt_text=p["prompt"]) for i, p in enumerate(prompts)]
    collate = PromptCollator(tokenizer.pad_token_id, pad_to_length=W.PPO["max_prompt_tokens"])
    assert collate(examples)["input_ids"].tolist() == [p["input_ids"] for p in prompts], "left padding differs"

    class Prompts(L.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.batch_size = batch_size

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(seed)
            return DataLoader(examples, batch_size=batch_size, shuffle=True, drop_last=True,
                              generator=generator, collate_fn=collate)

    return Prompts()


def per_iteration_lr_module():
    """``PPOModule`` whose learning rate decays linearly per PPO iteration (TRL's schedule), not per step."""
    from torch.optim.lr_scheduler import LambdaLR

    from rlhf_lit.modules import PPOModule

    class PerIterationLR(PPOModule):
        def configure_optimizers(self):
            optimizers, _ = super().configure_optimizers()
            rollout = self.trainer.datamodule.batch_size
            steps_per_iteration = self.ppo.ppo_epochs * (rollout // self.ppo.ppo_minibatch_size)
            total = self.ppo.total_iterations

            def factor(step: int) -> float:
                return max(0.0, 1.0 - (step // steps_per_iteration) / total)

            return optimizers, [{"scheduler": LambdaLR(optimizers[0], factor), "interval": "step"}]

    return PerIterationLR


def build_module(iterations: int, lora: dict | None = None):
    from rlhf_lit.models.backbone import BackboneConfig, LoraSettings
    from rlhf_lit.models.reward_source import RewardModelConfig
    from rlhf_lit.modules.common import OptimizerConfig
    from rlhf_lit.rl.generation import SamplingConfig
    from rlhf_lit.rl.settings import CriticConfig, KLConfig, PPOConfig, RewardShapingConfig

    cfg = W.PPO
    lora = dict(lora or LORA)
    module_cls = per_iteration_lr_module()
    return module_cls(
        backbone=BackboneConfig(name_or_path=str(W.base_dir()), dtype="float32", lora=LoraSettings(**lora)),
        reward_model=RewardModelConfig(path=str(W.rm_dir()), mode="separate"),
        sampling=SamplingConfig(max_new_tokens=cfg["response_length"], temperature=cfg["temperature"],
                                top_k=cfg["top_k"], top_p=cfg["top_p"], stop_at_eos=False,
                                merge_adapter=True),  # a speed knob; off by default and in the memory workload
        ppo=PPOConfig(ppo_epochs=cfg["ppo_epochs"], ppo_minibatch_size=cfg["mini_batch_size"], gamma=1.0,
                      gae_lambda=0.95, clip_range=0.2, value_clip_range=0.2, vf_coef=0.1, entropy_coef=0.0,
                      whiten_advantages=True, max_grad_norm=None, total_iterations=iterations, seed=cfg["seed"]),
        kl=KLConfig(kl_coef=0.05, estimator="k1", adaptive=False),
        reward=RewardShapingConfig(normalize=False, clip=None, missing_eos_penalty=None),
        critic=CriticConfig(lora=LoraSettings(**lora), init_from_reward=True),
        optimizer=OptimizerConfig(lr=cfg["learning_rate"], weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                                  scheduler="linear", warmup_steps=0),
        log_samples_every=0,
    )


class PhaseTimers:
    """Wall time of selected calls of a module, per PPO iteration (wrappers on instance attributes)."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.done: list[dict[str, float]] = []

    def wrap(self, owner, attr: str, name_of):
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[name_of()] += time.perf_counter() - t

        setattr(owner, attr, timed)

    def close_iteration(self) -> None:
        self.done.append(dict(self.current))
        self.current = defaultdict(float)


def instrument(module) -> PhaseTimers:
    import torch

    timers = PhaseTimers()
    timers.wrap(module.policy, "reference_logprobs", lambda: "reference_s")
    # the actor/critic forward: under no_grad it is the experience pass (old log-probs + values)
    timers.wrap(module.policy, "forward",
                lambda: "update_forward_s" if torch.is_grad_enabled() else "old_logprobs_values_s")
    timers.wrap(module.reward_source, "score", lambda: "reward_s")
    return timers


def child_ppo(threads: int, iterations: int) -> dict:
    setup_child(threads)
    import lightning as L
    from transformers import AutoTokenizer

    from rlhf_lit import metrics as M

    cfg = W.PPO
    L.seed_everything(cfg["seed"], verbose=False)
    tok = AutoTokenizer.from_pretrained(W.tokenizer_dir(), padding_side="left")
    prompts = W.load_ppo_prompts(tok)
    B = cfg["rollout_batch_size"]
    datamodule = prompt_datamodule(tok, prompts, B, cfg["seed"])
    module = build_module(iterations)
    assert module.tokenizer.get_vocab() == tok.get_vocab()
    assert module.reward_source.same_tokenizer, "the reward model must not need re-tokenisation"
    timers = instrument(module)

    marks: dict = {"train_begin": None, "ends": [], "lr": []}

    class Marks(L.Callback):
        def on_train_start(self, trainer, pl_module):
            marks["train_begin"] = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            marks["lr"].append(trainer.optimizers[0].param_groups[0]["lr"])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            marks["ends"].append(time.perf_counter())
            timers.close_iteration()

    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="32-true", max_epochs=-1, limit_train_batches=iterations,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Marks()],
    )
    rss_before = current_rss_mb()
    setup_s = time.perf_counter() - T_PROCESS_START
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    wall = time.perf_counter() - t0

    hist = module.history
    assert len(hist) == iterations == len(marks["ends"]), (len(hist), len(marks["ends"]))
    starts = [marks["train_begin"]] + marks["ends"][:-1]
    it_wall = [e - s for s, e in zip(starts, marks["ends"])]
    gen_s = [h[M.PERF_GENERATION_S] for h in hist]
    exp_s = [h[M.PERF_EXPERIENCE_S] for h in hist]
    upd_s = [h[M.PERF_UPDATE_S] for h in hist]
    gen_tokens = B * cfg["response_length"]
    seq_len = cfg["max_prompt_tokens"] + cfg["response_length"]
    upd_samples = B * cfg["ppo_epochs"]
    phase = timers.done
    per_iter = [
        dict(iter_wall_s=it_wall[i], gen_s=gen_s[i], experience_s=exp_s[i], update_s=upd_s[i], gen_tokens=gen_tokens,
             module_iteration_s=hist[i][M.PERF_ITERATION_S], **phase[i],
             score_mean=hist[i][M.ROLLOUT_SCORE_MEAN], kl_ref=hist[i][M.ROLLOUT_KL_REF], actor_lr=marks["lr"][i])
        for i in range(iterations)
    ]
    opt = trainer.optimizers[0]
    lrs = [g["lr"] for g in opt.param_groups]
    mean_of = lambda key: statistics.fmean(p.get(key, 0.0) for p in phase)  # noqa: E731
    return dict(
        wall_s=wall,
        throughput=iterations * B / wall,
        unit="episodes/s",
        peak_rss_mb=peak_rss_mb(),
        metrics=dict(
            iter_wall_s=statistics.fmean(it_wall),
            iter2_wall_s=it_wall[-1],
            gen_tokens_per_s=gen_tokens * iterations / sum(gen_s),
            gen_s_per_iter=statistics.fmean(gen_s),
            experience_s_per_iter=statistics.fmean(exp_s),  # ref + old log-probs/values + reward + GAE
            update_s_per_iter=statistics.fmean(upd_s),
            update_samples_per_s=upd_samples * iterations / sum(upd_s),
            update_tokens_per_s=upd_samples * seq_len * iterations / sum(upd_s),
            reference_s_per_iter=mean_of("reference_s"),
            old_logprobs_values_s_per_iter=mean_of("old_logprobs_values_s"),  # extra actor pass TRL does not run
            reward_s_per_iter=mean_of("reward_s"),
            update_forward_s_per_iter=mean_of("update_forward_s"),
            setup_s=setup_s,
            rss_before_train_mb=rss_before,
            score_mean=statistics.fmean(h[M.ROLLOUT_SCORE_MEAN] for h in hist),
            kl_ref_iter1=hist[0][M.ROLLOUT_KL_REF],
            approx_kl=statistics.fmean(h[M.PPO_APPROX_KL] for h in hist),
        ),
        details=dict(
            per_iteration=per_iter,
            driver="lightning.Trainer.fit(PPOModule) (logger off, checkpointing off, as TRL's report_to=none)",
            optimizer=f"{type(opt).__name__}(fused={opt.defaults.get('fused')}, foreach={opt.defaults.get('foreach')})",
            optimizer_steps=trainer.global_step,
            optimizer_steps_per_iteration=trainer.global_step // iterations,
            actor_lr_per_iteration=marks["lr"],
            final_lrs=lrs,
            lora=LORA,
            trainable_params=dict(actor=sum(p.numel() for p in module.policy.actor_parameters()),
                                  critic=sum(p.numel() for p in module.policy.critic_parameters())),
            module_history=hist,
            prompt_records_drawn="seeded shuffle (torch.Generator seed 42) of the 64 prompts",
            effective=dict(precision=str(trainer.precision), gradient_checkpointing=False,
                           optimizer=f"{type(opt).__name__}(fused={opt.defaults.get('fused')})",
                           grad_clip="none (max_grad_norm null: the norm is computed, clipping at +inf)"),
            differences=[
                "actor = LoRA adapter (r=8, alpha=16, all-linear) on the base; reference = base with adapters off "
                "(TRL: full fine-tuning, reference = a second copy)",
                "value model = critic LoRA adapter on the same base + value head initialised from the rm head "
                "(TRL: a separate full copy of the rm artefact, trained in full)",
                "old log-probs recomputed by an actor forward after generation (TRL: from generation scores); "
                "see metrics.old_logprobs_values_s_per_iter (that pass also yields the values)",
                "rlhf_lit speed-ups (exact): fused tanh-GELU kernel; prompt columns padded in every row of a "
                "rollout / update micro-batch are dropped; actor backward before the critic forward; logged "
                "entropy without autograd",
                "sampling.merge_adapter: true (actor adapter folded into the base while sampling, exact base "
                "restored after; off by default)",
                "gradient norm computed (clip at +inf) although no clipping is asked for; TRL computes none",
                "lr schedule: bench subclass replaces the per-step linear schedule by a per-step LambdaLR that "
                "is constant within an iteration = TRL's per-iteration linear decay",
                "AdamW fused in both",
                "the 32 prompts drawn differ from TRL's (seeded shuffle); shapes [16, 64] + 48 are identical",
                "a sampled <|pad|> token stays a real token (TRL masks it as padding)",
            ],
            env=env_info(threads),
        ),
    )
