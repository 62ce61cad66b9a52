"""docs/architecture.md's import rules, checked: each layer imports only the layers below it (at module level and
inside functions alike), the import graph of src/ has no cycle, and the model factory depends on nothing of ours but
the checkpoint loader."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "normatlas"

# top-level module or package -> its layer (docs/architecture.md, "The layers")
LAYER = {
    "spec": 0, "vocabulary": 0, "capacity": 0, "_exports": 0, "_io": 0,
    "backend": 1, "reference": 1, "functional": 1, "modules": 1, "presets": 1, "taxonomy": 1, "kernels": 1,
    "analysis": 2,
    "longtail": 3, "blocks": 3,
    "checkpoint": 4, "factory": 4,
    "inspect": 5, "surgery": 5, "diagnostics": 5,
    "distributed": 6, "experiments": 6, "port": 6, "tools": 6,
    "atlas": 7, "data": 7,
    "cli": 8, "web": 8, "__init__": 8, "__main__": 8,
}  # fmt: skip
# layers that may be imported (beyond one's own), at module level or inside a function: the table's last column
MAY_IMPORT = {
    0: {0},
    1: {0, 1},
    2: {0, 1},
    3: {0, 1, 2},
    4: {0, 4},
    5: {0, 1, 2, 3, 4, 5},
    6: {0, 1, 2, 3, 4, 5},
    7: {0},
    8: set(range(9)),
}
# one-way edges inside a layer: longtail's VLM connectors and tiny VLMs are written with the blocks (Placement,
# ResidualAdd, Attention, TransformerLM); the tools read attention through the port's dataflow reading (v_scale finds
# the value and output projections from Port.links, never by name); the other way is forbidden for both
WITHIN_LAYER = {("longtail", "blocks"), ("tools", "port")}
# what the model factory may import of ours, beside itself: the one load policy for checkpoint folders
FACTORY_IMPORTS = {"checkpoint"}

# Imports that break the layers today, each in a folder another change owns (issue 35 names them): listed so that the
# rest is held to the rule, and checked to still exist so that each one fixed leaves this list.
KNOWN_BREAKS = {
    ("diagnostics/monitor.py", "cli"): "Monitor.table() prints through the CLI's one table printer",
    ("tools/zoo.py", "experiments"): "the zoo's byte Llama trains on the experiments' stdlib corpus (experiments.data)",
}


@dataclass(frozen=True)
class Import:
    where: str  # the importing file, relative to src/normatlas
    source: str  # the importing module, dotted (normatlas.inspect.vision)
    target: str  # the imported module, dotted: a submodule where one is named, else the package
    lazy: bool  # inside a function or class body rather than at module level

    @property
    def owner(self) -> str:
        return _top(self.source)

    @property
    def layer_target(self) -> str:
        return _top(self.target)


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in sorted(SRC.rglob("*.py"))}


def _targets(path: Path, node: ast.ImportFrom | ast.Import, modules: dict[str, Path]) -> list[str]:
    """The normatlas modules ``node`` imports: ``from .x import y`` names the submodule ``x.y`` where there is one,
    else ``x``; a package's ``__init__`` stands for the package."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "normatlas"]
    if node.level == 0:
        base = node.module or ""
    else:
        here = _module(path).split(".")
        package = here if path.name == "__init__.py" else here[:-1]
        base = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
    if base.split(".")[0] != "normatlas":
        return []
    return list(dict.fromkeys(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names))


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _walk(node: ast.AST, lazy: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import under ``node`` with whether it runs lazily; ``if TYPE_CHECKING:`` blocks never run."""
    for child in ast.iter_child_nodes(node):
        if _is_type_checking(child):
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, lazy
        inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
        yield from _walk(child, inner)


def imports_of(path: Path, source: str, modules: dict[str, Path]) -> list[Import]:
    out = []
    for node, lazy in _walk(ast.parse(source), False):
        for target in _targets(path, node, modules):
            if target != _module(path):
                out.append(Import(str(path.relative_to(SRC)), _module(path), target, lazy))
    return out


IMPORTS = [imp for m, p in MODULES.items() for imp in imports_of(p, p.read_text(), MODULES)]


def _breaks(imports: list[Import]) -> list[Import]:
    return [
        i
        for i in imports
        if i.owner != i.layer_target
        and i.layer_target in LAYER
        and LAYER[i.layer_target] not in MAY_IMPORT[LAYER[i.owner]]
        and (i.owner, i.layer_target) not in WITHIN_LAYER
    ]


def test_within_layer_edges_are_one_way() -> None:
    for a, b in WITHIN_LAYER:
        assert LAYER[a] == LAYER[b]
        back = [i for i in IMPORTS if i.owner == b and i.layer_target == a]
        assert not back, f"{b} imports {a}: {[(i.where, i.target) for i in back]}"


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(frozenset(comp))
    return found


def _graph(imports: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for i in imports:
        edges.setdefault(i.source, set()).add(i.target)
    return edges


def test_every_module_has_a_layer() -> None:
    names = {_owner for p in SRC.rglob("*.py") if (_owner := _top(_module(p)))}
    assert names <= set(LAYER), names - set(LAYER)


@pytest.mark.parametrize("imp", _breaks(IMPORTS), ids=lambda i: f"{i.where}->{i.target}")
def test_imports_follow_the_layers(imp: Import) -> None:
    """Module level and inside functions alike: a lazy import is still a dependency."""
    assert (imp.where, imp.layer_target) in KNOWN_BREAKS, (
        f"{imp.where}: {imp.owner} (layer {LAYER[imp.owner]}) imports {imp.target} (layer {LAYER[imp.layer_target]})"
        f"{' inside a function' if imp.lazy else ''}"
    )


def test_known_breaks_are_still_there() -> None:
    """Each listed exception is still in the code (one fixed leaves the list)."""
    seen = {(i.where, i.layer_target) for i in _breaks(IMPORTS)}
    assert set(KNOWN_BREAKS) <= seen, set(KNOWN_BREAKS) - seen


def test_the_import_graph_has_no_cycle() -> None:
    """No module reaches itself through imports, lazy ones included (a cycle hidden in a function is still one)."""
    found = cycles(_graph(IMPORTS))
    assert not found, [sorted(c) for c in found]


def test_the_factory_imports_only_the_checkpoint_loader() -> None:
    """normatlas.factory builds models; it reads no design (no inspect, analysis, blocks ...)."""
    theirs = {i.layer_target for i in IMPORTS if i.owner == "factory"} - {"factory"}
    assert theirs <= FACTORY_IMPORTS, theirs - FACTORY_IMPORTS


def test_the_readers_build_through_the_factory() -> None:
    """inspect/ keeps the readers: no module of it builds a model from a config (the factory does)."""
    building = {"from_config", "_from_config", "for_model"}
    offenders = []
    for path in sorted((SRC / "inspect").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in building:
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno} .{node.attr}")
    assert not offenders, offenders


def test_the_check_can_fail() -> None:
    """A substrate module importing a reader, at module level or inside a function, would be caught; so would a
    cycle through a lazy import, the factory importing the inspector, and the factory's old circle."""
    here = SRC / "analysis" / "graph.py"
    top = "from ..inspect import analyze\n"
    lazy = "def f():\n    from ..inspect.build import x\n"
    for source, is_lazy in ((top, False), (lazy, True)):
        (imp,) = imports_of(here, source, MODULES)
        assert imp.lazy is is_lazy and _breaks([imp]) == [imp]
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import cli\n"
    assert not imports_of(here, typing_only, MODULES)
    factory = SRC / "factory" / "text.py"
    (imp,) = imports_of(factory, "def f():\n    from ..inspect.report import NormInfo\n", MODULES)
    assert _breaks([imp]) == [imp]
    # the circle this package replaced: build.py -> vlm_build.py (lazily) -> build.py
    build, vlm_build = "normatlas.inspect.build", "normatlas.inspect.vlm_build"
    old = {build: {vlm_build}, vlm_build: {build}}
    assert cycles(old) == [frozenset(old)]
    assert cycles({"a": {"b"}, "b": {"c"}}) == []


# The compiled kernels' entry points (the C++ extension's loader, the Triton kernels) are reached only through the one
# dispatch point, which decides which of them runs (normatlas.kernels.dispatch.route); the fused op asks it too
# (dispatch.implementation). triton_aot compiles the Triton kernels ahead of time for a GPU target and runs no norm.
KERNEL_ENTRY_POINTS = {"normatlas.kernels.cpu", "normatlas.kernels.triton_kernels"}
KERNEL_DISPATCH = "normatlas.kernels.dispatch"
KERNEL_ENTRY_ALLOWED = {("normatlas.kernels.triton_aot", "normatlas.kernels.triton_kernels")}


def _past_the_dispatch_point(imports: list[Import]) -> list[Import]:
    return [
        i
        for i in imports
        if i.target in KERNEL_ENTRY_POINTS
        and i.source not in KERNEL_ENTRY_POINTS | {KERNEL_DISPATCH}
        and (i.source, i.target) not in KERNEL_ENTRY_ALLOWED
    ]


def test_only_the_dispatch_point_imports_the_kernel_entry_points() -> None:
    """No module but normatlas.kernels.dispatch imports the C++ extension's loader or the Triton kernels (at module
    level or inside a function): every way into the kernels goes through its route."""
    offenders = _past_the_dispatch_point(IMPORTS)
    assert not offenders, [(i.where, i.target) for i in offenders]
    assert any(i.source == KERNEL_DISPATCH and i.target == "normatlas.kernels.cpu" for i in IMPORTS)


def test_the_dispatch_point_check_can_fail() -> None:
    """Each spelling of a way around the dispatch point is caught: a lazy import, a from-import of a name, a plain
    import of the module."""
    sources = {
        SRC / "functional.py": "def f():\n    from .kernels import cpu\n",
        SRC / "kernels" / "api.py": "from .cpu import extension\n",
        SRC / "kernels" / "ops.py": "import normatlas.kernels.triton_kernels as t\n",
    }
    for here, source in sources.items():
        (imp,) = imports_of(here, source, MODULES)
        assert _past_the_dispatch_point([imp]) == [imp], source
    (ok,) = imports_of(SRC / "kernels" / "dispatch.py", "from . import cpu\n", MODULES)
    assert _past_the_dispatch_point([ok]) == []
