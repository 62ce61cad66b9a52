"""Pure metric functions: each takes tensors and returns plain numbers or small dicts.

Every function here is stateless and side-effect free, so the :class:`~normatlas.diagnostics.Monitor`
hooks, the CLI report and user code all share one definition of each quantity.

The quantities and where they come from (see the essay, sections on the curse of depth,
attention entropy collapse, massive activations, bf16 and VLM interfaces):

* residual-stream statistics (Pre-LN variance growth, Sun et al. 2025 "Curse of Depth"),
* attention entropy and maximum logit (Zhai et al. 2023, "attention entropy collapse";
  Dehghani et al. 2023, ViT-22B),
* massive activations (Sun et al. 2024) and attention sinks (Xiao et al. 2024),
* bf16 / fp16 headroom (the essay's "fourth reason"),
* repeated n-grams in token batches (OLMo 2, Team OLMo 2024),
* modality norm gap and image-processor constants (the essay's VLM section).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "BF16_MAX",
    "FP16_MAX",
    "attention_sinks",
    "attention_stats",
    "headroom",
    "massive_activations",
    "modality_norm_gap",
    "repeated_ngrams",
    "residual_stats",
    "token_norms",
]

BF16_MAX = float(torch.finfo(torch.bfloat16).max)
FP16_MAX = float(torch.finfo(torch.float16).max)
_BF16_TINY = float(torch.finfo(torch.bfloat16).smallest_normal)


def _check_tensor(x: object, name: str, min_dim: int = 1) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; at least {min_dim} dims are required")
    return x


def token_norms(x: Tensor) -> Tensor:
    """Per-token L2 norm over the last (feature) axis, in float32."""
    return _check_tensor(x, "x").detach().float().norm(dim=-1)


def residual_stats(h_in: Tensor, h_out: Tensor) -> dict[str, float]:
    """Statistics of one block seen as ``h_out = h_in + update`` (any placement).

    Returns ``rms`` and ``var`` of the stream after the block, ``update_ratio``
    (RMS of ``h_out - h_in`` over RMS of ``h_in``: the branch's contribution to the
    residual; it shrinks with depth in Pre-LN, which is the curse of depth) and
    ``identity_cos`` (mean per-token cosine between input and output: 1 means the
    block is an identity up to scale). For Post-LN blocks the update includes the
    norm's rescaling, so read ``identity_cos`` there.
    """
    a = _check_tensor(h_in, "h_in").detach().float()
    b = _check_tensor(h_out, "h_out").detach().float()
    if a.shape != b.shape:
        raise ValueError(f"h_in shape {tuple(a.shape)} and h_out shape {tuple(b.shape)} must match")
    delta = b - a
    rms_in = a.pow(2).mean().sqrt()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-12)
    return {
        "rms": float(b.pow(2).mean().sqrt()),
        "var": float(b.var(dim=-1, unbiased=False).mean()),
        "update_ratio": float(delta.pow(2).mean().sqrt() / rms_in.clamp_min(1e-30)),
        "identity_cos": float(cos.mean()),
    }


def attention_stats(probs: Tensor, logits: Tensor | None = None, valid: Tensor | None = None) -> dict[str, object]:
    """Entropy (nats) and maximum logit of attention probabilities ``(B, H, Tq, Tk)``.

    ``valid`` is an optional boolean mask of query rows to average over (e.g. not
    padding), broadcastable to ``(B, H, Tq)``. Returns the mean entropy over heads,
    the per-head mean entropy, the normalized entropy (entropy / log(number of keys
    each query may attend to), 1 = uniform, 0 = one-hot) and, when logits are given,
    the largest finite logit overall and per head.
    """
    p = _check_tensor(probs, "probs", 4).detach().float()
    ent = -(p * p.clamp_min(1e-30).log()).sum(-1)  # (B, H, Tq)
    support = (p > 0).sum(-1).clamp_min(2).float().log()
    norm_ent = ent / support
    w = torch.ones_like(ent) if valid is None else valid.to(ent.dtype).expand_as(ent)
    denom = w.sum(dim=(0, 2)).clamp_min(1.0)
    head_ent = (ent * w).sum(dim=(0, 2)) / denom
    head_norm = (norm_ent * w).sum(dim=(0, 2)) / denom
    out: dict[str, object] = {
        "entropy": float(head_ent.mean()),
        "entropy_min_head": float(head_ent.min()),
        "entropy_norm": float(head_norm.mean()),
        "entropy_norm_min": float(head_norm.min()),
        "entropy_per_head": [float(v) for v in head_ent],
    }
    if logits is not None:
        lg = logits.detach().float()
        lg = torch.where(torch.isfinite(lg), lg, torch.full_like(lg, -math.inf))
        per_head = lg.amax(dim=(0, 2, 3))
        out["max_logit"] = float(per_head.max())
        out["max_logit_per_head"] = [float(v) for v in per_head]
    return out


def attention_sinks(probs: Tensor, threshold: float = 0.3) -> dict[str, object]:
    """Key positions that absorb attention mass: mean over batch, heads and queries.

    A sink is a key whose average received attention exceeds ``threshold``
    (Xiao et al. 2024: the first token usually). Returns the top key, its share
    and the list of sink positions.
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold={threshold!r} must lie in (0, 1]")
    p = _check_tensor(probs, "probs", 4).detach().float()
    share = p.mean(dim=(0, 1, 2))  # (Tk,)
    top = int(share.argmax())
    return {
        "sink_token": top,
        "sink_share": float(share[top]),
        "sinks": [int(i) for i in torch.nonzero(share > threshold).flatten()],
    }


def massive_activations(
    x: Tensor, factor: float = 100.0, top_k: int = 3, median_sample: int | None = 4096
) -> dict[str, object]:
    """Entries of a ``(B, T, D)`` (or ``(T, D)``) activation far above the median magnitude.

    Sun et al. (2024) call an activation massive when its magnitude is large in
    absolute terms and about ``1000x`` the median; we report the ratio of each of the
    ``top_k`` largest magnitudes to the median magnitude, with which example, token and
    channel it sits at, and ``massive`` = how many entries exceed ``factor`` x median.
    The median is exact up to ``median_sample`` values and estimated above that from
    ``median_sample`` evenly strided values (None: always exact); the top values are exact.
    """
    if factor <= 1.0:
        raise ValueError(f"factor={factor!r} must be > 1")
    a = _check_tensor(x, "x", 2).detach().float().abs()
    if a.dim() == 2:
        a = a.unsqueeze(0)
    a = a.reshape(a.shape[0], -1, a.shape[-1])
    flat = a.flatten()
    if median_sample is not None and flat.numel() > median_sample:
        flat = flat[:: -(-flat.numel() // median_sample)]
    med = float(flat.median().clamp_min(1e-30))
    vals, idx = a.flatten().topk(min(top_k, a.numel()))
    tops = []
    t, d = a.shape[1], a.shape[2]
    for v, i in zip(vals.tolist(), idx.tolist(), strict=False):
        tops.append({"example": i // (t * d), "token": (i // d) % t, "channel": i % d, "value": v, "ratio": v / med})
    return {"median": med, "max_ratio": tops[0]["ratio"], "massive": int((a > factor * med).sum()), "top": tops}


def headroom(x: Tensor) -> dict[str, float]:
    """Distance of ``x``'s largest magnitude from the bf16 / fp16 maximum, in powers of two.

    ``bf16_headroom_log2 = log2(bf16_max / max|x|)`` (negative means overflow);
    ``fp16_headroom_log2`` likewise; ``bf16_underflow_share`` is the share of non-zero
    values that become zero when cast to bf16, and ``bf16_subnormal_share`` the share
    below bf16's smallest normal number.
    """
    a = _check_tensor(x, "x").detach()
    af = a.float().abs()
    amax = float(af.max()) if af.numel() else 0.0
    nz = af > 0
    n = max(int(nz.sum()), 1)
    under = (a.to(torch.bfloat16) == 0) & nz
    return {
        "absmax": amax,
        "bf16_headroom_log2": math.log2(BF16_MAX / amax) if amax > 0 else math.inf,
        "fp16_headroom_log2": math.log2(FP16_MAX / amax) if amax > 0 else math.inf,
        "bf16_underflow_share": float(under.sum()) / n,
        "bf16_subnormal_share": float(((af < _BF16_TINY) & nz).sum()) / n,
    }


def _longest_true_run(eq: Tensor) -> Tensor:
    """Length of the longest run of True along the last axis, per row."""
    x = eq.to(torch.int64)
    csum = x.cumsum(-1)
    # value of csum at the last False before each position
    reset = torch.where(x == 0, csum, torch.zeros_like(csum))
    last_reset = reset.cummax(-1).values
    return (csum - last_reset).amax(-1) if x.shape[-1] else torch.zeros(x.shape[:-1], dtype=torch.int64)


def repeated_ngrams(
    input_ids: Tensor, max_ngram: int = 13, min_repeats: int = 32, ignore_id: int | None = None
) -> dict[str, object]:
    """Sequences in a ``(B, T)`` batch holding an n-gram repeated back to back.

    For each period ``n`` in 1..``max_ngram``, a run where ``ids[t] == ids[t - n]``
    for ``L`` consecutive positions is an n-gram repeated ``1 + L / n`` times.
    OLMo 2 removed documents with 32 or more repeats of an n-gram up to 13 tokens
    after tracing loss spikes to them. Returns the per-sequence worst repeat count
    and the flagged sequences. ``ignore_id`` (e.g. padding) never counts as a repeat.
    """
    ids = _check_tensor(input_ids, "input_ids", 1)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
    if max_ngram < 1 or min_repeats < 2:
        raise ValueError(f"max_ngram={max_ngram!r} must be >= 1 and min_repeats={min_repeats!r} >= 2")
    ids = ids.reshape(-1, ids.shape[-1]) if ids.dim() > 1 else ids.unsqueeze(0)
    best = torch.zeros(ids.shape[0])
    best_n = torch.zeros(ids.shape[0], dtype=torch.int64)
    for n in range(1, min(max_ngram, ids.shape[1] - 1) + 1):
        eq = ids[:, n:] == ids[:, :-n]
        if ignore_id is not None:
            eq &= ids[:, n:] != ignore_id
        reps = 1.0 + _longest_true_run(eq).float() / n
        better = reps > best
        best = torch.where(better, reps, best)
        best_n = torch.where(better, torch.full_like(best_n, n), best_n)
    flagged = [int(i) for i in torch.nonzero(best >= min_repeats).flatten()]
    return {
        "max_repeats": float(best.max()) if best.numel() else 0.0,
        "repeats": [float(v) for v in best],
        "ngram": [int(v) for v in best_n],
        "flagged": flagged,
    }


def modality_norm_gap(vision_tokens: Tensor, text_tokens: Tensor) -> dict[str, float]:
    """Mean per-token L2 norm of vision and text tokens at a VLM interface, and their ratio.

    The essay's VLM section: vision-encoder outputs sit at norms 30-90x the text
    embeddings of the language model they feed. ``gap = vision / text``.
    """
    v = float(token_norms(vision_tokens).mean())
    t = float(token_norms(text_tokens).mean())
    return {"vision_norm": v, "text_norm": t, "gap": v / t if t > 0 else math.inf}


def as_floats(values: Sequence[float] | Tensor, name: str) -> tuple[float, ...]:
    """Normalize a short sequence of numbers (helper for the image-processor check)."""
    if isinstance(values, Tensor):
        values = values.flatten().tolist()
    if isinstance(values, (int, float)):
        values = [float(values)]
    try:
        out = tuple(float(v) for v in values)
    except TypeError as exc:
        raise TypeError(f"{name}={values!r} must be a sequence of numbers") from exc
    if not out:
        raise ValueError(f"{name} must not be empty")
    return out
