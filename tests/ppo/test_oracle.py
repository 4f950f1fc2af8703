"""An oracle for one PPO iteration: the module's numbers against a plain, loop-based re-implementation.

The module runs one real iteration (sampling, reward model, update). Spies record what it sampled and
what its reward model scored; from those alone the oracle recomputes steps 2-6 with nothing of rlhf_lit's
math (the conventions of docs/layout.md, written out as loops over sequences and tokens):

2-3. reference and old log-probs and the critic's values from a plain Hugging Face forward of a FRESH GPT-2
     into which the LoRA weights are merged by hand (``W + alpha / r * (B A)^T``), one unpadded sequence
     at a time (so no padding, no position ids, no adapter switching is shared with the module);
5.   token rewards ``-kl_coef * (logp - ref_logp)`` plus the score on the last real token, GAE with the
     critic's values, whitening over every real token;
6.   the first minibatch's clipped policy loss + value loss - entropy bonus, and its gradients with respect
     to every LoRA matrix and the value head (autograd through the hand-made merge).

The actor and critic start from non-zero LoRA weights (so KL != 0 and the values are not 0), the reward
model is a real (random) one whose scores differ per response, and gamma, lambda, kl_coef, vf_coef and
entropy_coef are all away from their defaults, so that each of these four wiring bugs makes the test fail:
advantage whitening skipped; the KL penalty dropped from the token rewards; GAE fed zeros instead of the
critic's values; log-probs and values read one position late.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.func import functional_call
from torch.testing import assert_close
from transformers import GPT2LMHeadModel

from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.schedule import epoch_schedule
from rlhf_lit.rl.settings import KLConfig, PPOConfig
from tests.ppo.helpers import (
    LORA,
    RecordingReward,
    RecordingUpdater,
    make_data,
    make_module,
    make_trainer,
    uneven_sampler,
    update_fields,
)
from tests.ppo.oracle_recording import move_off_zero

TEMPERATURE = 0.7
KL_COEF = 0.2
GAMMA, LAMBDA = 0.9, 0.8
CLIP, VALUE_CLIP = 0.2, 0.2
VF_COEF, ENTROPY_COEF = 0.5, 0.01
SCALING = LORA.alpha / LORA.r  # peft's LoRA scaling, alpha / r = 2
BATCH = 4


# ---------------------------------------------------------------------------------------- the plain model
def _plain_gpt2(module) -> tuple[GPT2LMHeadModel, dict[str, torch.Tensor]]:
    """A fresh transformers GPT-2 with the module's frozen base weights, and the base weights by name."""
    peft_base = module.policy.lm.model.get_base_model()
    plain = GPT2LMHeadModel(copy.deepcopy(peft_base.config)).eval()
    base = {
        k.replace(".base_layer.", "."): v.detach().clone()
        for k, v in peft_base.state_dict().items()
        if "lora_" not in k
    }
    plain.load_state_dict(base, strict=False)  # lm_head.weight is tied to wte
    for k, v in plain.state_dict().items():
        assert torch.equal(v, base[k]), k
    return plain, {k: v for k, v in base.items() if k in dict(plain.named_parameters())}


def _lora(module, adapter: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{plain weight name: (A (r, in), B (out, r))} of one adapter, as leaf tensors that require grad."""
    out = {}
    for name, p in module.policy.lm.model.get_base_model().named_parameters():
        m = re.match(rf"(.*)\.lora_A\.{adapter}\.weight$", name)
        if m:
            b = dict(module.policy.lm.model.get_base_model().named_parameters())[
                f"{m[1]}.lora_B.{adapter}.weight"
            ]
            out[f"{m[1]}.weight"] = (
                p.detach().clone().requires_grad_(),
                b.detach().clone().requires_grad_(),
            )
    assert len(out) == 4  # c_attn and c_fc in 2 blocks
    return out


def _merged(base: dict, lora: dict | None) -> dict[str, torch.Tensor]:
    """GPT-2's Conv1D computes x @ W with W (in, out); LoRA adds scaling * x @ A^T @ B^T."""
    weights = dict(base)
    for name, (a, b) in (lora or {}).items():
        weights[name] = base[name] + SCALING * (b @ a).T
    return weights


def _forward(plain, weights, ids: torch.Tensor):
    """Logits (T, V) and last hidden states (T, H) of ONE unpadded sequence."""
    out = functional_call(
        plain, weights, args=(), kwargs={"input_ids": ids[None], "output_hidden_states": True}
    )
    return out.logits[0], out.hidden_states[-1][0]


# ---------------------------------------------------------------------------------------- the recording
def _record_one_iteration(tmp_path):
    """One iteration with recording components injected through the constructor (sampler, schedule) or put
    in place of the module's own (reward function, updater, backward, clip): no production code is patched."""
    rec: dict = {}

    def schedule(*args):
        out = epoch_schedule(*args)
        rec.setdefault("schedule", out)
        return out

    torch.manual_seed(0)
    module = make_module(
        sampling=SamplingConfig(max_new_tokens=8, temperature=TEMPERATURE),
        ppo=PPOConfig(
            ppo_epochs=1,
            ppo_minibatch_size=2,
            micro_batch_size=1,
            gamma=GAMMA,
            gae_lambda=LAMBDA,
            clip_range=CLIP,
            value_clip_range=VALUE_CLIP,
            vf_coef=VF_COEF,
            entropy_coef=ENTROPY_COEF,
            max_grad_norm=None,
            total_iterations=1,
        ),
        kl=KLConfig(kl_coef=KL_COEF),
        sampler=uneven_sampler(rec),  # responses 1 and 2 end with the stop token at positions 2 and 4
        schedule=schedule,
    )
    move_off_zero(module)  # LoRA B starts at 0 and the value head at 0: move both adapters and the head
    rec["lora"] = {a: _lora(module, a) for a in ("actor", "critic")}
    rec["head"] = {k: v.detach().clone() for k, v in module.policy.value_head.linear.state_dict().items()}

    reward = RecordingReward(module.collector.reward_fn)
    module.collector.reward_fn = reward
    module.updater = RecordingUpdater(module.updater)
    losses: list[float] = []
    real_backward, real_clip = module.updater.backward, module.updater.clip

    def backward(loss, *args, **kwargs):
        if "grads" not in rec:
            losses.append(float(loss.detach()))
        return real_backward(loss, *args, **kwargs)

    def clip(opt):
        if "grads" not in rec:  # the first optimizer step: gradients of the first minibatch's loss
            rec["grads"] = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
            rec["loss"] = sum(losses)
        return real_clip(opt)

    module.updater.inner.backward, module.updater.inner.clip = backward, clip
    make_trainer(tmp_path).fit(module, datamodule=make_data(module, batch_size=BATCH))
    assert module.iteration == 1
    rec["scores"] = reward.calls[-1]
    rec["update"] = update_fields(module.updater.calls[-1])
    return module, rec


# ---------------------------------------------------------------------------------------- the oracle
def _oracle(module, rec) -> dict:
    plain, base = _plain_gpt2(module)
    prompt_ids, prompt_mask, response_ids, response_mask = rec["sample"]
    actor, critic = rec["lora"]["actor"], rec["lora"]["critic"]
    head_w = rec["head"]["weight"].clone().requires_grad_()
    head_b = rec["head"]["bias"].clone().requires_grad_()
    rows = []
    for i in range(BATCH):
        prompt = prompt_ids[i][prompt_mask[i].bool()]
        response = response_ids[i][response_mask[i].bool()]
        rows.append({"ids": torch.cat([prompt, response]), "P": len(prompt), "response": response})

    def token_terms(row, actor_w, critic_w, with_grad):
        """log-probs, entropies and values of the response tokens: logits at position P - 1 + t predict
        token t, and the value of that action is read at the same position."""
        with torch.set_grad_enabled(with_grad):
            logits, _ = _forward(plain, actor_w, row["ids"])
            _, hidden = _forward(plain, critic_w, row["ids"])
        logp, entropy, values = [], [], []
        for t, token in enumerate(row["response"].tolist()):
            pos = row["P"] - 1 + t
            log_dist = torch.log_softmax(logits[pos] / TEMPERATURE, dim=-1)
            logp.append(log_dist[token])
            entropy.append(-(log_dist.exp() * log_dist).sum())
            values.append(hidden[pos] @ head_w[0] + head_b[0])
        return torch.stack(logp), torch.stack(entropy), torch.stack(values)

    with torch.no_grad():
        ref_w, actor_w, critic_w = _merged(base, None), _merged(base, actor), _merged(base, critic)
        for i, row in enumerate(rows):
            row["ref"], _, _ = token_terms(row, ref_w, ref_w, False)
            row["old"], _, row["values"] = token_terms(row, actor_w, critic_w, False)
            # token rewards: -kl_coef * k1 on every token, the score on the last one
            kl = [float(a - b) for a, b in zip(row["old"], row["ref"])]
            rewards = [-KL_COEF * k for k in kl]
            rewards[-1] += float(rec["scores"][i])
            # GAE, backwards over the real tokens; V = 0 after the last one
            values = [float(v) for v in row["values"]]
            adv, last, next_v = [0.0] * len(rewards), 0.0, 0.0
            for t in reversed(range(len(rewards))):
                delta = rewards[t] + GAMMA * next_v - values[t]
                last = delta + GAMMA * LAMBDA * last
                adv[t], next_v = last, values[t]
            row["kl"], row["adv_raw"] = kl, adv
            row["returns"] = [a + v for a, v in zip(adv, values)]
        # whitening: mean and unbiased variance over every real token of the rollout
        flat = [a for row in rows for a in row["adv_raw"]]
        mean = sum(flat) / len(flat)
        var = sum((a - mean) ** 2 for a in flat) / (len(flat) - 1)
        for row in rows:
            row["adv"] = [(a - mean) / (var + 1e-8) ** 0.5 for a in row["adv_raw"]]

    # the first minibatch (the rows the module's schedule drew first), its loss and gradients
    first_rows = rec["schedule"][0][0].tolist()
    leaves = [t for pair in list(actor.values()) + list(critic.values()) for t in pair] + [head_w, head_b]
    actor_w, critic_w = _merged(base, actor), _merged(base, critic)
    pg_terms, vf_terms, ent_terms = [], [], []
    for i in first_rows:
        row = rows[i]
        logp, entropy, values = token_terms(row, actor_w, critic_w, True)
        for t in range(len(row["response"])):
            a, ret, old_v = row["adv"][t], row["returns"][t], float(row["values"][t])
            ratio = torch.exp(logp[t] - float(row["old"][t]))
            pg_terms.append(torch.maximum(-a * ratio, -a * ratio.clamp(1 - CLIP, 1 + CLIP)))
            clipped_v = old_v + (values[t] - old_v).clamp(-VALUE_CLIP, VALUE_CLIP)
            vf_terms.append(torch.maximum((values[t] - ret) ** 2, (clipped_v - ret) ** 2))
            ent_terms.append(entropy[t])
    n = len(pg_terms)  # the token-level mean over the minibatch
    loss = sum(pg_terms) / n + VF_COEF * 0.5 * sum(vf_terms) / n - ENTROPY_COEF * sum(ent_terms) / n
    grads = torch.autograd.grad(loss, leaves)
    names = [(a, w, m) for a in ("actor", "critic") for w in rec["lora"][a] for m in ("A", "B")]
    by_name = {}
    for (adapter, weight, matrix), g in zip(names, grads[:-2]):
        by_name[f"{weight.removesuffix('.weight')}.lora_{matrix}.{adapter}.weight"] = g
    by_name["value_head.linear.weight"], by_name["value_head.linear.bias"] = grads[-2], grads[-1]
    return {"rows": rows, "loss": float(loss.detach()), "grads": by_name, "first_rows": first_rows}


def _padded(rows, key, width) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row[key])] = torch.as_tensor([float(x) for x in row[key]])
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    module, rec = _record_one_iteration(tmp_path_factory.mktemp("oracle"))
    return module, rec, _oracle(module, rec)


def test_the_case_is_not_degenerate(recorded):
    _, rec, oracle = recorded
    rows = oracle["rows"]
    kl = torch.tensor([k for row in rows for k in row["kl"]])
    values = torch.tensor([float(v) for row in rows for v in row["values"]])
    assert kl.abs().mean() > 0.05  # the actor is not the reference
    assert values.abs().mean() > 0.1 and values.std() > 0.05  # the critic is not 0
    assert rec["scores"].std() > 0.01 and len(set(rec["scores"].tolist())) == BATCH  # scores differ
    lengths = [len(row["response"]) for row in rows]
    assert len(set(lengths)) > 1 and max(lengths) > 3, lengths  # padding inside the update
    assert len(oracle["first_rows"]) == 2 and len(rec["schedule"]) == 2


def test_experience_equals_the_oracle(recorded):
    """Old log-probs, values, whitened advantages and returns that reach the update (steps 2-5)."""
    _, rec, oracle = recorded
    _, _, prompt_len, mask, old_logprobs, old_values, advantages, returns = rec["update"]
    response_mask = rec["sample"][3]
    assert torch.equal(mask, response_mask) and prompt_len == rec["sample"][0].shape[1]
    rows, width = oracle["rows"], mask.shape[1]
    m = mask.bool()
    for what, ours, key, atol in (
        ("old log-probs", old_logprobs, "old", 2e-5),
        ("values", old_values, "values", 2e-5),
        ("returns", returns, "returns", 1e-4),
        ("advantages", advantages, "adv", 1e-4),
    ):
        expected = _padded(rows, key, width)[m]
        diff = float((ours[m] - expected).abs().max())
        print(f"{what}: max |module - oracle| = {diff:.2e}")
        assert_close(ours[m], expected, atol=atol, rtol=1e-5, msg=lambda text, w=what: f"{w}: {text}")
    assert (advantages[~m] == 0).all()


def test_first_minibatch_loss_and_gradients_equal_the_oracle(recorded):
    """Step 6: the clipped policy loss + value loss - entropy bonus of the first minibatch, and its gradients
    with respect to the actor and critic LoRA matrices and the value head (before any clipping)."""
    _, rec, oracle = recorded
    assert rec["loss"] == pytest.approx(oracle["loss"], rel=1e-4, abs=1e-6)
    prefix = "policy.lm.model.base_model.model."
    expected = {(prefix + k if "lora_" in k else "policy." + k): v for k, v in oracle["grads"].items()}
    assert set(rec["grads"]) == set(expected)
    for name, grad in expected.items():
        assert grad.abs().max() > 1e-6, name  # every parameter gets a real gradient
        # float32 rounding of a sum scales with its largest terms: the tolerance with the tensor's scale
        scale = float(grad.abs().max())
        assert_close(
            rec["grads"][name], grad, atol=2e-5 * scale, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_actor_critic_reads_log_probs_and_values_at_the_right_positions_with_left_padding():
    """``ActorCritic`` on a left-padded batch (prompts of 1, 3 and 5 tokens; responses of 2-4, right padded)
    against the plain forward of each unpadded sequence: the log-prob of response token t comes from the
    logits at position P - 1 + t, its value from the hidden state there (docs/layout.md), for actor, critic and
    reference alike, and no padding or position offset changes a number (docs/pitfalls.md: left padding)."""
    torch.manual_seed(0)
    module = make_module()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        for p in module.policy.lm.adapter_parameters("actor") + module.policy.lm.adapter_parameters("critic"):
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
        module.policy.value_head.linear.weight.normal_(0.0, 0.5, generator=gen)
    plain, base = _plain_gpt2(module)
    actor, critic = _lora(module, "actor"), _lora(module, "critic")
    head = module.policy.value_head.linear
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    responses = [[20, 21, 22, 23], [24, 25], [26, 27, 28]]
    pad = module.tokenizer.pad_token_id
    P, R = max(map(len, prompts)), max(map(len, responses))
    ids = torch.tensor(
        [[pad] * (P - len(p)) + p + r + [pad] * (R - len(r)) for p, r in zip(prompts, responses)]
    )
    mask = torch.tensor(
        [
            [0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r))
            for p, r in zip(prompts, responses)
        ]
    )
    with torch.no_grad():
        out = module.policy(ids, mask, P, TEMPERATURE, want_entropy=True)
        ref = module.policy.reference_logprobs(ids, mask, P, TEMPERATURE)
        weights = {"actor": _merged(base, actor), "critic": _merged(base, critic), "ref": _merged(base, None)}
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            seq = torch.tensor(prompt + response)
            positions = [len(prompt) - 1 + t for t in range(len(response))]
            actor_logits, _ = _forward(plain, weights["actor"], seq)
            _, critic_hidden = _forward(plain, weights["critic"], seq)
            ref_logits, _ = _forward(plain, weights["ref"], seq)
            for t, (pos, token) in enumerate(zip(positions, response)):
                log_dist = torch.log_softmax(actor_logits[pos] / TEMPERATURE, dim=-1)
                assert_close(out.logprobs[i, t], log_dist[token], atol=1e-5, rtol=1e-5)
                assert_close(out.entropy[i, t], -(log_dist.exp() * log_dist).sum(), atol=1e-5, rtol=1e-5)
                assert_close(out.values[i, t], head(critic_hidden[pos]).squeeze(-1), atol=1e-5, rtol=1e-5)
                ref_dist = torch.log_softmax(ref_logits[pos] / TEMPERATURE, dim=-1)
                assert_close(ref[i, t], ref_dist[token], atol=1e-5, rtol=1e-5)
        # the adapters matter, so the comparison above tells actor, critic and reference apart
        assert (out.logprobs - ref).abs().max() > 0.05
