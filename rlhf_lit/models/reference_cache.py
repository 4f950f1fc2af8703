"""Reference log-probabilities computed once and kept on disk, so a preference run never runs the reference.

DPO-style losses need, for every response, its summed log-prob under the frozen reference policy. Those
numbers depend only on (the data, the tokenizer, the reference weights, the length limits), so they are
computed in one pass before training and written to ``<folder>/ref_logps-<key>.pt``, where ``<key>`` hashes
all of these (``cache_key``):

* the data: every train / val file's path and the SHA-256 of its bytes (a folder: of every file under it; a
  hub id: its name), plus the data module's settings that change the tokens (format, fields, templates,
  ``max_length``, ``max_prompt_length``, EOS, split sizes, seed, ...);
* the tokenizer: its serialised vocabulary and rules, special-token ids and chat template;
* the reference weights: a BLAKE2 digest of every tensor the reference reads (``tensor_fingerprint``);
* a format version.

Changing any of them gives another key and so a fresh computation; a second run with the same inputs finds
the file and runs no reference forward at all. Inside the file each sequence is found by a digest of its
token ids and prompt length (``sequence_key``), so batches may come in any order. The numbers are computed in
batches of the training batch size in file order: a run whose training batches are the same (``shuffle:
false``) gets bit-identical losses with and without the cache on CPU; with shuffled batches a sequence sits in
batches of other shapes, and CPU kernels may round its log-prob differently in the last bit. The file is written to a
temporary sibling and renamed (``os.replace``): a crash never leaves a half-written cache under the real name.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, is_dataclass
from typing import Any

import torch

from rlhf_lit.outputs import OutputError, replace_file, write_failure

__all__ = [
    "ReferenceLogpCache",
    "cache_key",
    "data_fingerprint",
    "file_digest",
    "sequence_key",
    "tensor_fingerprint",
    "tokenizer_fingerprint",
]

FORMAT_VERSION = 1
#: Data-module attributes that change the token ids of a split (read with getattr; absent ones are None).
DATA_SETTINGS = (
    "format",
    "fields",
    "chat_template",
    "max_length",
    "max_prompt_length",
    "min_prompt_tokens",
    "append_eos",
    "val_size",
    "seed",
    "max_train_samples_per_file",
    "train_part",
    "pair_unpaired",
)


def file_digest(path: str) -> str:
    """SHA-256 of a file's bytes, or of every file under a folder (sorted relative paths and bytes); a path
    that is neither (a hub id) gives the digest of its name."""
    h = hashlib.sha256()
    if os.path.isfile(path):
        files = [(os.path.basename(path), path)]
    elif os.path.isdir(path):
        files = sorted(
            (os.path.relpath(os.path.join(root, name), path), os.path.join(root, name))
            for root, _, names in os.walk(path)
            for name in names
        )
    else:
        h.update(f"name:{path}".encode())
        return h.hexdigest()
    for rel, full in files:
        h.update(rel.encode() + b"\0")
        with open(full, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _plain(value: Any) -> Any:
    if is_dataclass(value):
        return asdict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def data_fingerprint(datamodule: Any) -> dict[str, Any]:
    """The data module's files (path + content digest) and token-changing settings, as plain JSON values."""
    files = {}
    for split in ("train_files", "val_files"):
        paths = getattr(datamodule, split, None) or []
        files[split] = [[str(p), file_digest(str(p))] for p in ([paths] if isinstance(paths, str) else paths)]
    settings = {name: _plain(getattr(datamodule, name, None)) for name in DATA_SETTINGS}
    return {"class": type(datamodule).__name__, "files": files, "settings": settings}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of the tokenizer's serialised form (a fast tokenizer's JSON, else its sorted vocabulary), its
    special-token ids and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps(
        {
            "class": type(tokenizer).__name__,
            "bos": tokenizer.bos_token_id,
            "eos": tokenizer.eos_token_id,
            "pad": tokenizer.pad_token_id,
            "chat_template": getattr(tokenizer, "chat_template", None),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256((body + extra).encode()).hexdigest()


def tensor_fingerprint(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """BLAKE2b digest of named tensors (names, dtypes, shapes and raw bytes, in name order): equal digests
    mean bit-identical weights. Any dtype, 4-bit packed weights included.

    FSDP2 shards (DTensors) are gathered one at a time, so the digest is that of the whole tensors and a rank
    holds at most one whole tensor besides its shards; then it is a collective (every rank calls it with
    the same names).
    """
    h = hashlib.blake2b(digest_size=20)
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        full = getattr(tensor, "full_tensor", None)  # a DTensor's (torch.distributed.tensor)
        t = (full() if full is not None else tensor).detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(tensor.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def cache_key(parts: dict[str, Any]) -> str:
    """The cache file's key: SHA-256 of the parts as canonical JSON (first 24 hex digits)."""
    text = json.dumps({"version": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def sequence_key(input_ids: torch.Tensor, prompt_len: int, response_len: int) -> str:
    """Digest of one sequence: its first ``prompt_len + response_len`` token ids and ``prompt_len``."""
    ids = input_ids[: prompt_len + response_len].detach().to("cpu", torch.int64).contiguous()
    h = hashlib.blake2b(digest_size=16)
    h.update(int(prompt_len).to_bytes(4, "little"))
    h.update(ids.numpy().tobytes())
    return h.hexdigest()


class ReferenceLogpCache:
    """Summed reference log-probs by sequence, loaded from and saved to ``<folder>/ref_logps-<key>.pt``.

    Args:
        folder: where the cache files live (created on save).
        key_parts: what the numbers depend on (``data_fingerprint``, ``tokenizer_fingerprint``,
            ``tensor_fingerprint`` of the reference, ...); hashed into the file name (``cache_key``).
    """

    def __init__(self, folder: str, key_parts: dict[str, Any]) -> None:
        self.folder = folder
        self.key = cache_key(key_parts)
        self.key_parts = key_parts
        self.values: dict[str, float] = {}
        self._tensor: torch.Tensor | None = None
        self._index: dict[str, int] = {}

    @property
    def path(self) -> str:
        return os.path.join(self.folder, f"ref_logps-{self.key}.pt")

    def load(self) -> bool:
        """Read the file of this key; False if there is none."""
        if not os.path.isfile(self.path):
            return False
        saved = torch.load(self.path, map_location="cpu", weights_only=True)
        self._index = dict(saved["index"])
        self._tensor = saved["logps"]
        return True

    def add(
        self, input_ids: torch.Tensor, prompt_len: torch.Tensor, response_len: torch.Tensor, logps
    ) -> None:
        """Record ``(N,)`` summed log-probs of the N sequences ``input_ids`` ``(N, T)``."""
        values = logps.detach().to("cpu", torch.float32)
        for i in range(input_ids.shape[0]):
            key = sequence_key(input_ids[i], int(prompt_len[i]), int(response_len[i]))
            self._index.setdefault(key, len(self._index))
            self.values[key] = values[i]
        self._tensor = None

    def lookup(
        self, input_ids: torch.Tensor, prompt_len: torch.Tensor, response_len: torch.Tensor
    ) -> torch.Tensor:
        """``(N,)`` float32 summed log-probs of the N sequences, on ``input_ids``' device.

        Raises:
            KeyError: if a sequence is not in the cache (the data changed without changing the key).
        """
        table = self._table()
        rows = []
        for i in range(input_ids.shape[0]):
            key = sequence_key(input_ids[i], int(prompt_len[i]), int(response_len[i]))
            if key not in self._index:
                raise KeyError(f"sequence {i} of the batch is not in the reference cache {self.path}")
            rows.append(self._index[key])
        return table[torch.tensor(rows, dtype=torch.long)].to(input_ids.device)

    def _table(self) -> torch.Tensor:
        if self._tensor is None:
            table = torch.zeros(len(self._index), dtype=torch.float32)
            for key, value in self.values.items():
                table[self._index[key]] = value
            self._tensor = table
        return self._tensor

    def save(self) -> None:
        """Write the file atomically (``rlhf_lit.outputs.replace_file``: a temporary sibling, fsync, then
        ``os.replace``), readable as a plain ``open`` under the umask makes it (a cache folder may be shared).

        Raises:
            OutputError: the disk is full, the folder is not writable, or the path (or a parent) is a file;
                naming the cache folder (``model.init_args.reference_cache``), not the export's.
        """
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as err:
            if err.errno in (errno.EEXIST, errno.ENOTDIR):  # the path, or a folder on it, is a file
                blocker = os.path.abspath(self.folder)
                while not os.path.exists(blocker) and os.path.dirname(blocker) != blocker:
                    blocker = os.path.dirname(blocker)
                raise OutputError(
                    f"cannot write the reference cache to {self.folder} (model.init_args.reference_cache): "
                    f"{blocker} is a file, not a folder"
                ) from err
            raise (write_failure(err, self.folder, None, "reference cache") or err) from err
        payload = {
            "index": dict(self._index),
            "logps": self._table(),
            "key_parts": json.dumps(self.key_parts, default=str),
        }
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        replace_file(self.path, buffer.getvalue(), "reference cache")

    def __len__(self) -> int:
        return len(self._index)
