"""Classify a norm module by perturbation, name-free (the hook-based probe).

Method: the shared behavioural probe :func:`normatlas.probe.probe` (rescale invariance
-> it normalizes, essay §02; shift invariance -> it centres; the zeroing test -> gain
convention ``w`` / ``1+w`` and bias; eps measured from ``mean(y^2)`` at known input
scales), restricted to norms over the last axis of size ``size``, reported in the
inspect vocabulary (operator, ``"w"``/``"1+w"``/``"none"``/``"other"``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..probe import ParamRole, probe
from .report import InspectionReport, Operator, Placement, QKNorm, RopeOrder
from .trace import Graph

__all__ = ["check_sites", "probe_module", "probe_report"]


def probe_module(module: nn.Module, size: int, *, seed: int = 0) -> dict[str, Any] | None:
    """Perturbation probe of a module acting on the last axis of size ``size``; None if it is no norm."""
    facts = probe(module, size, seed=seed)
    if facts is None or facts.feature_axis != -1:
        return None
    if not any(p.is_floating_point() for p in module.parameters()):
        conv = "none"
    elif facts.structured and facts.gain_param is not None:
        conv = facts.convention.value  # "w" or "1+w"
    else:
        conv = "other"
    bias = any(r is ParamRole.BIAS for r in facts.roles.values())
    eps = float(f"{facts.eps:.3g}") if facts.eps_measured else None
    op = Operator.LAYERNORM if facts.center else Operator.RMSNORM
    if op is Operator.LAYERNORM and conv == "none" and not bias:
        op = Operator.LAYERNORM_NONPARAM
    return {"operator": op.value, "gain_convention": conv, "bias": bias, "eps": eps}


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
