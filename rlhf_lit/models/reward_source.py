"""The frozen reward model PPO scores responses with: a separate model, or an adapter on the policy base.

Two modes (``RewardModelConfig.mode``):

* ``separate``: any exported reward model (a causal LM or an encoder such as MiniLM, scored on the state its
  export names: ``pooling``), or any Hugging Face ``*ForSequenceClassification`` folder with one label (a
  decoder, or an encoder such as BERT, read at the last real token).
* ``adapter``: the reward model's LoRA adapter is loaded onto the policy's own base as a fourth adapter,
  with its head; nothing else is held in memory. Valid only when the reward model was trained on that same
  base (checked against the export's record of its base).

**What the reward model is fed.** When the reward model encodes text exactly as the policy does (same
vocabulary, same chat template, same BOS/EOS; see ``same_encoding``) and is a causal LM, it scores the
policy's own ids: the prompt, then the response up to and including its stop token. Otherwise (another
tokenizer, the same vocabulary with another chat template, or an encoder, which needs right-padded rows) its
input is rebuilt, per row, the way reward training built it
(``rlhf_lit.data.tokenize.Tokenization``, the same code): from the prompt as the data gave it (its message
list, or its text; ``batch["prompt"]`` of the prompt data module) and the response decoded to text with the
policy's tokenizer (special tokens kept, the stop token left out). Chat prompts, and text prompts of a
reward model trained with ``chat_template: true`` (``input_format`` in its ``rlhf_lit.json``), are rendered
with the reward model's chat template, the response as the assistant turn (a text prompt in the HH transcript
form is split into its turns, as the data modules' ``hh`` format does); text prompts otherwise are
prompt text + response text. A reward model with no chat template (an encoder trained on HH transcripts, such
as the MiniLM recipe) gets a chat prompt back as the HH transcript text it parses from (``hh_transcript``),
and the response with the leading space HH responses have. The reward model's EOS is appended (when it was trained with ``append_eos``)
only to responses that ended with a stop token: a response cut at ``max_new_tokens`` gets neither EOS nor the
template's end-of-turn text, exactly as the same-encoding path scores it without a stop token. The prompt is
cut from the left as reward training cut it: to the recorded ``max_prompt_length`` (``input_format``; e.g. 1
for a reward model trained on responses alone, which keeps only an encoder's ``[CLS]``), and so that prompt +
response fit the recorded ``max_length`` and the model's ``model_max_length`` / position limit (a leading
BOS / ``[CLS]`` is kept). Reward training cut for the longer response of a pair; here there is one response.

Every dropout probability of the reward model is 0 in both modes (its base's, and the LoRA dropout of a reward
model trained with ``lora.dropout > 0``), so identical calls score identically in train mode too.

Scores are divided by the calibration temperature stored with the export unless ``calibrated`` is off.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase

from rlhf_lit.models.adapters import AdaptedLM
from rlhf_lit.models.backbone import BackboneConfig, load_backbone_tokenizer
from rlhf_lit.models.export import (
    HEAD_FILE,
    META_FILE,
    RewardScorer,
    load_reward_model,
    portable_base,
    read_meta,
)
from rlhf_lit.models.heads import ScalarHead, score_pooled
from rlhf_lit.models.reward_input import RewardInputBuilder, RewardInputFormat, same_encoding
from rlhf_lit.models.sharded_load import build_base
from rlhf_lit.models.tokenizer import load_tokenizer
from rlhf_lit.models.trunk import disable_dropout, fuse_gelu_tanh, hidden_size, model_is_encoder

log = logging.getLogger("rlhf_lit")


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


def untrained_scorer(backbone: BackboneConfig, deferred: bool = False) -> RewardScorer:
    """A reward model with a random head on a backbone (seeded by ``backbone.seed``): for smoke tests.
    ``deferred``: as ``load_reward_model``'s (``sharded_load.build_base``)."""
    tokenizer = load_backbone_tokenizer(backbone)
    model, files = build_base(backbone, tokenizer, deferred)
    state = torch.random.get_rng_state()
    torch.manual_seed(backbone.seed)
    try:
        head = ScalarHead(hidden_size(model))
    finally:
        torch.random.set_rng_state(state)
    pooling = "mean" if model_is_encoder(model) else "last"
    return RewardScorer(AdaptedLM(model), head, tokenizer, pooling=pooling, checkpoint_files=files).eval()


class RewardSource(torch.nn.Module):
    """Scores (prompt, response) batches for PPO, in either mode (see the module docstring for the input).

    Args:
        cfg: the reward-model config.
        policy_tokenizer: the policy's tokenizer.
        policy_lm: the policy's ``AdaptedLM`` (``adapter`` mode loads the reward adapter onto it).
        policy_base: the policy's backbone config (``adapter`` mode checks the reward model's base).
        deferred: FSDP2: a separate reward model that can be read shard by shard is built on meta, its files in
            ``scorer.checkpoint_files`` (``load_reward_model``, ``untrained_scorer``).

    Attributes:
        same_tokenizer: the reward model encodes text as the policy does (``same_encoding``), so the policy's
            ids are scored as they are (unless a prompt needs a chat rendering the policy did not apply).
        input_builder: rebuilds the reward model's input from text (``RewardInputBuilder``).

    Raises:
        ValueError: ``adapter`` mode with a reward model trained on another base, or without an adapter.
    """

    def __init__(
        self,
        cfg: RewardModelConfig,
        policy_tokenizer: PreTrainedTokenizerBase,
        policy_lm: AdaptedLM | None = None,
        policy_base: BackboneConfig | None = None,
        deferred: bool = False,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.policy_tokenizer = policy_tokenizer
        self.scorer: RewardScorer | None = None
        self._policy_lm = [policy_lm]  # a list, so the shared base is not registered twice as a submodule
        meta = read_meta(cfg.path) if cfg.path and os.path.exists(os.path.join(cfg.path, META_FILE)) else None
        if cfg.mode == "adapter":
            meta = read_meta(cfg.path)
            _check_same_base(cfg.path, meta, policy_base)
            if not meta.get("has_adapter"):
                raise ValueError(f"{cfg.path!r} has no LoRA adapter; use reward_model.mode: separate")
            # loaded frozen, its LoRA dropout set to 0 (AdaptedLM.add_saved_adapter)
            policy_lm.add_saved_adapter(os.path.join(cfg.path, "adapter"), "reward")
            self.head = ScalarHead(hidden_size(policy_lm.model))
            self.head.linear.load_state_dict(load_file(os.path.join(cfg.path, HEAD_FILE)))
            self.head.requires_grad_(False)
            self.pooling = meta.get("pooling", "last")
            self.register_buffer("temperature", torch.tensor(float(meta.get("temperature", 1.0))))
            self.tokenizer = policy_tokenizer
        else:
            if cfg.backbone is not None:
                self.scorer = untrained_scorer(cfg.backbone, deferred)
            elif meta is not None:
                self.scorer = load_reward_model(cfg.path, cfg.dtype, cfg.load_in_4bit, deferred)
            else:
                self.scorer = load_sequence_classifier(cfg.path)
            self.tokenizer = self.scorer.tokenizer
            # Every dropout p is 0 in a RewardScorer, so train and eval mode compute the same numbers; train
            # mode keeps the whole module in one mode under Lightning.
            self.scorer.train()
        self.same_tokenizer = same_encoding(self.tokenizer, policy_tokenizer)
        # an encoder reads positions from the first column: its rows are always rebuilt, right padded
        self.is_encoder = self.scorer is not None and model_is_encoder(self.scorer.lm.model)
        self.input_builder = RewardInputBuilder(
            self.tokenizer, RewardInputFormat.from_meta(meta), _max_positions(self.scorer or policy_lm)
        )
        self._warned_no_prompts = False
        self._turn_end: str | None = None

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
        has_stop: torch.Tensor | None = None,
        prompts: list[Any] | None = None,
        fields: list[dict] | None = None,
    ) -> torch.Tensor:
        """Reward-model scores of ``(B, P)`` left-padded prompts and ``(B, R)`` right-padded responses.

        Args:
            prompt_ids: ``(B, P)`` the policy's prompt ids, left padded.
            prompt_mask: ``(B, P)``, 1 = real token.
            response_ids: ``(B, R)`` the sampled responses, right padded.
            response_mask: ``(B, R)``, True up to and including the first stop token.
            has_stop: ``(B,)`` bool, the response ended with a stop token (``sample_responses``); default:
                its last real token is the policy's EOS.
            prompts: the B prompts as the data gave them (strings or message lists; ``batch["prompt"]``),
                needed when the input is rebuilt; default: the prompt ids decoded with special tokens kept,
                scored as text.
            fields: the prompt rows' fields (``rollout.RewardFunction``); a reward model does not read them.

        Returns:
            ``(B,)`` float32 scores (divided by the calibration temperature when ``calibrated``).
        """
        if has_stop is None:
            has_stop = self._ends_with_eos(response_ids, response_mask)
        # a text prompt the policy saw as text, for a reward model trained on chat renderings of text prompts
        text_for_chat = self.input_builder.input_format.chat_template and any(
            isinstance(p, str) for p in prompts or []
        )
        rebuild = not self.same_tokenizer or text_for_chat or self.is_encoder
        if rebuild:
            ids, mask = self._reencode(
                prompt_ids, prompt_mask, response_ids, response_mask, has_stop, prompts
            )
        else:
            ids = torch.cat([prompt_ids, response_ids], dim=1)
            mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
        if self.scorer is not None:
            raw = self.scorer.score(ids, mask, calibrated=False)
        else:
            lm = self._policy_lm[0]
            with lm.adapter("reward"):
                raw = score_pooled(self.head, lm.hidden_states(ids, mask), mask, self.pooling)
        return raw / self.temperature_value

    def _ends_with_eos(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        eos = self.policy_tokenizer.eos_token_id
        mask = response_mask.bool()
        last = (mask.long().cumsum(-1) * mask).argmax(-1)
        tokens = response_ids.gather(1, last[:, None]).squeeze(1)
        return mask.any(-1) & (tokens == eos) if eos is not None else torch.zeros_like(mask[:, 0])

    def response_texts(
        self, response_ids: torch.Tensor, response_mask: torch.Tensor, has_stop: torch.Tensor
    ) -> list[str]:
        """The responses as text (policy tokenizer, special tokens kept, the stop token left out)."""
        texts = []
        for ids, mask, stopped in zip(response_ids, response_mask.bool(), has_stop.bool().tolist()):
            real = ids[mask].tolist()
            texts.append(self._decode(real[:-1] if stopped and real else real))
        return texts

    def _without_turn_end(self, response: str) -> tuple[str, bool]:
        """A chat response without the policy's own end-of-turn text (e.g. ChatML's ``<|im_end|>``), which
        the reward model's template writes itself; and whether the policy had closed its turn."""
        if self._turn_end is None:
            self._turn_end = ""
            template = getattr(self.policy_tokenizer, "chat_template", None)
            if template:
                marker = "\u2063rlhf_lit\u2063"
                messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
                text = self.policy_tokenizer.apply_chat_template(messages, tokenize=False)
                self._turn_end = text[text.rindex(marker) + len(marker) :].strip()
        end = self._turn_end
        stripped = response.rstrip()
        if end and stripped.endswith(end):
            return stripped[: -len(end)], True
        return response, False

    def _decode(self, ids: list[int]) -> str:
        return self.policy_tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def _prompt_texts(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[str]:
        if not self._warned_no_prompts:
            log.warning(
                "reward model: no prompt records given (batch['prompt']), so its input is rebuilt from the "
                "policy's decoded prompt ids, scored as plain text (a chat prompt keeps the policy's "
                "template)"
            )
            self._warned_no_prompts = True
        bos = self.policy_tokenizer.bos_token_id
        texts = []
        for ids, mask in zip(prompt_ids, prompt_mask.bool()):
            real = ids[mask].tolist()
            texts.append(self._decode(real[1:] if real and bos is not None and real[0] == bos else real))
        return texts

    def _reencode(self, prompt_ids, prompt_mask, response_ids, response_mask, has_stop, prompts):
        """The reward model's ``(B, T')`` ids and mask (right padded) for each (prompt, response) row."""
        if prompts is not None and len(prompts) != prompt_ids.shape[0]:
            raise ValueError(f"reward model: {len(prompts)} prompts for {prompt_ids.shape[0]} responses")
        if prompts is None or any(p is None for p in prompts):
            decoded = self._prompt_texts(prompt_ids, prompt_mask)
            prompts = (
                decoded if prompts is None else [d if p is None else p for p, d in zip(prompts, decoded)]
            )
        responses = self.response_texts(response_ids, response_mask, has_stop)
        rows = []
        for prompt, response, stopped in zip(prompts, responses, has_stop.tolist()):
            if self.input_builder.renders_chat(prompt):
                response, closed = self._without_turn_end(response)
                stopped = stopped or closed
            rows.append(self.input_builder.encode(prompt, response, bool(stopped)))
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        device = prompt_ids.device
        return ids.to(device), mask.to(device)


def _max_positions(module: torch.nn.Module) -> int | None:
    lm = module.lm if isinstance(module, RewardScorer) else module
    config = getattr(lm.model, "config", None)
    value = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(value) if value else None


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
