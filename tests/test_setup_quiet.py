"""A newcomer's set-up prints no warnings of ours: the editable install of this repository builds without a
warning from the build backend (setuptools once printed its import-finder notice on every `pip install -e .`,
and before that about 40 lines of license deprecation). And it leaves its environments compiled to bytecode."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import sysconfig
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


def test_the_set_up_leaves_the_installed_modules_compiled():
    """scripts/setup_env.sh installs with --no-compile and then compiles each environment once on every core
    (compile_installed). Bytecode has to be there: where PYTHONDONTWRITEBYTECODE is set, as on CI, an import writes
    none, and every process would compile torch, transformers and vLLM from source again (8 -> 19 s)."""
    site = Path(sysconfig.get_paths()["purelib"])
    # A model family no test imports, so that nothing but the set-up can have compiled it.
    sources = sorted((site / "transformers" / "models" / "bert").glob("*.py"))
    assert sources, f"no transformers in {site}: run the tests in .venv (bash scripts/test.sh)"
    missing = [p.name for p in sources if not Path(importlib.util.cache_from_source(str(p))).is_file()]
    assert not missing, f"no bytecode for {missing}: scripts/setup_env.sh did not compile {site}"
    stamp = Path(sys.prefix) / ".compiled"
    listed = sorted(p.name for p in site.glob("*.dist-info"))
    assert stamp.is_file() and sorted(stamp.read_text().split()) == listed, \
        f"{stamp} does not list the distributions installed now: the next set-up would compile {site} again"
