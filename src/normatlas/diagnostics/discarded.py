"""Rank deficiency: the directions a norm discards, and the share of the incoming gradient that falls in them.

The essay (§03, "The gradient is the interesting part"): the Jacobian of the normalised output
``x_hat = (x - mean) / sigma`` (before the affine gain) is ::

    LayerNorm:  J = (I - 1 1^T / D - x_hat x_hat^T / D) / sigma      rank D - 2   (null: 1, x_hat)
    RMSNorm:    J = (I - x_hat x_hat^T / D) / rms                     rank D - 1   (null: x_hat)

(eps = 0; with eps > 0 the x_hat direction keeps a singular value ``eps / (var + eps)`` times the others:
1e-5 for torch's default eps at unit variance, so the measured rank counts singular values above
:data:`RTOL` = 1e-4 of the largest; a token whose variance falls near ``eps / RTOL`` keeps x_hat).
``J`` is symmetric, so the backward ``g_x = J^T g`` drops the part of the gradient ``g`` arriving at the
normalised output that lies in ``span{1, x_hat}``: the *removed share*
``||P g|| / ||g||``.

* Closed form, float64: :func:`normaliser_jacobian`, :func:`discarded_basis`, :func:`removed_share`.
* Measured on any norm module, found by behaviour: :func:`measure_site` takes the module's Jacobian by autograd
  per token, divides out the gain the behavioural probe found (:func:`~normatlas.analysis.probe.probe`: which
  parameter multiplies, ``w`` or ``1 + w``), counts the singular values above ``rtol * max``
  (:func:`effective_rank`) and projects the real upstream gradient (times the gain: the gradient at the
  normalised output) off the Jacobian's range. No centring flag and no name is read.
* :class:`DiscardedDirections`: the same as a Monitor metric (per norm module: rank deficit, removed share).
* :func:`discarded_hf`: the same on a transformers checkpoint (default: the real all-MiniLM-L6-v2) and real
  sentences, the upstream gradient from a sentence-similarity loss.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..analysis.probe import NormFacts, probe
from .metric_base import Column, Hook, MonitorMetric, Row, Scope, first_tensor

__all__ = [
    "DiscardedDirections",
    "SiteDiscard",
    "discarded_basis",
    "discarded_hf",
    "effective_rank",
    "measure_site",
    "normaliser_jacobian",
    "removed_share",
]

RTOL = 1e-4  # a singular value below RTOL * the largest counts as discarded (passes < 1e-4 of the gradient)


def _centred(x: Tensor, center: bool) -> Tensor:
    x = x.to(torch.float64)
    return x - x.mean(-1, keepdim=True) if center else x


def normaliser_jacobian(x: Tensor, *, center: bool = True, eps: float = 0.0) -> Tensor:
    """``d x_hat / d x`` for each row of ``x`` (``(..., D)`` -> ``(..., D, D)``, float64), closed form.

    ``center``: LayerNorm (subtract the mean) or RMSNorm; ``eps`` inside the square root."""
    if eps < 0:
        raise ValueError(f"eps={eps!r} must be >= 0")
    xc = _centred(x, center)
    d = xc.shape[-1]
    s2 = xc.pow(2).mean(-1, keepdim=True) + eps
    s = s2.sqrt()
    eye = torch.eye(d, dtype=torch.float64, device=xc.device)
    jac = eye - (xc.unsqueeze(-1) * xc.unsqueeze(-2)) / (d * s2.unsqueeze(-1))
    if center:
        jac = jac - 1.0 / d
    return jac / s.unsqueeze(-1)


def discarded_basis(x: Tensor, *, center: bool = True) -> Tensor:
    """An orthonormal basis ``(..., D, k)`` of the discarded directions: ``1 / sqrt(D)`` (LayerNorm only) and
    ``x_hat / ||x_hat||``, float64 (``x_hat`` is centred when ``center``, so the two are orthogonal)."""
    xc = _centred(x, center)
    u = xc / xc.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    if not center:
        return u.unsqueeze(-1)
    ones = torch.full_like(u, 1.0 / math.sqrt(u.shape[-1]))
    return torch.stack([ones, u], dim=-1)


def removed_share(x: Tensor, g: Tensor, *, center: bool = True) -> Tensor:
    """``||P g|| / ||g||`` per row: the share of the gradient ``g`` at the normalised output that lies in
    ``span{1, x_hat}`` (``span{x_hat}`` without centring), which the backward pass discards."""
    if x.shape != g.shape:
        raise ValueError(f"x and g must have one shape, got {tuple(x.shape)} and {tuple(g.shape)}")
    basis = discarded_basis(x, center=center)
    g = g.to(torch.float64)
    proj = (basis * (basis.transpose(-1, -2) @ g.unsqueeze(-1)).transpose(-1, -2)).sum(-1)
    return proj.norm(dim=-1) / g.norm(dim=-1).clamp_min(torch.finfo(torch.float64).tiny)


def effective_rank(jac: Tensor, rtol: float = RTOL) -> Tensor:
    """The number of singular values of each ``(..., D, D)`` matrix above ``rtol`` times its largest."""
    s = torch.linalg.svdvals(jac.to(torch.float64))
    return (s > rtol * s[..., :1]).sum(-1)


@dataclasses.dataclass(frozen=True)
class SiteDiscard:
    """One norm site over its sampled tokens: width ``dim``, the effective ranks (min, max) of the pre-gain
    Jacobian, and the removed share of the incoming gradient (mean, max; NaN without a gradient)."""

    name: str
    dim: int
    rank_min: int
    rank_max: int
    share_mean: float
    share_max: float
    tokens: int

    @property
    def deficit(self) -> int:
        """How many directions the norm discards (``dim - rank_max``): 2 for LayerNorm, 1 for RMSNorm."""
        return self.dim - self.rank_max


def _bare(module: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of ``module`` without forward hooks (the Monitor's, a user's), optionally in ``dtype``: probing it
    neither fires nor trips them."""
    bare = copy.deepcopy(module)
    for m in bare.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks):
            hooks.clear()
    return bare if dtype is None else bare.to(dtype)


def _token_jacobians(module: nn.Module, rows: Tensor) -> Tensor:
    """The module's Jacobian at each row of ``rows`` (``(T, D)`` -> ``(T, D, D)``), each row fed alone as
    ``(1, 1, D)`` so the statistics are the row's own."""
    out = []
    for r in rows:

        def f(v: Tensor) -> Tensor:
            y = first_tensor(module(v.view(1, 1, -1)))
            assert y is not None
            return y.reshape(-1)

        out.append(torch.autograd.functional.jacobian(f, r, vectorize=True))
    return torch.stack(out)


def measure_site(
    module: nn.Module,
    x: Tensor,
    g: Tensor | None = None,
    *,
    facts: NormFacts | None = None,
    name: str = "",
    rtol: float = RTOL,
) -> SiteDiscard:
    """Measure one norm site on ``x`` ``(T, D)``, its input tokens, and ``g`` ``(T, D)``, the gradient arriving at
    its output (optional). The pre-gain Jacobian is the module's own (autograd) with the probed gain divided out
    of its rows; the removed share is ``||g_n - U_r U_r^T g_n|| / ||g_n||`` for ``g_n = gain * g`` and ``U_r``
    the Jacobian's first ``r`` left singular vectors (its range). The Jacobian is taken on a float64 copy."""
    if x.dim() != 2:
        raise ValueError(f"x must be (tokens, D), got shape {tuple(x.shape)}")
    facts = facts if facts is not None else probe(_bare(module))
    x = x.detach()
    exact = _bare(module, torch.float64)  # the Jacobian in float64, the model untouched
    with torch.enable_grad():
        jac = _token_jacobians(exact, x.to(torch.float64))
    gain = facts.multiplier(module) if facts is not None else None
    if gain is not None:
        gain = gain.to(torch.float64).reshape(-1)
        jac = jac / torch.where(gain == 0, torch.ones_like(gain), gain).unsqueeze(-1)
    u, s, _ = torch.linalg.svd(jac)
    keep = s > rtol * s[..., :1]
    ranks = keep.sum(-1)
    share_mean = share_max = float("nan")
    if g is not None:
        gn = g.detach().to(torch.float64)
        if gn.shape != x.shape:
            raise ValueError(f"g must have x's shape {tuple(x.shape)}, got {tuple(gn.shape)}")
        if gain is not None:
            gn = gn * gain
        ur = u * keep.unsqueeze(-2)
        kept = (ur @ (ur.transpose(-1, -2) @ gn.unsqueeze(-1))).squeeze(-1)
        shares = (gn - kept).norm(dim=-1) / gn.norm(dim=-1).clamp_min(torch.finfo(torch.float64).tiny)
        share_mean, share_max = float(shares.mean()), float(shares.max())
    return SiteDiscard(name, x.shape[-1], int(ranks.min()), int(ranks.max()), share_mean, share_max, int(x.shape[0]))


def _rows(t: Tensor, tokens: int) -> Tensor:
    """Up to ``tokens`` rows of ``t`` flattened to ``(N, D)``, evenly spaced (first and last included)."""
    flat = t.detach().reshape(-1, t.shape[-1])
    n = flat.shape[0]
    idx = torch.linspace(0, n - 1, min(tokens, n)).round().long().unique()
    return flat[idx]


class DiscardedDirections(MonitorMetric):
    """Per norm module (found by behaviour): how many directions its Jacobian discards and the share of the
    incoming gradient's norm in them, on ``tokens`` sampled tokens of a measured step. A norm that does not take
    one token ``(1, 1, D)`` alone (a channels-first BatchNorm) is left out."""

    key = "discarded"
    hooks = frozenset({Hook.MODULE_OUTPUT, Hook.GRADIENTS, Hook.STEP})
    columns = (
        Column("discarded_rank", "deficit", "directions the norm's Jacobian discards (D - rank)", scope=Scope.MODULE),
        Column(
            "discarded_grad",
            "g removed",
            "share of the incoming gradient's norm in the discarded directions (mean over tokens)",
            scope=Scope.MODULE,
        ),
        Column("discarded_grad_max", "max g removed", "largest removed share over norm sites", summary="g removed"),
    )

    def __init__(self, tokens: int = 8, rtol: float = RTOL) -> None:
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens={tokens!r} must be a positive int")
        self.tokens, self.rtol = tokens, rtol
        self._facts: dict[nn.Module, NormFacts | None] = {}
        self._seen: dict[nn.Module, tuple[Tensor, list[Tensor]]] = {}

    def on_module_output(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Row | None:
        x, y = first_tensor(args), first_tensor(output)
        if x is None or y is None or x.shape != y.shape or module in self._seen:
            return None  # a second call of one module in a step keeps the first
        n = x.reshape(-1, x.shape[-1]).shape[0]
        idx = torch.linspace(0, n - 1, min(self.tokens, n)).round().long().unique()
        grads: list[Tensor] = []
        if y.requires_grad:
            y.register_hook(lambda gr: grads.append(gr.detach().reshape(-1, gr.shape[-1])[idx].clone()))
        self._seen[module] = (x.detach().reshape(-1, x.shape[-1])[idx].clone(), grads)
        return None

    def on_gradients(self) -> Row | None:
        row: dict[str, object] = {}
        worst = float("nan")
        for module, (x, grads) in self._seen.items():
            if module not in self._facts:
                self._facts[module] = probe(_bare(module))
            if self._facts[module] is None:
                continue
            try:
                site = measure_site(module, x, grads[0] if grads else None, facts=self._facts[module], rtol=self.rtol)
            except (RuntimeError, ValueError, TypeError):
                continue  # not a per-token norm over the last axis (a channels-first BatchNorm): no token Jacobian
            name = self.monitor.name_of(module)
            row[self.columns[0].at(name)] = float(site.deficit)
            row[self.columns[1].at(name)] = site.share_mean
            if not math.isnan(site.share_mean):
                worst = site.share_mean if math.isnan(worst) else max(worst, site.share_mean)
        row[self.columns[2].key] = worst
        return row

    def on_step(self, record: Any) -> Row | None:
        self._seen = {}
        return None

    def release(self) -> None:
        self._seen = {}


DEFAULT_TOKENS = 16


def discarded_hf(
    model_dir: str | Path | None = None,
    sentences: Sequence[str] | None = None,
    *,
    tokens: int = DEFAULT_TOKENS,
    rtol: float = RTOL,
) -> list[SiteDiscard]:
    """Every norm site of a transformers encoder (default: the real all-MiniLM-L6-v2) on real sentences.

    The upstream gradient comes from a sentence-similarity loss: the mean cosine similarity between the
    sentences' mean-pooled embeddings (pads excluded). ``tokens`` real tokens per site are measured."""
    from ..analysis.probe import probe as _probe
    from .report import DEFAULT_SENTENCES, load_model, load_tokenizer, minilm_path
    from .roles import Kind, iter_kinds

    path = Path(model_dir) if model_dir is not None else minilm_path()
    model, tok = load_model(path), load_tokenizer(path)
    model.eval()
    sents = list(sentences if sentences is not None else DEFAULT_SENTENCES)
    enc = tok(sents, return_tensors="pt", padding=True)
    mask = enc["attention_mask"].bool()
    norms = [(n, m) for n, m, k in iter_kinds(model) if k is Kind.NORM]
    seen: dict[nn.Module, tuple[Tensor, Tensor]] = {}

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        x, y = first_tensor(args), first_tensor(output)
        if x is None or y is None or x.shape != y.shape or x.dim() != 3 or module in seen:
            return
        y.retain_grad()
        seen[module] = (x.detach(), y)

    handles = [m.register_forward_hook(hook) for _, m in norms]
    try:
        out = first_tensor(model(**enc))
        assert out is not None
        m = mask.unsqueeze(-1).to(out.dtype)
        emb = torch.nn.functional.normalize((out * m).sum(1) / m.sum(1), dim=-1)
        sim = emb @ emb.T
        n = len(sents)
        (sim.sum() - sim.diagonal().sum()).div(max(n * (n - 1), 1)).backward()
    finally:
        for h in handles:
            h.remove()
    sites = []
    for name, module in norms:
        if module not in seen:
            continue
        x, y = seen[module]
        assert y.grad is not None
        real = mask.reshape(-1)
        xr, gr = x.reshape(-1, x.shape[-1])[real], y.grad.reshape(-1, x.shape[-1])[real]
        idx = torch.linspace(0, xr.shape[0] - 1, min(tokens, xr.shape[0])).round().long().unique()
        sites.append(measure_site(module, xr[idx], gr[idx], facts=_probe(_bare(module)), name=name, rtol=rtol))
    return sites
