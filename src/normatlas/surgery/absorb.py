"""Absorbing post-branch RMSNorms at inference by freezing their statistic (Pangu's Depth-Scaled Sandwich-Norm).

A norm on a sublayer's branch output (the inspector's :attr:`~normatlas.vocabulary.SiteRole.OUT`, OLMo 2's and
Gemma 2's ``post_*_layernorm``) computes ``m * y / d(y)``: the gain ``m`` (``w`` or ``1 + w``, the inspector's typed
``gain_convention``) times ``y`` over a per-token divisor ``d(y) = sqrt(mean(y^2) + eps)``. That is not a linear map,
so it cannot be folded exactly. The absorbable form freezes the statistic: on calibration inputs each norm's
divisor is measured per token as it runs (``d = |m y|^2 / <m y, norm(y)>``), its mean over tokens ``r`` becomes a
constant, and ``y * (m / r)`` is folded into the branch's last linear layer (its output rows and bias scaled by
``m / r``), so the norm disappears (a runtime identity swap).

What is proven, and what is not:

* exact: the absorbed model equals the *frozen-statistic* model (:meth:`Absorption.reference`: each norm replaced
  by ``y * (m / r)``), to rounding (a float64 model: ~1e-16 relative). :func:`run_checks` against that reference is
  the surgery's proof, as for every other surgery;
* approximate: against the original model, which divides each token by its own ``d(y)``. The spread of ``d`` over
  calibration tokens (its coefficient of variation, per norm) says how far; :func:`approximation` measures the max
  logit difference and the loss change on held-out text. Nothing here claims the two agree.

Refused, with the module and the reason: a norm that centres (a LayerNorm) or has a bias, whose input is not the
direct output of a linear layer read by nothing else, whose linear layer is called more than once or has a weight
shared with another parameter (a tied matrix), or that is called more than once per forward.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..analysis.flow import Dataflow, linear_kind
from ..analysis.flow import record_flow as record
from ..spec import GainConvention
from ..vocabulary import Operator, SiteRole
from .fold import _shared
from .norms import find_norms
from .report import Change, Refusal, Surgery, Swap, SwapKind
from .verify import model_output

__all__ = ["Absorption", "FrozenStatNorm", "PostNormStat", "absorb_post_norms", "approximation"]


class FrozenStatNorm(nn.Module):
    """A post-branch norm with its statistic frozen: ``y * scale`` with ``scale = m / r`` (float64 buffer)."""

    scale: Tensor

    def __init__(self, scale: Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", scale.detach().double().clone())

    def forward(self, y: Tensor) -> Tensor:
        return y * self.scale.to(y.dtype)


@dataclass(frozen=True)
class PostNormStat:
    """One absorbed norm: the linear layer it went into, its frozen divisor ``rms`` (mean over calibration tokens)
    and that divisor's spread over those tokens (``cv``: standard deviation / mean; 0 would make it exact)."""

    norm: str
    layer: int | None
    linear: str
    rms: float
    cv: float
    rms_min: float
    rms_max: float
    tokens: int


@dataclass
class Absorption(Surgery):
    """A :class:`Surgery` that also carries each norm's calibration and the frozen scales ``m / r``."""

    stats: list[PostNormStat] = field(default_factory=list)
    scales: dict[str, Tensor] = field(default_factory=dict, repr=False)
    approximation: dict[str, float] = field(default_factory=dict)  # filled by the caller (see :func:`approximation`)

    def reference(self, model: nn.Module) -> nn.Module:
        """The frozen-statistic model the proof compares with: a copy of ``model`` (the original, any dtype) with
        every absorbed norm replaced by ``y * (m / r)``."""
        frozen = copy.deepcopy(model).eval()
        for name, scale in self.scales.items():
            frozen.set_submodule(name, FrozenStatNorm(scale))
        return frozen

    def manifest(self) -> dict[str, Any]:
        d = super().manifest()
        d["calibration"] = [asdict(s) for s in self.stats]
        d["approximation"] = dict(self.approximation)
        return d


def _target(flow: Dataflow, norm: str) -> tuple[str | None, str | None]:
    """(the linear layer whose output is ``norm``'s only input and which nothing else reads, None) or (None, why)."""
    calls = flow.module_calls(norm)
    if len(calls) != 1:
        return None, f"it runs {len(calls)} times per forward (a shared module), so one constant cannot stand for it"
    src = flow.producer_of(calls[0].inputs[0])
    what = "a model input" if src is None else src.label
    kind = linear_kind(flow.submodule(src.module)) if src is not None and src.module is not None else None
    if src is None or kind not in ("linear", "conv1d_t"):
        return None, f"its input comes from {what}, not a linear layer, so there is no weight to scale"
    lin = src.module
    assert lin is not None
    if len(flow.module_calls(lin)) != 1:
        return None, f"{lin} runs more than once per forward, so its weights cannot carry this norm alone"
    out = src.outputs[0]
    readers = [c.label for c in flow.consumers(out) if c.module != norm]
    if readers or flow.escapes(out):
        who = ", ".join(readers) or "the model output"
        return None, f"{lin}'s output is also read by {who}, so scaling its weights would change that reader too"
    return lin, None


def _refusal(info: Any, flow: Dataflow, model: nn.Module, gain_param: str | None) -> tuple[str | None, str | None]:
    """(the target linear, None) or (None, why ``info``'s norm cannot be absorbed), from the inspector's fields."""
    if info.operator is not Operator.RMSNORM:
        kind = "it subtracts the mean (a LayerNorm)" if info.operator is Operator.LAYERNORM else "it is not an RMSNorm"
        return None, f"operator {info.operator.value}: {kind}; only y * m / rms(y) can be absorbed"
    if info.bias:
        return None, "it has a bias, which a frozen scale cannot carry into the linear layer's rows"
    if info.gain_convention is not None and gain_param is None:
        return None, "its gain parameter could not be identified by the probe"
    lin, why = _target(flow, info.module)
    if lin is None:
        return None, why
    weight: Any = model.get_submodule(lin).weight
    owners = _shared(model, weight)
    if len(owners) > 1:
        others = ", ".join(o for o in owners if not o.startswith(lin + "."))
        return None, f"{lin}.weight is shared with {others} (tied), so scaling it would change those too"
    return lin, None


def _inputs_list(calibration_inputs: Any) -> list[Any]:
    if isinstance(calibration_inputs, list):
        if not calibration_inputs:
            raise ValueError("calibration_inputs=[] is empty; pass at least one model input (ids, tuple or dict)")
        return calibration_inputs
    return [calibration_inputs]


@torch.no_grad()
def _divisors(model: nn.Module, norms: dict[str, Tensor], calibration_inputs: list[Any]) -> dict[str, Tensor]:
    """Per norm, its divisor ``d`` per calibration token, measured as the norm runs: ``|m y|^2 / <m y, norm(y)>``."""
    seen: dict[str, list[Tensor]] = {n: [] for n in norms}

    def hook(name: str) -> Any:
        def run(_: nn.Module, args: tuple[Any, ...], out: Tensor) -> None:
            m = norms[name]
            my = (args[0].double() * m).flatten(0, -2)
            o = out.double().flatten(0, -2)
            d = my.pow(2).sum(-1) / (my * o).sum(-1)
            seen[name].append(d[torch.isfinite(d) & (d > 0)])  # a token with y = 0 has no divisor to measure

        return run

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in norms]
    try:
        for x in calibration_inputs:
            model_output(model, x)
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


@torch.no_grad()
def _scale_rows(model: nn.Module, lin_name: str, s: Tensor) -> None:
    """``lin``'s output multiplied by ``s`` per feature: weight rows (columns of a Conv1D) and bias."""
    lin: Any = model.get_submodule(lin_name)
    w = lin.weight.double()
    w = w * s[:, None] if linear_kind(lin) == "linear" else w * s[None, :]
    lin.weight.copy_(w.to(lin.weight.dtype))
    if lin.bias is not None:
        lin.bias.copy_((lin.bias.double() * s).to(lin.bias.dtype))


def absorb_post_norms(
    model: nn.Module, example_inputs: Any, calibration_inputs: Any, *, strict: bool = True
) -> Absorption:
    """Absorb every post-branch RMSNorm of (a copy of) ``model`` into the linear layer before it, its statistic
    frozen at its mean over ``calibration_inputs`` (one model input, or a list of them).

    Which norms are post-branch, their operator, bias and gain convention come from
    :func:`normatlas.inspect.inspect_model` on ``example_inputs``; the linear layer from the recorded dataflow.
    ``strict`` raises a ValueError naming every refused norm and its reason; ``strict=False`` records them as
    refusals and absorbs the rest. Prove the result with ``run_checks(surgery.reference(model), surgery, inputs)``
    (exact, to rounding) and measure its distance to ``model`` with :func:`approximation`.
    """
    from ..inspect import inspect_model

    if not isinstance(strict, bool):
        raise TypeError(f"strict={strict!r} must be a bool")
    calibration = _inputs_list(calibration_inputs)
    stock = copy.deepcopy(model).eval()
    surgery = Absorption("absorb", stock, stock_equivalent=False)
    report = inspect_model(stock, example_inputs)
    outs = [n for n in report.norms if n.role is SiteRole.OUT]
    if not outs:
        surgery.notes.append("the inspector found no norm on a sublayer's branch output (role out): nothing to absorb")
        return surgery
    flow = record(stock, example_inputs)
    facts = find_norms(flow)
    plan: dict[str, tuple[str, Tensor, Any]] = {}
    for info in outs:
        f = facts.get(info.module)
        gain_param = f.gain_param if f is not None else None
        lin, why = _refusal(info, flow, stock, gain_param)
        if lin is None:
            surgery.refusals.append(Refusal(info.module, "absorb", why or "not absorbable"))
            continue
        module = stock.get_submodule(info.module)
        if gain_param is None:
            m = torch.ones(flow.tensor(flow.module_calls(info.module)[0].inputs[0]).shape[-1], dtype=torch.float64)
        else:
            w = getattr(module, gain_param).detach().double()
            m = w + 1 if info.gain_convention is GainConvention.ONE_PLUS_W else w
        plan[info.module] = (lin, m, (info, gain_param))
    if strict and surgery.refusals:
        raise ValueError(
            "cannot absorb every post-branch norm: "
            + "; ".join(f"{r.target}: {r.reason}" for r in surgery.refusals)
            + " (strict=False absorbs the others)"
        )
    divisors = _divisors(stock, {n: p[1] for n, p in plan.items()}, calibration)
    for name, (lin, m, (info, gain_param)) in plan.items():
        d = divisors[name]
        if d.numel() == 0:
            raise ValueError(f"{name}: no calibration token has a nonzero input, so its rms cannot be measured")
        r = float(d.mean())
        cv = float(d.std(unbiased=False) / d.mean())
        s = m / r
        _scale_rows(stock, lin, s)
        if gain_param is not None:  # the norm is swapped for identity at runtime; its saved gain says so
            identity = 0.0 if info.gain_convention is GainConvention.ONE_PLUS_W else 1.0
            with torch.no_grad():
                getattr(stock.get_submodule(name), gain_param).fill_(identity)
        surgery.scales[name] = s
        surgery.swaps.append(Swap(name, SwapKind.IDENTITY))
        stat = PostNormStat(name, info.layer, lin, r, cv, float(d.min()), float(d.max()), d.numel())
        surgery.stats.append(stat)
        surgery.changes.append(
            Change(name, "absorbed", f"m / {r:.4g} -> {lin} (rms over {d.numel()} tokens: cv {cv:.3g})")
        )
    if plan:
        surgery.notes.append(
            "approximate: each absorbed norm divides by its calibration mean rms instead of each token's own; the "
            "proof compares with that frozen-statistic model (exact), not with the original"
        )
    return surgery


@torch.no_grad()
def approximation(original: nn.Module, absorbed: nn.Module, ids: Tensor) -> dict[str, float]:
    """How far the absorbed model is from ``original`` on token windows ``ids`` (B, T) of held-out text: the max
    absolute logit difference (and the largest logit, for scale), top-1 agreement, and the next-token loss (nats per
    token) of each and its change."""
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
        raise TypeError(f"ids must be an int64 tensor (batch, tokens), got {type(ids).__name__}")
    ref, _ = model_output(original.eval(), {"input_ids": ids})
    out, _ = model_output(absorbed.eval(), {"input_ids": ids})
    ref, out = ref.double(), out.double()

    def loss(logits: Tensor) -> float:
        return float(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))

    before, after = loss(ref), loss(out)
    return {
        "max_logit_diff": float((out - ref).abs().max()),
        "max_logit": float(ref.abs().max()),
        "top1": float((out.argmax(-1) == ref.argmax(-1)).double().mean()),
        "loss_before": before,
        "loss_after": after,
        "loss_change": after - before,
        "tokens": float(ids.numel()),
    }
