"""`env_service`: tasks listed by an environment service (protocol in `astuner/env_service.py`).

Each task row of `GET /tasks` becomes a Task: `task_id` and `query` from the row, the whole row as metadata,
plus `metadata["env_service"]` = {env_url, env_type, request_timeout, retries}, from which the workflow and
`EnvServiceJudge` build their client (`astuner.env_service.client_for(task)`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astuner.errors import UserError
from astuner.task_reader.base import KEY, SplitTaskReader
from astuner.types import Task

SECTION = f"{KEY}.env_service"


class EnvServiceTaskReader(SplitTaskReader):
    def __init__(self, reader_cfg: Any, base_dir: Path) -> None:
        super().__init__(reader_cfg, base_dir)
        from astuner.env_service import EnvServiceClient

        section = reader_cfg.env_service
        if not section.env_url:
            raise UserError(f"{SECTION}.env_url is not set; give the environment service's base URL, e.g. "
                            "http://127.0.0.1:8765 (tutorial/env_service/server.py starts one).")
        self.client = EnvServiceClient(section.env_url, section.env_type, section.request_timeout, section.retries)
        self.training_split = section.training_split
        self.validation_split = section.validation_split
        # The protocol's field names, whatever query_field/task_id_field say for file readers.
        self.query_field, self.task_id_field = "query", "task_id"

    def _read(self, split: str) -> list[Task]:
        from astuner.env_service import EnvServiceError

        try:
            rows = self.client.list_tasks(split)
        except EnvServiceError as exc:
            raise UserError(f"{SECTION}: {exc}") from None
        where = f"environment service {self.client.env_url} (env_type {self.client.env_type!r}, split {split!r})"
        tasks = self.make_tasks([(f"task {i}", row) for i, row in enumerate(rows)], split, where)
        link = {"env_url": self.client.env_url, "env_type": self.client.env_type,
                "request_timeout": self.client.request_timeout, "retries": self.client.retries}
        for task in tasks:
            task.metadata = {**task.metadata, "env_service": link}
        return tasks
