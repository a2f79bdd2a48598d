"""No import cycle among rackmend's modules.

The graph is read from the source with ``ast``: an edge A -> B for each import of B that
runs when A is imported (statements at module level, in its ``if``/``try`` blocks and
class bodies; not inside functions, nor under ``if TYPE_CHECKING:``). ``from P import X``
counts P.X where that is a module, else P (a name P's ``__init__`` must have defined by
then). A package's ``__init__`` is the node of its name; importing P.M is not counted as
importing P: Python starts P's ``__init__`` first, and a submodule loads fine while that
is partly done (which is also why ``from P import M`` needs P.M only).

Run as a script (``python tests/test_imports.py [SRC]``) it prints every cycle found.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterator

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = "rackmend"


def modules(src: Path = SRC, root: str = ROOT) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package ``root`` under ``src``."""
    out = {}
    for path in sorted((src / root).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_at_load(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``body`` that run when the module is loaded."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue  # runs when called, not when imported
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _imports_at_load(node.body)
            yield from _imports_at_load(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _imports_at_load(block)
        elif isinstance(node, (ast.ClassDef, ast.With, ast.For, ast.While)):
            yield from _imports_at_load(node.body)


def import_graph(src: Path = SRC, root: str = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at load time."""
    mods = modules(src, root)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports_at_load(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
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


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert len(graph) > 50, sorted(graph)
    # Edges the checks below rely on: absolute, relative-free ``from`` imports of modules and of names.
    assert "rackmend.core.records" in graph["rackmend.core.syncer"]
    assert "rackmend.learner.tensorboard" in graph["rackmend.learner.optimizer"]


def test_the_cycle_finder_finds_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import c\n")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("import pkg.sub.c\n")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
        "def f():\n    from pkg import a\ntry:\n    from ..a import x\nexcept ImportError:\n    pass\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub"] == {"pkg.sub.c"} and graph["pkg.a"] == {"pkg.sub.b"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    assert cycles(import_graph(tmp_path, "pkg")) == []


def test_no_import_cycle_among_rackmend_modules() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (each a set of modules importing one another at load time): " + "; ".join(
        " <-> ".join(c) for c in found)


if __name__ == "__main__":
    found = cycles(import_graph(Path(sys.argv[1]) if len(sys.argv) > 1 else SRC))
    for c in found:
        print(" <-> ".join(c))
    print(f"{len(found)} import cycle(s)")
    sys.exit(1 if found else 0)
