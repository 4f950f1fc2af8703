"""Reference log-probs cached on disk: the first run computes them before training (no reference forward in
any training or validation step), a second run reuses the file and runs none at all, and both give the same
losses as a run without the cache, bit for bit on CPU when the cache saw the same batches as training
(``shuffle: false``; with shuffled batches a sequence's reference log-prob can differ in the last bit, since
CPU kernels sum in an order that depends on the batch's shape), also under bf16 autocast (the cache is computed in
the training step's precision context). Any change of the key's parts (data bytes, length limits, tokenizer,
reference weights, the trainer's precision, the row layout: ``packing``, ``trim_padding``) gives another file."""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import torch

from rlhf_lit.errors import ConfigError
from rlhf_lit.models import BackboneConfig
from rlhf_lit.models.reference_cache import data_fingerprint, tensor_fingerprint, tokenizer_fingerprint
from rlhf_lit.models.tokenizer import build_byte_tokenizer
from rlhf_lit.modules.dpo import sequences
from tests.conftest import TINY_GPT2
from tests.dpo.helpers import make_data, make_module, make_trainer, write_pairs

FULL = BackboneConfig(tiny=TINY_GPT2, tokenizer="byte")  # full fine-tuning: the reference is the start


class Record(L.Callback):
    """Every training loss, and the module's reference-forward count when training starts and ends."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.forwards: dict[str, int] = {}

    def on_train_start(self, trainer, pl_module):
        self.forwards["start"] = pl_module.reference.forwards

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())

    def on_train_end(self, trainer, pl_module):
        self.forwards["end"] = pl_module.reference.forwards


def _fit(tmp_path, data_path, cache=None, precision="32-true", module_kw=None, **data_kw):
    torch.manual_seed(0)  # LoRA's A matrices are drawn from the global generator
    module = make_module(optimizer={"lr": 1e-2}, reference_cache=cache, **(module_kw or {}))
    record = Record()
    data = make_data(module, data_path, **data_kw)
    trainer = make_trainer(tmp_path, callbacks=[record], max_epochs=2, limit_val_batches=2, precision=precision)
    trainer.fit(module, datamodule=data)
    return module, record


def test_cached_runs_never_run_the_reference_in_steps_and_match_an_uncached_run_bit_for_bit(tmp_path):
    data_path = write_pairs(tmp_path / "pairs.jsonl", n=12)
    cache = str(tmp_path / "cache")
    plain, plain_record = _fit(tmp_path / "plain", data_path, shuffle=False)
    assert plain_record.forwards["end"] > 0  # without the cache the reference runs every step

    first, first_record = _fit(tmp_path / "first", data_path, cache, shuffle=False)
    files = os.listdir(cache)
    assert len(files) == 1 and files[0].startswith("ref_logps-") and files[0].endswith(".pt")  # no temp left
    umask = os.umask(0)
    os.umask(umask)  # the file's mode is a plain open()'s (a shared cache folder), not a private temp file's
    assert os.stat(os.path.join(cache, files[0])).st_mode & 0o777 == 0o666 & ~umask
    # 8 train pairs / batch 4 + 4 val pairs / batch 4 = 3 batches, computed before training, none after
    assert first_record.forwards == {"start": 3, "end": 3}

    second, second_record = _fit(tmp_path / "second", data_path, cache, shuffle=False)
    assert second_record.forwards == {
        "start": 0,
        "end": 0,
    }  # the file was reused: no reference forward at all
    assert os.listdir(cache) == files

    assert len(plain_record.losses) == 4  # 2 epochs x 2 batches
    for a, b, c in zip(plain_record.losses, first_record.losses, second_record.losses):
        assert torch.equal(a, b) and torch.equal(a, c)
    for (name, p), q, r in zip(plain.named_parameters(), first.parameters(), second.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r), name
    # shuffled: the same file serves (the key holds no batch order), equal to float rounding
    shuffled, shuffled_record = _fit(tmp_path / "shuffled", data_path, shuffle=True)
    cached, cached_record = _fit(tmp_path / "shuffled_cached", data_path, cache, shuffle=True)
    assert cached_record.forwards == {"start": 0, "end": 0}
    torch.testing.assert_close(torch.stack(cached_record.losses), torch.stack(shuffled_record.losses))


def test_under_bf16_autocast_the_cache_holds_what_an_uncached_step_computes_and_is_not_the_float32_file(tmp_path):
    # the training step runs under the precision plugin's autocast; a cache computed outside it (in float32)
    # made the first loss of a bf16-mixed run differ from ln 2 and from the uncached run's
    data_path = write_pairs(tmp_path / "pairs.jsonl", n=12)
    cache = str(tmp_path / "cache")
    _, plain = _fit(tmp_path / "plain", data_path, precision="bf16-mixed", shuffle=False)
    _, cached = _fit(tmp_path / "cached", data_path, cache, precision="bf16-mixed", shuffle=False)
    assert cached.forwards == {"start": 3, "end": 3}
    for a, b in zip(plain.losses, cached.losses, strict=True):
        assert torch.equal(a, b)
    # the same data, tokenizer and weights under float32: another file, not the bf16 one
    _, fp32 = _fit(tmp_path / "fp32", data_path, cache, shuffle=False)
    assert fp32.forwards["start"] == 3 and len(os.listdir(cache)) == 2


def test_changing_a_part_of_the_key_recomputes(tmp_path):
    data_path = write_pairs(tmp_path / "pairs.jsonl", n=12)
    cache = str(tmp_path / "cache")
    _fit(tmp_path / "a", data_path, cache)
    _, record = _fit(tmp_path / "b", data_path, cache, max_length=48)  # another length limit
    assert record.forwards["start"] > 0 and len(os.listdir(cache)) == 2
    with open(data_path, "a") as f:  # the same file name, other bytes
        f.write(json.dumps({"prompt": "Qx: hi", "chosen": " hi!", "rejected": " no"}) + "\n")
    _, record = _fit(tmp_path / "c", data_path, cache)
    assert record.forwards["start"] > 0 and len(os.listdir(cache)) == 3


def test_packing_writes_its_own_file_holding_the_padded_forward_values(tmp_path):
    """Packing changes a reference log-prob's rounding only: its own file (an unpacked run's key is unchanged),
    whose numbers equal the padded forward's within 1e-5 nats."""
    data_path = write_pairs(tmp_path / "pairs.jsonl", n=12)
    cache = str(tmp_path / "cache")
    packed, record = _fit(tmp_path / "packed", data_path, cache, module_kw={"packing": True}, shuffle=False)
    assert record.forwards["start"] == 3 and len(os.listdir(cache)) == 1
    padded, record = _fit(
        tmp_path / "padded", data_path, cache, module_kw={"packing": False, "trim_padding": False}, shuffle=False
    )
    assert record.forwards["start"] == 3 and len(os.listdir(cache)) == 2
    data = make_data(padded, data_path, shuffle=False)
    data.setup("fit")
    for batch in data.train_dataloader():
        ids, mask, prompt_len, response_len = sequences(batch)
        expected = padded.reference.cache.lookup(ids, prompt_len, response_len)
        assert bool((expected < -1.0).all())  # real sums of several tokens' log-probs
        cached = packed.reference.cache.lookup(ids, prompt_len, response_len)
        torch.testing.assert_close(cached, expected, atol=1e-5, rtol=0)


def test_the_key_parts_see_data_bytes_tokenizer_and_weights(tmp_path):
    module = make_module()
    path = write_pairs(tmp_path / "pairs.jsonl", n=4)
    data = make_data(module, path)
    before = data_fingerprint(data)
    with open(path, "a") as f:
        f.write("\n")
    assert data_fingerprint(data) != before

    tok = build_byte_tokenizer()
    other = build_byte_tokenizer()
    other.chat_template = "{{ messages }}"
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(build_byte_tokenizer())
    assert tokenizer_fingerprint(tok) != tokenizer_fingerprint(other)

    weights = module._reference_weights()
    assert not any(".default." in name for name, _ in weights)  # the trained adapter is not the reference
    fingerprint = tensor_fingerprint(weights)
    with torch.no_grad():
        for name, p in module.lm.named_parameters():
            if "lora_B" in name:
                p.add_(1.0)  # training the adapter does not change the reference
    assert tensor_fingerprint(module._reference_weights()) == fingerprint
    with torch.no_grad():
        next(p for n, p in module.lm.named_parameters() if "wte" in n)[0, 0] += 1e-3
    assert tensor_fingerprint(module._reference_weights()) != fingerprint


def _fit_from(tmp_path, name, epochs, backbone=None, ckpt_path=None):
    """A ``max_epochs`` run with the cache ``<tmp_path>/cache``, resumed from ``ckpt_path`` when given."""
    torch.manual_seed(0)
    module = make_module(backbone, optimizer={"lr": 1e-2}, reference_cache=str(tmp_path / "cache"))
    trainer = make_trainer(tmp_path / name, max_epochs=epochs, limit_val_batches=0)
    data = make_data(module, write_pairs(tmp_path / "pairs.jsonl", n=12), shuffle=False)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    trainer.save_checkpoint(tmp_path / f"{name}.ckpt")
    return module, trainer


def test_a_resumed_full_finetuning_run_keys_its_cache_with_the_weights_at_the_start(tmp_path):
    """Full fine-tuning: the reference is the weights at the start, so the key is taken in ``configure_model``,
    before Lightning restores ``ckpt_path`` into them; the resumed run reads the first run's cache (keyed with
    the restored, trained weights it would compute a cache of the wrong reference). Without the cache it is
    refused: the reference is gone."""
    first, trainer = _fit_from(tmp_path, "first", 1, FULL)
    key = first.reference.cache.key_parts["reference"]
    assert tensor_fingerprint(first._reference_weights()) != key  # the weights moved
    resumed, trainer = _fit_from(tmp_path, "resumed", 2, FULL, str(tmp_path / "first.ckpt"))
    assert trainer.global_step == 2 * first.trainer.global_step > 0
    assert resumed.reference.cache.key_parts["reference"] == key
    assert resumed.reference.forwards == 0  # read from the first run's file, the only one
    assert os.listdir(tmp_path / "cache") == [os.path.basename(first.reference.cache.path)]
    os.remove(first.reference.cache.path)
    with pytest.raises(ConfigError, match="reference cache .* is missing"):
        _fit_from(tmp_path, "no_cache", 2, FULL, str(tmp_path / "first.ckpt"))
    assert os.listdir(tmp_path / "cache") == []


def test_a_resumed_lora_run_computes_a_lost_cache_again(tmp_path):
    """With LoRA the reference is the base with the adapter off, which no checkpoint holds: a resumed run whose
    cache is gone computes the same numbers again."""
    first, _ = _fit_from(tmp_path, "first", 1)
    path = first.reference.cache.path
    saved = torch.load(path, weights_only=True)
    os.remove(path)
    resumed, trainer = _fit_from(tmp_path, "resumed", 2, ckpt_path=str(tmp_path / "first.ckpt"))
    assert trainer.global_step == 2 * first.trainer.global_step > 0 and resumed.reference.forwards > 0
    assert resumed.reference.cache.path == path
    assert torch.equal(torch.load(path, weights_only=True)["logps"], saved["logps"])


def test_a_cache_that_cannot_be_written_names_the_cache_folder(tmp_path):
    """A file in the way of the cache folder (it appeared after the checks, which refuse it before any model
    loads) is one OutputError naming the cache path, not a FileExistsError, nor a failure of the export."""
    from rlhf_lit.models.reference_cache import ReferenceLogpCache
    from rlhf_lit.outputs import OutputError

    (tmp_path / "blocker").write_text("a file")
    for folder in (tmp_path / "blocker", tmp_path / "blocker" / "cache"):
        cache = ReferenceLogpCache(str(folder), {"data": "d"})
        cache.add(torch.tensor([[5, 6, 7]]), torch.tensor([1]), torch.tensor([2]), torch.tensor([-1.5]))
        with pytest.raises(OutputError) as info:
            cache.save()
        message = str(info.value)
        assert message.startswith(f"cannot write the reference cache to {folder} (model.init_args.reference_cache)")
        assert f"{tmp_path / 'blocker'} is a file, not a folder" in message and "export" not in message, message
    assert (tmp_path / "blocker").read_text() == "a file"
