"""Reading raw rows: local JSON / JSON Lines (optionally gzipped), Parquet and CSV files, or hub ids.

Everything goes through ``datasets``. When ``datasets`` cannot read a JSON file, or reads it only by
falling back to its untyped ``Json`` column type (a field whose type changes between rows), the file
is scanned line by line with :func:`json.loads` so that the user gets ONE :class:`DataFormatError`
naming the file, the row (the 1-based line for JSON Lines) and the field.

Prompt files whose lines are bare JSON strings (``"Tell me a joke"``) are read as ``{"prompt": s}``.

Hook for generated data: :func:`register_source` maps a scheme to a function that makes rows. This
module knows no scheme itself; ``rlhf_lit.data`` registers ``"demo"`` (the synthetic demo task of
``rlhf_lit/data/demo_task.py``), so ``train_files: ["demo:preference?n=1000&seed=0&split=train"]`` works in a
YAML config.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_lit.errors import UserError

if (
    TYPE_CHECKING
):  # imported where rows are read: a config check or --help need not load datasets/pandas/pyarrow
    import datasets

__all__ = [
    "DataFileNotFoundError",
    "DataFormatError",
    "display_name",
    "is_hub_id",
    "is_registered_source",
    "load_rows",
    "register_source",
    "source_name",
]

JSON_EXTENSIONS = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
DATA_EXTENSIONS = JSON_EXTENSIONS + (".parquet", ".csv", ".csv.gz")

SourceLoader = Callable[[str, str], "datasets.Dataset"]


_SOURCE_LOADERS: dict[str, SourceLoader] = {}


class DataFormatError(UserError, ValueError):
    """Data that cannot be read as rows. The message is what the user sees: file, row and field."""


class DataFileNotFoundError(DataFormatError, FileNotFoundError):
    """A data file that does not exist (the message gives the path as written and as resolved)."""


def register_source(scheme: str, loader: SourceLoader) -> None:
    """Register rows made in code under ``"<scheme>:<name>"`` (the hook for the synthetic demo task).

    Args:
        scheme: the prefix before the colon, e.g. ``"demo"``.
        loader: called as ``loader(name, split)``; returns a ``datasets.Dataset`` of rows.
    """
    _SOURCE_LOADERS[scheme] = loader


def is_registered_source(path_or_id: str) -> bool:
    """True for ``"<scheme>:<name>"`` with a scheme given to :func:`register_source` (rows made in code)."""
    scheme, _, rest = path_or_id.partition(":")
    return bool(rest) and scheme in _SOURCE_LOADERS


def source_name(path_or_id: str) -> str:
    """A short name for a data source: the file stem without data extensions, or the hub id."""
    scheme, _, rest = path_or_id.partition(":")
    if rest and scheme in _SOURCE_LOADERS:
        kind, _, query = rest.partition("?")
        split = dict(p.partition("=")[::2] for p in query.split("&") if p).get("split")
        return f"{scheme}_{kind}" + (f"_{split}" if split else "")
    name = os.path.basename(path_or_id.rstrip("/\\")) if _looks_local(path_or_id) else path_or_id
    for ext in sorted(DATA_EXTENSIONS, key=len, reverse=True):
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def is_hub_id(path_or_id: str) -> bool:
    """True when ``load_rows`` would fetch ``path_or_id`` from the hub (not a file, not a registered scheme)."""
    scheme, _, rest = path_or_id.partition(":")
    return not (rest and scheme in _SOURCE_LOADERS) and not _looks_local(path_or_id)


def display_name(path_or_id: str) -> str:
    """How reports name a data source: a local file's base name (``hh.jsonl.gz``), else the spec."""
    return os.path.basename(path_or_id.rstrip("/\\")) if _looks_local(path_or_id) else path_or_id


def load_rows(path_or_id: str, split: str = "train") -> datasets.Dataset:
    """Load raw rows from a local file, a registered source or a hub dataset.

    Args:
        path_or_id: a ``.json``/``.jsonl`` (optionally ``.gz``), ``.parquet`` or ``.csv`` file (relative
            paths are resolved against the current directory); ``"scheme:name"`` for a source registered
            with :func:`register_source`; otherwise a hub id such as ``"Anthropic/hh-rlhf"``, optionally
            with ``":split"`` appended (needs network access).
        split: the split of a hub dataset or a registered source; ignored for local files.

    Returns:
        The rows. Bare-string JSON rows become ``{"prompt": s}``.

    Raises:
        DataFileNotFoundError: (a ``FileNotFoundError``) if a local path does not exist.
        DataFormatError: if the file is malformed (invalid JSON, a field whose type changes between
            rows, an unsupported extension) or a hub dataset cannot be loaded.
    """
    scheme, _, rest = path_or_id.partition(":")
    if rest and scheme in _SOURCE_LOADERS:
        return _SOURCE_LOADERS[scheme](rest, split)
    path = Path(path_or_id).expanduser()
    if path.is_file():
        return _load_local(path)
    if path.exists():
        raise DataFormatError(
            f"{path_or_id} is a folder, not a data file (resolved to {path.resolve()}); give the file(s) inside it "
            f"({', '.join(DATA_EXTENSIONS)})"
        )
    if _looks_local(path_or_id):
        raise DataFileNotFoundError(f"data file not found: {path_or_id} (resolved to {path.resolve()})")
    return _load_hub(path_or_id, split)


def _looks_local(spec: str) -> bool:
    lowered = spec.lower()
    return (
        lowered.endswith(DATA_EXTENSIONS)
        or spec.startswith(("/", "./", "../", "~"))
        or os.path.exists(os.path.expanduser(spec))
    )


def _load_hub(hub_id: str, split: str) -> datasets.Dataset:
    import datasets

    if ":" in hub_id:
        hub_id, split = hub_id.rsplit(":", 1)
    try:
        return datasets.load_dataset(hub_id, split=split)
    except Exception as err:  # network, unknown id, unknown split: all end up here
        raise DataFormatError(
            f"could not load {hub_id!r} (split {split!r}): not a local file, and loading it from the hub "
            f"failed ({type(err).__name__}: {err})"
        ) from None


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Silence ``datasets``' own error log while we try a file (we raise one clear error instead)."""
    logger = logging.getLogger("datasets")
    old = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(old)


def _load_local(path: Path) -> datasets.Dataset:
    import datasets

    lowered = path.name.lower()
    builder = (
        "json"
        if lowered.endswith(JSON_EXTENSIONS)
        else "parquet"
        if lowered.endswith(".parquet")
        else "csv"
        if lowered.endswith((".csv", ".csv.gz"))
        else None
    )
    if builder is None:
        raise DataFormatError(f"{path}: unsupported file type; use one of {', '.join(DATA_EXTENSIONS)}")
    _sniff(path, builder)
    if builder == "json":
        rows = _load_json(path)
    else:
        try:
            with _quiet_datasets():
                rows = datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as err:
            if "corresponds to no data" in str(err):  # datasets' words for a file with a header and no rows
                raise DataFormatError(
                    f"{path} holds no rows (only a header); give a file with data"
                ) from None
            raise DataFormatError(f"malformed {builder} file {path}: {_root_message(err)}") from None
    if len(rows) == 0:
        raise DataFormatError(f"{path} holds no rows (only a header or an empty list); give a file with data")
    return rows


def _sniff(path: Path, builder: str) -> None:
    """One clear error for an empty file, or content that does not match the extension (JSON Lines named
    ``.csv``, CSV named ``.jsonl``, a text file named ``.parquet``), before ``datasets`` reads it."""
    if builder == "parquet":
        with open(path, "rb") as handle:
            magic = handle.read(4)
        if magic != b"PAR1":
            hint = (
                " (it looks like text: rename it to .jsonl or .csv)"
                if magic[:1] in (b"{", b"[") or magic.isascii()
                else ""
            )
            raise DataFormatError(
                f"{path} is not a Parquet file{hint}" if magic else f"{path} is empty (0 bytes)"
            )
        return
    try:
        with _open_text(path) as handle:
            first = next((line for line in handle if line.strip()), None)
    except (UnicodeDecodeError, OSError, EOFError) as err:
        raise DataFormatError(f"{path} is not a UTF-8 text file ({type(err).__name__}: {err})") from None
    if first is None:
        raise DataFormatError(f"{path} is empty (no rows, only blank lines or nothing)")
    head = first.lstrip()[:1]
    if builder == "csv" and head in ("{", "["):
        raise DataFormatError(
            f"{path} holds JSON (its first line starts with {head!r}), not CSV; rename it to .jsonl (one object per "
            "line) or .json"
        )
    if builder == "json" and head not in ("{", "[", '"'):
        looks_csv = "," in first or "\t" in first
        hint = "; it looks like CSV: rename it to .csv" if looks_csv else ""
        raise DataFormatError(f"{path} is not JSON: its first line starts with {first.strip()[:40]!r}{hint}")


def _load_json(path: Path) -> datasets.Dataset:
    import datasets

    first = _first_json_line(path)
    if isinstance(first, str):  # bare JSON strings, one per line (the oasst prompt file)
        return _load_bare_strings(path)
    try:
        with _quiet_datasets():
            ds = datasets.load_dataset("json", data_files=str(path), split="train")
    except Exception as err:
        problem = _diagnose_json(path)
        if problem is None and not any(True for _ in _iter_json_rows(path)):
            problem = f"{path} holds no rows (an empty JSON list); give a file with data"
        raise DataFormatError(problem or f"malformed JSON file {path}: {_root_message(err)}") from None
    if any(isinstance(feature, datasets.Json) for feature in ds.features.values()):
        problem = _diagnose_json(path)  # an untyped column: some field changes type between rows
        if problem:
            raise DataFormatError(problem)
    return ds


def _open_text(path: Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _first_json_line(path: Path) -> object:
    """The first non-blank line of a JSON Lines file, parsed (``None`` if it is not valid JSON alone)."""
    if ".jsonl" not in path.name.lower():
        return None
    with _open_text(path) as handle:
        for line in handle:
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    return None
    return None


def _load_bare_strings(path: Path) -> datasets.Dataset:
    import datasets

    prompts: list[str] = []
    with _open_text(path) as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFormatError(
                    f"malformed JSON in {path}: line {lineno}: invalid JSON ({err.msg})"
                ) from None
            if not isinstance(value, str):
                raise DataFormatError(
                    f"malformed JSON in {path}: line {lineno}: expected a JSON string like the first line, "
                    f"got {_type_name(value)}"
                )
            prompts.append(value)
    return datasets.Dataset.from_dict({"prompt": prompts})


def _iter_json_rows(path: Path) -> Iterator[tuple[str, object]]:
    """Yield ``(where, value)`` per row; raises DataFormatError on invalid JSON."""
    if ".jsonl" in path.name.lower():
        with _open_text(path) as handle:
            for lineno, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    yield f"line {lineno}", json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataFormatError(
                        f"malformed JSON in {path}: line {lineno}: invalid JSON ({err.msg}, column {err.colno})"
                    ) from None
        return
    with _open_text(path) as handle:
        try:
            document = json.load(handle)
        except json.JSONDecodeError as err:
            raise DataFormatError(
                f"malformed JSON in {path}: invalid JSON at line {err.lineno}, column {err.colno} ({err.msg})"
            ) from None
    rows = document if isinstance(document, list) else [document]
    for index, value in enumerate(rows, 1):
        yield f"row {index}", value


def _diagnose_json(path: Path) -> str | None:
    """Find the first invalid row, or the first row whose field has another type than in most rows; return
    the message (None if none found). The majority decides, so an odd FIRST row is the one named."""
    kinds: dict[str, dict[str, list[str]]] = {}  # field -> type -> rows (where) holding it
    try:
        for where, row in _iter_json_rows(path):
            if not isinstance(row, dict):
                return f"malformed JSON in {path}: {where}: expected a JSON object, got {_type_name(row)}"
            for field, value in row.items():
                if value is not None:
                    kinds.setdefault(field, {}).setdefault(_type_name(value), []).append(where)
    except DataFormatError as err:
        return str(err)
    culprits = []
    for field, by_kind in kinds.items():
        if len(by_kind) < 2:
            continue
        usual = max(by_kind, key=lambda k: len(by_kind[k]))
        total = sum(len(v) for v in by_kind.values())
        for kind, wheres in by_kind.items():
            if kind != usual:
                culprits.append(
                    (_row_number(wheres[0]), wheres[0], field, kind, usual, by_kind[usual], total)
                )
    if not culprits:
        return None
    _, where, field, kind, usual, usual_rows, total = min(culprits)
    return (
        f"malformed JSON in {path}: {where}: field {field!r} is {kind}, but it is {usual} in "
        f"{len(usual_rows)} of {total} rows (e.g. {usual_rows[0]})"
    )


def _row_number(where: str) -> int:
    return int(where.rsplit(" ", 1)[-1])


def _type_name(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _root_message(err: BaseException) -> str:
    """The innermost cause's message (``datasets`` wraps the useful pyarrow message)."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return f"{type(err).__name__}: {err}"
