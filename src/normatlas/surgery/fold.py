"""Gain folding (FlashNorm) and pre-attention norm cancellation.

Method (essay, "Norm folding & FlashNorm"): a norm followed only by linear layers,
``W (m * x_hat + b) + c = (W diag(m)) x_hat + (W b + c)``, so the gain ``m`` (``w`` or
``1 + w``, as measured) and bias move into every consumer and the norm is left
weightless (FlashNorm, Graef et al. 2024). With ``defer=True`` an RMS norm's division
moves past the GEMM too: ``W (x / rms(x)) = (W x) / rms(x)``.

Cancellation: when every consumer's output flows (through reshapes only) into a
scale-invariant norm, as in an attention block with Q, K *and* V normalised, the
pre-attention norm's ``1 / rms(x)`` is a per-token scalar that the downstream norms
remove, so the norm can be deleted after folding its gain. Only Q and K normalised
(Qwen3, Gemma 3) is refused: the value path still carries the scale.

Guaranteed property: consumers are found from the recorded dataflow; a norm whose
output reaches anything but a linear layer (a residual add, an attention op) is
refused with that reader named. Exactness is then measured by :mod:`.verify`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..analysis.flow import Dataflow, linear_kind
from ..analysis.flow import record_flow as record
from ..spec import EpsPlacement, Scale
from .norms import NormFacts, find_norms
from .report import Change, Refusal, Surgery, Swap, SwapKind

__all__ = ["DeferredNormLinear", "cancel_pre_attention_norms", "fold_gains", "linear_consumers"]


def linear_consumers(flow: Dataflow, norm: str) -> tuple[list[str], str | None]:
    """The linear layers that read ``norm``'s output, or ([], reason) when anything else reads it."""
    found: list[str] = []
    for call in flow.module_calls(norm):
        out = call.outputs[0]
        if flow.escapes(out):
            return [], "its output is a model output, so nothing downstream can absorb the gain"
        for c in flow.consumers(out):
            kind = linear_kind(flow.submodule(c.module)) if c.module is not None else None
            if kind not in ("linear", "conv1d_t"):
                what = type(flow.submodule(c.module)).__name__ if c.module is not None else f"'{c.op}'"
                return [], (
                    f"its output is also read by {c.label} ({what}), not a linear layer, so the gain "
                    "cannot move into the readers"
                )
            if c.module not in found:
                found.append(c.module)  # type: ignore[arg-type]
    for lin in found:
        for call in flow.module_calls(lin):
            src = flow.producer_of(call.inputs[0]) if call.inputs else None
            if src is None or src.module != norm:
                return [], f"{lin} is also applied to other inputs, so its weights cannot carry this norm's gain"
    return found, None


def _shared(model: nn.Module, param: Tensor) -> list[str]:
    return [n for n, p in model.named_parameters(remove_duplicate=False) if p is param]


def _untie(model: nn.Module, name: str, surgery: Surgery) -> None:
    lin: Any = model.get_submodule(name)
    owners = _shared(model, lin.weight)
    if len(owners) > 1:
        lin.weight = nn.Parameter(lin.weight.detach().clone())
        others = [o for o in owners if not o.startswith(name + ".")]
        surgery.mark_untied(
            f"untied {name}.weight from {', '.join(others)} (+{lin.weight.numel()} parameters): "
            "folding into a tied matrix would change the embedding too"
        )


@torch.no_grad()
def _fold_into(model: nn.Module, lin_name: str, m: Tensor | None, b: Tensor | None) -> None:
    lin: Any = model.get_submodule(lin_name)
    kind = linear_kind(lin)
    w = lin.weight.double()
    if kind == "linear":  # y = x W^T + c: W' = W diag(m), c' = c + W b
        shift = w @ b.double() if b is not None else None
        w = w * m.double()[None, :] if m is not None else w
    else:  # Conv1D: y = x W + c
        shift = b.double() @ w if b is not None else None
        w = w * m.double()[:, None] if m is not None else w
    lin.weight.copy_(w.to(lin.weight.dtype))
    if shift is not None:
        assert lin.bias is not None
        lin.bias.copy_((lin.bias.double() + shift).to(lin.bias.dtype))


def _set_identity(module: nn.Module, facts: NormFacts, bias: Tensor | None = None) -> None:
    with torch.no_grad():
        if facts.gain_param:
            getattr(module, facts.gain_param).fill_(facts.identity_gain_value())
        if facts.bias_param:
            p = getattr(module, facts.bias_param)
            p.copy_(bias if bias is not None else torch.zeros_like(p))


def _fold_norm(model: nn.Module, facts: NormFacts, consumers: list[str], surgery: Surgery) -> str | None:
    module = model.get_submodule(facts.name)
    m, b = facts.multiplier(module), facts.bias(module)
    keep_bias = None
    if b is not None and not bool((b != 0).any()):
        b = None  # a zero bias: nothing to move
    if b is not None:
        no_bias = [c for c in consumers if model.get_submodule(c).bias is None]
        if no_bias:
            if m is None or bool((m == 0).any()):
                return f"{', '.join(no_bias)} has no bias and the gain has zeros, so the norm bias has nowhere to go"
            keep_bias, b = b / m, None  # W diag(m) (x_hat + b/m) = W (m x_hat + b)
    for c in consumers:
        _untie(model, c, surgery)
        _fold_into(model, c, m, b)
    _set_identity(module, facts, keep_bias)
    detail = f"gain{'+bias' if b is not None else ''} -> {', '.join(consumers)}"
    if keep_bias is not None:
        detail += "; bias kept in the norm as b/m (a consumer has no bias)"
    surgery.changes.append(Change(facts.name, "folded", detail))
    return None


_DEFERRABLE = (EpsPlacement.INSIDE_SQRT, EpsPlacement.OUTSIDE_SQRT)


class DeferredNormLinear(nn.Module):
    """FlashNorm's deferred normalisation: ``(W x) * rsqrt(mean(x^2) + eps) + c`` (eps inside the root) or
    ``(W x) / (sqrt(mean(x^2)) + eps) + c`` (outside), equal to ``W rmsnorm(x) + c`` for a weightless
    RMSNorm (statistics in at least fp32)."""

    weight: Tensor
    bias: Tensor | None

    def __init__(self, linear: Any, eps: float, eps_placement: EpsPlacement) -> None:
        super().__init__()
        if eps_placement not in _DEFERRABLE:
            allowed = ", ".join(f"EpsPlacement.{p.name}" for p in _DEFERRABLE)
            raise ValueError(f"eps_placement={eps_placement!r} cannot be deferred; allowed: {allowed}")
        self.kind = linear_kind(linear)
        self.weight, self.bias = linear.weight, linear.bias
        self.eps, self.eps_placement = eps, eps_placement

    def forward(self, x: Tensor) -> Tensor:
        ms = x.to(torch.promote_types(x.dtype, torch.float32)).pow(2).mean(-1, keepdim=True)
        if self.eps_placement is EpsPlacement.OUTSIDE_SQRT:
            inv = 1.0 / (ms.sqrt() + self.eps)
        else:
            inv = torch.rsqrt(ms + self.eps)
        y = F.linear(x, self.weight) if self.kind == "linear" else x @ self.weight
        y = (y.to(inv.dtype) * inv).to(x.dtype)
        return y if self.bias is None else y + self.bias


def _defer_refusal(facts: NormFacts, has_bias: bool) -> str | None:
    """Why :class:`DeferredNormLinear` cannot stand in for this (weightless) norm, or None when it can."""
    if facts.measured.center or has_bias:
        return (
            "centring/bias is not a per-token scalar, so the normalisation cannot move past the GEMM "
            "(convert LN->RMS first)"
        )
    if facts.measured.scale is not Scale.RMS:
        return (
            f"it divides by the {facts.measured.scale.value} statistic (measured), but the deferred linear computes "
            "rsqrt(mean(x^2)): only an RMS norm can be deferred"
        )
    if facts.measured.eps_placement not in _DEFERRABLE:
        return (
            f"its eps placement is {facts.measured.eps_placement.value} (measured), but the deferred linear supports "
            "only inside_sqrt and outside_sqrt"
        )
    return None


def _on_a_copy(transform: str, model: nn.Module, example_inputs: Any) -> tuple[Surgery, Dataflow, dict[str, NormFacts]]:
    """A surgery of ``transform`` on an eval copy of ``model`` (its ``stock``), the copy's dataflow and its norms."""
    stock = copy.deepcopy(model).eval()
    flow = record(stock, example_inputs)
    return Surgery(transform, stock), flow, find_norms(flow)


def fold_gains(model: nn.Module, example_inputs: Any, *, defer: bool = False) -> Surgery:
    """Fold every foldable norm's gain and bias into its linear consumers (a copy of ``model``).

    The saved structure keeps each norm module with an identity gain (so stock code loads it
    and computes the same); the runtime swaps make the norms weightless, or, with ``defer``,
    move an RMS norm's division past the GEMM (:class:`DeferredNormLinear`, runtime only).
    """
    surgery, flow, norms = _on_a_copy("fold", model, example_inputs)
    model = surgery.stock
    for name, facts in norms.items():
        consumers, reason = linear_consumers(flow, name)
        if reason is None:
            reason = _fold_norm(model, facts, consumers, surgery)
        if reason is not None:
            surgery.refusals.append(Refusal(name, "fold", reason))
            continue
        module = model.get_submodule(name)
        has_bias = facts.bias_param is not None and bool((getattr(module, facts.bias_param) != 0).any())
        spec = facts.spec(gain=False, bias=has_bias)
        surgery.swaps.append(Swap(name, SwapKind.NORM, spec, [facts.dim], params=facts.params()))
        if defer:
            why = _defer_refusal(facts, has_bias)
            if why is not None:
                surgery.refusals.append(Refusal(name, "defer", why))
            else:
                surgery.notes.append(f"{name}: normalisation deferred past {', '.join(consumers)} (runtime only)")
                surgery.deferred.append((name, consumers, facts))
    return surgery


def deferred_runtime(surgery: Surgery) -> nn.Module:
    """The runtime model with deferred normalisation where :func:`fold_gains` allowed it."""
    model = surgery.runtime()
    for name, consumers, facts in surgery.deferred:
        for c in consumers:
            model.set_submodule(c, DeferredNormLinear(model.get_submodule(c), facts.eps, facts.measured.eps_placement))
        model.set_submodule(name, nn.Identity())
    return model


def cancel_pre_attention_norms(model: nn.Module, example_inputs: Any) -> Surgery:
    """Delete every norm whose consumers' outputs are all normalised again (Q, K and V), after
    folding its gain into them; refuse, with the reason, everywhere else."""
    surgery, flow, norms = _on_a_copy("cancel", model, example_inputs)
    model = surgery.stock
    for name, facts in norms.items():
        consumers, reason = linear_consumers(flow, name)
        renormed = [c for c in consumers if flow.reaches_norm(flow.module_calls(c)[0].outputs[0], norms) is not None]
        if reason is not None or not renormed:
            continue  # no consumer is normalised again (MLP input, LM head, post-branch norm): not a candidate
        module = model.get_submodule(name)
        missing = []
        for c in consumers:
            out = flow.module_calls(c)[0].outputs[0]
            if flow.reaches_norm(out, norms) is None:
                missing.append(f"{c} -> {flow.first_non_shape_reader(out)}")
        if missing:
            reason = (
                "not every consumer is normalised afterwards: "
                + "; ".join(missing)
                + ". That path still needs the 1/rms(x) scale"
                + (" (the value path, when only Q and K have norms)" if len(missing) < len(consumers) else "")
            )
        elif facts.measured.center:
            reason = "it centres (LayerNorm); the downstream norms cancel a scale, not the mean"
        elif facts.bias_param is not None and bool((getattr(module, facts.bias_param) != 0).any()):
            reason = "it has a bias, which does not scale with 1/rms(x)"
        else:
            biased = [c for c in consumers if getattr(model.get_submodule(c), "bias", None) is not None]
            reason = f"{', '.join(biased)} add a bias, which does not scale with 1/rms(x)" if biased else None
        if reason is not None:
            surgery.refusals.append(Refusal(name, "cancel", reason))
            continue
        for c in consumers:
            _untie(model, c, surgery)
            _fold_into(model, c, facts.multiplier(module), None)
        _set_identity(module, facts)
        surgery.swaps.append(Swap(name, SwapKind.IDENTITY))
        surgery.changes.append(
            Change(
                name,
                "deleted",
                f"gain -> {', '.join(consumers)}; each output is "
                "normalised again, which removes the per-token scale (eps aside)",
            )
        )
    if not surgery.changes and not surgery.refusals:
        surgery.notes.append(_nothing_to_cancel(flow, norms))
    return surgery


def _nothing_to_cancel(flow: Dataflow, norms: dict[str, NormFacts]) -> str:
    """Why no norm could be cancelled: no projection output is normalised again (no QK-norm), or it is, but what
    feeds those projections is no norm (the stream itself, as in a norm-after placement)."""
    renormed = sorted(
        {
            c.module
            for c in flow.calls
            if c.module is not None and c.outputs and linear_kind(flow.submodule(c.module)) is not None
            and flow.reaches_norm(c.outputs[0], norms) is not None
        }
    )  # fmt: skip
    if not renormed:
        return "no linear layer's output is normalised again (no QK-norm): nothing to cancel"
    shown = ", ".join(renormed[:4]) + (f" and {len(renormed) - 4} more" if len(renormed) > 4 else "")
    return (
        f"the outputs of {shown} are normalised again (QK-norm), but no norm feeds those projections: they read "
        "the un-normalised stream (no pre-attention norm, as in a res-post placement), so there is nothing to cancel"
    )
