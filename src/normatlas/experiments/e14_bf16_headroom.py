"""Experiment 14: bf16 headroom, and why norms compute their statistics in fp32.

(1) Headroom: three tiny byte LMs trained in fp32 at a high learning rate (Pre-LN RMSNorm, the same with
QK-norm, and the norm-free placement); the largest |activation| of the residual stream seen during the run,
as log2(bf16 max / max|x|) (:func:`normatlas.diagnostics.headroom`).
(2) The op: RMSNorm on bf16 inputs of width 4096 with values around 10^2, with the library's fp32 statistics
(``CastOrder.AFTER_GAIN``) and without (``CastOrder.INPUT_DTYPE``), against a float64 reference.
(3) Training: the same tiny LM in bf16 weights with either RMSNorm, from the same seed and batches, against an
fp32 reference: the loss gap over the steps.
"""

from __future__ import annotations

import functools
import math
import statistics

import torch
from torch import nn

from ..blocks import QKNormConfig, norm_free, pre_ln
from ..diagnostics import headroom
from ..functional import normalize
from ..presets import RMSNorm
from ..spec import CastOrder, Gain, NormSpec
from .base import Experiment, Outcome, RunContext, Series, estimates
from .data import ByteBatches, stdlib_bytes
from .lm import TrainConfig, residual_stream, tiny_lm, train_lm
from .runner import use_agg
from .verdict import Clause, Direction, VerdictRule

OP_ERROR_FACTOR = 2.0  # fixed before the run: no-upcast op error > this x the upcast op error
UPCAST = functools.partial(RMSNorm, cast_order=CastOrder.AFTER_GAIN)
NO_UPCAST = functools.partial(RMSNorm, cast_order=CastOrder.INPUT_DTYPE)
PAPER_S = 150.0  # paper scale: 1,500 steps
RULE = VerdictRule((
    Clause("op_error_bf16_over_fp32_stats", Direction.ABOVE, OP_ERROR_FACTOR,
           "a bf16 RMSNorm is less exact with bf16 statistics than with fp32 ones (op error ratio)"),
    Clause("drift_bf16_over_fp32_stats", Direction.ABOVE, 1.0,
           "its training loss drifts further from fp32's with bf16 statistics (mean |loss gap| ratio)"),
))  # fmt: skip


def op_errors(gen: torch.Generator, tokens: int, d: int = 4096) -> dict[str, float]:
    """bf16 RMSNorm (with / without fp32 statistics) against float64 on the same bf16 input, values ~10^2.

    ``<name>``: the max over tokens of the relative error of the token's output RMS (the statistic's error: one
    scale per token, systematic, what a loss curve accumulates). ``<name>_element``: the max element-wise
    relative error, floored by the output's own bf16 rounding (2^-8) either way.
    """
    x = (100.0 + 30.0 * torch.randn(tokens, d, generator=gen)).to(torch.bfloat16)
    ref = normalize(x.double(), NormSpec(center=False, gain=Gain.NONE, bias=False, eps=1e-6), backend="reference")
    out = {}
    for name, order in (("fp32_stats", CastOrder.AFTER_GAIN), ("bf16_stats", CastOrder.INPUT_DTYPE)):
        spec = NormSpec(center=False, gain=Gain.NONE, bias=False, eps=1e-6, cast_order=order)
        y = normalize(x, spec, backend="reference").double()
        scale = y.pow(2).mean(-1).sqrt() / ref.pow(2).mean(-1).sqrt()
        out[name] = float((scale - 1).abs().max())
        out[name + "_element"] = float(((y - ref).abs() / ref.abs()).max())
    return out


def _headroom_run(name: str, steps: int, data: ByteBatches, seed: int) -> tuple[float, list[float]]:
    kwargs: dict = {"qk_norm": QKNormConfig()} if name == "Pre-LN + QK-norm" else {}
    placement = norm_free() if name == "norm-free" else pre_ln()
    model = tiny_lm(placement, RMSNorm, n_layers=2, d_model=64, seed=seed, **kwargs)
    probe, _ = data.held_out(4, 64)
    absmax: list[float] = []

    def on_step(step: int, m: nn.Module, _loss: float) -> None:
        if step % 10 == 0:
            absmax.append(max(headroom(s)["absmax"] for s in residual_stream(model, probe)))

    log = train_lm(model, data, TrainConfig(steps=steps, lr=1e-2, clip=None), on_step=on_step)
    worst = max(absmax) if log.diverged_at is None else math.inf
    return worst, absmax


def _bf16_run(norm: object, dtype: torch.dtype, steps: int, corpus: torch.Tensor, seed: int) -> list[float]:
    model = tiny_lm(pre_ln(), norm, n_layers=2, d_model=64, seed=seed).to(dtype)
    return train_lm(model, ByteBatches(corpus, seed), TrainConfig(steps=steps)).losses


def _title(room: dict[str, list[float]], drift: dict[str, float], errs: dict[str, float]) -> str:
    """What the first seed measured, in two lines: the headroom of each model, the op error and drift ratios."""
    bf16_max = float(torch.finfo(torch.bfloat16).max)
    worst = {n: max(v) for n, v in room.items()}
    bits = ", ".join(f"{n} {math.log2(bf16_max / w):.0f}" if math.isfinite(w) and w > 0 else f"{n} none"
                     for n, w in worst.items())  # fmt: skip
    op = errs["bf16_stats"] / errs["fp32_stats"]
    d = drift["bf16, bf16 statistics"] / drift["bf16, fp32 statistics"]
    return (f"Bits of headroom below bf16's max, norms or not: {bits}\n"
            f"bf16 statistics: {op:.0f}x the op error of fp32 statistics, {d:.2g}x the loss drift")  # fmt: skip


def _figure(room: dict[str, list[float]], losses: dict[str, list[float]], errs: dict[str, float],
            drift: dict[str, float]) -> object:  # fmt: skip
    plt = use_agg()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    fig.suptitle(_title(room, drift, errs), fontsize=11)
    bf16_max = torch.finfo(torch.bfloat16).max
    for name, values in room.items():
        axes[0].semilogy([10 * i for i in range(len(values))], values, marker="o", label=name)
    axes[0].axhline(bf16_max, color="k", linestyle=":", label=f"bf16 max {bf16_max:.2e}")
    axes[0].set(xlabel="step", ylabel="max |residual stream| (log)", title="activation range, fp32 training")
    axes[1].bar(["fp32 statistics", "bf16 statistics"], [errs["fp32_stats"], errs["bf16_stats"]],
                color=["tab:green", "tab:red"])  # fmt: skip
    axes[1].set(ylabel="output RMS, max rel. error vs fp64", yscale="log",
                title="bf16 RMSNorm, D = 4096, values ~10²")  # fmt: skip
    ref = losses["fp32"]
    for name in ("bf16, fp32 statistics", "bf16, bf16 statistics"):
        gap = [a - b for a, b in zip(losses[name], ref, strict=False)]
        axes[2].plot(_smooth(gap), label=f"{name} minus fp32")
    axes[2].axhline(0, color="grey", linewidth=0.8)
    axes[2].set(xlabel="step", ylabel="loss gap (nats/byte, 10-step mean)", title="drift against an fp32 run")
    for ax in (axes[0], axes[2]):  # the bars are named by their ticks
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _smooth(v: list[float], w: int = 10) -> list[float]:
    return [statistics.fmean(v[max(0, i - w + 1) : i + 1]) for i in range(len(v))]


def run(ctx: RunContext) -> Outcome:
    errs = op_errors(ctx.generator(), ctx.size(64, 8))
    corpus = stdlib_bytes(ctx.size(1_000_000, 200_000))
    steps = ctx.size(150, 15, paper=1500)
    room, worst = {}, {}
    for name in ("Pre-LN", "Pre-LN + QK-norm", "norm-free"):
        ctx.progress(f"headroom: {name}")
        worst[name], room[name] = _headroom_run(name, steps, ByteBatches(corpus, ctx.seed), ctx.seed)
    losses = {}
    for name, norm, dtype in (("fp32", RMSNorm, torch.float32), ("bf16, fp32 statistics", UPCAST, torch.bfloat16),
                              ("bf16, bf16 statistics", NO_UPCAST, torch.bfloat16)):  # fmt: skip
        ctx.progress(f"training {name}")
        losses[name] = _bf16_run(norm, dtype, steps, corpus, ctx.seed)
    half = steps // 2
    drift = {n: statistics.fmean(abs(a - b) for a, b in zip(losses[n][half:], losses["fp32"][half:], strict=False))
             for n in ("bf16, fp32 statistics", "bf16, bf16 statistics")}  # fmt: skip
    bf16_max = float(torch.finfo(torch.bfloat16).max)
    room_log2 = {k: (math.log2(bf16_max / v) if math.isfinite(v) else -math.inf) for k, v in worst.items()}
    measured = {
        "max_abs_activation": worst, "bf16_headroom_log2": room_log2,
        "op_token_scale_max_rel_error": {"fp32_stats": errs["fp32_stats"], "bf16_stats": errs["bf16_stats"]},
        "op_element_max_rel_error": {k: errs[f"{k}_element"] for k in ("fp32_stats", "bf16_stats")},
        "mean_abs_loss_gap_second_half": drift, "steps": steps,
    }  # fmt: skip
    decided_by = {
        "op_error_bf16_over_fp32_stats": errs["bf16_stats"] / errs["fp32_stats"],
        "drift_bf16_over_fp32_stats": drift["bf16, bf16 statistics"] / drift["bf16, fp32 statistics"],
    }
    rows = [(n, i, v) for n, c in losses.items() for i, v in enumerate(c)]
    room_rows = [(n, 10 * i, v) for n, c in room.items() for i, v in enumerate(c)]
    return Outcome(
        statistics=decided_by, measured=measured,
        series={"losses": Series(("run", "step", "loss"), rows),
                "activation_absmax": Series(("model", "step", "absmax"), room_rows)},
        figure=_figure(room, losses, errs, drift),
        notes=f"Tiny byte LMs (2 layers, d_model 64), {steps} steps on CPU. Headroom runs: fp32, lr 1e-2, no "
              "clipping. Drift runs: pure bf16 weights and AdamW states (no fp32 master weights) for both bf16 "
              "runs, so both drift from fp32; the comparison isolates the norm's statistics. The paper's setting "
              "is fp16 mixed precision with fp32 master weights and loss scaling at scale.",
    )  # fmt: skip


EXPERIMENT = Experiment.declare(
    "bf16-headroom", rule=RULE, estimates_s=estimates(default=15.0, quick=1.5, paper=PAPER_S), run=run
)
