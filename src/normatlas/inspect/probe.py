"""Classify a norm module by perturbation, name-free (the hook-based probe).

Method: the shared behavioural probe :func:`normatlas.analysis.probe` (rescale invariance
-> it normalizes, essay §02; shift invariance -> it centres; the zeroing test -> gain
convention ``w`` / ``1+w`` and bias; eps measured from ``mean(y^2)`` at known input
scales), restricted to norms over the last axis of size ``size``, reported in the design
vocabulary (:class:`ProbeResult`: operator, gain convention or none, bias, eps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..analysis.graph import Graph
from ..analysis.probe import ParamRole, probe
from ..spec import EpsPlacement, GainConvention
from ..vocabulary import BranchScale, Operator, PlacementKind, PlacementMix, QKNormKind, RopeOrder, SiteRole
from .report import InspectionReport, NormInfo

__all__ = ["ProbeResult", "check_sites", "probe_module", "probe_report"]


@dataclass(frozen=True)
class ProbeResult:
    """What the behavioural probe measured of the module that ran a site (``gain_convention`` None: no gain;
    ``structured`` False: parameters other than one gain and one bias, so no convention is reported)."""

    operator: Operator
    gain_convention: GainConvention | None
    structured: bool
    bias: bool
    eps: float | None

    def as_dict(self) -> dict[str, Any]:
        conv = self.gain_convention.value if self.gain_convention else "none" if self.structured else "other"
        return {"operator": self.operator.value, "gain_convention": conv, "bias": self.bias, "eps": self.eps}


def probe_module(module: nn.Module, size: int, *, seed: int = 0) -> ProbeResult | None:
    """Perturbation probe of a module acting on the last axis of size ``size``; None if it is no norm."""
    facts = probe(module, size, seed=seed)
    if facts is None or facts.feature_axis != -1:
        return None
    has_params = any(p.is_floating_point() for p in module.parameters())
    structured = not has_params or (facts.structured and facts.gain_param is not None)
    conv = facts.measured.gain_convention if has_params and structured else None
    bias = any(r is ParamRole.BIAS for r in facts.roles.values())
    eps = float(f"{facts.eps:.3g}") if facts.eps_measured else None
    op = Operator.LAYERNORM if facts.measured.center else Operator.RMSNORM
    if op is Operator.LAYERNORM and not has_params and not bias:
        op = Operator.LAYERNORM_NONPARAM
    return ProbeResult(op, conv, structured, bias, eps)


def _agrees(res: ProbeResult, info: NormInfo) -> bool:
    agree = (
        res.structured
        and res.operator is info.operator
        and res.gain_convention is info.gain_convention
        and res.bias == info.bias
    )
    if res.eps and info.eps and info.eps_placement is EpsPlacement.INSIDE_SQRT:
        agree = agree and math.isclose(res.eps, info.eps, rel_tol=0.05)
    return agree


def check_sites(model: nn.Module, graph: Graph, report: InspectionReport) -> None:
    """Probe the module that ran each norm site; record the probe and whether it agrees with the graph."""
    cache: dict[tuple[str, int], ProbeResult | None] = {}
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
        agree = _agrees(res, info)
        info.probe.update(res.as_dict(), agrees=agree)
        if not agree:
            report.notes.append(f"probe disagrees with the graph at {info.module}: {res.as_dict()}")


def _shape_keeping_modules(model: nn.Module, example_inputs: Any) -> dict[str, int]:
    """Every module that ran on one floating tensor and returned one of the same shape: path -> last dim."""
    seen: dict[str, int] = {}
    handles = []

    def hook(path: str) -> Any:
        def record(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            x = args[0] if len(args) == 1 else None
            same = isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and out.shape == x.shape
            if same and x.is_floating_point():  # type: ignore[union-attr]
                seen.setdefault(path, x.shape[-1])  # type: ignore[union-attr]

        return record

    for path, mod in model.named_modules():
        handles.append(mod.register_forward_hook(hook(path)))
    try:
        with torch.no_grad():
            if isinstance(example_inputs, dict):
                model(**example_inputs)
            elif isinstance(example_inputs, (tuple, list)):
                model(*example_inputs)
            else:
                model(example_inputs)
    except Exception:
        pass  # the modules that ran before the failure are still seen
    finally:
        for h in handles:
            h.remove()
    return seen


def probe_report(model: nn.Module, example_inputs: Any, name: str) -> InspectionReport:
    """Fallback when no dataflow can be recorded: probe every module seen by forward hooks."""
    seen = _shape_keeping_modules(model, example_inputs)
    if not seen:
        raise ValueError("no module ran")
    norms: list[NormInfo] = []
    for path, size in seen.items():
        res = probe_module(model.get_submodule(path), size)
        if res is not None:
            norms.append(
                NormInfo(
                    len(norms),
                    SiteRole.OTHER,
                    None,
                    path,
                    res.operator,
                    size,
                    res.eps,
                    None,
                    res.gain_convention,
                    res.bias,
                    None,
                    1.0,
                    False,
                    res.as_dict(),
                )
            )
    ops = {n.operator for n in norms}
    return InspectionReport(
        model=name, tracer="hooks", layers=0, hidden_size=None,
        operator=ops.pop() if len(ops) == 1 else Operator.MIXED if ops else Operator.NONE,
        eps=None, eps_placement=None, gain_convention=None, bias=any(n.bias for n in norms), cast_order=None,
        placement=PlacementKind.UNKNOWN, placement_attention=PlacementMix((PlacementKind.UNKNOWN,)),
        placement_mlp=PlacementMix((PlacementKind.UNKNOWN,)),
        placement_by_layer=(), residual_scale=BranchScale(), branch_scale=frozenset(), depth_scaling=None,
        qk_norm=QKNormKind.NONE, qk_norm_rope=RopeOrder.NOT_APPLICABLE, v_norm=False, attn_softcap=None,
        final_norm=Operator.NONE, final_logit_softcap=None, embedding_scale=None, embedding_norm=Operator.NONE,
        norms=norms,
    )  # fmt: skip
