"""The depth claims' shared trained set: one byte LM per placement, trained once per seed and scale, cached on disk.

Experiments 3 (variance with depth), 5 (the curse of depth) and 6 (scaled init is not enough) are three readings
of the same models: deep byte LMs on the standard library's sources, equal but for the placement (and, for one
member, GPT-2's scaled residual init). Training them once serves all three, and at paper scale (24 layers, 2,000
steps) it is what makes the group affordable on 2 cores. :func:`member` returns a trained member: read from
``RunContext.shared / depth-set / <scale>-seed<S> / <slug>/`` when a run with the same code, scale, seed and torch
made it, else trained and written there (``log.json`` last and atomically, so a killed run retrains only the member
it was in). Every member sees the same batches (its own :class:`~.data.ByteBatches` from the seed) and records the
residual stream's variance leaving every block on a fixed held-out batch at init and every ``every`` steps.

The weights are saved with safetensors (``save_model`` / ``load_model``, which keep the tied embedding and head).
Without ``RunContext.shared`` (a direct call in a test) members are trained in memory and not cached.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..blocks import (
    Placement,
    Schedule,
    TransformerLM,
    deepnorm,
    layernorm_scaling,
    mix_ln,
    peri_ln,
    post_ln,
    pre_ln,
)
from ..presets import LayerNorm
from ._shared import byte_data, stream_variance
from .base import Experiment, Outcome, RunContext, Scale, estimates
from .lm import TrainConfig, tiny_lm, train_lm
from .runner import atomic_write
from .verdict import VerdictRule

__all__ = ["MEMBERS", "DepthMember", "DepthSetup", "Trained", "declare", "growth", "member", "setup"]


@dataclass(frozen=True)
class DepthMember:
    """One model of the set: its label, its placement (a preset built for ``n_layers``) and GPT-2's scaled
    residual init or not. LayerNorm in every slot."""

    label: str
    placement: Callable[[int], Placement | Schedule]
    scaled_init: bool = False

    @property
    def slug(self) -> str:
        return self.label.lower().replace(" + ", "-").replace(" ", "-")


MEMBERS: dict[str, DepthMember] = {
    m.label: m
    for m in (
        DepthMember("Pre-LN", lambda n: pre_ln()),
        DepthMember("Pre-LN + scaled init", lambda n: pre_ln(), scaled_init=True),
        DepthMember("Post-LN", lambda n: post_ln()),
        DepthMember("Peri-LN", lambda n: peri_ln()),
        DepthMember("LNS", lambda n: layernorm_scaling()),
        DepthMember("DeepNorm", deepnorm),
        DepthMember("Mix-LN", mix_ln),
    )
}


@dataclass(frozen=True)
class DepthSetup:
    """The set's sizes at one scale: depth, width, training, how often the stream is probed, the probe batch."""

    n_layers: int
    d_model: int
    train: TrainConfig
    every: int
    probe_batch: int
    members: tuple[str, ...]  # the labels of MEMBERS trained at this scale

    def describe(self) -> str:
        t = self.train
        return (
            f"{self.n_layers} layers, d_model {self.d_model}, LayerNorm, AdamW lr {t.lr} (warm-up {t.warmup}, "
            f"clip {t.clip}), {t.steps} steps of {t.batch}x{t.seq} stdlib bytes; the stream probed on "
            f"{self.probe_batch}x{t.seq} held-out bytes every {self.every} steps"
        )


def setup(ctx: RunContext) -> DepthSetup:
    """Quick: 6 layers of width 32, 20 steps. Default: 8 layers of width 64, 300 steps. Paper: 24 layers of width
    32, 2,000 steps of 8 x 64 bytes, without Mix-LN, which no clause reads (experiment 3 draws it): the six members
    take about 21 minutes per seed on one idle core (0.10 s a step), so three seeds fit in about 30 minutes on two
    cores. Width 64 would cost 2.2x (0.22 s a step): depth and steps are what the claims are about."""
    train = TrainConfig(
        steps=ctx.size(300, 20, paper=2000), batch=ctx.size(16, 8, paper=8), seq=ctx.size(64, 32), lr=3e-3
    )
    return DepthSetup(
        n_layers=ctx.size(8, 6, paper=24), d_model=ctx.size(64, 32, paper=32), train=train,
        every=ctx.size(30, 5, paper=100), probe_batch=8,
        members=tuple(k for k in MEMBERS if k != "Mix-LN" or ctx.scale is not Scale.PAPER),
    )  # fmt: skip


@dataclass
class Trained:
    """A trained member: the model, the stream's variance per probe (``(step, [variance entering each block and
    leaving the last])``, step 0 = init), the loss per step and the step it diverged at (``None``: it did not)."""

    label: str
    model: TransformerLM
    trajectory: list[tuple[int, list[float]]]
    losses: list[float]
    diverged_at: int | None
    seconds: float
    cached: bool

    @property
    def init_variance(self) -> list[float]:
        return self.trajectory[0][1]

    @property
    def final_variance(self) -> list[float]:
        return self.trajectory[-1][1]


def _build(ctx: RunContext, m: DepthMember, s: DepthSetup) -> TransformerLM:
    return tiny_lm(
        m.placement(s.n_layers), LayerNorm, n_layers=s.n_layers, d_model=s.d_model, seed=ctx.seed,
        scaled_residual_init=m.scaled_init,
    )  # fmt: skip


def _key(ctx: RunContext, m: DepthMember, s: DepthSetup) -> dict[str, Any]:
    """What a cached member must have been made with: the member's design, the sizes, the seed, torch, and the
    source of the code that builds and trains it (this module's :func:`_build` and :func:`_train`, and
    experiments/lm.py), so an edit to how members are read or described does not throw the set away."""
    from . import lm as lm_module

    text = "".join(inspect.getsource(obj) for obj in (_build, _train, lm_module))
    design = {"placement": m.placement(s.n_layers).name, "scaled_init": m.scaled_init}
    return {
        "member": m.label, "design": design, "scale": ctx.scale.value, "seed": ctx.seed, "setup": repr(s),
        "source": hashlib.sha256(text.encode()).hexdigest()[:16], "torch": torch.__version__,
    }  # fmt: skip


def _folder(ctx: RunContext, m: DepthMember) -> Path | None:
    if ctx.shared is None:
        return None
    return Path(ctx.shared) / "depth-set" / f"{ctx.scale.value}-seed{ctx.seed}" / m.slug


def _read(folder: Path, key: dict[str, Any], ctx: RunContext, m: DepthMember, s: DepthSetup) -> Trained | None:
    from safetensors.torch import load_model

    try:
        log = json.loads((folder / "log.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(log, dict) or log.get("key") != key:
        return None
    model = _build(ctx, m, s)
    try:
        load_model(model, str(folder / "model.safetensors"))
    except Exception as e:
        ctx.progress(f"{m.label}: cached weights unreadable ({type(e).__name__}); retraining")
        return None
    trajectory = [(int(step), [float(v) for v in var]) for step, var in log["trajectory"]]
    losses = [float(v) for v in log["losses"]]
    return Trained(m.label, model, trajectory, losses, log["diverged_at"], float(log["seconds"]), cached=True)


def _write(folder: Path, key: dict[str, Any], t: Trained) -> None:
    from safetensors.torch import save_model

    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "model.safetensors", lambda p: save_model(t.model, str(p)))
    log = {
        "key": key, "trajectory": t.trajectory, "losses": t.losses, "diverged_at": t.diverged_at,
        "seconds": round(t.seconds, 2),
    }  # fmt: skip
    text = json.dumps(log) + "\n"
    atomic_write(folder / "log.json", lambda p: p.write_text(text))


def member(ctx: RunContext, label: str) -> Trained:
    """The member ``label`` of :data:`MEMBERS` trained at ``ctx``'s scale and seed (from the cache when there)."""
    import time

    s = setup(ctx)
    if label not in s.members:
        raise ValueError(f"label={label!r} is not one of {list(s.members)} (the set at {ctx.scale.value} scale)")
    m = MEMBERS[label]
    folder, key = _folder(ctx, m), _key(ctx, m, s)
    if folder is not None:
        hit = _read(folder, key, ctx, m, s)
        if hit is not None:
            ctx.progress(f"{label}: read from the shared depth set")
            return hit
    start = time.perf_counter()
    model, trajectory, log = _train(ctx, m, s)
    t = Trained(label, model, trajectory, log.losses, log.diverged_at, time.perf_counter() - start, cached=False)
    if folder is not None:
        _write(folder, key, t)
    return t


def _train(ctx: RunContext, m: DepthMember, s: DepthSetup) -> tuple[TransformerLM, list[tuple[int, list[float]]], Any]:
    """Train member ``m``: its own seeded batches, the stream's variance on a fixed held-out batch at step 0 and
    every ``s.every`` steps (and the last)."""
    data = byte_data(ctx)
    x, _ = data.held_out(s.probe_batch, s.train.seq)
    model = _build(ctx, m, s)
    trajectory = [(0, stream_variance(model, x))]

    def on_step(step: int, lm: nn.Module, _loss: float) -> None:
        if (step + 1) % s.every == 0 or step + 1 == s.train.steps:
            assert isinstance(lm, TransformerLM)
            trajectory.append((step + 1, stream_variance(lm, x)))

    log = train_lm(model, data, s.train, on_step=on_step, progress=lambda msg: ctx.progress(f"{m.label}: {msg}"))
    return model, trajectory, log


def growth(var: list[float]) -> float:
    """The stream's variance leaving the last block over that leaving the first (``var[0]`` is the embedding)."""
    return var[-1] / var[1]


def declare(
    name: str, *, rule: VerdictRule, run: Callable[[RunContext], Outcome], default: float, quick: float, paper: float
) -> Experiment:
    """The experiment ``name`` (claims.json's words) reading this shared set: its seed cache is keyed on this
    module's source too, so a change to the set reruns it. ``default`` / ``quick`` / ``paper``: seconds per seed."""
    return Experiment.declare(
        name, rule=rule, estimates_s=estimates(default=default, quick=quick, paper=paper), run=run, depends=(__name__,)
    )
