"""Experiment 9: DyT's S-curve: a trained LayerNorm's input against its output, and pointwise norms that train.

(1) The real all-MiniLM-L6-v2 (transformers, offline) reads real English sentences (the docstrings of a few
standard-library modules). Forward hooks on its ``nn.LayerNorm`` modules (found by type, in forward order)
capture each one's input; its output before the affine is ``(x - mean) / std`` per token. For the deepest
LayerNorms the element-wise (input, output) cloud is fitted with ``a * tanh(alpha * x)`` (grid over alpha,
least-squares a) and with a line through 0, and alpha is set against 1 / std of the layer's input.
(2) DyT and Derf (``normatlas.longtail``) replace LayerNorm in a tiny Pre-LN byte LM; all three train the same
steps from the same seed, and the held-out losses are compared.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

import torch
from torch import Tensor, nn

from ..blocks import pre_ln
from ..longtail import Derf, DyT
from ..presets import LayerNorm
from .base import Experiment, Outcome, RunContext, Series, estimates
from .data import ByteBatches, minilm_dir, stdlib_bytes
from .lm import TrainConfig, evaluate_lm, tiny_lm, train_lm
from .runner import use_agg
from .verdict import Clause, Direction, VerdictRule

TEXT_MODULES = ("json", "argparse", "collections", "functools", "itertools", "pathlib", "random", "statistics")
DEEP = 3  # the last three LayerNorms of the model are the "deep" ones
MARGIN = 0.05  # DyT / Derf held-out loss within 5% of LayerNorm's (fixed before the run)
BEND = 1.0  # an S-curve: the fitted tanh bends inside the data, alpha * max|x| > BEND
PAPER_S = 120.0  # paper scale: 128 sentences, 2,000 LM steps (DyT's per-site alpha settings are not in yet)
RULE = VerdictRule((
    Clause("min_r2_tanh_minus_line", Direction.ABOVE, 0.0,
           f"each of the last {DEEP} MiniLM LayerNorms' input-output map is fitted better by tanh than by a line"),
    Clause("min_alpha_times_max_abs_x", Direction.ABOVE, BEND,
           "each fitted tanh bends inside the data (alpha * max|x|)"),
    Clause("dyt_rel_gap", Direction.BELOW, MARGIN, "DyT's held-out loss is within 5% of LayerNorm's (relative gap)"),
    Clause("derf_rel_gap", Direction.BELOW, MARGIN, "Derf's held-out loss is within 5% of LayerNorm's (relative gap)"),
))  # fmt: skip


def sentences(n: int) -> list[str]:
    """The first ``n`` sentences of >= 6 words from some standard-library modules' docstrings (real English)."""
    out: list[str] = []
    for name in TEXT_MODULES:
        doc = importlib.import_module(name).__doc__ or ""
        for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
            if len(s.split()) >= 6:
                out.append(s)
    if len(out) < n:
        raise ValueError(f"only {len(out)} sentences found in {TEXT_MODULES}, asked for {n}")
    return out[:n]


def layernorm_inputs(texts: list[str]) -> list[tuple[Tensor, float]]:
    """The input of every ``nn.LayerNorm`` of MiniLM (real tokens only, as (tokens, D)) with its eps, in order."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    folder = str(minilm_dir())
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    keep = batch["attention_mask"].bool()
    seen: list[tuple[Tensor, float]] = []
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    hooks = [m.register_forward_hook(lambda mod, a, _y: seen.append((a[0].detach()[keep], mod.eps))) for m in norms]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return seen


def fit_tanh(x: Tensor, y: Tensor) -> dict[str, float]:
    """Best ``a * tanh(alpha x)`` over a log grid of alpha (a by least squares), the best line, their R^2."""
    x, y = x.double(), y.double()
    total = float(((y - y.mean()) ** 2).sum())
    c = float((x * y).sum() / (x * x).sum())
    best = (-1.0, 0.0, 0.0)
    for alpha in torch.logspace(-3, 1, 161, dtype=torch.float64):
        t = torch.tanh(alpha * x)
        a = float((t * y).sum() / (t * t).sum())
        r2 = 1 - float(((y - a * t) ** 2).sum()) / total
        if r2 > best[0]:
            best = (r2, float(alpha), a)
    return {"r2_tanh": best[0], "alpha": best[1], "a": best[2], "r2_line": 1 - float(((y - c * x) ** 2).sum()) / total,
            "inv_std": 1 / float(x.std()), "max_abs_x": float(x.abs().max())}  # fmt: skip


def _lm_runs(steps: int, data: ByteBatches, seed: int, ctx: RunContext) -> dict[str, tuple[float, list[float]]]:
    out = {}
    for name, norm in (("LayerNorm", LayerNorm), ("DyT", DyT), ("Derf", Derf)):
        ctx.progress(f"training the {name} LM")
        model = tiny_lm(pre_ln(), norm, n_layers=2, d_model=64, seed=seed)
        log = train_lm(model, data, TrainConfig(steps=steps))
        out[name] = (evaluate_lm(model, data) if log.diverged_at is None else float("inf"), log.losses)
    return out


def _figure(clouds: list[tuple[Tensor, Tensor, dict]], lm: dict[str, tuple[float, list[float]]]) -> object:
    plt = use_agg()
    fig, axes = plt.subplots(1, len(clouds) + 1, figsize=(4.2 * (len(clouds) + 1), 4))
    fig.suptitle("A trained LayerNorm's input-output cloud is an S-curve (MiniLM, deep layers); "
                 "DyT / Derf train a tiny LM close to LayerNorm")  # fmt: skip
    for ax, (i, (x, y, fit)) in zip(axes, enumerate(clouds), strict=False):
        sel = torch.randperm(len(x), generator=torch.Generator().manual_seed(i))[:20000]
        ax.scatter(x[sel].numpy(), y[sel].numpy(), s=1, alpha=0.3, label="elements (input, normalized output)")
        grid = torch.linspace(float(x.min()), float(x.max()), 200, dtype=torch.float64)
        ax.plot(grid.numpy(), (fit["a"] * torch.tanh(fit["alpha"] * grid)).numpy(), "r-",
                label=f"{fit['a']:.2f} tanh({fit['alpha']:.3f} x), R² {fit['r2_tanh']:.3f}")  # fmt: skip
        ax.plot(grid.numpy(), (grid * fit["inv_std"]).numpy(), "k:", label=f"x / std (1/std = {fit['inv_std']:.3f})")
        ax.set(xlabel="LayerNorm input x", ylabel="output before affine", title=fit["label"])
        ax.legend(fontsize=7, loc="upper left")
    ax = axes[-1]
    for name, (held, losses) in lm.items():
        ax.plot(losses, label=f"{name}: held-out {held:.3f}", alpha=0.8)
    ax.set(xlabel="step", ylabel="training loss (nats/byte)", title="tiny Pre-LN byte LM")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def run(ctx: RunContext) -> Outcome:
    texts = sentences(ctx.size(32, 8, paper=128))
    ctx.progress("MiniLM forward")
    inputs = layernorm_inputs(texts)
    clouds = []
    for k, (x, eps) in enumerate(inputs[-DEEP:]):
        y = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
        fit: dict[str, Any] = dict(fit_tanh(x.flatten(), y.flatten()))
        fit["label"] = f"LayerNorm {len(inputs) - DEEP + k + 1} of {len(inputs)}"
        clouds.append((x.flatten(), y.flatten(), fit))
    data = ByteBatches(stdlib_bytes(ctx.size(1_000_000, 200_000)), ctx.seed)
    lm = _lm_runs(ctx.size(200, 20, paper=2000), data, ctx.seed, ctx)
    ln = lm["LayerNorm"][0]
    rel = {n: (lm[n][0] - ln) / ln for n in ("DyT", "Derf")}
    fits = [c[2] for c in clouds]
    measured = {
        "deep_layernorms": [{k: v for k, v in f.items()} for f in fits],
        "alpha_times_std": [f["alpha"] / f["inv_std"] for f in fits],
        "held_out_loss": {n: v[0] for n, v in lm.items()}, "rel_gap_vs_layernorm": rel,
        "sentences": len(texts), "tokens": int(inputs[-1][0].shape[0]),
    }  # fmt: skip
    statistics = {
        "min_r2_tanh_minus_line": min(f["r2_tanh"] - f["r2_line"] for f in fits),
        "min_alpha_times_max_abs_x": min(f["alpha"] * f["max_abs_x"] for f in fits),
        "dyt_rel_gap": rel["DyT"], "derf_rel_gap": rel["Derf"],
    }  # fmt: skip
    rows = [(f["label"], f["alpha"], f["a"], f["r2_tanh"], f["r2_line"], f["inv_std"]) for f in fits]
    loss_rows = [(n, i, v) for n, (_, c) in lm.items() for i, v in enumerate(c)]
    return Outcome(
        statistics=statistics, measured=measured,
        series={"fits": Series(("layer", "alpha", "a", "r2_tanh", "r2_line", "inv_std"), rows),
                "lm_losses": Series(("norm", "step", "loss"), loss_rows)},
        figure=_figure(clouds, lm),
        notes=f"MiniLM-L6 (6 Post-LN BERT layers, 13 LayerNorms with the embeddings') on {len(texts)} sentences of "
              "stdlib docstrings; the DyT paper plots ViT / wav2vec / DiT layers. The LMs: 2 layers, d_model 64, "
              f"Pre-LN, {ctx.size(200, 20, paper=2000)} steps, DyT / Derf at their default alpha_init 0.5 (not tuned).",
    )  # fmt: skip


EXPERIMENT = Experiment(
    name="dyt-s-curve",
    number=9,
    title="DyT's S-curve",
    claim="A trained LayerNorm's input-output map in deep layers is an S-curve fitted by tanh(alpha x), and the "
    "pointwise replacements DyT and Derf train a tiny LM to within a few percent of LayerNorm's loss",
    guide_words="if you plot input-vs-output for a trained LayerNorm in a deep transformer, you get an S-curve. So "
    "replace the layer with an S-curve",
    anchor="dyt2025",
    anchor_reports="Zhu et al. show tanh-like input-output curves of LayerNorms in trained ViT, wav2vec 2.0 and DiT "
    "models, and DyT matching normalized baselines; alpha tracks 1/std of the activations. Derf (derf2025) "
    "reports erf(alpha x + s) beating LayerNorm, RMSNorm and DyT.",
    rule=RULE,
    estimates_s=estimates(default=15.0, quick=2.5, paper=PAPER_S),
    run=run,
)
