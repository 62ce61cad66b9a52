"""Decide, from behaviour alone, whether a module is a normalization layer, and measure what it computes.

The one behavioural probe of normatlas (inspect, surgery and diagnostics all call it). Names of
classes, attributes and parameters are never read, except that an ``eps`` attribute the module
happens to carry is reported beside the measured value.

Method (essay §02, "Invariances"), on seeded synthetic inputs, with the module's own floating
parameters temporarily set to random values in [0.5, 1.5) so that zero- or one-initialized gains
cannot fool it:

* **layout**: inputs ``(2, 5, D)`` (features last), ``(2, D, 5)`` and ``(2, D, 3, 3)`` (features
  first) are tried in turn; the first one the module maps to a tensor of the same shape is used;
* **norm**: the output depends on the input and is invariant to rescaling it,
  ``f(3 x) == f(x) == f(x / 2)`` at 10x and 1000x the unit input (re-scaling invariance);
  **pointwise** when each output feature depends only on the same input feature (DyT, LayerScale);
  eval-mode BatchNorm is an affine map, hence not a norm;
* **centring**: ``f(x + c) == f(x)`` (shift invariance: LayerNorm yes, RMSNorm no);
* **parameter roles** (zeroing test): a parameter is a gain when setting it to 0 makes the output
  independent of the input, a ``1 + w`` gain when setting it to -1 does, else a bias; the
  convention is cross-checked with every parameter zeroed (output 0 for ``w``, the unit-scale
  normalized input for ``1 + w``);
* **eps and its placement** (last-axis norms with a known gain/bias): with the gain at identity and
  the bias at 0, ``R(v) = mean(y^2) / mean(y^2)|_{v large}`` on inputs of known statistic ``v`` at
  quarter-decade scales gives ``eps = v / R - v`` (inside the root), ``sqrt(v / R) - sqrt(v)``
  (outside) or ``sqrt(v / R)`` (clamp) in each one's well-conditioned window; the placement whose
  estimates agree best wins, its median is eps; the statistic is RMS or L2 by ``mean(y^2)`` at
  large scale (1 or 1/D);
* **cast order** (bfloat16): a bfloat16 copy with random parameters is compared with normatlas
  ``Norm`` under each cast order; the closer one (AFTER_GAIN on a tie) is reported.

Guaranteed property: every parameter, buffer and ``training`` flag of the module is restored
exactly, whether the probe succeeds, rejects the module or raises.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..spec import CastOrder, EpsPlacement, Gain, GainConvention, NormSpec, Scale

__all__ = [
    "NormFacts",
    "ParamRole",
    "Response",
    "param_roles",
    "probe",
    "probe_inputs",
    "randomized",
    "respond",
    "restoring",
]


class ParamRole(enum.Enum):
    """What one of a module's own parameters does, from the zeroing test."""

    GAIN = "gain"  # multiplier w
    GAIN_ONE_PLUS_W = "gain_one_plus_w"  # multiplier 1 + w (Gemma)
    BIAS = "bias"  # anything else: added after the gain


@dataclass
class NormFacts:
    """What one norm module computes: the :class:`NormSpec` that reproduces it (``measured``, over the last
    axis: ``y = m(w) * (x - [mean]) / denom(eps) + b``), plus what the measurement itself found: which of the
    module's own parameters is the gain and which the bias, the input layouts it accepts, and how sure each
    number is (``eps_measured`` None: eps could not be measured, for a features-first layout or a gain of
    unknown shape; ``cast_measured`` False: the bfloat16 cast-order test could not run).

    Read the design off ``measured`` (``facts.measured.center``, ``.gain_convention``, ...); ``eps`` is always
    a usable number (the measured value, snapped to the module's own ``eps`` attribute when they agree within 1%,
    else that attribute, else the float32 tiny; float32's machine eps where ``measured.eps`` is None).
    """

    name: str
    dim: int
    measured: NormSpec
    gain_param: str | None
    bias_param: str | None
    eps_attr: float | None = None
    eps_measured: float | None = None
    feature_axis: int = -1
    accepted_shapes: tuple[tuple[int, ...], ...] = ()
    roles: dict[str, ParamRole] = field(default_factory=dict)
    cast_measured: bool = False
    structured: bool = True  # <= one gain, <= one bias, nothing else; the zeroing cross-check held

    @property
    def eps(self) -> float:
        eps = self.measured.eps
        return eps if eps is not None else torch.finfo(torch.float32).eps

    @property
    def machine_eps(self) -> bool:
        """eps is the compute dtype's machine eps (``eps=None``), measured in two dtypes."""
        return self.measured.eps is None

    def multiplier(self, module: nn.Module) -> Tensor | None:
        """The per-feature multiplier the gain parameter stands for (``w`` or ``1 + w``)."""
        if self.gain_param is None:
            return None
        w = getattr(module, self.gain_param).detach()
        return w + 1 if self.measured.gain_convention is GainConvention.ONE_PLUS_W else w

    def bias(self, module: nn.Module) -> Tensor | None:
        return None if self.bias_param is None else getattr(module, self.bias_param).detach()

    def params(self) -> dict[str, str]:
        """Our ``Norm``'s parameter -> the module's parameter it stands for: ``weight`` the measured gain,
        ``bias`` the measured bias (whatever they are called)."""
        pairs = (("weight", self.gain_param), ("bias", self.bias_param))
        return {ours: theirs for ours, theirs in pairs if theirs is not None}

    def identity_gain_value(self) -> float:
        return 0.0 if self.measured.gain_convention is GainConvention.ONE_PLUS_W else 1.0

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
        """``measured``, with fields changed for a conversion (``gain=False`` drops the gain)."""
        return self.measured.with_(
            center=self.measured.center if center is None else center,
            eps=self.measured.eps if eps is None else eps,
            eps_placement=self.measured.eps_placement if eps_placement is None else eps_placement,
            gain=Gain.PER_FEATURE if gain else Gain.NONE,
            gain_convention=(self.measured.gain_convention if convention is None else convention)
            if gain
            else GainConvention.W,
            bias=(self.bias_param is not None) if bias is None else bias,
        )


# ----------------------------------------------------------------------------- state handling


def _own_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None]


@contextlib.contextmanager
def restoring(module: nn.Module) -> Iterator[nn.Module]:
    """Restore every parameter, buffer and ``training`` flag of ``module`` (recursively) on exit."""
    tensors: list[Tensor] = [t for _, t in module.named_parameters(remove_duplicate=True)]
    tensors += [t for _, t in module.named_buffers(remove_duplicate=True) if t is not None]
    saved = [(t, t.detach().clone()) for t in tensors]
    flags = [(m, m.training) for m in module.modules()]
    try:
        yield module
    finally:
        with torch.no_grad():
            for t, v in saved:
                t.copy_(v)
        for m, flag in flags:
            m.training = flag


@contextlib.contextmanager
def randomized(module: nn.Module, seed: int = 0) -> Iterator[nn.Module]:
    """:func:`restoring`, with the module's own floating parameters set to random values in [0.5, 1.5)."""
    with restoring(module):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in _own_params(module):
                if p.is_floating_point():
                    p.copy_((0.5 + torch.rand(p.shape, generator=gen)).to(p))
        yield module


# ----------------------------------------------------------------------------- calling


def _call(module: nn.Module, x: Tensor) -> Tensor | None:
    """``module(x)`` (first element of a tuple output) when it runs and keeps the shape, else None."""
    try:
        with torch.no_grad():
            y = module(x)
    except Exception:
        return None
    if isinstance(y, (tuple, list)) and y:
        y = y[0]
    return y if isinstance(y, Tensor) and y.shape == x.shape else None


def _tol(t: Tensor) -> float:
    return 1e-2 if t.dtype in (torch.float16, torch.bfloat16) else 1e-4


def _close(a: Tensor, b: Tensor, tol: float | None = None) -> bool:
    """max |a - b| <= tol * max |a| (tol by dtype: 1e-4 float32/64, 1e-2 half)."""
    tol = _tol(a) if tol is None else tol
    scale = float(a.abs().max()) + 1e-12
    return float((a.double() - b.double()).abs().max()) <= tol * scale


def _module_dtype_device(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    params = _own_params(module)
    dtype = next((p.dtype for _, p in params if p.is_floating_point()), torch.float32)
    device = next((p.device for _, p in params), torch.device("cpu"))
    return dtype, device


_FALLBACK_SIZES = (8, 16, 64)


def _feature_sizes(module: nn.Module) -> list[int]:
    params = _own_params(module)
    sizes = sorted({p.shape[-1] for _, p in params if p.dim() >= 1 and p.numel() > 1})
    # scalar-only or parameter-free: tried at a few widths (no attribute is read for a size); a module that
    # needs one fixed width of its own is probed with ``dim`` by callers that saw it run (inspect, surgery)
    return sizes or list(_FALLBACK_SIZES)


def probe_inputs(module: nn.Module, dim: int | None = None) -> Iterator[tuple[Tensor, int]]:
    """Seeded inputs ``(x, feature_axis)``: ``(2, 5, D)``, then ``(2, D, 5)`` and ``(2, D, 3, 3)``.

    ``D`` is ``dim`` when given, else each trailing size of the module's own parameters.
    """
    dtype, device = _module_dtype_device(module)
    gen = torch.Generator().manual_seed(1)
    for d in [dim] if dim is not None else _feature_sizes(module):
        yield torch.randn(2, 5, d, generator=gen).to(device, dtype), -1
        yield torch.randn(2, d, 5, generator=gen).to(device, dtype), 1
        yield torch.randn(2, d, 3, 3, generator=gen).to(device, dtype), 1


@dataclass(frozen=True)
class Response:
    """How a module responds on the first probe input it accepts."""

    x: Tensor
    feature_axis: int
    depends: bool  # the output changes with the input
    norm: bool  # ... and is invariant to rescaling it
    pointwise: bool  # ... and each output feature reads only its own input feature


def _invariant(module: nn.Module, x: Tensor) -> bool:
    """``f(a x) == f(x)`` for a in {3, 1/2}: within 5e-2 at 10x the unit input (eps up to 1e-2 still
    negligible on short rows, a saturating pointwise map like DyT still visibly not invariant) and
    within 1e-3 (half: 1e-2) at 1000x (100x in float16), where even eps outside the root is
    negligible."""
    big = 100.0 if x.dtype is torch.float16 else 1000.0
    for base, tol in ((10.0 * x, 5e-2), (big * x, max(_tol(x), 1e-3))):
        yb = _call(module, base)
        if yb is None:
            return False
        for a in (3.0, 0.5):
            ya = _call(module, a * base)
            if ya is None or not _close(yb, ya, tol):
                return False
    return True


def respond(module: nn.Module, dim: int | None = None) -> Response | None:
    """Probe ``module`` (call inside :func:`randomized`) on :func:`probe_inputs`; None if it takes none."""
    for x, axis in probe_inputs(module, dim):
        y = _call(module, x)
        if y is None:
            continue
        y3, y_other = _call(module, 3.0 * x), _call(module, torch.roll(x, 1, dims=0) + 0.5)
        if y3 is None or y_other is None:
            continue
        depends = not _close(y, y_other)
        norm = depends and _invariant(module, x)
        pointwise = False
        if depends and not norm:
            xp = x.clone()
            xp.select(axis, 0).add_(1.0)
            yp = _call(module, xp)
            if yp is not None:
                changed = (yp - y).abs() > 1e-6 * (float(y.abs().max()) + 1e-12)
                changed.select(axis, 0).zero_()
                pointwise = not bool(changed.any())
        return Response(x, axis, depends, norm, pointwise)
    return None


def param_roles(module: nn.Module, x: Tensor) -> dict[str, ParamRole]:
    """The zeroing test for each own floating parameter, the others kept at their current values.

    Gain: the output stops depending on the input when it is 0; ``1 + w`` gain: when it is -1;
    bias otherwise.
    """
    x2 = torch.roll(x, 1, dims=0) + 0.5
    out: dict[str, ParamRole] = {}
    for name, p in _own_params(module):
        if not p.is_floating_point():
            continue
        saved = p.detach().clone()
        role = ParamRole.BIAS
        for value, label in ((0.0, ParamRole.GAIN), (-1.0, ParamRole.GAIN_ONE_PLUS_W)):
            with torch.no_grad():
                p.fill_(value)
            y1, y2 = _call(module, x), _call(module, x2)
            if y1 is None or y2 is None:
                continue
            if (_close(y1, y2) and not _close(y1, 0 * y1 + 1)) or float(y1.abs().max()) == 0.0 == float(y2.abs().max()):
                role = label
                break
        with torch.no_grad():
            p.copy_(saved)
        out[name] = role
    return out


# ----------------------------------------------------------------------------- measurements


def _shaped(u: Tensor, like: Tensor, axis: int) -> Tensor:
    """``u`` (length D) laid along ``axis`` of a tensor shaped like ``like`` with every other size 1."""
    shape = [1] * like.dim()
    shape[axis] = u.numel()
    return u.reshape(shape)


def _eps_windows(v: float, r: float) -> dict[EpsPlacement, float]:
    """Eps estimates from one (statistic, ratio) pair, each within its well-conditioned window."""
    out: dict[EpsPlacement, float] = {}
    if not 0.05 <= r <= 0.95:
        return out
    e_in, e_out = v / r - v, math.sqrt(v / r) - math.sqrt(v)
    if 0.05 <= e_in / v <= 20.0:
        out[EpsPlacement.INSIDE_SQRT] = e_in
    if 0.05 <= e_out / math.sqrt(v) <= 20.0:
        out[EpsPlacement.OUTSIDE_SQRT] = e_out
    out[EpsPlacement.CLAMP] = math.sqrt(v / r)
    return out


def measure_eps(module: nn.Module, like: Tensor, axis: int, center: bool) -> tuple[float | None, EpsPlacement, Scale]:
    """Eps, its placement and the statistic (RMS or L2) of a norm with identity gain and zero bias.

    Returns ``(None, INSIDE_SQRT, scale)`` when no scale gives a well-conditioned estimate.
    """
    dim = like.shape[axis]
    gen = torch.Generator().manual_seed(7)
    u = torch.randn(dim, generator=gen, dtype=torch.float64)
    u = u - u.mean() if center else u
    u = u / u.pow(2).mean().sqrt()
    points: list[tuple[float, float]] = []  # (mean square of the (centred) input, mean(y^2))
    for k in range(16, -125, -1):
        x = _shaped(u * math.sqrt(10.0 ** (k / 4)), like, axis).to(like)
        y = _call(module, x)
        if y is None:
            continue
        xd = x.double().reshape(-1)
        ms = float(((xd - xd.mean()) if center else xd).pow(2).mean())
        my2 = float(y.double().pow(2).mean())
        if ms > 0 and math.isfinite(my2):
            points.append((ms, my2))
    if not points or points[0][1] <= 0:
        return None, EpsPlacement.INSIDE_SQRT, Scale.RMS
    ref = points[0][1]  # the largest scale: eps negligible
    scale = Scale.L2 if dim > 1 and abs(math.log(ref * dim)) < abs(math.log(ref)) else Scale.RMS
    factor = float(dim) if scale is Scale.L2 else 1.0
    ests: dict[EpsPlacement, list[float]] = {p: [] for p in EpsPlacement}
    for ms, my2 in points:
        for placement, e in _eps_windows(ms * factor, my2 / ref).items():
            ests[placement].append(e)

    def spread(vals: list[float]) -> float:
        return max(vals) / min(vals) - 1 if len(vals) >= 2 and min(vals) > 0 else math.inf

    candidates = [p for p in EpsPlacement if ests[p]]
    if not candidates:
        return None, EpsPlacement.INSIDE_SQRT, scale
    best = min(candidates, key=lambda p: (spread(ests[p]), list(EpsPlacement).index(p)))
    vals = sorted(ests[best])
    return vals[len(vals) // 2], best, scale


def _measure_cast_order(module: nn.Module, facts: NormFacts, seed: int) -> CastOrder | None:
    """Which cast order reproduces the module most closely in bfloat16 (AFTER_GAIN on a tie)."""
    from ..modules import Norm  # lazy: modules imports functional, which is heavy

    shapes_ok = all(
        getattr(module, n).shape == (facts.dim,) for n in (facts.gain_param, facts.bias_param) if n is not None
    )
    if facts.feature_axis != -1 or not shapes_ok:
        return None
    gen = torch.Generator().manual_seed(seed + 11)
    try:
        mod = copy.deepcopy(module).to(torch.bfloat16)
    except Exception:
        return None
    with torch.no_grad():
        for _, p in _own_params(mod):
            p.copy_(torch.rand(p.shape, generator=gen) * 3 - 1)
        x = (torch.randn(8, facts.dim, generator=gen) * 5).to(torch.bfloat16)
        ref = _call(mod, x)
        if ref is None:
            return None
        state = {ours: getattr(mod, theirs) for ours, theirs in facts.params().items()}
        base = facts.spec(gain=facts.gain_param is not None)
        best, best_err = None, math.inf
        for order in (CastOrder.AFTER_GAIN, CastOrder.BEFORE_GAIN):
            ours = Norm(base.with_(cast_order=order), facts.dim, dtype=torch.bfloat16)
            ours.load_state_dict(state)
            err = float((ours(x).float() - ref.float()).abs().max())
            if err < best_err:
                best, best_err = order, err
    return best


def _eps_follows_dtype(module: nn.Module, x: Tensor, center: bool) -> bool:
    """Whether an eps measured as the machine eps of ``x``'s dtype is that by definition (``eps=None``): measured
    again on a float64 copy, it is float64's machine eps."""
    try:
        wide = copy.deepcopy(module).double()
    except Exception:
        return False
    e64, _, _ = measure_eps(wide, x.double(), -1, center)
    return e64 is not None and abs(e64 / torch.finfo(torch.float64).eps - 1) < 5e-2


def _eps_attr(module: nn.Module) -> float | None:
    for a in ("eps", "variance_epsilon", "epsilon"):
        v = getattr(module, a, None)
        if isinstance(v, float):
            return v
    return None


def probe(module: nn.Module, dim: int | None = None, *, name: str = "", seed: int = 0) -> NormFacts | None:
    """Measure ``module`` as a normalization layer; None when it is not one (or takes no probe input).

    ``dim`` fixes the feature size (else it is read from the parameter shapes). Restores the module.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool) or dim < 1):
        raise ValueError(f"dim must be a positive int or None, got {dim!r}")
    with randomized(module, seed), torch.no_grad():
        resp = respond(module, dim)
        if resp is None or not resp.norm:
            return None
        x, axis = resp.x, resp.feature_axis
        y, y_shift = _call(module, x), _call(module, x + 1.7)
        assert y is not None  # respond() ran it
        center = y_shift is not None and _close(y, y_shift, 1e-3)
        accepted = tuple(
            tuple(xi.shape) for xi, _ in probe_inputs(module, x.shape[axis]) if _call(module, xi) is not None
        )
        roles = param_roles(module, x)
        gain_param, bias_param, convention, structured = _structure(module, x, y, roles)
        feature_axis = -1 if axis == x.dim() - 1 or axis == -1 else axis
        eps, placement, scale, machine = None, EpsPlacement.INSIDE_SQRT, Scale.RMS, False
        if structured and feature_axis == -1:
            if gain_param:
                dict(_own_params(module))[gain_param].fill_(0.0 if convention is GainConvention.ONE_PLUS_W else 1.0)
            eps, placement, scale = measure_eps(module, x, -1, center)
            if eps is not None and x.dtype != torch.float64 and abs(eps / torch.finfo(x.dtype).eps - 1) < 1e-2:
                machine = _eps_follows_dtype(module, x, center)
    attr = _eps_attr(module)
    usable = attr if attr is not None and eps is not None and eps > 0 and abs(eps / attr - 1) < 1e-2 else eps
    usable = usable if usable is not None and usable > 0 else (attr or torch.finfo(torch.float32).tiny)
    measured = NormSpec(
        center=center, scale=scale, eps=None if machine else usable, eps_placement=placement,
        gain=Gain.PER_FEATURE if gain_param else Gain.NONE,
        gain_convention=convention if gain_param else GainConvention.W, bias=bias_param is not None,
    )  # fmt: skip
    facts = NormFacts(
        name, int(x.shape[axis]), measured, gain_param, bias_param, attr, eps, feature_axis, accepted, roles,
        structured=structured,
    )  # fmt: skip
    if structured:
        with restoring(module):
            order = _measure_cast_order(module, facts, seed)
        facts.measured = measured.with_(cast_order=order or CastOrder.AFTER_GAIN)
        facts.cast_measured = order is not None
    return facts


def _structure(
    module: nn.Module, x: Tensor, y: Tensor, roles: dict[str, ParamRole]
) -> tuple[str | None, str | None, GainConvention, bool]:
    """The gain and bias parameters, the gain convention, and whether the module is structured (at most one gain
    and one bias, and the cross-check with every parameter zeroed holds: 0 for ``w``, the unit-scale input for
    ``1 + w``). Leaves the module's parameters zeroed (the caller restores them)."""
    gains = [n for n, r in roles.items() if r is not ParamRole.BIAS]
    biases = [n for n, r in roles.items() if r is ParamRole.BIAS]
    structured = len(gains) <= 1 and len(biases) <= 1
    gain_param = gains[0] if len(gains) == 1 else None
    bias_param = biases[0] if len(biases) == 1 else None
    one_plus_w = gain_param is not None and roles[gain_param] is ParamRole.GAIN_ONE_PLUS_W
    convention = GainConvention.ONE_PLUS_W if one_plus_w else GainConvention.W
    if not structured:
        return gain_param, bias_param, convention, False
    params = dict(_own_params(module))
    for n in roles:
        params[n].zero_()
    y0 = _call(module, x)
    if y0 is None:
        structured = False
    elif gain_param is None:
        structured = True
    elif convention is GainConvention.W:
        structured = float(y0.abs().max()) <= 1e-6 * (1 + float(y.abs().max()))
    else:  # 1 + w: the zeroed output is the unit-gain output, so w = 1 adds it once more
        params[gain_param].fill_(1.0)
        y1 = _call(module, x)
        structured = y1 is not None and float(y0.abs().max()) > 1e-3 and _close(y1 - y0, y0, 1e-3)
    return gain_param, bias_param, convention, structured
