"""Rescaling at the attention value path (essay §6: massive activations are norm-mediated; interventions that
suppress them without removing the sink, V-scale among them, are said to improve quantization robustness).

:func:`v_scale` is the inference-time, function-preserving rescale: per channel ``j`` of the value projection's
output, its row ``j`` (and bias) is divided by ``s_j`` and every input column of the output projection that reads
channel ``j`` is multiplied by ``s_j``. Per head the attention output is ``softmax(Q K^T) V`` with the probabilities
independent of ``V``, so ``softmax(Q K^T) (V diag(1/s)) diag(s) W_o^T`` is the same function: exact up to rounding.
With grouped-query attention kv head ``k`` is read by the ``n_rep`` query heads ``k * n_rep .. (k + 1) * n_rep - 1``,
so the output-projection columns of each of them get the same ``s``.

Nothing here is read from a module's or parameter's name. The value and output projections and the head layout come
from the library's own dataflow reading of the model, :func:`normatlas.port.core.port`: each layer's
``layers.<i>.attn.v_proj.weight`` / ``.bias`` and ``layers.<i>.attn.o_proj.weight`` :class:`~normatlas.port.core.Link`
names the source tensor, whether it is stored transposed (GPT-2's ``Conv1D``) and which of its rows are V (a fused
QKV projection: GPT-2's ``c_attn``, Phi-3's ``qkv_proj``, GPT-NeoX's per-head interleaved ``query_key_value``), and
the port's :class:`~normatlas.blocks.ModelConfig` gives ``n_heads``, ``n_kv_heads`` (or ``layer_kv_heads``) and
``head_dim``, the layout our attention (``repeat_interleave`` of the kv heads) was checked to compute. Exactly the V
rows of the source tensor are divided, the other rows of a fused tensor are left bit for bit.

The argument holds for the textbook attention; a model may do more to ``V``. A norm over V (the port's ``v_norm``,
a QKV-norm placement) or MLA's latent V is refused from the port's config; anything the port did not see is caught
on the text: each rescaled layer is run before and after, one at a time, at the smallest module holding both
projections, and reverted (refused) when its output moves by more than rounding. The whole model's logits are
compared in :attr:`VScaling.max_logit_diff`. The quantization effect is measured, never assumed: the per-tensor
int8 error of the V output (the V columns of a fused projection's output) and of the output projection's input,
and the per-output-channel int8 error of the output projection's weight, before and after.

A gated-rescaling variant (a learned gate on the attention output) is a training-time architecture change: it
changes the function, so it cannot be applied exactly to a trained model and is not offered here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .outliers import _capture, max_logit_diff, quant_error, record

if TYPE_CHECKING:
    from ..blocks.model import ModelConfig
    from ..port.core import Link, Port

__all__ = ["VScaling", "head_layout", "v_scale"]


@dataclass
class VScaling:
    """The rescaled copy (``model``), one row per layer rescaled, one refusal per layer not, and the largest
    ``|logit|`` difference between the original and the copy on the text. A row's and a refusal's ``site`` is the
    smallest module holding both projections (the attention module)."""

    model: nn.Module
    alpha: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    refusals: list[dict[str, str]] = field(default_factory=list)
    max_logit_diff: float = float("nan")


@dataclass(frozen=True)
class _Path:
    """One layer's value path in the source model: the port's links and the head layout."""

    layer: int
    site: str
    v_weight: Link | None
    v_bias: Link | None
    o_weight: Link | None
    heads: int
    kv: int
    hd: int

    @property
    def v(self) -> Link:
        """The value projection's weight link (set on every path that passed :func:`_refusal`)."""
        assert self.v_weight is not None
        return self.v_weight

    @property
    def o(self) -> Link:
        """The output projection's weight link (set on every path that passed :func:`_refusal`)."""
        assert self.o_weight is not None
        return self.o_weight


def _port(model: nn.Module) -> tuple[Port, nn.Module]:
    """The port of ``model`` (its links and config), or a ``ValueError`` saying the port cannot read it and why."""
    from ..port.core import port

    try:
        return port(model, check=False)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"v_scale: the port cannot read {type(model).__name__}, so its value and output projections are not "
            f"known: {exc}"
        ) from exc


def _layout(cfg: ModelConfig, layer: int) -> tuple[int, int, int]:
    """``(n_heads, n_kv_heads, head_dim)`` of one layer of a port's config."""
    heads = int(cfg.n_heads)
    kv = cfg.layer_kv_heads[layer] if cfg.layer_kv_heads is not None else cfg.n_kv_heads
    kv = heads if kv is None else int(kv)
    hd = int(cfg.head_dim) if cfg.head_dim is not None else int(cfg.d_model) // heads
    return heads, kv, hd


def head_layout(model: nn.Module, layer: int = 0) -> tuple[int, int, int]:
    """``(n_heads, n_kv_heads, head_dim)`` of ``layer`` as the port reads it off the model's dataflow (not from
    its config's field names): the layout :func:`v_scale` rescales with."""
    p, ours = _port(model)
    del ours
    if not 0 <= layer < p.config.n_layers:
        raise ValueError(f"layer={layer} is out of range: the model has {p.config.n_layers} layers")
    return _layout(p.config, layer)


def _owner(name: str) -> str:
    """The module a registered parameter name belongs to."""
    return name.rpartition(".")[0]


def _site(names: list[str]) -> str:
    """The smallest module holding every named parameter (their owners' common ancestor in the module tree)."""
    parts = [_owner(n).split(".") for n in names]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _paths(p: Port) -> list[_Path]:
    by = {link.ours: link for link in p.links}
    out = []
    for i in range(p.config.n_layers):
        pre = f"layers.{i}.attn."
        vw, vb, ow = (by.get(pre + k) for k in ("v_proj.weight", "v_proj.bias", "o_proj.weight"))
        mine = [link.theirs[0] for link in p.links if link.ours.startswith(pre)]
        if vw is not None and ow is not None:  # a tensor with several names: the pair closest in the module tree
            site = max((_site([a, b]) for a in vw.theirs for b in ow.theirs), key=lambda x: len(x.split(".")))
        else:
            site = _site(mine) if mine else f"layer {i}"
        out.append(_Path(i, site, vw, vb, ow, *_layout(p.config, i)))
    return out


def _matrix(model: nn.Module, link: Link) -> Tensor:
    """The source tensor of ``link`` in our layout (``(out, in)`` for a weight), a view sharing its storage."""
    t = model.get_parameter(link.theirs[0]).detach()
    return t.transpose(-2, -1) if link.transpose else t


def _rows(link: Link, n: int) -> Tensor:
    return torch.tensor(link.rows) if link.rows is not None else torch.arange(n)


def _refusal(model: nn.Module, cfg: ModelConfig, path: _Path, links: tuple[Link, ...]) -> str | None:
    """Why ``path`` cannot be rescaled exactly, or None."""
    i, heads, kv, hd = path.layer, path.heads, path.kv, path.hd
    if cfg.mla is not None:
        return "MLA: V is part of the shared latent's up-projection (kv_b_proj), not a value projection of its own"
    if cfg.v_norm is not None or cfg.plan(i)[0].qkv_norm:
        return "a norm over V (the port reads v_norm or a QKV-norm placement) reads V nonlinearly"
    if path.v_weight is None or path.o_weight is None:
        return "the port links no value projection and output projection for this layer"
    w_v, w_o = _matrix(model, path.v_weight), _matrix(model, path.o_weight)
    if w_v.dim() != 2 or path.v_weight.axis != 0 or (path.v_bias is not None and path.v_bias.axis != 0):
        return f"the value projection {path.v_weight.theirs[0]} is not a matrix whose rows are V ({tuple(w_v.shape)})"
    n_v = len(_rows(path.v_weight, w_v.shape[0]))
    if n_v != kv * hd:
        return f"the value projection has {n_v} V rows, not n_kv_heads x head_dim = {kv} x {hd}"
    if w_o.dim() != 2 or path.o_weight.rows is not None:
        return f"the output projection {path.o_weight.theirs[0]} is fused with another ({tuple(w_o.shape)})"
    if w_o.shape[1] != heads * hd:
        return f"the output projection has {w_o.shape[1]} inputs, not n_heads x head_dim = {heads} x {hd}"
    for role, link in (
        ("v_proj.weight", path.v_weight),
        ("v_proj.bias", path.v_bias),
        ("o_proj.weight", path.o_weight),
    ):
        if link is None:
            continue
        if len(link.theirs) > 1:
            return f"{role} is shared with {', '.join(link.theirs[1:])} (one tensor, {link.theirs[0]})"
        mine = set(_rows(link, _matrix(model, link).shape[0]).tolist()) if role.startswith("v") else None
        for other in links:
            if other is link or other.theirs[0] != link.theirs[0]:
                continue
            theirs = set(_rows(other, _matrix(model, other).shape[other.axis]).tolist())
            if mine is None or other.axis != 0 or mine & theirs:
                return f"{role} ({link.theirs[0]}) is also read as {other.ours}"
    return None


def _outputs(model: nn.Module, names: list[str], ids: Tensor) -> dict[str, Tensor]:
    """Each named module's first output on one forward (its inputs may be keyword arguments)."""
    seen = record(model, names, ids, lambda args, y: y.detach() if isinstance(y, Tensor) else None)
    return {n: torch.cat(v, 1) for n, v in seen.items() if v}


def _w_error(w: Tensor) -> float:
    """Per-output-channel int8 error of a linear weight ``(out, in)``: one absmax scale per row."""
    return quant_error(w.T, "int8", "channel")


@torch.no_grad()
def _apply(model: nn.Module, path: _Path, s: Tensor) -> None:
    """The V rows of the value projection (and its bias) divided by ``s``, the output projection's input columns of
    every query head times its kv head's ``s``; in the source tensors' own layout (fused, transposed or not)."""
    n_rep = path.heads // path.kv
    s_o = s.view(path.kv, 1, path.hd).expand(path.kv, n_rep, path.hd).reshape(-1)
    for link in (path.v, path.v_bias):
        if link is None:
            continue
        t = _matrix(model, link)
        r = _rows(link, t.shape[0]).to(t.device)
        part = t.index_select(0, r).double()
        part = part / (s[:, None] if part.dim() == 2 else s)
        t.index_copy_(0, r, part.to(t.dtype))
    w_o = _matrix(model, path.o)
    w_o.copy_((w_o.double() * s_o[None, :]).to(w_o.dtype))


def _v_out(captured: dict[str, tuple[Tensor, Tensor]], path: _Path, width: int) -> Tensor | None:
    """The V part of the value projection's output (its V columns when fused), or None when not seen."""
    got = captured.get(_owner(path.v.theirs[0]))
    if got is None or got[1].shape[-1] != width:
        return None
    return got[1].index_select(-1, _rows(path.v, width).to(got[1].device))


def _o_in(captured: dict[str, tuple[Tensor, Tensor]], path: _Path, width: int) -> Tensor | None:
    got = captured.get(_owner(path.o.theirs[0]))
    return got[0] if got is not None and got[0].shape[-1] == width else None


@torch.no_grad()
def v_scale(model: nn.Module, ids: Tensor, alpha: float = 0.5, strict: bool = True) -> VScaling:
    """A copy of ``model`` with every layer's attention value path rescaled: ``s_j = max|v_j|^alpha /
    max|W_o[:, c(j)]|^(1-alpha)`` (SmoothQuant's balance; ``v`` the value projection's V output on ``ids``, ``c(j)``
    the output-projection columns that read channel ``j`` through every query head sharing its kv head).

    The projections and the head layout come from the port's reading of the model (see the module docstring); a
    model the port cannot read raises a ``ValueError`` with the port's reason. A layer whose pairing cannot be
    shown (MLA, a norm over V, a shared or otherwise read tensor, or an output that moves on ``ids``) raises a
    ``ValueError`` naming its attention module and the reason; with ``strict=False`` it is recorded in
    :attr:`VScaling.refusals` and left as it was. The port builds a second copy of the weights while it reads."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    stock = copy.deepcopy(model).eval()
    p, ours = _port(stock)
    del ours
    result = VScaling(stock, alpha)

    def refuse(path: _Path, reason: str) -> None:
        if strict:
            raise ValueError(f"v_scale refuses {path.site}: {reason}")
        result.refusals.append({"site": path.site, "reason": reason})

    ok = []
    for path in _paths(p):
        reason = _refusal(stock, p.config, path, p.links)
        if reason is None:
            ok.append(path)
        else:
            refuse(path, reason)
    owners = list(dict.fromkeys(_owner(link.theirs[0]) for q in ok for link in (q.v, q.o)))
    before = _capture(stock, owners, ids)
    att_out = _outputs(stock, list(dict.fromkeys(q.site for q in ok)), ids)
    eps = torch.finfo(next(stock.parameters()).dtype).eps
    done: list[tuple[_Path, Tensor, Tensor]] = []
    for path in ok:
        w_o = _matrix(stock, path.o)
        v_width = _matrix(stock, path.v).shape[0]
        v_out, o_in = _v_out(before, path, v_width), _o_in(before, path, w_o.shape[1])
        if path.site not in att_out or v_out is None or o_in is None:
            refuse(path, "the projections' modules were not run on the text as the projections")
            continue
        n_rep = path.heads // path.kv
        # o columns (heads * hd,): column h * hd + d reads kv channel (h // n_rep) * hd + d
        w_max = w_o.double().abs().amax(0).view(path.kv, n_rep, path.hd).amax(1).reshape(-1)
        v_max = v_out.double().abs().reshape(-1, v_out.shape[-1]).amax(0)
        s = v_max.pow(alpha) / w_max.pow(1 - alpha)
        s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
        params = [
            stock.get_parameter(link.theirs[0])
            for link in (path.v_weight, path.v_bias, path.o_weight)
            if link is not None
        ]
        saved = [t.detach().clone() for t in params]
        w_before = w_o.detach().clone()
        _apply(stock, path, s)
        y0 = att_out[path.site].double()
        y1 = _outputs(stock, [path.site], ids)[path.site].double()
        moved = float((y1 - y0).abs().max())
        bound = 1e4 * eps * float(y0.abs().max().clamp_min(1e-300))
        if moved > bound:
            for t, old in zip(params, saved, strict=True):
                t.detach().copy_(old)  # bit for bit, not through 1 / s
            refuse(
                path, f"its output moved by {moved:.3g} (rounding bound {bound:.3g}): V is not read linearly per head"
            )
            continue
        done.append((path, s, w_before))
    owners = list(dict.fromkeys(_owner(link.theirs[0]) for q, _, _ in done for link in (q.v, q.o)))
    after = _capture(stock, owners, ids)
    for path, s, w_before in done:
        w_o = _matrix(stock, path.o)
        v_width = _matrix(stock, path.v).shape[0]
        v0, v1 = _v_out(before, path, v_width), _v_out(after, path, v_width)
        o0, o1 = _o_in(before, path, w_o.shape[1]), _o_in(after, path, w_o.shape[1])
        assert v0 is not None and v1 is not None and o0 is not None and o1 is not None
        result.rows.append(
            {
                "site": path.site,
                "heads": f"{path.heads}q/{path.kv}kv x {path.hd}",
                "v_int8_before": quant_error(v0, "int8", "tensor"),
                "v_int8_after": quant_error(v1, "int8", "tensor"),
                "o_in_int8_before": quant_error(o0, "int8", "tensor"),
                "o_in_int8_after": quant_error(o1, "int8", "tensor"),
                "o_w_int8_before": _w_error(w_before),
                "o_w_int8_after": _w_error(w_o),
                "s_min": float(s.min()),
                "s_max": float(s.max()),
            }
        )
    result.max_logit_diff = max_logit_diff(model, stock, ids)
    return result
