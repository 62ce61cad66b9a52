"""docs/architecture.md's import rules, checked: each layer imports only the layers below it at module level."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "normatlas"

# top-level module or package -> its layer (docs/architecture.md, "The layers")
LAYER = {
    "spec": 0, "vocabulary": 0, "capacity": 0,
    "backend": 1, "functional": 1, "modules": 1, "presets": 1, "taxonomy": 1, "kernels": 1,
    "longtail": 2, "blocks": 2,
    "analysis": 3,
    "inspect": 4, "surgery": 4, "diagnostics": 4, "checkpoint": 4,
    "distributed": 5, "experiments": 5, "port": 5, "tools": 5,
    "atlas": 6, "data": 6,
    "cli": 7, "web": 7, "__init__": 7, "__main__": 7,
}  # fmt: skip
# layers that may be imported at module level (beyond one's own): the table's last column
MAY_IMPORT = {0: {0}, 1: {0, 1}, 2: {0, 1}, 3: {0, 1}, 4: {0, 1, 3, 4}, 5: {0, 1, 2, 3, 4}, 6: {0}, 7: set(range(8))}
# one-way edges inside a layer: longtail's VLM connectors and tiny VLMs are written with the blocks (Placement,
# ResidualAdd, Attention, TransformerLM); blocks never imports longtail
WITHIN_LAYER = {("longtail", "blocks")}


def _owner(path: Path) -> str:
    rel = path.relative_to(SRC).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _target(path: Path, node: ast.ImportFrom) -> str | None:
    """The top-level normatlas module a relative (or absolute normatlas) import names."""
    if node.level == 0:
        parts = (node.module or "").split(".")
        return parts[1] if parts[0] == "normatlas" and len(parts) > 1 else None
    here = list(path.relative_to(SRC).parts[:-1])
    base = here[: len(here) - (node.level - 1)]
    parts = base + [p for p in (node.module or "").split(".") if p]
    if parts:
        return parts[0].removesuffix(".py")
    return node.names[0].name  # ``from .. import x`` at the package root


def _module_level_imports() -> list[tuple[str, str, str]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only: imports inside functions are lazy by design
            if isinstance(node, ast.ImportFrom) and (target := _target(path, node)) is not None:
                owner = _owner(path)
                if target != owner and target in LAYER:
                    out.append((str(path.relative_to(SRC)), owner, target))
    return out


def test_every_module_has_a_layer() -> None:
    names = {_owner(p) for p in SRC.rglob("*.py")}
    assert names <= set(LAYER), names - set(LAYER)


@pytest.mark.parametrize(("where", "owner", "target"), _module_level_imports())
def test_imports_follow_the_layers(where: str, owner: str, target: str) -> None:
    allowed = LAYER[target] in MAY_IMPORT[LAYER[owner]] or (owner, target) in WITHIN_LAYER
    assert allowed, f"{where}: {owner} (layer {LAYER[owner]}) imports {target}"


def test_edges_within_a_layer_run_one_way() -> None:
    edges = {(owner, target) for _, owner, target in _module_level_imports()}
    for owner, target in WITHIN_LAYER:
        assert (target, owner) not in edges, f"{target} imports {owner}: the edge {owner} -> {target} is one-way"


def test_the_check_can_fail() -> None:
    """A substrate module importing a reader would be caught."""
    node = ast.parse("from ..inspect import analyze").body[0]
    assert isinstance(node, ast.ImportFrom)
    target = _target(SRC / "analysis" / "graph.py", node)
    assert target == "inspect" and LAYER[target] not in MAY_IMPORT[LAYER["analysis"]]
