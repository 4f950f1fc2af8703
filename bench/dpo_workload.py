"""The DPO workload: one definition that both sides read (ours in ``bench/dpo.py``, TRL's child in
``bench/dpo_trl.py``), framework-neutral (no rlhf_lit, no TRL import).

Built on the shared RM workload (``../shared/bench/workload.py``, imported unchanged): the same tiny GPT-2
base artefact and tokenizer and the same HH-RLHF pairs (``W.load_rm_pairs``: file order, chosen+EOS and
rejected+EOS <= 256 tokens). A DPO pair needs a prompt: it is the transcript up to and including its last
``"\\n\\nAssistant:"`` when chosen and rejected share it (pairs that do not are skipped, in file order), the
responses the rest. The ids are made the way TRL's ``DPOTrainer`` makes them (prompt, prompt+response+EOS,
the response starting where the two diverge), so both sides train on the same tokens; TRL's child asserts it.
"""

from __future__ import annotations

from bench.common import W

LORA = dict(r=8, alpha=16, dropout=0.0, target_modules="all-linear")  # the PPO/GRPO benches' LoRA

DPO = dict(
    n_pairs=128,
    batch_size=8,  # pairs per optimizer step (one forward of 16 sequences, plus one reference forward)
    steps=16,  # one pass over the 128 pairs, in file order, unshuffled
    learning_rate=1e-4,  # the RM workload's
    lr_schedule="linear decay to 0 over the 16 steps, no warm-up",
    optimizer="AdamW betas (0.9, 0.999), eps 1e-8, weight decay 0",
    max_grad_norm=1.0,
    beta=0.1,
    loss_type="sigmoid",
    max_length=W.RM["max_length"],  # 256 tokens incl. EOS; every selected pair fits (no truncation)
    precision="fp32",
    seed=42,
    reference="the base with the LoRA adapter off (both sides); TRL's full variant: a second model copy",
    lora=LORA,
)

ASSISTANT = "\n\nAssistant:"


def split_pair(chosen: str, rejected: str) -> tuple[str, str, str] | None:
    """``(prompt, chosen_response, rejected_response)``: the prompt is the text up to and including the last
    ``ASSISTANT`` marker of ``chosen``; None when ``rejected`` does not start with that prompt."""
    cut = chosen.rfind(ASSISTANT)
    if cut < 0:
        return None
    prompt = chosen[: cut + len(ASSISTANT)]
    if not rejected.startswith(prompt) or prompt == chosen or prompt == rejected:
        return None
    return prompt, chosen[len(prompt):], rejected[len(prompt):]


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def load_dpo_pairs(tokenizer) -> list[dict]:
    """The first ``DPO["n_pairs"]`` splittable pairs of ``W.load_rm_pairs`` with text and ids: ``prompt``,
    ``chosen``, ``rejected`` (text, no EOS) and ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` (the
    responses end with EOS), tokenized as TRL 1.16's ``DPOTrainer._prepare_dataset`` does."""
    eos = tokenizer.eos_token
    out = []
    for pair in W.load_rm_pairs(tokenizer):
        split = split_pair(pair["chosen"], pair["rejected"])
        if split is None:
            continue
        prompt, chosen, rejected = split

        def ids(text: str) -> list[int]:
            return tokenizer(text)["input_ids"]

        p, pc, pr = ids(prompt), ids(prompt + chosen + eos), ids(prompt + rejected + eos)
        n = min(common_prefix_length(p, pc), common_prefix_length(p, pr))
        out.append(dict(record_index=pair["record_index"], prompt=prompt, chosen=chosen, rejected=rejected,
                        prompt_ids=p[:n], chosen_ids=pc[n:], rejected_ids=pr[n:]))
        if len(out) == DPO["n_pairs"]:
            return out
    raise RuntimeError(f"only {len(out)} splittable pairs among the RM workload's pairs")
