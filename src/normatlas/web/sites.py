"""Every norm site of an inspected model's first layer, with its arithmetic written from the report's typed fields.

:func:`site_views` is what the Inspect view's diagram draws and what a click on a site opens: the site's place
(which branch, which slot: ``pre`` / ``out`` on the branch, ``post`` on the stream after the add, ``qk`` / ``v``
inside attention, ``embedding`` / ``final`` on the stream before the first and after the last layer; branch
``other``: a norm off the block's main path, a side path's or a head's, its slot its role) and
:func:`arithmetic`, the lines of its computation. Everything is read from :class:`normatlas.inspect.NormInfo`'s
typed fields (operator, eps and where it sits, gain convention, bias, cast order, output scale); the module name
rides along as a label and is never read.
"""

from __future__ import annotations

from typing import Any

from ..spec import CastOrder, EpsPlacement, GainConvention
from ..vocabulary import Operator, SiteRole

__all__ = ["arithmetic", "formula", "site_views"]

# the statistic each operator divides by, and the numerator it divides
_STAT = {
    Operator.RMSNORM: ("x", "mean(x²)", "ms = mean(x²) over the last {d} values"),
    Operator.LAYERNORM: ("(x − μ)", "σ²", "μ = mean(x), σ² = mean((x − μ)²) over the last {d} values"),
    Operator.LAYERNORM_NONPARAM: ("(x − μ)", "σ²", "μ = mean(x), σ² = mean((x − μ)²) over the last {d} values"),
    Operator.L2: ("x", "sum(x²)", "‖x‖² = sum(x²) over the last {d} values"),
    Operator.GROUPNORM: ("(x − μ)", "σ²", "μ, σ² over each group of channels ({d} values in all)"),
}
_GAIN = {GainConvention.W: "w", GainConvention.ONE_PLUS_W: "(1 + w)"}
_GAIN_WORDS = {
    GainConvention.W: "the multiplier is the stored w (initialised at 1)",
    GainConvention.ONE_PLUS_W: "the multiplier is 1 + the stored w (w initialised at 0)",
}
_CAST_WORDS = {
    CastOrder.AFTER_GAIN: "statistics in float32; the result returns to the input dtype after the gain",
    CastOrder.BEFORE_GAIN: "statistics in float32; x̂ returns to the input dtype before the gain",
    CastOrder.INPUT_DTYPE: "everything in the input dtype",
}


def _num(x: float) -> str:
    return f"{x:g}"


def _denominator(var: str, where: EpsPlacement | None, eps: float | None) -> str:
    e = _num(eps) if eps is not None else "eps"
    if where is EpsPlacement.OUTSIDE_SQRT:
        return f"(sqrt({var}) + {e})"
    if where is EpsPlacement.CLAMP:
        return f"max(sqrt({var}), {e})"
    if eps is None and where is None:
        return f"sqrt({var})"
    return f"sqrt({var} + {e})"


def formula(n: Any) -> str | None:
    """One line: the site's output ``y`` from its input ``x`` (None when the operator is not a named one)."""
    if n.operator not in _STAT:
        return None
    top, var, _ = _STAT[n.operator]
    x_hat = f"{top} / {_denominator(var, n.eps_placement, n.eps)}"
    gain = _GAIN.get(n.gain_convention) if n.gain_convention is not None else None
    bias = " + b" if n.bias else ""
    scaled = f"{gain} ⊙ ({x_hat})" if gain else x_hat
    if n.cast_order is CastOrder.BEFORE_GAIN:
        y = f"{gain + ' ⊙ ' if gain else ''}({x_hat}).to(dtype){bias}"
    elif n.cast_order is CastOrder.AFTER_GAIN:
        y = f"({scaled}{bias}).to(dtype)"
    else:
        y = f"{scaled}{bias}"
    if n.output_scale != 1.0:
        y = f"{_num(n.output_scale)} · {y}"
    return f"y = {y}"


def arithmetic(n: Any) -> list[dict[str, str]]:
    """The site's computation as labelled lines: statistic, normalize (with eps and where it sits), gain, bias,
    cast order, output scale."""
    lines = []
    if n.operator in _STAT:
        lines.append({"step": "statistic", "expr": _STAT[n.operator][2].format(d=n.size)})
        top, var, _ = _STAT[n.operator]
        lines.append({"step": "normalize", "expr": f"x̂ = {top} / {_denominator(var, n.eps_placement, n.eps)}"})
    else:
        lines.append({"step": "operator", "expr": f"{n.operator.value}: not one of the named operators"})
    eps_where = n.eps_placement.value.replace("_", " ") if n.eps_placement is not None else "not measured"
    lines.append({"step": "eps", "expr": f"{_num(n.eps) if n.eps is not None else 'not measured'} ({eps_where})"})
    if n.gain_convention is None:
        lines.append({"step": "gain", "expr": "none"})
    else:
        lines.append({"step": "gain", "expr": f"{_GAIN[n.gain_convention]} ⊙ x̂: {_GAIN_WORDS[n.gain_convention]}"})
    lines.append({"step": "bias", "expr": "+ b" if n.bias else "none"})
    cast = _CAST_WORDS.get(n.cast_order) if n.cast_order is not None else None
    lines.append({"step": "cast order", "expr": cast or "not measured (a fused kernel hides it)"})
    if n.output_scale != 1.0:
        lines.append({"step": "output scale", "expr": f"× {_num(n.output_scale)}"})
    if (f := formula(n)) is not None:
        lines.append({"step": "in all", "expr": f})
    return lines


def _site(n: Any, branch: str, slot: str) -> dict[str, Any]:
    return {
        "index": n.index,
        "role": n.role.value,
        "layer": n.layer,
        "branch": branch,
        "slot": slot,
        "module": n.module,
        "operator": n.operator.value,
        "size": n.size,
        "eps": n.eps,
        "eps_placement": n.eps_placement.value if n.eps_placement is not None else None,
        "gain_convention": n.gain_convention.value if n.gain_convention is not None else "none",
        "bias": n.bias,
        "cast_order": n.cast_order.value if n.cast_order is not None else None,
        "output_scale": n.output_scale,
        "fused": n.fused,
        "probe": dict(n.probe),
        "arithmetic": arithmetic(n),
    }


def site_views(report: Any) -> list[dict[str, Any]]:
    """The norm sites the diagram draws: the embedding norm, the first layer's (its sublayers' slots, the QK- and
    V-norms inside its attention, and any other norm in its stretch of the dataflow: side paths, a tower's heads),
    and the final norm. A site's place in the dataflow (its index) decides what belongs to the first layer: a QK- or
    V-norm of it runs before its last sublayer norm, another norm before the next layer's first."""
    norms = sorted(getattr(report, "norms", []), key=lambda n: n.index)
    by_index = {n.index: n for n in norms}
    subs = getattr(report, "sublayers", [])
    if not subs:
        return []
    layer = subs[0].layer
    first = [s for s in subs if s.layer == layer]
    attn, ffn = first[0], first[1] if len(first) > 1 else first[0]
    own = [i for s in first for i in (*s.pre, *s.out, *s.post)]
    last_own = max(own, default=-1)
    later = [i for s in subs if s.layer != layer for i in (*s.pre, *s.out, *s.post)]
    next_first = min(later, default=float("inf"))
    out: list[dict[str, Any]] = []
    seen: set[int] = set()

    def add(n: Any, branch: str, slot: str) -> None:
        if n.index not in seen:
            seen.add(n.index)
            out.append(_site(n, branch, slot))

    for n in norms:
        if n.role is SiteRole.EMBEDDING:
            add(n, "stream", "embedding")
    for sub, branch in ((attn, "attn"), (ffn, "ffn")):
        for slot in ("pre", "out", "post"):
            for i in getattr(sub, slot):
                if i in by_index:
                    add(by_index[i], branch, slot)
    for n in norms:
        if n.role in (SiteRole.QK, SiteRole.V) and (n.layer == layer or n.index < last_own):
            add(n, "attn", n.role.value)
    for n in norms:
        if n.role is SiteRole.FINAL:
            add(n, "stream", "final")
    inner = (SiteRole.PRE, SiteRole.OUT, SiteRole.POST, SiteRole.QK, SiteRole.V, SiteRole.FINAL, SiteRole.EMBEDDING)
    for n in norms:
        if n.role not in inner and n.index < next_first:
            add(n, "other", n.role.value)
    return out
