"""Evaluation of the demo's exports on held-out prompts: policies (gold score, RM score, KL to the
reference) and the reward model (accuracy against the noisy labels and the gold scorer).

Prompts are left-padded with ``data.collate.pad_sequences`` and the response log-probs read with
``functional.sequence.response_positions`` / ``gather_logprobs``, as in training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_lit.data.collate import pad_sequences
from rlhf_lit.data.demo_task import gold_score, label_noise_rate, preference_rows
from rlhf_lit.functional.sequence import gather_logprobs, position_ids_from_mask, response_positions
from rlhf_lit.models.export import load_reward_model
from rlhf_lit.models.tokenizer import load_tokenizer
from rlhf_lit.rl.generation import SamplingConfig, resolve_stop_ids, sample_responses

__all__ = ["PolicyEval", "evaluate_policy", "reward_model_accuracy"]


@dataclass
class PolicyEval:
    gold: list[float]
    rm: list[float]
    kl: list[float]
    responses: list[str]


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pad_sequences(rows, pad_id, max(len(r) for r in rows), left=True)


@torch.no_grad()
def _response_logprob_sums(
    model, ids, mask, prompt_len, response_ids, response_mask, temperature
) -> torch.Tensor:
    """``(B,)`` sums of the response tokens' log-probs under ``model`` at the sampling temperature."""
    full = torch.cat([ids, response_ids], 1)
    full_mask = torch.cat([mask, response_mask.long()], 1)
    logits = model(
        input_ids=full, attention_mask=full_mask, position_ids=position_ids_from_mask(full_mask)
    ).logits
    logprobs = gather_logprobs(response_positions(logits, prompt_len), response_ids, temperature)
    return (logprobs * response_mask).sum(-1)


@torch.no_grad()
def evaluate_policy(
    policy_dir: str,
    reference_dir: str,
    reward_dir: str | None,
    prompts: list[str],
    sampling: SamplingConfig,
    seed: int = 0,
    batch_size: int = 64,
) -> PolicyEval:
    """Sample one response per prompt from an exported policy; score it with gold, the RM and KL.

    ``reward_dir`` None (a method without a reward model, e.g. DPO): no RM scores (``PolicyEval.rm`` empty).
    KL is the sampled estimate of KL(policy || reference) per response, in nats (sum over its tokens of
    ``log pi(y_t) - log pi_ref(y_t)`` at the sampling temperature).
    """
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    reference = (
        AutoModelForCausalLM.from_pretrained(reference_dir).eval() if reference_dir != policy_dir else None
    )
    scorer = load_reward_model(reward_dir) if reward_dir is not None else None
    stop_ids = resolve_stop_ids(sampling, tokenizer)
    out = PolicyEval([], [], [], [])
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for start in range(0, len(prompts), batch_size):
            texts = prompts[start : start + batch_size]
            ids, mask = _left_pad(
                [tokenizer.encode(t, add_special_tokens=False) for t in texts], tokenizer.pad_token_id
            )
            response_ids, response_mask, _ = sample_responses(
                policy, ids, mask, sampling, stop_ids, tokenizer.pad_token_id
            )
            responses = [
                tokenizer.decode(r[m], skip_special_tokens=True) for r, m in zip(response_ids, response_mask)
            ]
            out.responses += responses
            out.gold += [gold_score(p, r) for p, r in zip(texts, responses)]
            full = torch.cat([ids, response_ids], 1)
            if scorer is not None:
                out.rm += scorer.score(full, torch.cat([mask, response_mask.long()], 1)).tolist()
            if reference is None:
                out.kl += [0.0] * len(texts)
            else:
                P = ids.shape[1]
                lp = _response_logprob_sums(
                    policy, ids, mask, P, response_ids, response_mask, sampling.temperature
                )
                ref = _response_logprob_sums(
                    reference, ids, mask, P, response_ids, response_mask, sampling.temperature
                )
                out.kl += (lp - ref).tolist()
    finally:
        torch.random.set_rng_state(state)
    return out


@torch.no_grad()
def reward_model_accuracy(reward_dir: str, n: int = 512, seed: int = 0) -> dict:
    """RM accuracy on held-out demo pairs, against the noisy labels and against the gold scorer."""
    scorer = load_reward_model(reward_dir)
    tok = scorer.tokenizer
    rows = preference_rows(n, seed=seed, split="val")

    def scores(texts: list[tuple[str, str]]) -> torch.Tensor:
        seqs = [
            tok.encode(p, add_special_tokens=False)
            + tok.encode(r, add_special_tokens=False)
            + [tok.eos_token_id]
            for p, r in texts
        ]
        ids, mask = _left_pad(seqs, tok.pad_token_id)
        return scorer.score(ids, mask, calibrated=False)

    chosen = scores([(r["prompt"], r["chosen"]) for r in rows])
    rejected = scores([(r["prompt"], r["rejected"]) for r in rows])
    margin = chosen - rejected
    gold_margin = torch.tensor([r["gold_chosen"] - r["gold_rejected"] for r in rows])
    decided = gold_margin != 0
    return {
        "pairs": n,
        "accuracy_noisy_labels": float((margin > 0).float().mean()),
        "accuracy_gold": float(((margin > 0) == (gold_margin > 0))[decided].float().mean()),
        "gold_decided_pairs": int(decided.sum()),
        "label_noise_rate": label_noise_rate(rows),
    }
