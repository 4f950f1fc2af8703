"""The sharded-loading scenario (``worker.py fsdp2 <out> sharded_sft``): one optimizer step under FSDP2 on a
saved tiny Llama, three times: SFT with the base loaded whole on every rank, then sharded (``load_backbone``
in ``__init__``), SFT built on the meta device (``trainer.init_module(empty_init=True)``: each rank reads only
its rows of every weight; ``rlhf_lit.models.sharded_load``), and a reward model built on the meta device.

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

Parameters are all the module's: the LM's and, for the reward model, its head's. Not counted: gradients,
optimizer state and activations (they are not parameters).
"""

from __future__ import annotations

from pathlib import Path

import torch

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


def probed(cls):
    """``cls`` (SFTModule or RewardModule) sampling ``param_bytes`` of all its parameters (module docstring)
    and recording its first training loss (SFT) or pair scores (reward) on this rank."""
    from rlhf_lit.parallel import transformer_blocks

    class Probed(cls):
        def __init__(self, *args, **kwargs) -> None:
            with TensorMemoryTracker() as tracker:
                super().__init__(*args, **kwargs)
            self.samples = {"init": sum(param_bytes(self)), "init_tensors": tracker.peak}
            self.shard_bytes = 0
            self.first_loss = None

        def configure_model(self) -> None:
            blocks = transformer_blocks(self.lm.model)  # found by class name: before FSDP2 renames them
            with TensorMemoryTracker(ignore=[*self.parameters(), *self.buffers()]) as tracker:
                super().configure_model()
            self.samples["configure_model_tensors"] = tracker.peak
            self.shard_bytes, plain = param_bytes(self)
            self.samples["configure_model"] = self.shard_bytes + plain
            for i, block in enumerate(blocks):
                block.register_forward_pre_hook(lambda *_, i=i: self._sample(f"block{i}_pre"))
                block.register_forward_hook(lambda *_, i=i: self._sample(f"block{i}_post"))

        def _sample(self, name: str) -> None:
            self.samples[name] = max(self.samples.get(name, 0), self.shard_bytes + param_bytes(self)[1])

        def _loss(self, batch):  # SFTModule's
            loss, num_tokens = super()._loss(batch)
            if self.first_loss is None and self.training:
                self.first_loss = {"loss": float(loss), "input_ids": batch["input_ids"].tolist()}
            return loss, num_tokens

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


def module_class(kind: str):
    from rlhf_lit.modules.reward import RewardModule
    from rlhf_lit.modules.sft import SFTModule

    return {"sft": SFTModule, "reward": RewardModule}[kind]


def run(out: Path, empty_init: bool, kind: str = "sft") -> dict:
    """One optimizer step of SFT (or reward) on 2 ranks x 2 rows (pairs) under FSDP2; returns this rank's
    samples and loss (scores) and the gathered parameters after the step."""
    from torch.utils.data import DataLoader

    from rlhf_lit.modules.common import OptimizerConfig
    from tests.ppo.helpers import make_trainer

    name = f"{kind}_{'empty' if empty_init else 'whole'}"
    trainer = make_trainer(out / name, devices=2, strategy=S.strategy_for("fsdp2"), max_steps=1)
    # Adam with eps = 1: a first step ~ lr * g, linear in the gradient (see scenarios.EQUALITY_OPTIMIZER)
    optimizer = OptimizerConfig(lr=1e-2, eps=1.0, scheduler="constant")
    cls = probed(module_class(kind))
    torch.manual_seed(0)  # the reward head's initialisation: the same on both ranks and in both runs
    with trainer.init_module(empty_init=True) if empty_init else torch.device("cpu"):
        module = cls(backbone(out / "base"), optimizer=optimizer)
    rows = sft_rows() if kind == "sft" else reward_rows()
    trainer.fit(module, train_dataloaders=DataLoader(rows, batch_size=PER_RANK))
    samples = dict(module.samples)
    return {
        "samples": samples,
        "peak_param_bytes": max(samples.values()),
        "shard_bytes": module.shard_bytes,
        "first_loss": module.first_loss,
        "after": S.trainable_state(module),  # gathered: every rank calls
        "world_size": trainer.world_size,
    }


def sharded_sft(out: Path, strategy: str) -> None:
    """SFT loaded whole and built on meta, then a reward model built on meta (worker scenario)."""
    assert strategy == "fsdp2", strategy
    results = {
        "whole": run(out, empty_init=False),
        "empty": run(out, empty_init=True),
        "reward_empty": run(out, empty_init=True, kind="reward"),
    }
    torch.save(results, out / f"sharded_sft_rank{S.rank()}.pt")


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
