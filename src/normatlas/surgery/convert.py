"""Conversions: LayerNorm -> RMSNorm exactly, ``w`` <-> ``1 + w``, eps, and BatchNorm folding/freezing.

LayerNorm -> RMSNorm (essay, "Folding"; "Enjoy Your LayerNorm with the Efficiency of
RMSNorm"): LayerNorm is RMSNorm of the centred input, ``LN(h) = RMS(P h)`` with
``P = I - 11^T/D``. When every writer into a residual stream is a linear map (an
embedding row, a projection and its bias) and the stream is read only by adds and
LayerNorms, centring each writer (``W <- P W``, ``b <- P b``) makes the stream centred,
so every LayerNorm reading it equals an RMSNorm with the same eps; the LN affine is
then folded forward into the consumers where they are all linear. The foldability
analysis walks the recorded dataflow back from each LayerNorm through the residual
adds to the writers and refuses a stream, naming why, when a writer cannot be centred
(a Post-LN norm's output ``g * x_hat + b`` would need the full matrix ``P diag(g)``) or
when a non-norm reads the stream (it would see the centred values).

Guaranteed property: the saved module structure stays the stock one (a LayerNorm on a
centred stream computes the RMSNorm), so stock transformers loads it exactly; the
runtime swaps put in normatlas RMSNorms. Measured by :mod:`.verify`.
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Any

import torch
from torch import nn

from ..analysis.flow import Dataflow, linear_kind
from ..analysis.flow import record_flow as record
from ..longtail.batchnorm import read_batchnorm
from ..modules import Norm
from ..spec import EpsPlacement, GainConvention, parse_enum
from .fold import _fold_norm, linear_consumers
from .norms import NormFacts, find_norms
from .report import Change, Refusal, Surgery, Swap, SwapKind

__all__ = [
    "change_eps",
    "convert_gain_convention",
    "fold_batchnorm",
    "freeze_batchnorm",
    "gain_offset_warnings",
    "ln_foldability",
    "ln_to_rms",
]


def _components(flow: Dataflow, lns: dict[str, NormFacts]) -> list[tuple[list[str], set, list]]:
    """Group the LayerNorms by the residual stream they read: (norms, stream tensors, writer tensors)."""
    groups: list[tuple[list[str], set, list]] = []
    for name in lns:
        for call in flow.module_calls(name):
            tensors, leaves = flow.stream(call.inputs[0])
            hit = [g for g in groups if g[1] & tensors]
            merged = ([name], set(tensors), list(leaves))
            for g in hit:
                groups.remove(g)
                merged[0].extend(n for n in g[0] if n not in merged[0])
                merged[1].update(g[1])
                merged[2].extend(g[2])
            groups.append(merged)
    return groups


def _stream_reasons(
    flow: Dataflow, norms: dict[str, NormFacts], names: list[str], tensors: set, leaves: list
) -> tuple[list[str], dict[str, str]]:
    reasons: list[str] = []
    writers: dict[str, str] = {}
    for leaf in dict.fromkeys(leaves):
        idx = flow.producer.get(leaf)
        call = flow.calls[idx] if idx is not None else None
        if call is None:
            reasons.append("the stream is written by a model input, which cannot be centred")
            continue
        kind = linear_kind(flow.submodule(call.module)) if call.module is not None else None
        if call.module in norms:
            reasons.append(
                f"{call.module}'s output is added into the stream directly (Post-LN): g*x_hat+b is not "
                "centred, and centring it would need the full matrix P*diag(g), not a per-feature gain; "
                "that output is also what the next block's layers read"
            )
        elif kind in ("embedding", "linear", "conv1d_t"):
            writers[call.module] = kind  # type: ignore[index]
        else:
            reasons.append(f"{call.label} writes into the stream and is not a linear layer or embedding")
    others: list[str] = []
    for k in tensors:
        if flow.escapes(k):
            reasons.append("the stream itself is a model output, which would change")
        for r in flow.readers.get(k, []):
            call = flow.calls[r]
            if call.module in names or any(o in tensors for o in call.outputs):
                continue
            others.append(call.label)
    if others:
        reasons.append(
            f"the stream is also read by {', '.join(dict.fromkeys(others))}, not LayerNorms, which "
            "would see the centred values"
        )
    for w in writers:
        for call in flow.module_calls(w):
            if not all(o in tensors for o in call.outputs):
                reasons.append(f"{w} also writes outside this stream, where centring would change its output")
    return list(dict.fromkeys(reasons)), writers


def ln_foldability(flow: Dataflow, norms: dict[str, NormFacts]) -> list[tuple[list[str], dict[str, str], list[str]]]:
    """For each residual stream read by LayerNorms: (norms, centrable writers, reasons it cannot be converted)."""
    lns = {n: f for n, f in norms.items() if f.measured.center}
    out = []
    for names, tensors, leaves in _components(flow, lns):
        reasons, writers = _stream_reasons(flow, norms, names, tensors, leaves)
        out.append((names, writers, reasons))
    return out


def _untie_readers(model: nn.Module, writer: str, surgery: Surgery) -> None:
    """Give every other module sharing ``writer``'s weight its own copy (the LM head of a tied model)."""
    w = model.get_submodule(writer).weight
    for name, mod in model.named_modules():
        if name != writer and getattr(mod, "weight", None) is w:
            mod.weight = nn.Parameter(w.detach().clone())
            surgery.mark_untied(
                f"untied {name}.weight from {writer}.weight (+{w.numel()} parameters): the "
                "embedding is centred as a stream writer, the head must keep the original"
            )


@torch.no_grad()
def _centre(module: Any, kind: str) -> None:
    w = module.weight
    dim = {"embedding": 1, "linear": 0, "conv1d_t": 1}[kind]
    w.copy_((w.double() - w.double().mean(dim, keepdim=True)).to(w.dtype))
    b = getattr(module, "bias", None)
    if b is not None:
        b.copy_((b.double() - b.double().mean()).to(b.dtype))


def ln_to_rms(model: nn.Module, example_inputs: Any) -> Surgery:
    """Convert every LayerNorm whose residual stream can be centred into an RMSNorm, exactly."""
    model = copy.deepcopy(model).eval()
    flow = record(model, example_inputs)
    norms = find_norms(flow)
    surgery = Surgery("ln-to-rms", model)
    for names, writers, reasons in ln_foldability(flow, norms):
        if reasons:
            for n in names:
                surgery.refusals.append(Refusal(n, "ln-to-rms", "; ".join(reasons)))
            continue
        for w, kind in writers.items():
            _untie_readers(model, w, surgery)
            _centre(model.get_submodule(w), kind)
        surgery.changes.append(
            Change(
                ", ".join(writers), "centred", "stream writers: weights and biases minus their mean over the model dim"
            )
        )
        for n in names:
            facts = norms[n]
            consumers, why = linear_consumers(flow, n)
            folded = why is None and _fold_norm(model, facts, consumers, surgery) is None
            module = model.get_submodule(n)
            has_bias = facts.bias_param is not None and bool((getattr(module, facts.bias_param) != 0).any())
            spec = facts.spec(center=False, gain=not folded, bias=has_bias)
            surgery.swaps.append(Swap(n, SwapKind.NORM, spec, [facts.dim], params=facts.params()))
            surgery.changes.append(
                Change(n, "LN -> RMSNorm", "affine folded forward" if folded else f"affine kept in the RMSNorm ({why})")
            )
    return surgery


def gain_offset_warnings(model: nn.Module, norms: dict[str, NormFacts]) -> list[str]:
    """Warn where the stored gains look like the other convention (the double-offset bug)."""
    out = []
    for name, f in norms.items():
        if f.gain_param is None:
            continue
        w = getattr(model.get_submodule(name), f.gain_param).detach().double()
        mean = float(w.mean())
        if f.measured.gain_convention is GainConvention.ONE_PLUS_W and mean > 0.5:
            out.append(
                f"{name}: the code computes (1 + w) but w averages {mean:.3f}, so the multiplier averages "
                f"{1 + mean:.3f}: the +1 offset looks already baked into the weights (double offset)"
            )
        elif f.measured.gain_convention is GainConvention.W and float(w.abs().mean()) < 0.1:
            out.append(
                f"{name}: the code computes w but |w| averages {float(w.abs().mean()):.3f}, so the layer "
                "nearly zeroes its output: these look like (1 + w) weights missing their offset"
            )
    return out


def convert_gain_convention(model: nn.Module, example_inputs: Any, to: GainConvention | str) -> Surgery:
    """Re-express every norm gain in convention ``to`` (``w <- 1 + w`` or ``w <- w - 1``).

    The convention each module's code uses is measured (:func:`.norms.probe_norm`), never read
    from names. The saved tensors are in the target convention, so stock code of the source
    convention would apply the offset twice: the checkpoint loads only with the manifest swaps.
    """
    to = parse_enum(GainConvention, to, name="to")
    model = copy.deepcopy(model).eval()
    flow = record(model, example_inputs)
    norms = find_norms(flow)
    surgery = Surgery(f"gain-{to.value}", model, stock_equivalent=False)
    surgery.notes.extend(gain_offset_warnings(model, norms))
    surgery.notes.append(
        "the saved gains are in the target convention: stock code for this config.json would apply its own "
        "convention on top, so load with normatlas.surgery.load_transformed (the manifest swaps the norms)"
    )
    for name, f in norms.items():
        if f.gain_param is None or f.measured.gain_convention is to:
            continue
        p = getattr(model.get_submodule(name), f.gain_param)
        with torch.no_grad():
            p.add_(1.0 if to is GainConvention.W else -1.0)
        surgery.swaps.append(Swap(name, SwapKind.NORM, f.spec(convention=to), [f.dim], params=f.params()))
        surgery.changes.append(
            Change(
                name,
                f"{f.measured.gain_convention.value} -> {to.value}",
                "measured: zero weight gives "
                + ("identity scale" if f.measured.gain_convention is GainConvention.ONE_PLUS_W else "zero output"),
            )
        )
    return surgery


@torch.no_grad()
def _eps_deviation(old: nn.Module, new: nn.Module, x: torch.Tensor) -> float:
    probes = [x] + [x * s for s in (1e-2, 1e-3, 1e-4)]
    return max(float((new(p).double() - old(p).double()).abs().max()) for p in probes)


def change_eps(
    model: nn.Module, example_inputs: Any, *, eps: float | None = None, eps_placement: EpsPlacement | None = None
) -> Surgery:
    """Change eps and/or its placement in every norm; report the measured deviation per norm.

    Not an equivalence: the deviation is measured on the recorded inputs of each norm and on
    the same inputs scaled down by 1e2..1e4 (where eps matters), and end to end by the checks.
    """
    if eps is not None:
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"eps={eps!r} must be a finite number > 0, or None to keep each norm's eps")
        if not math.isfinite(eps) or eps <= 0:
            raise ValueError(f"eps={eps!r} must be a finite number > 0, or None to keep each norm's eps")
    if eps_placement is not None and not isinstance(eps_placement, EpsPlacement):
        allowed = ", ".join(f"EpsPlacement.{p.name}" for p in EpsPlacement)
        raise TypeError(f"eps_placement={eps_placement!r} must be an EpsPlacement ({allowed}) or None")
    model = copy.deepcopy(model).eval()
    flow = record(model, example_inputs)
    norms = find_norms(flow)
    surgery = Surgery("eps", model, stock_equivalent=False)
    for name, f in norms.items():
        spec = f.spec(eps=eps, eps_placement=eps_placement)
        old = model.get_submodule(name)
        new = Norm(spec, f.dim, dtype=next(old.parameters()).dtype)
        new.load_state_dict({k: v for k, v in old.state_dict().items() if k in new.state_dict()})
        dev = _eps_deviation(old, new, flow.tensor(flow.module_calls(name)[0].inputs[0]))
        surgery.swaps.append(Swap(name, SwapKind.NORM, spec, [f.dim], params=f.params()))
        surgery.changes.append(
            Change(
                name,
                "eps",
                f"{f.eps:g} {f.measured.eps_placement.value} -> {spec.eps:g} "
                f"{spec.eps_placement.value}; max deviation on probes {dev:.3g}",
            )
        )
    surgery.notes.append("config.json keeps the old eps; the manifest's swaps carry the new one")
    return surgery


def _batchnorms(model: nn.Module) -> list[str]:
    """Every BatchNorm with running statistics (not already frozen), by the one detector."""
    states = ((n, read_batchnorm(m)) for n, m in model.named_modules())
    return [n for n, s in states if s is not None and not s.frozen and s.running_var is not None]


def _bn_channel_axis(bn: nn.Module, ndim: int) -> int:
    state = read_batchnorm(bn)
    assert state is not None  # one of _batchnorms
    return state.channel_axis(ndim)


def _bn_fold_refusal(flow: Dataflow, name: str, bn: Any) -> tuple[str | None, str | None]:
    """(the conv/linear that alone feeds BatchNorm ``name``, None) when it can be folded, else (None, why)."""
    calls = flow.module_calls(name)
    if len(calls) != 1:
        return None, f"it is applied {len(calls)} times, so no single producer carries its statistics"
    src = flow.producer_of(calls[0].inputs[0])
    conv = src.module if src is not None else None
    kind = linear_kind(flow.submodule(conv)) if conv is not None else None
    if src is None or conv is None or kind not in ("conv", "linear"):
        return None, f"its input comes from {src.label if src else 'a model input'}, not a convolution/linear"
    lin: Any = flow.submodule(conv)
    if len(flow.module_calls(conv)) != 1:
        return None, (
            f"{conv} is applied {len(flow.module_calls(conv))} times, so folding into its weights would change "
            "its other applications too"
        )
    if [c.module for c in flow.consumers(src.outputs[0])] != [name]:
        return None, f"{conv}'s output is also read elsewhere"
    owners = [n for n, q in flow.model.named_parameters(remove_duplicate=False) if q is lin.weight]
    if len(owners) > 1:
        return None, f"{conv}.weight is shared with {', '.join(owners)}, which folding would change too"
    y, x = flow.tensor(src.outputs[0]), flow.tensor(calls[0].inputs[0])
    out_axis = 1 if kind == "conv" else y.dim() - 1
    if x.shape != y.shape or _bn_channel_axis(bn, x.dim()) != out_axis:
        return None, (
            f"it normalises axis {_bn_channel_axis(bn, x.dim())} of a {tuple(x.shape)} tensor, but {conv}'s output "
            f"channels are axis {out_axis} of {tuple(y.shape)}: the per-channel scale does not map onto its weights"
        )
    raw = getattr(bn, "eps", None)
    eps = float(raw) if isinstance(raw, numbers.Real) and not isinstance(raw, bool) else math.nan
    if not math.isfinite(eps) or eps < 0:
        return None, f"its eps={raw!r} is not a finite number >= 0"
    if bn.weight is None and eps >= 1:
        return None, f"it has no affine weight and eps={eps:g} >= 1, so its running_var cannot be set to 1 - eps"
    return conv, None


def fold_batchnorm(model: nn.Module, example_inputs: Any) -> Surgery:
    """Fold each eval-mode BatchNorm into the convolution/linear that alone feeds it.

    ``s = gamma / sqrt(var + eps)``: ``W <- W * s`` per output channel, shift ``beta - mean * s``
    (plus ``b * s``); a BatchNorm without affine (``affine=False``) has ``gamma = 1, beta = 0``.
    The saved structure keeps the BatchNorm as ``x * 1 + shift``, exact to one rounding under
    stock code: running mean 0 and running var 1 with weight sqrt(1 + eps), or, without an
    affine weight, running var 1 - eps; the shift lives in the conv's bias, else in the
    BatchNorm's bias, else as minus its running mean. The runtime swap moves the shift into
    the conv's bias and deletes the BatchNorm. Every condition is checked before anything
    is written, so a refused BatchNorm and its conv are left untouched.
    """
    model = copy.deepcopy(model).eval()
    names = set(_batchnorms(model))
    flow = record(model, example_inputs, opaque=lambda n, m: n in names)  # BN without affine owns no parameters
    surgery = Surgery("bn-fold", model)
    for name in _batchnorms(model):
        bn: Any = model.get_submodule(name)
        if not flow.module_calls(name):
            surgery.notes.append(f"{name}: not called on the example inputs, left as is")
            continue
        conv, why = _bn_fold_refusal(flow, name, bn)
        if why is not None:
            surgery.refusals.append(Refusal(name, "bn-fold", why))
            continue
        lin: Any = model.get_submodule(conv)  # type: ignore[arg-type]
        with torch.no_grad():
            eps = float(bn.eps)
            g = bn.weight.double() if bn.weight is not None else torch.ones_like(bn.running_var.double())
            s = g / (bn.running_var.double() + eps).sqrt()
            beta = bn.bias.double() if bn.bias is not None else torch.zeros_like(s)
            shift = beta - bn.running_mean.double() * s
            if lin.bias is not None:
                shift = shift + lin.bias.double() * s
            view = (-1,) + (1,) * (lin.weight.dim() - 1)
            lin.weight.copy_((lin.weight.double() * s.reshape(view)).to(lin.weight.dtype))
            bn.running_mean.zero_()
            if bn.weight is not None:  # (x - 0) / sqrt(1 + eps) * sqrt(1 + eps)
                bn.running_var.fill_(1.0)
                bn.weight.fill_(math.sqrt(1.0 + eps))
            else:  # (x - 0) / sqrt((1 - eps) + eps)
                bn.running_var.fill_(1.0 - eps)
            if lin.bias is not None:
                lin.bias.copy_(shift.to(lin.bias.dtype))
                if bn.bias is not None:
                    bn.bias.zero_()
                surgery.swaps.append(Swap(name, SwapKind.IDENTITY))
            else:
                if bn.bias is not None:
                    bn.bias.copy_(shift.to(bn.bias.dtype))
                else:
                    bn.running_mean.copy_((-shift).to(bn.running_mean.dtype))
                surgery.swaps.append(Swap(conv, SwapKind.BIAS_INTO, source=name))  # type: ignore[arg-type]
        affine = "" if bn.weight is not None and bn.bias is not None else " (BatchNorm without affine: gamma 1, beta 0)"
        surgery.changes.append(
            Change(name, "folded", f"scale -> {conv}.weight, shift -> {conv}.bias (runtime){affine}")
        )
    return surgery


def freeze_batchnorm(model: nn.Module, example_inputs: Any = None) -> Surgery:
    """Swap every BatchNorm for :class:`normatlas.longtail.FrozenBatchNorm` (same state dict keys)."""
    model = copy.deepcopy(model).eval()
    surgery = Surgery("bn-frozen", model)
    for name in _batchnorms(model):
        surgery.swaps.append(Swap(name, SwapKind.FROZEN_BATCHNORM))
        surgery.changes.append(Change(name, "frozen", "statistics and affine become buffers"))
    return surgery
