"""The package's import graph, function-local imports included, has no cycle: a module can be read, tested and
replaced from the bottom up. (pyproject's import contracts check the layers; a cycle inside one layer slips past
them, so the whole graph is checked here.)"""

from __future__ import annotations

import grimp


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            for j in range(i, len(edges[node])):
                child = edges[node][j]
                if child not in index:
                    work += [(node, j + 1), (child, 0)]
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
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
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return found


def test_the_package_has_no_import_cycle():
    graph = grimp.build_graph("sdtrain")
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    graph = grimp.ImportGraph()
    for module in ("a", "a.b", "a.c", "a.d"):
        graph.add_module(module)
    graph.add_import(importer="a.b", imported="a.c")
    graph.add_import(importer="a.c", imported="a.d")
    graph.add_import(importer="a.d", imported="a.b")
    assert _cycles(graph) == [["a.b", "a.c", "a.d"]]


def test_no_family_module_imports_another_familys():
    """A family is one module: what two families share (autoencoders, text towers, the UNet and its file layout)
    lives in a module of its own beside them, so a family can be read, changed or removed without touching its
    siblings. Checked over the registry, so a family added there is held to it."""
    from sdtrain.models import families

    graph = grimp.build_graph("sdtrain")
    denoisers: dict[str, set[type]] = {}
    for family in families.FAMILIES.values():
        denoisers.setdefault(type(family).__module__, set()).add(family.components[family.denoiser])
    # Every registered family is a module of its own (SD's and SDXL's spec classes are not shared), but for the
    # variants of one model that diffusers gives a pipeline each (Flux.2's dev and klein): one denoiser class.
    assert all(len(classes) == 1 for classes in denoisers.values()), denoisers
    modules = set(denoisers)
    crossing = {module: sorted(graph.find_modules_directly_imported_by(module) & (modules - {module}))
                for module in modules}
    assert not any(crossing.values()), crossing
