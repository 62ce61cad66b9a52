"""Experiment 4: gradients with depth at initialisation, Post-LN against Pre-LN (Xiong et al. 2020).

The guide says Post-LN's gradient decays roughly as O(1/sqrt(l)) going backwards. What Xiong et al. derive
(Theorem 1, at init, for the last layer's FFN weight W2): ||dL/dW2|| is O(d sqrt(ln d)) for Post-LN, independent of
the depth L, and O(d sqrt(ln d / L)) for Pre-LN; their Figure 3 shows Post-LN's gradient norms growing with the layer
index (small near the input) while Pre-LN's stay about level. We measure both: the gradient norm of every layer's
FFN output weight in one model of each kind, and the last layer's against the depth L.
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


PAPER_S = 300.0  # paper scale: 48 layers, d_model 128, depths up to 64 (at init: no training)
RULE = VerdictRule((
    Clause("first_over_last_post_ln", Direction.BELOW, 1.0,
           "Post-LN's gradient shrinks toward the input (first layer's ||dL/dW2|| / last layer's)"),
    Clause("log_ratio_post_ln_minus_pre_ln", Direction.ABOVE, 0.0,
           "Pre-LN's first / last ratio is closer to 1 than Post-LN's (|log Post-LN's| - |log Pre-LN's|)"),
    Clause("last_layer_grad_slope_vs_depth_pre_ln", Direction.BELOW, -0.25,
           "Pre-LN's last-layer gradient falls with depth (log-log slope; theory -0.5)"),
    Clause("abs_last_layer_grad_slope_vs_depth_post_ln", Direction.BELOW, 0.25,
           "Post-LN's last-layer gradient is level in depth (|log-log slope|; theory 0)"),
))  # fmt: skip


def model(ctx: RunContext, kind: str, n_layers: int, d_model: int) -> TransformerLM:
    """Xiong et al.'s two blocks: ReLU FFN (not gated), LayerNorm, a final LayerNorm in Pre-LN only, and weights of
    std 1/sqrt(d_model) (Xavier's scale for the square matrices; the theorem assumes Xavier, not GPT-2's 0.02)."""
    place = post_ln() if kind == "Post-LN" else pre_ln()
    return tiny_lm(
        place, LayerNorm, n_layers=n_layers, d_model=d_model, seed=ctx.seed,
        activation=Activation.RELU, gated=False, final_norm=kind == "Pre-LN", init_std=d_model**-0.5,
    )  # fmt: skip


def layer_grads(lm: TransformerLM, data: ByteBatches, batches: int, seq: int) -> list[float]:
    """The Frobenius norm of dL/dW2 (each block's FFN output weight), averaged over ``batches`` training batches."""
    sums = [0.0] * len(lm.blocks())
    for _ in range(batches):
        x, y = data.train(16, seq)
        lm.zero_grad(set_to_none=True)
        F.cross_entropy(lm(x).flatten(0, 1), y.flatten()).backward()
        for i, b in enumerate(lm.blocks()):
            assert isinstance(b.mlp, MLP)  # a dense FFN (a MoE block has stacked experts)
            g = b.mlp.down_proj.weight.grad
            assert g is not None
            sums[i] += float(g.norm()) / batches
    return sums


def slope(xs: list[int], ys: list[float]) -> float:
    """The least-squares slope of log(y) against log(x)."""
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def run(ctx: RunContext) -> Outcome:
    n_layers, d_model, batches = ctx.size(24, 8, paper=48), ctx.size(64, 32, paper=128), ctx.size(8, 2, paper=16)
    depths = ctx.pick([4, 8, 16, 32], [2, 4, 8], paper=[4, 8, 16, 32, 64])
    seq = ctx.size(64, 32)
    profile: dict[str, list[float]] = {}
    last: dict[str, list[float]] = {k: [] for k in KINDS}
    for kind in KINDS:
        ctx.progress(f"{kind}: per-layer gradients")
        data = byte_data(ctx)
        profile[kind] = layer_grads(model(ctx, kind, n_layers, d_model), data, batches, seq)
        for depth in depths:
            ctx.progress(f"{kind}: depth {depth}")
            last[kind].append(layer_grads(model(ctx, kind, depth, d_model), byte_data(ctx), batches, seq)[-1])
    measured: dict[str, Any] = {}
    for kind in KINDS:
        key = kind.lower().replace("-", "_")
        measured[f"first_over_last_{key}"] = profile[kind][0] / profile[kind][-1]
        measured[f"last_layer_grad_slope_vs_depth_{key}"] = slope(depths, last[kind])
    m = measured
    statistics = {
        "first_over_last_post_ln": m["first_over_last_post_ln"],
        "log_ratio_post_ln_minus_pre_ln": abs(math.log(m["first_over_last_post_ln"]))
        - abs(math.log(m["first_over_last_pre_ln"])),
        "last_layer_grad_slope_vs_depth_pre_ln": m["last_layer_grad_slope_vs_depth_pre_ln"],
        "abs_last_layer_grad_slope_vs_depth_post_ln": abs(m["last_layer_grad_slope_vs_depth_post_ln"]),
    }
    series = {
        "per_layer": Series.of(
            layer=list(range(1, n_layers + 1)), post_ln=profile["Post-LN"], pre_ln=profile["Pre-LN"]
        ),
        "last_layer_vs_depth": Series.of(depth=depths, post_ln=last["Post-LN"], pre_ln=last["Pre-LN"]),
    }
    notes = (
        f"byte LMs, d_model {d_model}, ReLU FFN of 4 d_model, LayerNorm, init std 1/sqrt(d_model) (Xavier's "
        f"scale, as the theorem assumes), gradient of the next-byte loss averaged over {batches} batches of "
        f"16x{seq}; per-layer profile at {n_layers} layers, last layer at depths {depths}. Expected slopes: Pre-LN "
        "about -0.5 (1/sqrt(L)), Post-LN 0."
    )
    return Outcome(statistics, measured, series, _figure(ctx, profile, last, depths), notes)


def _figure(ctx: RunContext, profile: dict[str, list[float]], last: dict[str, list[float]], depths: list[int]) -> Any:
    fig, (a, b) = figure(
        2,
        "At init Post-LN's gradients shrink toward the input; Pre-LN's are level and fall as 1/sqrt(L) overall",
        f"seed {ctx.seed}; normatlas experiments run gradient-depth{ctx.flag}",
    )
    for i, kind in enumerate(KINDS):
        a.plot(range(1, len(profile[kind]) + 1), profile[kind], "o-", ms=3, color=f"C{i}", label=kind)
        b.plot(depths, last[kind], "o-", color=f"C{i}", label=f"{kind} (slope {slope(depths, last[kind]):.2f})")
    ref = [last["Pre-LN"][0] * math.sqrt(depths[0] / d) for d in depths]
    b.plot(depths, ref, "k--", lw=1, label="1/sqrt(L) reference")
    a.set(xlabel="layer index", ylabel="||dL/dW2|| (Frobenius)", title="per layer, at init", yscale="log")
    b.set(xlabel="depth L (layers)", ylabel="last layer's ||dL/dW2||", title="last layer vs depth", xscale="log")
    b.set_yscale("log")
    b.set_xticks(depths, [str(d) for d in depths])
    b.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    return finish(fig, (a, b))


EXPERIMENT = Experiment(
    name="gradient-depth",
    number=4,
    title="Gradients with depth",
    claim="At init Post-LN's gradients shrink toward the input; Pre-LN's are level, its last layer's falls with depth",
    guide_words=(
        "Post-LN puts a normalization in the gradient's way at every single block. Gradient magnitude at layer ℓ "
        "decays roughly as O(1/√ℓ) going backwards, which is why the original transformer needed a learning-rate "
        "warmup and why deep Post-LN models are notoriously fragile."
    ),
    anchor="xiong2020",
    anchor_reports=(
        "Theorem 1 (at init): the last FFN layer's gradient is O(d sqrt(ln d)) for Post-LN, independent of depth L, "
        "and O(d sqrt(ln d / L)) for Pre-LN; Figure 3: Post-LN's gradient norm grows with the layer index, Pre-LN's "
        "stays about level"
    ),
    rule=RULE,
    estimates_s=estimates(default=10.0, quick=0.5, paper=PAPER_S),
    run=run,
)
