"""The Python tool: output, timeout, memory limit, scratch directory, what the code can read, AgentScope
registration."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from astuner.tools import bubblewrap, execute_python_code, failures, python_exec, run_python
from astuner.tools.python_exec import SandboxRefused, SandboxUnavailable, describe_sandbox, sandbox_level

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


# --- the users we failed: a non-root user, a trainer's hundreds of threads, bombs, a sandbox that cannot start ---

SANDBOX_USER = "astuner-sandbox-test"
DISK_BOMB = """
import json, os
chunk = b"\\0" * (8 << 20)
def fill(folder):  # 4 x 200 MiB per folder: more than its cap, far less than the host has
    written = 0
    try:
        for i in range(4):
            with open(os.path.join(folder, f"bomb{i}"), "wb") as f:
                for _ in range(25):
                    f.write(chunk)
                    written += 8
    except OSError as exc:
        return [written, exc.strerror]
    return [written, None]
st = os.statvfs(".")
print(json.dumps({"tmp": fill("/tmp"), "work": fill("."), "dev": fill("/dev/shm"),
                  "work_fs_mib": st.f_blocks * st.f_frsize >> 20}))
open("one-more", "wb").write(chunk)  # uncaught: the model gets the error
"""
MEMORY_BOMB = "x = bytearray(2 * 1024 ** 3)\nprint('allocated')"
SNIPPETS = {"hello": "print(6 * 7)", "disk bomb": DISK_BOMB, "memory bomb": MEMORY_BOMB,
            "after the bombs": "print('the run goes on')"}
NON_ROOT_CHILD = """
import asyncio, json, sys, threading
sys.path.insert(0, sys.argv[1])
from astuner.tools import bubblewrap, failures, python_exec
stop = threading.Event()
for _ in range(300):  # what torch pools, tokenizers, vLLM and Ray hold in a trainer
    threading.Thread(target=stop.wait, daemon=True).start()
out = {"threads": threading.active_count(), "level": python_exec.sandbox_level(), "results": {}}
for name, code in json.loads(sys.argv[2]).items():
    result = asyncio.run(python_exec.run_python(code))
    out["results"][name] = [result.returncode, result.stdout, result.stderr]
python_exec._threads_of = lambda uid: 0  # RLIMIT_NPROC below the threads this user runs: bwrap cannot clone
with failures.for_episode() as health:
    try:
        out["undercounted"] = repr(asyncio.run(python_exec.run_python("print(1)")))
    except python_exec.SandboxUnavailable as exc:
        out["undercounted"] = str(exc)
out["undercounted_recorded"] = len(health.failures)
python_exec._bubblewrap_problem.cache_clear()  # the start-up probe runs under the same limits as a call
out["probe_undercounted"] = python_exec._bubblewrap_problem()
python_exec.sandbox_level = lambda: "process"
python_exec._bubblewrap_problem = lambda: bubblewrap.NOT_INSTALLED
out["without_bubblewrap"] = python_exec.describe_sandbox()
print(json.dumps(out))
"""


def _sandbox_user() -> tuple[int, int]:
    """(uid, gid) of a non-root user (made once, as CI runs as root), or this user's own when not root."""
    import pwd

    if os.geteuid() != 0:
        return os.getuid(), os.getgid()
    try:
        entry = pwd.getpwnam(SANDBOX_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SANDBOX_USER],
                       check=True)
        entry = pwd.getpwnam(SANDBOX_USER)
    return entry.pw_uid, entry.pw_gid


@pytest.fixture(scope="module")
def non_root_run():
    """SNIPPETS run by a non-root user's process holding 300 threads, with Debian's Python (the venv's links into
    /root, which only root may enter) and a copy of the package that user may read."""
    python = "/usr/bin/python3"
    if not os.path.exists(python):
        pytest.fail(f"{python} is missing: the non-root sandbox test runs the tool with the system's Python")
    uid, gid = _sandbox_user()
    base = Path(tempfile.mkdtemp(prefix="astuner-non-root-"))
    try:
        shutil.copytree(REPO / "astuner", base / "astuner", ignore=shutil.ignore_patterns("__pycache__"))
        for path in [base, *base.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        child = subprocess.run([python, "-c", NON_ROOT_CHILD, str(base), json.dumps(SNIPPETS)], cwd=base,
                               env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, user=uid, group=gid,
                               extra_groups=[], capture_output=True, text=True, timeout=240)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout)


def test_a_non_root_user_with_hundreds_of_threads_runs_code_under_bubblewrap(non_root_run):
    assert non_root_run["threads"] > 300 and non_root_run["level"] == "bubblewrap"
    assert non_root_run["results"]["hello"] == [0, "42\n", ""]


def _results(who: str, non_root_run) -> dict[str, list]:
    if who == "a non-root user":
        return non_root_run["results"]
    return {name: (lambda r: [r.returncode, r.stdout, r.stderr])(run(run_python(code)))
            for name, code in SNIPPETS.items()}


@pytest.mark.parametrize("who", ["astuner's user", "a non-root user"])
def test_disk_and_memory_bombs_are_contained_and_the_run_goes_on(who, request, monkeypatch):
    force_level(monkeypatch, "bubblewrap")
    results = _results(who, request.getfixturevalue("non_root_run") if who == "a non-root user" else None)
    returncode, stdout, stderr = results["disk bomb"]
    filled = json.loads(stdout)
    cap = python_exec._SCRATCH_BYTES >> 20
    assert filled["work_fs_mib"] == cap  # the working folder is the capped tmpfs, not the host's disk
    for folder in ("tmp", "work"):
        written, error = filled[folder]
        assert written <= cap and error == "No space left on device", filled
    assert filled["dev"][0] == 0  # /dev is a tmpfs too, with no cap: read-only
    assert returncode == 1 and "No space left on device" in stderr  # the model is told, as for any error
    returncode, stdout, stderr = results["memory bomb"]
    assert returncode != 0 and "MemoryError" in stderr and "allocated" not in stdout
    assert results["after the bombs"] == [0, "the run goes on\n", ""]


def test_the_rlimit_counts_threads_and_a_sandbox_that_cannot_start_is_not_a_tool_result(non_root_run):
    # With RLIMIT_NPROC below the user's threads (the old process count), bwrap cannot clone: the call raises
    # SandboxUnavailable quoting bwrap and recorded for the episode, instead of answering the model with it.
    assert "could not start" in non_root_run["undercounted"], non_root_run["undercounted"]
    assert "Resource temporarily unavailable" in non_root_run["undercounted"]
    assert non_root_run["undercounted_recorded"] == 1
    assert "Resource temporarily unavailable" in non_root_run["probe_undercounted"]  # start-up says so too


def test_a_non_root_user_without_bubblewrap_is_refused_naming_who_could_kill_the_run(non_root_run):
    description = non_root_run["without_bubblewrap"]
    assert description.startswith("python tool sandbox: REFUSED: bubblewrap is not installed")
    assert "able to kill this run" in description and "apt-get install bubblewrap" in description


def _broken_bubblewrap(monkeypatch):
    """bwrap that fails while building the sandbox, after it has started its child (a missing mount source)."""
    force_level(monkeypatch, "bubblewrap")
    real = bubblewrap.command
    monkeypatch.setattr(bubblewrap, "command", lambda *args: (lambda argv: [argv[0], "--ro-bind",
                        "/nonexistent-astuner-test", "/nonexistent", *argv[1:]])(real(*args)))


def test_a_sandbox_that_cannot_start_raises_and_the_episode_records_it(monkeypatch):
    _broken_bubblewrap(monkeypatch)
    with failures.for_episode() as health:
        with pytest.raises(SandboxUnavailable, match="nonexistent-astuner-test"):
            run(python_exec.python_tool_text("print(1)"))  # no bwrap error handed to the model as its output
    assert len(health.failures) == 1 and health.started == 0


def test_code_that_prints_a_sandbox_error_is_an_ordinary_tool_result():
    # Only a start that never happened is an infrastructure failure: the model cannot fake one to skip training.
    code = "import sys\nsys.stderr.write('bwrap: Creating new namespace failed: Resource temporarily unavailable')\n" \
           "sys.exit(1)"
    with failures.for_episode() as health:
        result = run(run_python(code))
    assert result.returncode == 1 and result.stderr.startswith("bwrap:")
    assert health.failures == [] and health.started == 1


def test_tool_infra_failures_flag_episodes_leave_them_out_of_training_and_repeated_stop_the_run(
        monkeypatch, demo_tokenizer):
    from astuner.errors import TrainingStalled
    from astuner.rollout import TOOL_INFRA_FAILURES_TO_STOP
    from astuner.types import FLAG_TOOL_INFRA_FAILED, Task
    from astuner.workflow import Workflow, WorkflowOutput
    from tests.test_rollout import runner

    class ToolAgent(Workflow):
        async def execute(self, workflow_task, model_tuner):
            await model_tuner.chat([{"role": "user", "content": "What is 2 + 2?"}])
            try:
                text = await python_exec.python_tool_text("print(2 + 2)")
            except Exception as exc:  # as agent frameworks do: the tool's error becomes its answer
                text = f"Error: {exc}"
            return WorkflowOutput(reward=1.0 if "<stdout>4" in text else 0.0)

    r, _ = runner(demo_tokenizer, ToolAgent, num_repeat=TOOL_INFRA_FAILURES_TO_STOP - 1, max_env_worker=1)
    assert all(e.trainable and e.reward == 1.0 for e in r.run([Task("t1", "2 + 2")]))
    _broken_bubblewrap(monkeypatch)
    episodes = r.run([Task("t2", "2 + 2")])
    assert all(FLAG_TOOL_INFRA_FAILED in e.flags and not e.trainable for e in episodes)
    assert "nonexistent-astuner-test" in episodes[0].error_summary
    with pytest.raises(TrainingStalled, match=f"{TOOL_INFRA_FAILURES_TO_STOP} episodes in a row.*nonexistent-astuner"):
        r.run([Task("t3", "2 + 2")])
    r.close()
