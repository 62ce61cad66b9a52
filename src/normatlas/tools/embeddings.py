"""The embedding-table scan: the norm of every token's embedding, outliers and special tokens flagged.

The token table is found from the dataflow (the ``embedding`` lookup that reads the input ids; its weight is the
table), never by name. Per row: the L2 norm and its robust z-score against the table
(``(norm - median) / (1.4826 * MAD)``); a row is an outlier when ``|z|`` exceeds the threshold. Special tokens come
from the tokenizer; how often each token occurs in a standard-library text sample is counted beside it, since a row
that no training text touched keeps whatever init and weight decay left it (the "under-trained tokens" of a
vocabulary). The summary adds the anisotropy of the table, ``||mean row|| / mean ||row||``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..analysis.graph import record
from ..analysis.ops import SHAPE_ONLY
from ..analysis.walk import strip
from .lens import token_text
from .reading import ToolError, finish_figure, model_inputs

__all__ = ["EmbeddingScan", "embedding_figure", "scan_embeddings", "token_table"]


def token_table(model: nn.Module, ids: Tensor) -> tuple[str, Tensor]:
    """(parameter name, weight) of the table the model looks its input ids up in (read from one recorded run)."""
    g = record(model.eval(), model_inputs(model, ids))
    inputs = {n.idx for n in g.nodes if n.op == "input" and g.tensors.get(n.idx) is ids}
    for n in g.nodes:
        if n.op != "embedding" or len(n.inputs) < 2:
            continue
        src, weight = strip(g, n.inputs[0], SHAPE_ONLY), strip(g, n.inputs[1], SHAPE_ONLY)
        if (src in inputs or any(g.feeds(i, src) for i in inputs)) and g.nodes[weight].op == "param":
            return g.nodes[weight].label, g.tensors[weight].detach()
    raise ToolError("no embedding lookup of the input ids was found")


@dataclass
class EmbeddingScan:
    name: str  # the table's parameter path (a label)
    norms: Tensor  # (vocab,)
    z: Tensor  # robust z-scores
    summary: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)  # flagged tokens, the extremes and the specials


def scan_embeddings(
    model: nn.Module,
    tokenizer: Any = None,
    sample_ids: list[int] | None = None,
    *,
    z: float = 4.0,
    extremes: int = 5,
    max_listed: int = 20,
) -> EmbeddingScan:
    """Scan the token table of ``model``. ``sample_ids``: token ids of a text sample (their counts are shown);
    ``z``: the |robust z| above which a row is an outlier; ``extremes``: the largest and smallest rows listed; the
    outliers are listed too when there are at most ``max_listed`` of them on a side (the summary counts them all)."""
    if z <= 0:
        raise ValueError(f"z={z} must be > 0")
    probe = torch.arange(min(8, int(getattr(getattr(model, "config", None), "vocab_size", 8) or 8)))[None]
    name, table = token_table(model, probe)
    w = table.double()
    norms = w.norm(dim=-1)
    med = norms.median()
    mad = (norms - med).abs().median() * 1.4826
    zs = (norms - med) / mad.clamp_min(1e-12)
    counts = torch.bincount(torch.tensor(sample_ids, dtype=torch.long), minlength=len(norms)) if sample_ids else None
    specials = sorted(set(getattr(tokenizer, "all_special_ids", []) or []))
    high = [int(i) for i in torch.nonzero(zs > z).flatten()]
    low = [int(i) for i in torch.nonzero(zs < -z).flatten()]
    order = torch.argsort(norms, descending=True)
    ends = [*order[:extremes].tolist(), *order[len(order) - extremes :].tolist()] if extremes else []
    flagged = [*(high if len(high) <= max_listed else []), *(low if len(low) <= max_listed else [])]
    listed = list(dict.fromkeys([*ends, *specials, *flagged]))
    rows = []
    for i in sorted(listed, key=lambda i: -float(norms[i])):
        rows.append(
            {
                "id": i,
                "token": token_text(tokenizer, i),
                "norm": float(norms[i]),
                "z": float(zs[i]),
                "flag": "high outlier" if i in high else "low outlier" if i in low else "",
                "special": i in specials,
                "in_sample": int(counts[i]) if counts is not None and i < len(counts) else None,
            }
        )
    unseen = int((counts[: len(norms)] == 0).sum()) if counts is not None else None
    summary = {
        "table": name,
        "vocab": int(w.shape[0]),
        "width": int(w.shape[1]),
        "norm_mean": float(norms.mean()),
        "norm_median": float(med),
        "norm_min": float(norms.min()),
        "norm_max": float(norms.max()),
        "high_outliers": len(high),
        "low_outliers": len(low),
        "z_threshold": z,
        "specials": len(specials),
        "anisotropy": float(w.mean(0).norm() / norms.mean()),
        "unseen_in_sample": unseen,
    }
    if counts is not None and unseen:
        seen = counts[: len(norms)] > 0
        summary["norm_mean_seen"] = float(norms[seen].mean())
        summary["norm_mean_unseen"] = float(norms[~seen].mean())
    return EmbeddingScan(name, norms.float(), zs.float(), summary, rows)


def embedding_figure(scan: EmbeddingScan, path: str | os.PathLike[str], title: str, caption: str = "") -> Any:
    """Every row's norm, sorted (the outliers and the special tokens marked)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    order = torch.argsort(scan.norms, descending=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    ax.plot(range(len(order)), scan.norms[order].numpy(), lw=1, label="row norm, sorted")
    out = torch.nonzero(scan.z.abs() > scan.summary["z_threshold"]).flatten()
    ax.plot(rank[out].numpy(), scan.norms[out].numpy(), "o", color="tab:red", ms=3)
    for r in scan.rows:
        if r["special"]:
            ax.plot(int(rank[r["id"]]), r["norm"], "o", color="tab:green", ms=4)
    ax.plot([], [], "o", color="tab:red", label=f"outlier (|robust z| > {scan.summary['z_threshold']:g})")
    ax.plot([], [], "o", color="tab:green", label="special token")
    ax.axhline(scan.summary["norm_median"], color="gray", ls=":", label="median")
    ax.set_xlabel("token rank by embedding norm")
    ax.set_ylabel("||embedding row|| (L2)")
    ax.legend(fontsize=8)
    finish_figure(fig, path, caption, title=title, bottom=0.05)
    return path
