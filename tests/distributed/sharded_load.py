"""The sharded-loading scenarios (``worker.py fsdp2 <out> sharded_sft`` / ``sharded_dpo``): one optimizer step
under FSDP2 on a saved tiny Llama. ``sharded_sft``, three times: SFT with the base loaded whole on every rank,
then sharded (``load_backbone`` in ``__init__``), SFT built on the meta device
(``trainer.init_module(empty_init=True)``: each rank reads only its rows of every weight;
``rlhf_lit.models.sharded_load``), and a reward model built on the meta device. ``sharded_dpo``: the
preference stage built on the meta device (``DPO_KINDS``).

What is measured on each rank, ``peak_param_bytes``: the largest of

* the peak of the tensors created during the module's ``__init__`` and during ``configure_model`` (FSDP2
  applied, shards allocated and filled), and still alive, counted by ``tests.memory_tracker
  .TensorMemoryTracker`` (every tensor an op returns, by its storage: this includes every tensor read from
  the checkpoint with safetensors, whose ``get_slice`` rows are a view of the whole tensor's storage, so a
  read counts as one whole tensor);
* the bytes of the real (non-meta) storages behind the module's parameters right after ``__init__`` (how a
  model loaded whole by ``from_pretrained`` is seen: transformers' loader creates its tensors below the
  dispatcher, where the tracker does not see them) and right after ``configure_model``;
* the same during the training step, before and after every transformer block's forward: the local shards
  of every parameter (recorded after ``configure_model``; FSDP2 keeps them while a unit is gathered) plus
  the gathered, unsharded parameters registered at that moment (the block's, the ``lm`` unit's, and any
  block FSDP2 prefetched). The backward pass gathers the same units one at a time again.

Parameters are all the module's: the LM's and, for the reward model, its head's (the preference stage's
reference copy, its blocks hooked too). Not counted: gradients, optimizer state and activations (they are not
parameters).

Every preference kind, and PPO and GRPO built on meta, also export at the end of fit (``export_dir``); around
that export every rank records
``export_held``: the largest, after any op dispatched during the export, of the bytes of the storages created
during it and still alive (at their size then: FSDP2 frees a gathered parameter by resizing its storage to 0)
plus the storages of the gathered (non-DTensor) parameters registered at that moment (:class:`HeldBytes`). The
rank's shards (``shard_bytes``) come on top. Not counted: the byte string safetensors builds for each file
on rank 0 (not a tensor), and a unit's gathered storages between its all-gather and their registration (the
all-gather buffer holding the same bytes is counted then). After it, a weight of rank 1's shard of the last
block is set to inf and the export run again inside an export transaction (``nonfinite_export``).
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.distributed import scenarios as S
from tests.memory_tracker import TensorMemoryTracker, storage_bytes

ROWS, WIDTH, PER_RANK = 4, 12, 2
# A Llama-shaped base of ~6 MB float32 (6 blocks of ~1 MB, tied 260 x 128 embeddings): large enough that
# one rank's shards plus two gathered blocks stay below the whole base.
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


def save_base(folder: Path) -> int:
    """Save the tiny Llama (seed 0) as a Hugging Face folder; returns its parameter bytes."""
    from rlhf_lit.models.backbone import BackboneConfig
    from rlhf_lit.models.model_files import build_tiny
    from rlhf_lit.models.tokenizer import load_tokenizer

    model = build_tiny(BackboneConfig(tiny=TINY_LLAMA), load_tokenizer("byte"))
    model.save_pretrained(folder)
    return storage_bytes(model.parameters())


def sft_rows() -> list[dict[str, torch.Tensor]]:
    """4 rows of 12 tokens: a 4-token prompt (label -100), a response, right padding on two rows."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i in range(ROWS):
        ids = torch.randint(3, 250, (WIDTH,), generator=gen)
        length = WIDTH - 3 * (i % 2)
        mask = (torch.arange(WIDTH) < length).long()
        labels = ids.masked_fill(mask == 0, -100)
        labels[:4] = -100
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def backbone(base: Path):
    from rlhf_lit.models.backbone import BackboneConfig

    return BackboneConfig(name_or_path=str(base), tokenizer="byte")


def param_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """``(sharded, plain)``: bytes of the real storages of the module's DTensor parameters (local shards) and of
    its other parameters (whole tensors: unsharded, or gathered by FSDP2 right now)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in module.parameters() if not p.is_meta]
    shards = [p.to_local() for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return storage_bytes(shards), storage_bytes(plain)


class HeldBytes(TorchDispatchMode):
    """``peak``: the largest, after each op, of the bytes of the storages the ops created inside the context and
    still alive (at their current size) and of the storages of ``module``'s non-DTensor parameters registered then
    (gathered by FSDP2), each storage once. Storages of ``ignore`` (the shards, the buffers) are not counted."""

    def __init__(self, module: torch.nn.Module, ignore=()) -> None:
        super().__init__()
        self.module = module
        self.peak = 0
        self._known = {t.untyped_storage()._cdata for t in ignore}
        self._created: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                t = t.to_local() if isinstance(t, DTensor) else t
                if t.device.type != "meta":
                    st = t.untyped_storage()
                    ref = self._created.get(st._cdata)
                    if st._cdata not in self._known and (ref is None or ref() is not st):
                        self._created[st._cdata] = weakref.ref(st)
        held = {}
        for key, ref in list(self._created.items()):
            st = ref()
            if st is None:
                del self._created[key]
            else:
                held[key] = st.nbytes()
        for p in self.module.parameters():
            if not isinstance(p, DTensor) and not p.is_meta:
                held[p.untyped_storage()._cdata] = p.untyped_storage().nbytes()
        self.peak = max(self.peak, sum(held.values()))
        return out


def local_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The module's parameters (their local shards for DTensors) and buffers."""
    from torch.distributed.tensor import DTensor

    params = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
    return [t for t in [*params, *module.buffers()] if not t.is_meta]


def sample_around_blocks(blocks, measure, samples: dict) -> None:
    """Record ``measure()`` (parameter bytes) before and after each block's forwards, the largest per block, in
    ``samples`` (``block<i>_pre`` / ``block<i>_post``)."""

    def sample(name: str) -> None:
        samples[name] = max(samples.get(name, 0), measure())

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda *_, i=i: sample(f"block{i}_pre"))
        block.register_forward_hook(lambda *_, i=i: sample(f"block{i}_post"))


def probe_result(module, trainer) -> dict:
    """What every probed run reports: its parameter-byte samples, their peak, its shard bytes, the world size."""
    samples = dict(module.samples)
    return {
        "samples": samples,
        "peak_param_bytes": max(samples.values()),
        "shard_bytes": module.shard_bytes,
        "world_size": trainer.world_size,
    }


class ExportProbe:
    """Records ``export_held`` (:class:`HeldBytes`) around the first ``export`` (the one at the end of fit) of the
    stage module it is mixed into, before it in the bases; the module sets ``export_held = None``."""

    def export(self, path, *args, **kwargs):
        with HeldBytes(self, ignore=local_tensors(self)) as held:
            super().export(path, *args, **kwargs)
        if self.export_held is None:
            self.export_held = held.peak


def probed(cls):
    """``cls`` (SFTModule, RewardModule or DPOModule) sampling ``param_bytes`` of all its parameters (module
    docstring) and recording its first training loss (SFT, DPO) or pair scores (reward) on this rank, and
    (DPO) the reference fingerprint its reference cache was keyed with."""
    from rlhf_lit.parallel import transformer_blocks

    class Probed(ExportProbe, cls):
        def __init__(self, *args, **kwargs) -> None:
            with TensorMemoryTracker() as tracker:
                super().__init__(*args, **kwargs)
            self.samples = {"init": sum(param_bytes(self)), "init_tensors": tracker.peak}
            self.shard_bytes = 0
            self.first_loss = None
            self.export_held = None

        def configure_model(self) -> None:
            lms = [self.lm, getattr(self, "reference_lm", None)]  # DPOModule's reference copy
            # found by class name: before FSDP2 renames them
            blocks = [b for lm in lms if lm is not None for b in transformer_blocks(lm.model)]
            with TensorMemoryTracker(ignore=[*self.parameters(), *self.buffers()]) as tracker:
                super().configure_model()
            self.samples["configure_model_tensors"] = tracker.peak
            self.shard_bytes, plain = param_bytes(self)
            self.samples["configure_model"] = self.shard_bytes + plain
            sample_around_blocks(blocks, lambda: self.shard_bytes + param_bytes(self)[1], self.samples)

        def _loss(self, batch, *split):  # SFTModule's (batch), DPOModule's (batch, split)
            loss, units = super()._loss(batch, *split)
            if self.first_loss is None and self.training:
                ids = batch["chosen_input_ids" if "chosen_input_ids" in batch else "input_ids"]
                self.first_loss = {"loss": float(loss), "input_ids": ids.tolist()}
            return loss, units

        def on_fit_start(self) -> None:
            super().on_fit_start()
            cache = getattr(getattr(self, "reference", None), "cache", None)  # DPOModule's reference cache
            self.reference_key = None if cache is None else cache.key_parts["reference"]

        def _score_pairs(self, batch, need_hidden=False):  # RewardModule's
            chosen, rejected, hidden = super()._score_pairs(batch, need_hidden)
            if self.first_loss is None and self.training:
                self.first_loss = {
                    "chosen": chosen.tolist(),
                    "rejected": rejected.tolist(),
                    "input_ids": batch["chosen_input_ids"].tolist(),
                }
            return chosen, rejected, hidden

    return Probed


def reward_rows() -> list[dict[str, torch.Tensor]]:
    """4 pairs: ``sft_rows``' ids as chosen, the same ids reversed as rejected, right padding on two rows."""
    rows = []
    for row in sft_rows():
        mask = row["attention_mask"]
        n = int(mask.sum())
        rejected = row["input_ids"].clone()
        rejected[:n] = rejected[:n].flip(0)
        rows.append(
            {
                "chosen_input_ids": row["input_ids"],
                "chosen_attention_mask": mask,
                "rejected_input_ids": rejected,
                "rejected_attention_mask": mask,
            }
        )
    return rows


PROMPT = 4  # prompt tokens of every row of sft_rows (label -100)
# LoRA on the tiny Llama's attention: per block q_proj (A 4 x 128, B 128 x 4) and v_proj (A 4 x 128, B 64 x 4,
# 2 key-value heads of 32), float32: (512 + 512 + 512 + 256) * 6 blocks * 4 bytes = 43,008 bytes.
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
LORA_BYTES = 43_008
# The preference stage's kinds: (LoRA?, DPOModule settings). Every loss adds the chosen (KTO: desirable)
# responses' NLL (nll_coef 1): at the first step the policy IS the reference, so the preference term alone is
# ln 2 (DPO) or 0.5 (KTO) whatever the weights are, and would check nothing.
DPO_KINDS = {
    "dpo": (True, {"loss_type": "sigmoid", "nll_coef": 1.0}),  # + a reference cache (dpo_settings)
    "kto": (True, {"loss_type": "kto", "nll_coef": 1.0}),  # the reference: the adapter switched off
    "dpo_copy": (False, {"loss_type": "sigmoid", "nll_coef": 1.0, "reference_copy": True}),  # full FT
}


def dpo_settings(base: Path, kind: str, out: Path | None = None) -> dict:
    """DPOModule's arguments for ``kind`` (``DPO_KINDS``) on the saved base. With ``out`` (the 2-rank runs):
    the ``dpo`` kind keeps its reference log-probs in the cache ``<out>/ref_cache``, and every kind exports to
    ``<out>/<kind>_export`` at the end of fit; without, the reference runs every step and nothing is
    exported."""
    from rlhf_lit.models.backbone import BackboneConfig, LoraSettings

    lora, settings = DPO_KINDS[kind]
    cfg = BackboneConfig(
        name_or_path=str(base), tokenizer="byte", lora=LoraSettings(**LORA) if lora else None
    )
    if out is not None and kind == "dpo":
        settings = {**settings, "reference_cache": str(out / "ref_cache")}
    if out is not None:
        settings = {**settings, "export_dir": str(out / f"{kind}_export")}
    return {"backbone": cfg, **settings}


def pair_rows() -> list[dict[str, torch.Tensor]]:
    """4 DPO pairs: ``sft_rows``' rows as chosen; rejected: the same prompt, the chosen response reversed."""
    rows = []
    for row in sft_rows():
        mask = row["attention_mask"]
        n = int(mask.sum())
        rejected = row["input_ids"].clone()
        rejected[PROMPT:n] = rejected[PROMPT:n].flip(0)
        rows.append(
            {
                "chosen_input_ids": row["input_ids"],
                "chosen_attention_mask": mask,
                "rejected_input_ids": rejected,
                "rejected_attention_mask": mask,
                "prompt_len": torch.tensor(PROMPT),
                "chosen_response_len": torch.tensor(n - PROMPT),
                "rejected_response_len": torch.tensor(n - PROMPT),
            }
        )
    return rows


def kto_rows() -> list[dict[str, torch.Tensor]]:
    """``sft_rows`` as 4 KTO completions, labelled desirable, desirable, undesirable, undesirable (each rank's
    2 rows, 0 and 2 or 1 and 3, hold one of each)."""
    return [
        {**row, "prompt_len": torch.tensor(PROMPT), "label": torch.tensor(i < 2)}
        for i, row in enumerate(sft_rows())
    ]


def preference_rows(kind: str) -> list[dict[str, torch.Tensor]]:
    return kto_rows() if kind == "kto" else pair_rows()


def rows_data(rows: list[dict]):
    """A data module of ``rows`` (2 per batch; no validation): the reference cache reads its loaders."""
    import lightning as L
    from torch.utils.data import DataLoader

    class Rows(L.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(rows, batch_size=PER_RANK)

        def val_dataloader(self):
            return []

    return Rows()


def module_class(kind: str):
    from rlhf_lit.modules.dpo import DPOModule
    from rlhf_lit.modules.reward import RewardModule
    from rlhf_lit.modules.sft import SFTModule

    return {"sft": SFTModule, "reward": RewardModule, **dict.fromkeys(DPO_KINDS, DPOModule)}[kind]


def run(out: Path, empty_init: bool, kind: str = "sft") -> dict:
    """One optimizer step of SFT (reward, a ``DPO_KINDS`` kind) on 2 ranks x 2 rows (pairs) under FSDP2;
    returns this rank's samples and loss (scores) and the gathered parameters after the step."""
    from torch.utils.data import DataLoader

    from rlhf_lit.modules.common import OptimizerConfig
    from tests.ppo.helpers import make_trainer

    name = f"{kind}_{'empty' if empty_init else 'whole'}"
    trainer = make_trainer(out / name, devices=2, strategy=S.strategy_for("fsdp2"), max_steps=1)
    # Adam with eps = 1: a first step ~ lr * g, linear in the gradient (see scenarios.EQUALITY_OPTIMIZER)
    optimizer = OptimizerConfig(lr=1e-2, eps=1.0, scheduler="constant")
    cls = probed(module_class(kind))
    if kind in DPO_KINDS:
        kwargs = dpo_settings(out / "base", kind, out)
    else:
        kwargs = {"backbone": backbone(out / "base")}
    torch.manual_seed(0)  # the reward head's / LoRA's initialisation: the same on both ranks and in both runs
    with trainer.init_module(empty_init=True) if empty_init else torch.device("cpu"):
        module = cls(optimizer=optimizer, **kwargs)
    if kind in DPO_KINDS:
        trainer.fit(module, datamodule=rows_data(preference_rows(kind)))
    else:
        rows = sft_rows() if kind == "sft" else reward_rows()
        trainer.fit(module, train_dataloaders=DataLoader(rows, batch_size=PER_RANK))
    result = {
        **probe_result(module, trainer),
        "first_loss": module.first_loss,
        "reference_key": module.reference_key,
        "after": S.trainable_state(module),  # gathered: every rank calls
        "export_held": module.export_held,
    }
    if kind == "kto":
        result["nonfinite"] = nonfinite_export(module, out / "kto_nonfinite")
    return result


def nonfinite_export(module, folder: Path) -> dict:
    """Set one weight of rank 1's shard of the last block to inf and export to ``folder`` in an export
    transaction (rank 0 opens it, as the CLI does); returns this rank's error message (None if none was raised)
    and what was left of ``folder`` and its staging siblings."""
    from rlhf_lit.errors import DivergedExportError
    from rlhf_lit.outputs import ExportFolder
    from rlhf_lit.parallel import fsdp_units

    last = fsdp_units(module.lm)[0][-1]
    if S.rank() == 1:
        with torch.no_grad():
            last.mlp.down_proj.weight.to_local()[0, 0] = float("inf")
    transaction = ExportFolder(str(folder), overwrite=True) if S.rank() == 0 else None
    if transaction is not None:
        transaction.begin()
    error = None
    try:
        module.export(str(folder))
    except DivergedExportError as err:
        error = str(err)
        if transaction is not None:
            transaction.abort()
    else:
        if transaction is not None:
            transaction.commit()
    torch.distributed.barrier()  # rank 0 has ended its transaction
    left = sorted(e for e in os.listdir(folder.parent) if folder.name in e)
    return {"error": error, "left": left}


def sharded_sft(out: Path, strategy: str) -> None:
    """SFT loaded whole and built on meta, then a reward model built on meta (worker scenario)."""
    assert strategy == "fsdp2", strategy
    results = {
        "whole": run(out, empty_init=False),
        "empty": run(out, empty_init=True),
        "reward_empty": run(out, empty_init=True, kind="reward"),
    }
    torch.save(results, out / f"sharded_sft_rank{S.rank()}.pt")


def sharded_dpo(out: Path, strategy: str) -> None:
    """The preference stage built on meta, one step per ``DPO_KINDS`` kind (worker scenario)."""
    assert strategy == "fsdp2", strategy
    results = {kind: run(out, empty_init=True, kind=kind) for kind in DPO_KINDS}
    torch.save(results, out / f"sharded_dpo_rank{S.rank()}.pt")


def whole_dpo(base: Path, kind: str, **extra):
    """The DPOModule of ``kind`` loaded whole (no FSDP, this process; the reference runs every step)."""
    from rlhf_lit.modules.dpo import DPOModule

    torch.manual_seed(0)
    return DPOModule(**dpo_settings(base, kind), **extra)


def dpo_reference_loss(base: Path, kind: str, rows: list[list[int]]) -> float:
    """The first loss of the whole, unsharded DPOModule of ``kind`` on the rows of ``preference_rows(kind)``
    whose (chosen) ids are ``rows``, in one forward as under FSDP2 (packed by default; ``trim_padding`` never
    runs there)."""
    module = whole_dpo(base, kind, trim_padding=False)
    key = "input_ids" if kind == "kto" else "chosen_input_ids"
    picked = [r for r in preference_rows(kind) if r[key].tolist() in rows]
    assert len(picked) == len(rows) == PER_RANK
    batch = {k: torch.stack([r[k] for r in picked]) for k in picked[0]}
    with torch.no_grad():
        loss, _ = module._loss(batch, "train")
    return float(loss)


def reference_loss(base: Path, rows: list[list[int]]) -> float:
    """The loss of the whole, unsharded SFTModule (no FSDP, this process) on the given rows of ``sft_rows``."""
    from rlhf_lit.modules.sft import SFTModule

    module = SFTModule(backbone(base))
    picked = [r for r in sft_rows() if r["input_ids"].tolist() in rows]
    batch = {k: torch.stack([r[k] for r in picked]) for k in picked[0]}
    with torch.no_grad():
        loss, _ = module._loss(batch)
    return float(loss)


def reference_scores(base: Path, rows: list[list[int]]) -> tuple[list[float], list[float]]:
    """Chosen and rejected scores of the whole, unsharded RewardModule (no FSDP, this process; the same seed
    for its head as ``run``) on the pairs of ``reward_rows`` whose chosen ids are ``rows``."""
    from rlhf_lit.modules.reward import RewardModule

    torch.manual_seed(0)
    module = RewardModule(backbone(base))
    picked = [r for r in reward_rows() if r["chosen_input_ids"].tolist() in rows]
    batch = {k: torch.stack([r[k] for r in picked]) for k in picked[0]}
    with torch.no_grad():
        chosen, rejected, _ = module._score_pairs(batch)
    return chosen.tolist(), rejected.tolist()


# ------------------------------------------------------------------ PPO built on meta (``sharded_ppo``)
def response_length(prompts, responses, fields):
    """The PPO scenario's reward function (no reward model: the policy is the only base): response length."""
    return [float(len(r)) for r in responses]


def ppo_module(base: Path, empty_init: bool, trainer, estimator: str = "gae", **overrides):
    """A PPOModule (``estimator``: GAE with actor and critic LoRA adapters, or GRPO with the actor's only and 2
    responses per prompt) on the saved base whose policy samples ``param_bytes`` after ``__init__``, after
    ``configure_model`` and around each transformer block's forwards; ``overrides``: other PPOModule
    arguments (``sampling``, ``sampler``, ``ppo``)."""
    from rlhf_lit.models import BackboneConfig, LoraSettings
    from rlhf_lit.modules import PPOModule
    from rlhf_lit.parallel import transformer_blocks
    from rlhf_lit.rewards import RewardSourceConfig
    from rlhf_lit.rl.generation import SamplingConfig
    from rlhf_lit.rl.settings import CriticConfig, PPOConfig

    class Probed(ExportProbe, PPOModule):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.samples = {"init": sum(param_bytes(self.policy))}
            self.shard_bytes = 0
            self.export_held = None

        def configure_model(self) -> None:
            blocks = transformer_blocks(self.policy.lm.model)  # found by class name: before FSDP2 renames them
            super().configure_model()
            self.shard_bytes, plain = param_bytes(self.policy)
            self.samples["configure_model"] = self.shard_bytes + plain
            sample_around_blocks(blocks, lambda: self.shard_bytes + param_bytes(self.policy)[1], self.samples)

    group = 2 if estimator == "grpo" else 1
    torch.manual_seed(0)  # LoRA and value head: the same on both ranks
    with trainer.init_module(empty_init=True) if empty_init else torch.device("cpu"):
        settings = dict(
            backbone=BackboneConfig(name_or_path=str(base), tokenizer="byte", lora=LoraSettings(**LORA)),
            reward_model=[RewardSourceConfig(name="len", function=f"{__name__}:response_length")],
            sampling=SamplingConfig(max_new_tokens=4, temperature=1.0, num_samples_per_prompt=group),
            ppo=PPOConfig(
                ppo_epochs=1, ppo_minibatch_size=2 * group, total_iterations=1, advantage_estimator=estimator
            ),
            critic=CriticConfig(lora=LoraSettings(**LORA)),
            log_samples_every=0,
        )
        return Probed(**{**settings, **overrides})


def run_ppo(out: Path, empty_init: bool, estimator: str = "gae") -> dict:
    """One PPO (GRPO) iteration on 2 ranks x 2 prompts under FSDP2, the policy's base loaded whole or built on
    meta; built on meta, the policy is exported to ``<out>/<estimator>_empty_export`` at the end of fit."""
    from tests.ppo.helpers import make_data, make_trainer

    name = f"{estimator}_{'empty' if empty_init else 'whole'}"
    trainer = make_trainer(out / name, devices=2, strategy=S.strategy_for("fsdp2"))
    export = {"export_dir": str(out / f"{name}_export")} if empty_init else {}
    module = ppo_module(out / "base", empty_init, trainer, estimator, **export)
    data = make_data(module, batch_size=2, n=8)
    torch.manual_seed(1)  # the sampling draws: the same in both runs (building consumed the RNG differently)
    trainer.fit(module, datamodule=data)
    return {**probe_result(module, trainer), "history": module.history, "export_held": module.export_held}


def sharded_ppo(out: Path, strategy: str) -> None:
    """PPO and GRPO, each with the policy's base loaded whole, then built on meta (worker scenario)."""
    assert strategy == "fsdp2", strategy
    results = {
        estimator: {"whole": run_ppo(out, False, estimator), "empty": run_ppo(out, True, estimator)}
        for estimator in ("gae", "grpo")
    }
    torch.save(results, out / f"sharded_ppo_rank{S.rank()}.pt")
