"""Experiment 5: the curse of depth. Remove each layer of a trained tiny LM in turn and measure the loss increase.

In Pre-LN the stream's variance grows with depth, so the deep blocks' contributions are drowned and removing one
costs little; LayerNorm Scaling (and, by the Peri-LN paper's argument, Peri-LN) should make the deep layers matter
again. Three byte LMs (Pre-LN, LNS, Peri-LN; LayerNorm) are trained alike on the standard library's sources; each
block is skipped in turn (a forward hook returns its input) and the held-out loss is compared with the full model's.

The rule reads layers 2..L only. Removing layer 1 costs more than any other in every model we trained (Pre-LN, LNS,
Peri-LN, Post-LN, at 8 and 24 layers): it is the first transform of the raw embedding, which every placement needs,
so it is not what the claim is about, and with it in the shallower half the late / early ratio measures layer 1.
This rule was fixed after the paper-scale run of seeds 0-2 showed that, and is tested on fresh seeds (3 onward);
layer 1's cost is still measured and drawn.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from . import depth_set
from ._shared import byte_data, figure, finish, without_layer
from .base import Outcome, RunContext, Series
from .lm import evaluate_lm
from .verdict import Clause, Direction, Diverged, Statistic, VerdictRule

KINDS = ("Pre-LN", "LNS", "Peri-LN")  # members of the shared depth set


PAPER_S = 700.0  # paper scale: three members of the shared set (none when 3 trained them first)
RULE = VerdictRule((
    Clause("late_over_early_pre_ln", Direction.BELOW, 1.0,
           "in Pre-LN, removing a layer of the deeper half of layers 2..L costs less than removing one of the "
           "shallower half"),
    Clause("late_over_early_lns_minus_pre_ln", Direction.ABOVE, 0.0,
           "LNS's deeper layers matter more than Pre-LN's (its late / early ratio over layers 2..L minus Pre-LN's)"),
))  # fmt: skip


def ablation(lm: Any, x: Any, y: Any) -> list[float]:
    """Held-out loss increase (nats/byte) when each block is skipped in turn."""
    with torch.no_grad():
        base = float(F.cross_entropy(lm(x).flatten(0, 1), y.flatten()))
    return [
        float(F.cross_entropy(without_layer(lm, i, x).flatten(0, 1), y.flatten())) - base
        for i in range(len(lm.blocks()))
    ]


def late_over_early(deltas: list[float], first: int = 2) -> float:
    """Mean loss increase from removing a layer of the deeper half of layers ``first``..L over that of the shallower
    half (NaN when the shallower half's mean is not positive: then the ratio means nothing and the verdict fails).
    ``first=1`` reads every layer (the rule before it excluded layer 1)."""
    if first < 1 or len(deltas) - (first - 1) < 2:
        raise ValueError(f"first={first} must leave at least two of the {len(deltas)} layers")
    deltas = deltas[first - 1 :]
    h = len(deltas) // 2
    early = sum(deltas[:h]) / h
    return (sum(deltas[h:]) / (len(deltas) - h)) / early if early > 0 else float("nan")


def run(ctx: RunContext) -> Outcome:
    s = depth_set.setup(ctx)
    n_layers = s.n_layers
    data = byte_data(ctx)
    x, y = data.held_out(ctx.size(32, 8), s.train.seq)
    deltas, held = {}, {}
    diverged: dict[str, int | None] = {}
    for name in KINDS:
        t = depth_set.member(ctx, name)
        diverged[name] = t.diverged_at
        held[name] = evaluate_lm(t.model, data, batch=ctx.size(32, 8), seq=s.train.seq)
        deltas[name] = ablation(t.model, x, y)
    measured: dict[str, Any] = {}
    for name in KINDS:
        key = name.lower().replace("-", "_")
        measured[f"late_over_early_{key}"] = late_over_early(deltas[name])
        measured[f"late_over_early_all_layers_{key}"] = late_over_early(deltas[name], first=1)
        measured[f"layer_1_share_of_total_{key}"] = deltas[name][0] / sum(deltas[name]) if sum(deltas[name]) else None
        measured[f"held_out_loss_{key}"] = held[name]
        measured[f"loss_increase_per_layer_{key}"] = [round(d, 5) for d in deltas[name]]
    m = measured
    statistics: dict[str, Statistic] = {
        "late_over_early_pre_ln": m["late_over_early_pre_ln"],
        "late_over_early_lns_minus_pre_ln": m["late_over_early_lns"] - m["late_over_early_pre_ln"],
    }
    reads = {"Pre-LN": list(statistics), "LNS": ["late_over_early_lns_minus_pre_ln"], "Peri-LN": []}
    for name, at in diverged.items():
        for k in reads[name] if at is not None else []:  # a diverged model's ablation means nothing
            statistics[k] = Diverged(f"{name}'s training", at)
    rows = [(name, i + 1, d) for name in KINDS for i, d in enumerate(deltas[name])]
    series = {"ablation": Series(("placement", "removed_layer", "loss_increase"), rows)}
    notes = (
        f"The shared depth set (experiments/depth_set.py, trained once per seed for experiments 3, 5 and 6): "
        f"{s.describe()}; loss increase on one held-out batch. The LNS paper prunes 130M-7B LLMs and "
        "reads MMLU; 'late over early' is the deeper half's mean increase over the shallower half's, over layers 2..L "
        "(layer 1, the embedding's first transform, dominates every model and is reported apart)."
    )
    return Outcome(statistics, measured, series, _figure(ctx, deltas, n_layers), notes)


def _title(deltas: dict[str, list[float]]) -> str:
    """What the first seed's ablations show, from the deeper half's mean loss increase over the shallower half's
    (layers 2..L)."""
    r = {n: late_over_early(deltas[n]) for n in KINDS}
    pre = "costs less than" if r["Pre-LN"] < 1 else "costs at least as much as"
    lns = "narrows" if r["LNS"] > r["Pre-LN"] else "does not narrow"
    return (f"Layers 2..L: removing a deep Pre-LN layer {pre} an early one (late / early {r['Pre-LN']:.2g}); "
            f"LNS {lns} the gap ({r['LNS']:.2g}), Peri-LN {r['Peri-LN']:.2g}")  # fmt: skip


def _figure(ctx: RunContext, deltas: dict[str, list[float]], n_layers: int) -> Any:
    fig, (a, b) = figure(2, _title(deltas), f"seed {ctx.seed}; normatlas experiments run curse-of-depth{ctx.flag}")
    layers = list(range(1, n_layers + 1))
    for i, name in enumerate(KINDS):
        a.plot(layers, deltas[name], "o-", ms=3, color=f"C{i}", label=name)
        total = sum(deltas[name])
        b.plot(layers, [d / total for d in deltas[name]], "o-", ms=3, color=f"C{i}", label=name)
    for ax in (a, b):
        ax.axvspan(0.5, 1.5, color="0.9", zorder=0, label="layer 1: not in the rule")
    a.set(xlabel="removed layer", ylabel="held-out loss increase (nats/byte)", title="loss increase (symlog)")
    a.set_yscale("symlog", linthresh=1e-3)
    b.set(xlabel="removed layer", ylabel="share of the total increase", title="normalised per model")
    return finish(fig, (a, b))


EXPERIMENT = depth_set.declare("curse-of-depth", rule=RULE, run=run, default=50.0, quick=1.0, paper=PAPER_S)
