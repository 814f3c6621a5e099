"""No import cycles in loramux, counting every import.

Every module of the five packages (engine, adapters, registry, platform, migrations) is parsed
with :mod:`ast`; every ``import`` statement counts: top level, inside a function, and under
``if TYPE_CHECKING:``. A lazy or type-only import still makes the importer depend on the
imported module, and a cycle through one is a cycle of responsibilities even where Python
happens to load it. Relative imports are resolved, and ``from package import name`` points at
``package.name`` where that is a submodule (else at ``package``). Cycles are the strongly
connected components of more than one module (or a module importing itself).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from support.import_graph import PACKAGES, import_graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components with a cycle (Tarjan's algorithm, iterative).

    Each component is returned sorted; the list is sorted by its first module. A module
    that imports itself is a component of one.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph.get(nxt, ()))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return sorted(found)


def describe(components: list[list[str]]) -> str:
    """One paragraph per cycle naming its modules."""
    return "\n".join(
        f"cycle of {len(c)} modules:\n  " + "\n  ".join(c) for c in components
    )


def test_cycle_finder_finds_a_synthetic_cycle() -> None:
    graph = {
        "a": {"b"},
        "b": {"c"},
        "c": {"a", "d"},
        "d": {"e"},
        "e": set(),
        "f": {"f"},
        "g": {"d"},
    }
    assert cycles(graph) == [["a", "b", "c"], ["f"]]
    assert cycles({"x": {"y"}, "y": set()}) == []


def test_import_resolution_counts_lazy_type_checking_and_relative_imports(tmp_path) -> None:
    (tmp_path / "platform" / "sub").mkdir(parents=True)
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
    (tmp_path / "adapters" / "__init__.py").write_text("")
    (tmp_path / "adapters" / "one.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from loramux.adapters.two import X\n"
    )
    (tmp_path / "adapters" / "two.py").write_text(
        "def f():\n    from . import one\n    return one\n"
    )
    (tmp_path / "platform" / "sub" / "__init__.py").write_text("from .leaf import y\n")
    (tmp_path / "platform" / "sub" / "leaf.py").write_text(
        "import loramux.platform.top\ny = 1\n"
    )
    (tmp_path / "platform" / "top.py").write_text("from loramux.platform import sub\n")
    graph = import_graph(tmp_path)
    assert graph["loramux.adapters.one"] == {"loramux.adapters.two"}
    assert graph["loramux.adapters.two"] == {"loramux.adapters.one"}
    assert graph["loramux.platform.sub"] == {"loramux.platform.sub.leaf"}
    assert graph["loramux.platform.top"] == {"loramux.platform.sub"}
    assert cycles(graph) == [
        ["loramux.adapters.one", "loramux.adapters.two"],
        ["loramux.platform.sub", "loramux.platform.sub.leaf", "loramux.platform.top"],
    ]


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (every import counted):\n" + describe(found)
