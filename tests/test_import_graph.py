"""No import circle anywhere in app/, inside a package as well as between packages.

import-linter's contracts (pyproject.toml) check directions between packages; a circle between two
modules of one package passes them. This walks grimp's graph of every module (grimp is what
import-linter reads imports with), lazy imports inside functions included, TYPE_CHECKING ones left out.
"""

from __future__ import annotations

import grimp
import pytest


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("app", exclude_type_checking_imports=True)


def circles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_of_app_takes_part_in_an_import_circle(graph):
    found = circles(graph)
    described = ["; ".join(" -> ".join(chain) for chain in _chains(graph, c)) for c in found]
    assert not found, "import circles in app/: " + " | ".join(described)


def test_the_circle_finder_sees_a_circle():
    # The check above must be able to fail: a two-module loop and a three-module loop are found, a chain is not.
    g = grimp.ImportGraph()
    for m in ("p.a", "p.b", "p.c", "p.d", "p.e", "p.f"):
        g.add_module(m)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.a")
    g.add_import(importer="p.c", imported="p.d")
    g.add_import(importer="p.d", imported="p.e")
    g.add_import(importer="p.e", imported="p.c")
    g.add_import(importer="p.e", imported="p.f")
    assert sorted(circles(g)) == [["p.a", "p.b"], ["p.c", "p.d", "p.e"]]


def _chains(graph, component: list[str]) -> list[list[str]]:
    """For a failure message: for each module of the circle, the import that leads to the next one inside it."""
    inside = set(component)
    return [[m, *sorted(graph.find_modules_directly_imported_by(m) & inside)] for m in component]
