"""Norm-free pointwise replacements for LayerNorm / RMSNorm: DyT and Derf.

Essay section "Replace the norm with a pointwise squashing function".

* **DyT**, Dynamic Tanh (Zhu, Chen, He, LeCun & Liu, "Transformers without Normalization",
  CVPR 2025): ``y = weight * tanh(alpha * x) + bias`` with one learnable scalar ``alpha``
  (initialised at ``alpha_init``, 0.5 in the paper) and the usual per-feature affine.
* **Derf**, Dynamic erf (Chen, Lu, Zhu, Sun & Liu, "Stronger Normalization-Free
  Transformers", arXiv:2512.10938, 2025): ``y = weight * erf(alpha * x + shift) + bias``
  with learnable scalars ``alpha`` (init 0.5) and ``shift`` (init 0).

Guaranteed property: each output element depends only on the same input element
(no reductions), so the Jacobian is diagonal; neither controls how the residual
variance grows with depth. Both accept LayerNorm's constructor arguments and load
its ``weight`` / ``bias``, so they drop in; :func:`convert_norms_to_pointwise` swaps
every LayerNorm / RMSNorm in a model.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..modules import Norm
from ..spec import Axis, GainConvention
from ._report import ConversionReport, replace_modules

__all__ = ["Derf", "DyT", "Pointwise", "convert_norms_to_pointwise", "derf", "dyt"]

Device = torch.device | str | None


class Pointwise(enum.Enum):
    """Which squashing function :func:`convert_norms_to_pointwise` installs."""

    DYT = "dyt"
    DERF = "derf"


def _affine(y: Tensor, weight: Tensor | None, bias: Tensor | None, channels_last: bool) -> Tensor:
    if weight is None and bias is None:
        return y
    ref = weight if weight is not None else bias
    assert ref is not None
    view = ref.shape if channels_last else (ref.shape[0],) + (1,) * (y.dim() - 2)
    if weight is not None:
        y = y * weight.reshape(view)
    if bias is not None:
        y = y + bias.reshape(view)
    return y


def dyt(
    input: Tensor, alpha: Tensor | float, weight: Tensor | None = None, bias: Tensor | None = None,
    *, channels_last: bool = True,
) -> Tensor:  # fmt: skip
    """``weight * tanh(alpha * input) + bias``; ``channels_last=False`` puts the features at dim 1."""
    return _affine(torch.tanh(alpha * input), weight, bias, channels_last)


def derf(
    input: Tensor, alpha: Tensor | float, shift: Tensor | float = 0.0, weight: Tensor | None = None,
    bias: Tensor | None = None, *, channels_last: bool = True,
) -> Tensor:  # fmt: skip
    """``weight * erf(alpha * input + shift) + bias``; ``channels_last=False`` puts the features at dim 1."""
    return _affine(torch.erf(alpha * input + shift), weight, bias, channels_last)


def _check_float(value: object, name: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name}={value!r} must be a finite float")
    if positive and value <= 0:
        raise ValueError(f"{name}={value!r} must be > 0")
    return float(value)


def _check_shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(normalized_shape, bool):
        raise TypeError(f"normalized_shape={normalized_shape!r} must be an int or a sequence of ints")
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
        raise ValueError(f"normalized_shape={normalized_shape!r} must be positive integers")
    return shape


class _PointwiseNorm(nn.Module):
    """Shared parameters of DyT / Derf: scalar ``alpha`` and the per-feature affine."""

    def __init__(
        self, normalized_shape: int | Sequence[int], alpha_init: float, elementwise_affine: bool, bias: bool,
        channels_last: bool, device: Device, dtype: torch.dtype | None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.normalized_shape = _check_shape(normalized_shape)
        if not channels_last and len(self.normalized_shape) != 1:
            raise ValueError(
                f"normalized_shape={self.normalized_shape} must be a single channel count when channels_last=False"
            )
        self.alpha_init = _check_float(alpha_init, "alpha_init", positive=True)
        self.channels_last = bool(channels_last)
        self.elementwise_affine = bool(elementwise_affine)
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.alpha = nn.Parameter(torch.empty((), **factory))
        self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory)) if elementwise_affine and bias else None

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.alpha.fill_(self.alpha_init)
            if self.weight is not None:
                self.weight.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def _check_input(self, input: Tensor) -> None:
        if self.channels_last:
            n = len(self.normalized_shape)
            got = tuple(input.shape[input.dim() - n :])
        else:
            got = tuple(input.shape[1:2])
        if got != self.normalized_shape:
            where = "trailing dims" if self.channels_last else "channel dim (dim 1)"
            raise ValueError(
                f"input of shape {tuple(input.shape)} has {where} {got}; built for {self.normalized_shape}"
            )

    def extra_repr(self) -> str:
        s = f"{self.normalized_shape}, alpha_init={self.alpha_init}, elementwise_affine={self.elementwise_affine}"
        return s + ("" if self.channels_last else ", channels_last=False")


class DyT(_PointwiseNorm):
    """Dynamic Tanh (Zhu et al., CVPR 2025): ``weight * tanh(alpha * x) + bias``.

    Drop-in for ``torch.nn.LayerNorm`` (same positional arguments, same ``weight`` /
    ``bias`` names); ``alpha`` is one learnable scalar initialised at ``alpha_init``.
    ``channels_last=False`` applies the affine per channel at dim 1 (ConvNeXt-style
    ``(N, C, H, W)`` inputs). The Jacobian is diagonal: no cross-element dependence.
    """

    def __init__(
        self, normalized_shape: int | Sequence[int], alpha_init: float = 0.5, elementwise_affine: bool = True,
        bias: bool = True, device: Device = None, dtype: torch.dtype | None = None, *, channels_last: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(normalized_shape, alpha_init, elementwise_affine, bias, channels_last, device, dtype)
        self.reset_parameters()

    def forward(self, input: Tensor) -> Tensor:
        self._check_input(input)
        return dyt(input, self.alpha, self.weight, self.bias, channels_last=self.channels_last)


class Derf(_PointwiseNorm):
    """Dynamic erf (Chen et al., 2025): ``weight * erf(alpha * x + shift) + bias``.

    Learnable scalars ``alpha`` (init ``alpha_init``) and ``shift`` (init ``shift_init``);
    otherwise as :class:`DyT`. The Jacobian is diagonal.
    """

    def __init__(
        self, normalized_shape: int | Sequence[int], alpha_init: float = 0.5, elementwise_affine: bool = True,
        bias: bool = True, device: Device = None, dtype: torch.dtype | None = None, *, shift_init: float = 0.0,
        channels_last: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(normalized_shape, alpha_init, elementwise_affine, bias, channels_last, device, dtype)
        self.shift_init = _check_float(shift_init, "shift_init")
        self.shift = nn.Parameter(torch.empty((), device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "shift"):
            with torch.no_grad():
                self.shift.fill_(self.shift_init)

    def forward(self, input: Tensor) -> Tensor:
        self._check_input(input)
        return derf(input, self.alpha, self.shift, self.weight, self.bias, channels_last=self.channels_last)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", shift_init={self.shift_init}"


# --------------------------------------------------------------------------- converter


_Described = tuple[tuple[int, ...], bool, Tensor | None, Tensor | None, str]


def _describe(module: nn.Module) -> _Described | None:
    """(shape, channels_last, multiplier, bias, note) for a per-token norm we can replace, else None.

    Recognised: torch.nn.LayerNorm / RMSNorm and normatlas ``Norm`` whose statistics are over the
    feature axis only (LayerNorm, RMSNorm, LayerNorm2d presets and friends), by their types; any other
    leaf module by its behaviour (:func:`_measured`), never by its attribute names. Only a module that
    cannot be run on probe inputs at all falls back to the HF RMSNorm protocol it declares (a 1-D
    ``weight`` and a ``variance_epsilon`` attribute); its gain convention is then unknown, so its gain
    is never copied.
    """
    if isinstance(module, nn.LayerNorm):
        return tuple(module.normalized_shape), True, module.weight, module.bias, ""
    if isinstance(module, nn.RMSNorm):
        return tuple(module.normalized_shape), True, module.weight, None, ""
    if isinstance(module, Norm):
        spec = module.spec
        if spec.reduce != frozenset({Axis.FEATURE}) or spec.groups != 1 or module.shape is None:
            return None
        gain: Tensor | None = module.weight
        if gain is not None and gain.dim() == 0:
            return None  # ScaleNorm: a scalar gain on an L2 norm has no per-feature analogue here
        if gain is not None and spec.gain_convention is GainConvention.ONE_PLUS_W:
            gain = 1 + gain
        return module.shape, spec.layout.channels_last, gain, module.bias, ""
    if isinstance(module, _PointwiseNorm) or not _is_leaf(module):
        return None
    runs, found = _measured(module)
    if runs:
        return found
    weight = getattr(module, "weight", None)
    if hasattr(module, "variance_epsilon") and isinstance(weight, Tensor) and weight.dim() == 1:
        return (weight.shape[0],), True, None, None, "HF-style RMSNorm: gain convention unknown, affine not copied"
    return None


def _is_leaf(module: nn.Module) -> bool:
    """Holds parameters of its own and no parameterized submodule (a layer, not a block)."""
    if next(module.parameters(recurse=False), None) is None:
        return False
    return not any(next(c.parameters(), None) is not None for c in module.children())


def _measured(module: nn.Module) -> tuple[bool, _Described | None]:
    """(whether ``module`` maps a features-last probe input to a tensor of its shape, its description when it
    is a per-token norm over the last axis). The shared probe (:mod:`normatlas.analysis.probe`) says it is a
    norm and measures its gain and bias by their roles (so a ``1 + w`` gain is carried as ``1 + w``); each
    token's output must depend on that token only (no batch or sequence statistics)."""
    from ..analysis.probe import probe, probe_inputs, randomized

    x = next(iter(probe_inputs(module)), None)
    with randomized(module), torch.no_grad():
        try:
            y = module(x[0]) if x is not None else None
        except Exception:
            y = None
        if not isinstance(y, Tensor) or x is None or y.shape != x[0].shape:
            return False, None
        xp = x[0].clone()
        xp[0, 0].add_(1.0)
        changed = (module(xp) - y).abs() > 1e-6 * (float(y.abs().max()) + 1e-12)
        changed[0, 0] = False
        if bool(changed.any()):
            return True, None  # statistics across tokens or examples (BatchNorm in training, GroupNorm)
    facts = probe(module)
    if facts is None or facts.feature_axis != -1:
        return True, None
    if not facts.structured:
        return True, ((facts.dim,), True, None, None, "norm with extra parameters: affine not copied")
    return True, ((facts.dim,), True, facts.multiplier(module), facts.bias(module), "")


def convert_norms_to_pointwise(
    model: nn.Module,
    kind: Pointwise = Pointwise.DYT,
    *,
    alpha_init: float = 0.5,
    shift_init: float = 0.0,
    copy_affine: bool = False,
    include: Callable[[str, nn.Module], bool] | None = None,
) -> ConversionReport:
    """Replace, in place, every LayerNorm / RMSNorm-like layer of ``model`` by DyT or Derf.

    Args:
        model: any ``nn.Module``; it may itself be a norm only if it sits inside a parent
            (the root cannot be replaced in place).
        kind: :attr:`Pointwise.DYT` or :attr:`Pointwise.DERF`.
        alpha_init, shift_init: initial ``alpha`` (and Derf's ``shift``).
        copy_affine: carry the trained gain (as a multiplier, so ``1 + w`` gains become
            ``w``-convention) and bias over; the papers start from 1 / 0, the default.
        include: optional filter ``(path, module) -> bool``.

    Returns a :class:`ConversionReport` with one row per replaced module.
    """
    if not isinstance(kind, Pointwise):
        raise TypeError(f"kind={kind!r} must be a Pointwise (Pointwise.DYT, Pointwise.DERF)")
    _check_float(alpha_init, "alpha_init", positive=True)
    _check_float(shift_init, "shift_init")

    def build(path: str, module: nn.Module) -> tuple[nn.Module, list[str], str] | None:
        found = _describe(module)
        if found is None:
            return None
        shape, channels_last, gain, bias, note = found
        ref = next(iter(module.parameters()), None)
        factory: dict[str, Any] = {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}
        new: _PointwiseNorm
        if kind is Pointwise.DYT:
            new = DyT(shape, alpha_init, True, True, channels_last=channels_last, **factory)
        else:
            new = Derf(shape, alpha_init, True, True, shift_init=shift_init, channels_last=channels_last, **factory)
        kept: list[str] = []
        if copy_affine and not note:
            with torch.no_grad():
                if gain is not None and new.weight is not None:
                    new.weight.copy_(gain)
                    kept.append("weight")
                if bias is not None and new.bias is not None:
                    new.bias.copy_(bias)
                    kept.append("bias")
        return new, kept, note

    return replace_modules(model, build, include)
