"""The sharded-loading scenario (``worker.py fsdp2 <out> sharded_sft``): SFT on a saved tiny Llama under FSDP2,
built whole (``load_backbone`` on every rank, then sharded) and built on the meta device
(``trainer.init_module(empty_init=True)``: each rank reads only its rows of every weight; rlhf_lit.models.sharded_load).

What is measured on each rank, ``peak_param_bytes``: the largest of

* the peak of the tensors created during ``SFTModule.__init__`` and during ``configure_model`` (FSDP2
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

Not counted: gradients, optimizer state and activations (they are not parameters).
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


def probed_sft_class():
    from rlhf_lit.modules.sft import SFTModule
    from rlhf_lit.parallel import transformer_blocks

    class ProbedSFT(SFTModule):
        """SFTModule that samples ``param_bytes`` (module docstring) and records its first loss per rank."""

        def __init__(self, *args, **kwargs) -> None:
            with TensorMemoryTracker() as tracker:
                super().__init__(*args, **kwargs)
            self.samples = {"init": sum(param_bytes(self.lm)), "init_tensors": tracker.peak}
            self.shard_bytes = 0
            self.first_loss = None

        def configure_model(self) -> None:
            blocks = transformer_blocks(self.lm.model)  # found by class name: before FSDP2 renames them
            with TensorMemoryTracker(ignore=[*self.parameters(), *self.buffers()]) as tracker:
                super().configure_model()
            self.samples["configure_model_tensors"] = tracker.peak
            self.shard_bytes, plain = param_bytes(self.lm)
            self.samples["configure_model"] = self.shard_bytes + plain
            for i, block in enumerate(blocks):
                block.register_forward_pre_hook(lambda *_, i=i: self._sample(f"block{i}_pre"))
                block.register_forward_hook(lambda *_, i=i: self._sample(f"block{i}_post"))

        def _sample(self, name: str) -> None:
            self.samples[name] = max(self.samples.get(name, 0), self.shard_bytes + param_bytes(self.lm)[1])

        def _loss(self, batch):
            loss, num_tokens = super()._loss(batch)
            if self.first_loss is None and self.training:
                self.first_loss = {
                    "loss": float(loss),
                    "num_tokens": int(num_tokens),
                    "input_ids": batch["input_ids"].tolist(),
                }
            return loss, num_tokens

    return ProbedSFT


def run(out: Path, empty_init: bool) -> dict:
    """One optimizer step of SFT on 2 ranks x 2 rows under FSDP2; returns this rank's samples and loss and
    the gathered parameters after the step."""
    from torch.utils.data import DataLoader

    from rlhf_lit.modules.common import OptimizerConfig
    from tests.ppo.helpers import make_trainer

    trainer = make_trainer(
        out / ("empty" if empty_init else "whole"), devices=2, strategy=S.strategy_for("fsdp2"), max_steps=1
    )
    # Adam with eps = 1: a first step ~ lr * g, linear in the gradient (see scenarios.EQUALITY_OPTIMIZER)
    optimizer = OptimizerConfig(lr=1e-2, eps=1.0, scheduler="constant")
    cls = probed_sft_class()
    with trainer.init_module(empty_init=True) if empty_init else torch.device("cpu"):
        module = cls(backbone(out / "base"), optimizer=optimizer)
    trainer.fit(module, train_dataloaders=DataLoader(sft_rows(), batch_size=PER_RANK))
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
    assert strategy == "fsdp2", strategy
    torch.manual_seed(0)
    whole = run(out, empty_init=False)
    torch.manual_seed(0)
    empty = run(out, empty_init=True)
    torch.save({"whole": whole, "empty": empty}, out / f"sharded_sft_rank{S.rank()}.pt")


def reference_loss(base: Path, rows: list[list[int]]) -> float:
    """The loss of the whole, unsharded SFTModule (no FSDP, this process) on the given rows of ``sft_rows``."""
    from rlhf_lit.modules.sft import SFTModule

    module = SFTModule(backbone(base))
    picked = [r for r in sft_rows() if r["input_ids"].tolist() in rows]
    batch = {k: torch.stack([r[k] for r in picked]) for k in picked[0]}
    with torch.no_grad():
        loss, _ = module._loss(batch)
    return float(loss)
