"""The package's dependency rules, read from the source (every import, lazy ones inside
functions included): batchgen -> {engine, clustering} -> kernels, no import circles, and
inside the engine the layers and their device backends meet only through engine/ops."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("batchgen", "engine", "kernels", "clustering")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The house modules `name` imports anywhere in its file (TYPE_CHECKING blocks too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    resolved = set()
    for target in targets:
        while target and target not in known:  # `from a.b import c`: c may be a name
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


GRAPH = None


def _graph() -> dict[str, set[str]]:
    global GRAPH
    if GRAPH is None:
        modules = _modules()
        GRAPH = {n: _imports(n, p, set(modules)) for n, p in modules.items()}
    return GRAPH


def _strip_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Edges into a package's __init__ from inside the package are how Python loads a
    submodule, not a dependency between concepts: left out of the circle search."""
    return {n: {t for t in deps if not n.startswith(t + ".")} for n, deps in graph.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert _cycles(_strip_package_inits(_graph())) == []


def _edges(source_prefix: str, target_prefix: str) -> list[str]:
    def inside(module: str, prefix: str) -> bool:
        return module == prefix or module.startswith(prefix + ".")

    return sorted(
        f"{n} -> {t}"
        for n, deps in _graph().items()
        if inside(n, source_prefix)
        for t in deps
        if inside(t, target_prefix)
    )


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("kernels", "engine"),
        ("kernels", "batchgen"),
        ("kernels", "clustering"),
        ("engine", "batchgen"),
        ("engine", "clustering"),
        ("clustering", "batchgen"),
        ("clustering", "engine"),
        ("engine.layers", "engine.backends"),
        ("engine.models", "engine.backends"),
        ("engine.quant", "engine.backends"),
        ("engine.backends", "engine.layers"),
        ("engine.backends", "engine.models"),
    ],
)
def test_dependency_rule(source, target):
    assert _edges(source, target) == []
