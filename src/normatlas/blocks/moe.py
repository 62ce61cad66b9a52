"""A routed mixture-of-experts MLP: a typed value of the MLP slot (:class:`MoEConfig`), one module (:class:`MoE`).

Per token ``x`` (``E`` experts, each a gated or plain MLP of width ``d_expert``)::

    logits = router(x)                                   (E scores; a linear map, no bias)
    s      = score(logits)                               softmax / sigmoid over all E   (score_after_topk=False)
    sel    = s + selection_bias                          DeepSeek-V3's bias: chooses the experts, never weighs them
    sel    = sel outside the topk_groups best groups -> -inf   (n_groups > 1: a group's score is its top-2 sum)
    idx    = top_k(sel)                                  the k experts this token goes to
    w      = s[idx]                or  softmax(logits[idx])  (score_after_topk=True: Mixtral's gate written that way)
    w      = w / sum(w)            if renormalize        (Mixtral, OLMoE, Qwen3-MoE's norm_topk_prob)
    y      = routed_scale * sum_j w_j * expert_{idx_j}(x)    or  sum_j expert_{idx_j}(w_j * x)  (weight_input: Llama 4)
    y     += [sigmoid(shared_gate(x)) *] shared(x)       shared experts: one MLP, shared_width wide (Qwen2-MoE's gate)

The experts' weights are three stacked tensors, ``gate`` and ``up`` ``(E, d_expert, d_model)`` and ``down``
``(E, d_model, d_expert)`` (each expert's slice in ``nn.Linear``'s ``(out, in)`` layout; a plain expert has no
``gate``). Which layers are MoE and which dense is ``ModelConfig.layer_moe``, as ``layer_windows`` is for windows.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .mlp import MLP, Activation

__all__ = ["MoE", "MoEConfig", "RouterScore", "route"]


class RouterScore(enum.Enum):
    """The function that turns the router's logits into expert scores."""

    SOFTMAX = "softmax"  # Mixtral, Qwen-MoE, OLMoE
    SIGMOID = "sigmoid"  # DeepSeek-V3, GLM-4.5, MiniMax-M2


@dataclass(frozen=True)
class MoEConfig:
    """A routed MoE MLP. Validated at construction.

    ``n_experts`` routed experts of width ``d_expert``, ``top_k`` of them per token; ``score`` (a
    :class:`RouterScore`) applied over all experts' logits, or (``score_after_topk``, softmax only) over the ``k``
    selected logits; ``renormalize`` divides the ``k`` weights by their sum; ``routed_scale`` multiplies the routed
    sum; ``selection_bias`` adds a per-expert bias to the scores for choosing only; ``n_groups > 1`` splits the
    experts into that many equal groups and chooses only in the ``topk_groups`` groups whose two best selection
    scores sum highest (DeepSeek-V3's ``n_group`` / ``topk_group``); ``shared_width > 0`` adds shared experts as one
    MLP of that total width, times ``sigmoid(shared_gate(x))`` when ``shared_gate``; ``weight_input`` applies each
    routing weight to the token an expert reads instead of to what it writes (Llama 4; ``routed_scale`` must be 1,
    as it no longer factors out of the experts).
    """

    n_experts: int
    top_k: int
    d_expert: int
    score: RouterScore = RouterScore.SOFTMAX
    score_after_topk: bool = False
    renormalize: bool = False
    routed_scale: float = 1.0
    selection_bias: bool = False
    shared_width: int = 0
    shared_gate: bool = False
    n_groups: int = 1
    topk_groups: int = 1
    weight_input: bool = False

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "d_expert", "n_groups", "topk_groups"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be <= n_experts={self.n_experts}")
        if not isinstance(self.score, RouterScore):
            allowed = ", ".join(f"RouterScore.{m.name}" for m in RouterScore)
            raise TypeError(f"score={self.score!r} must be one of {allowed}")
        for name in ("score_after_topk", "renormalize", "selection_bias", "shared_gate", "weight_input"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.score_after_topk and self.score is not RouterScore.SOFTMAX:
            raise ValueError(
                f"score_after_topk=True needs score=RouterScore.SOFTMAX (a softmax over the k selected logits); "
                f"got score={self.score}"
            )
        rs = self.routed_scale
        if isinstance(rs, bool) or not isinstance(rs, (int, float)) or not math.isfinite(rs) or rs <= 0:
            raise ValueError(f"routed_scale={rs!r} must be a finite number > 0")
        if self.weight_input and rs != 1.0:
            raise ValueError(
                f"routed_scale={rs!r} with weight_input=True: the weights scale the experts' input; use 1.0"
            )
        sw = self.shared_width
        if isinstance(sw, bool) or not isinstance(sw, int) or sw < 0:
            raise ValueError(f"shared_width={sw!r} must be an integer >= 0 (0: no shared experts)")
        if self.shared_gate and sw == 0:
            raise ValueError("shared_gate=True needs shared experts (shared_width > 0)")
        g, tg = self.n_groups, self.topk_groups
        if g > 1:
            per = self.n_experts // g
            if self.n_experts % g or per < 2:
                raise ValueError(
                    f"n_groups={g} must divide n_experts={self.n_experts} into groups of at least 2 (top-2 group score)"
                )
            if not tg <= g or self.top_k > tg * per:
                raise ValueError(
                    f"topk_groups={tg} must be <= n_groups={g} and hold top_k={self.top_k} experts ({per} per group)"
                )
        elif tg != 1:
            raise ValueError(f"topk_groups={tg} needs n_groups > 1 (n_groups={g})")


def _limit(sel: Tensor, c: MoEConfig) -> Tensor:
    """``sel`` with the experts outside the ``topk_groups`` best groups set to -inf (``n_groups > 1``)."""
    if c.n_groups == 1:
        return sel
    per = c.n_experts // c.n_groups
    grouped = sel.reshape(-1, c.n_groups, per)
    best = grouped.topk(2, dim=-1).values.sum(-1).topk(c.topk_groups, dim=-1).indices
    keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter(1, best, True)
    return sel.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))


def route(logits: Tensor, c: MoEConfig, selection_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The routing of :class:`MoEConfig` ``c`` from router logits ``(N, E)``: (chosen experts ``(N, k)``, their
    weights ``(N, k)``, renormalised and scaled as ``c`` says)."""
    if c.score_after_topk:
        sel = logits if selection_bias is None else logits + selection_bias
        idx = _limit(sel, c).topk(c.top_k, dim=-1).indices
        w = torch.softmax(logits.gather(-1, idx), dim=-1)
    else:
        s = torch.softmax(logits, dim=-1) if c.score is RouterScore.SOFTMAX else torch.sigmoid(logits)
        sel = s if selection_bias is None else s + selection_bias
        idx = _limit(sel, c).topk(c.top_k, dim=-1).indices
        w = s.gather(-1, idx)
    if c.renormalize:
        w = w / w.sum(-1, keepdim=True)
    return idx, w * c.routed_scale if c.routed_scale != 1.0 else w


class MoE(nn.Module):
    """The routed MoE MLP of :class:`MoEConfig` (module docstring); ``activation`` / ``gated`` as in ``MLP``.

    Parameters: ``router.weight`` ``(E, d_model)``, ``gate`` / ``up`` ``(E, d_expert, d_model)`` (``gate`` only when
    gated), ``down`` ``(E, d_model, d_expert)``, the buffer ``selection_bias`` ``(E,)``, ``shared`` (an ``MLP``) and
    ``shared_gate.weight`` ``(1, d_model)``.
    """

    def __init__(self, d_model: int, config: MoEConfig, activation: object, gated: bool) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config={config!r} must be a MoEConfig")
        if not isinstance(activation, Activation):
            raise TypeError(f"activation={activation!r} must be an Activation")
        self.config, self.activation, self.gated = config, activation, gated
        e, f = config.n_experts, config.d_expert
        self.router = nn.Linear(d_model, e, bias=False)
        self.gate = nn.Parameter(torch.empty(e, f, d_model)) if gated else None
        self.up = nn.Parameter(torch.empty(e, f, d_model))
        self.down = nn.Parameter(torch.empty(e, d_model, f))
        self.selection_bias: Tensor | None
        if config.selection_bias:
            self.register_buffer("selection_bias", torch.zeros(e))
        else:
            self.selection_bias = None
        self.shared = MLP(d_model, config.shared_width, activation, gated) if config.shared_width else None
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if config.shared_gate else None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for p in (self.gate, self.up, self.down):
            if p is not None:
                nn.init.normal_(p, std=std)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(the chosen experts ``(N, k)``, their weights ``(N, k)``) of tokens ``x`` ``(N, d_model)``."""
        return route(self.router(x), self.config, self.selection_bias)

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` applied to tokens ``x`` ``(n, d_model)``."""
        up = x @ self.up[e].t()
        h = self.activation(x @ self.gate[e].t()) * up if self.gate is not None else self.activation(up)
        return h @ self.down[e].t()

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, w = self.route(flat)
        out = torch.zeros_like(flat)
        for e in range(self.config.n_experts):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if not tok.numel():
                continue
            wt = w[tok, slot, None].to(flat.dtype)
            if self.config.weight_input:
                out = out.index_add(0, tok, self.expert(e, flat[tok] * wt))
            else:
                out = out.index_add(0, tok, self.expert(e, flat[tok]) * wt)
        if self.shared is not None:
            s = self.shared(flat)
            out = out + (torch.sigmoid(self.shared_gate(flat)) * s if self.shared_gate is not None else s)
        return out.reshape(shape)

    def extra_repr(self) -> str:
        c = self.config
        return f"experts={c.n_experts}, top_k={c.top_k}, d_expert={c.d_expert}, score={c.score.value}"
