"""Rescaling at the attention value path (essay §6: massive activations are norm-mediated; interventions that
suppress them without removing the sink, V-scale among them, are said to improve quantization robustness).

:func:`v_scale` is the inference-time, function-preserving rescale: per channel ``j`` of ``v_proj``'s output, row
``j`` of ``v_proj`` (and its bias) is divided by ``s_j`` and every column of ``o_proj`` that reads channel ``j`` is
multiplied by ``s_j``. Per head the attention output is ``softmax(Q K^T) V`` with the probabilities independent of
``V``, so ``softmax(Q K^T) (V diag(1/s)) diag(s) W_o^T`` is the same function: exact up to rounding. With grouped-
query attention (``num_key_value_heads < num_attention_heads``) kv head ``k`` is read by the ``n_rep`` query heads
``k * n_rep .. (k + 1) * n_rep - 1`` (transformers' ``repeat_kv``), so the ``o_proj`` columns of each of them get
the same ``s``. The head layout is read from the config (``num_attention_heads``, ``num_key_value_heads``,
``head_dim``) and checked against the layers' shapes.

The argument holds for the textbook attention; a model may do more to ``V`` (a norm over V, a gate). So each
rescaled attention module is also run on the text before and after, one at a time, and refused (reverted) when its
output moves by more than rounding: the pairing is verified on the text, and the whole model's logits are compared
in :attr:`VScaling.max_logit_diff`. The quantization effect is measured, never assumed: the per-tensor int8 error of
``v_proj``'s output and of ``o_proj``'s input, and the per-output-channel int8 error of ``o_proj``'s weight, before
and after.

A gated-rescaling variant (a learned gate on the attention output) is a training-time architecture change: it
changes the function, so it cannot be applied exactly to a trained model and is not offered here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .outliers import _capture, max_logit_diff, quant_error, record

__all__ = ["VScaling", "head_layout", "v_scale"]


@dataclass
class VScaling:
    """The rescaled copy (``model``), one row per attention module rescaled, one refusal per module not, and the
    largest ``|logit|`` difference between the original and the copy on the text."""

    model: nn.Module
    alpha: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    refusals: list[dict[str, str]] = field(default_factory=list)
    max_logit_diff: float = float("nan")


def head_layout(model: nn.Module) -> tuple[int, int, int]:
    """``(num_attention_heads, num_key_value_heads, head_dim)`` from the model's (text) config; a missing
    ``num_key_value_heads`` means one kv head per query head, a missing ``head_dim`` ``hidden_size // heads``."""
    cfg: Any = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    heads = getattr(cfg, "num_attention_heads", None)
    if not isinstance(heads, int) or heads <= 0:
        raise ValueError(
            f"{type(model).__name__}: the config has no num_attention_heads, so the head layout is unknown"
        )
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or getattr(cfg, "hidden_size", 0) // heads
    if not isinstance(kv, int) or heads % kv:
        raise ValueError(f"{type(model).__name__}: num_attention_heads={heads} is not a multiple of "
                         f"num_key_value_heads={kv!r}")  # fmt: skip
    if not isinstance(hd, int) or hd <= 0:
        raise ValueError(f"{type(model).__name__}: the config gives no head_dim or hidden_size")
    return heads, kv, hd


def _candidates(model: nn.Module) -> list[str]:
    """Modules holding a ``v_proj`` and an ``o_proj`` linear layer (transformers' attention convention)."""
    return [
        n
        for n, m in model.named_modules()
        if isinstance(getattr(m, "v_proj", None), nn.Linear) and isinstance(getattr(m, "o_proj", None), nn.Linear)
    ]


def _refusal(model: nn.Module, name: str, layout: tuple[int, int, int]) -> str | None:
    heads, kv, hd = layout
    att: Any = model.get_submodule(name)
    v, o = att.v_proj, att.o_proj
    own = getattr(att, "head_dim", hd)
    if own != hd:
        return f"its head_dim {own} differs from the config's {hd}"
    if v.out_features != kv * hd:
        return f"v_proj has {v.out_features} outputs, not num_key_value_heads x head_dim = {kv} x {hd}"
    if o.in_features != heads * hd:
        return f"o_proj has {o.in_features} inputs, not num_attention_heads x head_dim = {heads} x {hd}"
    params = list(model.named_parameters(remove_duplicate=False))
    for part in ("v_proj", "o_proj"):
        p = getattr(att, part).weight
        owners = [n for n, q in params if q is p]
        if len(owners) > 1:
            return f"{part}.weight is shared with {', '.join(x for x in owners if x != f'{name}.{part}.weight')}"
    return None


def _outputs(model: nn.Module, names: list[str], ids: Tensor) -> dict[str, Tensor]:
    """Each named module's first output on one forward (its inputs may be keyword arguments)."""
    seen = record(model, names, ids, lambda args, y: y.detach() if isinstance(y, Tensor) else None)
    return {n: torch.cat(v, 1) for n, v in seen.items() if v}


def _w_error(w: Tensor) -> float:
    """Per-output-channel int8 error of a linear weight ``(out, in)``: one absmax scale per row."""
    return quant_error(w.T, "int8", "channel")


@torch.no_grad()
def _apply(att: Any, s: Tensor, n_rep: int, hd: int) -> None:
    """``v_proj`` rows (and bias) divided by ``s``, ``o_proj`` columns of every query head times ``s``."""
    kv = s.numel() // hd
    s_o = s.view(kv, 1, hd).expand(kv, n_rep, hd).reshape(-1)
    v, o = att.v_proj, att.o_proj
    v.weight.copy_((v.weight.double() / s[:, None]).to(v.weight.dtype))
    if v.bias is not None:
        v.bias.copy_((v.bias.double() / s).to(v.bias.dtype))
    o.weight.copy_((o.weight.double() * s_o[None, :]).to(o.weight.dtype))


@torch.no_grad()
def v_scale(model: nn.Module, ids: Tensor, alpha: float = 0.5, strict: bool = True) -> VScaling:
    """A copy of ``model`` with every attention module's value path rescaled: ``s_j = max|v_j|^alpha /
    max|W_o[:, c(j)]|^(1-alpha)`` (SmoothQuant's balance; ``v`` the ``v_proj`` output on ``ids``, ``c(j)`` the
    ``o_proj`` columns that read channel ``j`` through every query head sharing its kv head).

    A module whose pairing cannot be shown (shapes against the config's head layout, a shared weight, or an output
    that moves on ``ids``) raises a ``ValueError`` naming it and the reason; with ``strict=False`` it is recorded
    in :attr:`VScaling.refusals` and left as it was."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    names = _candidates(model)
    if not names:
        raise ValueError(f"{type(model).__name__}: no module holds a v_proj and an o_proj linear layer")
    layout = head_layout(model)
    heads, kv, hd = layout
    n_rep = heads // kv
    stock = copy.deepcopy(model).eval()
    result = VScaling(stock, alpha)

    def refuse(name: str, reason: str) -> None:
        if strict:
            raise ValueError(f"v_scale refuses {name}: {reason}")
        result.refusals.append({"site": name, "reason": reason})

    ok = []
    for n in names:
        reason = _refusal(stock, n, layout)
        if reason is None:
            ok.append(n)
        else:
            refuse(n, reason)
    parts = [f"{n}.{p}" for n in ok for p in ("v_proj", "o_proj")]
    before = _capture(stock, parts, ids)
    att_out = _outputs(stock, ok, ids)
    eps = torch.finfo(next(stock.parameters()).dtype).eps
    done: dict[str, tuple[Tensor, Tensor]] = {}
    for n in ok:
        if n not in att_out or f"{n}.v_proj" not in before or f"{n}.o_proj" not in before:
            refuse(n, "not run on the text")
            continue
        att: Any = stock.get_submodule(n)
        v_out = before[f"{n}.v_proj"][1].double()
        # o_proj: (hidden, heads * hd); column h * hd + d reads kv channel (h // n_rep) * hd + d
        w_o = att.o_proj.weight.double()
        w_max = w_o.abs().amax(0).view(kv, n_rep, hd).amax(1).reshape(-1)
        v_max = v_out.abs().reshape(-1, v_out.shape[-1]).amax(0)
        s = v_max.pow(alpha) / w_max.pow(1 - alpha)
        s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
        params = [p for p in (att.v_proj.weight, att.v_proj.bias, att.o_proj.weight) if p is not None]
        saved = [p.detach().clone() for p in params]
        w_before = saved[-1]
        _apply(att, s, n_rep, hd)
        y0 = att_out[n].double()
        y1 = _outputs(stock, [n], ids)[n].double()
        moved = float((y1 - y0).abs().max())
        bound = 1e4 * eps * float(y0.abs().max().clamp_min(1e-300))
        if moved > bound:
            with torch.no_grad():
                for p, old in zip(params, saved, strict=True):
                    p.copy_(old)  # bit for bit, not through 1 / s
            refuse(n, f"its output moved by {moved:.3g} (rounding bound {bound:.3g}): V is not read linearly per head")
            continue
        done[n] = (s, w_before)
    after = _capture(stock, [f"{n}.{p}" for n in done for p in ("v_proj", "o_proj")], ids)
    for n, (s, w_before) in done.items():
        att = stock.get_submodule(n)
        result.rows.append(
            {
                "site": n,
                "heads": f"{heads}q/{kv}kv x {hd}",
                "v_int8_before": quant_error(before[f"{n}.v_proj"][1], "int8", "tensor"),
                "v_int8_after": quant_error(after[f"{n}.v_proj"][1], "int8", "tensor"),
                "o_in_int8_before": quant_error(before[f"{n}.o_proj"][0], "int8", "tensor"),
                "o_in_int8_after": quant_error(after[f"{n}.o_proj"][0], "int8", "tensor"),
                "o_w_int8_before": _w_error(w_before),
                "o_w_int8_after": _w_error(att.o_proj.weight),
                "s_min": float(s.min()),
                "s_max": float(s.max()),
            }
        )
    result.max_logit_diff = max_logit_diff(model, stock, ids)
    return result
