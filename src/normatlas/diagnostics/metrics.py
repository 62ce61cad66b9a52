"""Pure metric functions: each takes tensors and returns plain numbers or small dicts; and the names of what
a Monitor measures (:class:`Metric`, :data:`DEFAULT_METRICS`) with its effective-LR laws (:data:`LR_POWER`).

Every function here is stateless and side-effect free, so the Monitor's metric objects
(:mod:`~normatlas.diagnostics.monitor_metrics`), the CLI report and user code all share one definition of each quantity.

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

import enum
import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "BF16_MAX",
    "DEFAULT_METRICS",
    "FP16_MAX",
    "LR_POWER",
    "MASKED_LOGIT",
    "Metric",
    "attention_sinks",
    "attention_stats",
    "headroom",
    "masked_logits",
    "massive_activations",
    "modality_norm_gap",
    "repeated_ngrams",
    "residual_stats",
    "token_norms",
]

BF16_MAX = float(torch.finfo(torch.bfloat16).max)
FP16_MAX = float(torch.finfo(torch.float16).max)
_BF16_TINY = float(torch.finfo(torch.bfloat16).smallest_normal)
# an attention logit at or below this is a mask, not a score (additive masks of finfo(float32).min, -1e9);
# in float16 the bound is half of float16's lowest value (masks of finfo(float16).min). Real logits of a
# collapsing model reach -1e4 and beyond (TinyLM collapse: -1.6e4), so no bound near that range is safe.
MASKED_LOGIT = -1e8
_FP16_MASKED_LOGIT = float(torch.finfo(torch.float16).min) / 2


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


def masked_logits(logits: Tensor) -> Tensor:
    """Boolean mask of the attention logits that are masked rather than scores: ``-inf``, NaN, or an
    additive mask at most :data:`MASKED_LOGIT` (``-1e8``; half of float16's lowest value for float16
    logits). Masks of ``-1e4`` (older BERT/GPT-2 code) are not recognized: pass ``allowed`` there."""
    lg = _check_tensor(logits, "logits").detach()
    floor = _FP16_MASKED_LOGIT if lg.dtype == torch.float16 else MASKED_LOGIT
    return ~torch.isfinite(lg) | (lg <= floor)


def _allowed_keys(p: Tensor, logits: Tensor | None, allowed: Tensor | None) -> Tensor:
    """How many keys each query row of ``p`` ``(B, H, Tq, Tk)`` may attend to, as ``(B, H, Tq)``."""
    if allowed is not None:
        if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
            got = allowed.dtype if isinstance(allowed, Tensor) else type(allowed).__name__
            raise TypeError(f"allowed must be a boolean torch.Tensor, got {got}")
        try:
            mask = allowed.to(p.device).expand_as(p)
        except RuntimeError as exc:
            raise ValueError(
                f"allowed has shape {tuple(allowed.shape)}; it must broadcast to probs {tuple(p.shape)}"
            ) from exc
    elif logits is not None:
        if logits.shape != p.shape:
            raise ValueError(f"logits shape {tuple(logits.shape)} must equal probs shape {tuple(p.shape)}")
        mask = ~masked_logits(logits).to(p.device)
    else:  # every key, except in rows masked entirely (their probabilities are all zero)
        return torch.where(p.sum(-1) > 0, float(p.shape[-1]), 0.0)
    return mask.sum(-1).float()


def attention_stats(
    probs: Tensor, logits: Tensor | None = None, valid: Tensor | None = None, allowed: Tensor | None = None
) -> dict[str, object]:
    """Entropy (nats) and maximum logit of attention probabilities ``(B, H, Tq, Tk)``.

    The normalized entropy of a query row is its entropy over ``log(n)``, where ``n`` is the
    number of keys the query may attend to (1 = uniform over them, 0 = one-hot). ``n`` is
    never read from the probabilities, which softmax rounds to exactly 0 for losing keys as
    attention collapses; it comes from

    * ``allowed``: a boolean mask of the keys each query may attend to, broadcastable to
      ``(B, H, Tq, Tk)`` (e.g. ``torch.ones(T, T, dtype=torch.bool).tril()`` for causal), else
    * ``logits``: the keys whose logit is not masked (:func:`masked_logits`: ``-inf`` and
      additive masks of ``finfo(dtype).min`` or ``-1e9`` count as masked; a causal map's row
      ``i`` allows ``i + 1`` keys), else
    * every key ``Tk`` (rows whose probabilities are all zero count as fully masked): pass
      ``allowed`` or ``logits`` for causal or padded attention.

    Rows that may attend to fewer than two keys (the first row of a causal map, fully masked
    rows) have entropy 0 by construction and are left out of every average; a head with no
    other row reports NaN. ``valid`` is an optional boolean mask of query rows to average over
    (e.g. not padding), broadcastable to ``(B, H, Tq)``.

    Returns the mean entropy over heads, the per-head mean entropy, the normalized entropy
    (mean over heads and its minimum over heads) and, when logits are given, the largest
    finite logit overall and per head.
    """
    p = _check_tensor(probs, "probs", 4).detach().float()
    ent = -(p * p.clamp_min(1e-30).log()).sum(-1)  # (B, H, Tq)
    n_keys = _allowed_keys(p, logits, allowed)
    informative = n_keys >= 2
    norm_ent = torch.where(informative, ent / n_keys.clamp_min(2.0).log(), torch.zeros_like(ent))
    w = informative.to(ent.dtype)
    if valid is not None:
        w = w * valid.to(device=ent.device, dtype=ent.dtype).expand_as(ent)
    denom = w.sum(dim=(0, 2))
    nan = torch.full_like(denom, math.nan)
    head_ent = torch.where(denom > 0, (ent * w).sum(dim=(0, 2)) / denom.clamp_min(1.0), nan)
    head_norm = torch.where(denom > 0, (norm_ent * w).sum(dim=(0, 2)) / denom.clamp_min(1.0), nan)
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

    ``bf16_headroom_log2 = log2(bf16_max / max|x|)`` (negative means overflow; ``-inf`` when
    ``x`` already holds an inf or NaN); ``fp16_headroom_log2`` likewise; ``nonfinite_share`` is
    the share of values that are inf or NaN; ``bf16_underflow_share`` is the share of non-zero
    finite values that become zero when cast to bf16, and ``bf16_subnormal_share`` the share
    below bf16's smallest normal number. ``absmax`` is ``max|x|`` (inf or NaN when ``x`` holds one).
    """
    a = _check_tensor(x, "x").detach()
    af = a.float().abs()
    finite = torch.isfinite(a)
    n_nonfinite = int((~finite).sum())
    amax = float((a if a.is_floating_point() else af).abs().max()) if a.numel() else 0.0  # float64 stays exact
    nz = (af > 0) & finite
    n = max(int(nz.sum()), 1)
    under = (a.to(torch.bfloat16) == 0) & nz

    def room(limit: float) -> float:
        if n_nonfinite:
            return -math.inf
        return math.log2(limit / amax) if amax > 0 else math.inf

    return {
        "absmax": amax,
        "bf16_headroom_log2": room(BF16_MAX),
        "fp16_headroom_log2": room(FP16_MAX),
        "nonfinite_share": n_nonfinite / max(af.numel(), 1),
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


# ----------------------------------------------------------------------------- what a Monitor measures


class Metric(enum.Enum):
    """The built-in Monitor metrics by name (each a class in :data:`~.monitor_metrics.REGISTRY`)."""

    OUTPUT_NORM = "output_norm"
    GRAD_NORM = "grad_norm"
    RESIDUAL = "residual"
    ATTENTION = "attention"
    MASSIVE = "massive"
    HEADROOM = "headroom"
    EFFECTIVE_LR = "effective_lr"
    BATCHNORM = "batchnorm"
    NGRAMS = "ngrams"
    MODALITY = "modality"


DEFAULT_METRICS = frozenset(Metric) - {Metric.MODALITY}

# exponent p of effective_lr = lr / ||W||^p for a scale-invariant W, by optimizer type (others: 2)
LR_POWER: tuple[tuple[type, int], ...] = tuple(
    (cls, p)
    for names, p in (
        (("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam", "Adagrad", "Adadelta"), 1),
        (("RMSprop", "Muon"), 1),
        (("Adafactor",), 0),
    )
    for cls in (getattr(torch.optim, n, None) for n in names)
    if isinstance(cls, type)
)
