"""Shuffled SFT and preference loaders resume the training order exactly from an end-of-epoch state.

Every epoch draws its permutation from one generator seeded with ``seed``; the data module's
``state_dict`` carries that generator's state, so a run restored from a checkpoint taken between two epochs
draws the next epoch's order the uninterrupted run draws (not epoch 0's order again, which is what a fresh
generator would give).
"""

from __future__ import annotations

import pytest
import torch

from rlhf_lit.data import PreferenceDataModule, SFTDataModule

N, BATCH = 12, 4


def _build(kind, write_jsonl, tok):
    if kind == "sft":
        rows = [{"prompt": f"Q{i:02d}", "response": " ok"} for i in range(N)]
        dm = SFTDataModule(train_files=write_jsonl(rows, "sft.jsonl"), tokenizer=tok, val_size=0, batch_size=BATCH)
    else:
        rows = [{"prompt": f"Q{i:02d}", "chosen": " yes", "rejected": " no"} for i in range(N)]
        dm = PreferenceDataModule(
            train_files=write_jsonl(rows, "pref.jsonl"), tokenizer=tok, val_size=0, batch_size=BATCH
        )
    dm.setup("fit")
    return dm


def _epoch(loader, tok, limit=None) -> list[int]:
    """The example order of one pass, as the number in each row's prompt (``Qnn``), first ``limit`` batches."""
    order = []
    for index, batch in enumerate(loader):
        if limit is not None and index == limit:
            break
        key = "input_ids" if "input_ids" in batch else "chosen_input_ids"
        for row in batch[key].tolist():
            text = tok.decode(row, skip_special_tokens=True)
            order.append(int(text[text.index("Q") + 1 : text.index("Q") + 3]))
    return order


@pytest.mark.parametrize("kind", ["sft", "preference"])
@pytest.mark.parametrize("restore_before_loader", [True, False])
def test_a_restored_module_draws_the_next_epochs_order(kind, restore_before_loader, write_jsonl, tok):
    straight = _build(kind, write_jsonl, tok)
    loader = straight.train_dataloader()
    epochs = [_epoch(loader, tok) for _ in range(3)]
    assert all(sorted(e) == list(range(N)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]  # shuffled anew every epoch (else this test proves nothing)

    interrupted = _build(kind, write_jsonl, tok)
    assert interrupted.state_dict() == {}  # nothing drawn yet
    first = _epoch(interrupted.train_dataloader(), tok)
    assert first == epochs[0]
    state = interrupted.state_dict()
    assert set(state) == {"train_generator"} and state["train_generator"].dtype == torch.uint8

    resumed = _build(kind, write_jsonl, tok)
    if restore_before_loader:  # Lightning restores the data module before it builds the loaders
        resumed.load_state_dict(state)
        loader = resumed.train_dataloader()
    else:
        loader = resumed.train_dataloader()
        resumed.load_state_dict(state)
    assert _epoch(loader, tok) == epochs[1]
    assert _epoch(loader, tok) == epochs[2]


@pytest.mark.parametrize("kind", ["sft", "preference"])
def test_an_epoch_cut_short_by_a_batch_limit_resumes_too(kind, write_jsonl, tok):
    # limit_train_batches stops an epoch before its loader is exhausted, which draws less from the generator
    straight = _build(kind, write_jsonl, tok)
    loader = straight.train_dataloader()
    short = _epoch(loader, tok, limit=2)
    assert len(short) == 2 * BATCH
    following = _epoch(loader, tok, limit=2)

    interrupted = _build(kind, write_jsonl, tok)
    assert _epoch(interrupted.train_dataloader(), tok, limit=2) == short
    resumed = _build(kind, write_jsonl, tok)
    resumed.load_state_dict(interrupted.state_dict())
    assert _epoch(resumed.train_dataloader(), tok, limit=2) == following


def test_an_empty_or_older_state_changes_nothing(write_jsonl, tok):
    plain = _epoch(_build("sft", write_jsonl, tok).train_dataloader(), tok)
    dm = _build("sft", write_jsonl, tok)
    dm.load_state_dict({})  # a checkpoint written before the order was saved
    assert _epoch(dm.train_dataloader(), tok) == plain


class _Ranks:
    """What the data module reads of an attached trainer under several processes."""

    def __init__(self, world_size: int, global_rank: int) -> None:
        self.world_size, self.global_rank = world_size, global_rank


@pytest.mark.parametrize("kind", ["sft", "preference"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_under_two_ranks_each_takes_every_other_row_of_one_seeded_order(kind, shuffle, write_jsonl, tok):
    """Lightning would put its own sampler in (shuffled whatever ``shuffle`` says, seeded by ``seed_everything``);
    the data module's own keeps ``shuffle`` and ``seed``: epoch e's order is ``randperm(N)`` seeded ``seed + e``
    (the file order without shuffling), rank r takes its rows r, r + 2, ..."""
    single = _build(kind, write_jsonl, tok)
    single.shuffle = False
    file_order = _epoch(single.train_dataloader(), tok)
    assert sorted(file_order) == list(range(N))
    orders = {}
    for epoch in (0, 1):
        if shuffle:
            perm = torch.randperm(N, generator=torch.Generator().manual_seed(single.seed + epoch)).tolist()
            expected = [file_order[i] for i in perm]
        else:
            expected = file_order
        for rank in (0, 1):
            dm = _build(kind, write_jsonl, tok)
            dm.shuffle = shuffle
            dm.trainer = _Ranks(2, rank)
            loader = dm.train_dataloader()
            loader.sampler.set_epoch(epoch)  # what Lightning's fit loop does at each epoch start
            orders[epoch, rank] = _epoch(loader, tok)
            assert orders[epoch, rank] == expected[rank::2], (epoch, rank)
        assert sorted(orders[epoch, 0] + orders[epoch, 1]) == list(range(N))
    assert (orders[0, 0] != orders[1, 0]) == shuffle  # a new order each epoch, only when shuffling
