"""An independent float64 reference for NormSpec, written differently from the core.

It maps axis roles to dims on its own, permutes the reduced dims to the end,
flattens them, and computes the statistics with explicit sums and counts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from normatlas.spec import Axis, EpsPlacement, Gain, GainConvention, NormSpec, Scale

TOL = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-10},
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def roles(spec: NormSpec, ndim: int) -> dict[int, Axis | None]:
    if spec.layout.channels_last:
        k = spec.feature_ndim
        out: dict[int, Axis | None] = {d: Axis.FEATURE for d in range(ndim - k, ndim)}
        if ndim > k:
            out[0] = Axis.SAMPLE
        out.update({d: Axis.POSITION for d in range(1 if ndim > k else 0, ndim - k)})
        return out
    return {0: Axis.SAMPLE, 1: Axis.FEATURE, **{d: Axis.POSITION for d in range(2, ndim)}}


def reference(
    x: Tensor,
    spec: NormSpec,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    mask: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    """float64 reference; differentiable with respect to x, weight and bias."""
    x = x.double()
    eps = spec.eps if spec.eps is not None else eps
    assert eps is not None
    r = roles(spec, x.ndim)
    m = torch.ones_like(x) if mask is None else mask.expand(x.shape).double()
    shape = x.shape
    if spec.groups > 1:
        f = next(d for d, a in r.items() if a is Axis.FEATURE)
        g = spec.groups
        new = (*shape[:f], g, shape[f] // g, *shape[f + 1 :])
        x, m = x.reshape(new), m.reshape(new)
        r = {(d if d < f else d + 1): a for d, a in r.items()}
        r[f] = None  # the group axis is kept: one statistic per group
        r[f + 1] = Axis.FEATURE
    red = [d for d, a in r.items() if a in spec.reduce]
    keep = [d for d in range(x.ndim) if d not in red]
    perm = keep + red
    xp = x.permute(perm)
    mp = m.permute(perm)
    kshape = xp.shape[: len(keep)]
    xp = xp.reshape(*kshape, -1)
    mp = mp.reshape(*kshape, -1)
    n = mp.sum(-1, keepdim=True)
    mean = (xp * mp).sum(-1, keepdim=True) / n.clamp(min=1) if spec.center else torch.zeros_like(n)
    xc = xp - mean
    ss = (xc * xc * mp).sum(-1, keepdim=True)
    stat = ss if spec.scale is Scale.L2 else ss / n.clamp(min=1)
    if spec.scale is Scale.NONE:
        y = xc
    elif spec.eps_placement is EpsPlacement.INSIDE_SQRT:
        y = xc / torch.sqrt(stat + eps)
    elif spec.eps_placement is EpsPlacement.OUTSIDE_SQRT:
        y = xc / (torch.sqrt(stat) + eps)
    else:
        y = xc / torch.maximum(torch.sqrt(stat), torch.tensor(eps, dtype=torch.float64))
    y = y.reshape(*kshape, *[x.shape[d] for d in red])
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    y = y.permute(inv).reshape(shape)
    view = _param_view(spec, shape)
    if weight is not None and spec.gain is not Gain.NONE:
        w = weight.double()
        w = 1 + w if spec.gain_convention is GainConvention.ONE_PLUS_W else w
        y = y * (w if spec.gain is Gain.SCALAR else w.reshape(view))
    if bias is not None:
        y = y + bias.double().reshape(view)
    return y


def _param_view(spec: NormSpec, shape: torch.Size) -> tuple[int, ...]:
    if spec.layout.channels_last:
        return tuple(shape[len(shape) - spec.feature_ndim :])
    return (shape[1],) + (1,) * (len(shape) - 2)
