"""The shape of the code: no import circles among gradwatch's modules, small modules that name their stage."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: installed package -> source folder (pyproject's package-dir)
PACKAGES = {"gradwatch": "gradwatch", "gradwatch.integrations": "integrations", "gradwatch.dashboards": "dashboards"}
#: the most lines a module of gradwatch/ may have ("small modules, one concept each": aim ~300)
MAX_LINES = 330


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    """The modules of ours that one import statement imports (``from pkg import mod`` names the module)."""
    if isinstance(node, ast.Import):
        wanted = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        wanted = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    out = []
    for target in wanted:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.append(target)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere: at the top, in functions, under TYPE_CHECKING."""
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(_targets(name, path, node, known))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "gradwatch.step.lifecycle" in graph["gradwatch.watching"]  # top level
    assert "gradwatch.integrations.distributed" in graph["gradwatch.startup"]  # inside a function
    assert "gradwatch.step.snapshots" in graph["gradwatch.step.control"]  # from package import module


def test_no_import_circles() -> None:
    found = cycles(import_graph())
    assert not found, "import circles among gradwatch's modules:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("name", sorted(n for n, p in modules().items() if p.is_relative_to(ROOT / "gradwatch")))
def test_module_is_small_and_names_its_stage(name: str) -> None:
    path = modules()[name]
    source = path.read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(source))
    assert doc, f"{path.relative_to(ROOT)} has no module docstring"
    assert len(source.splitlines()) <= MAX_LINES, (
        f"{path.relative_to(ROOT)} has {len(source.splitlines())} lines; split it (modules of one concept, ~300 lines)")
