"""PowerNorm (Shen, Yao, Gholami, Mahoney & Keutzer, "PowerNorm: Rethinking Batch
Normalization in Transformers", ICML 2020), Algorithm 1.

Batch statistics relaxed for transformers: no centring, the quadratic mean
``psi^2 = mean(x^2)`` over (samples, positions) per feature, and the *running* estimate
used in the forward pass of training too:

    forward   x_hat = x / psi_{t-1}            y = gamma * x_hat + beta
              psi_t^2 = a_f psi_{t-1}^2 + (1 - a_f) psi_B^2
    backward  g = gamma * dL/dy
              dL/dx = (g - nu_{t-1} * x_hat) / psi_{t-1}
              nu_t = nu_{t-1} (1 - (1 - a_b) Gamma_t) + (1 - a_b) Lambda_t
              Gamma_t = mean(x_hat^2),  Lambda_t = mean(g * x_hat)

The backward correction ``- nu * x_hat`` is a running estimate of the term the exact
gradient through ``psi_B`` would contribute (``- mean(g * x_hat) * x_hat``); it is
written by hand in :class:`_PowerNormFunction`. Padding (``mask`` False) is excluded
from ``psi_B``, ``Gamma`` and ``Lambda`` and gets the plain ``g / psi`` gradient.
``alpha_bkw = 1`` freezes ``nu`` (at 0: the exact gradient of the forward as written).
The official code divides the backward by the batch ``psi_B``; we follow the paper's
algorithm (``psi_{t-1}``), which is the gradient of the forward actually computed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ..functional import compute_dtype, resolve
from ..spec import Axis, CastOrder, Gain, Layout, NormSpec

__all__ = ["PowerNorm", "power_norm"]

Device = torch.device | str | None


class _PowerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, phi: Tensor, nu: Tensor, mask: Tensor | None,
        eps: float, alpha_bkw: float, reduce_dims: tuple[int, ...], pview: tuple[int, ...],
    ) -> Tensor:  # fmt: skip
        cdtype = compute_dtype(x.dtype, CastOrder.AFTER_GAIN)
        inv = torch.rsqrt(phi.to(cdtype) + eps).reshape(pview)
        x_hat = x.to(cdtype) * inv
        y = x_hat
        if weight is not None:
            y = y * weight.to(cdtype).reshape(pview)
        if bias is not None:
            y = y + bias.to(cdtype).reshape(pview)
        ctx.save_for_backward(x_hat, inv, weight, nu, mask)
        ctx.meta = (alpha_bkw, reduce_dims, pview, x.dtype, bias is not None)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x_hat, inv, weight, nu, mask = ctx.saved_tensors
        alpha_bkw, dims, pview, in_dtype, has_bias = ctx.meta
        go = grad_out.to(x_hat.dtype)
        g = go * weight.to(x_hat.dtype).reshape(pview) if weight is not None else go
        nu_prev = nu.to(x_hat.dtype).reshape(pview)
        if mask is None:
            m = None
            correction = nu_prev * x_hat
            n = float(math.prod(x_hat.shape[d] for d in dims))
        else:
            m = mask.expand(x_hat.shape).to(x_hat.dtype)
            correction = nu_prev * x_hat * m
            n = float(m.sum())
        grad_x = ((g - correction) * inv).to(in_dtype)
        if n > 0 and alpha_bkw < 1:
            xm = x_hat if m is None else x_hat * m
            gamma_t = (xm * x_hat).sum(dims) / n
            lambda_t = (g * xm).sum(dims) / n
            with torch.no_grad():
                new = nu.to(x_hat.dtype) * (1 - (1 - alpha_bkw) * gamma_t.reshape(nu.shape))
                nu.copy_(new + (1 - alpha_bkw) * lambda_t.reshape(nu.shape))
        grad_w = (go * x_hat).sum(dims).reshape(weight.shape).to(weight.dtype) if weight is not None else None
        grad_b = go.sum(dims).reshape(-1).to(grad_out.dtype) if has_bias else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def power_norm(
    input: Tensor, running_phi: Tensor, nu: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, *,
    mask: Tensor | None = None, layout: Layout = Layout.N_ANY_C, eps: float = 1e-5, alpha_bkw: float = 0.9,
) -> Tensor:  # fmt: skip
    """PowerNorm's training forward (no running update) with the corrected backward (updates ``nu``)."""
    spec = NormSpec(layout=layout, reduce=frozenset({Axis.SAMPLE, Axis.POSITION}), center=False, gain=Gain.NONE,
                    bias=False)  # fmt: skip
    plan = resolve(spec, tuple(input.shape))
    out: Tensor = _PowerNormFunction.apply(
        input, weight, bias, running_phi, nu, mask, eps, alpha_bkw, plan.reduce_dims, plan.param_view
    )
    return out


class PowerNorm(nn.Module):
    """PowerNorm (Shen et al., ICML 2020): batch quadratic-mean statistics with running estimates
    in the forward and a corrected backward (see the module docstring for the algorithm).

    Args:
        num_features: the feature count D (``(B, T, D)`` by default; ``layout=Layout.NC_ANY`` for
            channels-first).
        eps: added to ``psi^2``.
        alpha_fwd: running-average factor for ``psi^2`` (the paper's alpha, 0.9).
        alpha_bkw: running-average factor for the backward correction ``nu``.
        affine: learn ``weight`` (gamma) and ``bias`` (beta).

    Buffers: ``running_phi`` (``psi^2``, fp32, init 1) and ``nu`` (fp32, init 0); they stay fp32
    when the module is cast to fp16 / bf16 (float64 is kept).
    Eval computes ``gamma * x / sqrt(running_phi + eps) + beta``: per example, no leakage.
    """

    running_phi: Tensor
    nu: Tensor

    def __init__(
        self, num_features: int, eps: float = 1e-5, alpha_fwd: float = 0.9, alpha_bkw: float = 0.9,
        affine: bool = True, device: Device = None, dtype: torch.dtype | None = None, *,
        layout: Layout = Layout.N_ANY_C,
    ) -> None:  # fmt: skip
        super().__init__()
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features={num_features!r} must be an integer >= 1")
        for name, v in (("alpha_fwd", alpha_fwd), ("alpha_bkw", alpha_bkw)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{name}={v!r} must be a float in [0, 1]")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"eps={eps!r} must be a float > 0")
        if not isinstance(layout, Layout):
            raise TypeError(f"layout={layout!r} must be a Layout (e.g. Layout.N_ANY_C, Layout.NC_ANY)")
        self.num_features, self.eps, self.layout = num_features, float(eps), layout
        self.alpha_fwd, self.alpha_bkw, self.affine = float(alpha_fwd), float(alpha_bkw), affine
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(num_features, **factory)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_features, **factory)) if affine else None
        self.register_buffer("running_phi", torch.ones(num_features, device=device, dtype=torch.float32))
        self.register_buffer("nu", torch.zeros(num_features, device=device, dtype=torch.float32))
        self._spec = NormSpec(layout=layout, reduce=frozenset({Axis.SAMPLE, Axis.POSITION}), center=False,
                              gain=Gain.NONE, bias=False)  # fmt: skip

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """Like nn.Module._apply, but ``running_phi`` / ``nu`` never drop below fp32 (``.half()``, ``.to(bf16)``)."""
        super()._apply(fn, recurse)
        for name in ("running_phi", "nu"):
            buf = getattr(self, name)
            if buf.dtype in (torch.float16, torch.bfloat16):
                setattr(self, name, buf.float())
        return self

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        plan = resolve(self._spec, tuple(input.shape))
        if tuple(input.shape[d] for d in plan.feature_dims) != (self.num_features,):
            raise ValueError(f"input of shape {tuple(input.shape)} does not have {self.num_features} features")
        if mask is not None and mask.dtype is not torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = real position), got dtype {mask.dtype}")
        if not self.training:
            cdtype = compute_dtype(input.dtype, CastOrder.AFTER_GAIN)
            pv = plan.param_view
            y = input.to(cdtype) * torch.rsqrt(self.running_phi.to(cdtype) + self.eps).reshape(pv)
            if self.weight is not None and self.bias is not None:
                y = y * self.weight.to(cdtype).reshape(pv) + self.bias.to(cdtype).reshape(pv)
            return y.to(input.dtype)
        phi_prev = self.running_phi.clone()  # the forward uses psi_{t-1}; the update below is psi_t
        out = power_norm(input, phi_prev, self.nu, self.weight, self.bias, mask=mask, layout=self.layout,
                         eps=self.eps, alpha_bkw=self.alpha_bkw)  # fmt: skip
        with torch.no_grad():
            xf = input.detach().to(compute_dtype(input.dtype, CastOrder.AFTER_GAIN))  # fp32 for half, else as given
            if mask is None:
                psi_b = xf.pow(2).mean(plan.reduce_dims)
                seen = input.numel() > 0
            else:
                m = mask.expand(input.shape).to(xf.dtype)
                seen = bool(m.sum() > 0)
                psi_b = (xf.pow(2) * m).sum(plan.reduce_dims) / m.sum(plan.reduce_dims).clamp_min(1)
            if seen:
                psi_b = psi_b.reshape(-1).to(self.running_phi.dtype)
                self.running_phi.mul_(self.alpha_fwd).add_(psi_b, alpha=1 - self.alpha_fwd)
        return out

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, alpha_fwd={self.alpha_fwd}, alpha_bkw={self.alpha_bkw}, "
                f"layout={self.layout.value!r}")  # fmt: skip
