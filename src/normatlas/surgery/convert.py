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
from typing import Any

import torch
from torch import nn

from ..modules import Norm
from ..spec import EpsPlacement, GainConvention
from .dataflow import Dataflow, linear_kind, record
from .fold import _fold_norm, linear_consumers
from .norms import NormFacts, find_norms
from .report import Change, Refusal, Surgery, Swap, spec_to_dict

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
    lns = {n: f for n, f in norms.items() if f.center}
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
            surgery.swaps.append(Swap(n, "norm", spec_to_dict(spec), [facts.dim]))
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
        if f.convention is GainConvention.ONE_PLUS_W and mean > 0.5:
            out.append(
                f"{name}: the code computes (1 + w) but w averages {mean:.3f}, so the multiplier averages "
                f"{1 + mean:.3f}: the +1 offset looks already baked into the weights (double offset)"
            )
        elif f.convention is GainConvention.W and float(w.abs().mean()) < 0.1:
            out.append(
                f"{name}: the code computes w but |w| averages {float(w.abs().mean()):.3f}, so the layer "
                "nearly zeroes its output: these look like (1 + w) weights missing their offset"
            )
    return out


def convert_gain_convention(model: nn.Module, example_inputs: Any, to: GainConvention) -> Surgery:
    """Re-express every norm gain in convention ``to`` (``w <- 1 + w`` or ``w <- w - 1``).

    The convention each module's code uses is measured (:func:`.norms.probe_norm`), never read
    from names. The saved tensors are in the target convention, so stock code of the source
    convention would apply the offset twice: the checkpoint loads only with the manifest swaps.
    """
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
        if f.gain_param is None or f.convention is to:
            continue
        p = getattr(model.get_submodule(name), f.gain_param)
        with torch.no_grad():
            p.add_(1.0 if to is GainConvention.W else -1.0)
        surgery.swaps.append(Swap(name, "norm", spec_to_dict(f.spec(convention=to)), [f.dim]))
        surgery.changes.append(
            Change(
                name,
                f"{f.convention.value} -> {to.value}",
                "measured: zero weight gives "
                + ("identity scale" if f.convention is GainConvention.ONE_PLUS_W else "zero output"),
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
    if eps is not None and (not isinstance(eps, (int, float)) or not eps >= 0 or not math.isfinite(eps)):
        raise ValueError(f"eps={eps!r} must be a finite number >= 0")
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
        surgery.swaps.append(Swap(name, "norm", spec_to_dict(spec), [f.dim]))
        surgery.changes.append(
            Change(
                name,
                "eps",
                f"{f.eps:g} {f.eps_placement.value} -> {spec.eps:g} "
                f"{spec.eps_placement.value}; max deviation on probes {dev:.3g}",
            )
        )
    surgery.notes.append("config.json keeps the old eps; the manifest's swaps carry the new one")
    return surgery


def _batchnorms(model: nn.Module) -> list[str]:
    from ..longtail import BatchNorm

    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, (nn.modules.batchnorm._BatchNorm, BatchNorm)) and getattr(m, "running_var", None) is not None
    ]


def fold_batchnorm(model: nn.Module, example_inputs: Any) -> Surgery:
    """Fold each eval-mode BatchNorm into the convolution/linear that alone feeds it.

    ``s = gamma / sqrt(var + eps)``: ``W <- W * s`` per output channel, shift ``beta - mean * s``
    (plus ``b * s``). The saved structure keeps the BatchNorm as ``x * 1 + shift`` (running
    stats 0/1, weight sqrt(1 + eps)), exact to one rounding under stock code; the runtime swap
    moves the shift into the conv's bias and deletes the BatchNorm.
    """
    model = copy.deepcopy(model).eval()
    flow = record(model, example_inputs)
    surgery = Surgery("bn-fold", model)
    for name in _batchnorms(model):
        calls = flow.module_calls(name)
        if not calls:
            continue
        src = flow.producer_of(calls[0].inputs[0])
        conv = src.module if src is not None else None
        kind = linear_kind(flow.submodule(conv)) if conv is not None else None
        readers = flow.consumers(src.outputs[0]) if src is not None else []
        if kind not in ("conv", "linear") or len(calls) != 1 or [c.module for c in readers] != [name]:
            why = (
                f"its input comes from {src.label if src else 'a model input'}, not a convolution/linear"
                if kind not in ("conv", "linear")
                else f"{conv}'s output is also read elsewhere"
            )
            surgery.refusals.append(Refusal(name, "bn-fold", why))
            continue
        bn: Any = model.get_submodule(name)
        lin: Any = model.get_submodule(conv)  # type: ignore[arg-type]
        with torch.no_grad():
            eps = float(bn.eps if isinstance(bn.eps, float) else 1e-5)
            g = bn.weight.double() if bn.weight is not None else torch.ones_like(bn.running_var.double())
            s = g / (bn.running_var.double() + eps).sqrt()
            beta = bn.bias.double() if bn.bias is not None else torch.zeros_like(s)
            shift = beta - bn.running_mean.double() * s
            if lin.bias is not None:
                shift = shift + lin.bias.double() * s
            view = (-1,) + (1,) * (lin.weight.dim() - 1)
            lin.weight.copy_((lin.weight.double() * s.reshape(view)).to(lin.weight.dtype))
            bn.running_mean.zero_()
            bn.running_var.fill_(1.0)
            if bn.weight is None or bn.bias is None:
                surgery.refusals.append(Refusal(name, "bn-fold", "BatchNorm without affine cannot hold the shift"))
                continue
            bn.weight.fill_(math.sqrt(1.0 + eps))
            if lin.bias is not None:
                lin.bias.copy_(shift.to(lin.bias.dtype))
                bn.bias.zero_()
                surgery.swaps.append(Swap(name, "identity"))
            else:
                bn.bias.copy_(shift.to(bn.bias.dtype))
                surgery.swaps.append(Swap(conv, "bias_into", source=name))  # type: ignore[arg-type]
        surgery.changes.append(Change(name, "folded", f"scale -> {conv}.weight, shift -> {conv}.bias (runtime)"))
    return surgery


def freeze_batchnorm(model: nn.Module, example_inputs: Any = None) -> Surgery:
    """Swap every BatchNorm for :class:`normatlas.longtail.FrozenBatchNorm` (same state dict keys)."""
    model = copy.deepcopy(model).eval()
    surgery = Surgery("bn-frozen", model)
    for name in _batchnorms(model):
        surgery.swaps.append(Swap(name, "frozen_batchnorm"))
        surgery.changes.append(Change(name, "frozen", "statistics and affine become buffers"))
    return surgery
