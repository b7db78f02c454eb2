"""The shape of the code: the stages import one way, no import circles, small modules that name their stage."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: installed package -> source folder (pyproject's package-dir)
PACKAGES = {"gradwatch": "gradwatch", "gradwatch.integrations": "integrations", "gradwatch.dashboards": "dashboards"}
#: the most lines a module of gradwatch/ may have ("small modules, one concept each": aim ~300)
MAX_LINES = 330


#: the layers of the package, top to bottom (docs/architecture.md): a module imports modules of its own layer
#: and of the layers below it, never one above. The step's stages run step -> judging -> rootcause -> store.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("commands", ("gradwatch.cli", "gradwatch.__main__")),
    ("public face", ("gradwatch", "gradwatch.watching", "gradwatch.watching.registry", "gradwatch.watching.watcher",
                     "gradwatch.watching.startup", "gradwatch.watching.ending",
                     "gradwatch.demo", "gradwatch.testing", "gradwatch.pytest_plugin", "gradwatch.pytest_fixture",
                     "gradwatch.integrations")),
    ("readers", ("gradwatch.report", "gradwatch.dashboards", "gradwatch.doctor")),
    ("settings", ("gradwatch.options", "gradwatch.config")),
    ("step", ("gradwatch.step",)),
    ("judging", ("gradwatch.judging", "gradwatch.detectors", "gradwatch.actions", "gradwatch.rules")),
    ("rootcause", ("gradwatch.rootcause",)),
    ("store", ("gradwatch.store", "gradwatch.sinks")),
    ("base", ("gradwatch.errors", "gradwatch.version", "gradwatch.encoding", "gradwatch.files", "gradwatch.plugins",
              "gradwatch.wording", "gradwatch.watching.guard", "gradwatch.watching.register",
              "gradwatch.watching.unpickled", "gradwatch.watching.parametrized")),
]


def layer(module: str) -> int:
    """The index in :data:`LAYERS` of the layer ``module`` belongs to (its longest matching prefix)."""
    best, found = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or (prefix != "gradwatch" and module.startswith(prefix + "."))
            if matches and len(prefix) > best:
                best, found = len(prefix), index
    if found < 0 and module == "gradwatch":
        return 1
    if found < 0:
        raise AssertionError(f"{module} belongs to no layer of tests/test_architecture.py's LAYERS: add it")
    return found


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


def _type_only(tree: ast.Module) -> set[int]:
    """The ids of the import statements under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            out.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return out


def import_graph(*, runtime: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere: at the top, in functions, under TYPE_CHECKING
    (``runtime``: leaving out those under TYPE_CHECKING, which only annotations use).
    """
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = _type_only(tree) if runtime else set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
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
    assert "gradwatch.step.lifecycle" in graph["gradwatch.watching.watcher"]  # top level
    assert "gradwatch.integrations.distributed" in graph["gradwatch.watching.startup"]  # inside a function
    assert "gradwatch.step.snapshots" in graph["gradwatch.step.control"]  # from package import module


def test_no_import_circles() -> None:
    found = cycles(import_graph())
    assert not found, "import circles among gradwatch's modules:\n" + "\n".join(" <-> ".join(c) for c in found)


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module of a layer above the importer's, as "importer (layer) -> imported (layer)"."""
    out = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer(target) < layer(name):
                out.append(f"{name} ({LAYERS[layer(name)][0]}) -> {target} ({LAYERS[layer(target)][0]})")
    return out


def test_every_module_belongs_to_a_layer() -> None:
    for name in modules():
        layer(name)


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {"gradwatch.store.reader": {"gradwatch.judging.judge"}, "gradwatch.step.probe": {"gradwatch.store.records"}}
    assert upward(graph) == ["gradwatch.store.reader (store) -> gradwatch.judging.judge (judging)"]


def test_imports_run_one_way_down_the_layers() -> None:
    """The stages import one way (step -> judging -> rootcause -> store -> base); the store never imports the judge.
    Imports under TYPE_CHECKING are left out: an annotation may name a type of a layer above (the Options).
    """
    found = upward(import_graph(runtime=True))
    assert not found, "imports of a layer above:\n" + "\n".join(found)


def test_the_store_never_reaches_the_judge() -> None:
    """Nothing the store imports, however indirectly and even for annotations, is of the judging stage."""
    graph = import_graph()
    seen: set[str] = set()
    todo = [n for n in graph if layer(n) == layer("gradwatch.store")]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    assert not {n for n in seen if layer(n) <= layer("gradwatch.judging")}


@pytest.mark.parametrize("name", sorted(n for n, p in modules().items() if p.is_relative_to(ROOT / "gradwatch")))
def test_module_is_small_and_names_its_stage(name: str) -> None:
    path = modules()[name]
    source = path.read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(source))
    assert doc, f"{path.relative_to(ROOT)} has no module docstring"
    assert len(source.splitlines()) <= MAX_LINES, (
        f"{path.relative_to(ROOT)} has {len(source.splitlines())} lines; split it (modules of one concept, ~300 lines)")


def test_the_architecture_page_names_files_that_exist() -> None:
    """Every file or folder docs/architecture.md names in backticks is there (from the root, or in gradwatch/)."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:[\w.]+/)*[\w.]+(?:\.py|/))`", text))
    assert len(named) > 40
    missing = [p for p in sorted(named) if not (ROOT / p).exists() and not (ROOT / "gradwatch" / p).exists()]
    assert not missing, f"docs/architecture.md names files that are not there: {missing}"


def test_the_architecture_page_lists_every_folder_and_top_level_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    top = [p.name for p in sorted((ROOT / "gradwatch").iterdir())
           if (p.suffix == ".py" and p.name != "__main__.py") or (p.is_dir() and (p / "__init__.py").exists())]
    absent = [name for name in top if f"`{name}`" not in text and f"`gradwatch/{name}" not in text]
    assert not absent, f"docs/architecture.md's layer table leaves out {absent}"
