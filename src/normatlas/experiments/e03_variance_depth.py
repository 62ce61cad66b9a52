"""Experiment 3: the residual stream's variance with depth, for six placements (the LNS paper's Figure 1 in miniature).

Six tiny byte LMs on the standard library's sources, equal but for the placement preset (Pre-LN, Post-LN, Peri-LN,
LayerNorm Scaling, DeepNorm, Mix-LN; LayerNorm everywhere), trained alike. We read the residual stream leaving every
block on a held-out batch (forward hooks on the model's own blocks), at init and after training.
"""

from __future__ import annotations

from typing import Any

from ..blocks import deepnorm, layernorm_scaling, mix_ln, peri_ln, post_ln, pre_ln
from ._shared import byte_data, figure, finish, stream_variance, trained
from .base import Experiment, Outcome, RunContext, Series, estimates
from .lm import TrainConfig
from .verdict import Clause, Direction, Diverged, Statistic, VerdictRule

PLACEMENTS = ("Pre-LN", "Post-LN", "Peri-LN", "LNS", "DeepNorm", "Mix-LN")
OTHERS = ("LNS", "Peri-LN", "Post-LN", "DeepNorm")  # the placements whose growth must stay below Pre-LN's
PAPER_S = 1500.0  # paper scale: 24 layers, 2,000 steps per placement (estimate)
RULE = VerdictRule(tuple(
    Clause(f"growth_pre_ln_over_{o.lower().replace('-', '_')}", Direction.ABOVE, 1.0,
           f"trained Pre-LN's variance growth over depth (last block / first) exceeds {o}'s")
    for o in OTHERS
))  # fmt: skip


def placement(name: str, n_layers: int) -> Any:
    """The library's preset for a label of :data:`PLACEMENTS`."""
    presets = {
        "Pre-LN": pre_ln, "Post-LN": post_ln, "Peri-LN": peri_ln, "LNS": layernorm_scaling,
        "DeepNorm": lambda: deepnorm(n_layers), "Mix-LN": lambda: mix_ln(n_layers),
    }  # fmt: skip
    if name not in presets:
        raise ValueError(f"placement={name!r} is not one of {sorted(presets)}")
    return presets[name]()


def growth(var: list[float]) -> float:
    """The stream's variance leaving the last block over that leaving the first (``var[0]`` is the embedding)."""
    return var[-1] / var[1]


def run(ctx: RunContext) -> Outcome:
    n_layers, d_model = ctx.size(8, 6, paper=24), ctx.size(64, 32)
    cfg = TrainConfig(steps=ctx.size(200, 15, paper=2000), batch=ctx.size(16, 8), seq=ctx.size(64, 32), lr=3e-3)
    data = byte_data(ctx)
    x, _ = data.held_out(8, cfg.seq)
    var: dict[str, dict[str, list[float]]] = {}
    finals: dict[str, float] = {}
    diverged: dict[str, int | None] = {}
    for name in PLACEMENTS:
        init, lm, log = trained(ctx, placement(name, n_layers), cfg, data, name, n_layers=n_layers, d_model=d_model)
        var[name] = {"init": stream_variance(init, x), "trained": stream_variance(lm, x)}
        finals[name] = sum(log.losses[-10:]) / len(log.losses[-10:])
        diverged[name] = log.diverged_at
    measured: dict[str, Any] = {}
    for name in PLACEMENTS:
        key = name.lower().replace("-", "_")
        measured[f"growth_init_{key}"] = growth(var[name]["init"])
        measured[f"growth_trained_{key}"] = growth(var[name]["trained"])
        measured[f"first_block_variance_trained_{key}"] = var[name]["trained"][1]
        measured[f"last_block_variance_trained_{key}"] = var[name]["trained"][-1]
        measured[f"final_train_loss_{key}"] = finals[name]
    g = {n: growth(var[n]["trained"]) for n in PLACEMENTS}
    statistics: dict[str, Statistic] = {}
    for other in OTHERS:
        key = f"growth_pre_ln_over_{other.lower().replace('-', '_')}"
        bad = next((n for n in ("Pre-LN", other) if diverged[n] is not None), None)
        statistics[key] = g["Pre-LN"] / g[other] if bad is None else Diverged(f"{bad}'s training", diverged[bad])
    rows = [
        (name, placement(name, n_layers).name, stage, layer, v)
        for name in PLACEMENTS
        for stage in ("init", "trained")
        for layer, v in enumerate(var[name][stage])
    ]  # the placement column is the preset's own name (the web atlas draws each profile beside its diagram)
    series = {"variance": Series(("label", "placement", "stage", "depth", "variance"), rows)}
    notes = (
        f"{n_layers} layers, d_model {d_model}, byte LM on the stdlib sources, AdamW lr {cfg.lr} (warm-up "
        f"{cfg.warmup}), {cfg.steps} steps of {cfg.batch}x{cfg.seq} bytes, LayerNorm in every slot. 'growth' = "
        "variance leaving the last block / leaving the first. The LNS paper measures 130M-1B Llama-style models "
        "over billions of tokens."
    )
    return Outcome(statistics, measured, series, _figure(ctx, var, n_layers), notes)


def _title(var: dict[str, dict[str, list[float]]]) -> str:
    """What the first seed's trained profiles show, from their growth (last block's variance / first block's)."""
    g = {n: growth(var[n]["trained"]) for n in PLACEMENTS}
    others = [n for n in PLACEMENTS if n != "Pre-LN"]
    less = [n for n in others if g[n] < g["Pre-LN"]]
    more = [n for n in others if g[n] >= g["Pre-LN"]]
    head = f"Trained variance growth over depth (last / first block): Pre-LN x{g['Pre-LN']:.2g}"
    parts = [f"{', '.join(less)} grow less" if less else "", f"{', '.join(more)} grow as much or more" if more else ""]
    return head + "\n" + "; ".join(p for p in parts if p)


def _figure(ctx: RunContext, var: dict[str, dict[str, list[float]]], n_layers: int) -> Any:
    fig, (a, b) = figure(2, _title(var), f"seed {ctx.seed}; normatlas experiments run variance-depth{ctx.flag}")
    depth = list(range(1, n_layers + 1))
    for i, name in enumerate(PLACEMENTS):
        a.plot(depth, var[name]["init"][1:], "o-", ms=3, color=f"C{i}", label=name)
        b.plot(depth, var[name]["trained"][1:], "o-", ms=3, color=f"C{i}", label=name)
    a.set(xlabel="block (depth)", ylabel="variance of the residual stream", title="at initialisation", yscale="log")
    b.set(xlabel="block (depth)", ylabel="variance of the residual stream", title="after training", yscale="log")
    return finish(fig, (a, b), ncol=2)


EXPERIMENT = Experiment(
    name="variance-depth",
    number=3,
    title="Variance with depth",
    claim="Pre-LN's residual variance grows with depth; LNS and Peri-LN grow less; Post-LN and DeepNorm stay flat",
    guide_words=(
        "and as Var[x_ℓ] grows, Norm(x_ℓ) becomes ever less sensitive to the branch's contribution, so the block's "
        "Jacobian drifts toward the identity. The deep layers stop doing anything. [...] it lands between Pre-LN's "
        "exponential variance growth and Post-LN's vanishing gradients"
    ),
    anchor="lns2025",
    anchor_reports=(
        "Figure 1 (qualitatively): in Pre-LN LLMs the output variance grows with depth; with LayerNorm Scaling it "
        "stays much smaller in the deep layers"
    ),
    rule=RULE,
    estimates_s=estimates(default=70.0, quick=1.5, paper=PAPER_S),
    run=run,
)
