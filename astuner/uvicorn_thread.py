"""uvicorn serving an ASGI app on an already bound socket, in a daemon thread: the log viewer and `astuner serve`."""

from __future__ import annotations

import threading
import time


class UvicornThread:
    def __init__(self, app, sock, url: str, name: str, what: str, **config) -> None:
        import uvicorn

        self.sock, self.url, self.name, self.what = sock, url, name, what
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                                    **config))
        self.thread: threading.Thread | None = None

    def start(self, timeout: float = 15.0) -> str:
        """Returns the URL once the server answers (a RuntimeError if it does not within `timeout`)."""
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name=self.name,
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.what} did not start on {self.url} within {timeout:g}s")
            time.sleep(0.01)
        return self.url

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C interrupts the wait)."""
        while self.thread is not None and self.thread.is_alive():
            self.thread.join(0.5)

    def stop(self, join_s: float = 5.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=join_s)
