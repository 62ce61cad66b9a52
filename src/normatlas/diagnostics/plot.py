"""Draw per-layer metrics over training steps (needs matplotlib, imported lazily)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from .sinks import MemorySink

__all__ = ["layer_series", "plot_metrics"]


def layer_series(history: MemorySink, metric: str) -> dict[str, tuple[list[int], list[float]]]:
    """``{layer: (steps, values)}`` for keys ``metric/L<i>`` (or ``metric`` itself), in depth order."""
    pat = re.compile(re.escape(metric) + r"(?:/(L\d+))?$")
    found = {m.group(1) or metric: k for k in history.keys() if (m := pat.match(k))}  # noqa: SIM118
    order = sorted(found, key=lambda s: int(s[1:]) if s.startswith("L") and s[1:].isdigit() else -1)
    return {label: history.series(found[label]) for label in order}


def plot_metrics(
    history: MemorySink, metrics: Sequence[str], path: str | os.PathLike[str] | None = None, log_y: bool = False
) -> Any:
    """One panel per metric, one line per layer; saves to ``path`` if given and returns the figure."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plot_metrics needs matplotlib: pip install matplotlib") from exc
    if not metrics:
        raise ValueError("metrics must name at least one metric, e.g. ['residual/rms']")
    fig, axes = plt.subplots(len(metrics), 1, figsize=(7, 2.6 * len(metrics)), squeeze=False, sharex=True)
    for ax, metric in zip(axes[:, 0], metrics, strict=True):
        series = layer_series(history, metric)
        if not series:
            raise ValueError(f"metric={metric!r} has no recorded values; recorded keys start with {history.keys()[:5]}")
        for label, (steps, values) in series.items():
            ax.plot(steps, values, label=label)
        ax.set_title(metric)
        if log_y:
            ax.set_yscale("log")
        if len(series) > 1:
            ax.legend(fontsize=7, ncol=min(len(series), 6))
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    if path is not None:
        fig.savefig(os.fspath(path), dpi=100)
    return fig
