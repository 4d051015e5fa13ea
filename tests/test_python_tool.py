"""The Python tool: output, timeout, memory limit, scratch directory, what the code can read, AgentScope
registration."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from astuner.tools import bubblewrap, execute_python_code, failures, python_exec, run_python
from astuner.tools.python_exec import SandboxRefused, describe_sandbox, sandbox_level

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")


def run(coro):
    return asyncio.run(coro)


def force_level(monkeypatch, level: str):
    """Makes run_python use `level`; returns the process level's plan (user, landlock) or None for bubblewrap.
    The process level runs as if bubblewrap were not installed and the fallback opted in. As root, where uid 65534
    cannot run this interpreter (pyenv's, under /root) the plan would fall to root; a system Python that uid can run
    then stands in, when there is one, so the checks see that level as it runs."""
    if level == "bubblewrap":
        if sandbox_level() != "bubblewrap":
            pytest.fail("bubblewrap is not usable here: install it (apt-get install bubblewrap)")
        return None
    no_bubblewrap(monkeypatch)
    monkeypatch.setattr(python_exec, "_allow_unsandboxed", True)
    plan = python_exec._process_plan(sys.executable, True)
    for candidate in SYSTEM_PYTHONS if plan.user in ("", "root") else ():
        if os.path.exists(candidate) and python_exec._process_plan(candidate, True).user == "nobody":
            monkeypatch.setattr(sys, "executable", candidate)
            return python_exec._process_plan(candidate, True)
    return plan


def no_bubblewrap(monkeypatch):
    """The sandbox as on a machine without bwrap."""
    monkeypatch.setattr(python_exec, "sandbox_level", lambda: "process")
    monkeypatch.setattr(python_exec, "_bubblewrap_problem", lambda: bubblewrap.NOT_INSTALLED)


def test_prints_output_and_stderr():
    result = run(run_python("import sys\nprint(6 * 12)\nprint('oops', file=sys.stderr)"))
    assert result.returncode == 0 and not result.timed_out
    assert result.stdout == "72\n"
    assert result.stderr == "oops\n"


def test_exception_gives_nonzero_returncode():
    result = run(run_python("raise ValueError('bad input')"))
    assert result.returncode == 1
    assert "ValueError: bad input" in result.stderr


def test_timeout_kills_fast_and_keeps_partial_output():
    started = time.monotonic()
    result = run(run_python("print('before', flush=True)\nwhile True:\n    pass", timeout=0.5))
    assert time.monotonic() - started < 5
    assert result.timed_out and result.returncode != 0
    assert result.stdout == "before\n"
    assert "TimeoutError" in result.stderr


def _processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds `marker` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes() and _alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _settle(check, seconds=3.0):
    deadline = time.monotonic() + seconds
    while check() and time.monotonic() < deadline:
        time.sleep(0.1)
    return check()


def test_ci_runs_the_strong_sandbox():
    # CI installs bubblewrap (.ci/run): the escape tests below must run against the real isolation there.
    if os.environ.get("CI"):
        assert sandbox_level() == "bubblewrap", describe_sandbox()
    assert sandbox_level() in describe_sandbox()


def test_timeout_kills_child_processes_too():
    marker = f"astuner-child-{uuid.uuid4().hex}"
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'])\n"
        "time.sleep(60)\n"
    )
    result = run(run_python(code, timeout=1.0))
    assert result.timed_out
    assert _settle(lambda: _processes_with(marker)) == []


def test_escape_detached_grandchild_does_not_outlive_the_call():
    # Double fork + setsid: the grandchild leaves the process group that a group kill would reach.
    marker = f"astuner-detached-{uuid.uuid4().hex}"
    code = (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'])\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    result = run(run_python(code, timeout=5.0))
    assert result.stdout == "parent done\n"
    if sandbox_level() == "bubblewrap":
        assert _settle(lambda: _processes_with(marker)) == []
    else:  # the process level cannot catch it (its docstring says so); clean up after the test
        for pid in _processes_with(marker):
            os.kill(pid, 9)


def test_escape_reading_the_parents_environment(monkeypatch):
    secret = f"astuner-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("ASTUNER_TEST_TOKEN", secret)
    code = (
        "import glob, os\n"
        "found = []\n"
        "for path in glob.glob('/proc/*/environ') + [f'/proc/{os.getppid()}/environ']:\n"
        "    try:\n"
        "        found.append(open(path, 'rb').read())\n"
        "    except OSError:\n"
        "        pass\n"
        "print(any(b'astuner-secret' in f for f in found), 'ASTUNER_TEST_TOKEN' in os.environ)\n"
    )
    result = run(run_python(code))
    assert result.returncode == 0, result.stderr
    if sandbox_level() == "bubblewrap":
        assert result.stdout.strip() == "False False"
    else:
        assert result.stdout.strip().endswith("False")  # at least the environment itself is scrubbed


def test_escape_fork_bomb_is_limited():
    code = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while n < 1000:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(5)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as exc:\n"
        "    print('limited', n)\n"
    )
    result = run(run_python(code, timeout=10.0))
    assert result.stdout.startswith("limited"), result
    assert int(result.stdout.split()[1]) <= 100


def test_escape_writing_outside_the_scratch_folder(tmp_path):
    target = tmp_path / "escaped.txt"
    tmp_path.chmod(0o777)  # writable for anyone: only the sandbox may stop the write
    result = run(run_python(f"open({str(target)!r}, 'w').write('x')\nprint('wrote')"))
    if sandbox_level() == "bubblewrap":
        assert not target.exists() and "wrote" not in result.stdout
    assert run(run_python("open('scratch.txt', 'w').write('ok'); print(open('scratch.txt').read())")).stdout == "ok\n"


def test_escape_opening_a_socket():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    result = run(run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')"))
    if sandbox_level() == "bubblewrap":
        assert "in" not in result.stdout and result.returncode != 0
        with pytest.raises(OSError):
            listener.accept()
    listener.close()


@pytest.mark.parametrize("level", ["bubblewrap", "process"])
def test_exit_while_a_child_holds_the_output_returns_at_once(monkeypatch, level):
    force_level(monkeypatch, level)
    started = time.monotonic()
    code = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\nsys.exit(3)"
    result = run(run_python(code, timeout=10.0))
    assert time.monotonic() - started < 5
    assert result.returncode == 3 and not result.timed_out


@pytest.fixture
def users_files():
    """What model code must not read: the data set and YAML of a project in a home only its owner may enter, a file
    in that home, a data set in another checkout anyone may read, and this checkout. Made outside /tmp (which the
    bubblewrap sandbox replaces anyway), in this checkout: beside the venv, when the venv lives here."""
    base = Path(tempfile.mkdtemp(prefix=".sandbox-test-", dir=REPO))
    try:
        base.chmod(0o755)
        home, other = base / "home", base / "other_checkout"
        (home / "project" / "data").mkdir(parents=True)
        (other / "data").mkdir(parents=True)
        paths = {
            "yaml beside the data": home / "project" / "run.yaml",
            "dataset beside the yaml": home / "project" / "data" / "train.jsonl",
            "file in $HOME": home / ".netrc",
            "another checkout": other / "data" / "train.jsonl",
            "this checkout": REPO / "pyproject.toml",
        }
        for path in paths.values():
            if not path.exists():
                path.write_text('{"question": "6 * 7", "answer": "42"}\n')
            path.chmod(0o644)
        for folder in (home / "project", home / "project" / "data", other, other / "data"):
            folder.chmod(0o755)
        home.chmod(0o700)
        paths["listing of $HOME"] = home
        paths["listing of the project"] = home / "project"
        yield {name: str(path) for name, path in paths.items()}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _read_all(paths: dict[str, str]) -> tuple[int, dict[str, object]]:
    """(the snippet's uid, what it could read of each path: its text or listing, None where refused or absent)."""
    code = (
        "import json, os\n"
        "found = {}\n"
        f"for name, path in {paths!r}.items():\n"
        "    try:\n"
        "        found[name] = os.listdir(path) if os.path.isdir(path) else open(path).read()\n"
        "    except OSError:\n"
        "        found[name] = None\n"
        "print(json.dumps([os.getuid(), found]))\n"
    )
    result = run(run_python(code))
    assert result.returncode == 0 and result.stderr == "", result
    uid, found = json.loads(result.stdout)
    return uid, found


def test_bubblewrap_shows_model_code_nothing_of_the_users(monkeypatch, users_files):
    force_level(monkeypatch, "bubblewrap")
    uid, found = _read_all(users_files)
    assert {name: text for name, text in found.items() if text is not None} == {}
    assert uid != 0
    description = describe_sandbox()
    assert "no home, no project, no data" in description and sys.prefix in description


@pytest.fixture
def fresh_plans():
    python_exec._process_plan.cache_clear()
    yield
    python_exec._process_plan.cache_clear()


def test_the_start_up_plan_describes_the_configs_setting_and_leaves_the_process_alone(
        monkeypatch, fresh_plans, tmp_path, tiny_model_dir):
    """The start-up block describes the sandbox the config asks for (python_tool_unsandboxed), without setting it
    in the process that plans: only a process that runs episodes does (runtime.configure_tools)."""
    from test_run_contract import write_run

    from astuner.config import load_config
    from astuner.runtime import prepare

    no_bubblewrap(monkeypatch)
    yaml = str(write_run(tmp_path, tiny_model_dir))
    opted = prepare(load_config(yaml, ["astuner.rollout.python_tool_unsandboxed=true"])).plan.sandbox
    assert "process level" in opted and "THE NETWORK IS REACHABLE" in opted
    assert python_exec._allow_unsandboxed is False and describe_sandbox().startswith("python tool sandbox: REFUSED")
    assert prepare(load_config(yaml, [])).plan.sandbox.startswith("REFUSED: bubblewrap is not installed")


@pytest.mark.parametrize("landlock", ["as the kernel has it", "without"])
def test_process_level_shows_model_code_nothing_of_the_users(monkeypatch, users_files, fresh_plans, landlock):
    if landlock == "without":
        monkeypatch.setattr(python_exec, "_landlock_abi", lambda: 0)
    plan = force_level(monkeypatch, "process")
    description = describe_sandbox()
    uid, found = _read_all(users_files)
    read = {name for name, text in found.items() if text is not None}
    assert uid != 0
    if plan.landlock:  # reads limited to the interpreter and the system, whoever owns the files
        assert read == set() and "Landlock limits its reads" in description
    elif plan.user == "nobody":  # what only the owner may read is out of reach; the start-up line names the rest
        assert not read & {"yaml beside the data", "dataset beside the yaml", "file in $HOME", "listing of $HOME"}
        assert "WORLD-READABLE FILES ARE READABLE" in description
    else:  # not root, no Landlock: the code runs as the user, and the start-up line says so
        assert "YOUR FILES ARE READABLE" in description


def test_process_fallback_is_refused_unless_opted_in(monkeypatch, fresh_plans):
    # Without bubblewrap, model code would run on this machine's network and (not as root) as the user who can
    # kill the run: refused, and the start-up line says why and how to get bubblewrap.
    no_bubblewrap(monkeypatch)
    description = describe_sandbox()
    assert description.startswith("python tool sandbox: REFUSED: bubblewrap is not installed")
    assert "apt-get install bubblewrap" in description and "python_tool_unsandboxed: true" in description
    assert "loopback" in description
    with failures.for_episode() as health, pytest.raises(SandboxRefused, match="apt-get install bubblewrap"):
        run(run_python("print(1)"))
    assert len(health.failures) == 1 and health.started == 0  # the episode learns it: not a tool result

    monkeypatch.setattr(python_exec, "_allow_unsandboxed", True)
    opted_in = describe_sandbox()
    assert "process level" in opted_in and "THE NETWORK IS REACHABLE" in opted_in
    if os.geteuid() == 0:
        # uid 65534 cannot start the interpreter (as with pyenv under /root): opted in, root is the last resort.
        monkeypatch.setattr(python_exec, "_probe_process", lambda exe, user, landlock: "denied" * (user == "nobody"))
        python_exec._process_plan.cache_clear()
        assert "RUNS AS ROOT, UNSANDBOXED" in describe_sandbox()
        assert run(run_python("import os\nprint(os.getuid())")).stdout == "0\n"
    else:
        assert "IT CAN KILL THIS RUN" in opted_in
        assert run(run_python("print(1)")).stdout == "1\n"


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper (containers' init may be slow to reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_memory_limit():
    result = run(run_python("x = bytearray(2 * 1024 ** 3)\nprint('allocated')", memory_mb=256))
    assert result.returncode != 0
    assert "MemoryError" in result.stderr
    assert "allocated" not in result.stdout


def test_cwd_is_a_scratch_dir_and_files_do_not_persist():
    code = "import os\nopen('left_behind.txt', 'w').write('x')\nprint(os.getcwd())"
    result = run(run_python(code))
    assert result.returncode == 0
    cwd = Path(result.stdout.strip())
    assert cwd != Path.cwd() and REPO not in cwd.parents and cwd != REPO
    assert not cwd.exists()
    assert not (Path.cwd() / "left_behind.txt").exists()
    # Each run starts in an empty directory.
    assert run(run_python("import os\nprint(os.listdir('.'))")).stdout == "[]\n"


def test_stdin_closed_and_output_truncated():
    assert run(run_python("import sys\nprint(repr(sys.stdin.read()))")).stdout == "''\n"
    result = run(run_python("print('a' * 50000)\nprint('END')", max_output_chars=200))
    assert len(result.stdout) < 400
    assert "truncated" in result.stdout and result.stdout.rstrip().endswith("END")


def test_uses_this_interpreter():
    assert run(run_python("import sys\nprint(sys.executable)")).stdout.strip() == sys.executable


def test_execute_python_code_registers_with_agentscope():
    pytest.importorskip("agentscope")
    from agentscope.tool import Toolkit

    toolkit = Toolkit()
    toolkit.register_tool_function(execute_python_code)
    (schema,) = toolkit.get_json_schemas()
    function = schema["function"]
    assert function["name"] == "execute_python_code"
    assert function["parameters"]["required"] == ["code"]
    assert set(function["parameters"]["properties"]) == {"code", "timeout"}

    response = run(execute_python_code("print(6 * 12)", language="python"))  # invented kwargs are ignored
    text = response.content[0]["text"]
    assert text == "<returncode>0</returncode><stdout>72\n</stdout><stderr></stderr>"
