"""Experiment 7: QK-norm against attention entropy collapse, by the small-scale-proxies method (Wortsman et al. 2023).

A learning-rate sweep of a tiny Pre-LN byte LM with and without QK-norm (LayerNorm on q and k per head, before RoPE),
trained alike on the standard library's sources without gradient clipping. The library's
:class:`~normatlas.diagnostics.Monitor` records every layer's largest attention logit and lowest normalised head
entropy, and its default alarms (entropy collapse, output-norm trend, non-finite loss) watch the run; we read when
they first fire against the first loss spike. Wortsman et al.'s LR sensitivity summarises each sweep.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ..blocks import QKNormConfig, pre_ln
from ..diagnostics import Metric, Monitor
from ..presets import LayerNorm
from ..vocabulary import Operator
from ._shared import byte_data, figure, finish
from .base import Experiment, Outcome, RunContext, Series, estimates
from .lm import TrainConfig, tiny_lm, train_lm
from .verdict import Clause, Direction, VerdictRule

VARIANTS = ("no QK-norm", "QK-norm")
UNIFORM_LOSS = math.log(256)  # nats per byte of a uniform guess: a diverged run's loss
SPIKE_NATS = 0.5  # a loss spike: the loss rises this far above its running minimum (or is not finite)


PAPER_S = 1700.0  # paper scale: 12 layers, d_model 64, batches of 8, 2,000 steps at each of 6 learning rates
RULE = VerdictRule((
    Clause("max_logit_top_lr_no_qk_over_qk", Direction.ABOVE, 1.0,
           "at the highest LR the largest attention logit is higher without QK-norm"),
    Clause("min_entropy_top_lr_qk_minus_no_qk", Direction.ABOVE, 0.0,
           "at the highest LR the lowest normalised head entropy is lower without QK-norm"),
    Clause("lr_sensitivity_no_qk_minus_qk", Direction.ABOVE, 0.0,
           "the LR sensitivity (Wortsman et al.) is higher without QK-norm"),
))  # fmt: skip


def _layer_values(mon: Monitor, prefix: str) -> tuple[list[int], list[float], list[float]]:
    """Per measured step: the max and the min over layers of the record keys starting with ``prefix``."""
    steps, hi, lo = [], [], []
    for rec in mon.history.records:
        vals = [v for k, v in rec.items() if k.startswith(prefix) and isinstance(v, float) and math.isfinite(v)]
        if vals:
            steps.append(rec["step"])
            hi.append(max(vals))
            lo.append(min(vals))
    return steps, hi, lo


def spike_step(losses: list[float], after: int) -> int | None:
    """The first step from ``after`` on whose loss is not finite or exceeds the running minimum by SPIKE_NATS."""
    best = math.inf
    for t, v in enumerate(losses):
        if t >= after and (not math.isfinite(v) or v > best + SPIKE_NATS):
            return t
        best = min(best, v)
    return None


def one_run(ctx: RunContext, qk: bool, lr: float, sizes: dict[str, int]) -> dict[str, Any]:
    cfg = TrainConfig(
        steps=sizes["steps"], batch=sizes["batch"], seq=sizes["seq"], lr=lr, warmup=sizes["warmup"], clip=None
    )
    lm = tiny_lm(
        pre_ln(), LayerNorm, n_layers=sizes["layers"], d_model=sizes["d_model"], seed=ctx.seed,
        qk_norm=QKNormConfig(operator=Operator.LAYERNORM) if qk else None,
    )  # fmt: skip
    mon = Monitor(
        lm, every=sizes["every"], metrics=[Metric.ATTENTION, Metric.OUTPUT_NORM], print_alarms=False,
        max_examples=2, per_head=False,
    )  # fmt: skip

    def on_step(_step: int, _model: nn.Module, loss: float) -> None:
        mon.step(loss=loss)

    with mon:
        label = f"{'QK-norm' if qk else 'no QK-norm'}, lr {lr:g}"
        log = train_lm(lm, byte_data(ctx), cfg, on_step=on_step, progress=lambda msg: ctx.progress(f"{label}: {msg}"))
    losses = log.losses
    tail = [v for v in losses[-10:] if math.isfinite(v)]
    final = sum(tail) / len(tail) if log.diverged_at is None and tail else UNIFORM_LOSS
    steps, logit_hi, _ = _layer_values(mon, "attention/max_logit/")
    ent_steps, _, ent_lo = _layer_values(mon, "attention/entropy_norm_min/")
    alarms = sorted(e.step for e in mon.events if e.alarm in ("entropy-collapse", "trend"))
    return {
        "final": min(final, UNIFORM_LOSS), "losses": losses, "steps": steps, "max_logit": logit_hi,
        "entropy_steps": ent_steps, "min_entropy": ent_lo, "first_alarm": alarms[0] if alarms else None,
        "spike": spike_step(losses, sizes["warmup"]), "diverged_at": log.diverged_at,
    }  # fmt: skip


def sensitivity(finals: list[float]) -> float:
    """Wortsman et al.'s LR sensitivity: the mean over the sweep of min(loss, uniform loss) - the best loss."""
    best = min(finals)
    return sum(min(f, UNIFORM_LOSS) - best for f in finals) / len(finals)


def run(ctx: RunContext) -> Outcome:
    sizes = {
        "steps": ctx.size(200, 40, paper=2000), "batch": ctx.size(16, 8, paper=8), "seq": ctx.size(64, 32),
        "warmup": ctx.size(20, 5, paper=200), "layers": ctx.size(4, 2, paper=12),
        "d_model": ctx.size(64, 32), "every": ctx.size(5, 4, paper=20),
    }  # fmt: skip
    lrs = ctx.pick([1e-3, 3e-3, 1e-2, 3e-2, 1e-1], [3e-3, 1e-1], paper=[3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1])
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for v in VARIANTS:
        for lr in lrs:
            runs[v].append(one_run(ctx, v == "QK-norm", lr, sizes))
    top = {v: runs[v][-1] for v in VARIANTS}
    measured: dict[str, Any] = {"learning_rates": lrs}
    for v in VARIANTS:
        key = v.lower().replace("-", "_").replace(" ", "_")
        measured[f"final_loss_{key}"] = [r["final"] for r in runs[v]]
        measured[f"lr_sensitivity_{key}"] = sensitivity([r["final"] for r in runs[v]])
        measured[f"max_attention_logit_top_lr_{key}"] = max(top[v]["max_logit"], default=math.nan)
        measured[f"min_norm_entropy_top_lr_{key}"] = min(top[v]["min_entropy"], default=math.nan)
        measured[f"first_alarm_step_top_lr_{key}"] = top[v]["first_alarm"]
        measured[f"loss_spike_step_top_lr_{key}"] = top[v]["spike"]
        measured[f"diverged_at_per_lr_{key}"] = [r["diverged_at"] for r in runs[v]]
        alarm, spike = top[v]["first_alarm"], top[v]["spike"]
        measured[f"alarm_lead_steps_top_lr_{key}"] = spike - alarm if alarm is not None and spike is not None else None
    m = measured
    statistics = {
        "max_logit_top_lr_no_qk_over_qk": m["max_attention_logit_top_lr_no_qk_norm"]
        / m["max_attention_logit_top_lr_qk_norm"],
        "min_entropy_top_lr_qk_minus_no_qk": m["min_norm_entropy_top_lr_qk_norm"]
        - m["min_norm_entropy_top_lr_no_qk_norm"],
        "lr_sensitivity_no_qk_minus_qk": m["lr_sensitivity_no_qk_norm"] - m["lr_sensitivity_qk_norm"],
    }
    sweep = [
        (v, lr, r["final"], max(r["max_logit"], default=math.nan), min(r["min_entropy"], default=math.nan))
        for v in VARIANTS
        for lr, r in zip(lrs, runs[v], strict=True)
    ]
    trace = []
    for v in VARIANTS:
        entropy = dict(zip(top[v]["entropy_steps"], top[v]["min_entropy"], strict=True))
        trace += [
            (v, s, hi, entropy.get(s, math.nan), top[v]["losses"][s])
            for s, hi in zip(top[v]["steps"], top[v]["max_logit"], strict=True)
        ]
    series = {
        "sweep": Series(("variant", "lr", "final_loss", "max_attention_logit", "min_norm_entropy"), sweep),
        "top_lr": Series(("variant", "step", "max_attention_logit", "min_norm_entropy", "loss"), trace),
    }
    notes = (
        f"{sizes['layers']} Pre-LN layers, d_model {sizes['d_model']}, LayerNorm; QK-norm = LayerNorm per head on q "
        f"and k before RoPE. AdamW (betas 0.9/0.95), warm-up {sizes['warmup']} then constant, no clipping, "
        f"{sizes['steps']} steps of {sizes['batch']}x{sizes['seq']} stdlib bytes; Monitor every {sizes['every']} "
        f"steps. A diverged run counts as the uniform loss ln 256. Spike: loss {SPIKE_NATS} nats above its running "
        "minimum. Wortsman et al. sweep 10M-1.2B-parameter models over 1e-4..1."
    )
    return Outcome(statistics, measured, series, _figure(ctx, runs, lrs, top), notes)


def _title(top: dict[str, Any], lr: float) -> str:
    """What the first seed's top-LR runs show: the largest logit and the lowest head entropy with and without."""
    no, qk = (top[v] for v in VARIANTS)
    logit = [max(r["max_logit"], default=math.nan) for r in (no, qk)]
    ent = [min(r["min_entropy"], default=math.nan) for r in (no, qk)]
    return (f"At lr {lr:g}, largest attention logit {logit[0]:.3g} without QK-norm vs {logit[1]:.3g} with; "
            f"lowest head entropy {ent[0]:.2f} vs {ent[1]:.2f}")  # fmt: skip


def _figure(ctx: RunContext, runs: dict[str, list[dict[str, Any]]], lrs: list[float], top: dict[str, Any]) -> Any:
    fig, (a, b, c) = figure(3, _title(top, lrs[-1]), f"seed {ctx.seed}; normatlas experiments run qk-norm{ctx.flag}")
    for i, v in enumerate(VARIANTS):
        a.plot(lrs, [r["final"] for r in runs[v]], "o-", color=f"C{i}", label=v)
        b.plot(top[v]["steps"], top[v]["max_logit"], color=f"C{i}", label=v)
        c.plot(top[v]["entropy_steps"], top[v]["min_entropy"], color=f"C{i}", label=v)
        for ax in (b, c):
            if top[v]["first_alarm"] is not None:
                ax.axvline(top[v]["first_alarm"], color=f"C{i}", ls=":", lw=1, label=f"{v}: first alarm")
            if top[v]["spike"] is not None:
                ax.axvline(top[v]["spike"], color=f"C{i}", ls="--", lw=1, label=f"{v}: loss spike")
    a.axhline(UNIFORM_LOSS, color="0.5", lw=0.8, ls=":", label="uniform guess (ln 256)")
    a.set(xlabel="peak learning rate", ylabel="final training loss (nats/byte)", title="LR sweep", xscale="log")
    b.set(xlabel="step", ylabel="largest attention logit (any layer)", title=f"lr {lrs[-1]:g}", yscale="log")
    c.set(xlabel="step", ylabel="lowest normalised head entropy", title=f"lr {lrs[-1]:g}")
    return finish(fig, (a, b, c), legend_size=7)


EXPERIMENT = Experiment.declare(
    "qk-norm", rule=RULE, estimates_s=estimates(default=65.0, quick=1.5, paper=PAPER_S), run=run
)
