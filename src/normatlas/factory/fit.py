"""Fits that keep a shrunk config buildable (:func:`.shrink.tiny_config`): the widths a config states as products
of each other, and the fields a model reads from a sub-config that only its parent config holds.

* **Products** (:func:`product_fixes`, tried by :func:`build_running` after the config rebuilt from its shrunk fields,
  where its ``__post_init__`` derives them: Zamba 2). A state-space mixer's inner width is ``expand * hidden_size``
  and its heads tile it: ``num_heads * head_dim == expand * hidden_size`` (Mamba 2 128 x 64 = 2 x 4096, Bamba, Zamba 2
  8 x 640 = 2 x 2560); a group count divides the head count (``n_groups``). Shrinking ``hidden_size`` (and
  ``head_dim``) breaks the product, and the tiny model fails its first reshape. Every such relation is read off the
  original config's own numbers, never its field names: two integer fields whose product was a multiple ``e`` (the
  value of a third, unchanged field, ``2 <= e <= 8``) of the hidden size are refitted to the same multiple of the
  shrunk hidden size, by cutting the larger factor the shrink did not set; a width field that was ``e * hidden_size``
  follows it (Zamba 2's ``attention_hidden_size``); a field that divided the cut factor is cut to a divisor of the new
  one. Powers of two make such coincidences common (``state_size * chunk_size`` is ``8 * hidden_size`` in Mamba 2), so
  a refit is only a candidate: it is applied when the shrunk model does not run, smallest multiple first, and kept
  when its model runs (the layout chosen by running it, as a tower's input is).
* **Required fields** (:func:`build_filling`). transformers' own default ``DbrxConfig()`` keeps ``rope_theta`` in
  the parent's ``rope_parameters`` while the attention reads ``attn_config.rope_theta``: building the model raises
  an ``AttributeError`` naming the sub-config object and the field. The field is then copied from the model's own
  config (an attribute of the parent, or a key of one of its dict-valued fields) onto that sub-config, and the
  build retried; an ``AttributeError`` on anything but a sub-config of the model's config is raised as it is.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, TypeVar

from .shrink import config_parts

__all__ = ["build_filling", "build_running", "product_fixes"]

M = TypeVar("M")
_TRIES = 8


def _ints(d: dict[str, Any]) -> dict[str, int]:
    return {k: v for k, v in d.items() if type(v) is int and v > 0}


def product_fixes(c: Any, before: dict[str, Any], deliberate: set[str]) -> list[dict[str, int]]:
    """The candidate refits of ``c``'s product relations broken by the shrink (``before``: its fields unshrunk;
    ``deliberate``: the fields the shrink set), most likely first: each a dict of fields to set together."""
    was, now = _ints(before), _ints(c.to_dict())
    h0, h = was.get("hidden_size"), now.get("hidden_size")
    if h0 is None or h is None or h >= h0:
        return []
    keys = [k for k in was if k in now and k != "hidden_size" and was[k] > 1]
    multiples = {e: was[e] for e in keys if 2 <= was[e] <= _MAX_MULTIPLE and now.get(e) == was[e]}
    fixes: list[tuple[int, int, dict[str, int]]] = []
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            m = min((v for e, v in multiples.items() if e not in (a, b) and was[a] * was[b] == v * h0), default=None)
            if m is None or now[a] * now[b] == m * h:
                continue
            free = [k for k in (a, b) if k not in deliberate] or [a, b]
            cut = max(free, key=lambda k: now[k])
            keep = b if cut == a else a
            if (m * h) % now[keep]:
                continue
            new = (m * h) // now[keep]
            fix = {cut: new}
            for g in keys:  # a count below both factors that divided the cut one (a group count of its heads)
                small = g not in (a, b, *multiples) and g not in deliberate and was[g] < min(was[a], was[b])
                if small and was[cut] % was[g] == 0 and new % now[g]:
                    fix[g] = math.gcd(now[g], new)
            for k in keys:  # a width stated as the multiple itself (an inner width = expand * hidden_size)
                if k not in fix and k not in deliberate and now[k] == was[k] == m * h0 and k.endswith(_WIDTHS):
                    fix[k] = m * h
            fixes.append((m, len(fix), fix))
    return [f for _, _, f in sorted(fixes, key=lambda t: t[:2])]  # smallest multiple, fewest fields first


_WIDTHS = ("_size", "_dim")
_MAX_MULTIPLE = 8  # an expansion factor (Mamba's expand = 2); a larger multiple of the width is no inner width


def build_running(
    cfg: Any, parts: list[tuple[Any, dict[str, Any]]], deliberate: set[str], build: Callable[[Any], M],
    runs: Callable[[M], bool], rederive: Callable[[Any], Any],
) -> M:  # fmt: skip
    """``build(cfg)`` when the model runs (``runs``); else the config rebuilt from its shrunk fields so that the
    widths its ``__post_init__`` derives follow them (``rederive``: Zamba 2's ``mamba_headdim = expand * hidden /
    heads``, set once from the unshrunk width), else the first candidate refit (:func:`product_fixes` of each
    ``(part, its fields unshrunk)`` of ``cfg``) whose model runs, chosen by running it; else ``build(cfg)``."""
    import copy

    model = build_filling(cfg, build)
    if runs(model):
        return model
    with contextlib.suppress(Exception):
        rebuilt = rederive(copy.deepcopy(cfg))
        if rebuilt is not cfg:
            candidate = build_filling(rebuilt, build)
            if runs(candidate):
                return candidate
    for i, (part, before) in enumerate(parts):
        for fix in product_fixes(part, before, deliberate)[:_TRIES]:
            trial = copy.deepcopy(cfg)
            target = config_parts(trial)[i]
            with contextlib.suppress(Exception):
                for key, val in fix.items():
                    setattr(target, key, val)
                candidate = build_filling(trial, build)
                if runs(candidate):
                    return candidate
    return model


def build_filling(cfg: Any, build: Callable[[Any], M]) -> M:
    """``build(cfg)``, filling a field the model reads from a sub-config of ``cfg`` that lacks it from ``cfg``
    itself (the module docstring) and retrying, a few fields at most."""
    for _ in range(_TRIES):
        try:
            return build(cfg)
        except AttributeError as exc:
            if not _fill(cfg, getattr(exc, "obj", None), getattr(exc, "name", None)):
                raise
    return build(cfg)


def _sub_configs(cfg: Any) -> list[Any]:
    subs = [getattr(cfg, k, None) for k in getattr(cfg, "sub_configs", None) or {}]
    return [s for s in subs if s is not None and s is not cfg and hasattr(s, "to_dict")]


def _fill(cfg: Any, obj: Any, name: Any) -> bool:
    if not isinstance(name, str) or obj is None or not any(obj is s for s in _sub_configs(cfg)):
        return False
    value = _get(cfg, name)
    if value is _MISSING:
        return False
    try:
        setattr(obj, name, value)
    except Exception:
        return False
    return True


_MISSING = object()


def _get(cfg: Any, name: str) -> Any:
    """``cfg.name``, else the value under ``name`` in one of ``cfg``'s dict fields (``rope_parameters``)."""
    with contextlib.suppress(Exception):
        if name in cfg.to_dict() or hasattr(type(cfg), name):
            return getattr(cfg, name)
    for val in vars(cfg).values():
        if isinstance(val, dict) and name in val:
            return val[name]
    return _MISSING
