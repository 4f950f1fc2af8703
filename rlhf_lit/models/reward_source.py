"""The frozen reward model PPO scores responses with: a separate model, or an adapter on the policy base.

Two modes (``RewardModelConfig.mode``):

* ``separate``: any exported reward model, or any Hugging Face ``*ForSequenceClassification`` folder with
  one label. When its tokenizer differs from the policy's, prompt and response are decoded to text and
  re-encoded with the reward model's tokenizer (its EOS appended, as in reward training).
* ``adapter``: the reward model's LoRA adapter is loaded onto the policy's own base as a fourth adapter,
  with its head; nothing else is held in memory. Valid only when the reward model was trained on that same
  base (checked against the export's record of its base).

Scores are divided by the calibration temperature stored with the export unless ``calibrated`` is off.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Literal

import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase

from rlhf_lit.models.adapters import AdaptedLM
from rlhf_lit.models.backbone import (
    BackboneConfig,
    disable_dropout,
    fuse_gelu_tanh,
    hidden_size,
    load_backbone,
    load_backbone_tokenizer,
)
from rlhf_lit.models.export import (
    HEAD_FILE,
    META_FILE,
    RewardScorer,
    load_reward_model,
    portable_base,
    read_meta,
)
from rlhf_lit.models.heads import ScalarHead, score_last_token
from rlhf_lit.models.tokenizer import load_tokenizer


@dataclass
class RewardModelConfig:
    """Which reward model scores PPO's responses.

    Args:
        path: a folder exported by the reward stage (``RewardModule.export_dir``), or a Hugging Face
            ``*ForSequenceClassification`` folder (``separate`` mode only).
        backbone: instead of ``path``, an untrained reward model built from this backbone config with a
            randomly initialised head (``seed``): smoke tests and benchmarks only.
        mode: ``separate`` (its own backbone) or ``adapter`` (its adapter on the policy's base).
        calibrated: divide scores by the calibration temperature saved with the reward model.
        dtype: backbone dtype override for ``separate`` mode (e.g. ``bfloat16`` on a GPU).
        load_in_4bit: hold a ``separate`` reward model's base in 4-bit NF4.
    """

    path: str | None = None
    backbone: BackboneConfig | None = None
    mode: Literal["separate", "adapter"] = "separate"
    calibrated: bool = True
    dtype: str | None = None
    load_in_4bit: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.backbone, dict):
            self.backbone = BackboneConfig(**self.backbone)
        if (self.path is None) == (self.backbone is None):
            raise ValueError(
                "reward_model: give exactly one of 'path' (a trained reward model) and 'backbone'"
            )
        if self.backbone is not None and self.mode != "separate":
            raise ValueError("reward_model.backbone builds a separate model; use mode: separate")


def load_sequence_classifier(path: str) -> RewardScorer:
    """A Hugging Face ``*ForSequenceClassification`` (1 label) as a scorer read at the last real token."""
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    disable_dropout(model)
    fuse_gelu_tanh(model)
    score = getattr(model, "score", None) or getattr(model, "classifier", None)
    if not isinstance(score, torch.nn.Linear) or score.out_features != 1:
        raise ValueError(
            f"{path!r}: expected a linear 'score' head with one output, found {type(score).__name__}"
        )
    head = ScalarHead(score.in_features)
    with torch.no_grad():
        head.linear.weight.copy_(score.weight.float())
        if score.bias is not None:
            head.linear.bias.copy_(score.bias.float())
    model.score = torch.nn.Identity()
    return RewardScorer(AdaptedLM(model), head, load_tokenizer(path)).eval()


def untrained_scorer(backbone: BackboneConfig) -> RewardScorer:
    """A reward model with a random head on a backbone (seeded by ``backbone.seed``): for smoke tests."""
    tokenizer = load_backbone_tokenizer(backbone)
    model = load_backbone(backbone, tokenizer)
    state = torch.random.get_rng_state()
    torch.manual_seed(backbone.seed)
    try:
        head = ScalarHead(hidden_size(model))
    finally:
        torch.random.set_rng_state(state)
    return RewardScorer(AdaptedLM(model), head, tokenizer).eval()


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    return a is b or (len(a) == len(b) and a.get_vocab() == b.get_vocab())


class RewardSource(torch.nn.Module):
    """Scores (prompt, response) batches for PPO, in either mode.

    Args:
        cfg: the reward-model config.
        policy_tokenizer: the policy's tokenizer.
        policy_lm: the policy's ``AdaptedLM`` (``adapter`` mode loads the reward adapter onto it).
        policy_base: the policy's backbone config (``adapter`` mode checks the reward model's base).

    Raises:
        ValueError: ``adapter`` mode with a reward model trained on another base, or without an adapter.
    """

    def __init__(
        self,
        cfg: RewardModelConfig,
        policy_tokenizer: PreTrainedTokenizerBase,
        policy_lm: AdaptedLM | None = None,
        policy_base: BackboneConfig | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.policy_tokenizer = policy_tokenizer
        self.scorer: RewardScorer | None = None
        self._policy_lm = [policy_lm]  # a list, so the shared base is not registered twice as a submodule
        if cfg.mode == "adapter":
            meta = read_meta(cfg.path)
            _check_same_base(cfg.path, meta, policy_base)
            if not meta.get("has_adapter"):
                raise ValueError(f"{cfg.path!r} has no LoRA adapter; use reward_model.mode: separate")
            policy_lm.add_saved_adapter(os.path.join(cfg.path, "adapter"), "reward")
            self.head = ScalarHead(hidden_size(policy_lm.model))
            self.head.linear.load_state_dict(load_file(os.path.join(cfg.path, HEAD_FILE)))
            self.head.requires_grad_(False)
            self.register_buffer("temperature", torch.tensor(float(meta.get("temperature", 1.0))))
            self.tokenizer = policy_tokenizer
        else:
            if cfg.backbone is not None:
                self.scorer = untrained_scorer(cfg.backbone)
            elif os.path.exists(os.path.join(cfg.path, META_FILE)):
                self.scorer = load_reward_model(cfg.path, dtype=cfg.dtype, load_in_4bit=cfg.load_in_4bit)
            else:
                self.scorer = load_sequence_classifier(cfg.path)
            self.tokenizer = self.scorer.tokenizer
            # Dropout is 0 in every reward backbone, so train and eval mode compute the same numbers; train
            # mode keeps the whole module in one mode under Lightning.
            self.scorer.train()
        self.same_tokenizer = same_vocabulary(self.tokenizer, policy_tokenizer)

    @property
    def temperature_value(self) -> float:
        t = self.temperature if self.scorer is None else self.scorer.temperature
        return float(t) if self.cfg.calibrated else 1.0

    @torch.no_grad()
    def score(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Reward-model scores of ``(B, P)`` left-padded prompts and ``(B, R)`` right-padded responses.

        Returns:
            ``(B,)`` float32 scores (divided by the calibration temperature when ``calibrated``).
        """
        if self.same_tokenizer:
            ids = torch.cat([prompt_ids, response_ids], dim=1)
            mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
        else:
            ids, mask = self._reencode(prompt_ids, prompt_mask, response_ids, response_mask)
        if self.scorer is not None:
            raw = self.scorer.score(ids, mask, calibrated=False)
        else:
            lm = self._policy_lm[0]
            with lm.adapter("reward"):
                raw = score_last_token(self.head, lm.hidden_states(ids, mask), mask)
        return raw / self.temperature_value

    def _reencode(self, prompt_ids, prompt_mask, response_ids, response_mask):
        """Decode with the policy tokenizer, encode with the reward model's (its EOS appended)."""
        src, dst = self.policy_tokenizer, self.tokenizer
        rows = []
        for p_ids, p_mask, r_ids, r_mask in zip(
            prompt_ids, prompt_mask.bool(), response_ids, response_mask.bool()
        ):
            prompt = src.decode(p_ids[p_mask].tolist(), skip_special_tokens=True)
            response = src.decode(r_ids[r_mask].tolist(), skip_special_tokens=True)
            encoded = (
                dst(prompt, add_special_tokens=True)["input_ids"]
                + dst(response, add_special_tokens=False)["input_ids"]
            )
            if dst.eos_token_id is not None:
                encoded.append(dst.eos_token_id)
            rows.append(encoded[-(dst.model_max_length if dst.model_max_length < 10**6 else len(encoded)) :])
        width = max(len(r) for r in rows)
        pad = dst.pad_token_id if dst.pad_token_id is not None else 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        device = prompt_ids.device
        return ids.to(device), mask.to(device)


def _check_same_base(path: str, meta: dict, policy_base: BackboneConfig | None) -> None:
    if policy_base is None:
        raise ValueError("reward_model.mode=adapter needs the policy's backbone config")
    rm_base = meta.get("base", {})
    keys = ("name_or_path", "gguf_file", "tiny", "seed")
    mine = {k: v for k, v in portable_base(policy_base).items() if k in keys}  # local paths made absolute
    theirs = {k: rm_base.get(k) for k in keys}
    if mine["tiny"] is None:
        mine.pop("seed"), theirs.pop("seed")
    if json.dumps(mine, sort_keys=True, default=str) != json.dumps(theirs, sort_keys=True, default=str):
        raise ValueError(
            f"reward_model.mode=adapter: the reward model in {path!r} was trained on base {theirs}, "
            f"but the policy's base is {mine}; train the reward model on the policy's base or use mode: separate"
        )
