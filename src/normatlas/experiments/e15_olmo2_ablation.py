"""Experiment 15: OLMo 2's 2x2 ablation, norm reordering x QK-norm, on gradient-norm spikes.

Four tiny byte LMs on the standard library's sources, equal but for two switches: the placement (Pre-LN,
x <- x + F(Norm(x)), or OLMo 2's "reordered norm", the Swin-V2 res-post-norm x <- x + Norm(F(x)), both with RMSNorm
as OLMo 2 uses) and QK-norm (off, or RMSNorm per head on q and k before RoPE). They train alike (AdamW, betas
0.9 / 0.95, gradient clipping at 1.0 as OLMo 2 clips) at a learning rate high enough that the Pre-LN baseline's
gradient norm spikes, from the same initial seed and batches. The gradient norm is the global L2 norm of every
parameter's gradient before clipping, read by ``register_post_accumulate_grad_hook`` on the model's parameters.

Spikiness (fixed here): step t is a gradient-norm spike when its norm exceeds ``SPIKE_RATIO`` x the median of the
previous ``window`` steps' norms (counted from ``max(warmup, window)`` on); the spike rate is spikes per step. A loss
spike is a step whose loss exceeds the median of the previous ``window`` losses by ``LOSS_SPIKE_NATS``. A run that
diverges (non-finite loss) counts every step from its divergence to the planned end as a spike.
"""

from __future__ import annotations

import math
import statistics as st
from typing import Any

from ..blocks import QKNormConfig, pre_ln, reordered_norm
from ..presets import RMSNorm
from ._shared import byte_data, figure, finish
from .base import Experiment, Outcome, RunContext, Series, estimates
from .lm import TrainConfig, tiny_lm, train_lm
from .verdict import Clause, Direction, Diverged, OnDivergence, Statistic, Untested, VerdictRule

CELLS = ("Pre-LN", "Pre-LN + QK-norm", "reordered", "reordered + QK-norm")
SPIKE_RATIO = 3.0  # a gradient-norm spike: above 3x the rolling median of the previous window
LOSS_SPIKE_NATS = 0.3  # a loss spike: this far above the rolling median of the previous window
LR = 3e-2  # high enough that the Pre-LN baseline's gradient norm spikes (AdamW, clip 1.0)
PAPER_S = 1100.0  # paper scale: 12 layers, d_model 64, 2,000 steps per cell (0.13 s a step on one idle core)
RULE = VerdictRule((
    Clause("baseline_spike_rate", Direction.ABOVE, 0.0,
           "at this LR the Pre-LN baseline without QK-norm has gradient-norm spikes", OnDivergence.PASSES),
    Clause("combo_spikes_removed", Direction.ABOVE, 0.5,
           "reordered norm + QK-norm together remove more than half the baseline's gradient-norm spikes "
           "(1 - rate(both) / rate(baseline))", OnDivergence.FAILS),
    Clause("best_single_spikes_removed", Direction.BELOW, 0.5,
           "neither change alone removes half of them (the larger of 1 - rate(one change) / rate(baseline))"),
))  # fmt: skip


def cell(name: str) -> tuple[Any, bool]:
    """The placement preset and the QK-norm switch of a label of :data:`CELLS`."""
    if name not in CELLS:
        raise ValueError(f"cell={name!r} is not one of {CELLS}")
    return (reordered_norm() if name.startswith("reordered") else pre_ln()), name.endswith("QK-norm")


def spikes(values: list[float], start: int, window: int, above: Any) -> list[int]:
    """The steps t >= ``start`` where ``above(values[t], median of the previous window)`` holds."""
    return [t for t in range(max(start, window), len(values)) if above(values[t], st.median(values[t - window : t]))]


def one_run(ctx: RunContext, name: str, sizes: dict[str, int]) -> dict[str, Any]:
    placement, qk = cell(name)
    lm = tiny_lm(
        placement, RMSNorm, n_layers=sizes["layers"], d_model=sizes["d_model"], seed=ctx.seed,
        qk_norm=QKNormConfig() if qk else None,
    )  # fmt: skip
    squares: list[float] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda q: squares.append(float(q.grad.double().pow(2).sum())))
        for p in lm.parameters()
    ]
    grad_norms: list[float] = []

    def on_step(_step: int, _model: Any, _loss: float) -> None:
        grad_norms.append(math.sqrt(sum(squares)))
        squares.clear()

    cfg = TrainConfig(
        steps=sizes["steps"], batch=sizes["batch"], seq=sizes["seq"], lr=LR, warmup=sizes["warmup"], clip=1.0
    )
    log = train_lm(lm, byte_data(ctx), cfg, on_step=on_step, progress=lambda msg: ctx.progress(f"{name}: {msg}"))
    for h in handles:
        h.remove()
    w, start = sizes["window"], sizes["warmup"]
    g_spikes = spikes(grad_norms, start, w, lambda v, m: v > SPIKE_RATIO * m)
    l_spikes = spikes(log.losses, start, w, lambda v, m: v > m + LOSS_SPIKE_NATS)
    counted = cfg.steps - max(start, w)
    lost = 0 if log.diverged_at is None else cfg.steps - log.diverged_at
    finite = [v for v in log.losses[-20:] if math.isfinite(v)]
    return {
        "grad_norms": grad_norms, "losses": log.losses, "grad_spikes": g_spikes, "loss_spikes": l_spikes,
        "spike_rate": (len(g_spikes) + lost) / counted, "loss_spike_rate": (len(l_spikes) + lost) / counted,
        "diverged_at": log.diverged_at, "final_loss": sum(finite) / len(finite) if finite else math.nan,
    }  # fmt: skip


def _removed(runs: dict[str, dict[str, Any]], name: str) -> float:
    return 1.0 - runs[name]["spike_rate"] / runs["Pre-LN"]["spike_rate"]


def run(ctx: RunContext) -> Outcome:
    sizes = {
        "steps": ctx.size(400, 60, paper=2000), "batch": ctx.size(16, 8), "seq": ctx.size(64, 32),
        "warmup": ctx.size(40, 10, paper=200), "layers": ctx.size(4, 2, paper=12),
        "d_model": ctx.size(64, 32), "window": ctx.size(50, 10, paper=100),
    }  # fmt: skip
    runs = {name: one_run(ctx, name, sizes) for name in CELLS}
    base, both = runs["Pre-LN"], runs["reordered + QK-norm"]
    statistics: dict[str, Statistic] = {}
    if base["diverged_at"] is not None:
        statistics["baseline_spike_rate"] = Diverged("the Pre-LN baseline's loss", base["diverged_at"])
    else:
        statistics["baseline_spike_rate"] = base["spike_rate"]
    if base["spike_rate"] == 0:
        why = Untested("the Pre-LN baseline had no gradient-norm spike at this LR, so there was nothing to remove")
        statistics["combo_spikes_removed"] = why
        statistics["best_single_spikes_removed"] = why
    else:
        statistics["combo_spikes_removed"] = (
            _removed(runs, "reordered + QK-norm")
            if both["diverged_at"] is None
            else Diverged("reordered + QK-norm's loss", both["diverged_at"])
        )
        statistics["best_single_spikes_removed"] = max(_removed(runs, "Pre-LN + QK-norm"), _removed(runs, "reordered"))
    measured: dict[str, Any] = {"learning_rate": LR}
    for name in CELLS:
        key = name.lower().replace(" + ", "_").replace("-", "_").replace(" ", "_")
        r = runs[name]
        measured[f"grad_spike_rate_{key}"] = r["spike_rate"]
        measured[f"grad_spike_steps_{key}"] = r["grad_spikes"]
        measured[f"loss_spike_count_{key}"] = len(r["loss_spikes"])
        measured[f"max_grad_norm_{key}"] = max(r["grad_norms"], default=math.nan)
        measured[f"median_grad_norm_{key}"] = st.median(r["grad_norms"]) if r["grad_norms"] else math.nan
        measured[f"final_loss_{key}"] = r["final_loss"]
        measured[f"diverged_at_{key}"] = r["diverged_at"]
    series = {
        "training": Series(
            ("cell", "step", "grad_norm_before_clip", "loss", "grad_spike", "loss_spike"),
            [
                (name, t, g, runs[name]["losses"][t], t in runs[name]["grad_spikes"], t in runs[name]["loss_spikes"])
                for name in CELLS
                for t, g in enumerate(runs[name]["grad_norms"])
            ],
        )
    }
    notes = (
        f"{sizes['layers']} layers, d_model {sizes['d_model']}, RMSNorm; byte LM on the stdlib sources; AdamW lr {LR} "
        f"(warm-up {sizes['warmup']}, then constant), betas 0.9/0.95, clip 1.0, {sizes['steps']} steps of "
        f"{sizes['batch']}x{sizes['seq']} bytes. Spike: gradient norm (before clipping) > {SPIKE_RATIO:g}x the median "
        f"of the previous {sizes['window']} steps; loss spike: > {LOSS_SPIKE_NATS} nats above that median. OLMo 2 ran "
        "the ablation at 1B-7B over billions of tokens with a 'spike score' of its own; we count spikes per step "
        "at a tiny scale, so only the direction can compare."
    )
    return Outcome(statistics, measured, series, _figure(ctx, runs, sizes), notes)


def _figure(ctx: RunContext, runs: dict[str, dict[str, Any]], sizes: dict[str, int]) -> Any:
    rate = {n: 100 * runs[n]["spike_rate"] for n in CELLS}
    fig, (a, b) = figure(
        2,
        "Gradient-norm spikes per 100 steps: " + ", ".join(f"{n} {rate[n]:.1f}" for n in CELLS),
        f"seed {ctx.seed}; lr {LR:g}; normatlas experiments run olmo2-ablation{ctx.flag}",
    )
    for i, name in enumerate(CELLS):
        r = runs[name]
        a.plot(range(len(r["grad_norms"])), r["grad_norms"], color=f"C{i}", lw=0.9, label=name)
        a.plot(r["grad_spikes"], [r["grad_norms"][t] for t in r["grad_spikes"]], "v", color=f"C{i}", ms=5)
    a.axvline(max(sizes["warmup"], sizes["window"]), color="0.5", ls=":", lw=1, label="spikes counted from here")
    a.set(xlabel="step", ylabel="global gradient norm before clipping", yscale="log", title="gradient norm (v: spike)")
    x = list(range(len(CELLS)))
    b.bar([i - 0.2 for i in x], [rate[n] for n in CELLS], width=0.4, color="C0", label="gradient-norm spikes")
    b.bar([i + 0.2 for i in x], [100 * runs[n]["loss_spike_rate"] for n in CELLS], width=0.4, color="C3",
          label=f"loss spikes (> {LOSS_SPIKE_NATS} nats)")  # fmt: skip
    b.set_xticks(x, [n.replace(" + ", "\n+ ") for n in CELLS], fontsize=8)
    b.set(ylabel="spikes per 100 steps", title="the 2x2 cells (OLMo 2: only the combination helps)")
    return finish(fig, (a, b), legend_size=7)


EXPERIMENT = Experiment.declare(
    "olmo2-ablation", rule=RULE, estimates_s=estimates(default=240.0, quick=10.0, paper=PAPER_S), run=run
)
