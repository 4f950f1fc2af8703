"""The oracle of ``test_oracle.py`` for critic-free iterations: GRPO, Dr.GRPO and RLOO.

The module runs one real iteration with n = 2 responses per prompt; spies record what it sampled, scored and
shuffled; from those alone a plain loop over a fresh Hugging Face GPT-2 (LoRA merged by hand,
``test_oracle``'s helpers) recomputes the log-probs, the group advantages, and the first minibatch's loss and
gradients for every actor LoRA matrix, with each estimator's defaults from its paper:

* ``grpo``: ``A_i = (r_i - mean) / (std + 1e-6)`` (unbiased std over the group, r = score), the k3 KL in the
  loss, the loss the mean over responses of each response's token mean (Shao et al. 2024, eq. 3);
* ``dr_grpo`` (``scale_by_std: false``): ``A_i = r_i - mean``, the KL in the loss, the token sum divided by
  responses x ``max_new_tokens`` (Liu et al. 2025);
* ``rloo``: ``r_i = score - kl_coef * sum_t k1_t`` (the KL in the reward), ``A_i = r_i - mean of the other``,
  the same token-sum aggregation.

The actor adapter starts non-zero, so the KL terms are not 0; there is no critic, value head or value loss.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.schedule import epoch_schedule
from rlhf_lit.rl.settings import KLConfig, PPOConfig
from tests.ppo.helpers import RecordingReward, make_data, make_module, make_trainer, uneven_sampler
from tests.ppo.oracle_recording import move_off_zero
from tests.ppo.test_oracle import _forward, _lora, _merged, _plain_gpt2

TEMPERATURE, KL_COEF, CLIP, ENTROPY_COEF = 0.7, 0.2, 0.2, 0.01
N, PROMPTS, MAX_NEW = 2, 2, 8
CASES = {
    "grpo": dict(advantage_estimator="grpo"),
    "dr_grpo": dict(advantage_estimator="grpo", scale_by_std=False),
    "rloo": dict(advantage_estimator="rloo"),
}


def _record(case, tmp_path):
    rec: dict = {}

    def schedule(*args):
        out = epoch_schedule(*args)
        rec.setdefault("schedule", out)
        return out

    torch.manual_seed(0)
    module = make_module(
        sampling=SamplingConfig(max_new_tokens=MAX_NEW, temperature=TEMPERATURE, num_samples_per_prompt=N),
        ppo=PPOConfig(
            ppo_epochs=1,
            ppo_minibatch_size=2,
            micro_batch_size=1,
            clip_range=CLIP,
            entropy_coef=ENTROPY_COEF,
            max_grad_norm=None,
            total_iterations=1,
            **CASES[case],
        ),
        kl=KLConfig(kl_coef=KL_COEF),
        sampler=uneven_sampler(rec),  # uneven lengths whatever was sampled
        schedule=schedule,
    )
    move_off_zero(module)  # critic-free: the actor's LoRA matrices only
    rec["lora"] = _lora(module, "actor")
    reward = RecordingReward(module.collector.reward_fn)
    module.collector.reward_fn = reward
    losses: list[float] = []
    updater = module.updater
    real_backward, real_clip = updater.backward, updater.clip

    def backward(loss, *args, **kwargs):
        if "grads" not in rec:
            losses.append(float(loss.detach()))
        return real_backward(loss, *args, **kwargs)

    def clip(opt):
        if "grads" not in rec:
            rec["grads"] = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
            rec["loss"] = sum(losses)
        return real_clip(opt)

    updater.backward, updater.clip = backward, clip
    make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=PROMPTS))
    rec["scores"] = reward.calls[-1]
    return module, rec


def _advantages(case, rewards):
    """Plain group arithmetic over consecutive pairs (n = 2)."""
    out = []
    for g in range(0, len(rewards), N):
        group = rewards[g : g + N]
        mean = sum(group) / N
        std = (sum((r - mean) ** 2 for r in group) / (N - 1)) ** 0.5
        for r in group:
            if case == "grpo":
                out.append((r - mean) / (std + 1e-6))
            elif case == "dr_grpo":
                out.append(r - mean)
            else:
                out.append(r - (sum(group) - r) / (N - 1))
    return out


def _oracle(case, module, rec):
    plain, base = _plain_gpt2(module)
    prompt_ids, prompt_mask, response_ids, response_mask = rec["sample"]
    actor = rec["lora"]
    rows = []
    for i in range(prompt_ids.shape[0]):
        prompt, response = prompt_ids[i][prompt_mask[i].bool()], response_ids[i][response_mask[i].bool()]
        rows.append({"ids": torch.cat([prompt, response]), "P": len(prompt), "response": response})

    def logp_entropy(row, weights):
        logits, _ = _forward(plain, weights, row["ids"])
        logp, ent = [], []
        for t, token in enumerate(row["response"].tolist()):
            dist = torch.log_softmax(logits[row["P"] - 1 + t] / TEMPERATURE, dim=-1)
            logp.append(dist[token])
            ent.append(-(dist.exp() * dist).sum())
        return torch.stack(logp), torch.stack(ent)

    with torch.no_grad():
        for row in rows:
            row["ref"], _ = logp_entropy(row, _merged(base, None))
            row["old"], _ = logp_entropy(row, _merged(base, actor))
    kl_in_reward = case == "rloo"
    rewards = [
        float(rec["scores"][i]) - (KL_COEF * float((row["old"] - row["ref"]).sum()) if kl_in_reward else 0.0)
        for i, row in enumerate(rows)
    ]
    adv = _advantages(case, rewards)
    first = rec["schedule"][0][0].tolist()
    leaves = [t for pair in actor.values() for t in pair]
    weights = _merged(base, actor)
    per_row = []
    for i in first:
        row = rows[i]
        logp, ent = logp_entropy(row, weights)
        terms = []
        for t in range(len(row["response"])):
            ratio = torch.exp(logp[t] - float(row["old"][t]))
            term = torch.maximum(-adv[i] * ratio, -adv[i] * ratio.clamp(1 - CLIP, 1 + CLIP))
            if not kl_in_reward:  # k3 = exp(ref - logp) - 1 - (ref - logp)
                d = float(row["ref"][t]) - logp[t]
                term = term + KL_COEF * (torch.exp(d) - 1 - d)
            terms.append(term - ENTROPY_COEF * ent[t])
        per_row.append(terms)
    if case == "grpo":  # mean over responses of token means
        loss = sum(sum(terms) / len(terms) for terms in per_row) / len(per_row)
    else:  # token sum / (responses x max_new_tokens)
        loss = sum(sum(terms) for terms in per_row) / (len(per_row) * MAX_NEW)
    grads = torch.autograd.grad(loss, leaves)
    names = [(w, m) for w in actor for m in ("A", "B")]
    by_name = {f"{w.removesuffix('.weight')}.lora_{m}.actor.weight": g for (w, m), g in zip(names, grads)}
    return {"rows": rows, "adv": adv, "loss": float(loss.detach()), "grads": by_name, "first": first}


@pytest.mark.parametrize("case", sorted(CASES))
def test_critic_free_iteration_equals_the_oracle(case, tmp_path):
    module, rec = _record(case, tmp_path)
    assert module.policy.value_head is None
    oracle = _oracle(case, module, rec)
    rows = oracle["rows"]
    # not degenerate: the actor is not the reference, scores and lengths differ, prompts repeat in pairs
    kl = torch.cat([row["old"] - row["ref"] for row in rows])
    assert kl.abs().mean() > 0.05 and len(set(rec["scores"].tolist())) == N * PROMPTS
    assert len({len(row["response"]) for row in rows}) > 1
    assert torch.equal(rec["sample"][0][0::2], rec["sample"][0][1::2])
    assert len(oracle["first"]) == 2 and len(rec["schedule"]) == 2
    assert rec["loss"] == pytest.approx(oracle["loss"], rel=1e-4, abs=1e-6)
    prefix = "policy.lm.model.base_model.model."
    expected = {prefix + k: v for k, v in oracle["grads"].items()}
    assert set(rec["grads"]) == set(expected)  # the actor's LoRA matrices only: no critic, no value head
    for name, grad in expected.items():
        assert grad.abs().max() > 1e-6, name
        scale = float(grad.abs().max())
        assert_close(
            rec["grads"][name], grad, atol=2e-5 * scale, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )
