"""The tutorial commands' fork server (tests/cli_forkserver.py): a child runs as a fresh `astuner` would, in the
client's folder, streams and exit code; signals reach it; a vanished client takes its child along; a command
whose environment differs runs in a fresh interpreter."""

from __future__ import annotations

import os
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def start_server(path: Path, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(HERE / "cli_forkserver.py"), str(path), "--no-preload"], env=env,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def server(tmp_path):
    path = tmp_path / "s.sock"
    proc = start_server(path)
    yield path
    proc.terminate()
    proc.wait(30)


def client_code(path: Path, args: list[str]) -> str:
    """A client's Python: prints "fresh" on stderr when the server sent it to a fresh interpreter."""
    return f"import sys; sys.path.insert(0, {str(HERE)!r}); from cli_forkserver import run_client; " \
           f"r = run_client({str(path)!r}, {args!r}); print('fresh' if r is None else '', file=sys.stderr); " \
           "sys.exit(0 if r is None else r)"


def client(path: Path, args: list[str], cwd: Path, merged: bool = False, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", client_code(path, args)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merged else subprocess.PIPE, text=True, **kw)


def serving(proc: subprocess.Popen) -> None:
    """Read the viewer's output until it names its address (or fail after 60 s)."""
    deadline = time.time() + 60
    while time.time() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1)
        if ready and "http://127.0.0.1:" in proc.stdout.readline():
            return
    raise AssertionError("the viewer named no address")


def test_a_child_has_the_clients_folder_streams_and_exit_code(server, tmp_path):
    (tmp_path / "here").mkdir()
    proc = client(server, ["eval", "--conf", "missing.yaml"], tmp_path / "here")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err  # a UserError's exit code, through the server
    # on the client's stderr, the path resolved in the client's folder
    assert f"config file {tmp_path / 'here' / 'missing.yaml'} does not exist" in err, err
    assert "fresh" not in err


def test_a_signal_reaches_the_child_and_a_vanished_clients_child_ends(server, tmp_path):
    runs = tmp_path / "runs"
    (runs / "a").mkdir(parents=True)
    (runs / "a" / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = client(server, ["logview", str(runs), "--port", "0"], tmp_path, merged=True)
    serving(proc)
    (child,) = _children_of_server(server)
    proc.send_signal(signal.SIGTERM)  # forwarded: the viewer stops as it does on SIGTERM
    assert proc.wait(60) in (0, 143)
    assert not _alive(child)

    proc = client(server, ["logview", str(runs), "--port", "0"], tmp_path, merged=True)
    serving(proc)
    children = _children_of_server(server)
    assert len(children) == 1
    proc.kill()  # the client is gone: the server ends its child's session
    deadline = time.time() + 30
    while time.time() < deadline and _alive(children[0]):
        time.sleep(0.2)
    assert not _alive(children[0])


def test_another_environment_runs_a_fresh_interpreter(server, tmp_path):
    proc = client(server, ["--help"], tmp_path, env={**os.environ, "HF_HOME": str(tmp_path)})
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "fresh" in err  # HF_HOME is read at import: the server's would be wrong


def test_a_command_from_bash_in_an_activated_environment_is_forked(tmp_path):
    """`. .venv/bin/activate` exports PS1, which a non-interactive bash (the tutorial scripts') drops: the server,
    started with the activated environment, still serves the command."""
    env = {**os.environ, "PS1": "(.venv) $ "}
    path = tmp_path / "s.sock"
    proc = start_server(path, env)
    try:
        done = subprocess.run(["bash", "-c", f"{sys.executable} -c {shlex.quote(client_code(path, ['--help']))}"],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "fresh" not in done.stderr, done.stderr
    finally:
        proc.terminate()
        proc.wait(30)


def _children_of_server(path: Path) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid,ppid,args", "--width", "4000"], capture_output=True,
                         text=True).stdout.splitlines()[1:]
    server = [int(line.split()[0]) for line in out if str(path) in line and "cli_forkserver.py" in line]
    return [int(line.split()[0]) for line in out if int(line.split()[1]) in server]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
