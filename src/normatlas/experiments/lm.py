"""Tiny byte-level language models on the standard library's sources: the experiments' shared bench.

:func:`tiny_lm` builds a :class:`~normatlas.blocks.TransformerLM` from a placement and a norm
operator (the library's own presets, nothing special-cased); :func:`train_lm` trains it with AdamW
on :class:`~normatlas.experiments.data.ByteBatches` and returns the loss per step, calling
``on_step(step, model, loss)`` after every optimizer step so an experiment can measure what it needs
(a :class:`~normatlas.diagnostics.Monitor`, weight norms, activations) without its own loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..blocks import ModelConfig, Placement, Schedule, TransformerLM
from .data import ByteBatches

__all__ = ["TrainConfig", "TrainLog", "evaluate_lm", "residual_stream", "tiny_lm", "train_lm"]


def tiny_lm(
    placement: Placement | Schedule,
    norm: Any,
    *,
    n_layers: int = 4,
    d_model: int = 64,
    n_heads: int = 4,
    d_ff: int | None = None,
    seed: int = 0,
    **config: Any,
) -> TransformerLM:
    """A byte-level decoder (vocabulary 256) with ``placement`` and ``norm`` (a NormSpec or factory), seeded."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=256, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        d_ff=d_ff if d_ff is not None else 4 * d_model, norm=norm, placement=placement, **config,
    )  # fmt: skip
    return TransformerLM(cfg)


@dataclass(frozen=True)
class TrainConfig:
    """AdamW with linear warm-up then a constant rate (``schedule='constant'``), cosine decay to 10% (``'cosine'``)
    or the original Transformer's inverse-square-root decay (``'inverse-sqrt'``: ``lr * sqrt(a / (step + 1))`` from
    step ``a`` on, ``a = decay_start`` or the warm-up's end, so a run without warm-up can share a warm-up run's
    decay and differ from it in the first ``a`` steps only); ``jump`` switches to another rate at a step (a run that
    settles first and is then pushed too hard)."""

    steps: int = 200
    batch: int = 16
    seq: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup: int = 10
    schedule: str = "constant"
    clip: float | None = 1.0
    betas: tuple[float, float] = (0.9, 0.95)
    jump: tuple[int, float] | None = None  # (step, lr): from that step on the rate is lr (a late instability)
    decay_start: int | None = None  # inverse-sqrt only: the step the decay starts at (None: the warm-up's end)

    def __post_init__(self) -> None:
        if self.schedule not in ("constant", "cosine", "inverse-sqrt"):
            raise ValueError(f"schedule={self.schedule!r} must be 'constant', 'cosine' or 'inverse-sqrt'")
        if self.decay_start is not None and (self.schedule != "inverse-sqrt" or self.decay_start < 1):
            raise ValueError(
                f"decay_start={self.decay_start!r} needs schedule='inverse-sqrt' (got {self.schedule!r}) and >= 1"
            )
        if self.steps < 1 or self.batch < 1 or self.seq < 2:
            raise ValueError(f"steps={self.steps}, batch={self.batch}, seq={self.seq} must be >= 1, 1, 2")

    def lr_at(self, step: int) -> float:
        if self.jump is not None and step >= self.jump[0]:
            return self.jump[1]
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.schedule == "constant":
            return self.lr
        if self.schedule == "inverse-sqrt":
            start = max(1, self.warmup if self.decay_start is None else self.decay_start)
            return self.lr * min(1.0, math.sqrt(start / (step + 1)))
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@dataclass
class TrainLog:
    losses: list[float]
    diverged_at: int | None  # first step with a non-finite loss (training stops there)


def train_lm(
    model: nn.Module,
    data: ByteBatches,
    cfg: TrainConfig,
    on_step: Callable[[int, nn.Module, float], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> TrainLog:
    """Next-byte cross-entropy with AdamW (decay on matrices only, never on norm gains or biases)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=cfg.betas,
    )  # fmt: skip
    losses: list[float] = []
    model.train()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        x, y = data.train(cfg.batch, cfg.seq)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        value = float(loss.detach())
        if not math.isfinite(value):
            losses.append(value)
            return TrainLog(losses, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        losses.append(value)
        if on_step is not None:
            on_step(step, model, value)
        if progress is not None and (step % 20 == 0 or step == cfg.steps - 1):
            progress(f"step {step + 1}/{cfg.steps} loss {value:.3f}")
    return TrainLog(losses, None)


@torch.no_grad()
def evaluate_lm(model: nn.Module, data: ByteBatches, batch: int = 32, seq: int = 64) -> float:
    """Held-out next-byte cross-entropy (nats per byte), the same batch on every call."""
    was = model.training
    model.eval()
    x, y = data.held_out(batch, seq)
    loss = float(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    model.train(was)
    return loss


def residual_stream(model: TransformerLM, x: Tensor) -> list[Tensor]:
    """The residual stream entering each block and leaving the last (``n_layers + 1`` tensors), no grad,
    captured with forward hooks on the model's own blocks (so RoPE, masks and schedules are the model's)."""
    seen: list[Tensor] = []
    blocks = list(model.blocks())

    def pre(_m: nn.Module, args: tuple[Any, ...]) -> None:
        seen.append(args[0].detach())

    def post(_m: nn.Module, _args: tuple[Any, ...], out: Tensor) -> None:
        seen.append(out.detach())

    handles = [b.register_forward_pre_hook(pre) for b in blocks] + [blocks[-1].register_forward_hook(post)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return seen
