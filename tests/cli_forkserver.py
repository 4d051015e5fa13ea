"""A fork server for the tutorial commands' test (tests/test_tutorial_commands.py): `astuner` commands run in
children forked from one interpreter that has already imported the CLI, torch, transformers and AgentScope, so
each of the ~55 commands skips the ~6 s of imports a fresh interpreter spends on 2 cores.

A child is as a fresh `python -m astuner.cli` would be where the commands can tell: the client's argv, working
folder, environment and standard streams (passed as descriptors), its own session, default signal handlers, the
interpreter's normal exit (atexit handlers, non-daemon threads joined). The server is started with the scripts'
own environment, so what the imported libraries read from it at import (HF_HUB_OFFLINE, ...) is the same; the
stand-in runs a fresh interpreter instead when the environment differs, or when the server cannot be reached.
Variables the imports set (TORCHINDUCTOR_CACHE_DIR, ...) are set in each child as a fresh import would set them.

Protocol, one Unix-socket connection per command: the client sends one JSON line {argv, cwd, env} with its
descriptors 0, 1, 2; the server answers {"pid": N} once forked and {"exit": code} when the child ends (a signal
is 128 + its number). The client forwards SIGTERM, SIGINT and SIGHUP to the child; a client that disappears has its
child's session terminated. The server single-threaded (forking a threaded process is unsafe): one select loop.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import time

# Variables a shell or pytest sets by itself: the only ones a command's environment may differ in from the
# server's (the child gets the command's own). A non-interactive bash drops PS1 and PS2 and resets PS4, and
# `. .venv/bin/activate` (scripts/test.sh) exports PS1: without them here, every command ran a fresh interpreter.
SHELL_OWN = frozenset({"PWD", "OLDPWD", "SHLVL", "_", "PS1", "PS2", "PS4", "PYTEST_CURRENT_TEST"})


def same_environment(env: dict, server_env: dict) -> bool:
    strip = lambda e: {k: v for k, v in e.items() if k not in SHELL_OWN}  # noqa: E731
    return strip(env) == strip(server_env)


def preload() -> None:
    """What every command imports first; no thread may start here (the children are forked)."""
    import agentscope  # noqa: F401
    import torch  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import astuner.cli  # noqa: F401
    import threading

    assert threading.active_count() == 1, "a preloaded library started a thread: forking would be unsafe"


def serve(path: str):
    """Accept commands until SIGTERM; returns (argv, cwd, env) in a forked child, never in the server."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    added = {k: v for k, v in os.environ.items() if START_ENV.get(k) != v}  # set by the preloaded imports
    children: dict[int, socket.socket] = {}  # pid -> the client's connection
    doomed: dict[int, float] = {}  # pid -> when to SIGKILL the session of a child whose client vanished
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    try:
        while True:
            for key, _ in selector.select(timeout=0.1):
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                    request = json.loads(message.decode())
                    if not same_environment(request["env"], START_ENV):
                        differs = sorted(k for k in {*request["env"], *START_ENV} - SHELL_OWN
                                         if request["env"].get(k) != START_ENV.get(k))
                        conn.sendall(json.dumps({"fresh": True, "differs": differs}).encode() + b"\n")
                        conn.close()
                        for fd in fds:
                            os.close(fd)
                        continue
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        selector.close()
                        listener.close()
                        for other in children.values():
                            other.close()
                        conn.close()
                        signal.signal(signal.SIGTERM, signal.SIG_DFL)
                        os.setsid()
                        for target, fd in enumerate(fds):
                            os.dup2(fd, target)
                            os.close(fd)
                        return {**request, "env": {**request["env"], **added}}
                    for fd in fds:
                        os.close(fd)
                    children[pid] = conn
                    selector.register(conn, selectors.EVENT_READ, pid)
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                else:  # a client closed its end: it is gone, so is the reason for its child
                    pid = key.data
                    selector.unregister(key.fileobj)
                    if pid in children and pid not in doomed:
                        _signal_session(pid, signal.SIGTERM)
                        doomed[pid] = time.monotonic() + 15
            for pid, conn in list(children.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if not done:
                    if pid in doomed and time.monotonic() > doomed[pid]:
                        _signal_session(pid, signal.SIGKILL)
                    continue
                code = os.waitstatus_to_exitcode(status)
                try:
                    conn.sendall(json.dumps({"exit": code if code >= 0 else 128 - code}).encode() + b"\n")
                except OSError:
                    pass
                if pid not in doomed:
                    selector.unregister(conn)
                conn.close()
                children.pop(pid)
                doomed.pop(pid, None)
    finally:
        if os.getpid() == _SERVER_PID:
            for pid in children:
                _signal_session(pid, signal.SIGKILL)
            listener.close()


def _signal_session(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its own session: its group is its pid
    except ProcessLookupError:
        pass


def run_client(path: str, argv: list[str]) -> int | None:
    """Run `astuner argv` in a child of the server at `path`; None when it cannot (run a fresh interpreter)."""
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
    except OSError as error:
        print(f"astuner (test stand-in): a fresh interpreter; the fork server is not there ({error})", file=sys.stderr)
        return None
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    replies = conn.makefile("r")
    first = json.loads(replies.readline() or '{"fresh": true}')
    if first.get("fresh"):
        print(f"astuner (test stand-in): a fresh interpreter; the environment differs in {first.get('differs')}",
              file=sys.stderr)
        return None
    pid = first["pid"]

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    line = replies.readline()
    if not line:
        print("astuner (test stand-in): the fork server went away before the command ended", file=sys.stderr)
        return 1
    return int(json.loads(line)["exit"])


def _child(request: dict) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["astuner", *request["argv"]]
    from astuner.cli import main

    sys.exit(main(request["argv"]))


_SERVER_PID = os.getpid()
START_ENV = dict(os.environ)  # before the imports, which add their own variables (the children get those too)

if __name__ == "__main__":  # cli_forkserver.py SOCKET [--no-preload: its own test, which needs no torch]
    if "--no-preload" not in sys.argv:
        preload()
    job = serve(sys.argv[1])
    if job is not None:
        _child(job)
