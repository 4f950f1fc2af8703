"""``--vs-trl --workload grpo_loss``: the first optimisation step's loss of TRL 1.16's ``GRPOTrainer`` and of
rlhf_lit's update on the same completions, for each configuration the two share (issue 36, item 8).

Route (one child process, ``bench/run.py --_child grpo_loss``; trl is imported there only):

1. TRL's side is built as in ``bench/grpo_trl.py`` (the GRPO workload: tiny base + LoRA, 4 prompts x 4 samples,
   48 new tokens, temperature 0.7, 4 minibatches of 4 per generation, ``num_iterations`` 4, ``beta`` 0.04 so
   the reference log-probs exist, seed 42). ``GRPOTrainer._prepare_inputs`` is called once on the workload's
   first 4 prompts (each 4 times): TRL samples the 16 completions, scores them, computes the advantages and the
   old and reference log-probs, shuffles and splits them, and returns the first step's minibatch (4
   completions): the inputs dict its ``_compute_loss`` reads at step 1.
2. For each configuration, TRL's attributes that ``_compute_loss`` reads at call time (``loss_type``,
   ``importance_sampling_level``, ``epsilon_low`` / ``epsilon_high``, ``beta``, ``top_entropy_quantile``,
   ``args.use_bias_correction_kl``, ``args.delta``) are set on the one trainer and ``trainer._compute_loss(model,
   inputs)`` gives TRL's loss. Its training forward's per-token log-probs and entropies are read by a wrapper
   on ``_get_per_token_logps_and_entropies`` (TRL's code is not modified).
3. Ours: ``rlhf_lit.rl.update.PPOUpdater.update`` -- the code a ``PPOModule`` runs -- with the settings a user's
   config gives (``PPOConfig`` -> ``rl.assembly.update_settings`` and ``PPOObjective.from_settings``) on an
   ``UpdateBatch`` of the same minibatch (TRL's prompt and completion ids and masks, old and reference
   log-probs, its advantages on every completion token), one epoch of one minibatch; its collaborators are
   injected through the constructor: a policy that returns TRL's log-probs and entropies (the same tensors,
   so both losses are functions of one forward), a backward that keeps the loss, no-op optimizer and
   schedule, one process, and the minibatch in row order (``epoch_schedule`` on the identity permutation).
4. Both losses, their difference, and the largest difference of their gradients with respect to the shared
   log-probs (which separates e.g. GSPO's ``sequence`` ratio from GSPO-token's, equal in value).

Two policies per configuration: ``ratio1`` (step 1 as TRL runs it: the policy that sampled; ratio 1 on every
token) and ``perturbed`` (the LoRA ``B`` matrices moved by seeded Gaussian noise after the old log-probs were
taken, standing in for a later step of the ``num_iterations`` loop: the ratios spread out, so clipping, the
sequence ratio and the KL's importance correction matter). The advantages are also compared separately: ours
(``group_relative_advantages`` from the same rewards) against TRL's over all 16 completions.
"""

from __future__ import annotations

import string
import time
from types import SimpleNamespace

from bench.common import T_PROCESS_START, W, cpu_model, env_info, setup_child
from bench.grpo_workload import GRPO, LORA, model_dir, tokenizer_dir, trl_reward, workload

TOL = 1e-5
PERTURB_STD = 0.05  # std of the noise added to every LoRA B matrix for the ``perturbed`` policy
PERTURB_SEED = 1234
STEPS, STEP_LR = 3, 0.02  # the ``stepped`` policy: Adam steps on TRL's own loss of the minibatch
# Stop tokens besides EOS: with EOS alone the tiny model's 16 completions all run to the 48-token cap, and every
# aggregation (grpo, bnpo, dr_grpo, dapo) gives the same number; stopping at the ASCII punctuation characters too
# (one token each) gives lengths that differ (TRL stops at, and keeps in the mask, every id of
# ``model.generation_config.eos_token_id``).
EXTRA_STOP = string.punctuation

# Each case: TRL's GRPOConfig values, ours (``ppo.*`` settings and ``kl.kl_coef``), and ``differs``: None when
# the definitions are the same (pass/fail at TOL), else why they are not (the record states it).
_DAPO_NORM = ("TRL's dapo (and cispo) divide the minibatch's token sum by num_items_in_batch / "
              "steps_per_generation (the whole generation batch's completion tokens over its 4 minibatches; "
              "GRPOTrainer._compute_loss); ours (token_mean) by the minibatch's own tokens")
_KL_IS = ("TRL's use_bias_correction_kl (default True) multiplies the k3 KL term by the importance ratio "
          "(GRPOTrainer._compute_loss); ours does not: equal at ratio 1 only")


def _case(name, trl: dict, ours: dict, differs: str | None = None, rescale: bool = False) -> dict:
    base_trl = dict(loss_type="grpo", importance_sampling_level="token", epsilon=0.2, epsilon_high=None, beta=0.0,
                    use_bias_correction_kl=False, delta=None, top_entropy_quantile=1.0)
    base_ours = dict(loss_aggregation="seq_mean_token_mean", importance_sampling_level="token", clip_range=0.2,
                     clip_range_high=None, kl_coef=0.0, dual_clip=None, top_entropy_quantile=1.0, policy_loss="ppo",
                     clip_range_low=None)
    return dict(name=name, trl={**base_trl, **trl}, ours={**base_ours, **ours}, differs=differs, rescale=rescale)


AGG = {"grpo": "seq_mean_token_mean", "bnpo": "token_mean", "dr_grpo": "token_sum_norm", "dapo": "token_mean"}


def cases() -> list[dict]:
    """The overlapping configurations: TRL's loss_type x importance_sampling_level x epsilon / epsilon_high x
    beta, and the options both sides have besides (delta = dual_clip, top_entropy_quantile, cispo)."""
    out = []
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        dapo = loss_type == "dapo"
        agg = AGG[loss_type]
        for level, eps, eps_high in (("token", 0.2, None), ("token", 0.2, 0.28), ("sequence", 3e-4, 4e-4),
                                     ("sequence", 0.2, 0.28)):
            for beta in (0.0, 0.04):
                tag = f"{loss_type} {level} eps {eps:g}/{eps if eps_high is None else eps_high:g} beta {beta:g}"
                out.append(_case(
                    tag,
                    dict(loss_type=loss_type, importance_sampling_level=level, epsilon=eps, epsilon_high=eps_high,
                         beta=beta),
                    dict(loss_aggregation=agg, importance_sampling_level=level, clip_range=eps,
                         clip_range_high=eps_high, kl_coef=beta),
                    differs=_DAPO_NORM if dapo else None,
                    rescale=dapo,
                ))
    # TRL's default KL (ratio-corrected) against ours
    for level in ("token", "sequence"):
        out.append(_case(
            f"grpo {level} eps 0.2/0.2 beta 0.04 use_bias_correction_kl=True",
            dict(importance_sampling_level=level, beta=0.04, use_bias_correction_kl=True),
            dict(importance_sampling_level=level, kl_coef=0.04),
            differs=_KL_IS,
        ))
    # GSPO-token against TRL's GSPO: the same loss, and the same gradient whenever every token of a response has
    # the same advantage, as in GRPO (Zheng et al. 2025, s. 4.3); ours 'sequence_token' must agree here
    out.append(_case("grpo sequence eps 0.2/0.28 (ours sequence_token: GSPO-token)",
                     dict(importance_sampling_level="sequence", epsilon_high=0.28),
                     dict(importance_sampling_level="sequence_token", clip_range_high=0.28)))
    # options both have under other names
    out.append(_case("grpo token eps 0.2/0.28 delta 1.5 (ours dual_clip 1.5)", dict(epsilon_high=0.28, delta=1.5),
                     dict(clip_range_high=0.28, dual_clip=1.5)))
    out.append(_case("bnpo token eps 0.2/0.28 top_entropy_quantile 0.2",
                     dict(loss_type="bnpo", epsilon_high=0.28, top_entropy_quantile=0.2),
                     dict(loss_aggregation="token_mean", clip_range_high=0.28, top_entropy_quantile=0.2)))
    out.append(_case("cispo token epsilon_high 1.1 (ours policy_loss cispo, clip_range_low 1, clip_range_high 0.1)",
                     dict(loss_type="cispo", epsilon_high=1.1),
                     dict(loss_aggregation="token_mean", policy_loss="cispo", clip_range_low=1.0,
                          clip_range_high=0.1),
                     differs=_DAPO_NORM, rescale=True))
    return out


# ------------------------------------------------------------------------------------------ TRL's side
def build_trainer(model_name: str):
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from bench.grpo_trl import grpo_config

    transformers.set_seed(GRPO["seed"])
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(model_name), padding_side="left")
    prompts = [p["prompt"] for p in W.load_ppo_prompts(tok)]
    model = AutoModelForCausalLM.from_pretrained(model_dir(model_name), dtype="float32")
    stops = [tok.convert_tokens_to_ids(ch) for ch in EXTRA_STOP]
    assert tok.unk_token_id not in stops or tok.unk_token_id is None, "a stop character is not one token"
    model.generation_config.eos_token_id = [tok.eos_token_id, *stops]
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["target_modules"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_reward], args=grpo_config(1),
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                          peft_config=lora)
    return trainer, prompts


class Capture:
    """Instance wrappers (TRL's code is not modified): the full generation batch before TRL shuffles it, the
    rewards, and the last forward's per-token log-probs and entropies."""

    def __init__(self, trainer):
        self.full = self.rewards = self.logps = self.entropies = None
        gen, rewards, fwd = (trainer._generate_and_score_completions, trainer._calculate_rewards,
                             trainer._get_per_token_logps_and_entropies)

        def gen_probe(*a, **k):
            self.full = gen(*a, **k)
            return self.full

        def rewards_probe(*a, **k):
            self.rewards = rewards(*a, **k)
            return self.rewards

        def fwd_probe(*a, **k):
            out = fwd(*a, **k)
            self.logps, self.entropies = out[0], out[1]
            return out

        trainer._generate_and_score_completions = gen_probe
        trainer._calculate_rewards = rewards_probe
        trainer._get_per_token_logps_and_entropies = fwd_probe


def set_trl_case(trainer, c: dict) -> None:
    """The attributes ``GRPOTrainer._compute_loss`` reads, as ``GRPOTrainer.__init__`` sets them from the
    config (``epsilon_low = epsilon``, ``epsilon_high = epsilon_high or epsilon``)."""
    t = c["trl"]
    trainer.loss_type = t["loss_type"]
    trainer.importance_sampling_level = t["importance_sampling_level"]
    trainer.epsilon_low = t["epsilon"]
    trainer.epsilon_high = t["epsilon_high"] if t["epsilon_high"] is not None else t["epsilon"]
    trainer.beta = t["beta"]
    trainer.top_entropy_quantile = t["top_entropy_quantile"]
    trainer.args.use_bias_correction_kl = t["use_bias_correction_kl"]
    trainer.args.delta = t["delta"]


def step_on_trl_loss(trainer, inputs, steps: int, lr: float) -> list[float]:
    """``steps`` Adam steps (lr ``lr``) on TRL's loss of ``inputs`` (its ``_compute_loss``, the trainer's
    configuration at the time): a later micro-step of the ``num_iterations`` loop, with a large learning rate so
    the ratios move. Returns the losses."""
    import torch

    params = [p for p in trainer.model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    opt.zero_grad()
    return losses


def perturb(model, std: float, seed: int) -> int:
    """Add N(0, std^2) noise (seeded) to every LoRA B matrix; returns how many matrices were moved."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    moved = 0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=gen) * std)
                moved += 1
    return moved


# ------------------------------------------------------------------------------------------ ours
class _NoOp:
    def zero_grad(self):
        pass

    def step(self):
        pass


class FixedPolicy:
    """The ``PPOUpdater``'s policy collaborator: returns the given log-probs and entropies (TRL's forward's),
    after checking that the micro-batch is the minibatch in row order."""

    def __init__(self, completion_ids, logps, entropies):
        self.completion_ids, self.logps, self.entropies = completion_ids, logps, entropies
        self.calls = 0

    def __call__(self, input_ids, attention_mask, prompt_len, temperature, chunk_size=None, entropy_grad=False,
                 want_logprobs=True, want_values=False, want_entropy=True):
        from rlhf_lit.models.policy import PolicyOutput

        assert input_ids[:, prompt_len:].equal(self.completion_ids), "the micro-batch is not the minibatch in order"
        assert not want_values
        self.calls += 1
        return PolicyOutput(logprobs=self.logps, entropy=self.entropies)


def ours_loss(c: dict, inputs: dict, logps, entropies, advantages):
    """rlhf_lit's loss of the minibatch: ``PPOUpdater.update`` (one epoch, one minibatch of every row, one
    micro-batch) with the settings ``c["ours"]`` as a user's config gives them. Returns (loss, update stats)."""
    import torch

    from rlhf_lit.functional.group_advantages import token_advantages
    from rlhf_lit.rl.assembly import update_settings
    from rlhf_lit.rl.generation import SamplingConfig
    from rlhf_lit.rl.objectives import PPOObjective
    from rlhf_lit.rl.schedule import epoch_schedule
    from rlhf_lit.rl.settings import PPOConfig
    from rlhf_lit.rl.update import PPOUpdater, UpdateBatch

    o = c["ours"]
    rows = inputs["completion_ids"].shape[0]
    ppo = PPOConfig(advantage_estimator="grpo", ppo_epochs=1, ppo_minibatch_size=rows,
                    loss_aggregation=o["loss_aggregation"], kl_placement="loss", clip_range=o["clip_range"],
                    clip_range_low=o["clip_range_low"], clip_range_high=o["clip_range_high"],
                    importance_sampling_level=o["importance_sampling_level"], dual_clip=o["dual_clip"],
                    top_entropy_quantile=o["top_entropy_quantile"], policy_loss=o["policy_loss"], entropy_coef=0.0,
                    seed=GRPO["seed"])
    sampling = SamplingConfig(max_new_tokens=GRPO["max_new_tokens"], temperature=GRPO["temperature"],
                              num_samples_per_prompt=GRPO["group_size"])
    mask = inputs["completion_mask"].bool()
    old = inputs.get("old_per_token_logps")
    beta = o["kl_coef"]
    batch = UpdateBatch(
        input_ids=torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
        prompt_len=inputs["prompt_ids"].shape[1],
        mask=mask,
        old_logprobs=logps.detach() if old is None else old,
        old_values=None,
        advantages=token_advantages(advantages, mask),
        returns=None,
        **({"ref_logprobs": inputs["ref_per_token_logps"], "kl_coef": beta} if beta else {}),
    )
    losses = []
    policy = FixedPolicy(inputs["completion_ids"], logps, entropies)
    updater = PPOUpdater(
        policy,
        PPOObjective.from_settings(ppo, "k3"),
        update_settings(ppo, sampling),
        backward=losses.append,
        clip=lambda opt: 0.0,
        optimizers=lambda: (_NoOp(), _NoOp()),
        world=lambda: SimpleNamespace(world_size=1, global_rank=0),
        schedule=lambda order, *args: epoch_schedule(torch.arange(order.numel()), *args),
    )
    stats = updater.update(batch, 0)
    assert policy.calls == 1 and len(losses) == 1, (policy.calls, len(losses))
    return losses[0], stats


# ------------------------------------------------------------------------------------------ the forwards
class OurForward:
    """rlhf_lit's policy (``ActorCritic`` on the same base, loaded by ``load_backbone`` as a ``PPOModule`` loads
    it, with the workload's LoRA) holding TRL's LoRA weights, to compare the two forwards on the minibatch."""

    def __init__(self, model_name: str, tokenizer):
        from rlhf_lit.models.backbone import BackboneConfig, LoraSettings, load_backbone
        from rlhf_lit.models.policy import ActorCritic

        cfg = BackboneConfig(name_or_path=str(model_dir(model_name)), dtype="float32", lora=LoraSettings(**LORA))
        self.policy = ActorCritic(load_backbone(cfg, tokenizer), cfg.lora, None, with_critic=False)

    def load_from(self, trl_model) -> None:
        """Copy TRL's peft adapter (``default``) into our ``actor`` adapter, parameter by parameter."""
        import torch

        ours = {n: p for n, p in self.policy.named_parameters() if "lora_" in n}
        theirs = {n: p for n, p in trl_model.named_parameters() if "lora_" in n}
        assert len(ours) == len(theirs) > 0, (len(ours), len(theirs))
        with torch.no_grad():
            for name, p in theirs.items():
                ours["lm.model." + name.replace(".default.", ".actor.")].copy_(p)

    def compare(self, trl_model, inputs: dict, trl_logps) -> dict:
        """max |logp_ours - logp_TRL| per row over the completion tokens; and TRL's model called directly with
        position ids from the attention mask (what transformers' ``generate`` uses) against ours."""
        import torch

        self.load_from(trl_model)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        p, r = inputs["prompt_ids"].shape[1], inputs["completion_ids"].shape[1]
        mask = inputs["completion_mask"].bool()
        with torch.no_grad():
            ours = self.policy(ids, attn, p, GRPO["temperature"], want_values=False).logprobs
            pos = (attn.cumsum(1) - 1).clamp(min=0)
            logits = trl_model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, p - 1 : p + r - 1]
            trl_pos = torch.log_softmax(logits.float() / GRPO["temperature"], -1)
            trl_pos = trl_pos.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)

        def per_row(a, b):
            return [float(x) for x in ((a - b).abs() * mask).amax(1)]

        return dict(
            left_padding=[int(x) for x in (1 - inputs["prompt_mask"]).sum(1)],
            ours_vs_trl_forward=per_row(ours, trl_logps.detach()),
            ours_vs_trl_model_positions_from_mask=per_row(ours, trl_pos),
        )


def sampling_positions(trl_model, tokenizer, prompts: list[str], new_tokens: int = 16) -> dict:
    """Which positions ``generate`` samples with: per row, max |log-prob at sampling - log-prob of a forward|
    for a forward without ``position_ids`` (TRL's ``_get_per_token_logps_and_entropies``) and one with positions
    from the attention mask (ours). The prompts are left-padded as TRL pads them."""
    import torch
    import transformers

    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    transformers.set_seed(GRPO["seed"])
    t = GRPO["temperature"]
    with torch.no_grad():
        out = trl_model.generate(**enc, do_sample=True, max_new_tokens=new_tokens, temperature=t, top_k=0, top_p=1.0,
                                 min_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=tokenizer.pad_token_id)
        p = enc["input_ids"].shape[1]
        comp = out.sequences[:, p:]
        sampled = torch.stack([torch.log_softmax(x.float() / t, -1) for x in out.logits], 1)
        sampled = sampled.gather(-1, comp.unsqueeze(-1)).squeeze(-1)
        attn = torch.cat([enc["attention_mask"], torch.ones_like(comp)], 1)

        def forward(**kw):
            logits = trl_model(input_ids=out.sequences, attention_mask=attn, **kw).logits[:, p - 1 : -1]
            lp = torch.log_softmax(logits.float() / t, -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
            return [float(x) for x in (lp - sampled).abs().amax(1)]

        return dict(
            left_padding=[int(x) for x in (1 - enc["attention_mask"]).sum(1)],
            without_position_ids=forward(),
            positions_from_mask=forward(position_ids=(attn.cumsum(1) - 1).clamp(min=0)),
        )


# ------------------------------------------------------------------------------------------ the child
def locate_rows(full: dict, mb: dict) -> list[int]:
    """Rows of the unshuffled generation batch that make TRL's first minibatch (by prompt and completion)."""
    out = []
    for i in range(mb["completion_ids"].shape[0]):
        hits = [j for j in range(full["completion_ids"].shape[0])
                if full["completion_ids"][j].equal(mb["completion_ids"][i])
                and full["prompt_ids"][j].equal(mb["prompt_ids"][i])]
        assert hits, "a minibatch row is not in the generation batch"
        out.append(hits[0])
    return out


def child_grpo_loss(threads: int, model_name: str = "tiny") -> dict:
    setup_child(threads)
    import torch
    import transformers
    import trl

    from rlhf_lit.functional.group_advantages import group_relative_advantages

    trainer, prompts = build_trainer(model_name)
    our_forward = OurForward(model_name, trainer.processing_class)
    cap = Capture(trainer)
    trainer.model.train()
    if not hasattr(trainer, "current_gradient_accumulation_steps"):  # set by Trainer's loop at each step
        trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    n = GRPO["prompts_per_rollout"] * GRPO["group_size"]
    generation_batch = [{"prompt": p} for p in prompts[: GRPO["prompts_per_rollout"]] for _ in range(GRPO["group_size"])]
    transformers.set_seed(GRPO["seed"])
    with torch.no_grad():
        inputs = trainer._prepare_inputs(generation_batch)  # TRL's first step's minibatch (generation included)
    full, rewards = cap.full, cap.rewards[:, 0]
    assert full["completion_ids"].shape[0] == n and inputs["completion_ids"].shape[0] == GRPO["mini_batch_size"]
    rows = locate_rows(full, inputs)

    # advantages: ours from the same rewards (GRPO's group std, rlhf_lit's eps 1e-6) against TRL's
    ours_adv = group_relative_advantages(rewards.double(), GRPO["group_size"]).float()
    ours_adv_eps4 = group_relative_advantages(rewards.double(), GRPO["group_size"], eps=1e-4).float()
    adv = dict(
        trl=[round(float(a), 6) for a in full["advantages"]],
        rewards=[round(float(r), 6) for r in rewards],
        max_abs_diff_eps_1e6=float((ours_adv - full["advantages"]).abs().max()),
        max_abs_diff_eps_1e4=float((ours_adv_eps4 - full["advantages"]).abs().max()),
        note="TRL: (r - group mean) / (unbiased group std + 1e-4) (GRPOTrainer._generate_and_score_completions, "
             "scale_rewards='group'); ours: + 1e-6 (functional.group_advantages.group_relative_advantages); "
             "scale_rewards='none' against ours scale_by_std=False (Dr.GRPO): r - group mean on both sides",
    )
    # Dr.GRPO's advantages: TRL's scale_rewards="none" (the same completions: the same seed) against ours
    trainer.scale_rewards = "none"
    transformers.set_seed(GRPO["seed"])
    with torch.no_grad():
        none = trainer._generate_and_score_completions(generation_batch)
    trainer.scale_rewards = trainer.args.scale_rewards
    assert none["completion_ids"].equal(full["completion_ids"]), "the second sampling drew other completions"
    ours_none = group_relative_advantages(cap.rewards[:, 0].double(), GRPO["group_size"], scale_by_std=False).float()
    adv["max_abs_diff_scale_rewards_none"] = float((ours_none - none["advantages"]).abs().max())
    mb_adv = inputs["advantages"]
    assert torch.equal(mb_adv, full["advantages"][rows])
    tokens_mb = int(inputs["completion_mask"].sum())
    num_items = float(inputs["num_items_in_batch"])
    spg = trainer.args.steps_per_generation

    records = []
    forwards = {}
    stepped_losses = []
    for phase in ("ratio1", "stepped", "perturbed"):
        if phase == "stepped":  # from the sampling policy: Adam steps on TRL's grpo loss (token, eps 0.2)
            set_trl_case(trainer, cases()[0])
            stepped_losses = step_on_trl_loss(trainer, inputs, STEPS, STEP_LR)
        if phase == "perturbed":  # then noise on every LoRA B matrix
            moved = perturb(trainer.model, PERTURB_STD, PERTURB_SEED)
        for c in cases():
            set_trl_case(trainer, c)
            trl_loss = trainer._compute_loss(trainer.model, inputs)
            logps, ent = cap.logps, cap.entropies
            ours, stats = ours_loss(c, inputs, logps, ent, mb_adv)
            g_trl, = torch.autograd.grad(trl_loss, logps, retain_graph=True)
            g_ours, = torch.autograd.grad(ours, logps, retain_graph=True)
            mask = inputs["completion_mask"].bool()
            old = inputs["old_per_token_logps"]
            ratio = torch.exp(logps.detach() - old)[mask]
            seq_log = ((logps.detach() - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            scale = tokens_mb * spg / num_items if c["rescale"] else 1.0
            diff = abs(float(trl_loss) - float(ours))
            rec = dict(
                case=c["name"], phase=phase, trl=c["trl"], ours=c["ours"],
                trl_loss=float(trl_loss), ours_loss=float(ours), abs_diff=diff,
                grad_max_abs_diff=float((g_trl - g_ours)[mask].abs().max()),
                grad_max_abs=float(g_trl[mask].abs().max()),
                token_ratio_range=[float(ratio.min()), float(ratio.max())],
                seq_ratio_range=[float(seq_log.exp().min()), float(seq_log.exp().max())],
                clipfrac=stats.get("ppo/clipfrac"), differs=c["differs"],
            )
            if c["rescale"]:  # the normaliser is the whole difference: ours x (mb tokens / (N / spg))
                rec["ours_loss_rescaled"] = float(ours) * scale
                rec["abs_diff_rescaled"] = abs(float(trl_loss) - float(ours) * scale)
            rec["agrees"] = (diff <= TOL and rec["grad_max_abs_diff"] <= TOL) if c["differs"] is None else None
            records.append(rec)
            if phase not in forwards:  # the first case's forward (the LoRA weights are the phase's)
                forwards[phase] = our_forward.compare(trainer.model, inputs, logps)
    positions = sampling_positions(trainer.model, trainer.processing_class, prompts[: GRPO["prompts_per_rollout"]])
    agreed = [r for r in records if r["differs"] is None]
    return dict(
        wall_s=time.perf_counter() - T_PROCESS_START,
        throughput=float(len(records)),
        unit="cases",
        peak_rss_mb=0.0,
        metrics=dict(
            cases=len(records),
            same_definition=len(agreed),
            passed=sum(bool(r["agrees"]) for r in agreed),
            max_abs_diff_same_definition=max(r["abs_diff"] for r in agreed),
            max_grad_diff_same_definition=max(r["grad_max_abs_diff"] for r in agreed),
        ),
        details=dict(
            records=records,
            advantages=adv,
            minibatch=dict(rows_of_generation_batch=rows, tokens=tokens_mb, num_items_in_batch=num_items,
                           steps_per_generation=spg, completion_lengths=inputs["completion_mask"].sum(1).tolist(),
                           old_logprobs_given="old_per_token_logps" in inputs),
            forwards=forwards,
            sampling_positions=positions,
            stepped=dict(steps=STEPS, lr=STEP_LR, optimizer="torch.optim.Adam on the LoRA parameters",
                         trl_losses=stepped_losses),
            perturbation=dict(std=PERTURB_STD, seed=PERTURB_SEED, lora_b_matrices=moved, after="stepped"),
            extra_stop=EXTRA_STOP,
            tolerance=TOL,
            workload=workload(model_name),
            env=dict(env_info(threads), trl=trl.__version__, cpu=cpu_model()),
        ),
    )


# ------------------------------------------------------------------------------------------ the parent
PHASES = ("ratio1", "stepped", "perturbed")


def markdown(result: dict) -> str:
    """One row per configuration: both losses and |TRL - ours| for each policy, the largest gradient difference,
    and the verdict (pass / FAIL at TOL for the same definition; for a different one, the rescaled difference
    where the normaliser is the whole difference). Then the ratios of each policy."""
    d = result["details"]
    by_case: dict = {}
    for r in d["records"]:
        by_case.setdefault(r["case"], {})[r["phase"]] = r
    head = " | ".join(f"{p}: TRL / rlhf_lit loss | abs diff" for p in PHASES)
    lines = [f"| configuration | {head} | max grad diff | result |", "|---" * (3 + 2 * len(PHASES)) + "|"]
    for case, rows in by_case.items():
        rs = [rows[p] for p in PHASES]
        cells = " | ".join(f"{r['trl_loss']:.8f} / {r['ours_loss']:.8f} | {r['abs_diff']:.1e}" for r in rs)
        grad = max(r["grad_max_abs_diff"] for r in rs)
        if rs[0]["differs"] is None:
            verdict = "pass" if all(r["agrees"] for r in rs) else "FAIL"
        elif "abs_diff_rescaled" in rs[0]:
            verdict = f"differs (normaliser); rescaled diff <= {max(r['abs_diff_rescaled'] for r in rs):.1e}"
        elif all(r["abs_diff"] <= TOL for r in rs):
            verdict = "loss agrees, gradient differs (definition)"
        else:
            verdict = "differs (definition)"
        lines.append(f"| {case} | {cells} | {grad:.1e} | {verdict} |")
    first = {r["phase"]: r for r in d["records"] if r["case"] == d["records"][0]["case"]}
    lines.append("")
    for p in PHASES:
        r = first[p]
        t, q = r["token_ratio_range"], r["seq_ratio_range"]
        lines.append(f"- {p}: token ratios {t[0]:.4f}-{t[1]:.4f}, sequence ratios {q[0]:.4f}-{q[1]:.4f}, "
                     f"clip fraction at eps 0.2 (token level) {r['clipfrac']:.3f}")
    return "\n".join(lines)


def _commit() -> str | None:
    import subprocess

    from bench.common import REPO

    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"],
                           cwd=REPO, capture_output=True, text=True).stdout.strip()  # the --out file aside
    return (out.stdout.strip() + ("+uncommitted changes" if dirty else "")) if out.returncode == 0 else None


def main(args, fingerprint: dict) -> None:
    import datetime
    import json
    import sys

    from bench.common import log, print_line, run_child

    try:
        import trl
    except ImportError:
        trl = None
    if trl is None or trl.__version__ != "1.16.0":
        print("rlhf-lit: error: --workload grpo_loss needs trl==1.16.0 in this interpreter "
              f"({sys.executable}; found {getattr(trl, '__version__', 'none')}): run it with an environment "
              "that has it (bench/README.md)", file=sys.stderr)
        raise SystemExit(2)
    log("[bench] grpo_loss: TRL 1.16 GRPOTrainer._compute_loss vs rlhf_lit's PPOUpdater, first step ...")
    result = run_child("grpo_loss", 0, args)
    m = result["metrics"]
    line = dict(
        system="rlhf_lit/trl",
        workload="grpo_loss",
        metrics=m,
        details=result["details"],
        config=dict(
            command=" ".join(["python", "bench/run.py", *sys.argv[1:]]),
            commit=_commit(),
            threads=args.threads,
            artifact_sha256_16=fingerprint,
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        ),
    )
    print_line(line, args.out)
    log("\n" + markdown(result) + "\n")
    log(f"[bench] grpo_loss: {m['passed']}/{m['same_definition']} same-definition cases agree to {TOL:g} (loss and "
        f"gradient); {m['cases'] - m['same_definition']} differ by definition; advantages: "
        + json.dumps({k: v for k, v in result['details']['advantages'].items() if k.startswith('max')}))
    if m["passed"] < m["same_definition"]:  # a configuration with the same definition disagrees
        raise SystemExit(1)
