"""Experiment 16: massive activations as gradient regulators (removing them hurts; the sink's gradient grows).

A tiny Pre-LN byte LM with RMSNorm (the library's blocks) is trained on the standard library's sources with a fixed
beginning-of-sequence byte (0, which the sources never contain) in front of every window, as LLMs have a BOS token.
On a held-out batch we read the residual stream leaving every block (forward hooks on the model's own blocks), find
the largest activations with the library's :func:`~normatlas.diagnostics.massive_activations` (Sun et al.: a few
channels on a few tokens, orders of magnitude above the median), and the attention mass every layer puts on the BOS
position (:class:`~normatlas.diagnostics.AttentionCapture`, :func:`~normatlas.diagnostics.attention_sinks`).

Then three interventions on the BOS token's residual stream leaving the block where its largest activation peaks
(a forward hook that rewrites the block's output; the rest of the forward is the model's own): its ``TOP_K``
largest channels set to zero (Sun et al.'s intervention), to their mean over the other tokens (their control), and
``TOP_K`` random channels of it set to zero (ours). We read the held-out loss, and the gradient of the loss with
respect to the BOS token's residual there, which RMSNorm's backward scales by 1/rms(h_BOS) in the next block.
When the BOS token carries nothing above ``FACTOR`` x the median, the two intervention clauses are untested at that
seed (their numbers, on its largest channels, are still reported).
"""

from __future__ import annotations

import statistics as st
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..blocks import TransformerLM, pre_ln
from ..diagnostics import AttentionCapture, massive_activations
from ..presets import RMSNorm
from ._shared import figure, finish
from .base import Experiment, Outcome, RunContext, Series, estimates
from .data import ByteBatches, stdlib_bytes
from .lm import TrainConfig, residual_stream, tiny_lm, train_lm
from .verdict import Clause, Direction, Diverged, Statistic, Untested, VerdictRule

BOS = 0  # the byte put in front of every window (the stdlib sources contain no NUL byte)
TOP_K = 2  # channels of the BOS token's residual that an intervention rewrites
RANDOM_DRAWS = 8  # random TOP_K-channel sets the control averages over
FACTOR = 100.0  # massive: |activation| above FACTOR x the median (the library's default; Sun et al. see ~1000x)
SUN_ZERO_PPL = "LLaMA2-7B WikiText-2 perplexity 5.47 -> inf with its massive activations set to zero"
PAPER_S = 4800.0  # paper scale: 8 layers, d_model 128, 5,000 steps (estimate)
RULE = VerdictRule((
    Clause("max_over_median", Direction.ABOVE, FACTOR,
           "the trained Pre-LN LM has massive activations: its residual stream's largest |activation| is more than "
           f"{FACTOR:g}x the median |activation|"),
    Clause("loss_zero_top_minus_random", Direction.ABOVE, 0.05,
           f"zeroing the BOS token's {TOP_K} largest channels raises the held-out loss (nats) by more than 0.05 "
           f"over zeroing {TOP_K} random channels of it"),
    Clause("sink_grad_growth", Direction.ABOVE, 1.0,
           "with those channels set to their mean over the other tokens, the gradient reaching the BOS token's "
           "residual grows (||dL/dh_BOS|| after / before)"),
))  # fmt: skip


class BosBatches(ByteBatches):
    """:class:`~.data.ByteBatches` whose windows start with the byte :data:`BOS` (the target there is the window's
    first byte): every sequence has one fixed first token, as an LLM's BOS."""

    def train(self, batch: int, seq: int) -> tuple[Tensor, Tensor]:
        return _with_bos(*super().train(batch, seq - 1))

    def held_out(self, batch: int, seq: int) -> tuple[Tensor, Tensor]:
        return _with_bos(*super().held_out(batch, seq - 1))


def _with_bos(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    return torch.cat([torch.full_like(x[:, :1], BOS), x], 1), torch.cat([x[:, :1], y], 1)


def sink_shares(model: TransformerLM, x: Tensor) -> list[float]:
    """Per layer (in call order): the attention mass the queries put on position 0, averaged over heads and queries."""
    shares: list[float] = []

    def seen(probs: Tensor, _logits: Tensor | None) -> None:
        shares.append(float(probs[..., 1:, 0].mean()))  # every query but the BOS itself (which can only see itself)

    with torch.no_grad(), AttentionCapture(seen, max_examples=x.shape[0]):
        model(x)
    return shares


def intervene(
    model: TransformerLM, layer: int, x: Tensor, y: Tensor, edit: Callable[[Tensor], None] | None
) -> tuple[float, float, float]:
    """Held-out loss with block ``layer``'s output rewritten at the BOS position by ``edit`` (None: untouched), the
    norm of dL/dh at the BOS position there (summed over the batch) and the median of that norm over the other
    positions."""
    grads: list[Tensor] = []

    def hook(_m: Any, _args: Any, out: Tensor) -> Tensor:
        out = out.clone()
        if edit is not None:
            with torch.no_grad():
                edit(out)
        out.retain_grad()
        grads.append(out)
        return out

    handle = model.blocks()[layer].register_forward_hook(hook)
    try:
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
    finally:
        handle.remove()
    g = grads[0].grad
    assert g is not None
    per_pos = g.norm(dim=-1).sum(0)  # (T,)
    return float(loss.detach()), float(per_pos[0]), float(per_pos[1:].median())


def _top(found: dict[str, Any]) -> list[int]:
    """The (token, channel) of :func:`~normatlas.diagnostics.massive_activations`' largest entry."""
    first = found["top"][0]
    return [int(first["token"]), int(first["channel"])]


def run(ctx: RunContext) -> Outcome:
    layers, d_model = ctx.size(4, 2, paper=8), ctx.size(64, 32, paper=128)
    cfg = TrainConfig(steps=ctx.size(600, 40, paper=5000), batch=ctx.size(16, 8), seq=ctx.size(64, 32), lr=3e-3)
    data = BosBatches(stdlib_bytes(2_000_000), seed=ctx.seed)
    lm = tiny_lm(pre_ln(), RMSNorm, n_layers=layers, d_model=d_model, seed=ctx.seed)
    log = train_lm(lm, data, cfg, progress=lambda msg: ctx.progress(f"Pre-LN RMSNorm: {msg}"))
    x, y = data.held_out(32, cfg.seq)
    streams = residual_stream(lm, x)[1:]  # leaving each block
    found: list[dict[str, Any]] = [massive_activations(h, factor=FACTOR, top_k=5) for h in streams]
    ratios = [float(f["max_ratio"]) for f in found]
    bos_ratio = [float(h[:, 0].abs().amax() / h.abs().median()) for h in streams]
    peak = max(range(layers), key=lambda i: bos_ratio[i])  # the block where the BOS token's largest activation peaks
    h = streams[peak]
    top = h[0, 0].abs().topk(TOP_K).indices  # the BOS position is the same in every example (it sees only itself)
    mean_other = h[:, 1:].mean(dim=(0, 1))
    gen = ctx.generator(16)
    rest = torch.tensor([c for c in range(d_model) if c not in set(top.tolist())])
    lm.eval()

    def set_to(chans: Tensor, values: Tensor | float) -> Callable[[Tensor], None]:
        def edit(out: Tensor) -> None:
            out[:, 0, chans] = values if isinstance(values, float) else values[chans]

        return edit

    base_loss, base_g, base_g_other = intervene(lm, peak, x, y, None)
    zero_loss, zero_g, _ = intervene(lm, peak, x, y, set_to(top, 0.0))
    mean_loss, mean_g, _ = intervene(lm, peak, x, y, set_to(top, mean_other))
    random_losses = []
    for _ in range(RANDOM_DRAWS):
        chans = rest[torch.randperm(rest.numel(), generator=gen)[:TOP_K]]
        random_losses.append(intervene(lm, peak, x, y, set_to(chans, 0.0))[0])
    random_loss = st.fmean(random_losses)
    shares = sink_shares(lm, x)
    statistics: dict[str, Statistic] = {
        "max_over_median": max(ratios),
        "loss_zero_top_minus_random": (zero_loss - base_loss) - (random_loss - base_loss),
        "sink_grad_growth": mean_g / base_g,
    }
    if bos_ratio[peak] <= FACTOR:  # nothing massive on the sink token: its removal cannot be tested
        why = Untested(
            f"the BOS token's largest activation is {bos_ratio[peak]:.0f}x the median (not above {FACTOR:g}x), so "
            "there was no massive activation to remove"
        )
        statistics["loss_zero_top_minus_random"] = statistics["sink_grad_growth"] = why
    if log.diverged_at is not None:
        statistics = {k: Diverged("the LM's training loss", log.diverged_at) for k in statistics}
    measured: dict[str, Any] = {
        "max_over_median_per_block": ratios,
        "massive_count_per_block": [int(f["massive"]) for f in found],
        "bos_max_over_median_per_block": bos_ratio,
        "top_token_channel_per_block": [_top(f) for f in found],
        "peak_block": peak, "bos_top_channels": top.tolist(), "sequence_length": cfg.seq,
        "bos_top_values": [float(h[0, 0, c]) for c in top], "median_abs_activation": float(h.abs().median()),
        "bos_rms_over_median_token_rms": float(h[0, 0].pow(2).mean().sqrt() / h[:, 1:].pow(2).mean(-1).sqrt().median()),
        "sink_share_per_layer": shares,
        "held_out_loss": base_loss, "loss_top_zeroed": zero_loss, "loss_top_set_to_mean": mean_loss,
        "loss_random_zeroed_mean": random_loss, "loss_random_zeroed": random_losses,
        "grad_norm_bos": base_g, "grad_norm_bos_top_set_to_mean": mean_g, "grad_norm_bos_top_zeroed": zero_g,
        "grad_norm_median_other_token": base_g_other,
        "final_train_loss": sum(log.losses[-20:]) / len(log.losses[-20:]), "diverged_at": log.diverged_at,
    }  # fmt: skip
    series = {
        "blocks": Series.of(
            block=list(range(1, layers + 1)),
            max_over_median=ratios,
            bos_max_over_median=bos_ratio,
            sink_share=shares if len(shares) == layers else [float("nan")] * layers,
        ),
        "interventions": Series.of(
            intervention=["none", "top zeroed", "top set to mean", "random zeroed (mean)"],
            held_out_loss=[base_loss, zero_loss, mean_loss, random_loss],
            grad_norm_bos=[base_g, zero_g, mean_g, float("nan")],
        ),
    }
    notes = (
        f"{layers} Pre-LN layers, d_model {d_model}, RMSNorm; byte LM on the stdlib sources with byte {BOS} as BOS "
        f"before every window; AdamW lr {cfg.lr}, {cfg.steps} steps of {cfg.batch}x{cfg.seq}. Interventions rewrite "
        f"the BOS token's {TOP_K} largest channels leaving block {peak + 1} (where its largest |activation| / median "
        f"peaks) on a held-out batch of 32x{cfg.seq}. Sun et al. (2024): {SUN_ZERO_PPL}, unchanged when set to their "
        "mean; they study 7B-70B LLMs trained on trillions of tokens."
    )
    return Outcome(statistics, measured, series, _figure(ctx, measured, ratios, bos_ratio, shares), notes)


def _figure(ctx: RunContext, m: dict[str, Any], ratios: list[float], bos: list[float], shares: list[float]) -> Any:
    best = max(ratios)
    fig, (a, b, c) = figure(
        3,
        f"Largest activation {best:.0f}x the median ({'massive' if best > FACTOR else 'not massive'}: Sun et al. "
        f"see ~1000x); zeroing the BOS token's top {TOP_K} channels moves the loss "
        f"{m['loss_top_zeroed'] - m['held_out_loss']:+.3f} nats, random ones "
        f"{m['loss_random_zeroed_mean'] - m['held_out_loss']:+.3f}",
        f"seed {ctx.seed}; normatlas experiments run massive-activations{ctx.flag}",
    )
    blocks = list(range(1, len(ratios) + 1))
    a.plot(blocks, ratios, "o-", label="any token")
    a.plot(blocks, bos, "s--", label="BOS token")
    a.axhline(FACTOR, color="0.4", ls=":", label=f"massive ({FACTOR:g}x, library default)")
    a.axhline(1000, color="C3", ls="--", lw=1, label="Sun et al. 2024: ~1000x")
    a.set(xlabel="block", ylabel="largest |activation| / median", yscale="log", title="residual stream")
    if len(shares) == len(blocks):
        b.plot(blocks, shares, "o-", color="C2", label="attention on BOS")
    t = m["sequence_length"]
    uniform = sum(1 / (q + 1) for q in range(1, t)) / (t - 1)
    b.axhline(uniform, color="0.5", ls=":", label=f"uniform causal attention ({uniform:.3f})")
    b.set(xlabel="block", ylabel="mean attention share on position 0", title="attention sink", ylim=(0, 1))
    names = ["none", f"top {TOP_K}\nzeroed", f"top {TOP_K}\nto mean", f"random {TOP_K}\nzeroed"]
    losses = [m["held_out_loss"], m["loss_top_zeroed"], m["loss_top_set_to_mean"], m["loss_random_zeroed_mean"]]
    c.bar(range(4), losses, color=["0.5", "C3", "C1", "C0"], label="held-out loss")
    c.set_xticks(range(4), names, fontsize=8)
    c.set(ylabel="held-out loss (nats/byte)", title=f"interventions at block {m['peak_block'] + 1} (BOS)",
          ylim=(min(losses) * 0.95, max(losses) * 1.02))  # fmt: skip
    for ax in (a, b):
        ax.set_xticks(blocks)
    return finish(fig, (a, b, c), legend_size=7)


EXPERIMENT = Experiment.declare(
    "massive-activations", rule=RULE, estimates_s=estimates(default=120.0, quick=3.0, paper=PAPER_S), run=run
)
