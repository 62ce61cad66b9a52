"""Designs seen in no transformers model, built from hand-written toy blocks: the
inspector must classify them from their dataflow alone (norms written as raw
arithmetic, as fused ops, and as F.normalize; module names are deliberately
misleading)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normatlas.inspect import inspect_model
from normatlas.vocabulary import (
    BranchScale,
    EpsPlacement,
    GainConvention,
    QKNormKind,
    RopeOrder,
    SiteRole,
    SublayerKind,
    branch_scale_word,
    layer_placement_words,
    residual_scale_word,
)
from normatlas.vocabulary import PlacementKind as Placement

D, H, V, T = 32, 4, 50, 6


class HandRMS(nn.Module):
    def __init__(self, n: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.w, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class HandLNOutside(nn.Module):
    """LayerNorm with eps outside the root: (x - mu) / (std + eps)."""

    def __init__(self, n: int, eps: float = 1e-4) -> None:
        super().__init__()
        self.g, self.b, self.eps = nn.Parameter(torch.ones(n)), nn.Parameter(torch.zeros(n)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x - x.mean(-1, keepdim=True)
        return xc / (xc.pow(2).mean(-1, keepdim=True).sqrt() + self.eps) * self.g + self.b


class L2(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1)


def make_norm(kind: str, n: int) -> nn.Module:
    return {"rms": lambda: HandRMS(n), "ln": lambda: nn.LayerNorm(n), "ln_out": lambda: HandLNOutside(n), "l2": L2}[
        kind
    ]()


def rope(x: torch.Tensor) -> torch.Tensor:
    t = torch.arange(x.shape[-2], dtype=x.dtype)[:, None] * torch.ones(x.shape[-1] // 2)
    cos, sin = torch.cat([t.cos(), t.cos()], -1), torch.cat([t.sin(), t.sin()], -1)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attn(nn.Module):
    def __init__(
        self,
        qk: str | None = None,
        qk_kind: str = "rms",
        qk_after_rope: bool = False,
        v_norm: bool = False,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        hd = D // H
        self.qk, self.after, self.softcap = qk, qk_after_rope, softcap
        size = hd if qk == "per-head" else D
        self.input_layernorm = make_norm(qk_kind, size) if qk else None  # misleading name on purpose
        self.knorm = make_norm(qk_kind, size) if qk else None
        self.vnorm = make_norm("rms", hd) if v_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.qk == "flat":
            q, k = self.input_layernorm(q), self.knorm(k)
        q, k, v = (z.view(b, t, H, -1).transpose(1, 2) for z in (q, k, v))
        if self.qk == "per-head" and not self.after:
            q, k = self.input_layernorm(q), self.knorm(k)
        q, k = rope(q), rope(k)
        if self.qk == "per-head" and self.after:
            q, k = self.input_layernorm(q), self.knorm(k)
        if self.vnorm is not None:
            v = self.vnorm(v)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if self.softcap:
            s = torch.tanh(s / self.softcap) * self.softcap
        a = s.softmax(-1) @ v
        return self.o(a.transpose(1, 2).reshape(b, t, D))


class Block(nn.Module):
    """One residual block; ``scheme`` per sublayer: pre / post / peri / res-post / none."""

    def __init__(
        self,
        attn_scheme: str,
        mlp_scheme: str,
        *,
        norm: str = "rms",
        alpha: float = 1.0,
        branch: str | None = None,
        out_scale: float = 1.0,
        parallel: bool = False,
        **attn_kw: object,
    ) -> None:
        super().__init__()
        self.attn = Attn(**attn_kw)  # type: ignore[arg-type]
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.schemes, self.alpha, self.out_scale, self.parallel = (attn_scheme, mlp_scheme), alpha, out_scale, parallel
        self.pre = nn.ModuleList(make_norm(norm, D) for _ in range(2))
        self.out = nn.ModuleList(make_norm(norm, D) for _ in range(2))
        self.post = nn.ModuleList(make_norm(norm, D) for _ in range(2))
        self.branch = branch
        if branch == "rezero":
            self.gates = nn.ParameterList(nn.Parameter(torch.full((1,), 0.5)) for _ in range(2))
        elif branch == "layerscale":
            self.gates = nn.ParameterList(nn.Parameter(torch.full((D,), 0.1)) for _ in range(2))
        elif branch == "const":
            self.const = 0.25

    def sub(self, i: int, x: torch.Tensor, f: nn.Module) -> torch.Tensor:
        scheme = self.schemes[i]
        h = self.pre[i](x) * self.out_scale if scheme in ("pre", "peri") else x
        y = f(h)
        if scheme in ("peri", "res-post"):
            y = self.out[i](y)
        if self.branch in ("rezero", "layerscale"):
            y = self.gates[i] * y
        elif self.branch == "const":
            y = y * self.const
        z = x * self.alpha + y if self.alpha != 1.0 else x + y
        return self.post[i](z) if scheme == "post" else z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            h = self.pre[0](x)
            return x + (self.attn(h) + self.mlp(h))
        return self.sub(1, self.sub(0, x, self.attn), self.mlp)


class Toy(nn.Module):
    def __init__(self, layers: list[Block], final: str | None = "rms") -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(layers)
        self.final = make_norm(final, D) if final else nn.Identity()
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.final(x))

    def example_inputs(self) -> tuple[torch.Tensor]:
        return (torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0)),)


def deepnorm() -> Toy:
    return Toy([Block("post", "post", norm="ln", alpha=2.0) for _ in range(2)], final=None)


def lns() -> Toy:
    return Toy([Block("pre", "pre", out_scale=1 / math.sqrt(i + 1)) for i in range(3)])


def mixln() -> Toy:
    return Toy([Block("post", "post") for _ in range(2)] + [Block("pre", "pre") for _ in range(2)])


def hybridnorm() -> Toy:
    return Toy([Block("none", "post", qk="per-head", v_norm=True) for _ in range(2)], final=None)


def rezero() -> Toy:
    return Toy([Block("none", "none", branch="rezero") for _ in range(2)], final=None)


def layerscale_peri() -> Toy:
    return Toy([Block("peri", "peri", branch="layerscale") for _ in range(2)])


def parallel_gptj() -> Toy:
    return Toy([Block("pre", "pre", norm="ln", parallel=True) for _ in range(2)], final="ln")


def l2_qk_after_rope() -> Toy:
    return Toy([Block("pre", "pre", qk="per-head", qk_kind="l2", qk_after_rope=True) for _ in range(2)])


def flat_ln_qk_softcap() -> Toy:
    return Toy([Block("res-post", "res-post", qk="flat", qk_kind="ln", softcap=20.0, branch="const") for _ in range(2)])


def eps_outside() -> Toy:
    return Toy([Block("pre", "pre", norm="ln_out") for _ in range(2)], final="ln_out")


_CACHE: dict[str, object] = {}


def report(name: str):  # type: ignore[no-untyped-def]
    if name not in _CACHE:
        torch.manual_seed(0)
        model = globals()[name]()
        _CACHE[name] = inspect_model(model, model.example_inputs(), name=name)
    return _CACHE[name]


def test_deepnorm_is_post_with_residual_alpha() -> None:
    r = report("deepnorm")
    assert r.placement is Placement.POST
    assert r.residual_scale == BranchScale.of([2.0]) and residual_scale_word(r.residual_scale) == "2"
    assert r.operator.value == "layernorm" and r.final_norm.value == "none"


def test_layernorm_scaling_is_depth_dependent() -> None:
    r = report("lns")
    assert r.placement is Placement.PRE
    assert r.depth_scaling is not None and r.depth_scaling.inverse_sqrt and r.depth_scaling.value == "1/sqrt(layer)"


def test_mix_ln_is_a_per_layer_mix() -> None:
    r = report("mixln")
    assert r.placement is Placement.MIX
    assert layer_placement_words(r.placement_by_layer) == ["post/post", "post/post", "pre/pre", "pre/pre"]


def test_hybridnorm_qkv_norm_and_post_ffn() -> None:
    r = report("hybridnorm")
    assert (r.placement_attention.value, r.placement_mlp.value) == ("none", "post")
    assert r.placement is Placement.MIX
    assert r.qk_norm is QKNormKind.PER_HEAD and r.qk_norm_rope is RopeOrder.BEFORE_ROPE and r.v_norm


def test_rezero_has_no_norm_and_a_learned_scalar() -> None:
    r = report("rezero")
    assert r.placement is Placement.NONE and r.operator.value == "none"
    assert branch_scale_word(r.branch_scale) == "learned scalar"


def test_layerscale_with_peri_norms() -> None:
    r = report("layerscale_peri")
    assert r.placement is Placement.PERI and branch_scale_word(r.branch_scale) == "per-channel"
    assert r.gain_convention is GainConvention.W and r.cast_order is None


def test_parallel_single_sum_branch() -> None:
    r = report("parallel_gptj")
    assert r.placement is Placement.PARALLEL
    assert r.sublayers[0].kind is SublayerKind.PARALLEL


def test_l2_qk_norm_after_rope() -> None:
    r = report("l2_qk_after_rope")
    assert r.qk_norm is QKNormKind.PER_HEAD and r.qk_norm_rope is RopeOrder.AFTER_ROPE
    qk = [n for n in r.norms if n.role is SiteRole.QK]
    assert qk and all(n.operator.value == "l2" and n.eps_placement is EpsPlacement.CLAMP for n in qk)


def test_flattened_layernorm_qk_softcap_res_post() -> None:
    r = report("flat_ln_qk_softcap")
    assert r.placement is Placement.RES_POST and r.qk_norm is QKNormKind.FLATTENED
    assert r.attn_softcap == pytest.approx(20.0)
    assert branch_scale_word(r.branch_scale) == "0.25"


def test_eps_outside_the_root() -> None:
    r = report("eps_outside")
    assert r.eps_placement is EpsPlacement.OUTSIDE_SQRT and r.eps == pytest.approx(1e-4)
    assert r.operator.value == "layernorm" and r.bias


def test_names_do_not_matter() -> None:
    """The QK norm module is called ``input_layernorm``; it is still found as a QK norm, not a pre-norm."""
    r = report("hybridnorm")
    labelled = [n for n in r.norms if n.module.endswith("input_layernorm")]
    assert labelled and all(n.role is SiteRole.QK for n in labelled)


def test_package_is_callable_and_aliases() -> None:
    import normatlas.inspect as pkg

    model = lns()
    rep = pkg(model, model.example_inputs())
    assert rep.depth_scaling is not None and rep.depth_scaling.inverse_sqrt and pkg.inspect is pkg.inspect_model
