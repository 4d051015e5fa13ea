"""The benchmarks stay runnable as shipped: most need a GPU or minutes, so CI never runs them, but a name they
import from astuner that moved (or a Trainer keyword that was renamed) fails here, on CPU, without running them.

Each bench module is imported under a name other than __main__ (so its `main()` does not run), and every
`from astuner... import name` in it is resolved, those inside functions and child-process scripts included."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def _trees(path: Path) -> list[ast.AST]:
    """The module's syntax tree, plus that of every string constant that is itself a script importing astuner
    (a child process's source, run with `python -c`)."""
    tree = ast.parse(path.read_text(), str(path))
    out = [tree]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "astuner" in node.value:
            try:
                out.append(ast.parse(node.value))
            except SyntaxError:
                continue
    return out


def _astuner_imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, name or None, line) of every import of astuner anywhere in the file."""
    found = []
    for tree in _trees(path):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "astuner":
                found += [(node.module, alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(alias.name, None, node.lineno) for alias in node.names
                          if alias.name.split(".")[0] == "astuner"]
    return found


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_bench_module_imports_without_running(path, monkeypatch):
    tree = ast.parse(path.read_text())
    guarded = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)
    declarative = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)
    library = all(isinstance(n, declarative) or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
                  for n in tree.body)  # a helper such as timing.py: nothing to run
    assert guarded or library, \
        f"{path.name}: put its work in main() under `if __name__ == \"__main__\":` so it can be imported"
    monkeypatch.syspath_prepend(str(BENCH))  # siblings (timing, bench_gpu_trainer), as when run as a script
    spec = importlib.util.spec_from_file_location(f"bench_import_check_{path.stem}", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_astuner_name_a_bench_module_imports_exists(path):
    missing = []
    for module, name, line in _astuner_imports(path):
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"line {line}: {module} ({exc})")
            continue
        if name is not None and name != "*" and not hasattr(mod, name) \
                and not (hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}")):
            missing.append(f"line {line}: {name} from {module}")
    assert not missing, f"{path.name} imports names astuner no longer has: {'; '.join(missing)}"


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_bench_trainer_keywords_are_trainer_settings(path):
    from astuner.trainer.settings import TrainerSettings

    fields = {f.name for f in dataclasses.fields(TrainerSettings)}
    wrong = [f"line {node.lineno}: {kw.arg}" for tree in _trees(path) for node in ast.walk(tree)
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Trainer"
             for kw in node.keywords if kw.arg is not None and kw.arg not in fields]
    assert not wrong, f"{path.name} passes Trainer keywords TrainerSettings lacks: {', '.join(wrong)}"
