"""Experiment 2: internal covariate shift is not the mechanism; a smoother landscape is (Santurkar et al. 2018).

Three deep MLPs trained alike with SGD on a task none of them can fit within the run: predicting the next byte of
the standard library's sources from the previous CONTEXT bytes (one-hot inputs; ~1.8 MB of training text, so a net
of this size keeps learning to the end and never memorises it). One net without BatchNorm, one with our BatchNorm1d
after every hidden linear layer, and one with BatchNorm followed by "noisy BN" (a random per-unit scale and
non-zero shift, drawn afresh at every step, plus per-example noise: covariate shift put back on purpose). The noisy
net should train about as well as the BN net. At checkpoints we walk along the gradient from the current weights,
as the paper does in miniature: the spread of the loss over the step sizes (loss-landscape variation), the change
of the gradient (gradient predictiveness) and that change over the step length (effective beta-smoothness),
averaged over the probes taken while the nets train (step 0, the untrained net, is drawn but not averaged).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..longtail import BatchNorm1d
from ._shared import byte_data, figure, finish, smooth
from .base import Experiment, Outcome, RunContext, Series, estimates
from .verdict import Clause, Direction, Diverged, Statistic, VerdictRule

WIDTH, DEPTH, LR, BATCH = 128, 6, 0.05, 64
CONTEXT = 8  # bytes the net sees before the one it predicts
CLASSES = 256
TEST = 4096  # held-out windows for the test accuracy
STEP_SCALES = (0.5, 1.0, 2.0, 4.0)  # multiples of LR walked along the gradient
VARIANTS = ("no BN", "BN", "noisy BN")
SMOOTHNESS = ("loss_range", "grad_change", "beta")
PAPER_S = 150.0  # paper scale: 6,000 steps (the paper's VGG / CIFAR-10 is out of reach on 2 cores)
RULE = VerdictRule((
    Clause("accuracy_noisy_bn_minus_bn", Direction.ABOVE, -0.03,
           "noisy BN's test accuracy is within 3 points of BN's (covariate shift put back does not hurt)"),
    Clause("loss_range_no_bn_over_bn", Direction.ABOVE, 1.0, "BN narrows the loss spread along the gradient"),
    Clause("grad_change_no_bn_over_bn", Direction.ABOVE, 1.0, "BN's gradient changes less along the step"),
    Clause("beta_no_bn_over_bn", Direction.ABOVE, 1.0, "BN lowers the effective beta-smoothness"),
))  # fmt: skip
# The three smoothness ratios are of means over the training-phase probes (_training_mean): since the paper run of
# seeds 0-2 (2026-12-07), where step 0's probe set the mean; that change is decided on fresh seeds 3-5.
# The task since stop 45 (2026-12-07): next byte from 8 bytes, not the digits images, which both nets fitted by
# step ~1,500 (the spreads then 1e-4 to 1e-8 nats), and SGD lr 0.05, not 0.1, at which the net without BN diverged at
# two of six digits seeds. Both changed before any run of this task; decided on seeds 0-2, then 3-5.


class NoisyShift(nn.Module):
    """``s * x + m + 0.1 * noise`` with ``s ~ U(1, 2)`` and ``m ~ U(-1, 1)`` per unit, redrawn every training
    step (:meth:`redraw`), so the next layer's input distribution moves all the time. In eval mode the noise's
    expectation, ``1.5 * x`` (as dropout evaluates at its mean), so the test sees the scale training saw."""

    def __init__(self, width: int, gen: torch.Generator) -> None:
        super().__init__()
        self.gen, self.width = gen, width
        self.redraw()

    def redraw(self) -> None:
        self.s = 1 + torch.rand(self.width, generator=self.gen)
        self.m = 2 * torch.rand(self.width, generator=self.gen) - 1

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return 1.5 * x
        return self.s * x + self.m + 0.1 * torch.randn(x.shape, generator=self.gen)


def one_hot(context: Tensor) -> Tensor:
    """``(B, CONTEXT)`` bytes -> ``(B, CONTEXT * 256)`` one-hot features scaled by 16, so each input coordinate has
    mean square 1 (as standardised inputs do) and He init gives the first layer unit-scale pre-activations."""
    return F.one_hot(context, CLASSES).flatten(1).float() * math.sqrt(CLASSES)


def mlp(variant: str, gen: torch.Generator) -> nn.Sequential:
    """CONTEXT * 256 -> DEPTH x (Linear(WIDTH) [-> BN [-> noise]] -> ReLU) -> Linear(256), He-initialised."""
    layers: list[nn.Module] = []
    fan_in = CONTEXT * CLASSES
    for _ in range(DEPTH):
        layers.append(nn.Linear(fan_in, WIDTH))
        if variant != "no BN":
            layers.append(BatchNorm1d(WIDTH))
        if variant == "noisy BN":
            layers.append(NoisyShift(WIDTH, gen))
        layers.append(nn.ReLU())
        fan_in = WIDTH
    layers.append(nn.Linear(fan_in, CLASSES))
    for layer in layers:  # He init, so the net without BN trains too (the paper's baseline does)
        if isinstance(layer, nn.Linear):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


def _grad(model: nn.Module, x: Tensor, y: Tensor) -> tuple[float, list[Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return float(loss.detach()), [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def landscape(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, float]:
    """Walk from the weights along -grad by LR * STEP_SCALES on one batch (a copy: running stats untouched; the
    noise held fixed): the loss spread, the largest gradient change and the largest change / step length."""
    probe = copy.deepcopy(model)
    loss0, g0 = _grad(probe, x, y)
    start = [p.detach().clone() for p in probe.parameters()]
    losses, changes, betas = [loss0], [], []
    for scale in STEP_SCALES:
        with torch.no_grad():
            for p, w, gp in zip(probe.parameters(), start, g0, strict=True):
                p.copy_(w - LR * scale * gp)
        loss, g = _grad(probe, x, y)
        change = sum(float((a - b).pow(2).sum()) for a, b in zip(g, g0, strict=True)) ** 0.5
        step = LR * scale * sum(float(a.pow(2).sum()) for a in g0) ** 0.5
        losses.append(loss)
        changes.append(change)
        betas.append(change / step)
    return {"loss_range": max(losses) - min(losses), "grad_change": max(changes), "beta": max(betas)}


def windows(data: Any, batch: int, held_out: bool = False) -> tuple[Tensor, Tensor]:
    """``batch`` (one-hot context, next byte) pairs: seeded training windows, or the fixed held-out ones."""
    inputs, targets = (data.held_out if held_out else data.train)(batch, CONTEXT)
    return one_hot(inputs), targets[:, -1]


def train(ctx: RunContext, variant: str, steps: int, probe_every: int) -> dict[str, Any]:
    data = byte_data(ctx)  # the same seeded batches for every variant (a fresh stream each call)
    torch.manual_seed(ctx.seed)
    gen = ctx.generator(2)
    model = mlp(variant, gen)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    probes, losses = [], []
    for step in range(steps):
        x, y = windows(data, BATCH)
        for m in model.modules():
            if isinstance(m, NoisyShift):
                m.redraw()
        if step % probe_every == 0:
            probes.append({"step": step, **landscape(model, x, y)})
        loss, _ = _grad(model, x, y)
        opt.step()
        losses.append(loss)
    model.eval()
    xt, yt = windows(data, TEST, held_out=True)
    with torch.no_grad():
        acc = float((model(xt).argmax(1) == yt).float().mean())
    diverged_at = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    return {"losses": losses, "probes": probes, "accuracy": acc, "diverged_at": diverged_at}


def run(ctx: RunContext) -> Outcome:
    steps, every = ctx.size(1200, 400, paper=6000), ctx.size(60, 40, paper=200)
    logs = {}
    for v in VARIANTS:
        ctx.progress(f"training {v}")
        logs[v] = train(ctx, v, steps, every)

    def mean(v: str, key: str) -> float:
        return _training_mean(logs[v]["probes"], key)

    measured: dict[str, Any] = {f"test_accuracy_{v.replace(' ', '_')}": logs[v]["accuracy"] for v in VARIANTS}
    tail = max(1, steps // 10)
    for v in VARIANTS:
        measured[f"final_train_loss_{v.replace(' ', '_')}"] = sum(logs[v]["losses"][-tail:]) / tail
    for key in ("loss_range", "grad_change", "beta"):
        for v in ("no BN", "BN"):
            measured[f"mean_{key}_{v.replace(' ', '_')}"] = mean(v, key)
    m = measured
    statistics: dict[str, Statistic] = {
        "accuracy_noisy_bn_minus_bn": m["test_accuracy_noisy_BN"] - m["test_accuracy_BN"],
        **{f"{key}_no_bn_over_bn": m[f"mean_{key}_no_BN"] / m[f"mean_{key}_BN"] for key in SMOOTHNESS},
    }
    for v in VARIANTS:
        at = logs[v]["diverged_at"]
        measured[f"diverged_at_{v.replace(' ', '_')}"] = at
        if at is None:
            continue
        ratios = [f"{key}_no_bn_over_bn" for key in SMOOTHNESS]  # no BN's and BN's landscapes
        accuracy = ["accuracy_noisy_bn_minus_bn"]  # noisy BN's and BN's accuracies
        for k in {"no BN": ratios, "BN": ratios + accuracy, "noisy BN": accuracy}[v]:
            statistics[k] = Diverged(f"the {v} net's training loss", at)
    series = {
        "training": Series.of(
            step=list(range(steps)), **{f"loss_{v.replace(' ', '_')}": logs[v]["losses"] for v in VARIANTS}
        ),
        "landscape": Series(
            ("variant", "step", "loss_range", "grad_change", "beta"),
            [(v, p["step"], p["loss_range"], p["grad_change"], p["beta"]) for v in VARIANTS for p in logs[v]["probes"]],
        ),
    }
    notes = (
        f"{DEPTH} hidden layers of {WIDTH} units predicting the next byte of the stdlib's sources from {CONTEXT} "
        f"(one-hot; {TEST:,} held-out windows for the test accuracy), SGD lr {LR} momentum 0.9, "
        f"batch {BATCH}, {steps} steps; landscape probes every {every} steps at step sizes {STEP_SCALES} x lr on the "
        "step's own batch; the smoothness statistics average the probes after step 0 (the training phase). The "
        "paper uses VGG on CIFAR-10; the smoothness verdict compares BN with no BN."
    )
    return Outcome(statistics, measured, series, _figure(ctx, logs, steps), notes)


def _training_mean(probes: list[dict[str, float]], key: str) -> float:
    """The mean of ``key`` over the probes taken while the net trains: every probe but step 0's.

    Step 0 probes the untrained net (He init, no step taken), which is not the landscape training moves through; at
    paper scale its loss spread (1.67 nats with BN, 0.46 without at seed 0) outweighed the 29 probes after it
    together, so the statistic measured the initialisation. Changed after the paper run of seeds 0-2 (which showed
    this) and decided on fresh seeds 3-5; docs/experiments.md has both runs."""
    values = [p[key] for p in probes if p["step"] > 0]
    return sum(values) / len(values) if values else math.nan


def _title(logs: dict[str, Any]) -> str:
    """What the first seed shows: the three test accuracies (noisy BN's gap to BN) and the three smoothness ratios."""
    acc = ", ".join(f"{v} {logs[v]['accuracy']:.3f}" for v in VARIANTS)
    diverged = [f"{v} diverged at step {at}" for v in VARIANTS if (at := logs[v]["diverged_at"]) is not None]
    if diverged:
        return f"Test accuracy: {acc}; {', '.join(diverged)} (its landscape is not compared)"
    ratios = {
        key: _training_mean(logs["no BN"]["probes"], key) / _training_mean(logs["BN"]["probes"], key)
        for key in SMOOTHNESS
    }
    gap = 100 * (logs["noisy BN"]["accuracy"] - logs["BN"]["accuracy"])
    return (
        f"Test accuracy: {acc} (noisy BN {abs(gap):.1f} points {'under' if gap < 0 else 'over'} BN)\n"
        f"along the gradient after step 0, no BN over BN: loss spread {ratios['loss_range']:.2f}x, gradient change "
        f"{ratios['grad_change']:.2f}x, beta {ratios['beta']:.2f}x"
    )


def _figure(ctx: RunContext, logs: dict[str, Any], steps: int) -> Any:
    fig, (a, b, c) = figure(3, _title(logs), f"seed {ctx.seed}; normatlas experiments run covariate-shift{ctx.flag}")
    colors = dict(zip(VARIANTS, ("C3", "C0", "C2"), strict=True))
    for v in VARIANTS:
        label = f"{v} (test acc {logs[v]['accuracy']:.3f})"
        a.plot(range(steps), smooth(logs[v]["losses"]), color=colors[v], label=label)
        steps_p = [p["step"] for p in logs[v]["probes"]]
        b.plot(steps_p, [p["loss_range"] for p in logs[v]["probes"]], "o-", ms=3, color=colors[v], label=v)
        c.plot(steps_p, [p["beta"] for p in logs[v]["probes"]], "o-", ms=3, color=colors[v], label=v)
    a.set(xlabel="SGD step", ylabel="training loss (nats, smoothed)", title="training", yscale="log")
    b.set(xlabel="SGD step", ylabel="loss spread along the gradient (nats)", title="loss landscape", yscale="log")
    c.set(
        xlabel="SGD step", ylabel="max ||g(w - s g) - g(w)|| / ||s g||", title="effective beta-smoothness", yscale="log"
    )
    return finish(fig, (a, b, c))


EXPERIMENT = Experiment.declare(
    "covariate-shift", rule=RULE, estimates_s=estimates(default=30.0, quick=4.0, paper=PAPER_S), run=run
)
