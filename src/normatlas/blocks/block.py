"""One transformer block whose forward reads a :class:`Placement` (no class per scheme).

For each sublayer ``F`` (attention, then FFN) the block computes::

    h = N_pre(x) * pre_scale        if placement.<sub>.pre        (pre_scale: LayerNorm Scaling)
    y = F(h)
    y = N_post(y)                   if placement.<sub>.post       (Sandwich / Peri-LN / res-post-norm)
    x = residual_add(x, y)          alpha * skip_gate(x) + branch_scale * gate(y)
    x = N_after(x)                  if placement.<sub>.after_add  (Post-LN / DeepNorm)

and, with ``placement.parallel``, ``x = N_after(residual_add(x, F_attn(h) + F_ffn(h')))``.
The norms are attributes ``{attn,ffn}_{pre,post,after}_norm`` (absent when the slot is off).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..analysis.probe import ParamRole, param_roles, probe, randomized, respond
from ..modules import Norm
from ..spec import GainConvention
from .alibi import Alibi
from .attention import Attention, RopeStyle, _head_dim
from .attn_gate import OutputGate
from .mla import MLAConfig, MLAttention
from .mlp import MLP, Activation
from .moe import MoE, MoEConfig
from .placement import DepthScale, Gate, NormFactory, Placement
from .qknorm import QKNormConfig
from .residual import LayerScale, ResidualAdd, ReZero

__all__ = ["Block"]


def _gate(gate: Gate, init: float, d_model: int) -> nn.Module | None:
    if gate is Gate.SCALAR:
        return ReZero(init)
    if gate is Gate.VECTOR:
        return LayerScale(d_model, init)
    return None


def _residual(p: Placement, sublayer: str, d_model: int) -> ResidualAdd:
    alpha, scale = p.scalings(sublayer)
    return ResidualAdd(alpha, scale, _gate(p.gate, p.gate_init, d_model), _gate(p.skip_gate, 1.0, d_model))


def _gain_of(norm: nn.Module) -> tuple[Tensor, bool]:
    """``norm``'s per-feature gain parameter and whether it multiplies as ``1 + w``: a normatlas :class:`Norm` says
    so in its typed ``spec``; any other module (a foreign norm, or a pointwise stand-in such as DyT) is measured by
    the shared probe (:mod:`normatlas.analysis.probe`), never read from its attribute names. Raises without one."""
    if isinstance(norm, Norm):
        w: Tensor | None = norm.weight
        one_plus_w = norm.spec.gain_convention is GainConvention.ONE_PLUS_W
    else:
        name, one_plus_w = _measured_gain(norm)
        w = getattr(norm, name) if name is not None else None
    if not isinstance(w, Tensor) or w.dim() == 0:
        raise ValueError(f"post_gain_init needs post-norms with a per-feature gain; got {type(norm).__name__}")
    return w, one_plus_w


def _measured_gain(module: nn.Module) -> tuple[str | None, bool]:
    """(the registered name of ``module``'s one per-feature gain, whether it is ``1 + w``), by the zeroing test."""
    facts = probe(module)
    if facts is not None:
        return facts.gain_param, facts.measured.gain_convention is GainConvention.ONE_PLUS_W
    with randomized(module):
        resp = respond(module)
        roles = param_roles(module, resp.x) if resp is not None and resp.pointwise else {}
    sizes = {n: p.numel() for n, p in module.named_parameters(recurse=False)}
    gains = [(n, r) for n, r in roles.items() if r is not ParamRole.BIAS and sizes.get(n, 0) > 1]
    if len(gains) != 1:
        return None, False
    return gains[0][0], gains[0][1] is ParamRole.GAIN_ONE_PLUS_W


class Block(nn.Module):
    """A transformer block configured by a placement and a norm operator.

    Args:
        placement: where the norms and scalings sit (validated value).
        norm: the operator factory ``dim -> nn.Module`` for every norm slot; required when
            ``placement.has_norm``.
        layer: 0-based index of this layer, ``n_layers`` the depth (for depth-scaled schemes).
        attn_kwargs: passed to :class:`Attention`; ``mlp_kwargs`` to :class:`MLP`.
        moe: a :class:`MoEConfig` makes the MLP slot a routed mixture of experts (:class:`MoE`, its experts
            ``activation`` / ``gated`` as the dense MLP's; ``d_ff`` unused); None: the dense :class:`MLP`.
    """

    def __init__(
        self,
        d_model: int,
        placement: Placement,
        norm: NormFactory | None,
        *,
        layer: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        d_ff: int,
        activation: Activation = Activation.SILU,
        gated: bool = True,
        mlp_bias: bool = False,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: QKNormConfig | None = None,
        attn_scale: float | None = None,
        attn_softcap: float | None = None,
        window: int | None = None,
        rope_theta: float | None = None,
        moe: MoEConfig | None = None,
        mla: MLAConfig | None = None,
        attn_sinks: bool = False,
        attn_gate: OutputGate | None = None,
        alibi: Alibi | None = None,
        v_norm: QKNormConfig | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("n_layers", n_layers), ("n_heads", n_heads), ("d_ff", d_ff)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
            raise ValueError(
                f"layer={layer!r} must be an integer in [0, n_layers) = [0, {n_layers}) (0-based, n_layers={n_layers})"
            )
        if not isinstance(placement, Placement):
            raise TypeError(f"placement={placement!r} must be a Placement")
        if placement.has_norm and norm is None:
            raise ValueError(
                f"placement {placement.name!r} has norm slots but norm=None; give a norm operator "
                "(e.g. normatlas.RMSNorm) or a norm-free placement (rezero, skipinit, norm_free)"
            )
        self.placement, self.layer, self.n_layers = placement, layer, n_layers
        self.attn_pre_norm: nn.Module | None
        self.attn_post_norm: nn.Module | None
        self.attn_after_norm: nn.Module | None
        self.ffn_pre_norm: nn.Module | None
        self.ffn_post_norm: nn.Module | None
        self.ffn_after_norm: nn.Module | None
        self.window, self.rope_theta = window, rope_theta
        self.attn: Attention | MLAttention
        if mla is not None:
            if not isinstance(mla, MLAConfig):
                raise TypeError(f"mla={mla!r} must be an MLAConfig or None")
            if qk_norm is not None or placement.qkv_norm:
                raise ValueError(f"mla={mla!r} with a QK-norm or QKV-norm: MLA's norms are on its latents")
            if attn_sinks or attn_gate is not None or alibi is not None or v_norm is not None:
                raise ValueError(
                    f"mla with attn_sinks={attn_sinks} / attn_gate={attn_gate!r} / alibi={alibi!r} / "
                    f"v_norm={v_norm!r}: not expressed for MLA"
                )
            self.attn = MLAttention(
                d_model, n_heads, mla, bias=qkv_bias, out_bias=out_bias, scale=attn_scale, softcap=attn_softcap
            )
        else:
            hd = _head_dim(d_model, n_heads, head_dim)  # raises unless n_heads divides d_model or head_dim is given
            qkv = None
            if placement.qkv_norm:
                assert norm is not None
                qkv = (norm(hd), norm(hd), norm(hd))
            self.attn = Attention(
                d_model, n_heads, n_kv_heads, hd, qkv_bias=qkv_bias, out_bias=out_bias, qk_norm=qk_norm,
                qkv_norm=qkv, scale=attn_scale, softcap=attn_softcap, sinks=attn_sinks, out_gate=attn_gate,
                alibi=alibi, v_norm=v_norm,
            )  # fmt: skip
        if moe is not None and not isinstance(moe, MoEConfig):
            raise TypeError(f"moe={moe!r} must be a MoEConfig or None")
        if moe is not None and mlp_bias:
            raise ValueError("mlp_bias=True with moe: our experts have no biases")
        self.mlp: MLP | MoE = (
            MLP(d_model, d_ff, activation, gated, mlp_bias) if moe is None else MoE(d_model, moe, activation, gated)
        )
        p = placement
        for sub, slots in (("attn", p.attn), ("ffn", p.ffn)):
            for slot in ("pre", "post", "after"):
                on = getattr(slots, "after_add" if slot == "after" else slot)
                if sub == "ffn" and p.parallel and (slot == "after" or (slot == "pre" and p.shared_pre_norm)):
                    on = False  # one add (attn's after-norm) and, when shared, one pre-norm
                setattr(self, f"{sub}_{slot}_norm", norm(d_model) if on and norm is not None else None)
        self.pre_scale = p.pre_norm_scale.factor(layer, n_layers)
        self.attn_residual = _residual(p, "attn", d_model)
        self.ffn_residual = None if p.parallel else _residual(p, "ffn", d_model)
        self._init_post_gains()

    def _init_post_gains(self) -> None:
        p = self.placement
        if p.post_gain_init is DepthScale.NONE:
            return
        g = p.post_gain_c * p.post_gain_init.factor(self.layer, self.n_layers)
        for norm in (self.attn_post_norm, self.ffn_post_norm):
            if norm is None:
                continue
            w, one_plus_w = _gain_of(norm)
            with torch.no_grad():
                w.fill_(g - 1.0 if one_plus_w else g)

    def deepnorm_init(self) -> None:
        """DeepNet init: v, o and FFN weights Xavier-normal with gain beta, q and k with gain 1."""
        beta = self.placement.branch_init_beta
        if beta is None:
            return
        a = self.attn
        if isinstance(a, MLAttention):  # the query side at gain 1; the kv latent feeds v, so beta
            qs, vs = [a.q_proj, a.q_a_proj, a.q_b_proj], [a.kv_a_proj, a.kv_b_proj]
        else:
            qs, vs = [a.q_proj, a.k_proj], [a.v_proj]
        for lin in qs:
            if lin is not None:
                nn.init.xavier_normal_(lin.weight, gain=1.0)
        lins = [*vs, a.o_proj]
        if isinstance(self.mlp, MLP):
            lins += [self.mlp.up_proj, self.mlp.down_proj] + ([self.mlp.gate_proj] if self.mlp.gate_proj else [])
        else:
            for w in (self.mlp.gate, self.mlp.up, self.mlp.down):
                for e in range(w.shape[0] if w is not None else 0):
                    nn.init.xavier_normal_(w.data[e], gain=beta)  # type: ignore[union-attr]
        for lin in lins:
            nn.init.xavier_normal_(lin.weight, gain=beta)

    def _pre(self, norm: nn.Module | None, x: Tensor) -> Tensor:
        if norm is None:
            return x
        h = norm(x)
        return h * self.pre_scale if self.pre_scale != 1.0 else h

    @staticmethod
    def _opt(norm: nn.Module | None, x: Tensor) -> Tensor:
        return x if norm is None else norm(x)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor, RopeStyle] | None = None, mask: Tensor | None = None
    ) -> Tensor:
        if self.placement.parallel:
            h = self._pre(self.attn_pre_norm, x)
            h2 = h if self.placement.shared_pre_norm else self._pre(self.ffn_pre_norm, x)
            a = self._opt(self.attn_post_norm, self.attn(h, rope, mask))
            f = self._opt(self.ffn_post_norm, self.mlp(h2))
            return self._opt(self.attn_after_norm, self.attn_residual(x, a + f))
        y = self._opt(self.attn_post_norm, self.attn(self._pre(self.attn_pre_norm, x), rope, mask))
        x = self._opt(self.attn_after_norm, self.attn_residual(x, y))
        y = self._opt(self.ffn_post_norm, self.mlp(self._pre(self.ffn_pre_norm, x)))
        assert self.ffn_residual is not None
        return self._opt(self.ffn_after_norm, self.ffn_residual(x, y))

    def extra_repr(self) -> str:
        s = f"layer={self.layer}, placement={self.placement.name}"
        return s + (f", pre_scale={self.pre_scale:.4g}" if self.pre_scale != 1.0 else "")
