"""Classify a norm module by perturbation, name-free (the hook-based probe).

Method: call the module on a seeded random batch ``x`` (non-zero mean) and on
transformed copies, in float32:

* rescale: ``f(a x) == f(x)`` for a > 0 -> it normalizes (essay §02, re-scaling
  invariance); shift: ``f(x + c) == f(x)`` -> it centres (LayerNorm), else RMS;
* gain convention: with every floating parameter set to 0 the output is 0 for a
  ``w`` gain and the unit-RMS normalized input for a ``1+w`` gain;
* bias: with random parameters, ``f(0) != 0`` only when a bias is added;
* eps: with ``r(s) = (f(s x) - f(0)) / (s (f(x) - f(0)))`` (gain and bias cancel),
  eps inside the root gives ``r^2 = (m + eps) / (s^2 m + eps)`` with m the row's
  (centred) mean square, so ``eps = m (1 - r^2 s^2) / (r^2 - 1)``; measured at the
  scales s where both factors are well conditioned, median taken.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from .report import InspectionReport, Operator, Placement, QKNorm, RopeOrder
from .trace import Graph

__all__ = ["check_sites", "probe_module", "probe_report"]


def _call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        raise TypeError("module does not map a tensor to a tensor of the same shape")
    return out.float()


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> bool:
    return bool(((a - b).abs().max() <= tol * (1 + b.abs().max())).item())


def probe_module(module: nn.Module, size: int, *, seed: int = 0) -> dict[str, Any] | None:
    """Perturbation probe of a module acting on the last axis of size ``size``; None if it is no norm."""
    gen = torch.Generator().manual_seed(seed)
    dtype = next((p.dtype for p in module.parameters()), torch.float32)
    x = (torch.randn(3, 5, size, generator=gen) * 3 + 0.5).to(dtype)
    with torch.no_grad():
        try:
            y = _call(module, x)
        except Exception:
            return None
        if not _close(_call(module, 2.5 * x), y, 1e-3):
            return None
        centred = _close(_call(module, x + 1.7), y, 1e-3)
        params = [p for p in module.parameters() if p.is_floating_point()]
        zeroed = copy.deepcopy(module)
        for p in zeroed.parameters():
            p.zero_()
        y0 = _call(zeroed, x)
        xc = x.float() - x.float().mean(-1, keepdim=True) if centred else x.float()
        unit = xc / xc.pow(2).mean(-1, keepdim=True).sqrt()
        if not params:
            conv = "none"
        elif _close(y0, torch.zeros_like(y0)):
            conv = "w"
        elif _close(y0, unit, 1e-3):
            conv = "1+w"
        else:
            conv = "other"
        rnd = copy.deepcopy(module)
        for p in rnd.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
        bias = bool(_call(rnd, torch.zeros_like(x)).abs().max() > 1e-6)
        # eps from the ratio curve, first row, largest coordinate
        row = x[:1, :1]
        f0 = _call(module, torch.zeros_like(row))
        fx = _call(module, row) - f0
        j = int(fx.abs().argmax())
        rc = row.float() - row.float().mean(-1, keepdim=True) if centred else row.float()
        m = float(rc.pow(2).mean())
        ests = []
        for k in range(0, 65):
            s = 10 ** (-k / 8)
            r = float((_call(module, (s * row.double()).to(row.dtype)) - f0).reshape(-1)[j]) / (
                s * float(fx.reshape(-1)[j])
            )
            if r * r > 1.05 and r * r * s * s * m < 0.95 * m and r * r * s * s < 0.95:
                ests.append(m * (1 - r * r * s * s) / (r * r - 1))
        eps = sorted(ests)[len(ests) // 2] if ests else None
    op = Operator.LAYERNORM if centred else Operator.RMSNORM
    if op is Operator.LAYERNORM and conv == "none" and not bias:
        op = Operator.LAYERNORM_NONPARAM
    return {"operator": op.value, "gain_convention": conv, "bias": bias, "eps": float(f"{eps:.3g}") if eps else None}


def check_sites(model: nn.Module, graph: Graph, report: InspectionReport) -> None:
    """Probe the module that ran each norm site; record the probe and whether it agrees with the graph."""
    cache: dict[tuple[str, int], dict[str, Any] | None] = {}
    for info in report.norms:
        if not info.module:
            continue
        key = (info.module, info.size)
        if key not in cache:
            try:
                mod = model.get_submodule(info.module)
            except AttributeError:
                cache[key] = None
                continue
            cache[key] = probe_module(mod, info.size) if not any(True for _ in mod.children()) else None
        res = cache[key]
        if res is None:
            continue
        agree = (
            res["operator"] == info.operator.value
            and res["gain_convention"] == info.gain_convention
            and res["bias"] == info.bias
        )
        if res["eps"] and info.eps and info.eps_placement == "inside_sqrt":
            agree = agree and math.isclose(res["eps"], info.eps, rel_tol=0.05)
        info.probe.update(res, agrees=agree)
        if not agree:
            report.notes.append(f"probe disagrees with the graph at {info.module}: {res}")


def probe_report(model: nn.Module, example_inputs: Any, name: str) -> InspectionReport:
    """Fallback when no dataflow can be recorded: probe every module seen by forward hooks."""
    seen: dict[str, int] = {}
    handles = []
    for path, mod in model.named_modules():

        def hook(m: nn.Module, args: tuple[Any, ...], out: Any, path: str = path) -> None:
            if (
                len(args) == 1
                and isinstance(args[0], torch.Tensor)
                and isinstance(out, torch.Tensor)
                and out.shape == args[0].shape
                and args[0].is_floating_point()
            ):
                seen.setdefault(path, args[0].shape[-1])

        handles.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            if isinstance(example_inputs, dict):
                model(**example_inputs)
            elif isinstance(example_inputs, (tuple, list)):
                model(*example_inputs)
            else:
                model(example_inputs)
    except Exception:
        pass
    finally:
        for h in handles:
            h.remove()
    if not seen:
        raise ValueError("no module ran")
    from .report import NormInfo

    norms: list[NormInfo] = []
    for path, size in seen.items():
        res = probe_module(model.get_submodule(path), size)
        if res is not None:
            norms.append(
                NormInfo(
                    len(norms),
                    "other",
                    None,
                    path,
                    Operator(res["operator"]),
                    size,
                    res["eps"],
                    None,
                    res["gain_convention"],
                    res["bias"],
                    None,
                    1.0,
                    False,
                    res,
                )
            )
    ops = {n.operator for n in norms}
    return InspectionReport(
        name,
        "hooks",
        0,
        None,
        ops.pop() if len(ops) == 1 else Operator.MIXED if ops else Operator.NONE,
        None,
        None,
        "n/a",
        any(n.bias for n in norms),
        None,
        Placement.UNKNOWN,
        "unknown",
        "unknown",
        [],
        None,
        None,
        None,
        QKNorm.NONE,
        RopeOrder.NOT_APPLICABLE,
        False,
        None,
        Operator.NONE,
        None,
        None,
        Operator.NONE,
        norms=norms,
    )
