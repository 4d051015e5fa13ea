"""`huggingface_dat_repo`: tasks from `datasets.load_dataset(dataset_path, name=dataset_name, split=...)`.

`dataset_path` is a local dataset folder (e.g. my_dataset/ holding train.jsonl and test.jsonl; `datasets` infers
the split names from the file names) or a hub id already in the local Hugging Face cache. There is no hub access
at run time, so anything else fails with a UserError that says how to provide the data locally.
Errors in rows name the 0-based row index of the split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astuner.errors import UserError
from astuner.task_reader.base import KEY, SplitTaskReader
from astuner.types import Task

SECTION = f"{KEY}.huggingface_dat_repo"


class HuggingFaceTaskReader(SplitTaskReader):
    def __init__(self, reader_cfg: Any, base_dir: Path) -> None:
        super().__init__(reader_cfg, base_dir)
        section = reader_cfg.huggingface_dat_repo
        dataset_path = section.dataset_path
        if dataset_path is None or not str(dataset_path).strip():
            raise UserError(
                f"{SECTION}.dataset_path is not set; give a local dataset folder (e.g. my_dataset/ with "
                f"train.jsonl) or a hub id already in the local Hugging Face cache."
            )
        self.dataset_path, self.is_local = _resolve_dataset_path(str(dataset_path), self.base_dir)
        name = section.dataset_name
        self.dataset_name = None if name is None else str(name)
        train_split = section.training_split
        if train_split is None:
            raise UserError(f"{SECTION}.training_split is null; name the split to train on (e.g. train).")
        self.training_split = str(train_split)
        val_split = section.validation_split
        self.validation_split = None if val_split is None else str(val_split)

    def _read(self, split: str) -> list[Task]:
        dataset = self._load(split)
        source = f"dataset {self.dataset_path!r} (split {split!r})"
        try:
            rows = [(f"row {i}", row) for i, row in enumerate(dataset)]
        except UnicodeDecodeError as exc:  # `datasets` may load a latin-1 file and fail only on reading a row
            raise UserError(
                f"{source}: cannot read the data files: not UTF-8 text ({exc.reason} at byte {exc.start}); save "
                "the files as UTF-8."
            ) from None
        return self.make_tasks(rows, split, source)

    def _load(self, split: str):
        import datasets  # lazy: importing astuner.task_reader must stay light

        what = f"{SECTION}.dataset_path={self.dataset_path!r}"
        try:
            return datasets.load_dataset(self.dataset_path, name=self.dataset_name, split=split)
        except ConnectionError as exc:
            # What `datasets` raises when the hub is unreachable or offline mode is on and nothing is cached.
            raise UserError(
                f"{what}: not a local folder, and not in the local Hugging Face cache "
                f"({type(exc).__name__}: {exc}). There is no hub access at run time. Put the data in a local "
                f"folder (e.g. my_dataset/ with train.jsonl and test.jsonl) and point dataset_path at it, or use "
                f"{KEY}.type=jsonl_dataset_file with a .jsonl file."
            ) from None
        except (FileNotFoundError, ValueError) as exc:
            # Unknown split or config name, a folder without data files, a hub id that does not exist.
            hint = "" if self.is_local else " (no such folder in the working directory or the YAML's folder)"
            raise UserError(f"{what}{hint}, split {split!r}, dataset_name {self.dataset_name!r}: {exc}") from None
        except Exception as exc:  # `datasets` wraps a bad data file (not UTF-8, broken JSON) in its own errors
            cause = exc.__cause__ or exc.__context__ or exc
            detail = " ".join(f"{type(cause).__name__}: {cause}".split())[:400]
            if isinstance(cause, UnicodeDecodeError):
                detail += " (the file is not UTF-8 text; save it as UTF-8)"
            raise UserError(f"{what}, split {split!r}: cannot read the data files: {detail}") from None


def _resolve_dataset_path(value: str, base_dir: Path) -> tuple[str, bool]:
    """A local folder (against cwd, then the YAML's folder) when one exists; otherwise the string as given."""
    path = Path(value).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, base_dir / path]
    for candidate in candidates:
        if candidate.is_dir():
            return str(candidate.resolve()), True
    return value, False
