"""The Python tool's sandbox against hostile code and real users: a non-root user with a trainer's threads, disk,
memory, fork and memfd bombs bounded per call, concurrent calls kept apart, the model's timeout counted from the
snippet's start, old bubblewrap, and a sandbox that cannot start (not a tool result; repeated, it stops the run)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from astuner.tools import bubblewrap, failures, limits, python_exec, run_python
from astuner.tools.python_exec import SandboxUnavailable, describe_sandbox
from tests.test_python_tool import REPO, force_level, run

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
from astuner.tools import bubblewrap, failures, limits, python_exec
stop = threading.Event()
for _ in range(300):  # what torch pools, tokenizers, vLLM and Ray hold in a trainer
    threading.Thread(target=stop.wait, daemon=True).start()
out = {"threads": threading.active_count(), "level": python_exec.sandbox_level(), "results": {}}
for name, code in json.loads(sys.argv[2]).items():
    result = asyncio.run(python_exec.run_python(code))
    out["results"][name] = [result.returncode, result.stdout, result.stderr]
limits.threads_of = lambda uid: 0  # RLIMIT_NPROC below the threads this user runs: bwrap cannot clone
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




# --- one call's total: its own cgroup; concurrent calls apart --------------------------------------------------

FORK_AND_MEMFD_BOMB = """
import os, time
pids = []
for i in range(3):  # each child its own RLIMIT_AS: 3 x 700 MiB
    pid = os.fork()
    if pid == 0:
        b = bytearray(700 << 20)
        for j in range(0, len(b), 4096):
            b[j] = 1
        time.sleep(20)
        os._exit(0)
    pids.append(pid)
chunk = b"\\1" * (8 << 20)
for i in range(4):  # memfds: in no address space, no tmpfs cap, no process's RSS
    fd = os.memfd_create(f"m{i}")
    for _ in range(25):
        os.write(fd, chunk)
time.sleep(20)
print("held it all")
"""


def _calls_left() -> list[str]:
    parents = limits.cgroup_setup().parents
    return [entry for parent in parents for entry in os.listdir(parent) if os.path.isdir(os.path.join(parent, entry))]


def test_a_fork_and_memfd_bomb_is_bounded_by_the_calls_cgroup_and_the_run_goes_on(monkeypatch):
    force_level(monkeypatch, "bubblewrap")
    setup = limits.cgroup_setup()
    if os.geteuid() == 0:  # CI: root with writable cgroups (v1 memory and pids on its machine)
        assert setup.version in ("v1", "v2"), setup.why
    if not setup.version:  # a user without cgroups: the start-up line must not promise a total
        assert "NO TOTAL MEMORY BOUND" in describe_sandbox()
        return
    cap = (python_exec.DEFAULT_MEMORY_MB << 20) + 2 * python_exec._SCRATCH_BYTES
    assert f"at most {cap >> 20} MiB in all" in describe_sandbox() and f"cgroup ({setup.version})" in describe_sandbox()
    result = run(run_python(FORK_AND_MEMFD_BOMB, timeout=25))
    assert result.returncode != 0 and not result.timed_out and "held it all" not in result.stdout
    assert f"more than {cap >> 20} MiB in all" in result.stderr, result
    assert result.memory_peak_bytes is not None and result.memory_peak_bytes <= cap
    assert _calls_left() == []  # the call's cgroup is gone, with whatever ran in it
    assert run(run_python("print('the run goes on')")).stdout == "the run goes on\n"


def test_every_sandbox_process_is_the_oom_killers_first_choice_with_few_open_files():
    code = "import resource\nprint(open('/proc/self/oom_score_adj').read().strip(), " \
           "resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    assert run(run_python(code)).stdout == f"1000 {limits.OPEN_FILES}\n"


def test_without_a_cgroup_the_start_up_line_says_no_total_holds(monkeypatch):
    monkeypatch.setattr(limits, "cgroup_setup", lambda: limits.CgroupSetup("", why="no writable cgroup (test)"))
    line = describe_sandbox()
    assert "NO TOTAL MEMORY BOUND (no writable cgroup (test))" in line and "OOM killer picks the sandbox" in line
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "SHARED by this user's concurrent calls" in python_exec._who_and_bounds()


def test_cgroup_paths_are_read_from_proc():
    assert limits.own_cgroups("8:pids:/a\n4:memory:/p/x\n1:cpu,cpuacct:/\n0::/user.slice/s") == {
        "pids": "/a", "memory": "/p/x", "cpu": "/", "cpuacct": "/", "": "/user.slice/s"}
    mounts = "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0"
    assert limits.v1_mounts(mounts) == {"rw": "/sys/fs/cgroup/memory", "relatime": "/sys/fs/cgroup/memory",
                                        "memory": "/sys/fs/cgroup/memory"}


BOMB_HOLDING_THREADS = ("import os, time\nn = 0\ntry:\n    while n < 200:\n        if os.fork() == 0:\n"
                        "            time.sleep(3); os._exit(0)\n        n += 1\nexcept OSError: pass\n"
                        "print('held', n)\ntime.sleep(3)")
NEEDS_THREADS = ("import time, threading\ntime.sleep(1.0)\nts = [threading.Thread(target=time.sleep, args=(0.5,)) "
                 "for _ in range(8)]\nfor t in ts: t.start()\nprint('8 threads ok')")


@pytest.mark.slow
def test_a_fork_bomb_in_one_episode_leaves_another_episodes_threads_alone(monkeypatch):
    force_level(monkeypatch, "bubblewrap")

    async def both():
        async def bomb():
            await asyncio.sleep(0.3)  # starts after the other call's limits were set
            return await run_python(BOMB_HOLDING_THREADS, timeout=10)
        return await asyncio.gather(run_python(NEEDS_THREADS, timeout=10), bomb())

    victim, bomb = run(both())
    assert bomb.stdout.startswith("held")
    if os.geteuid() == 0 or limits.cgroup_setup().version:  # per-call uids (root) or per-call pids limits
        assert (victim.returncode, victim.stdout) == (0, "8 threads ok\n"), victim
    else:
        assert "SHARED" in describe_sandbox()


def test_the_proc_scan_and_the_set_up_run_off_the_event_loop(monkeypatch):
    threads = []
    real = limits.threads_of
    monkeypatch.setattr(limits, "threads_of", lambda uid: threads.append(threading.current_thread()) or real(uid))

    async def call():
        loop_thread = threading.current_thread()
        await run_python("print(1)")
        return loop_thread

    loop_thread = run(call())
    assert threads and loop_thread not in threads


# --- the model's timeout counts from the snippet's start -----------------------------------------------------

def _slow_start(monkeypatch, seconds: float):
    monkeypatch.setattr(python_exec, "_BOOT", f"import time; time.sleep({seconds}); " + python_exec._BOOT)


def test_the_models_timeout_counts_from_the_snippets_start(monkeypatch):
    _slow_start(monkeypatch, 1.0)  # bwrap and the interpreter slow to start (a loaded machine)
    with failures.for_episode() as health:
        result = run(python_exec.python_tool_text("print(1)", timeout=0.1))  # the model's smallest timeout
    assert "<stdout>1\n</stdout>" in result and health.failures == [] and health.started == 1


def test_a_start_past_the_start_up_limit_is_an_infrastructure_failure(monkeypatch):
    _slow_start(monkeypatch, 20)
    monkeypatch.setattr(python_exec, "STARTUP_LIMIT_S", 0.5)
    with failures.for_episode() as health, pytest.raises(SandboxUnavailable, match="within 0.5 s"):
        run(run_python("print(1)", timeout=5))
    assert len(health.failures) == 1


def test_bwraps_thread_limit_error_gets_the_ulimit_advice():
    error = python_exec._unavailable("bubblewrap", 1, "bwrap: Creating new namespace failed: Resource temporarily "
                                                      "unavailable")
    assert "ulimit -u" in str(error)


def test_an_old_bubblewrap_is_told_to_upgrade():
    assert bubblewrap.parse_version("bubblewrap 0.4.1\n") == (0, 4, 1)
    assert bubblewrap.parse_version("bubblewrap 0.10") == (0, 10, 0)
    assert bubblewrap.version_problem("bubblewrap 0.8.0") == "" and bubblewrap.version_problem("odd") == ""
    for old in ("bubblewrap 0.4.0", "bubblewrap 0.5.0"):  # Ubuntu 20.04; --perms but no --size
        problem = bubblewrap.version_problem(old)
        assert "is too old" in problem
        assert bubblewrap.how_to_enable(problem).startswith("upgrade bubblewrap to >= 0.6.0")
    unknown = "bubblewrap cannot run here (bwrap: Unknown option --size)"
    assert bubblewrap.how_to_enable(unknown).startswith("upgrade bubblewrap to >= 0.6.0")


# --- infrastructure failures in the rollout: flagged, not trained, counted per batch ---------------------------

@pytest.mark.slow
def test_tool_infra_failures_flag_episodes_and_only_whole_failed_batches_in_a_row_stop_the_run(
        monkeypatch, demo_tokenizer):
    from astuner.errors import TrainingStalled
    from astuner.rollout import TOOL_INFRA_BATCHES_TO_STOP
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

    # 8 episodes at once: one hiccup hits them all in the same second, and is still one batch, not a stop.
    r, _ = runner(demo_tokenizer, ToolAgent, num_repeat=8, max_env_worker=8)
    assert all(e.trainable and e.reward == 1.0 for e in r.run([Task("t1", "2 + 2")]))
    real_command = bubblewrap.command
    _broken_bubblewrap(monkeypatch)
    episodes = r.run([Task("t2", "2 + 2")])
    assert all(FLAG_TOOL_INFRA_FAILED in e.flags and not e.trainable for e in episodes)
    assert "nonexistent-astuner-test" in episodes[0].error_summary
    monkeypatch.setattr(bubblewrap, "command", real_command)
    assert all(e.trainable for e in r.run([Task("t3", "2 + 2")]))  # a batch whose tools started: count reset
    _broken_bubblewrap(monkeypatch)
    for _ in range(TOOL_INFRA_BATCHES_TO_STOP - 1):
        r.run([Task("t4", "2 + 2")])
    with pytest.raises(TrainingStalled, match=f"{TOOL_INFRA_BATCHES_TO_STOP} batches in a row.*nonexistent-astuner"):
        r.run([Task("t5", "2 + 2")])
    r.close()
