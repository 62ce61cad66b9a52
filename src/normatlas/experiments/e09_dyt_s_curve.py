"""Experiment 9: DyT's S-curve: a trained LayerNorm's input against its output, and pointwise norms that train.

(1) The real all-MiniLM-L6-v2 (transformers, offline) reads real English sentences (the docstrings of standard-
library modules and of their public functions and classes: 256 sentences at the default scale, where the previous
design read 32, too few tokens for the rare large-norm tokens that bend the curve). Forward hooks on its
``nn.LayerNorm`` modules (found by type, in forward order) capture each one's input; its output before the affine
is ``(x - mean) / std`` per token. For the deepest LayerNorms the element-wise (input, output) cloud is fitted with
``a * tanh(alpha * x)`` (grid over alpha, least-squares a) and with a line through 0, and alpha is set against
1 / std of the layer's input.
(2) DyT and Derf (``normatlas.longtail``) replace LayerNorm in a tiny Pre-LN byte LM with DyT's own settings for
LLMs: Zhu et al. (CVPR 2025, arXiv 2503.10622) initialise alpha per site, larger before attention than before the
FFN and at the final norm, and smaller the wider the model: for LLaMA 7B 0.8 / 0.2 / 0.2, 13B 0.6 / 0.15 / 0.15,
34B and 70B 0.2 / 0.05 / 0.05 (the DyT repository's LLaMA README, as summarised at
https://deepwiki.com/jiachenzhu/DyT/3.2-natural-language-processing-applications). Our width (64) is far below
LLaMA 7B's (4,096), for which they list no value, so alpha_0 is swept: the 7B triple times each factor of
:data:`ALPHA_FACTORS` (the paper chose alpha_0 for its LLMs by such a search). The setting that reaches the lowest
training loss (the mean of the last tenth of the steps) is the one compared on held-out loss; Derf (Chen et al.
2025) gets the same per-site sweep (its own LLM settings are not checked here). Everything is fixed before a run.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..blocks import TransformerLM, pre_ln
from ..longtail import Derf, DyT
from ..presets import LayerNorm
from .base import Experiment, Outcome, RunContext, Series, estimates
from .data import ByteBatches, minilm_dir, stdlib_bytes
from .lm import TrainConfig, evaluate_lm, tiny_lm, train_lm
from .runner import use_agg
from .verdict import Clause, Direction, Diverged, Statistic, VerdictRule

TEXT_MODULES = (
    "json", "argparse", "collections", "functools", "itertools", "pathlib", "random", "statistics", "logging",
    "subprocess", "threading", "inspect", "typing", "dataclasses", "enum", "string", "textwrap", "heapq", "bisect",
    "csv", "zipfile", "tarfile", "shutil", "tempfile", "datetime", "calendar", "decimal", "fractions", "difflib",
    "pickle", "copy", "pprint", "ast", "contextlib", "abc", "operator", "socket", "email", "unittest", "urllib.parse",
)  # fmt: skip
DEEP = 3  # the last three LayerNorms of the model are the "deep" ones
MARGIN = 0.05  # DyT / Derf held-out loss within 5% of LayerNorm's (fixed before the run)
BEND = 1.0  # an S-curve: the fitted tanh bends inside the data, alpha * max|x| > BEND
ALPHA_7B = (0.8, 0.2, 0.2)  # DyT's LLaMA-7B alpha_0: before attention, before the FFN, the final norm
ALPHA_FACTORS = (0.5, 1.0, 2.0, 4.0, 8.0)  # the sweep: ALPHA_7B times each (our width 64 is below 7B's 4,096)
PAPER_S = 1000.0  # paper scale: 1,024 sentences, 2,000 LM steps per setting
RULE = VerdictRule((
    Clause("min_r2_tanh_minus_line", Direction.ABOVE, 0.0,
           f"each of the last {DEEP} MiniLM LayerNorms' input-output map is fitted better by tanh than by a line"),
    Clause("min_alpha_times_max_abs_x", Direction.ABOVE, BEND,
           "each fitted tanh bends inside the data (alpha * max|x|)"),
    Clause("dyt_rel_gap", Direction.BELOW, MARGIN,
           "DyT at its best per-site alpha_0 of the sweep (chosen on training loss) is within 5% of LayerNorm's "
           "held-out loss (relative gap)"),
    Clause("derf_rel_gap", Direction.BELOW, MARGIN,
           "Derf, the same way, is within 5% of LayerNorm's held-out loss (relative gap)"),
))  # fmt: skip


def _docstrings() -> list[str]:
    """Each module's docstring, then those of its public functions and classes (by name), in a fixed order."""
    docs = []
    with warnings.catch_warnings():  # typing's deprecated aliases warn when their docstring is read
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in TEXT_MODULES:
            mod = importlib.import_module(name)
            docs.append(mod.__doc__ or "")
            for attr, obj in sorted(vars(mod).items()):
                if not attr.startswith("_") and getattr(obj, "__module__", None) == name and callable(obj):
                    docs.append(obj.__doc__ or "")
    return docs


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct sentences of >= 6 words from standard-library docstrings (real English), drawn at random by
    ``seed`` from all of them (kept in their order)."""
    pool: list[str] = []
    seen: set[str] = set()
    for doc in _docstrings():
        for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
            if len(s.split()) >= 6 and s not in seen:
                seen.add(s)
                pool.append(s)
    if len(pool) < n:
        raise ValueError(f"only {len(pool)} sentences found in {len(TEXT_MODULES)} modules' docstrings, asked for {n}")
    pick = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))[:n].sort().values
    return [pool[int(i)] for i in pick]


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


def set_alphas(model: TransformerLM, alphas: tuple[float, float, float]) -> TransformerLM:
    """Initialise every pointwise norm's alpha per site (DyT's LLM recipe): ``alphas`` = (before attention, before
    the FFN, the final norm), read from the blocks' own slots, not from names."""
    attn, ffn, final = alphas
    sites = [(b.attn_pre_norm, attn) for b in model.blocks()] + [(b.ffn_pre_norm, ffn) for b in model.blocks()]
    sites.append((model.final_norm, final))
    for module, value in sites:
        if not isinstance(module, (DyT, Derf)):
            raise TypeError(f"set_alphas: a norm site holds {type(module).__name__}, not DyT or Derf")
        module.alpha_init = value
        module.reset_parameters()
    return model


@dataclass
class _LM:
    held_out: float  # inf when the run diverged
    train_end: float  # mean training loss over the last tenth of the steps (how the sweep picks)
    losses: list[float]
    diverged_at: int | None


def _train(norm: Any, alphas: tuple[float, float, float] | None, steps: int, data: ByteBatches, seed: int) -> _LM:
    model = tiny_lm(pre_ln(), norm, n_layers=2, d_model=64, seed=seed)
    if alphas is not None:
        set_alphas(model, alphas)
    log = train_lm(model, data, TrainConfig(steps=steps))
    if log.diverged_at is not None:
        return _LM(math.inf, math.inf, log.losses, log.diverged_at)
    tail = log.losses[-max(1, steps // 10) :]
    return _LM(evaluate_lm(model, data), sum(tail) / len(tail), log.losses, None)


def _alphas(k: float) -> tuple[float, float, float]:
    return (ALPHA_7B[0] * k, ALPHA_7B[1] * k, ALPHA_7B[2] * k)


def _lm_runs(steps: int, factors: tuple[float, ...], data: ByteBatches, ctx: RunContext) -> dict[str, Any]:
    """LayerNorm, then DyT and Derf at every factor of the sweep; the best factor of each by training loss."""
    ctx.progress("training the LayerNorm LM")
    out: dict[str, Any] = {"LayerNorm": _train(LayerNorm, None, steps, data, ctx.seed), "sweep": {}, "best": {}}
    for name, norm in (("DyT", DyT), ("Derf", Derf)):
        runs = {}
        for k in factors:
            ctx.progress(f"training the {name} LM at alpha_0 = {k:g} x (0.8, 0.2, 0.2)")
            runs[k] = _train(norm, _alphas(k), steps, data, ctx.seed)
        out["sweep"][name] = runs
        out["best"][name] = min(factors, key=lambda f: runs[f].train_end)
    return out


def _title(fits: list[dict[str, Any]], rel: dict[str, float], best: dict[str, float]) -> str:
    """The first seed's finding in two lines, from its numbers."""
    bent = [f["r2_tanh"] > f["r2_line"] and f["alpha"] * f["max_abs_x"] > BEND for f in fits]
    lines = [str(f["label"]).split(" of ")[0] for f, b in zip(fits, bent, strict=True) if not b]
    curve = f"{sum(bent)} of MiniLM's last {len(fits)} LayerNorms bend like tanh"
    curve += f" ({', '.join(lines)}: a line)" if lines else ""
    gaps = ", ".join(f"{n} {100 * rel[n]:+.1f}% (alpha_0 {best[n]:g}x LLaMA-7B's)" for n in ("DyT", "Derf"))
    return f"{curve}\nheld-out loss against LayerNorm at the best alpha_0: {gaps}; the rule asks < +5%"


def _figure(clouds: list[tuple[Tensor, Tensor, dict]], lm: dict[str, Any], rel: dict[str, float],
            factors: tuple[float, ...], caption: str) -> object:  # fmt: skip
    plt = use_agg()
    n = len(clouds)
    fig, axes = plt.subplots(2, max(n, 2), figsize=(4.2 * max(n, 2), 8.2), squeeze=False)
    fig.suptitle(_title([c[2] for c in clouds], rel, lm["best"]), fontsize=11)
    for ax, (i, (x, y, fit)) in zip(axes[0], enumerate(clouds), strict=False):
        sel = torch.randperm(len(x), generator=torch.Generator().manual_seed(i))[:20000]
        ax.scatter(x[sel].numpy(), y[sel].numpy(), s=1, alpha=0.3, label="elements (input, normalized output)")
        grid = torch.linspace(float(x.min()), float(x.max()), 200, dtype=torch.float64)
        ax.plot(grid.numpy(), (fit["a"] * torch.tanh(fit["alpha"] * grid)).numpy(), "r-",
                label=f"{fit['a']:.2f} tanh({fit['alpha']:.3f} x), R² {fit['r2_tanh']:.3f}")  # fmt: skip
        ax.plot(grid.numpy(), (grid * fit["inv_std"]).numpy(), "k:", label=f"x / std (line R² {fit['r2_line']:.3f})")
        ax.set(xlabel="LayerNorm input x", ylabel="output before affine",
               title=f"{fit['label']}: alpha max|x| = {fit['alpha'] * fit['max_abs_x']:.2g}")  # fmt: skip
        ax.legend(fontsize=7, loc="upper left")
    ln = lm["LayerNorm"].held_out
    ax = axes[1][0]
    for j, name in enumerate(("DyT", "Derf")):
        runs = lm["sweep"][name]
        held = [runs[k].held_out if math.isfinite(runs[k].held_out) else float("nan") for k in factors]
        ax.semilogx([0.2 * k for k in factors], held, "o-", color=f"C{j + 1}", label=name)
    ax.axhline(ln, color="C0", label=f"LayerNorm {ln:.3f}")
    ax.axhline(ln * (1 + MARGIN), color="C0", ls=":", label="LayerNorm + 5% (the rule)")
    ax.axvline(0.2, color="0.5", ls="--", lw=1, label="DyT's LLaMA-7B value (0.2)")
    ax.set(xlabel="alpha_0 at the FFN and final norm (attention side 4x)", ylabel="held-out loss (nats/byte)",
           title="alpha_0 sweep (tiny Pre-LN byte LM, width 64)")  # fmt: skip
    ax.legend(fontsize=7)
    ax = axes[1][1]
    ax.plot(lm["LayerNorm"].losses, color="C0", lw=1, label=f"LayerNorm: held-out {ln:.3f}")
    for j, name in enumerate(("DyT", "Derf")):
        k = lm["best"][name]
        r = lm["sweep"][name][k]
        ax.plot(r.losses, color=f"C{j + 1}", lw=1, label=f"{name} at {k:g}x: held-out {r.held_out:.3f}")
    ax.set(xlabel="step", ylabel="training loss (nats/byte)", title="best alpha_0 of each, training")
    ax.legend(fontsize=7)
    for ax in axes[1][2:]:
        ax.axis("off")
    for row in axes:
        for ax in row:
            ax.grid(alpha=0.3)
    fig.text(0.5, -0.01, caption, ha="center", fontsize=8, color="0.35")
    fig.tight_layout()
    return fig


def run(ctx: RunContext) -> Outcome:
    texts = sentences(ctx.size(256, 64, paper=1024), ctx.seed)
    ctx.progress(f"MiniLM forward on {len(texts)} sentences")
    inputs = layernorm_inputs(texts)
    clouds = []
    for k, (x, eps) in enumerate(inputs[-DEEP:]):
        y = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
        fit: dict[str, Any] = dict(fit_tanh(x.flatten(), y.flatten()))
        fit["label"] = f"LayerNorm {len(inputs) - DEEP + k + 1} of {len(inputs)}"
        clouds.append((x.flatten(), y.flatten(), fit))
    data = ByteBatches(stdlib_bytes(ctx.size(1_000_000, 200_000)), ctx.seed)
    steps = ctx.size(400, 30, paper=2000)
    factors = ctx.pick(ALPHA_FACTORS, (1.0, 4.0))
    lm = _lm_runs(steps, factors, data, ctx)
    ln = lm["LayerNorm"].held_out
    best = {n: lm["sweep"][n][lm["best"][n]] for n in ("DyT", "Derf")}
    rel = {n: (best[n].held_out - ln) / ln for n in best}
    fits = [c[2] for c in clouds]
    measured = {
        "deep_layernorms": [{k: v for k, v in f.items()} for f in fits],
        "alpha_times_std": [f["alpha"] / f["inv_std"] for f in fits],
        "held_out_loss": {"LayerNorm": ln, **{n: b.held_out for n, b in best.items()}},
        "rel_gap_vs_layernorm": rel, "best_alpha_factor": lm["best"],
        "rel_gap_at_llama7b_alpha": {n: (lm["sweep"][n][1.0].held_out - ln) / ln for n in best if 1.0 in factors},
        "sweep_held_out": {n: {f"{k:g}": r.held_out for k, r in lm["sweep"][n].items()} for n in best},
        "sweep_diverged_at": {n: {f"{k:g}": r.diverged_at for k, r in lm["sweep"][n].items()} for n in best},
        "sentences": len(texts), "tokens": int(inputs[-1][0].shape[0]), "lm_steps": steps,
    }  # fmt: skip
    statistics: dict[str, Statistic] = {
        "min_r2_tanh_minus_line": min(f["r2_tanh"] - f["r2_line"] for f in fits),
        "min_alpha_times_max_abs_x": min(f["alpha"] * f["max_abs_x"] for f in fits),
    }
    for n in ("DyT", "Derf"):
        b = best[n]
        statistics[f"{n.lower()}_rel_gap"] = (
            rel[n] if b.diverged_at is None else Diverged(f"{n}'s LM at every alpha_0", b.diverged_at)
        )
    if lm["LayerNorm"].diverged_at is not None:
        for n in ("dyt", "derf"):
            statistics[f"{n}_rel_gap"] = Diverged("the LayerNorm LM", lm["LayerNorm"].diverged_at)
    rows = [(f["label"], f["alpha"], f["a"], f["r2_tanh"], f["r2_line"], f["inv_std"]) for f in fits]
    loss_rows = [("LayerNorm", "", i, v) for i, v in enumerate(lm["LayerNorm"].losses)]
    swept = [(n, k, r) for n, runs in lm["sweep"].items() for k, r in runs.items()]
    loss_rows += [(n, k, i, v) for n, k, r in swept for i, v in enumerate(r.losses)]
    sweep_rows = [(n, k, *_alphas(k), r.held_out, r.train_end) for n, k, r in swept]
    caption = f"seed {ctx.seed}; normatlas experiments run dyt-s-curve{ctx.flag}"
    return Outcome(
        statistics=statistics, measured=measured,
        series={"fits": Series(("layer", "alpha", "a", "r2_tanh", "r2_line", "inv_std"), rows),
                "lm_losses": Series(("norm", "alpha_factor", "step", "loss"), loss_rows),
                "alpha_sweep": Series(("norm", "alpha_factor", "alpha_attn", "alpha_ffn", "alpha_final",
                                       "held_out_loss", "train_loss_last_tenth"), sweep_rows)},
        figure=_figure(clouds, lm, rel, factors, caption),
        notes=f"MiniLM-L6 (6 Post-LN BERT layers, 13 LayerNorms with the embeddings') on {len(texts)} sentences of "
              "stdlib docstrings; the DyT paper plots ViT / wav2vec / DiT layers. The LMs: 2 layers, d_model 64, "
              f"Pre-LN, {steps} steps; DyT / Derf alpha_0 per site (before attention, before the FFN, final) = "
              f"(0.8, 0.2, 0.2) x {list(factors)} (DyT's LLaMA-7B values times a factor; the paper lists none for "
              "width 64), the best factor chosen on training loss. Not done: the paper's other LLaMA changes.",
    )  # fmt: skip


EXPERIMENT = Experiment.declare(
    "dyt-s-curve", rule=RULE, estimates_s=estimates(default=200.0, quick=15.0, paper=PAPER_S), run=run
)
