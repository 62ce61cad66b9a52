"""Depth pruning by norm geometry (guide §07-08, the curse of depth).

In a Pre-LN stack the stream's norm grows with depth, so a late layer's update is a small turn of a long
vector: its block is close to the identity. :func:`layer_scores` measures that per layer on real text:

* **angle**: the angular distance between the stream entering the layer and leaving it,
  ``arccos(cos(x_in, x_out)) / pi`` (0: the layer does not turn the stream; Gromov et al., 2024), mean over tokens;
* **ratio**: the update-to-stream ratio ``||x_out - x_in|| / ||x_in||`` (the branch's size against the stream's);
* **block** (:func:`block_scores`): the angle across ``k`` consecutive layers, to drop the one block that turns the
  stream least (Gromov et al.'s rule; layers that stand in for each other are not scored one at a time).

:func:`prune` drops the ``k`` layers with the lowest score: the model is rebuilt from its own config with the
depth (and every per-layer list of the config) shortened and the surviving layers' weights renumbered. Its proof
(:func:`prune_surgery`) is the original model with the dropped layers made to pass their stream through (forward
hooks), compared in float64 and the working dtype; the write is the surgery's (:func:`normatlas.surgery.save_surgery`:
atomic, never the input, safetensors only, read back and rebuilt from the folder).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import textwrap
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..surgery.io import _load_into
from ..surgery.report import Change, Surgery
from ..surgery.verify import Tolerance, compare, model_dtype
from .lens import windows
from .reading import Reading, ToolError, capture_stream, finish_figure, model_inputs, read_model, skipping
from .text import check_ids, heldout_ids, window_len

__all__ = [
    "SCORES",
    "PrunePlan",
    "PruneResult",
    "block_scores",
    "choose",
    "choose_block",
    "is_causal",
    "layer_scores",
    "plan_prune",
    "prune",
    "prune_figure",
    "prune_surgery",
    "quality",
    "run_prune",
]

SCORES = ("angle", "ratio")


@torch.no_grad()
def layer_scores(model: nn.Module, reading: Reading, ids: Tensor) -> list[dict[str, Any]]:
    """Per layer, on token windows ``ids`` (B, T): the angular distance and the update-to-stream ratio (means over
    tokens), and the stream's RMS entering the layer."""
    with capture_stream(model, reading) as streams:
        model(**model_inputs(model, ids))
        hs = [h.double() for h in streams]
    rows = []
    for i in range(len(reading.layers)):
        x, y = hs[i], hs[i + 1]
        cos = F.cosine_similarity(x, y, dim=-1).clamp(-1, 1)
        rows.append(
            {
                "layer": i,
                "angle": float((torch.arccos(cos) / math.pi).mean()),
                "ratio": float(((y - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)).mean()),
                "stream_rms": float(x.pow(2).mean(-1).sqrt().mean()),
            }
        )
    return rows


@torch.no_grad()
def block_scores(model: nn.Module, reading: Reading, ids: Tensor, k: int) -> list[dict[str, Any]]:
    """Per block of ``k`` consecutive layers: the angular distance between the stream entering its first layer and
    leaving its last (Gromov et al., 2024, who drop the block with the smallest), mean over tokens."""
    n = len(reading.layers)
    if not 1 <= k < n:
        raise ValueError(f"k={k} must be >= 1 and leave at least one of the {n} layers")
    with capture_stream(model, reading) as streams:
        model(**model_inputs(model, ids))
        hs = [h.double() for h in streams]
    rows = []
    for start in range(n - k + 1):
        cos = F.cosine_similarity(hs[start], hs[start + k], dim=-1).clamp(-1, 1)
        rows.append({"start": start, "layers": list(range(start, start + k)),
                     "angle": float((torch.arccos(cos) / math.pi).mean())})  # fmt: skip
    return rows


def choose_block(blocks: Sequence[dict[str, Any]]) -> list[int]:
    """The layers of the block with the smallest angular distance (the first such block on a tie)."""
    return list(min(blocks, key=lambda b: (b["angle"], b["start"]))["layers"])


def choose(scores: Sequence[dict[str, Any]], k: int, by: str = "angle") -> list[int]:
    """The ``k`` layers with the lowest ``by`` score, in layer order."""
    if by not in SCORES:
        raise ValueError(f"by={by!r} is not one of {', '.join(SCORES)}")
    if not 0 <= k < len(scores):
        raise ValueError(f"k={k} must be >= 0 and leave at least one of the {len(scores)} layers")
    return sorted(r["layer"] for r in sorted(scores, key=lambda r: (r[by], r["layer"]))[:k])


def _layer_list(model: nn.Module, reading: Reading) -> str:
    """The ``nn.ModuleList`` holding every layer, its children in layer order."""
    parents = {layer.module.rpartition(".")[0] for layer in reading.layers}
    if len(parents) != 1:
        raise ToolError(f"the layers do not share one layer list ({', '.join(sorted(parents))})")
    path = parents.pop()
    container = model.get_submodule(path)
    children = [name for name, _ in container.named_children()]
    own = [layer.module.rpartition(".")[2] for layer in reading.layers]
    if not isinstance(container, nn.ModuleList) or children != own:
        raise ToolError(f"{path} is not a layer list holding exactly the {len(own)} layers in order")
    return path


def _pruned_config(model: nn.Module, keep: list[int], n: int) -> tuple[Any, list[str]]:
    cfg = copy.deepcopy(getattr(model, "config", None))
    if cfg is None or getattr(cfg, "num_hidden_layers", None) != n:
        raise ToolError(
            f"the model's config does not give its depth as num_hidden_layers={n}; pruning rebuilds it from the config"
        )
    cfg.num_hidden_layers = len(keep)
    changed = [f"num_hidden_layers: {n} -> {len(keep)}"]
    for key, value in cfg.to_dict().items():
        if key != "num_hidden_layers" and isinstance(value, (list, tuple)) and len(value) == n:
            setattr(cfg, key, type(value)(value[i] for i in keep))
            changed.append(f"{key}: the dropped layers' entries removed")
    return cfg, changed


def prune(model: nn.Module, reading: Reading, drop: Sequence[int]) -> tuple[nn.Module, list[str]]:
    """A new model of ``model``'s class without the layers ``drop``: built from the config with the depth and
    every per-layer config list shortened, the kept layers' tensors renumbered (each in its stored dtype).
    Returns (model, what changed in the config). ``model`` is not modified."""
    n = len(reading.layers)
    bad = sorted({int(i) for i in drop if not 0 <= int(i) < n})
    if bad or len(set(drop)) >= n:
        raise ValueError(f"drop={list(drop)} must name distinct layers in 0..{n - 1} and leave at least one")
    keep = [i for i in range(n) if i not in set(drop)]
    path = _layer_list(model, reading)
    cfg, changed = _pruned_config(model, keep, n)
    renum = {str(old): str(new) for new, old in enumerate(keep)}
    prefix = f"{path}." if path else ""
    state = {}
    for key, value in model.state_dict().items():
        if key.startswith(prefix) and (idx := key[len(prefix) :].split(".", 1)[0]).isdigit():
            if idx not in renum:
                continue
            key = f"{prefix}{renum[idx]}.{key[len(prefix) + len(idx) + 1 :]}"
        state[key] = value.detach().clone()
    pruned = type(model)(cfg).eval()
    _load_into(pruned, state, "the pruned model")  # type: ignore[arg-type]
    return pruned, changed


def prune_surgery(
    model: nn.Module,
    reading: Reading,
    drop: Sequence[int],
    inputs: Any,
    *,
    scores: Sequence[dict[str, Any]] = (),
    tolerance: Tolerance | None = None,
) -> Surgery:
    """:func:`prune` as a :class:`~normatlas.surgery.Surgery`: the changes, and the proof that the pruned model
    computes what ``model`` computes with the dropped layers passing their stream through, in float64 and the
    model's dtype (``inputs``: the probe inputs)."""
    pruned, changed = prune(model, reading, drop)
    by_layer = {r["layer"]: r for r in scores}
    surgery = Surgery("prune", pruned)
    if drop:  # pruning nothing changes nothing: a surgery with no change is never written
        surgery.config_updates["num_hidden_layers"] = len(reading.layers) - len(drop)
        surgery.notes += [f"config {c}" for c in changed]
    for i in drop:
        r = by_layer.get(i, {})
        detail = ", ".join(f"{k} {r[k]:.4g}" for k in SCORES if k in r)
        surgery.changes.append(Change(f"layer {i} ({reading.layers[i].module})", "dropped", detail))
    surgery.notes.append(
        "pruning changes the model's function: the proof compares it with the original whose dropped layers pass "
        "their stream through unchanged (verify against the original measures what the pruning costs)"
    )
    reference = copy.deepcopy(model).eval()
    remove = skipping(reference, reading, drop)
    try:
        dtype = model_dtype(model)
        tol = tolerance or Tolerance.default(dtype, dtype)
        for dt, t in ((torch.float64, tol.float64), (dtype, tol.working)):
            surgery.checks.append(compare(reference, pruned, inputs, dt, label="runtime", tol=t))
    finally:
        remove()
    return surgery


@torch.no_grad()
def is_causal(model: nn.Module, ids: Tensor) -> bool:
    """Whether no position's output depends on a later token (changing the last token changes nothing before it)."""
    a = ids[:1].clone()
    b = a.clone()
    b[0, -1] = (b[0, -1] + 1) % int(ids.max() + 1 if ids.max() > 0 else 2)
    out_a = model(**model_inputs(model, a))
    out_b = model(**model_inputs(model, b))
    ta = getattr(out_a, "logits", None)
    ta = ta if ta is not None else out_a[0]
    tb = getattr(out_b, "logits", None)
    tb = tb if tb is not None else out_b[0]
    return bool(torch.equal(ta[:, :-1], tb[:, :-1]))


@torch.no_grad()
def quality(model: nn.Module, reading: Reading, ids: Tensor, reference: Tensor | None = None) -> dict[str, Any]:
    """What the model does on token windows ``ids``: for a causal LM, the next-token loss (nats per token); for any
    other model, its last stream mean-pooled per window (compare two with :func:`pooled_cosine`)."""
    model = model.eval()
    if reading.tail and is_causal(model, ids):
        logits = model(**model_inputs(model, ids)).logits
        loss = float(F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), ids[:, 1:].flatten()))
        return {"measure": "next-token loss (nats/token)", "value": loss}
    with capture_stream(model, reading) as streams:
        model(**model_inputs(model, ids))
        pooled = streams[-1].double().mean(1)
    value = 1.0 if reference is None else float(F.cosine_similarity(pooled, reference, dim=-1).mean())
    return {
        "measure": "cosine of the mean-pooled last stream to the unpruned model's",
        "value": value,
        "pooled": pooled,
    }


def prune_figure(
    scores: Sequence[dict[str, Any]],
    drop: Sequence[int],
    path: str | os.PathLike[str],
    title: str,
    caption: str = "",
    measured: tuple[str, float, Sequence[float]] | None = None,
) -> Any:
    """Angular distance (bars; the dropped layers in red) and update-to-stream ratio (line) by depth; with
    ``measured`` = (what, the unpruned value, the value with each layer alone skipped), a second panel of those."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    layers = [r["layer"] for r in scores]
    rows = 2 if measured is not None else 1
    fig, axes = plt.subplots(rows, 1, figsize=(max(6.0, 0.5 * len(layers) + 3), 3.6 * rows), squeeze=False)
    ax = axes[0, 0]
    colors = ["tab:red" if i in set(drop) else "tab:blue" for i in layers]
    ax.bar(layers, [r["angle"] for r in scores], color=colors, label="angular distance in -> out (red: dropped)")
    ax.set_xlabel("layer")
    ax.set_ylabel("angular distance arccos(cos)/pi")
    ax2 = ax.twinx()
    ax2.plot(layers, [r["ratio"] for r in scores], "ko-", label="||x_out - x_in|| / ||x_in||")
    ax2.set_ylabel("update-to-stream ratio (log)")
    ax2.set_yscale("log")
    lines = ax.get_legend_handles_labels()
    more = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper center")
    ax.set_xticks(layers)
    if measured is not None:
        what, base, values = measured
        mx = axes[1, 0]
        mx.bar(layers, list(values), color=colors, label="this layer alone skipped")
        mx.axhline(base, color="gray", ls=":", label=f"unpruned ({base:.4g})")
        mx.set_ylim(min(min(values), base) * 0.95, max(max(values), base) * 1.02)
        mx.set_xlabel("layer")
        mx.set_ylabel("\n".join(textwrap.wrap(what, 34)))
        mx.set_xticks(layers)
        mx.legend(fontsize=8)
    finish_figure(fig, path, caption, title=title, wrap=140, top=0.94)
    return path


@dataclass
class PrunePlan:
    """Which layers a prune drops and why, read from the held-out text before anything changes: the reading, the
    8 scoring windows and the evaluation windows after them, every layer's scores, the block table (``by="block"``)
    and the layers chosen."""

    reading: Reading
    score_ids: Tensor
    eval_ids: Tensor
    scores: list[dict[str, Any]]
    blocks: list[dict[str, Any]]
    drop: list[int]
    by: str

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The score table with a ``dropped`` column."""
        return [dict(r, dropped=r["layer"] in self.drop) for r in self.scores]


@dataclass
class PruneResult:
    """A planned prune carried out in memory: its surgery (changes and proof) and the quality before and after on
    the plan's evaluation windows (:func:`quality`'s dicts)."""

    surgery: Surgery
    before: dict[str, Any]
    after: dict[str, Any]


Phase = Callable[[str], AbstractContextManager[Any]]


def _quiet(_what: str) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


def plan_prune(
    model: nn.Module, tokenizer: Any, drop: int, by: str = "angle", eval_windows: int = 8, phase: Phase = _quiet
) -> PrunePlan:
    """Score ``model``'s layers on 8 windows of held-out text (its ``tokenizer``'s ids) and choose the ``drop``
    layers to prune: the lowest ``by`` score (``angle`` / ``ratio``), or the ``block`` of ``drop`` consecutive
    layers that turns the stream least. ``phase(what)`` wraps the slow part (a progress display)."""
    if by not in (*SCORES, "block"):
        raise ValueError(f"by={by!r} must be one of {[*SCORES, 'block']}")
    ids = heldout_ids(tokenizer)
    check_ids(model, ids, "the held-out text")
    seq = window_len(model)
    score_ids = windows(ids, seq, 8)
    eval_ids = windows(ids, seq, eval_windows, offset=8 * seq)
    with phase("reading the layers from the dataflow and scoring them"):
        reading = read_model(model, score_ids[:1], head=False)
        scores = layer_scores(model, reading, score_ids)
    if not 0 <= drop < len(scores):
        raise ValueError(f"drop={drop} would leave no layer of the {len(scores)}" if drop > 0 else
                         f"drop={drop} must be >= 0")  # fmt: skip
    blocks = block_scores(model, reading, score_ids, drop) if by == "block" and drop else []
    chosen = choose_block(blocks) if blocks else choose(scores, drop, "angle" if by == "block" else by)
    return PrunePlan(reading, score_ids, eval_ids, scores, blocks, chosen, by)


def run_prune(model: nn.Module, plan: PrunePlan, inputs: Any, phase: Phase = _quiet) -> PruneResult:
    """Carry out ``plan`` in memory: the surgery with its proof on the probe ``inputs``, then the quality of the
    original and the pruned model on the plan's evaluation windows."""
    with phase("pruning and proving (against the original with the dropped layers skipped)"):
        surgery = prune_surgery(model, plan.reading, plan.drop, inputs, scores=plan.scores)
    with phase(f"measuring on {plan.eval_ids.numel()} other held-out tokens"):
        before = quality(model, plan.reading, plan.eval_ids)
        pruned = read_model(surgery.stock, plan.eval_ids[:1], head=False) if plan.drop else plan.reading
        after = quality(surgery.stock, pruned, plan.eval_ids, reference=before.get("pooled"))
    return PruneResult(surgery, before, after)
