"""The Axes page's API: the taxonomy table, and one reduction classified and computed by the core.

``normalize_view`` is what ``POST /api/normalize`` answers: the layer's name from
:func:`normatlas.taxonomy.classify`, the essay's four lines of arithmetic with the real shapes
(read from the core's own :func:`~normatlas.functional.resolve` plan), and the statistics and
before / after histograms of :func:`normatlas.functional.normalize` run on a seeded sample tensor.
With an explicit ``input`` (and optionally an ``upstream`` gradient) it also returns the output and
the input gradient from autograd, which the Geometry page draws.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..functional import moments, normalize, resolve
from ..spec import Axis, Gain, Layout, NormSpec, parse_enum
from ..taxonomy import AXIS_LETTERS, classify, taxonomy_table

__all__ = ["DEFAULT_SHAPES", "LAYOUTS", "MAX_ELEMENTS", "MAX_MAGNITUDE", "normalize_view", "taxonomy_view"]

#: the two conventions the page draws side by side, and the sample tensor each gets by default
LAYOUTS = (Layout.NCHW, Layout.BTD)
DEFAULT_SHAPES = {Layout.NCHW: (8, 6, 4, 4), Layout.BTD: (8, 16, 6)}
MAX_ELEMENTS = 1 << 16  # a sample tensor the page may ask for (64 Ki values)
#: the largest |value| of an explicit input or upstream: its square, summed over MAX_ELEMENTS, stays finite in float64
MAX_MAGNITUDE = 1e150
BINS = 24
_CONVENTION = {Layout.NCHW: "vision", Layout.BTD: "sequence"}
_KEYS = frozenset({"layout", "reduce", "groups", "center", "seed", "shape", "input", "upstream"})


def taxonomy_view() -> dict[str, Any]:
    """``GET /api/taxonomy``: the taxonomy rows, the axis roles and how each convention spells them."""
    return {
        "rows": taxonomy_table(),
        "axes": [a.value for a in Axis],
        "layouts": [
            {
                "layout": layout.value,
                "convention": _CONVENTION[layout],
                "letters": {a.value: AXIS_LETTERS[_CONVENTION[layout]][a] for a in Axis},
                "default_shape": list(DEFAULT_SHAPES[layout]),
            }
            for layout in LAYOUTS
        ],
    }


def _int(body: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{key}={value!r} must be an integer in [{low}, {high}]")
    return value


def _parse(body: Mapping[str, Any]) -> tuple[Layout, frozenset[Axis], int, bool, int]:
    if not isinstance(body, Mapping):
        raise TypeError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _KEYS)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; allowed: {sorted(_KEYS)}")
    layout = parse_enum(Layout, body.get("layout", Layout.NCHW.value), name="layout")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout.value!r} is not one of {[lay.value for lay in LAYOUTS]}")
    reduce = body.get("reduce")
    if not isinstance(reduce, list) or not reduce or not all(isinstance(a, str) for a in reduce):
        raise ValueError(f"reduce={reduce!r} must be a non-empty list of {[a.value for a in Axis]}")
    axes = frozenset(parse_enum(Axis, a, name="reduce") for a in reduce)
    groups = _int(body, "groups", 1, 1, 1024)
    center = body.get("center", True)
    if not isinstance(center, bool):
        raise TypeError(f"center={center!r} must be true or false")
    return layout, axes, groups, center, _int(body, "seed", 0, 0, 2**31 - 1)


def _shape(body: Mapping[str, Any], layout: Layout) -> tuple[int, ...]:
    shape = body.get("shape", list(DEFAULT_SHAPES[layout]))
    if not isinstance(shape, list) or len(shape) != len(layout.value):
        raise ValueError(f"shape={shape!r} must be a list of {len(layout.value)} sizes for layout={layout.value!r}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 4096 for n in shape):
        raise ValueError(f"shape={shape!r}: every size must be an integer in [1, 4096]")
    if math.prod(shape) > MAX_ELEMENTS:
        raise ValueError(f"shape={shape!r} has {math.prod(shape)} elements; at most {MAX_ELEMENTS}")
    return tuple(shape)


def _tensor(value: Any, name: str, layout: Layout) -> torch.Tensor:
    try:
        t = torch.tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name} must be a nested list of numbers (a rectangular array): {exc}") from None
    if t.dim() != len(layout.value) or t.numel() > MAX_ELEMENTS or not torch.isfinite(t).all():
        raise ValueError(
            f"{name} must be a finite {len(layout.value)}-d array for layout={layout.value!r} "
            f"with at most {MAX_ELEMENTS} values; got shape {list(t.shape)}"
        )
    if t.numel() and float(t.abs().max()) > MAX_MAGNITUDE:
        raise ValueError(
            f"{name} has a value of magnitude {float(t.abs().max()):.3g}; every |value| must be at most "
            f"{MAX_MAGNITUDE:.0e} (its square must stay finite in float64)"
        )
    return t


def sample_tensor(layout: Layout, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A seeded float64 tensor whose channels and samples have their own offsets and scales, so that
    each reduction visibly removes something different."""
    g = torch.Generator().manual_seed(seed)
    c_dim = len(shape) - 1 if layout.channels_last else 1
    view = [1] * len(shape)
    view[c_dim] = shape[c_dim]
    chan_shift = torch.linspace(-2.0, 3.0, shape[c_dim], dtype=torch.float64).view(view)
    chan_scale = torch.linspace(0.5, 2.5, shape[c_dim], dtype=torch.float64).view(view)
    sample_shift = torch.randn(shape[0], generator=g, dtype=torch.float64).view(-1, *[1] * (len(shape) - 1))
    noise = torch.randn(shape, generator=g, dtype=torch.float64)
    return noise * chan_scale + chan_shift + sample_shift


def _hist(t: torch.Tensor) -> dict[str, Any]:
    lo, hi = float(t.min()), float(t.max())
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    counts = torch.histc(t.double(), bins=BINS, min=lo, max=hi)
    return {"lo": lo, "hi": hi, "counts": [int(c) for c in counts.tolist()]}


def _summary(t: torch.Tensor) -> dict[str, float]:
    return {"mean": float(t.mean()), "std": float(t.std(unbiased=False)), "min": float(t.min()), "max": float(t.max())}


def _arithmetic(spec: NormSpec, shape: tuple[int, ...]) -> tuple[list[dict[str, Any]], tuple[int, ...]]:
    """The essay's four lines with the real shapes of the core's plan (grouped view, reduced dims, params)."""
    plan = resolve(spec, shape)
    view = plan.view or shape
    dims = plan.reduce_dims
    stat = tuple(1 if d in dims else n for d, n in enumerate(view))
    grouped = f"x.view{list(view)}" if plan.view else "x"
    first = (
        {"step": "mean", "expr": f"mu = {grouped}.mean(dims={list(dims)})", "shape": list(stat)}
        if spec.center
        else {"step": "mean", "expr": "(no centring: RMS variant)", "shape": None}
    )
    var = "((x - mu)^2)" if spec.center else "(x^2)"
    return [
        first,
        {"step": "variance", "expr": f"var = {var}.mean(dims={list(dims)})", "shape": list(stat)},
        {
            "step": "normalise",
            "expr": ("x_hat = (x - mu) / sqrt(var + eps)" if spec.center else "x_hat = x / sqrt(var + eps)"),
            "shape": list(shape),
        },
        {"step": "affine", "expr": "y = gamma * x_hat + beta", "shape": list(plan.param_view)},
    ], stat


def normalize_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """``POST /api/normalize``: see the module docstring. Raises ValueError/TypeError naming the field."""
    layout, axes, groups, center, seed = _parse(body)
    explicit = body.get("input") is not None
    x = _tensor(body["input"], "input", layout) if explicit else sample_tensor(layout, _shape(body, layout), seed)
    shape = tuple(x.shape)
    channels = shape[-1] if layout.channels_last else shape[1]
    taxon = classify(layout, axes, groups=groups, num_channels=channels, center=center)
    spec = NormSpec(layout=layout, reduce=axes, groups=groups, center=center, bias=center, gain=Gain.PER_FEATURE)
    lines, stat_shape = _arithmetic(spec, shape)
    plan = resolve(spec, shape)
    xv = x.view(plan.view) if plan.view else x
    mean, _, ms, count = moments(xv, spec, plan.reduce_dims, None)
    y = normalize(x, spec, backend="reference")
    if not bool(torch.isfinite(y).all()):  # a guard: the bounds above keep every statistic finite
        raise ValueError(f"the normalised {'input' if explicit else 'sample'} is not finite; use smaller values")
    effect, effect_note = _batch_effect(x, y, spec)
    out: dict[str, Any] = {
        "layout": layout.value,
        "reduce": sorted(a.value for a in axes),
        "groups": groups,
        "center": center,
        "seed": seed,
        "name": taxon.name,
        "note": taxon.note,
        "per": taxon.per,
        "batch_dependent": taxon.batch_dependent,
        # measured: how far sample 0's output moves when it is normalised alone instead of in the batch
        "batch_effect": effect,
        "batch_effect_note": effect_note,
        "shape": list(shape),
        "stat_shape": list(stat_shape),
        "statistics": int(math.prod(stat_shape)),
        "per_statistic": int(count),
        "arithmetic": lines,
        "stats": {
            "mean": _summary(mean) if mean is not None else None,
            "var": _summary(ms),
            "before": _summary(x),
            "after": _summary(y),
        },
        "hist": {"before": _hist(x), "after": _hist(y)},
    }
    if explicit:
        out |= _output_and_grad(x, spec, body.get("upstream"), layout)
    return out


def _batch_effect(x: torch.Tensor, y: torch.Tensor, spec: NormSpec) -> tuple[float | None, str]:
    """How far sample 0's output moves when it is normalised alone instead of in the batch (measured)."""
    try:
        lone = normalize(x[:1], spec, backend="reference")
    except ValueError as exc:  # e.g. statistics over the batch axis alone need two samples
        return None, f"undefined for a single sample: {exc}"
    return float((lone - y[:1]).abs().max()), "max |y(sample 0 alone) - y(sample 0 in the batch)|"


def _output_and_grad(x: torch.Tensor, spec: NormSpec, upstream: Any, layout: Layout) -> dict[str, Any]:
    """The output for an explicit input, and with ``upstream`` the input gradient (autograd of the core)."""
    xg = x.clone().requires_grad_(True)
    y = normalize(xg, spec, backend="reference")
    res: dict[str, Any] = {"output": y.detach().tolist()}
    if upstream is not None:
        g = _tensor(upstream, "upstream", layout)
        if g.shape != y.shape:
            raise ValueError(f"upstream has shape {list(g.shape)}; it must match input's {list(y.shape)}")
        (grad,) = torch.autograd.grad(y, xg, g)
        res["input_grad"] = grad.tolist()
    return res
