"""Size limits: no module over 500 lines, no class over 250, no function over 60 (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "astuner"


LIMITS = {"file": 500, "class": 250, "function": 60}  # lines; a class or function from its def to its last line


def oversized(root: Path = PACKAGE) -> list[str]:
    """Every module, class and function of `root` over LIMITS, as "path:name (lines)"."""
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(root.parent)
        if len(text.splitlines()) > LIMITS["file"]:
            out.append(f"{where} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            kind = ("class" if isinstance(node, ast.ClassDef) else
                    "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if kind and node.end_lineno - node.lineno + 1 > LIMITS[kind]:
                out.append(f"{where}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    return out


def test_no_module_class_or_function_over_the_size_limits():
    # Past these sizes a unit holds more than one responsibility: split it by what it does.
    found = oversized()
    assert not found, f"over the limits {LIMITS}: " + "; ".join(found)


def test_the_size_check_finds_a_long_function(tmp_path):
    pkg = tmp_path / "astuner"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(LIMITS["function"]))
    (pkg / "long.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}")
    assert oversized(pkg) == [f"astuner/long.py:long ({LIMITS['function'] + 1} lines)"]
