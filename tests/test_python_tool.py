"""The Python tool: output, timeout, memory limit, scratch directory, AgentScope registration."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from astuner.tools import execute_python_code, run_python

REPO = Path(__file__).resolve().parents[1]


def run(coro):
    return asyncio.run(coro)


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


def test_timeout_kills_child_processes_too():
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    result = run(run_python(code, timeout=1.0))
    assert result.timed_out
    child = int(result.stdout.strip())
    time.sleep(0.2)
    assert not _alive(child)


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
