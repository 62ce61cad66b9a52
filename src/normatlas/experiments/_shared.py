"""Small pieces experiments 1-7 share: the figure frame, per-layer residual variance, layer ablation.

Nothing here measures a claim on its own; each ``eNN_*.py`` module states and checks its claim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..blocks import Placement, Schedule, TransformerLM
from ..presets import LayerNorm
from .base import RunContext
from .data import ByteBatches, stdlib_bytes
from .lm import TrainConfig, TrainLog, residual_stream, tiny_lm, train_lm

__all__ = ["byte_data", "figure", "smooth", "stream_variance", "trained", "without_layer"]


def byte_data(ctx: RunContext) -> ByteBatches:
    """The standard library's first 2 MB of sources as seeded train / held-out windows."""
    return ByteBatches(stdlib_bytes(2_000_000), seed=ctx.seed)


def trained(
    ctx: RunContext, placement: Placement | Schedule, cfg: TrainConfig, data: ByteBatches, label: str, **model: Any
) -> tuple[TransformerLM, TransformerLM, TrainLog]:
    """A tiny byte LM with ``placement`` and LayerNorm (seeded from ``ctx.seed``): its state at init (a copy)
    and after :func:`~.lm.train_lm` with ``cfg``, and the training log."""
    import copy

    lm = tiny_lm(placement, LayerNorm, seed=ctx.seed, **model)
    init = copy.deepcopy(lm)
    log = train_lm(lm, data, cfg, progress=lambda msg: ctx.progress(f"{label}: {msg}"))
    return init, lm, log


def smooth(v: list[float], k: int = 20) -> list[float]:
    """A trailing moving average over ``k`` values (the first ones over what there is)."""
    out, acc = [], 0.0
    for i, x in enumerate(v):
        acc += x - (v[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def figure(ncols: int, title: str, caption: str) -> tuple[Any, list[Any]]:
    """A ``(10, 4)``-ish figure with ``ncols`` panels, the claim as its title and the seed/command as caption."""
    from .runner import use_agg

    plt = use_agg()
    fig, axes = plt.subplots(1, ncols, figsize=(5 * ncols if ncols < 3 else 14, 4.2), squeeze=False)
    fig.suptitle(title, fontsize=11)
    fig.text(0.5, -0.02, caption, ha="center", fontsize=8, color="0.35")
    fig.tight_layout()
    return fig, list(axes[0])


def finish(fig: Any, axes: Any, legend_size: int = 8, ncol: int = 1) -> Any:
    """Every panel gets its legend and a light grid; the layout is tightened. Returns ``fig``."""
    for ax in axes:
        ax.legend(fontsize=legend_size, ncol=ncol)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def stream_variance(model: TransformerLM, x: Tensor) -> list[float]:
    """The residual stream's variance (over tokens and features) entering each block and leaving the last."""
    return [float(h.double().var()) for h in residual_stream(model, x)]


@torch.no_grad()
def without_layer(model: TransformerLM, layer: int, x: Tensor) -> Tensor:
    """The model's logits with block ``layer`` skipped (its input passed straight through), via a forward hook
    on the model's own block, so the placement's residual arithmetic is the model's everywhere else."""
    block = model.blocks()[layer]
    handle = block.register_forward_hook(lambda _m, args, _out: args[0])
    try:
        return model(x)
    finally:
        handle.remove()
