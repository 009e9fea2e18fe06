"""The layout's rules, read from the source: the shared ground (`switchyard/`) names nothing of
the folders above it, by import statement or by a module name in a string (importlib,
`python -m`), and no product module installs an importer of its own."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import ROOT

TENANTS = ("services", "workflows", "clients")
PRODUCT = ("switchyard", *TENANTS)


def _modules(folder: str) -> Iterator[Path]:
    for path in sorted((ROOT / folder).rglob("*.py")):
        if "gen" not in path.relative_to(ROOT).parts and "__pycache__" not in path.parts:
            yield path


def _names_a_tenant(name: str) -> bool:
    return name.split(".")[0] in TENANTS


def tenant_references(path: Path) -> list[str]:
    """Each import of, and each string naming, a module of services/, workflows/ or clients/."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if _names_a_tenant(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _names_a_tenant(node.module or ""):
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            head = node.value.split(".")[0]
            if head in TENANTS and "." in node.value and " " not in node.value:
                found.append(f"string {node.value!r}")
    return found


def test_the_shared_ground_names_nothing_above_it() -> None:
    found = [f"{p.relative_to(ROOT)}: {ref}" for p in _modules("switchyard") for ref in tenant_references(p)]
    assert found == []


def test_the_reference_scan_sees_both_ways_of_naming_a_tenant(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('import importlib\nfrom clients import cli\nimportlib.import_module("services.x")\n')
    assert tenant_references(probe) == ["from clients import ...", "string 'services.x'"]


def test_no_product_module_installs_an_importer() -> None:
    found = []
    for folder in PRODUCT:
        for path in _modules(folder):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in ("meta_path", "path_hooks"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: sys.{node.attr}")
                if isinstance(node, ast.ClassDef) and any("Finder" in ast.unparse(b) for b in node.bases):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: class {node.name}")
    assert found == []


def import_graph(folders: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of `folders` it imports (at the top or inside a function)."""
    paths = {}
    for folder in folders:
        for path in _modules(folder):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            paths[name] = path
    graph = {}
    for name, path in paths.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        graph[name] = (deps & paths.keys()) - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_shared_ground_and_the_clients_have_no_import_circle() -> None:
    assert circles(import_graph(("switchyard", "clients"))) == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_two_product_modules_share_a_name() -> None:
    seen: dict[str, list[str]] = {}
    for folder in PRODUCT:
        for path in _modules(folder):
            if path.name != "__init__.py":
                seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    # The trial kinds' packages name their roles alike on purpose (workflows/tensor/verdict.py,
    # workflows/generation/verdict.py, ...): a name may repeat only among workflows/ packages.
    assert {
        name: paths for name, paths in shared.items() if not all(p.startswith("workflows/") for p in paths)
    } == {}
