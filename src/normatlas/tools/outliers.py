"""Outliers and quantization at the norms (essay §6 "Massive activations and attention sinks", §7 "Norm folding").

Per norm site (a module that behaves as a last-dim norm on the recorded run: :func:`normatlas.surgery.find_norms`,
never a name) this module reads the site's input and output on real text and reports

* the massive activations of the input (:func:`normatlas.diagnostics.metrics.massive_activations`: value,
  channel, token, ratio to the median ``|x|``);
* the relative quantization error ``||q(x) - x|| / ||x||`` of the input and of the output, for int8 and fp8
  e4m3 with absmax scales per tensor and per channel (:func:`quantize`): the norm input carries the outliers,
  the norm output does not;
* the SmoothQuant-style migration (:func:`smooth`): a per-channel ``s`` leaves the norm's gain (``m / s``, bias
  ``b / s``) for the next bias-free linear layers' input columns (``W diag(s)``), so the model computes the same
  function while the norm output's outlier channels shrink. Only where that is exact: a norm whose output is
  read by linear layers alone (:func:`normatlas.surgery.fold.linear_consumers`), which read nothing else and
  share no weights; every other norm is refused with the reason;
* the matrix entropy of the residual stream by depth (:func:`matrix_entropy`, the "compression valley").
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..analysis.flow import Dataflow, linear_kind, record_flow
from ..diagnostics.metrics import massive_activations
from ..spec import GainConvention
from ..surgery.fold import linear_consumers
from ..surgery.norms import NormFacts, find_norms
from .reading import capture_stream, model_inputs, read_model

__all__ = [
    "FORMATS",
    "SCALES",
    "Smoothing",
    "matrix_entropy",
    "max_logit_diff",
    "norm_sites",
    "quant_error",
    "quantize",
    "site_report",
    "smooth",
    "stream_entropy",
]

FORMATS = ("int8", "fp8_e4m3")
SCALES = ("tensor", "channel")
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}  # the largest magnitude each format represents


def quantize(x: Tensor, fmt: str, scale: str) -> Tensor:
    """``x`` quantized and dequantized (same dtype): absmax scale over the whole tensor (``tensor``) or per last-
    dim channel over every other axis (``channel``); int8 rounds to nearest on [-127, 127], fp8 e4m3 casts to
    ``torch.float8_e4m3fn`` (round to nearest even). A zero channel keeps scale 1."""
    if fmt not in _QMAX:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    a = x.abs().amax() if scale == "tensor" else x.abs().reshape(-1, x.shape[-1]).amax(0)
    s = torch.where(a > 0, a / _QMAX[fmt], torch.ones_like(a))
    u = x / s
    q = torch.clamp(torch.round(u), -127, 127) if fmt == "int8" else u.to(torch.float8_e4m3fn).to(x.dtype)
    return q * s


def quant_error(x: Tensor, fmt: str, scale: str) -> float:
    """``||q(x) - x|| / ||x||`` (Frobenius, computed in float64)."""
    x = x.detach().double()
    return float((quantize(x, fmt, scale) - x).norm() / x.norm().clamp_min(1e-300))


def _errors(
    x: Tensor, prefix: str, formats: Sequence[str] = FORMATS, scales: Sequence[str] = SCALES
) -> dict[str, float]:
    return {f"{prefix}_{f.split('_')[0]}_{s}": quant_error(x, f, s) for f in formats for s in scales}


def norm_sites(model: nn.Module, ids: Tensor) -> tuple[Dataflow, dict[str, NormFacts]]:
    """The recorded dataflow of ``model`` on ``ids`` and every module in it that behaves as a last-dim norm."""
    flow = record_flow(model, model_inputs(model, ids))
    return flow, find_norms(flow)


def record(model: nn.Module, names: Sequence[str], ids: Tensor, pick: Callable[[Any, Any], Any]) -> dict[str, list]:
    """``pick(args, output)`` of each named module's every call on one forward (``None`` picks are dropped)."""
    seen: dict[str, list] = {n: [] for n in names}
    handles = []
    for n in names:

        def hook(mod: nn.Module, args: Any, out: Any, n: str = n) -> None:
            got = pick(args, out[0] if isinstance(out, (tuple, list)) else out)
            if got is not None:
                seen[n].append(got)

        handles.append(model.get_submodule(n).register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(**model_inputs(model, ids))
    finally:
        for h in handles:
            h.remove()
    return seen


def _in_out(args: Any, y: Any) -> tuple[Tensor, Tensor] | None:
    x = args[0] if args else None
    return (x.detach(), y.detach()) if isinstance(x, Tensor) and isinstance(y, Tensor) else None


def _capture(model: nn.Module, names: Sequence[str], ids: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """Each named module's input and output on one forward (calls of one module joined along the token axis)."""
    seen = record(model, names, ids, _in_out)
    return {n: (torch.cat([x for x, _ in v], 1), torch.cat([y for _, y in v], 1)) for n, v in seen.items() if v}


def site_report(
    model: nn.Module,
    ids: Tensor,
    tokens: Sequence[str] | None = None,
    formats: Sequence[str] = FORMATS,
    scales: Sequence[str] = SCALES,
) -> list[dict[str, Any]]:
    """One row per norm site (call order): the input's largest activation (value, channel, token, ratio to the
    median |x|, count above 100 x median) and the relative quantization errors of input and output in each of
    ``formats`` (of :data:`FORMATS`) with each of ``scales`` (of :data:`SCALES`), columns ``in_int8_tensor`` ..."""
    for name, got, allowed in (("formats", formats, FORMATS), ("scales", scales, SCALES)):
        if isinstance(got, str) or not got or any(g not in allowed for g in got):
            raise ValueError(f"{name} must be a non-empty sequence of {allowed}, got {got!r}")
    model = model.eval()
    _, norms = norm_sites(model, ids)
    rows = []
    for name, (x, y) in _capture(model, list(norms), ids).items():
        ma = massive_activations(x, median_sample=None)
        top: Any = ma["top"]
        t = top[0]
        tok = int(t["token"])
        row: dict[str, Any] = {
            "site": name,
            "kind": "LayerNorm" if norms[name].measured.center else "RMSNorm",
            "in_max": t["value"],
            "channel": t["channel"],
            "token": tokens[tok] if tokens is not None and tok < len(tokens) else tok,
            "x_median": ma["max_ratio"],
            "n_massive": ma["massive"],
            "out_x_median": massive_activations(y, median_sample=None)["max_ratio"],
        }
        row.update(_errors(x, "in", formats, scales))
        row.update(_errors(y, "out", formats, scales))
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- SmoothQuant-style migration
@dataclass
class Smoothing:
    """The smoothed copy (``model``), one row per norm folded and one refusal per norm not."""

    model: nn.Module
    alpha: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    refusals: list[dict[str, str]] = field(default_factory=list)


def _refusal(model: nn.Module, facts: NormFacts, consumers: list[str]) -> str | None:
    if facts.gain_param is None:
        return "the norm has no gain to carry the scale"
    params = list(model.named_parameters(remove_duplicate=False))
    for c in consumers:
        lin: Any = model.get_submodule(c)  # its own bias is untouched by W diag(s)
        owners = [n for n, p in params if p is lin.weight]
        if len(owners) > 1:
            return f"{c}.weight is shared with {', '.join(o for o in owners if not o.startswith(c + '.'))}"
    return None


@torch.no_grad()
def smooth(model: nn.Module, ids: Tensor, alpha: float = 0.5) -> Smoothing:
    """A copy of ``model`` with every foldable norm's output smoothed: ``s_j = max|y_j|^alpha / max|W_:j|^(1-alpha)``
    (SmoothQuant's rule; ``y`` the norm output on ``ids``, ``W`` the consumers stacked), multiplier ``m / s`` and
    bias ``b / s`` in the norm, ``W diag(s)`` in each consumer. Each row reports the per-tensor int8 error of the
    consumers' input (the norm output) and the per-output-channel int8 error of their weights, before and after."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    stock = copy.deepcopy(model).eval()
    flow, norms = norm_sites(stock, ids)
    outputs = _capture(stock, list(norms), ids)
    result = Smoothing(stock, alpha)
    for name, facts in norms.items():
        consumers, reason = linear_consumers(flow, name)
        reason = reason or _refusal(stock, facts, consumers)
        if reason is not None or name not in outputs:
            result.refusals.append({"site": name, "reason": reason or "not run on the text"})
            continue
        y = outputs[name][1].double()
        lins: list[Any] = [stock.get_submodule(c) for c in consumers]
        cols = [(lin.weight.double() if linear_kind(lin) == "linear" else lin.weight.double().T) for lin in lins]
        w_max = torch.cat(cols, 0).abs().amax(0)
        y_max = y.abs().reshape(-1, y.shape[-1]).amax(0)
        s = y_max.pow(alpha) / w_max.pow(1 - alpha)
        s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
        w_before = sum(quant_error(w, "int8", "channel") * w.numel() for w in cols) / sum(w.numel() for w in cols)
        module = stock.get_submodule(name)
        gain = getattr(module, facts.gain_param)  # type: ignore[arg-type]
        m = facts.multiplier(module).double()  # type: ignore[union-attr]
        m_new = m / s
        if facts.measured.gain_convention is GainConvention.ONE_PLUS_W:
            m_new = m_new - 1
        gain.copy_(m_new.to(gain.dtype))
        if facts.bias_param is not None:
            b = getattr(module, facts.bias_param)
            b.copy_((b.double() / s).to(b.dtype))
        for lin in lins:
            w = lin.weight.double()
            w = w * s[None, :] if linear_kind(lin) == "linear" else w * s[:, None]
            lin.weight.copy_(w.to(lin.weight.dtype))
        cols_after = [c * s[None, :] for c in cols]
        w_after = sum(quant_error(w, "int8", "channel") * w.numel() for w in cols_after) / sum(
            w.numel() for w in cols_after
        )
        result.rows.append(
            {
                "site": name,
                "into": ", ".join(consumers),
                "act_int8_before": quant_error(y, "int8", "tensor"),
                "act_int8_after": quant_error(y / s, "int8", "tensor"),
                "w_int8_before": w_before,
                "w_int8_after": w_after,
                "s_min": float(s.min()),
                "s_max": float(s.max()),
            }
        )
    return result


def max_logit_diff(a: nn.Module, b: nn.Module, ids: Tensor) -> float:
    """``max |a(ids) - b(ids)|`` over the first output (float64 of whatever dtype the models run in)."""
    with torch.no_grad():
        ya = a(**model_inputs(a, ids))[0]
        yb = b(**model_inputs(b, ids))[0]
    return float((ya.double() - yb.double()).abs().max())


# ----------------------------------------------------------------------------- compression valley
def matrix_entropy(h: Tensor) -> float:
    """The entropy of the normalised singular-value spectrum of a (tokens x features) matrix, ``p_i = s_i^2 /
    sum s^2``, divided by ``log(rank bound)`` so it lies in [0, 1] (1: flat spectrum, 0: rank one)."""
    m = h.detach().double().reshape(-1, h.shape[-1])
    sv = torch.linalg.svdvals(m)
    p = sv.square() / sv.square().sum()
    p = p[p > 0]
    n = min(m.shape)
    return float(-(p * p.log()).sum() / math.log(n)) if n > 1 else 0.0


def stream_entropy(model: nn.Module, ids: Tensor) -> list[dict[str, Any]]:
    """The residual stream's matrix entropy entering layer 0 and leaving each layer (read from the dataflow)."""
    reading = read_model(model, ids, head=False)
    with torch.no_grad(), capture_stream(model, reading) as found:
        model(**model_inputs(model, ids))
        streams = list(found)
    return [{"depth": i, "after": "embedding" if i == 0 else f"layer {i - 1}", "entropy": matrix_entropy(h)}
            for i, h in enumerate(streams)]  # fmt: skip
