"""`jsonl_dataset_file`: tasks from local .jsonl, .json or .parquet files.

.jsonl    one JSON object per line (blank lines skipped); errors name the 1-based line number.
.json     a list of objects (errors name the 0-based row index), one object, or one object per line.
.parquet  one task per row (errors name the 0-based row index).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from astuner.errors import UserError
from astuner.task_reader.base import KEY, TaskReader, resolve_path
from astuner.types import Task

SUFFIXES = (".jsonl", ".json", ".parquet")
SECTION = f"{KEY}.jsonl_dataset_file"


class JsonlTaskReader(TaskReader):
    def __init__(self, reader_cfg: Any, base_dir: Path) -> None:
        super().__init__(reader_cfg, base_dir)
        section = reader_cfg.jsonl_dataset_file
        train_path = section.training.file_path
        val_path = section.validation.file_path
        if train_path is None:
            raise UserError(f"{SECTION}.training.file_path is not set; point it at a .jsonl, .json or .parquet file.")
        # Resolved now so that a wrong path fails before any model is loaded.
        self.training_path = _checked(resolve_path(train_path, base_dir, f"{SECTION}.training.file_path"))
        self.validation_path = (
            None
            if val_path is None
            else _checked(resolve_path(val_path, base_dir, f"{SECTION}.validation.file_path"))
        )

    def training_tasks(self) -> list[Task]:
        return self._cached("train", lambda: self._read(self.training_path, "train"))

    def validation_tasks(self) -> list[Task]:
        if self.validation_path is None:
            return []
        return self._cached("validation", lambda: self._read(self.validation_path, "validation"))

    def _read(self, path: Path, split: str) -> list[Task]:
        return self.make_tasks(read_rows(path), split, str(path))


def _checked(path: Path) -> Path:
    if path.suffix.lower() not in SUFFIXES:
        raise UserError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(SUFFIXES)}.")
    return path


def read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """Yield (location, row) pairs; rows are not validated here beyond being valid JSON."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise UserError(
            f"{path}, line {line}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}). Save the file "
            "as UTF-8, e.g. iconv -f latin1 -t utf-8 in > out."
        ) from None
    if suffix == ".json":
        yield from _json_rows(path, text)
    else:
        yield from _jsonl_rows(path, text)


def _jsonl_rows(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}, line {line_no}: invalid JSON ({exc.msg} at column {exc.colno}).") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}, line {line_no}: expected a JSON object, got {type(row).__name__}.")
        yield f"line {line_no}", row


def _json_rows(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}, line {exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno}).") from None
        for index, row in enumerate(rows):
            yield f"row {index}", row
        return
    try:
        single = json.loads(text)
    except json.JSONDecodeError:
        # Not one document: read it as one object per line, which reports the failing line.
        yield from _jsonl_rows(path, text)
        return
    yield "row 0", single


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{path}: cannot read as parquet ({exc}).") from None
    for index, row in enumerate(table.to_pylist()):
        yield f"row {index}", row
