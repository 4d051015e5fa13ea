"""One live run per run folder: a second run never writes into a folder a live run holds (it moves on to the next
free `<folder>_N`, or is refused naming the live PID when it would resume there), a killed run leaves no stale
lock, a folder holding only a saved config counts as holding a run, and a start refused for bad input leaves no
folder behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from test_run_contract import write_run

from astuner.cli import main
from astuner.config import load_config
from astuner.errors import UserError
from astuner.resume import plan_start
from astuner.run_lock import LOCK_NAME, claim, live_holder

HOLD = """
import os, sys, time
from astuner.run_lock import claim
claim(sys.argv[1])
child = os.fork()  # as vLLM's engine core is forked from a run: it must not keep the folder once the run is gone
if child == 0:
    time.sleep(120)
    os._exit(0)
print("held", child, flush=True)
time.sleep(120)
"""


@pytest.fixture
def live_run(tmp_path):
    """A process holding the lock on a folder as a live run does; yields (folder, process)."""
    folder = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    said, proc.child = proc.stdout.readline().split(), None
    try:
        assert said[0] == "held"
        proc.child = int(said[1])
        yield folder, proc
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if proc.child:
            os.kill(proc.child, signal.SIGKILL)


def complete_checkpoint(folder, step=2):
    state = folder / f"global_step_{step}" / "astuner_resume" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"step": step}))


def test_a_fresh_run_beside_a_live_one_goes_to_the_next_folder_naming_the_live_pid(tmp_path, tiny_model_dir,
                                                                                   live_run):
    folder, proc = live_run
    yaml = write_run(tmp_path, tiny_model_dir)  # experiment_dir: tmp_path / "out", which the live run holds
    start = plan_start(load_config(yaml, ["astuner.model.path=/another/model"]))
    assert start.loaded.experiment_dir == tmp_path / "out_1"
    assert f"is in use by a live run (PID {proc.pid}" in start.message
    assert start.message.endswith(f"starting a fresh run in {tmp_path / 'out_1'}")
    holder = live_holder(folder)
    assert holder.pid == proc.pid and "-c" in holder.command
    # Taking the folder itself (another run decided before this one took it) is refused the same way.
    with pytest.raises(UserError, match=f"in use by a live run \\(PID {proc.pid}.*experiment_dir={tmp_path / 'out_1'}"):
        claim(folder)


def test_resuming_a_folder_a_live_run_writes_is_refused_naming_its_pid(tmp_path, tiny_model_dir, live_run):
    folder, proc = live_run
    yaml = write_run(tmp_path, tiny_model_dir)
    complete_checkpoint(folder)
    with pytest.raises(UserError) as raised:
        plan_start(load_config(yaml))
    assert f"{folder} is in use by a live run (PID {proc.pid}" in str(raised.value)
    assert "Wait for it to end" in str(raised.value)
    with pytest.raises(UserError, match=f"PID {proc.pid}"):  # the path form of resume_mode too
        plan_start(load_config(yaml, [f"astuner.trainer_common.resume_mode={folder / 'global_step_2'}"]))


def test_a_killed_run_leaves_no_stale_lock(tmp_path, tiny_model_dir, live_run):
    folder, proc = live_run
    yaml = write_run(tmp_path, tiny_model_dir)
    complete_checkpoint(folder)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    os.kill(proc.child, 0)  # its forked child lives on, holding the lock file open: the folder is free all the same
    assert (folder / LOCK_NAME).is_file() and live_holder(folder) is None
    start = plan_start(load_config(yaml))
    assert start.resumed_step == 2 and start.loaded.experiment_dir == folder
    lock = claim(folder)
    try:
        assert live_holder(folder).pid == os.getpid() and live_holder(folder).pid == os.getpid()  # asked twice
        with pytest.raises(UserError, match=f"PID {os.getpid()}"):
            claim(folder)  # a second claim of this process would not conflict in the kernel: refused here
        probe = subprocess.run([sys.executable, "-c", "import sys, pathlib; from astuner.run_lock import live_holder; "
                                "print(live_holder(pathlib.Path(sys.argv[1])).pid)", str(folder)],
                               capture_output=True, text=True, timeout=60)
        assert probe.stdout.strip() == str(os.getpid())  # still held after this process asked
    finally:
        lock.release()
    assert live_holder(folder) is None


def test_a_folder_holding_only_a_saved_config_holds_a_run(tmp_path, tiny_model_dir):
    yaml = write_run(tmp_path, tiny_model_dir)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.yaml").write_text("astuner: {}\n")
    start = plan_start(load_config(yaml))
    assert start.loaded.experiment_dir == tmp_path / "out_1"
    assert "has no complete checkpoint to resume" in start.message


def test_a_start_refused_for_bad_input_leaves_no_folder(tmp_path, capsys):
    yaml = write_run(tmp_path, tmp_path / "no_such_model")
    yaml.write_text(yaml.read_text().replace("wf.py->EchoWorkflow", "wf.py->EchoWorkflw"))
    out = tmp_path / "records" / "mine"
    code = main(["--conf", str(yaml), "--backbone", "debug", f"astuner.experiment_dir={out}"])
    assert code == 2 and "did you mean 'EchoWorkflow'" in capsys.readouterr().err
    assert not (tmp_path / "records").exists()
    # A folder that held a run before keeps it.
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["--conf", str(yaml), "--backbone", "debug", f"astuner.experiment_dir={out}"]) == 2
    assert (out / "metrics.jsonl").is_file()


def test_the_lock_is_held_for_the_whole_run_and_released_after(tmp_path, tiny_model_dir, monkeypatch):
    """Seen from another process while the backbone runs, then free once the command returns."""
    from astuner import backbone

    yaml = write_run(tmp_path, tiny_model_dir)
    seen = {}

    def fake_backbone(name, loaded, checkpoint=None, with_ray=False):
        probe = subprocess.run([sys.executable, "-c", "import sys; from astuner.run_lock import live_holder; "
                                "print(live_holder(__import__('pathlib').Path(sys.argv[1])).pid)",
                                str(loaded.experiment_dir)], capture_output=True, text=True, timeout=60)
        seen["pid"] = probe.stdout.strip()

    monkeypatch.setattr(backbone, "run_backbone", fake_backbone)
    assert main(["--conf", str(yaml), "--backbone", "debug"]) == 0
    assert seen["pid"] == str(os.getpid())
    assert live_holder(tmp_path / "out") is None
    # The finished run's folder holds its config: the next fresh start goes to the next folder.
    assert plan_start(load_config(yaml)).loaded.experiment_dir == tmp_path / "out_1"
