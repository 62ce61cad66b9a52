"""Experiment 6: scaled init is not enough. GPT-2's 1/sqrt(2L) init against LayerNorm Scaling, during training.

GPT-2's init (``ModelConfig(scaled_residual_init=True)``) starts the two stream-writing projections at
``0.02 / sqrt(2 L)``, so the Pre-LN stream starts with little growth over depth. The guide says that only sets the
starting point: training grows the deep layers' variance back, while LayerNorm Scaling (applied at every forward
pass) keeps it bounded. Three byte LMs on the standard library's sources: Pre-LN with the plain init, Pre-LN with
the scaled init, and LNS (plain init); the stream's variance leaving every block is read at checkpoints.
"""

from __future__ import annotations

from typing import Any

from . import depth_set
from ._shared import figure, finish
from .base import Outcome, RunContext, Series
from .verdict import Clause, Direction, Diverged, Statistic, VerdictRule

KINDS = ("Pre-LN", "Pre-LN + scaled init", "LNS")  # members of the shared depth set
PAPER_S = 700.0  # paper scale: three members of the shared set, 2,000 steps (the guide's "by 2k steps")
RULE = VerdictRule((
    Clause("growth_init_scaled_over_plain", Direction.BELOW, 1.0,
           "GPT-2's scaled init lowers the variance growth over depth at init"),
    Clause("growth_end_over_init_scaled", Direction.ABOVE, 2.0,
           "training grows the scaled-init model's depth growth back, more than 2x its value at init"),
    Clause("growth_end_scaled_over_lns", Direction.ABOVE, 1.0,
           "LNS ends with a lower depth growth than the scaled init"),
))  # fmt: skip


def run(ctx: RunContext) -> Outcome:
    s = depth_set.setup(ctx)
    n_layers = s.n_layers
    runs: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        t = depth_set.member(ctx, kind)
        runs[kind] = {"checkpoints": t.trajectory, "losses": t.losses, "diverged_at": t.diverged_at}
    measured: dict[str, Any] = {}
    for kind in KINDS:
        key = kind.lower().replace("-", "_").replace(" + ", "_").replace(" ", "_")
        cps = runs[kind]["checkpoints"]
        measured[f"growth_init_{key}"] = depth_set.growth(cps[0][1])
        measured[f"growth_end_{key}"] = depth_set.growth(cps[-1][1])
        measured[f"last_block_variance_init_{key}"] = cps[0][1][-1]
        measured[f"last_block_variance_end_{key}"] = cps[-1][1][-1]
    m = measured
    statistics: dict[str, Statistic] = {
        "growth_init_scaled_over_plain": m["growth_init_pre_ln_scaled_init"] / m["growth_init_pre_ln"],
        "growth_end_over_init_scaled": m["growth_end_pre_ln_scaled_init"] / m["growth_init_pre_ln_scaled_init"],
        "growth_end_scaled_over_lns": m["growth_end_pre_ln_scaled_init"] / m["growth_end_lns"],
    }
    reads = {"Pre-LN": [], "Pre-LN + scaled init": list(statistics)[1:], "LNS": ["growth_end_scaled_over_lns"]}
    for kind in KINDS:
        at = runs[kind]["diverged_at"]
        for k in reads[kind] if at is not None else []:
            statistics[k] = Diverged(f"{kind}'s training", at)
    rows = [
        (kind, step, layer, v)
        for kind in KINDS
        for step, var in runs[kind]["checkpoints"]
        for layer, v in enumerate(var)
    ]
    series = {"variance": Series(("model", "step", "depth", "variance"), rows)}
    notes = (
        f"The shared depth set (experiments/depth_set.py, trained once per seed for experiments 3, 5 and 6): "
        f"{s.describe()}. 'growth' = variance leaving the last block / "
        "leaving the first. The guide's '2k steps' is the LNS paper's scale (LLMs); here the horizon is shorter."
    )
    return Outcome(statistics, measured, series, _figure(ctx, runs, n_layers), notes)


def _title(runs: dict[str, Any]) -> str:
    """What the first seed's runs show, from their growth (last block's variance / first block's)."""
    g = {
        k: (depth_set.growth(runs[k]["checkpoints"][0][1]), depth_set.growth(runs[k]["checkpoints"][-1][1]))
        for k in KINDS
    }
    end = runs["Pre-LN + scaled init"]["checkpoints"][-1][0]
    scaled, lns = g["Pre-LN + scaled init"], g["LNS"]
    lower = "lower" if lns[1] < scaled[1] else "not lower"
    return (f"Scaled init starts Pre-LN's depth growth at x{scaled[0]:.2g} (plain x{g['Pre-LN'][0]:.2g}); at step "
            f"{end} it is x{scaled[1]:.2g}, LNS's x{lns[1]:.2g} ({lower})")  # fmt: skip


def _figure(ctx: RunContext, runs: dict[str, Any], n_layers: int) -> Any:
    fig, (a, b) = figure(2, _title(runs), f"seed {ctx.seed}; normatlas experiments run scaled-init{ctx.flag}")
    for i, kind in enumerate(KINDS):
        cps = runs[kind]["checkpoints"]
        a.plot([s for s, _ in cps], [depth_set.growth(v) for _, v in cps], "o-", ms=3, color=f"C{i}", label=kind)
        b.plot(range(1, n_layers + 1), cps[0][1][1:], ":", color=f"C{i}", label=f"{kind}, init")
        b.plot(range(1, n_layers + 1), cps[-1][1][1:], "-", color=f"C{i}", label=f"{kind}, step {cps[-1][0]}")
    a.set(xlabel="training step", ylabel="variance last block / first block", title="growth over depth", yscale="log")
    b.set(xlabel="block (depth)", ylabel="variance of the residual stream", title="per block", yscale="log")
    return finish(fig, (a, b), legend_size=7)


EXPERIMENT = depth_set.declare("scaled-init", rule=RULE, run=run, default=50.0, quick=1.0, paper=PAPER_S)
