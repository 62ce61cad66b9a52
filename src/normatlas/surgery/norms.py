"""Find a model's normalization layers and measure what each one computes.

Method: a module is a norm when, on inputs shaped like the ones it received in the
recorded run, its output is invariant to rescaling the input (``f(a x) = f(x)``,
the essay's defining property). Probing it further measures, never reads from
names: whether it centres (``f(x + c) = f(x)``); which of its 1-D parameters is the
gain and which the bias (set one to ones with the others at zero and see whether
the output moves by ``x_hat`` or by a constant); the gain convention (with every
parameter zeroed, output 0 means ``w``, output ``x_hat`` means ``1 + w``); eps and
where it sits (from ``mean(y^2)`` on inputs of known variance at several scales);
and the cast order (bit-exact bf16 match against the two candidates).

Guaranteed property: every field of :class:`NormFacts` is a measurement of the
module as it runs; the module's parameters are restored afterwards.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..modules import Norm
from ..spec import CastOrder, EpsPlacement, Gain, GainConvention, NormSpec
from .dataflow import Dataflow

__all__ = ["NormFacts", "find_norms", "probe_norm"]


@dataclass
class NormFacts:
    """What one norm module computes: ``y = m(w) * (x - [mean]) / denom(eps) + b`` over the last dim."""

    name: str
    dim: int
    center: bool
    gain_param: str | None
    bias_param: str | None
    convention: GainConvention
    eps: float
    eps_placement: EpsPlacement
    cast_order: CastOrder
    eps_attr: float | None = None
    eps_measured: float | None = None

    def multiplier(self, module: nn.Module) -> Tensor | None:
        """The per-feature multiplier the gain parameter stands for (``w`` or ``1 + w``)."""
        if self.gain_param is None:
            return None
        w = getattr(module, self.gain_param).detach()
        return w + 1 if self.convention is GainConvention.ONE_PLUS_W else w

    def bias(self, module: nn.Module) -> Tensor | None:
        return None if self.bias_param is None else getattr(module, self.bias_param).detach()

    def identity_gain_value(self) -> float:
        return 0.0 if self.convention is GainConvention.ONE_PLUS_W else 1.0

    def spec(
        self,
        *,
        center: bool | None = None,
        gain: bool = True,
        bias: bool | None = None,
        convention: GainConvention | None = None,
        eps: float | None = None,
        eps_placement: EpsPlacement | None = None,
    ) -> NormSpec:
        """A normatlas spec computing the same thing (fields overridable for conversions)."""
        return NormSpec(
            center=self.center if center is None else center,
            eps=self.eps if eps is None else eps,
            eps_placement=self.eps_placement if eps_placement is None else eps_placement,
            cast_order=self.cast_order,
            gain=Gain.PER_FEATURE if gain else Gain.NONE,
            gain_convention=(self.convention if convention is None else convention) if gain else GainConvention.W,
            bias=(self.bias_param is not None) if bias is None else bias,
        )


def _params_1d(module: nn.Module, dim: int) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters(recurse=False) if p.dim() == 1 and p.shape[0] == dim}


def _close(a: Tensor, b: Tensor, rtol: float = 2e-4) -> bool:
    scale = max(float(b.abs().max()), 1e-6)
    return float((a - b).abs().max()) <= rtol * scale


def _measure_eps(module: nn.Module, dim: int, center: bool, dtype: torch.dtype) -> tuple[float, EpsPlacement]:
    gen = torch.Generator().manual_seed(7)
    u = torch.randn(dim, generator=gen, dtype=torch.float64)
    u = u - u.mean() if center else u
    u = u / u.pow(2).mean().sqrt()
    inside: list[float] = []
    outside: list[float] = []
    for k in range(4, -31, -1):
        x = (u * math.sqrt(10.0**k)).to(dtype)
        xd = x.double()
        v = float(((xd - xd.mean()) if center else xd).pow(2).mean())
        y = module(x[None]).double()[0]
        my2 = float(y.pow(2).mean())
        if my2 <= 0 or not math.isfinite(my2) or v <= 0:
            continue
        e_in, e_out = v / my2 - v, math.sqrt(v / my2) - math.sqrt(v)
        if 0.05 <= e_in / v <= 20.0:
            inside.append(e_in)
        if 0.05 <= e_out / math.sqrt(v) <= 20.0:
            outside.append(e_out)

    def spread(vals: list[float]) -> float:
        return max(vals) / min(vals) - 1 if len(vals) >= 2 and min(vals) > 0 else math.inf

    if not inside and not outside:
        return 0.0, EpsPlacement.INSIDE_SQRT
    if spread(outside) < spread(inside) or not inside:
        return outside[len(outside) // 2], EpsPlacement.OUTSIDE_SQRT
    return inside[len(inside) // 2], EpsPlacement.INSIDE_SQRT


def _cast_order(module: nn.Module, facts: NormFacts) -> CastOrder:
    """Which cast order reproduces the module bit for bit in bfloat16 (AFTER_GAIN when both do)."""
    gen = torch.Generator().manual_seed(11)
    mod = copy.deepcopy(module).to(torch.bfloat16)
    with torch.no_grad():
        for p in mod.parameters(recurse=False):
            p.copy_(torch.rand(p.shape, generator=gen) * 3 - 1)
    x = (torch.randn(8, facts.dim, generator=gen) * 5).to(torch.bfloat16)
    ref = mod(x)
    best, best_err = CastOrder.AFTER_GAIN, math.inf
    for order in (CastOrder.AFTER_GAIN, CastOrder.BEFORE_GAIN):
        facts.cast_order = order
        ours = Norm(facts.spec(), facts.dim, dtype=torch.bfloat16)
        sd = {}
        if facts.gain_param:
            sd["weight"] = getattr(mod, facts.gain_param)
        if facts.bias_param:
            sd["bias"] = getattr(mod, facts.bias_param)
        ours.load_state_dict(sd)
        err = float((ours(x).float() - ref.float()).abs().max())
        if err < best_err:
            best, best_err = order, err
    return best


@torch.no_grad()
def probe_norm(module: nn.Module, name: str, dim: int) -> NormFacts | None:
    """Measure ``module`` as a last-dim norm of width ``dim``; None when it is not scale invariant."""
    params = _params_1d(module, dim)
    if len(params) > 2 or any(p.dim() != 1 for p in module.parameters(recurse=False)):
        return None
    dtype = next(iter(params.values())).dtype if params else torch.float32
    saved = {n: p.detach().clone() for n, p in params.items()}
    gen = torch.Generator().manual_seed(3)
    x = ((torch.randn(16, dim, generator=gen) * 2 + 0.3) * 30).to(dtype)  # large: eps negligible
    try:
        for p in params.values():  # make the probe well conditioned: gains away from zero
            p.copy_(torch.rand(dim, generator=gen).to(dtype) + 0.5)
        y = module(x)
        if not isinstance(y, Tensor) or y.shape != x.shape or not _close(module(x * 3.7), y, 2e-3):
            return None
        center = _close(module(x + 5.0), y, 2e-3)
        for p in params.values():
            p.zero_()
        y0 = module(x)
        gain_param = bias_param = None
        delta_gain = None
        for n, p in params.items():
            p.fill_(1.0)
            delta = module(x) - y0
            p.zero_()
            if _close(delta, torch.ones_like(delta), 1e-3):
                bias_param = n
            else:
                gain_param, delta_gain = n, delta
        if delta_gain is not None and float(y0.abs().max()) > 1e-3 and _close(y0, delta_gain, 1e-3):
            convention = GainConvention.ONE_PLUS_W
        elif float(y0.abs().max()) <= 1e-6 or gain_param is None:
            convention = GainConvention.W
        else:
            return None
        facts = NormFacts(
            name, dim, center, gain_param, bias_param, convention, 0.0, EpsPlacement.INSIDE_SQRT, CastOrder.AFTER_GAIN
        )
        if gain_param:
            getattr(module, gain_param).fill_(facts.identity_gain_value())
        eps, placement = _measure_eps(module, dim, center, dtype)
        attr = next(
            (
                float(v)
                for a in ("eps", "variance_epsilon", "epsilon")
                if isinstance(v := getattr(module, a, None), float)
            ),
            None,
        )
        facts.eps_attr = attr
        facts.eps_measured = eps
        if attr is not None and eps > 0 and abs(eps / attr - 1) < 1e-2:
            eps = attr
        facts.eps = eps if eps > 0 else (attr or torch.finfo(torch.float32).tiny)
        facts.eps_placement = placement
    finally:
        for n, p in params.items():
            p.copy_(saved[n])
    facts.cast_order = _cast_order(module, facts)
    return facts


def find_norms(flow: Dataflow) -> dict[str, NormFacts]:
    """Every module in the recorded run that behaves as a last-dim norm, with its measured facts."""
    found: dict[str, NormFacts] = {}
    for name in flow.modules():
        module = flow.submodule(name)
        calls = flow.module_calls(name)
        first = calls[0]
        if len(first.inputs) != 1 or len(first.outputs) != 1:
            continue
        tensor = flow.tensor(first.inputs[0])
        dim = tensor.shape[-1]
        if not _params_1d(module, dim) or not tensor.is_floating_point():
            continue
        facts = probe_norm(module, name, dim)
        if facts is not None:
            found[name] = facts
    return found
