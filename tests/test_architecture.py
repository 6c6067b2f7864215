"""The package's import graph, function-local imports included, has no cycle: a module can be read, tested and
replaced from the bottom up. (pyproject's import contracts check the layers; a cycle inside one layer slips past
them, so the whole graph is checked here.)"""

from __future__ import annotations

import ast
from pathlib import Path

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
        table = family.components
        denoisers.setdefault(type(family.sampling).__module__, set()).add(table.classes[table.denoiser])
    # Every registered family is a module of its own (SD's and SDXL's spec classes are not shared), but for the
    # variants of one model that diffusers gives a pipeline each (Flux.2's dev and klein): one denoiser class.
    assert all(len(classes) == 1 for classes in denoisers.values()), denoisers
    modules = set(denoisers)
    crossing = {module: sorted(graph.find_modules_directly_imported_by(module) & (modules - {module}))
                for module in modules}
    assert not any(crossing.values()), crossing


# What names a family outside models/families/ today, file by file, and why it still does: each is to move into the
# family's parts (a run's family recorded since before the family was). A file may name fewer families, never more,
# and no other file may name one.
FAMILY_NAMES_OUTSIDE = {
    # Runs written before checkpoints recorded their family were Stable Diffusion's.
    "loaders/writers.py": 1, "loaders/components.py": 2, "model_card.py": 1,
    # The shapes demo's two recipes, one per family, are the command's choices.
    "cli/demo.py": 5,
}

# The most members each part of a family's spec may have: a part that must grow past this is a part to split
# (a family is composed of small parts, each of one concern), not a longer list. The video families grew four:
# LatentCodec (clip_frames), ModelFamily (experts), DenoiserCall (conditioned: a first frame), Sampling (index_marks,
# image_pipeline_class: image-to-video). Sampling grew one more beside `distilled`, which reads a folder for which
# released model it is: `variant` (Flux.1 Kontext, Qwen-Image-Edit-2511), what a run records.
SPEC_MEMBERS = {"ModelFamily": 23, "Components": 11, "Component": 8, "LatentCodec": 9, "Conditioner": 10,
                "DenoiserCall": 14, "FileInterchange": 16, "Sampling": 16, "ControlSpec": 8, "InstructSpec": 3,
                "ReferenceSpec": 4, "SingleFileLayout": 9, "ExpertSpec": 10}


def _family_names_used(tree: ast.AST, names: set[str]) -> int:
    """String constants in `tree` that are a registered family's name (not words in prose: docstrings are longer)."""
    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in names)


def test_code_outside_the_families_names_no_family_but_the_ones_still_to_move():
    from sdtrain.models import families

    names = set(families.FAMILIES)
    root = Path(__file__).resolve().parents[1] / "src" / "sdtrain"
    found = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("models/families/"):
            continue
        count = _family_names_used(ast.parse(path.read_text()), names)
        if count:
            found[relative] = count
    grown = {file: count for file, count in found.items() if count > FAMILY_NAMES_OUTSIDE.get(file, 0)}
    assert not grown, (f"these files name a model family (by its model.family value) outside models/families/: "
                       f"{grown}; ask the family's spec instead")


def _members(cls: type) -> set[str]:
    names: set[str] = set()
    for base in cls.__mro__:
        if base is not object:
            names |= {n for n in (*vars(base), *getattr(base, "__annotations__", {})) if not n.startswith("_")}
    return names


def test_each_part_of_a_family_spec_stays_small():
    from sdtrain.models.families import codec, spec

    parts = {name: getattr(spec, name, None) or getattr(codec, name) for name in SPEC_MEMBERS}
    sizes = {name: len(_members(cls)) for name, cls in parts.items()}
    grown = {name: f"{size} > {SPEC_MEMBERS[name]}" for name, size in sizes.items() if size > SPEC_MEMBERS[name]}
    assert not grown, f"spec parts past their stated size: {grown}; split the part, or make it a part of its own"


def test_the_modes_a_config_takes_are_the_modes_a_run_trains():
    """The config (a lower layer) names the modes; the run's parts implement them: neither list may drift."""
    from sdtrain.config import COMBINED, MODES
    from sdtrain.train.modes import RECIPES, TRAINED

    assert set(MODES) == {"full", *TRAINED, *RECIPES}
    assert all(set(pair) <= set(TRAINED) for pair in COMBINED)
