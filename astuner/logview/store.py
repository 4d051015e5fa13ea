"""What the log viewer reads: one SQLite file per run (`<experiment_dir>/logview.sqlite`), written by the monitor.

The monitor appends one transaction per step (its episodes, and every LLM call with its token-level data), so
a viewer can read while the run writes (WAL mode) and a run killed mid-step still opens with every step it
finished. A resumed run deletes the steps after its checkpoint, as it does for metrics.jsonl. Metrics curves
come from metrics.jsonl itself.

Tables:
  episodes(id, split, step, idx, uid, task_id, query, reward, success, flags, error, seconds, n_calls,
           advantage, output)
  calls(episode_id, idx, agent, trainable, messages, response_text, finish_reason, flags, prompt_tokens,
        tokens, model, segment, context)
`model` is the model that served the call (astuner.models; "policy" in a one-model run; a store written before
the column existed reads "policy"). `segment` and `context`: the call's context (records.py; 0 and "" in an older
store); an episode read back links its context policy's calls (`records.link_contexts`).
`tokens` is JSON: {"ids", "text" (each token decoded alone), "logprob" (engine, as sampled), "trainer_logprob"
(the trainer's before the update, or null where the call was not trained), "mask" (1 = trained), "advantage"}.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any, Iterable

from astuner.logview.records import link_contexts

FILE_NAME = "logview.sqlite"

SCHEMA = """
CREATE TABLE IF NOT EXISTS episodes (
    id INTEGER PRIMARY KEY, split TEXT NOT NULL, step INTEGER NOT NULL, idx INTEGER NOT NULL, uid TEXT,
    task_id TEXT, query TEXT, reward REAL, success INTEGER, flags TEXT, error TEXT, seconds REAL,
    n_calls INTEGER, advantage REAL, output TEXT
);
CREATE INDEX IF NOT EXISTS episodes_by_step ON episodes (split, step, idx);
CREATE TABLE IF NOT EXISTS calls (
    episode_id INTEGER NOT NULL, idx INTEGER NOT NULL, agent TEXT, trainable INTEGER, messages TEXT,
    response_text TEXT, finish_reason TEXT, flags TEXT, prompt_tokens INTEGER, tokens TEXT, model TEXT,
    segment INTEGER, context TEXT, PRIMARY KEY (episode_id, idx)
);
"""


def connect(path: Path, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10, check_same_thread=False)
    else:
        conn = sqlite3.connect(path, timeout=30, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")  # readers never block the writer, nor it them
        conn.executescript(SCHEMA)
        columns = {row[1] for row in conn.execute("PRAGMA table_info(calls)")}
        for name, kind in (("model", "TEXT"), ("segment", "INTEGER"), ("context", "TEXT")):
            if name not in columns:  # a store an older version wrote, continued by a resumed run
                conn.execute(f"ALTER TABLE calls ADD COLUMN {name} {kind}")
    conn.row_factory = sqlite3.Row
    return conn


class StepWriter:
    """The monitor's side: one transaction per step."""

    def __init__(self, experiment_dir: Path, resume_step: int | None = None) -> None:
        self.path = Path(experiment_dir) / FILE_NAME
        if resume_step is None and self.path.exists():
            for suffix in ("", "-wal", "-shm"):  # a fresh run in a reused folder starts a fresh store
                Path(str(self.path) + suffix).unlink(missing_ok=True)
        self.conn = connect(self.path)
        if resume_step is not None:
            with self.conn:
                self.conn.execute("DELETE FROM calls WHERE episode_id IN (SELECT id FROM episodes WHERE step > ?)",
                                  (resume_step,))
                self.conn.execute("DELETE FROM episodes WHERE step > ?", (resume_step,))

    def write(self, split: str, step: int, episodes: Iterable[dict]) -> None:
        """`episodes`: records from `records.episode_records` (the monitor builds them)."""
        with self.conn:
            self.conn.execute("DELETE FROM calls WHERE episode_id IN (SELECT id FROM episodes "
                              "WHERE split = ? AND step = ?)", (split, step))
            self.conn.execute("DELETE FROM episodes WHERE split = ? AND step = ?", (split, step))
            for idx, ep in enumerate(episodes):
                cur = self.conn.execute(
                    "INSERT INTO episodes (split, step, idx, uid, task_id, query, reward, success, flags, error, "
                    "seconds, n_calls, advantage, output) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (split, step, idx, ep["uid"], ep["task_id"], ep["query"], ep["reward"], int(ep["success"]),
                     json.dumps(ep["flags"]), ep["error"], ep["seconds"], len(ep["calls"]), ep["advantage"],
                     json.dumps(ep["output"], ensure_ascii=False, default=str)))
                episode_id = cur.lastrowid
                self.conn.executemany(
                    "INSERT INTO calls (episode_id, idx, agent, trainable, messages, response_text, finish_reason, "
                    "flags, prompt_tokens, tokens, model, segment, context) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [(episode_id, i, c["agent"], int(c["trainable"]), json.dumps(c["messages"], ensure_ascii=False),
                      c["response_text"], c["finish_reason"], json.dumps(c["flags"]), c["prompt_tokens"],
                      json.dumps(c["tokens"], ensure_ascii=False), c.get("model", "policy"), c.get("segment", 0),
                      c.get("context", ""))
                     for i, c in enumerate(ep["calls"])])

    def close(self) -> None:
        self.conn.close()


# --- the viewer's side ------------------------------------------------------------------------------------

SORTS = {"idx": "idx", "reward": "reward", "-reward": "reward DESC", "seconds": "seconds",
         "-seconds": "seconds DESC", "calls": "n_calls", "-calls": "n_calls DESC"}


def steps(conn: sqlite3.Connection) -> list[dict]:
    rows = conn.execute(
        "SELECT split, step, COUNT(*) AS episodes, AVG(reward) AS reward_mean, AVG(success) AS success_rate, "
        "SUM(flags != '[]') AS flagged FROM episodes GROUP BY split, step ORDER BY step, split").fetchall()
    return [dict(r) for r in rows]


def episodes(conn: sqlite3.Connection, split: str, step: int, *, flag: str | None = None,
             min_reward: float | None = None, max_reward: float | None = None, sort: str = "idx",
             page: int = 0, page_size: int = 50) -> dict[str, Any]:
    where, args = ["split = ?", "step = ?"], [split, step]
    if flag == "none":
        where.append("flags = '[]'")
    elif flag:
        where.append("EXISTS (SELECT 1 FROM json_each(episodes.flags) WHERE value = ?)")
        args.append(flag)
    if min_reward is not None:
        where.append("reward >= ?")
        args.append(min_reward)
    if max_reward is not None:
        where.append("reward <= ?")
        args.append(max_reward)
    clause = " AND ".join(where)
    total = conn.execute(f"SELECT COUNT(*) FROM episodes WHERE {clause}", args).fetchone()[0]
    rows = conn.execute(
        f"SELECT id, idx, uid, task_id, query, reward, success, flags, error, seconds, n_calls, advantage "
        f"FROM episodes WHERE {clause} ORDER BY {SORTS[sort]}, idx LIMIT ? OFFSET ?",
        args + [page_size, page * page_size]).fetchall()
    items = []
    for r in rows:
        item = dict(r)
        item["flags"] = json.loads(item["flags"])
        item["success"] = bool(item["success"])
        item["error"] = (item["error"] or "").strip().splitlines()[-1:] or None
        item["error"] = item["error"][0] if item["error"] else None
        items.append(item)
    flags = [r[0] for r in conn.execute(
        "SELECT DISTINCT value FROM episodes, json_each(episodes.flags) WHERE split = ? AND step = ?",
        (split, step))]
    return {"total": total, "page": page, "page_size": page_size, "items": items, "flags": sorted(flags)}


def episode(conn: sqlite3.Connection, episode_id: int) -> dict | None:
    row = conn.execute("SELECT * FROM episodes WHERE id = ?", (episode_id,)).fetchone()
    if row is None:
        return None
    out = dict(row)
    out["flags"] = json.loads(out["flags"])
    out["output"] = json.loads(out["output"] or "{}")
    out["success"] = bool(out["success"])
    out["calls"] = []
    for c in conn.execute("SELECT * FROM calls WHERE episode_id = ? ORDER BY idx", (episode_id,)):
        call = dict(c)
        for key in ("messages", "flags", "tokens"):
            call[key] = json.loads(call[key])
        call["trainable"] = bool(call["trainable"])
        call["model"] = call.get("model") or "policy"
        call["segment"], call["context"] = call.get("segment") or 0, call.get("context") or ""
        out["calls"].append(call)
    link_contexts(out["calls"])
    return out
