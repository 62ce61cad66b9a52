"""The logit lens through the model's own final norm (guide §12.5), and its tuned variant.

Every layer's output stream is decoded by the model's own tail (:meth:`.reading.Reading.decode`: the final norm,
any head transform, the head, the logit scale and soft-cap, found from the dataflow), so the last row is the
model's logits exactly. Per layer: the top-k next tokens at the prompt's last position, the KL divergence from the
final layer's distribution (``KL(p_final || p_layer)`` in nats, mean over positions and at the last one), and the
rank of the final answer (the model's top-1 token at the last position; 0 = top).

The **tuned** variant refits the final norm's gain per layer, the tuned-lens way (Belrose et al., 2023, who fit a
full affine map per layer; here only the norm's own knob): a vector ``g_l`` multiplies the final norm's output
for layer ``l`` (the norm's gain becomes ``g_l * w``), fitted to minimise the same KL on held-out text.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .reading import Reading, ToolError, capture_stream, finish_figure, model_inputs, read_model
from .text import check_ids, heldout_ids, window_len

__all__ = [
    "LensResult",
    "TunedFit",
    "fit_on_heldout",
    "fit_tuned_gains",
    "lens_figure",
    "logit_lens",
    "token_text",
    "tuned_rows",
    "tuned_title",
    "windows",
]

TUNED_WINDOWS = 16  # held-out windows the tuned gains are fit on, and as many after them they are evaluated on


def token_text(tokenizer: Any, i: int) -> str:
    """One token as readable text (control characters escaped, a space as an open box)."""
    if tokenizer is None:
        return str(i)
    s = tokenizer.decode([i])
    if s == "\ufffd":  # one byte of a multi-byte character
        return f"<{i}>"
    return repr(s)[1:-1].replace(" ", "\u2423") if s else f"<{i}>"  # a space shows as an open box


@dataclass
class LensResult:
    model: str
    text: str
    tokens: list[str]  # the prompt's tokens
    answer: str  # the final layer's top-1 at the last position
    rows: list[dict[str, Any]]  # one per layer: 0 = the embeddings, l = after layer l
    top1: list[list[str]]  # [layer][position]: each layer's top-1 token
    kl: list[list[float]]  # [layer][position]: KL(p_final || p_layer), nats
    tuned: bool = False
    kl_tuned: list[list[float]] = field(default_factory=list)


def _kl(final: Tensor, logits: Tensor) -> Tensor:
    """KL(p_final || p) per position, in float64 (nats)."""
    lp, lq = F.log_softmax(final.double(), -1), F.log_softmax(logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


@torch.no_grad()
def logit_lens(
    model: nn.Module,
    ids: Tensor,
    tokenizer: Any = None,
    *,
    k: int = 5,
    reading: Reading | None = None,
    gains: Tensor | None = None,
    name: str | None = None,
) -> LensResult:
    """The lens on one prompt ``ids`` (shape (1, T)); ``gains`` (layers + 1, width) from :func:`fit_tuned_gains`
    adds the tuned lens's columns."""
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must have shape (1, T), got {tuple(ids.shape)}")
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    model = model.eval()
    reading = reading or read_model(model, ids)
    with capture_stream(model, reading) as streams:
        model(**model_inputs(model, ids))
    logits = [reading.decode(model, h)[0] for h in streams]
    final = logits[-1]
    answer = int(final[-1].argmax())
    tuned = [reading.decode(model, h, g)[0] for h, g in zip(streams, gains, strict=True)] if gains is not None else []
    rows, top1, kls, kls_t = [], [], [], []
    for layer, lg in enumerate(logits):
        kl = _kl(final, lg)
        p = F.softmax(lg[-1].double(), -1)
        top = torch.topk(p, min(k, p.numel()))
        row: dict[str, Any] = {
            "layer": layer,
            "stream": "embeddings" if layer == 0 else f"after layer {layer - 1}",
            "top_k": " ".join(f"{token_text(tokenizer, int(i))}:{float(v):.2f}" for v, i in zip(*top, strict=True)),
            "kl_mean": float(kl.mean()),
            "kl_last": float(kl[-1]),
            "answer_rank": int((lg[-1] > lg[-1, answer]).sum()),
            "answer_p": float(p[answer]),
        }
        if tuned:
            kt = _kl(final, tuned[layer])
            row.update(kl_mean_tuned=float(kt.mean()), kl_last_tuned=float(kt[-1]))
            row["answer_rank_tuned"] = int((tuned[layer][-1] > tuned[layer][-1, answer]).sum())
            kls_t.append(kt.tolist())
        rows.append(row)
        top1.append([token_text(tokenizer, int(i)) for i in lg.argmax(-1)])
        kls.append(kl.tolist())
    text = tokenizer.decode(ids[0].tolist()) if tokenizer is not None else " ".join(map(str, ids[0].tolist()))
    return LensResult(
        name or type(model).__name__,
        text,
        [token_text(tokenizer, int(i)) for i in ids[0]],
        token_text(tokenizer, answer),
        rows,
        top1,
        kls,
        bool(tuned),
        kls_t,
    )


@dataclass
class TunedFit:
    gains: Tensor  # (layers + 1, width); the last row is ones (the model's own final layer)
    kl_before: list[float]  # mean KL per layer on the evaluation windows, plain lens
    kl_after: list[float]  # and with the refit gains
    steps: int
    fit_tokens: int
    eval_tokens: int


def _streams(model: nn.Module, reading: Reading, ids: Tensor) -> tuple[list[Tensor], Tensor]:
    with torch.no_grad(), capture_stream(model, reading) as streams:
        model(**model_inputs(model, ids))
        hs = [h.detach() for h in streams]
    with torch.no_grad():
        final = reading.decode(model, hs[-1])
    return hs, final


def fit_tuned_gains(
    model: nn.Module,
    reading: Reading,
    fit_ids: Tensor,
    eval_ids: Tensor,
    *,
    steps: int = 200,
    lr: float = 0.05,
    seed: int = 0,
) -> TunedFit:
    """Fit one gain vector per layer multiplying the final norm's output, minimising KL(p_final || p_layer) on
    ``fit_ids`` (B, T) with Adam; report the mean KL per layer on ``eval_ids`` before and after."""
    if reading.norm_at is None:
        raise ToolError("the model has no final norm module to refit (a Post-LN model ends in its last layer's norm)")
    torch.manual_seed(seed)
    model = model.eval()
    hs, final = _streams(model, reading, fit_ids)
    with torch.no_grad():
        probe = model.get_submodule(reading.tail[reading.norm_at])(hs[-1][:1, :1])
    width = probe.shape[-1]
    gains = torch.ones(len(hs) - 1, width, dtype=torch.float32, requires_grad=True)
    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam([gains], lr=lr)
    target = F.log_softmax(final.float(), -1).detach()
    try:
        for _ in range(steps):
            loss = torch.zeros(())
            for layer, h in enumerate(hs[:-1]):
                lq = F.log_softmax(reading.decode(model, h, gains[layer]).float(), -1)
                loss = loss + (target.exp() * (target - lq)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        for p, flag in zip(model.parameters(), flags, strict=True):
            p.requires_grad_(flag)
    full = torch.cat([gains.detach(), torch.ones(1, width)])
    ehs, efinal = _streams(model, reading, eval_ids)
    with torch.no_grad():
        before = [float(_kl(efinal, reading.decode(model, h)).mean()) for h in ehs]
        after = [float(_kl(efinal, reading.decode(model, h, g)).mean()) for h, g in zip(ehs, full, strict=True)]
    return TunedFit(full, before, after, steps, fit_ids.numel(), eval_ids.numel())


def fit_on_heldout(model: nn.Module, tok: Any, reading: Reading, steps: int = 200, seed: int = 0) -> TunedFit:
    """:func:`fit_tuned_gains` on the held-out standard-library text: fit on :data:`TUNED_WINDOWS` windows, evaluated
    on as many after them (``normatlas lens --tuned`` and the page's lens)."""
    ids = heldout_ids(tok)
    check_ids(model, ids, "the held-out text")
    seq = window_len(model)
    fit_ids = windows(ids, seq, TUNED_WINDOWS)
    eval_ids = windows(ids, seq, TUNED_WINDOWS, offset=TUNED_WINDOWS * seq)
    return fit_tuned_gains(model, reading, fit_ids, eval_ids, steps=steps, seed=seed)


def tuned_rows(fit: TunedFit) -> list[dict[str, Any]]:
    """One row per layer: the mean KL to the final layer through the plain lens and through the refit gain."""
    pairs = enumerate(zip(fit.kl_before, fit.kl_after, strict=True))
    return [{"layer": i, "kl_lens": b, "kl_tuned": a} for i, (b, a) in pairs]


def tuned_title(fit: TunedFit) -> str:
    return (
        f"tuned gain: mean KL(final || layer) on {fit.eval_tokens} other held-out tokens "
        f"(fit on {fit.fit_tokens}, {fit.steps} steps)"
    )


def lens_figure(result: LensResult, path: str | os.PathLike[str], caption: str = "", max_positions: int = 24) -> Any:
    """Two panels: each layer's top-1 token per position, coloured by its KL to the final layer; and the KL and the
    final answer's rank by layer (the tuned lens beside the plain one when it was fitted)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    n_layers = len(result.rows)
    pos = list(range(max(0, len(result.tokens) - max_positions), len(result.tokens)))
    kl = torch.tensor(result.kl)[:, pos].clamp_min(1e-6).log10().numpy()
    fig = plt.figure(figsize=(max(8.0, 0.55 * len(pos) + 4.5), 2.2 + 0.42 * n_layers))
    grid = fig.add_gridspec(1, 2, width_ratios=[max(3.0, len(pos) / 4), 1.6])
    ax = fig.add_subplot(grid[0])
    im = ax.imshow(kl, aspect="auto", origin="lower", cmap="viridis_r", vmin=-3, vmax=max(1.0, float(kl.max())))
    for r in range(n_layers):
        for c, p in enumerate(pos):
            ax.text(c, r, result.top1[r][p][:6], ha="center", va="center", fontsize=7, color="black")
    ax.set_xticks(range(len(pos)), [result.tokens[p][:6] for p in pos], rotation=90, fontsize=7)
    ax.set_yticks(range(n_layers), [str(r["layer"]) for r in result.rows], fontsize=7)
    ax.set_xlabel("input token (the prediction is of the next one)")
    ax.set_ylabel("layer (0 = embeddings)")
    fig.colorbar(im, ax=ax, label="log10 KL(final || layer), nats")
    ax2 = fig.add_subplot(grid[1])
    layers = [r["layer"] for r in result.rows][:-1]  # the final layer's KL to itself is 0
    ax2.plot(layers, [r["kl_mean"] for r in result.rows][:-1], "o-", color="tab:blue", label="KL, lens")
    if result.tuned:
        ax2.plot(layers, [r["kl_mean_tuned"] for r in result.rows][:-1], "s--", color="tab:orange", label="KL, tuned")
    ax2.set_yscale("log")
    ax2.set_xlabel("layer (0 = embeddings)")
    ax2.set_ylabel("KL(final || layer), nats, mean over positions")
    ax3 = ax2.twinx()
    every = [r["layer"] for r in result.rows]
    ax3.plot(every, [r["answer_rank"] + 1 for r in result.rows], "^:", color="tab:green", label="answer rank+1, lens")
    if result.tuned:
        ax3.plot(every, [r["answer_rank_tuned"] + 1 for r in result.rows], "v:", color="tab:red",
                 label="answer rank+1, tuned")  # fmt: skip
    ax3.set_yscale("log")
    ax3.set_ylabel(f"rank of {result.answer!r} at the last position, + 1")
    h2, l2 = ax2.get_legend_handles_labels()
    h3, l3 = ax3.get_legend_handles_labels()
    ax2.legend(h2 + h3, l2 + l3, fontsize=7)
    first = _first_settled(result)
    fig.suptitle(
        f"{result.model}: decoded through its own final norm, the stream names the answer {result.answer!r} "
        f"from layer {first} on"
        if first is not None
        else f"{result.model}: the logit lens through the final norm",
        fontsize=9,
    )
    finish_figure(fig, path, caption)
    return path


def _first_settled(result: LensResult) -> int | None:
    """The first layer from which the answer stays the top-1 at the last position."""
    first = None
    for r in result.rows:
        first = (r["layer"] if first is None else first) if r["answer_rank"] == 0 else None
    return first


def windows(ids: Sequence[int], seq: int, count: int, offset: int = 0) -> Tensor:
    """``count`` consecutive windows of ``seq`` tokens from ``ids`` starting at ``offset`` (fewer if too short)."""
    n = min(count, max(0, (len(ids) - offset) // seq))
    if n < 1:
        raise ValueError(f"{len(ids) - offset} tokens cannot make one window of {seq}")
    return torch.tensor(list(ids[offset : offset + n * seq]), dtype=torch.long).view(n, seq)
