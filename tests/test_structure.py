"""The package's import graph runs one way: no module imports, even inside a function or for type checking
only, a module that imports it back. A circle makes the order of imports matter and hides which layer owns what."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "astuner"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def modules(root: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package __init__)} of every module under `root`."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph(mods: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """{module: the package modules it imports}, with function-level and TYPE_CHECKING imports."""

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, is_package) in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                # `from pkg import submodule` depends on the submodule; `from module import name` on the module.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            edges[name] |= {t for t in map(owner, targets) if t and t != name}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    edges = import_graph(modules())
    found = circles(edges)
    described = ["; ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a] & set(c))) for c in found]
    assert not found, "import circles: " + " | ".join(described)


def test_config_imports_nothing_above_it():
    # The config sits at the bottom: every stage reads it, and `astuner --help` imports it. The algorithm
    # catalog is pure data beside it (what each algorithm type means, which keys it reads).
    edges = import_graph(modules())
    allowed = ("astuner.config", "astuner.errors", "astuner.algorithm.catalog")
    upward = {f"{m} -> {t}" for m, targets in edges.items() if m.startswith("astuner.config")
              for t in targets if not t.startswith(allowed)}
    assert not upward, sorted(upward)


def layers(note: Path = ARCHITECTURE) -> list[list[str]]:
    """The layer table of docs/architecture.md, top row first: the module prefixes named in each row."""
    text = note.read_text(encoding="utf-8")
    table = text[text.index("| layer | modules |"):].split("\n\n")[0].splitlines()[2:]
    rows = []
    for line in table:
        names = re.findall(r"`([\w/.]+)`", line.split("|")[2])
        rows.append(["astuner." + n.removesuffix(".py").strip("/").replace("/", ".") for n in names])
    return rows


def test_imports_run_down_the_layers_of_the_architecture_note():
    rows = layers()
    found = {}
    for m in modules():
        # The longest prefix that names the module places it: `algorithm/catalog.py` can sit below `algorithm/`.
        matches = [(len(p), i) for i, row in enumerate(rows) for p in row if m == p or m.startswith(p + ".")]
        if matches:
            found[m] = max(matches)[1]
    unplaced = sorted(m for m in modules() if m not in found and m != "astuner")
    assert not unplaced, f"modules missing from the layer table of {ARCHITECTURE.name}: {unplaced}"
    upward = sorted(f"{m} -> {t}" for m, targets in import_graph(modules()).items() if m in found
                    for t in targets if t in found and found[t] < found[m])
    assert not upward, f"imports that run up the layers of {ARCHITECTURE.name}: {upward}"


def test_the_checker_finds_a_circle(tmp_path):
    pkg = tmp_path / "astuner"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from astuner.sub import low\n")
    (pkg / "sub" / "low.py").write_text("def f():\n    from .high import g\n")
    (pkg / "sub" / "high.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from astuner.sub.low import f\n")
    edges = import_graph(modules(pkg))
    assert circles(edges) == [["astuner.sub.high", "astuner.sub.low"]]
    assert edges["astuner.sub"] == {"astuner.sub.low"}  # a submodule import is not an edge to the package



def _compares(path: Path):
    """The comparisons of one module, each as (line, its operands)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            yield node.lineno, [node.left, *node.comparators]


def test_no_module_tells_a_backbone_by_its_name():
    """A backbone is one record (config/backbones.py): code asks the record what it does (`on_ray`, `explorers`),
    never `backbone == "trinity"`, so a new backbone is one record, not a hunt through the package."""
    from astuner.config.backbones import BACKBONES

    def names(node) -> set:
        elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return {e.value for e in elts if isinstance(e, ast.Constant) and e.value in BACKBONES}

    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in PACKAGE.rglob("*.py")
             if path.name != "backbones.py" for line, operands in _compares(path)
             if any(names(o) for o in operands)]
    assert found == []


def test_the_first_model_is_not_told_apart_by_its_name():
    """Every model of a run is a record of one set (config/model_set.py); `policy` names only the default agent's
    model. Its name is compared with another only where the config reserves it (schema_models.py)."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in PACKAGE.rglob("*.py")
             for line, operands in _compares(path)
             if any(isinstance(o, ast.Name) and o.id == "POLICY" for o in operands)]
    assert len(found) <= 3 and all("schema_models.py" in f for f in found), found
