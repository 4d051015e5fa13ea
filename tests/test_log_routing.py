"""Where log lines land: the user's DEBUG lines (loguru, and the standard loggers of the workflow's modules) in the
run's log file and never on the console, during training and in `astuner eval`; libraries' DEBUG nowhere."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from astuner.cli import main
from astuner.logs import is_user_file, user_module_names

WORKFLOW = '''
import asyncio
import logging

from loguru import logger

import wf_helper
from astuner import Workflow, WorkflowOutput

log = logging.getLogger(__name__)


class EchoWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        reply = await model_tuner.chat([{"role": "user", "content": workflow_task.task.main_query}])
        logger.debug("wf-loguru-debug {}", workflow_task.task.task_id)
        log.debug("wf-stdlib-debug")
        log.info("wf-stdlib-info")
        wf_helper.note()
        print("wf-print", workflow_task.task.task_id)
        await asyncio.to_thread(print, "wf-thread-print")  # a synchronous agent's print, in a worker thread
        await asyncio.get_running_loop().run_in_executor(None, print, "wf-executor-print")
        print("wf-partial-line", end="")  # no newline: written when the episode ends
        return WorkflowOutput(reward=None, metadata={"final_answer": reply["content"]})
'''
HELPER = '''
import logging

def note():
    logging.getLogger(__name__).debug("wf-helper-debug")
'''
LINES = ("wf-loguru-debug", "wf-stdlib-debug", "wf-helper-debug", "print: wf-print", "print: wf-thread-print",
         "print: wf-executor-print", "print: wf-partial-line")


def _write(tmp_path: Path, model_dir: Path) -> Path:
    from tests.test_run_contract import write_run

    yaml = write_run(tmp_path, model_dir)
    (tmp_path / "wf.py").write_text(WORKFLOW)
    (tmp_path / "wf_helper.py").write_text(HELPER)
    sys.modules.pop("wf_helper", None)  # an earlier test's copy, from its own folder
    return yaml


@pytest.mark.slow
def test_workflow_debug_lines_land_in_the_run_log_not_on_the_console(tmp_path, tiny_model_dir, capfd,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    yaml = _write(tmp_path, tiny_model_dir)
    assert main(["--conf", str(yaml), "astuner.trainer_common.total_training_steps=1",
                 "astuner.rollout.num_repeat=2", "astuner.rollout.max_response_length_in_one_turn=4"]) == 0
    console = "".join(capfd.readouterr())
    log_text = (tmp_path / "out" / "astuner.log").read_text()
    for line in LINES:
        assert line in log_text, f"{line} missing from astuner.log"
        assert line.removeprefix("print: ") not in console, f"{line} printed on the console"
    assert "wf-stdlib-info" in log_text and "wf-stdlib-info" not in console
    assert "] print: wf-print " in log_text.split("[train:", 1)[1]  # labelled with its episode


@pytest.mark.slow
def test_eval_console_has_the_table_and_its_log_file_the_workflow_lines(tmp_path, tiny_model_dir, capfd,
                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    yaml = _write(tmp_path, tiny_model_dir)
    out = tmp_path / "eval_out"
    model = str(tiny_model_dir)
    label = Path(model).name
    # Three models (the same weights): the second is the baseline, so the columns are first - second and
    # third - second.
    code = main(["eval", "--conf", str(yaml), "--model", model, "--model", model, "--model", model,
                 "--baseline", f"{label}'", "--num-repeat", "0", "--out", str(out),
                 "astuner.rollout.max_response_length_in_one_turn=4"])
    assert code == 0
    stdout, stderr = capfd.readouterr()
    assert "greedy/success_rate" in stdout
    assert f"{label} - {label}' [95% CI]" in stdout and f"{label}'' - {label}' [95% CI]" in stdout
    for line in (*LINES, "wf-stdlib-info"):
        assert line.removeprefix("print: ") not in stdout + stderr, f"{line} printed on the console"
    log_file = out / "eval.log"
    assert str(log_file) in stderr  # the console names the log file
    log_text = log_file.read_text()
    for line in (*LINES, "wf-stdlib-info"):
        assert line in log_text, f"{line} missing from eval.log"
    summary = json.loads((out / "eval_summary.json").read_text())
    assert [(d["model"], d["baseline"]) for d in summary["differences"]] == [(label, f"{label}'"),
                                                                             (f"{label}''", f"{label}'")]


def test_only_user_code_counts_as_user_code(tmp_path):
    import torch

    import astuner.logs

    assert is_user_file(str(tmp_path / "agent.py"))
    assert not is_user_file(torch.__file__) and not is_user_file(astuner.logs.__file__)
    assert not is_user_file(json.__file__) and not is_user_file(None)
    # A library's modules never get DEBUG: their loggers would flood the log file.
    assert user_module_names(torch) == [] and user_module_names(astuner.logs) == []
    (tmp_path / "agent_p.py").write_text("import agent_p_tools\nimport agent_p_linked\n")
    (tmp_path / "agent_p_tools.py").write_text("")
    # A sibling linked from elsewhere (runfiles, a shared checkout) counts where its file lies, not its link.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "agent_p_linked.py").write_text("")
    (tmp_path / "agent_p_linked.py").symlink_to(elsewhere / "agent_p_linked.py")
    sys.path.insert(0, str(tmp_path))
    try:
        import agent_p  # noqa: F401  (imports its siblings)

        assert user_module_names(sys.modules["agent_p"]) == ["agent_p", "agent_p_tools"]
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("agent_p", "agent_p_tools", "agent_p_linked"):
            sys.modules.pop(name, None)


def test_library_code_outside_the_python_prefix_is_not_user_code(tmp_path, monkeypatch):
    """Pseudo-paths, any site-packages or dist-packages folder (a venv on PYTHONPATH), and an installed
    distribution's files wherever they lie (pip --target, PYTHONPATH), found by its metadata."""
    assert not is_user_file("<frozen importlib._bootstrap>") and not is_user_file("<string>")
    assert not is_user_file(str(tmp_path / "venv/lib/python3.12/site-packages/lib_x/core.py"))
    assert not is_user_file(str(tmp_path / "usr/lib/python3/dist-packages/lib_y/core.py"))
    target = tmp_path / "target"  # as `pip install --target` leaves a loguru-using library
    (target / "lib_z").mkdir(parents=True)
    (target / "lib_z" / "__init__.py").write_text("")
    info = target / "lib_z-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lib_z\nVersion: 1.0\n")
    (info / "RECORD").write_text("lib_z/__init__.py,,\nlib_z/deep/mod.py,,\nlib_z-1.0.dist-info/METADATA,,\n")
    monkeypatch.syspath_prepend(str(target))
    from astuner import logs

    for cached in (logs._distribution_roots, logs._is_library_folder, logs.is_user_file):
        cached.cache_clear()  # the distributions are read once per process; this test added one
    assert not is_user_file(str(target / "lib_z" / "deep" / "mod.py"))
    assert is_user_file(str(tmp_path / "agent.py")) and is_user_file(str(target / "agent.py"))


def test_a_users_stdout_sink_in_an_episode_neither_loops_nor_errors(tmp_path, capfd):
    """A workflow's `logger.add(sys.stdout)`: its lines, written from an episode, reach the log once as prints;
    loguru (whose handlers are not re-entrant) is never called back from inside its own sink."""
    from loguru import logger

    from astuner import logs

    logs.setup_logging(tmp_path)
    sink = logger.add(sys.stdout, format="user-sink {message}")
    token = logs.EPISODE.set("train:t#0")
    try:
        logger.info("inside the episode")
        print("a print", end="")
        logs.end_episode_prints("train:t#0")
    finally:
        logs.EPISODE.reset(token)
        logger.remove(sink)
    out, err = capfd.readouterr()
    assert "Logging error" not in err and "inside the episode" not in out
    text = (tmp_path / "astuner.log").read_text()
    assert text.count("[train:t#0] print: user-sink inside the episode") == 1
    assert "[train:t#0] print: a print" in text


def test_an_episode_print_after_its_runs_folder_is_gone_reaches_the_console(tmp_path, capfd, monkeypatch):
    from astuner import logs

    monkeypatch.setattr(logs, "_LOG_PATH", [tmp_path / "gone" / "astuner.log"])
    logs._print_line("train:t#0", "hello")
    assert "hello" in capfd.readouterr().out
