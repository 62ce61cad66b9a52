"""Experiment 8: the last block's output norm as the early warning of a loss divergence (Chameleon).

What Chameleon reports (arXiv 2405.09818): monitoring the L2 norm of the last transformer layer's
output predicted training divergence, and the divergence itself can appear only after 20-30% of training has
passed. The guide reads the second number as a *warning lead* ("predicted loss divergence 20-30% of training in
advance"); the paper's 20-30% is *when* divergence showed up, not how far ahead the norm warned. We test the
norm-leads-the-loss part and draw both numbers beside ours.

A slow instability, so a lead is possible at all. A tiny Pre-LN byte LM without QK-norm and without the final
norm (``final_norm=False``: the last block's output reaches the tied head unnormalized, so its norm is the logit
scale) trains with AdamW and no gradient clipping while its learning rate ramps geometrically from
:data:`START_LR` to :data:`END_LR` over the run (after a short warm-up), next to a control at a flat
:data:`START_LR`. The library's :class:`~normatlas.diagnostics.Monitor` records ``output_norm`` (mean per-token L2
norm of the last block's output) every step; a :class:`~normatlas.diagnostics.TrendAlarm` watches it with a slow
window (a tenth of the run). (The previous design jumped the rate at once from 3e-3 to 0.1 after 100 steps: norm
and loss blew up in the same few steps, the alarm came 2 steps after the spike at every seed, and the set-up could
not show a slow warning; this ramp replaced it before its first run.) Everything below is fixed before any run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..blocks import pre_ln
from ..diagnostics import Monitor, TrendAlarm
from ..presets import RMSNorm
from .base import Experiment, Outcome, RunContext, Series, estimates
from .data import ByteBatches, stdlib_bytes
from .lm import TrainConfig, tiny_lm, train_lm
from .runner import use_agg
from .verdict import Clause, Direction, Diverged, Statistic, Untested, VerdictRule

START_LR, END_LR = 1e-3, 0.3  # geometric ramp: x300 over the run (x1.77 per tenth); the control stays at START_LR
WARMUP = 10
WATCH_FROM = 0.1  # the first tenth of the run is not watched for alarms or spikes (the init transient)
SPIKE_NATS = 1.0  # a spike: the loss exceeds the best 5-step running mean so far by this much (or is non-finite)
ALARM_SHARE, ALARM_GROWTH = 0.1, 2.0  # TrendAlarm: output_norm's log-linear fit grew x2 over the last tenth of the run
MIN_LEAD = 0.02  # the alarm must lead the spike by more than 2% of the run (not fire in the same few steps)
CHAMELEON_DIVERGENCE_SHARE = (0.2, 0.3)  # the paper: divergence can appear after 20-30% of training
PAPER_S = 600.0  # paper scale: 3,000 steps, 4 layers, d_model 128


@dataclass(frozen=True)
class RampConfig(TrainConfig):
    """:class:`~.lm.TrainConfig` whose rate, after the linear warm-up, grows geometrically from ``lr`` at the end of
    the warm-up to ``end_lr`` at the last step."""

    end_lr: float = END_LR

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - 1 - self.warmup)
        return self.lr * (self.end_lr / self.lr) ** t


@dataclass
class _Run:
    losses: list[float]
    norms: list[float]
    lrs: list[float]
    alarm: int | None  # the first alarm in the watched steps
    spike: int | None
    diverged_at: int | None


RULE = VerdictRule((
    Clause("lead_share_of_run", Direction.ABOVE, MIN_LEAD,
           f"under a geometric LR ramp {START_LR:g} -> {END_LR:g}, a TrendAlarm on the last block's output norm "
           f"(x{ALARM_GROWTH:g} over a tenth of the run) fires before the first loss spike (> {SPIKE_NATS:g} nat above "
           "the best 5-step mean, or non-finite), by more than 2% of the run (lead / steps; no alarm counts as 0)"),
    Clause("control_alarm_fired", Direction.BELOW, 0.5,
           f"the same alarm stays silent in the control at a flat lr {START_LR:g} (1 if it fired, else 0)",
           ),
))  # fmt: skip


def spike_step(losses: list[float], start: int = 0, nats: float = SPIKE_NATS, window: int = 5) -> int | None:
    """The first step >= ``start`` whose loss is non-finite or exceeds the best running mean so far by ``nats``."""
    best = math.inf
    for i in range(start, len(losses)):
        if not math.isfinite(losses[i]):
            return i
        if i >= start + window:
            best = min(best, sum(losses[i - window : i]) / window)
        if losses[i] > best + nats:
            return i
    return None


def _train(
    cfg: TrainConfig, data: ByteBatches, seed: int, layers: int, width: int, ctx: RunContext, label: str
) -> _Run:
    model = tiny_lm(pre_ln(), RMSNorm, n_layers=layers, d_model=width, seed=seed, final_norm=False)
    watch = int(WATCH_FROM * cfg.steps)
    alarm = TrendAlarm("output_norm", window=max(3, int(ALARM_SHARE * cfg.steps)), growth=ALARM_GROWTH, once=True)
    mon = Monitor(model, every=1, metrics=["output_norm"], alarms=[], print_alarms=False)
    fired: list[int] = []

    def on_step(step: int, _model: object, loss: float) -> None:
        mon.step(loss=loss)
        if step >= watch:  # the alarm sees only the watched steps, so the init transient cannot trip it
            fired.extend(e.step for e in alarm.check(step, {"output_norm": mon.history.records[-1]["output_norm"]}))

    log = train_lm(model, data, cfg, on_step=on_step, progress=lambda m: ctx.progress(f"{label}: {m}"))
    mon.detach()
    norms = [float(v) for v in mon.history.series("output_norm")[1]]
    return _Run(log.losses, norms, [cfg.lr_at(i) for i in range(len(log.losses))], min(fired) if fired else None,
                spike_step(log.losses, start=watch), log.diverged_at)  # fmt: skip


def _title(ramp: _Run, control: _Run, steps: int) -> str:
    """What the first seed's runs show, in one line (computed from them)."""
    if ramp.spike is None:
        return f"The LR ramp to {END_LR:g} never spiked in {steps} steps: there was nothing to warn of"
    at = f"loss spiked at {ramp.spike / steps:.0%} of the run"
    if ramp.alarm is None or ramp.alarm >= ramp.spike:
        late = "no alarm" if ramp.alarm is None else f"the alarm came {ramp.alarm - ramp.spike} steps after it"
        return f"The output norm did not warn: {at}, {late}"
    lead = f"{(ramp.spike - ramp.alarm) / steps:.0%} of the run ({ramp.spike - ramp.alarm} steps)"
    if control.alarm is not None:
        return f"The alarm fired {lead} before the spike, but also in the stable control: a false alarm"
    return f"The output-norm alarm led the loss spike by {lead}; the control stayed silent"


def _figure(runs: dict[str, _Run], steps: int, caption: str) -> Any:
    plt = use_agg()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    ramp, control = runs.values()
    fig.suptitle(_title(ramp, control, steps), fontsize=11)
    pct = 100 / steps
    for (name, r), color in zip(runs.items(), ("tab:red", "tab:blue"), strict=True):
        x = [i * pct for i in range(len(r.losses))]
        axes[0].plot(x, r.losses, color=color, lw=1, label=name)
        axes[1].semilogy([i * pct for i in range(len(r.norms))], r.norms, color=color, lw=1, label=name)
        for ax in axes:
            if r.alarm is not None:
                ax.axvline(r.alarm * pct, color=color, ls="--", lw=1.2, label=f"{name}: alarm ({r.alarm * pct:.0f}%)")
            if r.spike is not None:
                at = f"{name}: loss spike ({r.spike * pct:.0f}%)"
                ax.axvline(r.spike * pct, color=color, ls=":", lw=1.5, label=at)
    lo, hi = (100 * v for v in CHAMELEON_DIVERGENCE_SHARE)
    for ax in axes:
        ax.axvspan(0, 100 * WATCH_FROM, color="0.85", alpha=0.6, label="not watched (init transient)")
        ax.axvspan(lo, hi, color="tab:green", alpha=0.15,
                   label="Chameleon: divergence can appear after 20-30% of training (7B/34B)")  # fmt: skip
    if ramp.spike is not None:
        s = ramp.spike * pct
        axes[1].axvspan(max(0, s - hi), max(0, s - lo), facecolor="none", edgecolor="tab:purple", hatch="//",
                        label="the guide's reading: a warning 20-30% of training ahead")  # fmt: skip
    finite = [v for r in runs.values() for v in r.losses if math.isfinite(v)]
    axes[0].set_ylim(0, min(12.0, max(finite, default=6.0)) * 1.05)
    axes[0].set(xlabel="training progress (% of steps)", ylabel="training loss (nats/byte)", title="loss")
    axes[1].set(xlabel="training progress (% of steps)", ylabel="mean token L2 norm (log scale)",
                title="last block's output norm (Monitor)")  # fmt: skip
    twin = axes[0].twinx()
    twin.semilogy([i * pct for i in range(len(ramp.lrs))], ramp.lrs, color="0.4", lw=0.8)
    twin.set_ylabel("ramped learning rate (grey, log)", color="0.4", fontsize=8)
    handles, labels = axes[1].get_legend_handles_labels()
    extra = [(h, lab) for h, lab in zip(*axes[0].get_legend_handles_labels(), strict=True) if lab not in labels]
    fig.legend(handles + [h for h, _ in extra], labels + [lab for _, lab in extra], fontsize=8, ncol=3,
               loc="upper center", bbox_to_anchor=(0.5, 0.0))  # fmt: skip
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.text(0.5, -0.2, caption, ha="center", fontsize=8, color="0.35")
    return fig


def run(ctx: RunContext) -> Outcome:
    steps = ctx.size(600, 150, paper=3000)
    layers, width = ctx.size(2, 2, paper=4), ctx.size(64, 64, paper=128)
    data = ByteBatches(stdlib_bytes(ctx.size(1_000_000, 200_000)), ctx.seed)
    ramp_name, control_name = f"lr {START_LR:g} -> {END_LR:g} (ramp)", f"control: lr {START_LR:g}"
    cfgs = {
        ramp_name: RampConfig(steps=steps, lr=START_LR, end_lr=END_LR, clip=None, warmup=WARMUP),
        control_name: TrainConfig(steps=steps, lr=START_LR, clip=None, warmup=WARMUP, schedule="constant"),
    }
    runs = {name: _train(cfg, data, ctx.seed, layers, width, ctx, name) for name, cfg in cfgs.items()}
    ramp, control = runs[ramp_name], runs[control_name]
    lead = None if ramp.alarm is None or ramp.spike is None else ramp.spike - ramp.alarm
    measured = {
        "steps": steps, "alarm_step": ramp.alarm, "spike_step": ramp.spike, "lead_steps": lead,
        "lead_share_of_run": None if lead is None else lead / steps,
        "spike_share_of_run": None if ramp.spike is None else ramp.spike / steps,
        "lr_at_spike": None if ramp.spike is None else ramp.lrs[ramp.spike],
        "lr_at_alarm": None if ramp.alarm is None else ramp.lrs[ramp.alarm],
        "ramp_diverged_at": ramp.diverged_at, "control_alarm_step": control.alarm,
        "control_spike_step": control.spike, "max_output_norm": max(ramp.norms),
        "control_max_output_norm": max(control.norms),
        "chameleon_divergence_share": list(CHAMELEON_DIVERGENCE_SHARE),
    }  # fmt: skip
    rows = [(n, i, r.lrs[i], loss, r.norms[i] if i < len(r.norms) else None) for n, r in runs.items()
            for i, loss in enumerate(r.losses)]  # fmt: skip
    notes = (
        f"{layers} layers, d_model {width}, RMSNorm Pre-LN, final_norm=False, no QK-norm, AdamW, no clipping, "
        f"{steps} steps of batch 16 x 64 bytes; lr warms up to {START_LR:g} in {WARMUP} steps, then grows "
        f"geometrically to {END_LR:g} at the last step (the control stays at {START_LR:g}). The first "
        f"{WATCH_FROM:.0%} of the run is not watched. Chameleon's finding: the last layer's output norm predicted "
        "divergence, which can appear after 20-30% of training (7B/34B mixed-modal runs over many thousand steps); "
        "the guide reads the 20-30% as the warning's lead, which the paper does not say. Our lead is reported as a "
        "share of the run beside both numbers; the paper gives no lead to compare it with."
    )
    lead_stat: Statistic
    if ramp.spike is None:
        lead_stat = Untested(f"the ramped run did not spike within {steps} steps, so there was nothing to warn of")
    else:
        lead_stat = 0.0 if lead is None else lead / steps  # no alarm at all: no warning, lead 0
    control_stat: Statistic = 1.0 if control.alarm is not None else 0.0
    if control.diverged_at is not None:
        control_stat = Diverged("the control run's loss", control.diverged_at)
    caption = f"seed {ctx.seed}; normatlas experiments run output-norm-warning{ctx.flag}"
    return Outcome(
        statistics={"lead_share_of_run": lead_stat, "control_alarm_fired": control_stat}, measured=measured,
        series={"curves": Series(("run", "step", "lr", "loss", "output_norm"), rows)},
        figure=_figure(runs, steps, caption), notes=notes,
    )  # fmt: skip


EXPERIMENT = Experiment.declare(
    "output-norm-warning", rule=RULE, estimates_s=estimates(default=40.0, quick=10.0, paper=PAPER_S), run=run
)
