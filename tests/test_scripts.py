"""The test command's closing passes (scripts/test_apart.sh) exit 0 when both pass and 1 when either fails: CI
reads only the exit status. Their trap once turned two passing runs into exit 1 (a failing `kill` under set -e)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tree(root: Path, as2_rc: int, vf_rc: int) -> Path:
    """A repository copy whose two environments' pythons are stubs that print their arguments and exit as told."""
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "test_apart.sh", root / "scripts" / "test_apart.sh")
    for venv, rc in ((".venv-as2", as2_rc), (".venv-vf", vf_rc)):
        python = root / venv / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(f'#!/bin/sh\necho "{venv} ran $*"\nexit {rc}\n')
        python.chmod(0o755)
    return root


@pytest.mark.parametrize("as2_rc, vf_rc", [(0, 0), (1, 0), (0, 2)])
def test_the_closing_passes_exit_0_only_when_both_pass(tmp_path, as2_rc, vf_rc):
    root = _tree(tmp_path / "repo", as2_rc, vf_rc)
    done = subprocess.run(["bash", str(root / "scripts" / "test_apart.sh")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == (0 if as2_rc == vf_rc == 0 else 1), done.stdout + done.stderr
    # Each pass ran its own file in its own environment, and both logs are printed with their exit codes.
    assert f"AgentScope 2.x (exit {as2_rc}):\n.venv-as2 ran -m pytest -q --basetemp" in done.stdout
    assert "tests/test_agentscope2.py" in done.stdout
    assert f"verifiers (exit {vf_rc}):\n.venv-vf ran -m pytest -q --basetemp" in done.stdout
    assert "tests/test_verifiers.py" in done.stdout
