"""What every task reader shares: the interface, path resolution and the row -> Task mapping.

A row becomes `Task(task_id, main_query, init_messages, metadata)`:
  main_query     row[query_field], a non-empty string
  task_id        str(row[task_id_field]) when task_id_field is set, else "<split>-<row index>"
  init_messages  row["messages"] when it is a list of {role, content} dicts, else []
  metadata       the whole row, unchanged (ground truth such as GSM8K's `answer` stays here for the judge)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from astuner.errors import UserError
from astuner.types import Task

KEY = "astuner.task_reader"


class TaskReader:
    """Reads the training and validation tasks of a run. `reader_cfg` is the `astuner.task_reader` node;
    `run_seed` is `astuner.seed` (set by build_task_reader), for readers that generate their tasks."""

    run_seed: int = 42

    def __init__(self, reader_cfg: Any, base_dir: Path) -> None:
        self.base_dir = Path(base_dir)
        self.query_field = str(reader_cfg.query_field or "question")
        task_id_field = reader_cfg.task_id_field
        self.task_id_field = None if task_id_field is None else str(task_id_field)
        self._cache: dict[str, list[Task]] = {}

    def training_tasks(self) -> list[Task]:
        raise NotImplementedError

    def validation_tasks(self) -> list[Task]:
        """Empty when no validation source is configured."""
        raise NotImplementedError

    def _cached(self, key: str, load) -> list[Task]:
        # Readers are asked once per run in practice; caching keeps a second call from re-reading a big file.
        if key not in self._cache:
            self._cache[key] = load()
        return list(self._cache[key])

    def make_tasks(self, rows: Iterable[tuple[str, Any]], split: str, source: str) -> list[Task]:
        """Map (location, row) pairs to tasks; `location` ("line 3", "row 2") and `source` name bad rows."""
        tasks: list[Task] = []
        seen: dict[str, str] = {}
        for index, (location, row) in enumerate(rows):
            task = self._row_to_task(row, index, split, f"{source}, {location}")
            if task.task_id in seen:
                raise UserError(
                    f"{source}: task id {task.task_id!r} appears at {seen[task.task_id]} and again at {location}. "
                    f"Task ids must be unique because GRPO groups episodes by task id; fix the data or set "
                    f"{KEY}.task_id_field to a unique field (currently {self.task_id_field!r})."
                )
            seen[task.task_id] = location
            tasks.append(task)
        if not tasks:
            raise UserError(f"{source}: the dataset has no rows; give it at least one task.")
        return tasks

    def _row_to_task(self, row: Any, index: int, split: str, where: str) -> Task:
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected an object (a JSON object / dict row), got {type(row).__name__}.")
        query = row.get(self.query_field)
        if not isinstance(query, str) or not query.strip():
            state = "is missing" if query is None else f"must be a non-empty string, got {query!r}"[:200]
            raise UserError(
                f"{where}: field {self.query_field!r} {state} ({KEY}.query_field={self.query_field!r}). "
                f"The row has fields: {', '.join(map(str, row)) or '(none)'}."
            )
        if self.task_id_field is None:
            task_id = f"{split}-{index}"
        else:
            raw_id = row.get(self.task_id_field)
            if raw_id is None or str(raw_id) == "":
                raise UserError(
                    f"{where}: task id field {self.task_id_field!r} is missing or empty "
                    f"({KEY}.task_id_field={self.task_id_field!r}; set it to null to number rows instead). "
                    f"The row has fields: {', '.join(map(str, row))}."
                )
            task_id = str(raw_id)
        return Task(task_id=task_id, main_query=query, init_messages=_init_messages(row), metadata=row)



class SplitTaskReader(TaskReader):
    """A reader whose source is addressed by split names (a dataset, an environment service): subclasses set
    `training_split` / `validation_split` (None: no validation) and implement `_read(split)`."""

    training_split: str
    validation_split: str | None = None

    def training_tasks(self) -> list[Task]:
        return self._cached("train", lambda: self._read(self.training_split))

    def validation_tasks(self) -> list[Task]:
        if self.validation_split is None:
            return []
        return self._cached("validation", lambda: self._read(self.validation_split))

    def _read(self, split: str) -> list[Task]:
        raise NotImplementedError

def _init_messages(row: dict) -> list[dict[str, Any]]:
    messages = row.get("messages")
    if isinstance(messages, list) and messages and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        # Copies, so a workflow editing its messages cannot change the metadata the judge reads.
        return [dict(m) for m in messages]
    return []


def resolve_path(value: Any, base_dir: Path, key: str) -> Path:
    """A configured file path: absolute as is; relative against the working directory, then the YAML's folder."""
    path = Path(str(value)).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, Path(base_dir) / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    looked = ", ".join(str(c) for c in candidates)
    raise UserError(f"{key}={str(value)!r}: file not found (looked at {looked}).")


# A generated task set's validation tasks come from the same generators under another seed: never the training
# tasks again.
VALIDATION_SEED_OFFSET = 1_000_003


class SeededTaskReader(TaskReader):
    """A reader that generates its tasks from a seed (`section`: its config section, with `size`,
    `validation_size` and `seed`): training tasks from `seed` (null: astuner.seed), validation tasks from `seed +
    VALIDATION_SEED_OFFSET`; `_tasks(split, size, seed)` makes them."""

    section: Any

    @property
    def seed(self) -> int:
        return int(self.section.seed if self.section.seed is not None else self.run_seed)

    def _tasks(self, split: str, size: int, seed: int) -> list[Task]:
        raise NotImplementedError

    def training_tasks(self) -> list[Task]:
        return self._cached("train", lambda: self._tasks("train", self.section.size, self.seed))

    def validation_tasks(self) -> list[Task]:
        if not self.section.validation_size:
            return []
        return self._cached("validation", lambda: self._tasks(
            "validation", self.section.validation_size, self.seed + VALIDATION_SEED_OFFSET))
