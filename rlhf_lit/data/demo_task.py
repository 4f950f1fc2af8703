"""The embedded demo task: echo a word, with a hidden gold scorer.

A prompt is a random lowercase word w (3-6 letters) written as ``"w="``; the ideal response is ``"w."``:
the word again, then a full stop (the response's EOS is added by the data modules). The gold scorer grades
responses, not just right/wrong:

    gold(w, y) = content + format,   content = 1.0 if the echoed word equals w,
                                      else 2 * (fraction of w's letters matched in place) - 1   (in [-1, 1))
                                     format  = -0.5 without the final ".", -0.25 per extra word,
                                               and -0.05 per character beyond len(w) + 1

so the best response scores 1.0 and a garbled, chatty one about -1.5.

SFT demonstrations are of mixed quality, the way human demonstrations are: a perfect echo, a missing full
stop, a typo (one letter changed), or a chatty echo ("ok w." / "w w."). SFT alone therefore learns that
mixture and does not max out the gold score. Preference pairs compare two responses to one prompt and are
labelled the way humans label: a Bradley-Terry choice with noise,
``P(a preferred) = sigmoid(beta * (gold_a - gold_b))``, so some labels disagree with the gold scorer.

Everything is generated from a seed; nothing is read from disk. The gold scorer is for evaluation only:
no reward model or PPO code path calls it.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Iterator

STYLES = ("perfect", "no_period", "typo", "chatty")
DEFAULT_STYLE_WEIGHTS = (0.35, 0.25, 0.2, 0.2)
SPLIT_OFFSETS = {"train": 0, "val": 1, "test": 2}
DEMO_BETA = 4.0


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))


def make_prompt(word: str) -> str:
    return f"{word}="


def parse_prompt(prompt: str) -> str:
    """The word a prompt asks to echo (text before the last ``=``)."""
    return prompt.rsplit("=", 1)[0].strip()


def make_response(word: str, style: str, rng: random.Random) -> str:
    """A response in one of the demonstration styles."""
    if style == "perfect":
        return f"{word}."
    if style == "no_period":
        return word
    if style == "typo":
        i = rng.randrange(len(word))
        letter = rng.choice([c for c in string.ascii_lowercase if c != word[i]])
        return f"{word[:i]}{letter}{word[i + 1 :]}."
    if style == "chatty":
        return rng.choice([f"ok {word}.", f"{word} {word}.", f"so {word}."])
    raise ValueError(f"unknown style {style!r}; expected one of {STYLES}")


def gold_score(prompt: str, response: str) -> float:
    """The hidden gold score of a response (see the module docstring); higher is better, at most 1.0."""
    word = parse_prompt(prompt)
    text = response.strip()
    has_period = text.endswith(".")
    words = text.rstrip(".").split()
    echoed = words[-1] if words else ""
    if echoed == word:
        content = 1.0
    else:
        matched = sum(a == b for a, b in zip(echoed, word))
        content = 2.0 * matched / max(len(word), 1) - 1.0
    format_penalty = (0.0 if has_period else 0.5) + 0.25 * max(len(words) - 1, 0)
    format_penalty += 0.05 * max(len(text) - (len(word) + 1), 0)
    return content - format_penalty


def _rng(seed: int, split: str, stream: str) -> random.Random:
    return random.Random(f"{seed}/{split}/{stream}")


def _words(n: int, seed: int, split: str) -> Iterator[str]:
    """Words of a split; train, val and test words never overlap (a word's split is a hash of the word)."""
    rng = _rng(seed, split, "words")
    offset = SPLIT_OFFSETS[split]
    made = 0
    while made < n:
        word = _word(rng)
        if sum(map(ord, word)) % 3 == offset:
            made += 1
            yield word


def sft_rows(n: int, seed: int = 0, split: str = "train", style_weights=DEFAULT_STYLE_WEIGHTS) -> list[dict]:
    """``n`` demonstrations ``{"prompt", "response", "style"}`` of mixed quality."""
    rng = _rng(seed, split, "sft")
    return [
        {"prompt": make_prompt(w), "response": make_response(w, s, rng), "style": s}
        for w in _words(n, seed, split)
        for s in [rng.choices(STYLES, weights=style_weights)[0]]
    ]


def preference_rows(n: int, seed: int = 0, split: str = "train", beta: float = DEMO_BETA) -> list[dict]:
    """``n`` noisy-labelled pairs ``{"prompt", "chosen", "rejected", "gold_chosen", "gold_rejected",
    "label_agrees_with_gold"}``; two different styles per prompt, chosen by a Bradley-Terry draw."""
    rng = _rng(seed, split, "pairs")
    rows = []
    for word in _words(n, seed, split):
        prompt = make_prompt(word)
        style_a, style_b = rng.sample(STYLES, 2)
        a, b = make_response(word, style_a, rng), make_response(word, style_b, rng)
        gold_a, gold_b = gold_score(prompt, a), gold_score(prompt, b)
        a_wins = rng.random() < 1.0 / (1.0 + math.exp(-beta * (gold_a - gold_b)))
        chosen, rejected = (a, b) if a_wins else (b, a)
        gold_c, gold_r = (gold_a, gold_b) if a_wins else (gold_b, gold_a)
        rows.append(
            {
                "prompt": prompt,
                "chosen": chosen,
                "rejected": rejected,
                "gold_chosen": gold_c,
                "gold_rejected": gold_r,
                "label_agrees_with_gold": gold_c > gold_r,
            }
        )
    return rows


def unpaired_rows(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """The ``n`` pairs of ``preference_rows`` as ``2 n`` unpaired (KTO-style) rows ``{"prompt", "completion",
    "label"}``: the chosen response labelled desirable (True), the rejected one undesirable (False)."""
    return [
        {"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
        for r in preference_rows(n, seed, split)
        for side in ("chosen", "rejected")
    ]


def prompt_rows(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` prompts ``{"prompt", "reference"}`` (the reference is the ideal response)."""
    return [{"prompt": make_prompt(w), "reference": f"{w}."} for w in _words(n, seed, split)]


def label_noise_rate(rows: list[dict]) -> float:
    """Fraction of pairs whose label disagrees with the gold scorer (ties in gold count as disagreeing)."""
    return sum(not r["label_agrees_with_gold"] for r in rows) / max(len(rows), 1)


GENERATORS = {
    "sft": sft_rows,
    "preference": preference_rows,
    "unpaired": unpaired_rows,
    "prompts": prompt_rows,
}


def load_source(name: str, split: str):
    """The ``load_rows`` source of the ``demo`` scheme: ``demo:<kind>?n=..&seed=..&split=..`` -> a
    ``datasets.Dataset`` of the task's rows (the split is in the spec; ``split`` is ignored)."""
    import datasets

    return datasets.Dataset.from_list(rows_from_spec(f"demo:{name}"))


def rows_from_spec(spec: str) -> list[dict]:
    """Rows for a ``demo:<kind>?n=<n>&seed=<seed>&split=<split>`` spec (used by ``load_rows``).

    Raises:
        ValueError: unknown kind or malformed spec.
    """
    body = spec[len("demo:") :]
    kind, _, query = body.partition("?")
    if kind not in GENERATORS:
        raise ValueError(f"{spec!r}: unknown demo data kind {kind!r}; expected one of {sorted(GENERATORS)}")
    params = {"n": "1000", "seed": "0", "split": "train"}
    for item in filter(None, query.split("&")):
        key, sep, value = item.partition("=")
        if not sep or key not in params:
            raise ValueError(f"{spec!r}: bad parameter {item!r}; expected n=, seed=, split=")
        params[key] = value
    if params["split"] not in SPLIT_OFFSETS:
        raise ValueError(f"{spec!r}: split must be one of {sorted(SPLIT_OFFSETS)}")
    return GENERATORS[kind](int(params["n"]), seed=int(params["seed"]), split=params["split"])
