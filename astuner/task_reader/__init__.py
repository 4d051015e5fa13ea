"""Task readers: turn a dataset source into `Task`s, chosen by `astuner.task_reader.type`.

Importing this package is light: `datasets` and `pyarrow` are imported only when a reader reads.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from astuner.errors import UserError
from astuner.task_reader.base import KEY, TaskReader
from astuner.task_reader.env_service_reader import EnvServiceTaskReader
from astuner.task_reader.hf_reader import HuggingFaceTaskReader
from astuner.task_reader.jsonl_reader import JsonlTaskReader
from astuner.task_reader.openenv_reader import OpenEnvTaskReader
from astuner.task_reader.reasoning_gym_reader import ReasoningGymTaskReader
from astuner.task_reader.textarena_reader import TextArenaTaskReader
from astuner.task_reader.verifiers_reader import VerifiersTaskReader

TASK_READERS: dict[str, type[TaskReader]] = {
    "jsonl_dataset_file": JsonlTaskReader,
    "huggingface_dat_repo": HuggingFaceTaskReader,
    "env_service": EnvServiceTaskReader,
    "reasoning_gym": ReasoningGymTaskReader,
    "textarena": TextArenaTaskReader,
    "openenv": OpenEnvTaskReader,
    "verifiers": VerifiersTaskReader,
}

__all__ = ["TASK_READERS", "TaskReader", "build_task_reader", "first_samples"]


def build_task_reader(cfg: Any, base_dir: Path) -> TaskReader:
    """The reader named by `cfg.astuner.task_reader.type`; relative paths resolve against cwd, then `base_dir`."""
    reader_cfg = cfg.astuner.task_reader
    kind = str(reader_cfg.type)
    if kind not in TASK_READERS:
        close = difflib.get_close_matches(kind, TASK_READERS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UserError(f"{KEY}.type={kind!r} is not a task reader; use one of {', '.join(TASK_READERS)}.{hint}")
    reader = TASK_READERS[kind](reader_cfg, Path(base_dir))
    seed = getattr(cfg.astuner, "seed", None)  # a bare reader config (tests, tune's preview) has none
    if seed is not None:
        reader.run_seed = int(seed)
    data = getattr(cfg.astuner, "data", None)
    if data is None or (data.train_max_samples, data.val_max_samples) == (-1, -1):
        return reader
    return CappedReader(reader, data.train_max_samples, data.val_max_samples, bool(data.shuffle), reader.run_seed)


def first_samples(tasks: list, limit: int, shuffle: bool, seed: int) -> list:
    """verl's data.train_max_samples / val_max_samples: all of `tasks` when `limit` is -1 or not below their
    count; else `limit` of them, drawn without replacement with `seed` when `shuffle` (in their order), or the
    first `limit`."""
    if limit < 0 or limit >= len(tasks):
        return tasks
    if not shuffle:
        return tasks[:limit]
    import random

    return [tasks[i] for i in sorted(random.Random(seed).sample(range(len(tasks)), limit))]


class CappedReader:
    """A reader's tasks under astuner.data.train_max_samples / val_max_samples (`first_samples`)."""

    def __init__(self, reader: TaskReader, train_max: int, val_max: int, shuffle: bool, seed: int) -> None:
        self.reader, self.train_max, self.val_max, self.shuffle, self.seed = reader, train_max, val_max, shuffle, seed

    def training_tasks(self) -> list:
        return first_samples(self.reader.training_tasks(), self.train_max, self.shuffle, self.seed)

    def validation_tasks(self) -> list:
        return first_samples(self.reader.validation_tasks(), self.val_max, self.shuffle, self.seed)
