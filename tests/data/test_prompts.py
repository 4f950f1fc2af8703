"""PromptDataModule: formats, left padding, truncation counting, and exactly resumable training order."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from rlhf_lit.data import PromptDataModule
from rlhf_lit.data.sampler import ResumableSampler
from tests.data.conftest import byte_ids

HH_CHOSEN = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant: Knock knock."


def build(files, tok, **kwargs) -> PromptDataModule:
    kwargs.setdefault("val_size", 0)
    dm = PromptDataModule(train_files=files, tokenizer=tok, **kwargs)
    dm.setup("fit")
    return dm


def prompts(tok, dm) -> list[str]:
    return [tok.decode(e["prompt_ids"]) for e in dm.train_dataset]


def test_formats(tok, write_jsonl):
    bare = write_jsonl(["Tell me a joke.", "  "], "oasst.jsonl")
    explicit = write_jsonl([{"prompt": "Hi", "gold": 42}], "explicit.jsonl")
    gsm8k = write_jsonl([{"question": "What is 3+4?", "answer": "3+4=7\n#### 7"}], "gsm8k.jsonl")
    hh = write_jsonl([{"chosen": HH_CHOSEN, "rejected": "x"}], "hh.jsonl")
    messages = write_jsonl([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
                           "messages.jsonl")
    dm = build([bare, explicit, gsm8k, hh, messages], tok, reference_field="gold")
    assert prompts(tok, dm) == [
        "Tell me a joke.",
        "Hi",
        "\n\nHuman: What is 3+4?\n\nAssistant:",
        "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant:",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    ]
    assert [e["reference"] for e in dm.train_dataset] == [None, "42", "7", None, None]
    assert dm.skip_counter.skipped("train") == {"empty_prompt": 1}
    assert [e["prompt_index"] for e in dm.train_dataset] == [0, 1, 2, 3, 4]
    first_turn = build(hh, tok, hh_first_turn_only=True)
    assert prompts(tok, first_turn) == ["\n\nHuman: hi\n\nAssistant:"]
    chat = build(explicit, tok, chat_template=True)
    assert prompts(tok, chat) == ["<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]


def test_left_padding_truncation_and_fixed_width(tok_pad_eos, write_jsonl):
    path = write_jsonl([{"prompt": "abcdefgh"}, {"prompt": "xy"}, {"prompt": "<|endoftext|>z"}])
    dm = build(path, tok_pad_eos, max_prompt_length=4, batch_size=3, shuffle=False, pad_to_length=6)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].tolist() == [
        [0, 0] + byte_ids("efgh"),  # cut from the LEFT to 4, then left-padded to 6
        [0, 0, 0, 0] + byte_ids("xy"),
        [0, 0, 0, 0, 0] + byte_ids("z"),  # a leading real EOS/BOS (id 0) is a prompt token ...
    ]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1]]
    # ... and keeps mask 1 even though it equals pad: row 3 is [pad, pad, pad, pad, EOS, z].
    assert batch["prompt_text"][0] == "abcdefgh"
    assert dm.skip_counter.truncated("train") == 1 and dm.skip_counter.skipped("train") == {}
    assert "left-truncated 1 prompts" in dm.data_report()["train"]
    with pytest.raises(ValueError, match="pad_to_length"):
        PromptDataModule(train_files=path, max_prompt_length=8, pad_to_length=6)


def test_train_batches_are_whole_and_val_is_sequential(tok, write_jsonl):
    path = write_jsonl([{"prompt": f"P{i}"} for i in range(23)])
    dm = build(path, tok, val_size=3, batch_size=6, val_batch_size=2)
    assert [len(b["prompt_index"]) for b in dm.train_dataloader()] == [6, 6, 6]  # 20 // 6, drop_last
    val_indices = [i for b in dm.val_dataloader() for i in b["prompt_index"].tolist()]
    assert val_indices == [0, 1, 2]


def test_order_is_randperm_of_seed_plus_epoch(tok, write_jsonl):
    dm = build(write_jsonl([{"prompt": f"P{i}"} for i in range(12)]), tok, batch_size=4, seed=7)
    loader = dm.train_dataloader()
    for epoch in (0, 1):
        dm.set_epoch(epoch)
        order = [i for b in loader for i in b["prompt_index"].tolist()]
        assert order == torch.randperm(12, generator=torch.Generator().manual_seed(7 + epoch)).tolist()


def test_resume_manual_loop_skips_exactly_the_consumed_batches(tok, write_jsonl):
    path = write_jsonl([{"prompt": f"P{i}"} for i in range(30)])
    reference = build(path, tok, batch_size=4, seed=3)
    reference.set_epoch(1)
    full = [b["prompt_index"].tolist() for b in reference.train_dataloader()]

    first = build(path, tok, batch_size=4, seed=3)
    loader = first.train_dataloader()
    first.set_epoch(1)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
        first.mark_consumed()
    state = first.state_dict()
    # 30 prompts / 4 = 7 batches per epoch: all of epoch 0 and 3 of epoch 1
    assert state == {"batches_consumed_total": 10, "seed": 3, "batch_size": 4, "num_train_prompts": 30}

    resumed = build(path, tok, batch_size=4, seed=3)
    resumed.load_state_dict(state)
    rest = [b["prompt_index"].tolist() for b in resumed.train_dataloader()]
    assert rest == full[3:]
    resumed.set_epoch(2)  # the skip applied to one pass only
    assert len(list(resumed.train_dataloader())) == 7
    with pytest.raises(ValueError, match="batch_size was 4"):
        build(path, tok, batch_size=5, seed=3).load_state_dict(state)


class _Recorder(L.LightningModule):
    """Records the prompt indices of every training batch; learns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["prompt_index"].tolist())
        return self.weight.sum() * 0.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(tmp_path, path, tok, ckpt_path=None, **trainer_kwargs) -> list[list[int]]:
    model = _Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, **trainer_kwargs)
    trainer.fit(model, datamodule=PromptDataModule(train_files=path, tokenizer=tok, val_size=0, batch_size=3, seed=5),
                ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.filterwarnings("ignore:.*validation_step:UserWarning", "ignore:.*ckpt_path.*callbacks:UserWarning")
@pytest.mark.parametrize("stop_step", [3, 4])  # 3: the checkpoint falls on the epoch's last batch
def test_resume_under_trainer_fit_equals_an_uninterrupted_run(tmp_path, tok, write_jsonl, stop_step):
    path = write_jsonl([{"prompt": f"P{i}"} for i in range(10)])  # 3 batches per epoch
    full = _fit(tmp_path / "full", path, tok, max_epochs=3, enable_checkpointing=False)
    assert len(full) == 9 and full[:3] != full[3:6]
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=stop_step, save_top_k=-1
    )
    first = _fit(tmp_path / "first", path, tok, max_steps=stop_step, callbacks=[checkpoint])
    assert first == full[:stop_step]
    (ckpt,) = (tmp_path / "ckpt").glob("*.ckpt")
    saved = torch.load(ckpt, weights_only=False)["PromptDataModule"]
    assert saved["batches_consumed_total"] == stop_step
    resumed = _fit(tmp_path / "resumed", path, tok, max_epochs=3, enable_checkpointing=False, ckpt_path=str(ckpt))
    assert resumed == full[stop_step:]


@pytest.mark.filterwarnings("ignore:.*validation_step:UserWarning")
def test_resume_from_a_checkpoint_saved_after_a_max_steps_stop(tmp_path, tok, write_jsonl):
    """Lightning records a max_steps stop as a finished epoch; the order must still continue mid-epoch."""
    path = write_jsonl([{"prompt": f"P{i}"} for i in range(10)])  # 3 batches per epoch
    full = _fit(tmp_path / "full", path, tok, max_steps=7, enable_checkpointing=False)
    model = _Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, max_steps=2,
                        enable_checkpointing=False)
    trainer.fit(model, datamodule=PromptDataModule(train_files=path, tokenizer=tok, val_size=0, batch_size=3, seed=5))
    trainer.save_checkpoint(tmp_path / "after_stop.ckpt")
    resumed = _fit(tmp_path / "resumed", path, tok, max_steps=7, enable_checkpointing=False,
                   ckpt_path=str(tmp_path / "after_stop.ckpt"))
    assert model.seen + resumed == full


def test_sampler_shards_ranks_without_overlap():
    data = list(range(20))
    shards = [list(ResumableSampler(data, batch_size=3, seed=0, num_replicas=2, rank=r)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 9  # 20 // (2 * 3) = 3 batches of 3 per rank
    assert not set(shards[0]) & set(shards[1])
    with pytest.raises(ValueError, match="do not fill one batch"):
        ResumableSampler(list(range(5)), batch_size=3, num_replicas=2, rank=0)
