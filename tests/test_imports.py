"""No import circles in flexgen_dist, between files or between its subpackages.

Every ``.py`` file under ``flexgen_dist/`` is parsed with ``ast`` (nothing is imported), so a
circle that only bites in some import order, or only when a function runs, is still found.

What counts as an import of file ``m`` by file ``f``:

- ``import flexgen_dist.a.b`` and ``from flexgen_dist.a.b import x`` (or the relative forms)
  anywhere in ``f``: at module level and inside functions alike, since a function-local import
  only moves the circle to call time;
- ``from pkg import name`` imports ``pkg/__init__.py`` and, when ``name`` is a submodule file
  of ``pkg``, that submodule too. ``pkg/__init__.py`` is left out when ``pkg`` is a package
  ``f`` itself lives in and every name is a submodule (``from . import x``): Python has
  already started that ``__init__`` before ``f`` runs and takes ``x`` from the file, not
  from the ``__init__``;
- a package's ``__init__.py`` is also imported when any file below it is, unless the package
  holds the importing file (Python runs it on the way, as for ``from`` imports).

Imports under ``if TYPE_CHECKING:`` are ignored: they never run. Imports built at run time
(``importlib.import_module`` with a string) are not seen; the package has none.

Graphs: (a) files (``flexgen_dist.models.common``; a package by its ``__init__``) and (b) the
top-level parts of flexgen_dist: a subpackage (``engine``, ``models``, ``memory``, ...) or a
top-level module (``api``, ``plan``, ...), with an edge where a file of one imports a file of
another. Both must be acyclic.
"""
from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

PKG = "flexgen_dist"
ROOT = Path(__file__).resolve().parent.parent / PKG

Graph = dict[str, set[str]]


def module_name(path: Path) -> str:
    """``flexgen_dist/models/common.py`` -> ``flexgen_dist.models.common``; a package's
    ``__init__.py`` -> the package's name."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth, except under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the else branch does run
        else:
            stack.extend(ast.iter_child_nodes(node))


def _resolve_from(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` names (before its imported names)."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def imports_of(importer: str, path: Path, modules: set[str]) -> set[str]:
    """The flexgen_dist files (module names) that ``importer`` imports; see the docstring."""
    is_package = path.name == "__init__.py"
    own = set(_ancestors(importer)) | ({importer} if is_package else set())
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
            continue
        base = _resolve_from(node, importer, is_package)
        subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
        targets |= subs
        if base not in own or len(subs) < len(node.names):
            targets.add(base)
    found: set[str] = set()
    for t in targets:
        if t != PKG and not t.startswith(PKG + "."):
            continue
        if t not in modules:
            raise AssertionError(f"{path}: imports {t}, which is no file under {ROOT}")
        found.add(t)
        found.update(a for a in _ancestors(t) if a not in own)
    found.discard(importer)
    return found


def file_graph() -> Graph:
    mods = all_modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def part_of(module: str) -> str:
    """The top-level part of flexgen_dist a module belongs to (``engine``, ``api``, ...);
    ``flexgen_dist`` for the package's own ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def part_graph(files: Graph) -> Graph:
    out: Graph = {}
    for src, dsts in files.items():
        out.setdefault(part_of(src), set()).update(
            part_of(d) for d in dsts if part_of(d) != part_of(src))
    return out


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected components that hold a cycle (more than one node, or a
    self-loop), each sorted. Empty when ``graph`` is acyclic."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []
    nodes = sorted(set(graph) | {d for ds in graph.values() for d in ds})

    def connect(v: str) -> None:  # Tarjan; the graphs here are far too shallow to need a loop
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(comp)

    for v in nodes:
        if v not in index:
            connect(v)
    return sorted(sorted(c) for c in comps if len(c) > 1 or c[0] in graph.get(c[0], ()))


def find_cycles(graph: Graph) -> list[list[str]]:
    """One cycle per circle (see ``circles``), as a closed chain ``[a, b, ..., a]``."""
    return [_cycle_in(c, graph) for c in circles(graph)]


def _cycle_in(comp: list[str], graph: Graph) -> list[str]:
    """A shortest closed chain through ``comp[0]`` inside the component (breadth-first)."""
    members, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w not in members:
                    continue
                if w == start:
                    chain = [v]
                    while chain[-1] != start:
                        chain.append(prev[chain[-1]])
                    return chain[::-1] + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in component {comp}")


def _report(what: str, graph: Graph) -> str:
    """Each circle as one chain, plus the other members of its component when there are more."""
    lines = []
    for comp in circles(graph):
        chain = [n.removeprefix(PKG + ".") for n in _cycle_in(comp, graph)]
        rest = sorted(set(n.removeprefix(PKG + ".") for n in comp) - set(chain))
        lines.append("  " + " -> ".join(chain) + (f"  (same circle: {', '.join(rest)})" if rest else ""))
    return f"import circles between {what}:\n" + "\n".join(lines)


def test_cycle_finder_finds_a_made_up_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"a"}}
    cycles = find_cycles(graph)
    assert sorted(cycles) == [["a", "b", "c", "a"], ["e", "e"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert "a -> b -> c -> a" in _report("x", graph)


def test_import_resolution_on_known_files() -> None:
    """The resolver sees relative, package and function-local imports (or the check is empty)."""
    files = file_graph()
    assert len(files) > 50
    assert "flexgen_dist.kernels.gemm" in files["flexgen_dist.models.common"]  # from ..kernels import gemm
    assert "flexgen_dist.kernels" in files["flexgen_dist.models.common"]  # that package's __init__
    assert "flexgen_dist.memory.disk" in files["flexgen_dist.memory"]  # from a.b.disk import ...
    assert "flexgen_dist.kernels" in files["flexgen_dist.memory.quant"]  # inside a function


def test_no_import_circles_between_files() -> None:
    graph = file_graph()
    assert not find_cycles(graph), _report("files", graph)


def test_no_import_circles_between_subpackages() -> None:
    graph = part_graph(file_graph())
    assert not find_cycles(graph), _report("subpackages and top-level modules", graph)


def test_every_family_registers_itself() -> None:
    """Importing flexgen_dist.models fills the family table (models/__init__ imports each
    family module); an unknown family is refused with the known ones named."""
    from flexgen_dist.models.families import family_names, get_family
    from flexgen_dist.models.spec import FAMILIES

    assert family_names() == sorted(FAMILIES)
    assert get_family("llama").name == "llama"
    with pytest.raises(ValueError, match="unknown model family 'gpt2': known families are cohere, gemma, llama, neox, opt"):
        get_family("gpt2")
