"""Experiment 8: the last block's output norm as the early warning of a loss divergence (Chameleon).

A tiny Pre-LN byte LM without QK-norm and without the final norm's protection (``final_norm=False``: the
last block's output reaches the tied head unnormalized) first trains at a sane rate until it has settled
(:data:`BURN_IN` steps), then its rate jumps to a too-high one with no gradient clipping, next to a control
that keeps the sane rate. (The first design trained at the high rate from the start: its divergence came inside
the init transient, which no alarm can be judged on, so the run tested nothing; the settle-then-jump design
replaced it before its first run, and its verdict is reported whatever it is.) The library's
:class:`~normatlas.diagnostics.Monitor`
records ``output_norm`` (mean per-token L2 norm of the last block's output) on every step and a
:class:`~normatlas.diagnostics.TrendAlarm` watches it. The alarm step is compared with the loss-spike
step; both are defined below, before any run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..blocks import pre_ln
from ..diagnostics import Monitor, TrendAlarm
from ..presets import RMSNorm
from .base import Experiment, Outcome, RunContext, Series, estimates
from .data import ByteBatches, stdlib_bytes
from .lm import TrainConfig, tiny_lm, train_lm
from .runner import use_agg
from .verdict import Clause, Direction, Statistic, Untested, VerdictRule

HIGH_LR, CONTROL_LR = 1e-1, 3e-3  # the high rate: the top of experiment 7's sweep, where attention collapses
WARMUP = 10
BURN_IN = 100  # steps at the sane rate before the jump; they are not watched (the init transient is in them)
SPIKE_NATS = 1.0  # a spike: the loss exceeds the best 5-step running mean so far by this much (or is non-finite)
ALARM_WINDOW, ALARM_GROWTH = 8, 2.0  # TrendAlarm: output_norm grew x2 over the last 8 records


@dataclass
class _Run:
    losses: list[float]
    norms: list[float]
    alarm: int | None
    spike: int | None


PAPER_S = 300.0  # paper scale: 3,000 steps (the set-up is the same sudden LR jump; see docs/experiments.md)
RULE = VerdictRule((
    Clause("lead_steps", Direction.ABOVE, 0.0,
           f"after the jump to lr {HIGH_LR:g} at step {BURN_IN}, a TrendAlarm (output norm x{ALARM_GROWTH:g} over "
           f"{ALARM_WINDOW} records) fires strictly before the first loss spike (> {SPIKE_NATS:g} nat above the best "
           "5-step mean, or non-finite): lead in steps, no alarm counts as 0"),
))  # fmt: skip


def spike_step(losses: list[float], start: int = BURN_IN, nats: float = SPIKE_NATS, window: int = 5) -> int | None:
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


def _train(lr: float, steps: int, data: ByteBatches, seed: int) -> _Run:
    model = tiny_lm(pre_ln(), RMSNorm, n_layers=2, d_model=64, seed=seed, final_norm=False)
    alarm = TrendAlarm("output_norm", window=ALARM_WINDOW, growth=ALARM_GROWTH, once=False)
    mon = Monitor(model, every=1, metrics=["output_norm"], alarms=[], print_alarms=False)
    fired: list[int] = []

    def on_step(step: int, _model: object, loss: float) -> None:
        mon.step(loss=loss)
        if step >= BURN_IN:  # the alarm sees only the watched steps, so the init transient cannot trip it
            record = {"output_norm": mon.history.records[-1]["output_norm"]}
            fired.extend(e.step for e in alarm.check(step, record))

    jump = None if lr == CONTROL_LR else (BURN_IN, lr)
    cfg = TrainConfig(steps=steps, lr=CONTROL_LR, clip=None, warmup=WARMUP, schedule="constant", jump=jump)
    log = train_lm(model, data, cfg, on_step=on_step)
    mon.detach()
    norms = [float(v) for v in mon.history.series("output_norm")[1]]
    return _Run(log.losses, norms, min(fired) if fired else None, spike_step(log.losses))


def early(r: _Run) -> dict[str, float | int]:
    """What happened in the unwatched steps: the largest loss and its step, and the first step the output norm
    reached 10x its initial value (descriptive; the verdict does not use it)."""
    window = r.losses[:BURN_IN]
    peak = max(range(len(window)), key=window.__getitem__)
    rise = next((i for i, v in enumerate(r.norms[:BURN_IN]) if v > 10 * r.norms[0]), -1)
    return {"max_loss": window[peak], "max_loss_step": peak, "norm_x10_step": rise}


def _figure(runs: dict[str, _Run]) -> object:
    plt = use_agg()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    fig.suptitle(
        "Claim: the last block's output norm climbs before the loss spikes (tiny Pre-LN byte LM, no final norm)"
    )
    for (name, r), color in zip(runs.items(), ("tab:red", "tab:blue"), strict=True):
        axes[0].plot(r.losses, color=color, label=f"{name}: training loss")
        axes[1].semilogy(r.norms, color=color, label=f"{name}: output norm")
        for ax in axes:
            if r.alarm is not None:
                ax.axvline(r.alarm, color=color, linestyle="--", label=f"{name}: alarm (step {r.alarm})")
            if r.spike is not None:
                ax.axvline(r.spike, color=color, linestyle=":", label=f"{name}: loss spike (step {r.spike})")
    axes[0].set(xlabel="step", ylabel="loss (nats/byte)", title="training loss")
    axes[1].set(xlabel="step", ylabel="mean token L2 norm (log)", title="last block's output norm (Monitor)")
    for ax in axes:
        ax.axvspan(0, BURN_IN, color="grey", alpha=0.15, label=f"steps 0-{BURN_IN}: lr {CONTROL_LR:g}, not watched")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def run(ctx: RunContext) -> Outcome:
    steps = ctx.size(300, BURN_IN + 40, paper=3000)
    data = ByteBatches(stdlib_bytes(ctx.size(1_000_000, 200_000)), ctx.seed)
    runs = {}
    for name, lr in (
        (f"lr {CONTROL_LR:g} -> {HIGH_LR:g} at step {BURN_IN}", HIGH_LR),
        (f"control lr {CONTROL_LR:g}", CONTROL_LR),
    ):
        ctx.progress(f"training at {name}")
        runs[name] = _train(lr, steps, data, ctx.seed)
    high, control = runs[f"lr {CONTROL_LR:g} -> {HIGH_LR:g} at step {BURN_IN}"], runs[f"control lr {CONTROL_LR:g}"]
    lead = None if high.alarm is None or high.spike is None else high.spike - high.alarm
    measured = {
        "alarm_step": high.alarm, "spike_step": high.spike, "lead_steps": lead,
        "lead_share_of_run_to_spike": None if lead is None or not high.spike else lead / high.spike,
        "control_alarm_step": control.alarm, "control_spike_step": control.spike, "steps": steps,
        "max_output_norm": max(high.norms), "control_max_output_norm": max(control.norms),
        "unwatched_steps": early(high), "control_unwatched_steps": early(control),
    }  # fmt: skip
    rows = [(n, i, loss, r.norms[i] if i < len(r.norms) else None) for n, r in runs.items()
            for i, loss in enumerate(r.losses)]  # fmt: skip
    notes = (f"2 layers, d_model 64, RMSNorm Pre-LN, final_norm=False, no QK-norm, AdamW, no clipping, "
             f"{steps} steps of batch 16 x 64 bytes, lr {CONTROL_LR:g} for {BURN_IN} steps then {HIGH_LR:g} (the "
             f"control stays at {CONTROL_LR:g}); the paper's 7B/34B runs diverged after many thousand steps. "
             f"Steps before {BURN_IN} are not counted for alarms or spikes.")  # fmt: skip
    if high.spike is None:
        notes += " The run did not spike after the jump at this scale."
    statistic: Statistic
    if high.spike is None:
        statistic = Untested(
            f"the lr {HIGH_LR:g} run did not spike within {steps} steps, so there was nothing to warn of"
        )
    else:
        statistic = float(lead) if lead is not None else 0.0  # no alarm before the spike: no warning, lead 0
    return Outcome(
        statistics={"lead_steps": statistic}, measured=measured,
        series={"curves": Series(("run", "step", "loss", "output_norm"), rows)},
        figure=_figure(runs), notes=notes,
    )  # fmt: skip


EXPERIMENT = Experiment(
    name="output-norm-warning",
    number=8,
    title="Output norm as the early warning",
    claim="The last block's output norm climbs before the loss diverges, so an alarm on it fires ahead of the spike",
    guide_words="monitoring the L2 norm of the final transformer layer's output predicted loss divergence 20–30% of "
    "training in advance. The loss curve looked fine; the output norm was already climbing.",
    anchor="chameleon2024",
    anchor_reports="Chameleon reports that the final layer's output norm grew and predicted divergence 20-30% of "
    "training in advance (as the guide quotes it), in 7B/34B mixed-modal runs.",
    rule=RULE,
    estimates_s=estimates(default=10.0, quick=5.0, paper=PAPER_S),
    run=run,
)
