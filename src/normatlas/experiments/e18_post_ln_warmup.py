"""Experiment 18: Post-LN needs a learning-rate warm-up, more so as it deepens; Pre-LN trains without one.

The guide: "Gradient magnitude at layer ℓ decays roughly as O(1/√ℓ) going backwards, which is why the original
transformer needed a learning-rate warmup and why deep Post-LN models are notoriously fragile. Pre-LN [...] trains
without warmup, it survives depth". Xiong et al. (2020) explain the warm-up: at initialisation Post-LN's gradients
near the output are large, so the full learning rate from step 0 destabilises training.

Byte LMs with Xiong et al.'s blocks (experiment 4's: ReLU FFN, LayerNorm, Xavier-scale init, a final norm in Pre-LN
only) at several depths, each trained twice from the same init on the same batches: with a linear warm-up over the
first tenth of the steps, and without (the full rate from step 0). The optimiser is the original Transformer's Adam
(betas 0.9 / 0.98, no gradient clipping, no weight decay) with its learning-rate schedule: peak 1e-3 (the larger of
the two rates Xiong et al. report Post-LN failing at without warm-up), decaying as the inverse square root of the
step from the end of the warm-up's tenth on. The run without warm-up holds the peak over that tenth and then decays
alike, so the two runs differ in the first tenth only. Every number of the set-up is fixed here, before a run.
Per run: the held-out loss at the end (or the step the loss went non-finite), the step a run that had trained fell
back to the unigram level (if it did), and each block's gradient norm at the first step (the no-warm-up run's
step 0: the gradient the full rate meets).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ._shared import byte_data, figure, finish, smooth
from .base import Experiment, Outcome, RunContext, Series, estimates
from .e04_gradient_depth import fit
from .e04_gradient_depth import model as xiong_model
from .lm import TrainConfig, evaluate_lm, train_lm
from .verdict import Clause, Direction, Diverged, OnDivergence, Statistic, Untested, VerdictRule

KINDS = ("Post-LN", "Pre-LN")
ARMS = ("no warm-up", "warm-up")
LR, BETAS = 1e-3, (0.9, 0.98)
WARMUP_SHARE = 0.1
GAP = 0.1  # nats/byte: "needs a warm-up" = training without one ends at least this much worse
PRE_LN_SLACK = 0.05  # nats/byte: "trains without warm-up" = at most this much worse without one
STALLED = 0.97  # a held-out loss above this share of the unigram entropy: the run learned (almost) no context
DIES_ABOVE = 20  # layers: the guide's Post-LN "dies above ~20 layers without help"
SCHEDULE = "inverse-sqrt"  # the original Transformer's decay after the warm-up's tenth, in both arms
WINDOW = 100  # steps: the training-loss mean that says whether a run has trained or fallen back
PAPER_S = 2600.0  # paper scale: depths 6, 12, 24, 2,000 steps, four runs per depth (one of three workers on 2 cores)
# The rule since 2026-12-07 (the first rule decided every Post-LN clause at the deepest depth, 24 at paper scale,
# and asked the warm-up to make it train there; the guide says Post-LN "dies above ~20 layers without help"). The
# warm-up's clauses are now decided at the deepest depth of at most 20 layers, and the guide's "dies above ~20
# layers" is its own clause; decided on fresh seeds 3-5, docs/experiments.md has both rules' runs. The schedule since
# 2026-12-07 (stop 45): both rules' runs used a constant 1e-3 after the warm-up, under which the 12-layer warm-up run
# trained and then fell back to the unigram level; the decaying schedule is the one Xiong et al. train with.
RULE = VerdictRule((
    Clause("post_ln_gap_under_20", Direction.ABOVE, GAP,
           "at the deepest depth of at most 20 layers, Post-LN trained without warm-up ends worse than with it "
           "(held-out loss, nats/byte; a diverged no-warm-up run passes)", OnDivergence.PASSES),
    Clause("post_ln_gap_growth", Direction.ABOVE, 0.0,
           "Post-LN's no-warm-up penalty grows with depth (at that depth minus at the shallowest; that depth "
           "diverging alone passes)", OnDivergence.PASSES),
    Clause("post_ln_warmup_under_20_over_unigram", Direction.BELOW, STALLED,
           "with warm-up that Post-LN trains: its held-out loss is below 97% of the bytes' unigram entropy",
           OnDivergence.FAILS),
    Clause("post_ln_warmup_over_20_over_unigram", Direction.ABOVE, STALLED,
           "above 20 layers Post-LN dies even with warm-up: its held-out loss stays at the unigram level (97% of "
           "the entropy or more; a divergence passes)", OnDivergence.PASSES),
    Clause("pre_ln_gap_deepest", Direction.BELOW, PRE_LN_SLACK,
           "the deepest Pre-LN trains without warm-up (at most 0.05 nats/byte worse than with it)",
           OnDivergence.FAILS),
))  # fmt: skip


def unigram_entropy(data: torch.Tensor) -> float:
    """The bytes' unigram entropy (nats): the loss of a model that knows byte frequencies and no context."""
    p = torch.bincount(data.flatten(), minlength=256).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def block_grad_norms(lm: nn.Module) -> list[float]:
    """The gradient norm of each block's parameters (all of them), from the ``.grad`` the last backward left."""
    out = []
    for block in lm.blocks():  # type: ignore[operator]
        sq = sum(float(p.grad.double().pow(2).sum()) for p in block.parameters() if p.grad is not None)
        out.append(math.sqrt(sq))
    return out


def warmup_depth(depths: tuple[int, ...]) -> int:
    """The depth the warm-up's clauses read: the deepest of at most DIES_ABOVE layers."""
    return max(d for d in depths if d <= DIES_ABOVE)


def fell_back_at(losses: list[float], h1: float) -> int | None:
    """The first step of the first WINDOW-step mean at the unigram level (>= STALLED * h1) after the run's best
    window, when that best window was below it (the run had trained); None when it never trained or stayed trained."""
    means = [sum(losses[i : i + WINDOW]) / WINDOW for i in range(0, len(losses) - WINDOW + 1, WINDOW)]
    if not means or not all(math.isfinite(m) for m in means):
        return None
    best = min(range(len(means)), key=means.__getitem__)
    if means[best] >= STALLED * h1:
        return None
    return next((i * WINDOW for i in range(best + 1, len(means)) if means[i] >= STALLED * h1), None)


def arm_config(arm: str, steps: int, batch: int, seq: int) -> TrainConfig:
    """The arm's optimiser settings: a linear warm-up over the first tenth (``'warm-up'``) or the peak rate over it
    (``'no warm-up'``), then in both the same inverse-square-root decay."""
    tenth = max(1, round(WARMUP_SHARE * steps))
    return TrainConfig(
        steps=steps, batch=batch, seq=seq, lr=LR, betas=BETAS, clip=None, weight_decay=0.0,
        warmup=tenth if arm == "warm-up" else 0, schedule=SCHEDULE, decay_start=tenth,
    )  # fmt: skip


def train_arm(ctx: RunContext, kind: str, depth: int, arm: str, steps: int, batch: int, seq: int) -> dict[str, Any]:
    data = byte_data(ctx)
    lm = xiong_model(ctx, kind, depth, ctx.size(64, 32))
    cfg = arm_config(arm, steps, batch, seq)
    first: list[float] = []

    def on_step(step: int, model: nn.Module, _loss: float) -> None:
        if step == 0:
            first.extend(block_grad_norms(model))

    log = train_lm(lm, data, cfg, on_step=on_step, progress=lambda m: ctx.progress(f"{kind} {depth} {arm}: {m}"))
    held: float | None = None
    if log.diverged_at is None:
        held = evaluate_lm(lm, data, batch=ctx.size(32, 8), seq=seq)
        if not math.isfinite(held):  # trained to the end with finite losses, but the held-out loss is not finite
            held, log.diverged_at = None, steps
    return {"losses": log.losses, "diverged_at": log.diverged_at, "held_out": held, "first_grads": first}


def _gap(runs: dict[tuple[str, int, str], dict[str, Any]], kind: str, depth: int) -> Statistic:
    """No-warm-up held-out loss minus warm-up's; a Diverged when the no-warm-up run diverged; Untested when the
    warm-up run did (then the set-up cannot say what the warm-up buys)."""
    cold, warm = runs[(kind, depth, "no warm-up")], runs[(kind, depth, "warm-up")]
    if warm["diverged_at"] is not None:
        return Untested(f"{kind} at depth {depth} diverged with warm-up too (step {warm['diverged_at']})")
    if cold["diverged_at"] is not None:
        return Diverged(f"{kind} at depth {depth} without warm-up", cold["diverged_at"])
    return float(cold["held_out"] - warm["held_out"])


def _over_unigram(runs: dict[tuple[str, int, str], dict[str, Any]], depth: int, h1: float) -> Statistic:
    """The warm-up Post-LN's held-out loss at ``depth`` over the unigram entropy, or the step it diverged."""
    warm = runs[("Post-LN", depth, "warm-up")]
    if warm["diverged_at"] is not None:
        return Diverged(f"Post-LN at depth {depth} with warm-up", warm["diverged_at"])
    return float(warm["held_out"] / h1)


def run(ctx: RunContext) -> Outcome:
    depths = ctx.pick((3, 12), (2, 4), paper=(6, 12, 24))
    steps, batch, seq = ctx.size(600, 30, paper=2000), 8, ctx.size(64, 32)
    data = byte_data(ctx)
    h1 = unigram_entropy(data.train_data)
    runs = {
        (kind, depth, arm): train_arm(ctx, kind, depth, arm, steps, batch, seq)
        for depth in depths
        for kind in KINDS
        for arm in ARMS
    }
    deep, shallow = depths[-1], depths[0]
    mid = warmup_depth(depths)
    gaps = {(k, d): _gap(runs, k, d) for k in KINDS for d in depths}
    statistics: dict[str, Statistic] = {"post_ln_gap_under_20": gaps[("Post-LN", mid)]}
    g_mid, g_shallow = gaps[("Post-LN", mid)], gaps[("Post-LN", shallow)]
    if mid == shallow:
        statistics["post_ln_gap_growth"] = Untested(f"one depth of at most {DIES_ABOVE} layers ({mid}): no growth")
    elif isinstance(g_mid, float) and isinstance(g_shallow, float):
        statistics["post_ln_gap_growth"] = g_mid - g_shallow
    elif isinstance(g_mid, Diverged) and isinstance(g_shallow, float):
        statistics["post_ln_gap_growth"] = g_mid  # the deeper one alone diverged: the gap grew
    else:
        statistics["post_ln_gap_growth"] = Untested(
            f"the depth-{shallow} and depth-{mid} Post-LN penalties cannot be compared ({g_shallow!r}, {g_mid!r})"
        )
    statistics["post_ln_warmup_under_20_over_unigram"] = _over_unigram(runs, mid, h1)
    statistics["post_ln_warmup_over_20_over_unigram"] = (
        _over_unigram(runs, deep, h1)
        if deep > DIES_ABOVE
        else Untested(f"no depth above {DIES_ABOVE} layers at this scale (depths {list(depths)})")
    )
    pre = gaps[("Pre-LN", deep)]
    cold_pre = runs[("Pre-LN", deep, "no warm-up")]
    statistics["pre_ln_gap_deepest"] = (
        Diverged(f"Pre-LN at depth {deep} without warm-up", cold_pre["diverged_at"])
        if cold_pre["diverged_at"] is not None
        else pre
    )
    measured: dict[str, Any] = {"depths": list(depths), "steps": steps, "unigram_entropy_nats": h1}
    for (kind, depth, arm), r in runs.items():
        key = f"{kind.lower().replace('-', '_')}_{depth}_{arm.replace(' ', '_').replace('-', '_')}"
        measured[f"held_out_{key}"] = r["held_out"]
        measured[f"diverged_at_{key}"] = r["diverged_at"]
        measured[f"fell_back_at_{key}"] = fell_back_at(r["losses"], h1)
    for kind in KINDS:
        g = runs[(kind, deep, "no warm-up")]["first_grads"]
        back = list(range(len(g), 0, -1))
        slope, _, r2 = fit(back, g)
        key = kind.lower().replace("-", "_")
        measured[f"step0_grad_last_over_first_block_{key}"] = g[-1] / g[0]
        measured[f"step0_grad_backward_slope_{key}"], measured[f"step0_grad_backward_fit_r2_{key}"] = slope, r2
    rows = [
        (kind, depth, arm, step, loss)
        for (kind, depth, arm), r in runs.items()
        for step, loss in enumerate(r["losses"])
    ]  # fmt: skip
    grads = [
        (kind, depth, i + 1, g)
        for (kind, depth, arm), r in runs.items()
        if arm == "no warm-up"
        for i, g in enumerate(r["first_grads"])
    ]  # fmt: skip
    series = {
        "loss": Series(("placement", "depth", "arm", "step", "train_loss"), rows),
        "step0_grads": Series(("placement", "depth", "block", "grad_norm"), grads),
        "held_out": Series(
            ("placement", "depth", "arm", "held_out_loss", "diverged_at"),
            [(k, d, a, r["held_out"], r["diverged_at"]) for (k, d, a), r in runs.items()],
        ),
    }
    notes = (
        f"byte LMs with Xiong et al.'s blocks (ReLU FFN, LayerNorm, Xavier-scale init; experiment 4's), d_model "
        f"{ctx.size(64, 32)}, depths {list(depths)}, Adam peak lr {LR} betas {BETAS}, no clipping, no weight decay, "
        f"{steps} steps of {batch}x{seq} stdlib bytes; warm-up = linear over the first {WARMUP_SHARE:.0%} of the "
        f"steps (without: the peak over them); then, in both, the rate decays as 1/sqrt(step). Held-out loss on "
        f"{ctx.size(32, 8)}x{seq} bytes; unigram entropy of the training bytes {h1:.3f} "
        "nats. Xiong et al. train 6-layer translation Transformers on IWSLT14 / WMT14."
    )
    return Outcome(statistics, measured, series, _figure(ctx, runs, depths, h1), notes)


def _title(runs: dict[tuple[str, int, str], dict[str, Any]], depths: tuple[int, ...], h1: float) -> str:
    """What the first seed's runs show at the warm-up clauses' depth (the deepest of at most 20 layers) and at the
    deepest: a divergence, a stall at the unigram level, or the warm-up's gap."""
    deep = depths[-1]
    mid = warmup_depth(depths)

    def say(kind: str, depth: int) -> str:
        cold, warm = runs[(kind, depth, "no warm-up")], runs[(kind, depth, "warm-up")]
        if cold["diverged_at"] is not None:
            return f"{kind} without warm-up diverges (step {cold['diverged_at']})"
        if warm["diverged_at"] is not None:
            return f"{kind} diverges even with warm-up (step {warm['diverged_at']})"
        stalled = [arm for arm, r in (("without", cold), ("with", warm)) if r["held_out"] >= STALLED * h1]
        back = {arm: at for arm, r in (("without", cold), ("with", warm)) if (at := fell_back_at(r["losses"], h1))}
        if back:
            arm, at = next(iter(back.items()))
            return f"{kind} {arm} warm-up trains, then falls back to the unigram level (step ~{at})"
        if len(stalled) == 2:
            return f"{kind} stalls at the unigram level with and without warm-up"
        if stalled:
            return f"{kind} stalls at the unigram level {stalled[0]} warm-up only"
        d = cold["held_out"] - warm["held_out"]
        return f"{kind} without warm-up ends {abs(d):.2f} nats/byte {'worse' if d > 0 else 'better'}"

    if mid == deep:
        return f"At {deep} layers: {say('Post-LN', deep)}; {say('Pre-LN', deep)}"
    return f"At {mid} layers: {say('Post-LN', mid)}\nat {deep}: {say('Post-LN', deep)}; {say('Pre-LN', deep)}"


def _figure(
    ctx: RunContext, runs: dict[tuple[str, int, str], dict[str, Any]], depths: tuple[int, ...], h1: float
) -> Any:
    from matplotlib.ticker import NullFormatter  # matplotlib is optional (the demo extra)

    fig, (a, b, c) = figure(
        3, _title(runs, depths, h1), f"seed {ctx.seed}; normatlas experiments run post-ln-warmup{ctx.flag}"
    )
    deep = depths[-1]
    mid = warmup_depth(depths)
    # the deepest Post-LN first and faint, so the warm-up depth's curves (the clauses' own) are drawn over it
    shown = [*([("Post-LN", deep, "C3", 0.45)] if deep != mid else []), ("Pre-LN", deep, "C1", 1.0),
             ("Post-LN", mid, "C0", 1.0)]  # fmt: skip
    for kind, depth, color, alpha in shown:
        for arm, style in zip(ARMS, ("-", "--"), strict=True):
            losses = runs[(kind, depth, arm)]["losses"]
            finite = [v if math.isfinite(v) else float("nan") for v in losses]
            a.plot(range(len(finite)), smooth(finite), style, color=color, alpha=alpha, label=f"{kind} {depth}, {arm}")
    a.axhline(h1, color="0.5", lw=0.8, ls=":", label="unigram entropy")
    a.set(xlabel="step", ylabel="training loss (nats/byte, 20-step mean)", title="training")
    top = max((r["held_out"] for r in runs.values() if r["held_out"] is not None), default=h1)
    for i, kind in enumerate(KINDS):
        for arm, marker in zip(ARMS, ("o", "s"), strict=True):
            ys = [runs[(kind, d, arm)]["held_out"] for d in depths]
            b.plot(depths, [float("nan") if y is None else y for y in ys], marker, color=f"C{i}",
                   ls="-" if arm == "no warm-up" else "--", label=f"{kind}, {arm}")  # fmt: skip
            for d, y in zip(depths, ys, strict=True):
                if y is None:
                    b.plot([d], [top * 1.05], "x", color=f"C{i}", ms=9)
                    b.annotate("diverged", (d, top * 1.05), fontsize=7, color=f"C{i}", ha="center", va="bottom")
    b.axhline(h1, color="0.5", lw=0.8, ls=":", label="unigram entropy")
    b.set(xlabel="depth (layers)", ylabel="held-out loss (nats/byte)", title="end of training", xscale="log")
    b.set_xticks(list(depths), [str(d) for d in depths])
    b.xaxis.set_minor_formatter(NullFormatter())
    for i, kind in enumerate(KINDS):
        g = runs[(kind, deep, "no warm-up")]["first_grads"]
        back = list(range(len(g), 0, -1))
        slope, icpt, r2 = fit(back, g)
        c.plot(back, g, "o", ms=3, color=f"C{i}", label=f"{kind}: l^{slope:.2f} (R² {r2:.2f})")
        c.plot(back, [math.exp(icpt) * x**slope for x in back], "-", color=f"C{i}", lw=0.8)
    g0 = runs[("Post-LN", deep, "no warm-up")]["first_grads"][-1]
    c.plot(range(1, deep + 1), [g0 * x**-0.5 for x in range(1, deep + 1)], ":", color="0.4", label="guide: 1/sqrt(l)")
    c.set(xlabel="l: layers back from the output", ylabel="block gradient norm at step 0", xscale="log", yscale="log",
          title="gradients the full rate meets")  # fmt: skip
    ticks = [2**i for i in range(deep.bit_length()) if 2**i <= deep]
    c.set_xticks(ticks, [str(t) for t in ticks])
    c.xaxis.set_minor_formatter(NullFormatter())
    return finish(fig, (a, b, c), legend_size=7)


EXPERIMENT = Experiment.declare(
    "post-ln-warmup", rule=RULE, estimates_s=estimates(default=400.0, quick=2.0, paper=PAPER_S), run=run
)
