"""The lazy top level lists its names once (``_EXPORTS``); the static view of them must agree with it."""

from __future__ import annotations

import ast
import importlib
import inspect

import normatlas


def _type_checking_imports() -> tuple[dict[str, str], set[str]]:
    """(name -> submodule, subpackages) as the ``if TYPE_CHECKING:`` block of normatlas/__init__.py imports them."""
    tree = ast.parse(inspect.getsource(normatlas))
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    names: dict[str, str] = {}
    subpackages: set[str] = set()
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.unparse(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"{ast.unparse(node)}: write 'X as X' so static tools re-export it"
            if node.module is None:
                subpackages.add(alias.name)
            else:
                names[alias.name] = node.module
    return names, subpackages


def test_static_imports_match_the_lazy_table() -> None:
    names, subpackages = _type_checking_imports()
    assert names == normatlas._NAMES
    assert subpackages == normatlas._SUBPACKAGES
    assert normatlas.__all__ == sorted([*names, *subpackages])


def test_every_lazy_name_resolves_to_its_submodule() -> None:
    for name, module in normatlas._NAMES.items():
        assert getattr(normatlas, name) is getattr(importlib.import_module(f"normatlas.{module}"), name)


def test_each_submodule_exports_what_the_package_takes_from_it() -> None:
    for module, names in normatlas._EXPORTS.items():
        exported = getattr(importlib.import_module(f"normatlas.{module}"), "__all__", None)
        assert exported is None or set(names) <= set(exported), module
