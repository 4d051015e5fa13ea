"""Design figures of the package, read from its syntax (nothing is imported or run).

    python bench/design_measures.py [--list KIND]

policy_tests    comparisons with POLICY (==, !=, in, not in) and dicts built with POLICY as a key
backbone_tests  comparisons of a value with a backbone's name ("debug", "verl", "trinity")
local_imports   import statements inside a function
private_reads   `x._name` where x is not self or cls (a private attribute of another object)
root_modules    modules at the package's root (besides __init__.py)
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "astuner"
BACKBONES = {"debug", "verl", "trinity"}


def _is_policy(node) -> bool:
    return isinstance(node, ast.Name) and node.id == "POLICY"


def _findings(tree: ast.AST):
    """(kind, line) for each finding in one module."""
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) in inside:
            yield "local_imports", node.lineno
        elif isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            if any(_is_policy(p) for p in parts):
                yield "policy_tests", node.lineno
            if any(isinstance(p, ast.Constant) and p.value in BACKBONES for p in parts) or any(
                    isinstance(p, (ast.Tuple, ast.Set, ast.List)) and any(
                        isinstance(e, ast.Constant) and e.value in BACKBONES for e in p.elts) for p in parts[1:]):
                yield "backbone_tests", node.lineno
        elif isinstance(node, ast.Dict) and any(k is not None and _is_policy(k) for k in node.keys):
            yield "policy_tests", node.lineno
        elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
              and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            yield "private_reads", node.lineno


def measure() -> tuple[dict[str, int], dict[str, list[str]]]:
    counts: dict[str, int] = {"policy_tests": 0, "backbone_tests": 0, "local_imports": 0, "private_reads": 0}
    where: dict[str, list[str]] = {k: [] for k in counts}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        for kind, line in _findings(ast.parse(path.read_text(), str(path))):
            counts[kind] += 1
            where[kind].append(f"{rel}:{line}")
    counts["root_modules"] = len([p for p in PACKAGE.glob("*.py") if p.name != "__init__.py"])
    where["root_modules"] = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    return counts, where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", help="print where each finding of this kind is")
    args = parser.parse_args()
    counts, where = measure()
    for kind, n in counts.items():
        print(f"{kind:15} {n}")
    if args.list:
        print("\n".join(where[args.list]))


if __name__ == "__main__":
    main()
