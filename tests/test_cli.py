"""The astuner command: exit codes, one-paragraph errors without tracebacks, light --help, the call into a backbone.

Paths that fail before the backbone runs are tested in a subprocess (the real console behaviour); paths that
reach it run in-process with a fake `astuner.backbone` module, so no model is loaded.
"""

from __future__ import annotations

import subprocess
import importlib
import sys
import types
from pathlib import Path

import pytest

from astuner.cli import main
from astuner.errors import UserError

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "vllm", "ray", "transformers", "datasets")

SEED_LIKE = """\
astuner:
  project_name: cli_test
  rollout: {agentscope_workflow: pkg.mod->Flow, max_num_seqs: 40}
hydra: {searchpath: [file://astuner/default_config, file://astuner/default_config/verl, file://astuner/default_config/trinity]}
defaults: [verl_default, trinity_default, astuner_default, _self_]
"""


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "launcher.py"), *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def assert_user_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("astuner: error:"), result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr


@pytest.fixture
def conf(tmp_path) -> Path:
    path = tmp_path / "cli_test.yaml"
    path.write_text(SEED_LIKE)
    return path


# --- subprocess: the real console behaviour -----------------------------------------------------------------


def test_help_is_light_and_exits_zero(tmp_path):
    code = (
        "import sys\n"
        "from astuner.cli import main\n"
        "rc = main(['--help'])\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
        "sys.exit(rc if not heavy else 99)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--conf" in result.stdout and "--backbone" in result.stdout
    assert "HEAVY []" in result.stdout


def test_launcher_help(tmp_path):
    result = cli("--help", cwd=tmp_path)
    assert result.returncode == 0 and "--conf" in result.stdout


def test_missing_config_file(tmp_path):
    stderr = assert_user_error(cli("--conf", "nope.yaml", cwd=tmp_path))
    assert "nope.yaml" in stderr


def test_directory_as_config(tmp_path):
    assert "directory" in assert_user_error(cli("--conf", str(tmp_path), cwd=tmp_path))


def test_with_ray_needs_a_ray_backbone(conf, tmp_path):
    stderr = assert_user_error(cli("--conf", str(conf), "--with-ray", cwd=tmp_path))
    assert "debug backbone runs in this one process" in stderr and "--backbone verl" in stderr


def test_unknown_key_exits_2(conf, tmp_path):
    conf.write_text(SEED_LIKE.replace("max_num_seqs", "max_num_seq"))
    stderr = assert_user_error(cli("--conf", str(conf), cwd=tmp_path))
    assert "astuner.rollout.max_num_seq'" in stderr and "astuner.rollout.max_num_seqs" in stderr


def test_unknown_override_exits_2(conf, tmp_path):
    stderr = assert_user_error(cli("-c", str(conf), "astuner.rollout.temprature=0.3", cwd=tmp_path))
    assert "astuner.rollout.temperature" in stderr


def test_missing_conf_option_is_a_usage_error(tmp_path):
    stderr = assert_user_error(cli(cwd=tmp_path))
    assert "--conf" in stderr


# --- in-process, with a fake backbone -----------------------------------------------------------------------


@pytest.fixture
def fake_backbone(monkeypatch):
    """Replace astuner.backbone with a module whose run_backbone records its calls (or raises `behaviour`)."""
    module = types.ModuleType("astuner.backbone")
    module.calls = []
    module.behaviour = None

    def run_backbone(name, loaded, checkpoint=None, with_ray=False):
        module.calls.append((name, loaded))
        if module.behaviour is not None:
            raise module.behaviour

    module.run_backbone = run_backbone
    module.BACKBONES = importlib.import_module("astuner.backbone").BACKBONES  # the real registry's names
    monkeypatch.setitem(sys.modules, "astuner.backbone", module)
    return module


def test_run_loads_saves_warns_and_calls_backbone(conf, tmp_path, monkeypatch, capsys, fake_backbone):
    monkeypatch.chdir(tmp_path)
    rc = main(["--conf", str(conf), "--backbone", "debug", "astuner.rollout.temperature=0.5", "astuner.seed=3",
               "astuner.rollout.engine=hf"])
    assert rc == 0
    [(name, loaded)] = fake_backbone.calls
    assert name == "debug"
    assert loaded.cfg.astuner.rollout.temperature == 0.5 and loaded.cfg.astuner.seed == 3
    record = tmp_path / "launcher_record" / "cli_test"
    assert loaded.experiment_dir == record
    assert (record / "config.yaml").is_file() and (record / "cli_test.yaml").read_text() == SEED_LIKE
    stderr = capsys.readouterr().err
    assert stderr.count("astuner: warning:") == 1
    assert "astuner.rollout.max_num_seqs" in stderr


def test_no_warning_when_every_key_applies(conf, tmp_path, monkeypatch, capsys, fake_backbone):
    monkeypatch.chdir(tmp_path)
    assert main(["--conf", str(conf), "astuner.rollout.engine=vllm"]) == 0
    assert "astuner: warning:" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--backbone", "nope"], "unknown backbone"),
        (["--with-ray"], "--backbone verl"),
        (["--with-logview", "astuner.logview.port=70000"], "logview.port"),
        (["astuner.rollout.temperature"], "malformed"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_input_never_reaches_the_backbone(conf, tmp_path, monkeypatch, capsys, fake_backbone, args, needle):
    monkeypatch.chdir(tmp_path)
    assert main(["--conf", str(conf), *args]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("astuner: error:") and needle in stderr
    assert fake_backbone.calls == []


def test_user_error_during_the_run_exits_2(conf, tmp_path, monkeypatch, capsys, fake_backbone):
    monkeypatch.chdir(tmp_path)
    fake_backbone.behaviour = UserError("dataset file\nmissing")
    assert main(["--conf", str(conf)]) == 2
    err = capsys.readouterr().err
    assert "astuner: error: dataset file missing" in err and "Traceback" not in err


def test_keyboard_interrupt_exits_130(conf, tmp_path, monkeypatch, capsys, fake_backbone):
    monkeypatch.chdir(tmp_path)
    fake_backbone.behaviour = KeyboardInterrupt()
    assert main(["--conf", str(conf)]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_a_bug_is_not_disguised_as_user_error(conf, tmp_path, monkeypatch, fake_backbone):
    # Only bad input gets the short message; a crash keeps its traceback for the bug report.
    monkeypatch.chdir(tmp_path)
    fake_backbone.behaviour = RuntimeError("bug")
    with pytest.raises(RuntimeError):
        main(["--conf", str(conf)])
