"""SIGTERM ends a command within its deadline, saying so once, even when its cleanup hangs; the processes it
started go with it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

HANGS_IN_CLEANUP = textwrap.dedent("""
    import subprocess, sys, time
    from astuner.interrupts import Terminated, sigterm_as_interrupt

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        with sigterm_as_interrupt(grace_s=float(sys.argv[1])):
            try:
                # Inside the try: the SIGTERM the pid invites may land before print returns, and the cleanup
                # must still run (else the sleeping child keeps the test's pipes open).
                print(child.pid, flush=True)
                time.sleep(300)
            finally:
                time.sleep(300)  # an engine that never answers its shutdown
    except Terminated:
        print("unwound", flush=True)
""")


@pytest.mark.slow
def test_sigterm_ends_a_hanging_cleanup_at_its_deadline_once_and_kills_the_children():
    proc = subprocess.Popen([sys.executable, "-c", HANGS_IN_CLEANUP, "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    child = psutil.Process(int(proc.stdout.readline()))
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # a second one (a process group's, an impatient user's) changes nothing
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.monotonic() - start < 10
    assert err.count("terminated (SIGTERM)") == 1 and "ran past 2 s" in err, err
    assert "unwound" not in out
    psutil.wait_procs([child], timeout=10)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_a_prompt_cleanup_ends_normally_before_the_deadline():
    quick = HANGS_IN_CLEANUP.replace("time.sleep(300)  # an engine", "child.kill()  # an engine")
    proc = subprocess.Popen([sys.executable, "-c", quick, "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.strip() == "unwound" and "ran past" not in err


BUSY_IN_C = textwrap.dedent("""
    import hashlib, sys
    from astuner.interrupts import sigterm_as_interrupt

    with sigterm_as_interrupt(grace_s=float(sys.argv[1])):
        print("ready", flush=True)
        hashlib.pbkdf2_hmac("sha256", b"x", b"y", 2_000_000_000)  # minutes in one C call, as a long backward pass
""")


def test_the_deadline_holds_while_the_main_thread_is_in_a_long_c_call():
    """Python runs the handler only when the main thread returns to the interpreter: the deadline must not wait
    for that."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY_IN_C, "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)  # into the C call (a signal before it would be handled at once)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143 and time.monotonic() - start < 10
    assert err.count("terminated (SIGTERM)") == 1 and "ran past 1 s" in err, err
