"""Rename every submodule and every parameter / buffer of a model, keeping its forward working.

:func:`renamed` returns a structurally identical copy of a model (sharing every parameter and buffer
by identity) in which each entry of every module's ``_modules`` / ``_parameters`` / ``_buffers`` is
registered under a new name drawn by a caller-given scheme: ``named_modules()``, ``named_parameters()``,
``state_dict()``, ``get_submodule`` and ``set_submodule`` see only the new names.

Approach (the "wrap" option): module code refers to its attributes by name (``self.q_proj(x)``,
``self.weight``), so each module's class is swapped for a dynamically created subclass (one per class,
with the same ``__name__`` / ``__qualname__`` / ``__module__``, so ``isinstance`` and class-name labels
are unchanged) whose ``__getattr__`` / ``__setattr__`` / ``__delattr__`` map the old attribute names to
the new registered ones through a per-instance alias map. The alias is resolved at every access, so a
surgery that replaces a module under its new name (``set_submodule``) is seen by the forward code too.
``nn.ModuleList`` indexes by position instead of by the string ``"0"``; ``nn.ModuleDict`` looks old keys up
through the alias map.

Why not ``torch.fx`` / ``torch.export``: they do not trace HF models robustly (data-dependent control
flow, cache objects, kwargs), and a traced ``GraphModule`` is a different module structure from the one
the library reads, so the test would not be of the same model.

The one invariant kept: a new name never equals an old name of the same module, nor any attribute its
class or instance already has. So ``getattr(module, registered_name)`` is the registered entry (the
torch invariant) and ``getattr(module, old_name)`` is what the module's own code meant (its typed API):
the two never disagree. Names may still *lie* (an RMSNorm's gain registered as ``bias``, a norm as
``q_proj``, a layer stack as ``ln_f``): a library that reads names is fooled, one that reads behaviour
is not.
"""

from __future__ import annotations

import copy
import keyword
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

__all__ = ["ALIAS", "Scheme", "counter_scheme", "old_names", "renamed"]

ALIAS = "_rename_alias"
"""Instance attribute holding ``{old attribute name: new registered name}``."""

Scheme = Callable[[nn.Module, str, str, set[str]], str]
"""``(module, kind, old_name, forbidden) -> new_name``: ``kind`` is ``"module"``, ``"param"`` or ``"buffer"``;
the new name must be an identifier not in ``forbidden`` (the renamer checks)."""

_SUBCLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _resolve(module: nn.Module, name: str) -> str:
    alias = module.__dict__.get(ALIAS)
    return alias.get(name, name) if alias else name


def _subclass(cls: type[nn.Module]) -> type[nn.Module]:
    """The renamed twin of ``cls``: same names, attribute access through the instance's alias map."""
    if cls in _SUBCLASSES:
        return _SUBCLASSES[cls]
    if getattr(cls, "_is_renamed_twin", False):
        return cls

    def __getattr__(self: nn.Module, name: str) -> Any:
        return cls.__getattr__(self, _resolve(self, name))

    def __setattr__(self: nn.Module, name: str, value: Any) -> None:
        cls.__setattr__(self, _resolve(self, name), value)

    def __delattr__(self: nn.Module, name: str) -> None:
        cls.__delattr__(self, _resolve(self, name))

    ns: dict[str, Any] = {
        "__getattr__": __getattr__,
        "__setattr__": __setattr__,
        "__delattr__": __delattr__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "_is_renamed_twin": True,
    }
    if issubclass(cls, nn.ModuleList):

        def _get_abs_string_index(self: nn.ModuleList, idx: Any) -> str:
            # positions, not the string "0": the registered keys are no longer the indices
            return list(self._modules)[int(cls._get_abs_string_index(self, idx))]

        ns["_get_abs_string_index"] = _get_abs_string_index
    if issubclass(cls, nn.ModuleDict):

        def __getitem__(self: nn.ModuleDict, key: str) -> nn.Module:
            return cls.__getitem__(self, _resolve(self, key))

        def __contains__(self: nn.ModuleDict, key: object) -> bool:
            return isinstance(key, str) and cls.__contains__(self, _resolve(self, key))

        ns["__getitem__"], ns["__contains__"] = __getitem__, __contains__
    twin = type(cls.__name__, (cls,), ns)
    _SUBCLASSES[cls] = twin
    return twin


def _forbidden(module: nn.Module) -> set[str]:
    """Names a new entry of ``module`` may not take: its old entries, its instance and class attributes."""
    taken = set(module._modules) | set(module._parameters) | set(module._buffers)
    return taken | set(module.__dict__) | set(dir(type(module))) | set(keyword.kwlist)


def _rename_one(module: nn.Module, scheme: Scheme) -> dict[str, str]:
    """Re-register ``module``'s own entries under ``scheme``'s names (in place); return ``{old: new}``."""
    forbidden = _forbidden(module)
    alias: dict[str, str] = {}
    for kind, store in (("module", "_modules"), ("param", "_parameters"), ("buffer", "_buffers")):
        entries = getattr(module, store)
        fresh: dict[str, Any] = {}
        for old, value in entries.items():
            new = scheme(module, kind, old, set(forbidden))
            if not new.isidentifier() or new in forbidden:
                raise ValueError(f"scheme gave {new!r} for {kind} {old!r} of {type(module).__name__}: taken or invalid")
            forbidden.add(new)
            alias[old] = new
            fresh[new] = value
        entries.clear()
        entries.update(fresh)
    module._non_persistent_buffers_set = {alias[n] for n in module._non_persistent_buffers_set}
    module.__class__ = _subclass(type(module))
    object.__setattr__(module, ALIAS, alias)
    return alias


def renamed(model: nn.Module, scheme: Scheme | None = None, *, share: bool = True) -> nn.Module:
    """A structural copy of ``model`` with every submodule, parameter and buffer renamed by ``scheme``.

    With ``share`` (the default) every parameter and buffer is the same tensor object as in ``model``
    (a shallow copy of each module: only the name tables are new); else a deep copy. ``model`` itself is
    left untouched either way.
    """
    scheme = scheme or counter_scheme()
    memo: dict[int, Any] = {}
    if share:
        for _, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
            memo[id(t)] = t
    out = copy.deepcopy(model, memo)
    for module in list(_modules_once(out)):
        _rename_one(module, scheme)
    return out


def _modules_once(model: nn.Module) -> Iterator[nn.Module]:
    seen: set[int] = set()
    stack = [model]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        yield m
        stack.extend(c for c in m._modules.values() if c is not None)


def counter_scheme(prefix: dict[str, str] | None = None) -> Scheme:
    """``m0, m1, ...`` for modules, ``p0, ...`` for parameters, ``b0, ...`` for buffers (model-wide counters)."""
    prefix = prefix or {"module": "m", "param": "p", "buffer": "b"}
    counts = dict.fromkeys(prefix, 0)

    def scheme(module: nn.Module, kind: str, old: str, forbidden: set[str]) -> str:
        while True:
            name = f"{prefix[kind]}{counts[kind]}"
            counts[kind] += 1
            if name not in forbidden:
                return name

    return scheme


def old_names(original: nn.Module, renamed_model: nn.Module) -> dict[str, str]:
    """``{new qualified name: old qualified name}`` for every module, parameter and buffer (modules by
    structure: the two models are walked in step)."""
    out: dict[str, str] = {"": ""}

    def walk(a: nn.Module, b: nn.Module, pa: str, pb: str) -> None:
        for store in ("_parameters", "_buffers"):
            for (na, _), (nb, _) in zip(getattr(a, store).items(), getattr(b, store).items(), strict=True):
                out[pb + nb] = pa + na
        for (na, ca), (nb, cb) in zip(a._modules.items(), b._modules.items(), strict=True):
            out[pb + nb] = pa + na
            if ca is not None and cb is not None:
                walk(ca, cb, pa + na + ".", pb + nb + ".")

    walk(original, renamed_model, "", "")
    return out
