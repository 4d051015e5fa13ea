"""The log viewer's web app: JSON endpoints over the runs under a folder, and one static page.

  GET /                                   the page (static/index.html: runs -> steps -> episodes -> episode)
  GET /api/runs                           runs under the root: a folder holding metrics.jsonl or logview.sqlite
  GET /api/runs/{run}/metrics             metrics.jsonl rows (a torn last line of a live run is skipped)
  GET /api/runs/{run}/steps               per (split, step): episodes, mean reward, success rate, flagged
  GET /api/runs/{run}/episodes            ?split=train&step=N&flag=&min_reward=&max_reward=&sort=&page=&page_size=
  GET /api/runs/{run}/episodes/{id}       one episode: calls with messages, reply and token-level data
Run ids are paths relative to the root, checked against the runs found there (nothing outside it is served).
Every request opens the SQLite file read-only, so the viewer follows a live run and never blocks its writer.
"""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

from astuner.logview import store
from astuner.uvicorn_thread import UvicornThread

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
MAX_DEPTH = 3
MAX_PAGE_SIZE = 200


def find_runs(root: Path) -> dict[str, Path]:
    """Run id -> folder, for the root itself and folders below it (to MAX_DEPTH levels)."""
    root = root.resolve()
    runs: dict[str, Path] = {}

    def visit(folder: Path, depth: int) -> None:
        if (folder / "metrics.jsonl").is_file() or (folder / store.FILE_NAME).is_file():
            # The root itself is named by its folder name ("." does not survive URL normalisation).
            runs[folder.relative_to(root).as_posix() if folder != root else (root.name or "run")] = folder
        if depth < MAX_DEPTH:
            try:
                children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
            except OSError:
                return
            for child in children:
                if child.name not in ("tensorboard", "trajectories") and not child.name.startswith("global_step_"):
                    visit(child, depth + 1)

    visit(root, 0)
    return runs


def read_metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # the line a live run is writing, or one cut by a kill
    return rows


def build_app(root: Path):
    """The viewer's Starlette app over the runs under `root`: the page and the JSON endpoints (module docstring)."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    api = _Endpoints(Path(root))
    return Starlette(routes=[
        Route("/", api.index),
        Route("/api/runs", api.runs),
        Route("/api/runs/{run:path}/metrics", api.metrics),
        Route("/api/runs/{run:path}/steps", api.steps),
        Route("/api/runs/{run:path}/episodes/{episode_id:int}", api.episode),
        Route("/api/runs/{run:path}/episodes", api.episodes),
    ])


def _json(content, status_code: int = 200):
    """A JSON response (starlette is imported when the viewer serves, not with this module)."""
    from starlette.responses import JSONResponse

    return JSONResponse(content, status_code)


def _missing(what: str):
    return _json({"error": f"{what} not found"}, 404)


def _query_store(folder: Path, query, empty):
    """query(connection) on the run's store, read-only and closed after; `empty` when it has none yet."""
    path = folder / store.FILE_NAME
    if not path.is_file():
        return empty
    conn = store.connect(path, readonly=True)
    try:
        return query(conn)
    finally:
        conn.close()


class _Endpoints:
    """The route handlers of `build_app`: the runs under `root` are found again on every request."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def run_folder(self, request) -> Path | None:
        return find_runs(self.root).get(request.path_params["run"])

    async def index(self, request):
        from starlette.responses import FileResponse

        return FileResponse(STATIC / "index.html")

    async def runs(self, request):
        out = []
        for run_id, folder in find_runs(self.root).items():
            metrics = read_metrics(folder)
            last = max((m.get("step", 0) for m in metrics), default=0)
            out.append({"id": run_id, "name": folder.name,
                        "steps": last, "has_trajectories": (folder / store.FILE_NAME).is_file(),
                        "modified": (folder / "metrics.jsonl").stat().st_mtime
                        if (folder / "metrics.jsonl").is_file() else None})
        return _json({"root": str(self.root.resolve()), "runs": out})

    async def metrics(self, request):
        folder = self.run_folder(request)
        return _missing("run") if folder is None else _json({"rows": read_metrics(folder)})

    async def steps(self, request):
        folder = self.run_folder(request)
        if folder is None:
            return _missing("run")
        return _json({"steps": _query_store(folder, store.steps, [])})

    async def episodes(self, request):
        folder = self.run_folder(request)
        if folder is None:
            return _missing("run")
        q = request.query_params
        try:
            step = int(q.get("step", "0"))
            page = max(int(q.get("page", "0")), 0)
            page_size = min(max(int(q.get("page_size", "50")), 1), MAX_PAGE_SIZE)
            min_reward = float(q["min_reward"]) if q.get("min_reward") not in (None, "") else None
            max_reward = float(q["max_reward"]) if q.get("max_reward") not in (None, "") else None
        except ValueError as exc:
            return _json({"error": f"bad query: {exc}"}, 400)
        sort = q.get("sort", "idx")
        if sort not in store.SORTS:
            return _json({"error": f"sort must be one of {', '.join(store.SORTS)}"}, 400)
        return _json(_query_store(
            folder,
            lambda conn: store.episodes(conn, q.get("split", "train"), step, flag=q.get("flag") or None,
                                        min_reward=min_reward, max_reward=max_reward, sort=sort, page=page,
                                        page_size=page_size),
            {"total": 0, "page": 0, "page_size": page_size, "items": [], "flags": []}))

    async def episode(self, request):
        folder = self.run_folder(request)
        if folder is None:
            return _missing("run")
        found = _query_store(folder, lambda conn: store.episode(conn, int(request.path_params["episode_id"])), None)
        return _missing("episode") if found is None else _json(found)


class LogViewServer:
    """uvicorn on 127.0.0.1 in a daemon thread (beside a run), or in the foreground (`astuner logview`)."""

    def __init__(self, root: Path, port: int = 0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind(("127.0.0.1", int(port)))
        except OSError as exc:
            from astuner.errors import UserError

            raise UserError(f"the log viewer cannot listen on 127.0.0.1:{port} ({exc.strerror}); set "
                            "astuner.logview.port to a free port, or 0 for any free port") from None
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        self._uvicorn = UvicornThread(build_app(root), self.sock, self.url, "astuner-logview", "the log viewer")

    def start(self, timeout: float = 15.0) -> str:
        return self._uvicorn.start(timeout)

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C interrupts the wait)."""
        self._uvicorn.wait()

    def stop(self) -> None:
        self._uvicorn.stop()
