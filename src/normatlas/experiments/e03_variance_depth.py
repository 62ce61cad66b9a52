"""Experiment 3: the residual stream's variance with depth, for six placements (the LNS paper's Figure 1 in miniature).

Six tiny byte LMs on the standard library's sources, equal but for the placement preset (Pre-LN, Post-LN, Peri-LN,
LayerNorm Scaling, DeepNorm, Mix-LN; LayerNorm everywhere), trained alike. We read the residual stream leaving every
block on a held-out batch (forward hooks on the model's own blocks), at init and after training.
"""

from __future__ import annotations

from typing import Any

from . import depth_set
from ._shared import figure, finish
from .base import Outcome, RunContext, Series
from .verdict import Clause, Direction, Diverged, Statistic, VerdictRule

PLACEMENTS = ("Pre-LN", "Post-LN", "Peri-LN", "LNS", "DeepNorm", "Mix-LN")
OTHERS = ("LNS", "Peri-LN", "Post-LN", "DeepNorm")  # the placements whose growth must stay below Pre-LN's
PAPER_S = 1300.0  # paper scale: the shared set, six members of 24 layers x 2,000 steps (0.10 s a step, one idle core)
RULE = VerdictRule(tuple(
    Clause(f"growth_pre_ln_over_{o.lower().replace('-', '_')}", Direction.ABOVE, 1.0,
           f"trained Pre-LN's variance growth over depth (last block / first) exceeds {o}'s")
    for o in OTHERS
))  # fmt: skip


def run(ctx: RunContext) -> Outcome:
    s = depth_set.setup(ctx)
    n_layers = s.n_layers
    members = {name: depth_set.member(ctx, name) for name in PLACEMENTS if name in s.members}
    var = {name: {"init": t.init_variance, "trained": t.final_variance} for name, t in members.items()}
    measured: dict[str, Any] = {}
    for name, t in members.items():
        key = name.lower().replace("-", "_")
        measured[f"growth_init_{key}"] = depth_set.growth(var[name]["init"])
        measured[f"growth_trained_{key}"] = depth_set.growth(var[name]["trained"])
        measured[f"first_block_variance_trained_{key}"] = var[name]["trained"][1]
        measured[f"last_block_variance_trained_{key}"] = var[name]["trained"][-1]
        measured[f"final_train_loss_{key}"] = sum(t.losses[-10:]) / len(t.losses[-10:])
    g = {n: depth_set.growth(var[n]["trained"]) for n in members}
    statistics: dict[str, Statistic] = {}
    for other in OTHERS:
        key = f"growth_pre_ln_over_{other.lower().replace('-', '_')}"
        bad = next((n for n in ("Pre-LN", other) if members[n].diverged_at is not None), None)
        statistics[key] = (
            g["Pre-LN"] / g[other] if bad is None else Diverged(f"{bad}'s training", members[bad].diverged_at)
        )
    rows = [
        (name, depth_set.MEMBERS[name].placement(n_layers).name, stage, layer, v)
        for name in members
        for stage in ("init", "trained")
        for layer, v in enumerate(var[name][stage])
    ]  # the placement column is the preset's own name (the web atlas draws each profile beside its diagram)
    series = {"variance": Series(("label", "placement", "stage", "depth", "variance"), rows)}
    notes = (
        f"The shared depth set (experiments/depth_set.py, trained once per seed for experiments 3, 5 and 6): "
        f"{s.describe()}. 'growth' = variance leaving the last block / leaving the first. The LNS paper measures "
        "130M-1B Llama-style models over billions of tokens."
    )
    return Outcome(statistics, measured, series, _figure(ctx, var, n_layers), notes)


def _title(var: dict[str, dict[str, list[float]]]) -> str:
    """What the first seed's trained profiles show, from their growth (last block's variance / first block's)."""
    g = {n: depth_set.growth(var[n]["trained"]) for n in var}
    others = [n for n in var if n != "Pre-LN"]
    less = [n for n in others if g[n] < g["Pre-LN"]]
    more = [n for n in others if g[n] >= g["Pre-LN"]]
    head = f"Trained variance growth over depth (last / first block): Pre-LN x{g['Pre-LN']:.2g}"
    parts = [f"{', '.join(less)} grow less" if less else "", f"{', '.join(more)} grow as much or more" if more else ""]
    return head + "\n" + "; ".join(p for p in parts if p)


def _figure(ctx: RunContext, var: dict[str, dict[str, list[float]]], n_layers: int) -> Any:
    fig, (a, b) = figure(2, _title(var), f"seed {ctx.seed}; normatlas experiments run variance-depth{ctx.flag}")
    depth = list(range(1, n_layers + 1))
    for i, name in enumerate(PLACEMENTS):  # one colour per placement at every scale
        if name not in var:
            continue
        a.plot(depth, var[name]["init"][1:], "o-", ms=3, color=f"C{i}", label=name)
        b.plot(depth, var[name]["trained"][1:], "o-", ms=3, color=f"C{i}", label=name)
    a.set(xlabel="block (depth)", ylabel="variance of the residual stream", title="at initialisation", yscale="log")
    b.set(xlabel="block (depth)", ylabel="variance of the residual stream", title="after training", yscale="log")
    return finish(fig, (a, b), ncol=2)


EXPERIMENT = depth_set.declare("variance-depth", rule=RULE, run=run, default=70.0, quick=1.5, paper=PAPER_S)
