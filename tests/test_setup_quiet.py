"""A newcomer's set-up prints no warnings of ours: the editable install of this repository builds without a
warning from the build backend (setuptools once printed its import-finder notice on every `pip install -e .`,
and before that about 40 lines of license deprecation)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What pip runs in its build environment for `pip install -e .` (PEP 660); warnings as Python shows them.
BUILD = """
import sys, setuptools.build_meta as backend
out = sys.argv[1]  # read first: the backend rewrites sys.argv
meta = backend.prepare_metadata_for_build_editable(out)
print(backend.build_editable(out, metadata_directory=out + "/" + meta))
"""


def test_the_editable_install_prints_no_warning(tmp_path):
    # A copy of what the build reads, so that its by-products stay out of the repository.
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(REPO / "astuner", src / "astuner", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    out.mkdir()
    done = subprocess.run([sys.executable, "-c", BUILD, str(out)], cwd=src, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert list(out.glob("astuner-*.whl")), done.stdout + done.stderr
    # The warnings module's "file:line: Category: message" lines (setuptools' notices are InformationOnly, pip
    # shows them as BuildBackendWarning).
    noise = [line for line in done.stderr.splitlines() if re.match(r"\S+\.py:\d+: \w+: ", line)]
    assert not noise, "\n".join(noise)
