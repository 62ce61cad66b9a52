"""Experiment 17: weight decay and the learning rate set the effective LR of a normalised layer only through eta*lambda.

A normalised weight W (a bias-free Linear followed by a LayerNorm without affine) is scale invariant, so its
gradient g is orthogonal to W and scales as 1/||W||. One SGD step with L2 decay, W <- (1 - eta*lambda) W - eta g,
gives exactly ||W'||^2 = (1 - eta*lambda)^2 ||W||^2 + eta^2 ||g||^2. Without decay ||W|| only grows, so eta/||W||^2
(the effective LR, experiment 1) falls under a flat schedule. With decay ||W|| settles where the two terms balance,
eta^2 ||g||^2 = (2 eta*lambda - (eta*lambda)^2) ||W||^2, which fixes the angle W turns per step at

    tan(angle) = sqrt(2 eta*lambda - (eta*lambda)^2) / (1 - eta*lambda)   (about sqrt(2 eta*lambda))

whatever the gradient, and, with ||g|| = ||g_1|| / ||W|| (g_1 the gradient at unit norm), ||W||^4 about
eta ||g_1||^2 / (2 lambda): the weight norm scales as (eta/lambda)^(1/4) and the effective LR eta/||W||^2 as
sqrt(2 eta*lambda) / ||g_1||, so eta and lambda enter the equilibrium only through their product.

The model is real, the data real: a next-byte MLP language model (Bengio et al. 2003 style: the previous
``context`` bytes embedded and concatenated, then ``depth`` blocks Linear (no bias) -> LayerNorm (no affine) -> ReLU,
then a linear head) on the standard library's sources, which it cannot memorise, so the gradient noise persists.
The normalised Linears get SGD with (eta, lambda); the embedding and head get the same fixed SGD rate in every run
and no decay. Four runs: A (eta 0.1, lambda 1e-2) and B (eta 1, lambda 1e-3) share eta*lambda = 1e-3 with eta/lambda
100x apart; D (eta 1, lambda 1e-2) has ten times the product; C (eta 1, no decay) is the flat schedule.
"""

from __future__ import annotations

import itertools
import math
import statistics as st
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..presets import LayerNorm
from ._shared import byte_data, figure, finish, smooth
from .base import Experiment, Outcome, RunContext, Series, estimates
from .verdict import Clause, Direction, VerdictRule

# label -> (eta, lambda) for the normalised Linears
RUNS = {"A": (0.1, 1e-2), "B": (1.0, 1e-3), "D": (1.0, 1e-2), "C": (1.0, 0.0)}
DECAYED = ("A", "B", "D")
OTHER_LR = 0.5  # SGD rate of the embedding and the head, the same in every run (no decay)
PAPER_S = 900.0  # paper scale: width 512, 4 normalised layers, 12,000 steps per run, 4 runs (estimate)
RULE = VerdictRule((
    Clause("angle_over_theory_error", Direction.BELOW, 0.1,
           "with decay every normalised layer turns atan(sqrt(2 eta*lambda - (eta*lambda)^2) / (1 - eta*lambda)) "
           "per step once settled (largest |RMS angle / theory - 1| over runs A, B, D and layers)"),
    Clause("w_norm_exponent_error", Direction.BELOW, 0.05,
           "at equal eta*lambda the settled ||W|| scales as (eta/lambda)^(1/4) (|median exponent over layers "
           "- 0.25|, runs B against A)"),
    Clause("drift_no_decay_over_decay", Direction.ABOVE, 2.0,
           "over the last quarter the flat no-decay run's ||W|| keeps growing (its eta/||W||^2 keeps falling) "
           "more than twice as fast as the decayed runs' ||W|| moves"),
))  # fmt: skip


def theory_angle(eta: float, lam: float) -> float:
    """The angle (radians) a scale-invariant weight turns per SGD step at the norm equilibrium."""
    p = eta * lam
    return math.atan(math.sqrt(2 * p - p * p) / (1 - p))


class ByteMLP(nn.Module):
    """The previous ``context`` bytes -> Embedding(256, emb) concatenated -> ``depth`` x [Linear (no bias) ->
    LayerNorm (no affine) -> ReLU] -> Linear(256): a next-byte LM whose Linears are scale invariant."""

    def __init__(self, context: int, emb: int, width: int, depth: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, emb)
        dims = [context * emb] + [width] * depth
        self.lins = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in itertools.pairwise(dims))
        self.norms = nn.ModuleList(LayerNorm(width, elementwise_affine=False) for _ in range(depth))
        self.head = nn.Linear(width, 256)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x).flatten(1)
        for lin, norm in zip(self.lins, self.norms, strict=True):
            h = torch.relu(norm(lin(h)))
        return self.head(h)

    def weights(self) -> list[Tensor]:
        """The normalised Linears' weights (the scale-invariant ones)."""
        return [lin.weight for lin in self.lins if isinstance(lin, nn.Linear)]


def train(ctx: RunContext, eta: float, lam: float, sizes: dict[str, int]) -> dict[str, Any]:
    """SGD for ``sizes['steps']`` steps; per step and normalised layer: ||W|| and the angle W turned (radians);
    per step: the training loss. Every run of a seed sees the same batches from the same initial weights."""
    data = byte_data(ctx)
    torch.manual_seed(ctx.seed)
    net = ByteMLP(sizes["context"], sizes["emb"], sizes["width"], sizes["depth"])
    opt = torch.optim.SGD([
        {"params": list(net.lins.parameters()), "lr": eta, "weight_decay": lam},
        {"params": list(net.emb.parameters()) + list(net.head.parameters()), "lr": OTHER_LR},
    ])  # fmt: skip
    norms: list[list[float]] = [[] for _ in net.lins]
    angles: list[list[float]] = [[] for _ in net.lins]
    losses: list[float] = []
    for step in range(sizes["steps"]):
        x, y = data.train(sizes["batch"], sizes["context"])
        before = [w.detach().clone() for w in net.weights()]
        loss = F.cross_entropy(net(x), y[:, -1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = float(loss.detach())
        losses.append(value)
        if not math.isfinite(value):
            break
        for i, (w0, w) in enumerate(zip(before, net.weights(), strict=True)):
            w1 = w.detach()
            cos = float((w0 * w1).sum() / (w0.norm() * w1.norm()))
            angles[i].append(math.acos(max(-1.0, min(1.0, cos))))
            norms[i].append(float(w1.norm()))
        if step % 500 == 0:
            ctx.progress(f"eta {eta:g}, lambda {lam:g}: step {step + 1}/{sizes['steps']} loss {value:.3f}")
    return {"norms": norms, "angles": angles, "losses": losses}


def settled(run: dict[str, Any], layer: int) -> dict[str, float]:
    """Over the last quarter of steps: the RMS angle per step, ||W|| at the end, and the drift
    |log(||W||_end / ||W||_3/4)| (how far the norm still moves)."""
    w, a = run["norms"][layer], run["angles"][layer]
    q = 3 * len(w) // 4
    tail = a[q:]
    return {
        "rms_angle": math.sqrt(sum(v * v for v in tail) / len(tail)),
        "w_end": w[-1],
        "drift": abs(math.log(w[-1] / w[q])),
    }


def run(ctx: RunContext) -> Outcome:
    sizes = {
        "steps": ctx.size(3000, 300, paper=12000), "batch": ctx.size(64, 32), "context": ctx.size(8, 4),
        "emb": ctx.size(16, 8), "width": ctx.size(128, 32, paper=512), "depth": ctx.size(3, 2, paper=4),
    }  # fmt: skip
    runs = {label: train(ctx, eta, lam, sizes) for label, (eta, lam) in RUNS.items()}
    depth = sizes["depth"]
    at = {label: [settled(runs[label], i) for i in range(depth)] for label in RUNS}
    angle_ratio = {
        label: [s["rms_angle"] / theory_angle(*RUNS[label]) for s in at[label]] for label in DECAYED
    }  # fmt: skip
    (eta_a, lam_a), (eta_b, lam_b) = RUNS["A"], RUNS["B"]
    span = math.log((eta_b / lam_b) / (eta_a / lam_a))
    exponents = [math.log(at["B"][i]["w_end"] / at["A"][i]["w_end"]) / span for i in range(depth)]
    eff = {label: [RUNS[label][0] / s["w_end"] ** 2 for s in at[label]] for label in RUNS}
    drift_decay = max(s["drift"] for label in DECAYED for s in at[label])
    drift_flat = st.median(s["drift"] for s in at["C"])
    tail = max(1, sizes["steps"] // 10)
    measured: dict[str, Any] = {
        "runs_eta_lambda": {k: list(v) for k, v in RUNS.items()},
        "theory_angle_rad": {k: theory_angle(*RUNS[k]) for k in DECAYED},
        "rms_angle_last_quarter_rad": {k: [s["rms_angle"] for s in at[k]] for k in RUNS},
        "angle_over_theory": angle_ratio,
        "w_norm_start": [runs["A"]["norms"][i][0] for i in range(depth)],
        "w_norm_end": {k: [s["w_end"] for s in at[k]] for k in RUNS},
        "w_norm_exponent_b_vs_a_per_layer": exponents,
        "eff_lr_end": eff,
        "eff_lr_b_over_a_per_layer": [b / a for a, b in zip(eff["A"], eff["B"], strict=True)],
        "w_norm_drift_last_quarter": {k: [s["drift"] for s in at[k]] for k in RUNS},
        "train_loss_end": {k: sum(runs[k]["losses"][-tail:]) / tail for k in RUNS},
    }
    statistics = {
        "angle_over_theory_error": max(abs(r - 1) for k in DECAYED for r in angle_ratio[k]),
        "w_norm_exponent_error": abs(st.median(exponents) - 0.25),
        "drift_no_decay_over_decay": drift_flat / max(drift_decay, 1e-12),
    }
    series = {
        "training": Series(
            ("run", "eta", "lambda", "step", "layer", "w_norm", "angle_rad", "eff_lr"),
            [
                (k, RUNS[k][0], RUNS[k][1], t, i, w, a, RUNS[k][0] / w**2)
                for k in RUNS
                for i in range(depth)
                for t, (w, a) in enumerate(zip(runs[k]["norms"][i], runs[k]["angles"][i], strict=True))
                if t % 10 == 0 or t == len(runs[k]["norms"][i]) - 1
            ],
        ),
        "loss": Series.of(step=list(range(sizes["steps"])), **{f"loss_{k}": runs[k]["losses"] for k in RUNS}),
    }
    notes = (
        f"Next-byte MLP LM on the stdlib sources: {sizes['context']} context bytes x Embedding {sizes['emb']} -> "
        f"{depth} x [Linear {sizes['width']} (no bias) -> LayerNorm (no affine) -> ReLU] -> Linear 256. SGD, batch "
        f"{sizes['batch']}, {sizes['steps']} steps; (eta, lambda) on the normalised Linears per run {RUNS}, the "
        f"embedding and head at a fixed {OTHER_LR} without decay. 'Settled' values are over the last quarter of "
        "steps (RMS angle per step; ||W|| at the end). The equilibrium law is derived in the module docstring from "
        "SGD's update; van Laarhoven (2017) gives the effective LR eta/||W||^2 it rests on."
    )
    return Outcome(statistics, measured, series, _figure(ctx, runs, sizes, statistics, exponents), notes)


def _figure(
    ctx: RunContext, runs: dict[str, Any], sizes: dict[str, int], stats: dict[str, float], exponents: list[float]
) -> Any:
    err = stats["angle_over_theory_error"]
    r = stats["drift_no_decay_over_decay"]
    drift = (
        f"their ||W|| moves {r:.1f}x less than the no-decay run's"
        if r >= 1
        else f"the most-moving decayed run's ||W|| moves {1 / r:.1f}x more than the no-decay run's"
    )
    fig, (a, b, c) = figure(
        3,
        f"Decayed runs turn within {100 * err:.0f}% of the derived sqrt(2*eta*lambda) per step and ||W|| ~ "
        f"(eta/lambda)^{st.median(exponents):.3f} (derived 0.25);\nover the last quarter {drift} (whose "
        "eta/||W||^2 keeps falling)",
        f"seed {ctx.seed}; middle normalised layer; normatlas experiments run decay-equilibrium{ctx.flag}",
    )
    layer = sizes["depth"] // 2
    k = max(5, sizes["steps"] // 60)
    for i, (label, (eta, lam)) in enumerate(RUNS.items()):
        name = f"{label}: eta {eta:g}, lambda {lam:g}"
        steps = list(range(len(runs[label]["norms"][layer])))
        w = runs[label]["norms"][layer]
        a.plot(steps, w, color=f"C{i}", label=name)
        b.plot(steps, smooth(runs[label]["angles"][layer], k), color=f"C{i}", label=name)
        c.plot(steps, [eta / v**2 for v in w], color=f"C{i}", label=name)
    for lam_eta, ls in ((RUNS["A"][0] * RUNS["A"][1], "--"), (RUNS["D"][0] * RUNS["D"][1], ":")):
        th = theory_angle(lam_eta, 1.0)
        b.axhline(th, color="0.3", ls=ls, lw=1, label=f"derived: eta*lambda {lam_eta:g} -> {th:.4f} rad")
    a.set(xlabel="SGD step", ylabel="||W|| (Frobenius)", title="weight norm", yscale="log")
    b.set(xlabel="SGD step", ylabel=f"angle per step (rad, mean of {k})", title="angular update", yscale="log")
    c.set(xlabel="SGD step", ylabel="eta / ||W||^2", title="effective learning rate", yscale="log")
    return finish(fig, (a, b, c), legend_size=7)


EXPERIMENT = Experiment.declare(
    "decay-equilibrium", rule=RULE, estimates_s=estimates(default=90.0, quick=2.5, paper=PAPER_S), run=run
)
