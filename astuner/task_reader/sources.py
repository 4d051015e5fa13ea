"""Where a run's batches come from, by the catalog's `data` (algorithm/catalog.py): `runtime.prepare` reads
through one of these, so a GRPO run and an offline one are set up by the same steps.

    WorkflowTasks    "rollouts": the task reader's tasks, rolled out by the workflow
    OfflineExamples  "conversations" | "pairs": astuner.offline_data's jsonl rows, tokenized by the chat renderer
                     into `Example`s or `Pair`s (task_reader/offline_data.py)

Each is read in two moves, so bad data stops a run before the model is read: `read()` (files and rows) first,
`encode(chat_text, max_len)` (what needs the tokenizer) once the model's limits are known.
"""

from __future__ import annotations

import logging
from pathlib import Path

from astuner.errors import UserError
from astuner.task_reader import build_task_reader

log = logging.getLogger(__name__)


class WorkflowTasks:
    """Tasks for the workflow to roll out; the turn cap is the rollout's per-turn response length."""

    runs_workflow = True

    def __init__(self, typed, config_dir: Path, data: str) -> None:
        self.typed, self.config_dir = typed, config_dir
        self.turn_cap = typed.astuner.rollout.max_response_length_in_one_turn

    def read(self) -> None:
        reader = build_task_reader(self.typed, self.config_dir)
        self.train, self.val = reader.training_tasks(), reader.validation_tasks()
        log.info("tasks: %d training, %d validation", len(self.train), len(self.val))

    def encode(self, chat_text, max_len: int) -> tuple[list, list]:
        return self.train, self.val

    def describe(self) -> str:
        return ""


class OfflineExamples:
    """astuner.offline_data's conversations or pairs; whole conversations, so no per-turn cap."""

    runs_workflow = False
    turn_cap = 1
    KEY = "astuner.offline_data"

    def __init__(self, typed, config_dir: Path, data: str) -> None:
        self.typed, self.config_dir, self.data = typed, config_dir, data

    def _path(self, value: str) -> Path:
        return Path(value) if Path(value).is_absolute() else self.config_dir / value

    def read(self) -> None:
        from astuner.task_reader.offline_data import read_rows

        files = self.typed.astuner.offline_data
        kind = self.typed.astuner.trainer_common.algorithm.type
        if files.train_file is None:
            raise UserError(f"{self.KEY}.train_file is not set: algorithm.type {kind} trains on a jsonl of "
                            "conversations (format in the default config's doc of offline_data.train_file)")
        self.files = {f"{self.KEY}.{name}": self._path(value) for name, value in
                      (("train_file", files.train_file), ("val_file", files.val_file)) if value}
        self.rows = {key: read_rows(path, key) for key, path in self.files.items()}

    def encode(self, chat_text, max_len: int) -> tuple[list, list]:
        """`chat_text()`: (the rollouts' chat renderer, the texts that end an assistant turn)."""
        from astuner.task_reader.offline_data import encode_rows

        renderer, end_texts = chat_text()
        out = {}
        for key, rows in self.rows.items():
            items, dropped = encode_rows(rows, self.files[key], self.data, renderer, end_texts, max_len, key)
            if dropped["too_long"]:
                log.warning("%s: %d of %d rows are longer than max_model_len=%d tokens and are left out", key,
                            dropped["too_long"], dropped["too_long"] + len(items), max_len)
            out[key] = items
        self.train, self.val = out[f"{self.KEY}.train_file"], out.get(f"{self.KEY}.val_file", [])
        return self.train, self.val

    def describe(self) -> str:
        return (f"{self.typed.astuner.trainer_common.algorithm.type}: {len(self.train)} training and {len(self.val)} "
                f"validation {self.data}, {self.typed.astuner.data.train_batch_size} per step\n")


# The catalog's `data` -> its source.
DATA_SOURCES = {"rollouts": WorkflowTasks, "conversations": OfflineExamples, "pairs": OfflineExamples}
