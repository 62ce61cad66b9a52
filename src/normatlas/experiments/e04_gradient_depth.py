"""Experiment 4: gradients with depth at initialisation, Post-LN against Pre-LN (Xiong et al. 2020).

The guide says Post-LN's gradient decays roughly as O(1/sqrt(l)) going backwards. What Xiong et al. derive
(Theorem 1, at init, for the last layer's FFN weight W2): ||dL/dW2|| is O(d sqrt(ln d)) for Post-LN, independent of
the depth L, and O(d sqrt(ln d / L)) for Pre-LN; their Figure 3 shows Post-LN's gradient norms growing with the layer
index (small near the input) while Pre-LN's stay about level. We measure both: the gradient norm of every layer's
FFN output weight in one model of each kind, and the last layer's against the depth L.

The width is the paper's: d_model 512 with 8 heads and a ReLU FFN of 2,048 (the Transformer-base of its translation
experiments; the theorem's d). Post-LN's per-layer profile is fitted against the guide's O(1/sqrt(l)), with ``l``
the number of layers counted back from the output (l = 1 for the last layer): the log-log slope of ||dL/dW2||
against l, which 1/sqrt(l) predicts to be -0.5, with its R^2. (The previous design ran at d_model 64.)
"""

from __future__ import annotations

import math
from typing import Any

import torch.nn.functional as F

from ..blocks import MLP, Activation, TransformerLM, post_ln, pre_ln
from ..presets import LayerNorm
from ._shared import byte_data, figure, finish
from .base import Experiment, Outcome, RunContext, Series, estimates
from .data import ByteBatches
from .lm import tiny_lm
from .verdict import Clause, Direction, VerdictRule

KINDS = ("Post-LN", "Pre-LN")


WIDTH, HEADS = 512, 8  # Xiong et al.'s width (Transformer base); the FFN is 4 x d_model
SLOPE_TOLERANCE = 0.25  # the guide's O(1/sqrt(l)): a backward slope within 0.25 of -0.5
PAPER_S = 400.0  # paper scale: 48 layers at width 512, depths up to 48 (at init: no training)
RULE = VerdictRule((
    Clause("post_ln_backward_slope", Direction.BELOW, 0.0,
           "Post-LN's gradient shrinks going backwards (log-log slope of ||dL/dW2|| against l, the layers counted "
           "back from the output)"),
    Clause("abs_post_ln_backward_slope_plus_half", Direction.BELOW, SLOPE_TOLERANCE,
           "at about the guide's O(1/sqrt(l)) rate (|that slope + 0.5|)"),
    Clause("log_ratio_post_ln_minus_pre_ln", Direction.ABOVE, 0.0,
           "Pre-LN's first / last ratio is closer to 1 than Post-LN's (|log Post-LN's| - |log Pre-LN's|)"),
    Clause("last_layer_grad_slope_vs_depth_pre_ln", Direction.BELOW, -0.25,
           "Pre-LN's last-layer gradient falls with depth (log-log slope; theory -0.5)"),
    Clause("abs_last_layer_grad_slope_vs_depth_post_ln", Direction.BELOW, 0.25,
           "Post-LN's last-layer gradient is level in depth (|log-log slope|; theory 0)"),
))  # fmt: skip


def model(ctx: RunContext, kind: str, n_layers: int, d_model: int, n_heads: int = 4) -> TransformerLM:
    """Xiong et al.'s two blocks: ReLU FFN (not gated), LayerNorm, a final LayerNorm in Pre-LN only, and weights of
    std 1/sqrt(d_model) (Xavier's scale for the square matrices; the theorem assumes Xavier, not GPT-2's 0.02)."""
    place = post_ln() if kind == "Post-LN" else pre_ln()
    return tiny_lm(
        place, LayerNorm, n_layers=n_layers, d_model=d_model, n_heads=n_heads, seed=ctx.seed,
        activation=Activation.RELU, gated=False, final_norm=kind == "Pre-LN", init_std=d_model**-0.5,
    )  # fmt: skip


def layer_grads(lm: TransformerLM, data: ByteBatches, batches: int, seq: int, batch: int = 16) -> list[float]:
    """The Frobenius norm of dL/dW2 (each block's FFN output weight), averaged over ``batches`` training batches."""
    sums = [0.0] * len(lm.blocks())
    for _ in range(batches):
        x, y = data.train(batch, seq)
        lm.zero_grad(set_to_none=True)
        F.cross_entropy(lm(x).flatten(0, 1), y.flatten()).backward()
        for i, b in enumerate(lm.blocks()):
            assert isinstance(b.mlp, MLP)  # a dense FFN (a MoE block has stacked experts)
            g = b.mlp.down_proj.weight.grad
            assert g is not None
            sums[i] += float(g.norm()) / batches
    return sums


def fit(xs: list[int], ys: list[float]) -> tuple[float, float, float]:
    """The least-squares line of log(y) against log(x): ``(slope, intercept, R^2)``."""
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    b = sum((a - mx) * (c - my) for a, c in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)
    total = sum((c - my) ** 2 for c in ly)
    resid = sum((c - my - b * (a - mx)) ** 2 for a, c in zip(lx, ly, strict=True))
    return b, my - b * mx, 1 - resid / total if total > 0 else 1.0


def slope(xs: list[int], ys: list[float]) -> float:
    """The least-squares slope of log(y) against log(x)."""
    return fit(xs, ys)[0]


def run(ctx: RunContext) -> Outcome:
    n_layers, d_model, batches = ctx.size(24, 6, paper=48), ctx.size(WIDTH, 128, paper=WIDTH), ctx.size(2, 1, paper=4)
    heads = ctx.size(HEADS, 4, paper=HEADS)
    depths = ctx.pick([2, 4, 8, 16], [2, 4, 8], paper=[3, 6, 12, 24, 48])
    seq, batch = ctx.size(64, 32), ctx.size(8, 8, paper=16)
    profile: dict[str, list[float]] = {}
    last: dict[str, list[float]] = {k: [] for k in KINDS}
    for kind in KINDS:
        ctx.progress(f"{kind}: per-layer gradients at {n_layers} layers, width {d_model}")
        profile[kind] = layer_grads(model(ctx, kind, n_layers, d_model, heads), byte_data(ctx), batches, seq, batch)
        for depth in depths:
            ctx.progress(f"{kind}: depth {depth}")
            lm = model(ctx, kind, depth, d_model, heads)
            last[kind].append(layer_grads(lm, byte_data(ctx), batches, seq, batch)[-1])
    back = list(range(n_layers, 0, -1))  # l: layers counted back from the output (the last layer is l = 1)
    post_fit = fit(back, profile["Post-LN"])
    measured: dict[str, Any] = {"d_model": d_model, "n_heads": heads, "n_layers": n_layers, "depths": depths}
    for kind in KINDS:
        key = kind.lower().replace("-", "_")
        measured[f"first_over_last_{key}"] = profile[kind][0] / profile[kind][-1]
        measured[f"last_layer_grad_slope_vs_depth_{key}"] = slope(depths, last[kind])
        measured[f"backward_slope_{key}"], _, measured[f"backward_fit_r2_{key}"] = fit(back, profile[kind])
    m = measured
    statistics = {
        "post_ln_backward_slope": post_fit[0],
        "abs_post_ln_backward_slope_plus_half": abs(post_fit[0] + 0.5),
        "log_ratio_post_ln_minus_pre_ln": abs(math.log(m["first_over_last_post_ln"]))
        - abs(math.log(m["first_over_last_pre_ln"])),
        "last_layer_grad_slope_vs_depth_pre_ln": m["last_layer_grad_slope_vs_depth_pre_ln"],
        "abs_last_layer_grad_slope_vs_depth_post_ln": abs(m["last_layer_grad_slope_vs_depth_post_ln"]),
    }
    series = {
        "per_layer": Series.of(
            layer=list(range(1, n_layers + 1)),
            layers_back_from_output=back,
            post_ln=profile["Post-LN"],
            pre_ln=profile["Pre-LN"],
        ),
        "last_layer_vs_depth": Series.of(depth=depths, post_ln=last["Post-LN"], pre_ln=last["Pre-LN"]),
    }
    notes = (
        f"byte LMs, d_model {d_model} ({heads} heads; Xiong et al.'s Transformer-base width is 512), ReLU FFN of 4 "
        "d_model, LayerNorm, init std 1/sqrt(d_model) (Xavier's scale, as the theorem assumes), gradient of the "
        f"next-byte loss averaged over {batches} batches of {batch}x{seq}; per-layer profile at {n_layers} layers, "
        f"last layer at depths {depths}. Expected slopes: Post-LN's per-layer profile against l (layers back from the "
        "output) -0.5 by the guide's O(1/sqrt(l)); the last layer against depth L: Pre-LN -0.5, Post-LN 0 (Theorem 1)."
    )
    return Outcome(statistics, measured, series, _figure(ctx, profile, last, depths, post_fit, d_model), notes)


def _title(post_slope: float, pre_ratio: float, depth_slopes: dict[str, float], d_model: int) -> str:
    """The first seed's finding in two lines, from its numbers."""
    if post_slope < 0:
        post = f"Post-LN's gradient falls going back from the output as l^{post_slope:.2f} (guide: l^-0.5)"
    else:
        post = f"Post-LN's gradient does not fall going back (l^{post_slope:+.2f}; guide: l^-0.5)"
    level = "about level" if 0.67 < pre_ratio < 1.5 else f"not level (first / last layer {pre_ratio:.2g})"
    pre, post_d = depth_slopes["Pre-LN"], depth_slopes["Post-LN"]
    return (f"At init, width {d_model}: {post}\nPre-LN's profile is {level}; last layer vs depth: Pre-LN L^{pre:.2f} "
            f"(theory -0.5), Post-LN L^{post_d:.2f} (theory 0)")  # fmt: skip


def _figure(
    ctx: RunContext, profile: dict[str, list[float]], last: dict[str, list[float]], depths: list[int],
    post_fit: tuple[float, float, float], d_model: int,
) -> Any:  # fmt: skip
    fig, (a, b) = figure(
        2,
        _title(
            post_fit[0],
            profile["Pre-LN"][0] / profile["Pre-LN"][-1],
            {k: slope(depths, last[k]) for k in KINDS},
            d_model,
        ),
        f"seed {ctx.seed}; normatlas experiments run gradient-depth{ctx.flag}",
    )
    n = len(profile["Post-LN"])
    back = list(range(n, 0, -1))
    for i, kind in enumerate(KINDS):
        a.plot(back, profile[kind], "o-", ms=3, color=f"C{i}", label=kind)
        b.plot(depths, last[kind], "o-", color=f"C{i}", label=f"{kind} (slope {slope(depths, last[kind]):.2f})")
    k, c, r2 = post_fit
    ls = list(range(1, n + 1))
    a.plot(ls, [math.exp(c) * v**k for v in ls], "C0--", lw=1.2, label=f"Post-LN fit: l^{k:.2f} (R² {r2:.2f})")
    a.plot(ls, [profile["Post-LN"][-1] / math.sqrt(v) for v in ls], "k:", lw=1.2, label="guide: 1/sqrt(l)")
    ref = [last["Pre-LN"][0] * math.sqrt(depths[0] / d) for d in depths]
    b.plot(depths, ref, "k--", lw=1, label="Xiong et al.: Pre-LN 1/sqrt(L)")
    a.set(xlabel="l: layers back from the output (1 = last layer)", ylabel="||dL/dW2|| (Frobenius)",
          title=f"per layer at {n} layers", xscale="log", yscale="log")  # fmt: skip
    b.set(xlabel="depth L (layers)", ylabel="last layer's ||dL/dW2||", title="last layer vs depth", xscale="log")
    b.set_yscale("log")
    for ax, ticks in ((a, [t for t in (1, 2, 4, 8, 16, 32, 48) if t <= n]), (b, depths)):
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    return finish(fig, (a, b))


EXPERIMENT = Experiment.declare(
    "gradient-depth", rule=RULE, estimates_s=estimates(default=40.0, quick=1.5, paper=PAPER_S), run=run
)
