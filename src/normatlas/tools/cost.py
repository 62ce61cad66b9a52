"""What normalization costs around attention (essay §09): QK-norm against Gemma 2's logit soft-capping against neither,
around the fused ``F.scaled_dot_product_attention``, and each placement per block, as ratios measured in one run.

The measurement behind ``benchmarks/norm_cost.py`` (its docstring holds the claim, the command and a run's reading)
and the page's ``cost`` tool. Part 1, the attention core (fp32, causal, q / k / v of shape (B, T, H, Dh)), four
variants forward and forward + backward, each as a ratio to ``sdpa`` from the same run: ``sdpa``; ``qknorm_sdpa``
(:class:`~normatlas.blocks.QKNorm` on q and k, then the same fused call); ``eager`` (matmul, mask, softmax, matmul);
``eager_softcap`` (the same with ``cap * tanh(scores / cap)``). Part 2, a small :class:`~normatlas.blocks.TransformerLM`
for the ``pre_ln``, ``post_ln`` and ``peri_ln`` presets, each with and without QK-norm, forward + backward, as a
ratio to Pre-LN without QK-norm. Every provider is timed interleaved in a fresh seeded random order each round; each
variant's forward is first compared with a float64 reference (:func:`check`).
"""

from __future__ import annotations

import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..blocks import ModelConfig, QKNorm, QKNormConfig, TransformerLM, peri_ln, post_ln, pre_ln
from ..presets import RMSNorm

__all__ = [
    "BLOCK",
    "MODES",
    "PEER",
    "PLACEMENTS",
    "QUICK_BLOCK",
    "QUICK_SHAPES",
    "SHAPES",
    "SOFTCAP",
    "VARIANTS",
    "Timing",
    "attention_rows",
    "block_model",
    "block_rows",
    "check",
    "cpu_model",
    "inputs",
    "qk_norms",
    "run",
    "shape_name",
    "time_interleaved",
    "variants",
]

SOFTCAP = 50.0  # Gemma 2's attn_logit_softcapping
# (B, T, H, Dh): LLM-like heads of 64, sized so the whole run stays near a minute and a half on 2 cores
SHAPES = ((1, 256, 8, 64), (2, 512, 8, 64), (1, 1024, 16, 64))
QUICK_SHAPES = ((1, 16, 2, 8), (2, 23, 3, 16))  # an odd T
BLOCK = {"d_model": 512, "n_heads": 8, "d_ff": 1536, "n_layers": 2, "seq": 512, "batch": 1}
QUICK_BLOCK = {"d_model": 32, "n_heads": 2, "d_ff": 96, "n_layers": 1, "seq": 16, "batch": 1}
PLACEMENTS = {"pre_ln": pre_ln, "post_ln": post_ln, "peri_ln": peri_ln}
PEER = "sdpa"
VARIANTS = ("sdpa", "qknorm_sdpa", "eager", "eager_softcap")
MODES = ("fwd", "fwd+bwd")
MAX_ROUNDS = 40
CPU = torch.device("cpu")
ATTENTION_BUDGET_S, BLOCK_BUDGET_S = 4.0, 30.0  # timed seconds per (shape, mode) cell and for all the blocks

Core = Callable[[Tensor, Tensor, Tensor], Tensor]


def shape_name(shape: Sequence[int]) -> str:
    return "x".join(str(n) for n in shape)


def qk_norms(n_heads: int, head_dim: int, seed: int = 0) -> tuple[QKNorm, QKNorm]:
    """The q and k norms (library defaults: RMS per head, one shared gain), gains drawn near 1 so they count."""
    g = torch.Generator().manual_seed(seed)
    norms = (QKNorm(QKNormConfig(), n_heads, head_dim), QKNorm(QKNormConfig(), n_heads, head_dim))
    with torch.no_grad():
        for n in norms:
            assert n.weight is not None
            n.weight.copy_(1.0 + 0.1 * torch.randn(n.weight.shape, generator=g))
    return norms


def variants(
    t: int, head_dim: int, norms: tuple[QKNorm, QKNorm], softcap: float = SOFTCAP, device: torch.device | None = None
) -> dict[str, Core]:
    """Each variant as ``(q, k, v) -> out``: inputs ``(B, T, H, Dh)``, output ``(B, H, T, Dh)``, causal."""
    mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    scale = head_dim**-0.5
    qn, kn = norms

    def eager(q: Tensor, k: Tensor, v: Tensor, cap: float | None = None) -> Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v)

    def sdpa(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)

    return {
        "sdpa": sdpa,
        "qknorm_sdpa": lambda q, k, v: sdpa(qn(q), kn(k), v),
        "eager": eager,
        "eager_softcap": lambda q, k, v: eager(q, k, v, softcap),
    }


def inputs(
    shape: Sequence[int], seed: int, grad: bool = False, scale: float = 3.0, device: torch.device | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v of ``shape`` (B, T, H, Dh) times ``scale``, and an upstream gradient ``(B, H, T, Dh)``.

    At ``scale=3`` (the check's) the logits' std is 9 and their largest reach the cap's range (tanh(40 / 50) is 0.66,
    not 0.8); the timings use unit-variance inputs (logits of std 1).
    """
    g = torch.Generator().manual_seed(seed)
    b, t, h, dh = shape
    q, k, v = ((torch.randn(b, t, h, dh, generator=g) * scale).to(device) for _ in range(3))
    up = torch.randn(b, h, t, dh, generator=g).to(device)
    return q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad), up


def _reference(q: Tensor, k: Tensor, v: Tensor, cap: float | None, norms: tuple[QKNorm, QKNorm] | None) -> Tensor:
    """float64 eager attention, the QK-norm written out (``x / sqrt(mean(x^2) + eps) * w``)."""
    q, k, v = (x.detach().double().transpose(1, 2) for x in (q, k, v))
    if norms is not None:
        q, k = (
            x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + n.config.eps) * n.weight.detach().double()  # type: ignore[union-attr]
            for x, n in zip((q, k), norms, strict=True)
        )
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    t = q.shape[-2]
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, -1) @ v


def check(shape: Sequence[int], seed: int = 0) -> list[dict[str, object]]:
    """Each variant's fp32 forward against its float64 reference: max |difference| and the output's max |value|."""
    q, k, v, _ = inputs(shape, seed)
    norms = qk_norms(shape[2], shape[3], seed)
    refs = {
        "sdpa": _reference(q, k, v, None, None),
        "qknorm_sdpa": _reference(q, k, v, None, norms),
        "eager": _reference(q, k, v, None, None),
        "eager_softcap": _reference(q, k, v, SOFTCAP, None),
    }
    rows: list[dict[str, object]] = []
    with torch.no_grad():
        for name, fn in variants(shape[1], shape[3], norms).items():
            ref = refs[name]
            rows.append({"shape": shape_name(shape), "variant": name,
                         "max_abs_err": float((fn(q, k, v).double() - ref).abs().max()),
                         "max_abs_ref": float(ref.abs().max())})  # fmt: skip
    return rows


def time_interleaved(
    calls: Mapping[str, Callable[[], object]],
    rounds: int,
    warmup: int,
    rng: random.Random,
    budget_s: float = 0.0,
    sync: Callable[[], object] = lambda: None,
) -> dict[str, list[float]]:
    """Seconds per call of each provider, the providers in a fresh random order every round.

    ``rounds`` is the least number of rounds; with a ``budget_s`` the last warm-up round's time sets more (up to
    ``MAX_ROUNDS``) so that the timed rounds take about ``budget_s`` seconds.
    """
    round_s = 0.0
    for _ in range(max(warmup, 1)):
        t0 = time.perf_counter()
        for fn in calls.values():
            fn()
        sync()
        round_s = time.perf_counter() - t0
    if budget_s > 0:
        rounds = max(rounds, min(MAX_ROUNDS, int(budget_s / max(round_s, 1e-9))))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        order = list(calls)
        rng.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            calls[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def _fwd(fn: Core, q: Tensor, k: Tensor, v: Tensor) -> Callable[[], object]:
    def call() -> object:
        with torch.no_grad():
            return fn(q, k, v)

    return call


def _fwd_bwd(fn: Core, q: Tensor, k: Tensor, v: Tensor, up: Tensor, params: Sequence[Tensor]) -> Callable[[], object]:
    def call() -> object:
        for p in params:
            p.grad = None
        out = fn(q, k, v)
        out.backward(up)
        return out

    return call


def _stats(seconds: list[float], peer: list[float]) -> dict[str, object]:
    """Median and best call in ms; ``ratio`` of medians and ``ratio_min`` of best calls to the same-run peer."""
    return {"median_ms": statistics.median(seconds) * 1e3, "min_ms": min(seconds) * 1e3,
            "ratio": statistics.median(seconds) / statistics.median(peer), "ratio_min": min(seconds) / min(peer),
            "rounds": len(seconds)}  # fmt: skip


@dataclass(frozen=True)
class Timing:
    """How a table is timed: at least ``rounds`` interleaved rounds after ``warmup`` (more to fill ``budget_s``
    seconds when it is > 0), inputs and order seeded by ``seed``, on ``device``; ``progress`` prints a line per
    finished part to stderr."""

    rounds: int
    warmup: int
    seed: int = 0
    progress: bool = False
    budget_s: float = 0.0
    device: torch.device = CPU


def attention_rows(shapes: Sequence[Sequence[int]], timing: Timing) -> list[dict[str, object]]:
    """The attention table: every variant against the peer, forward and forward + backward, at each shape."""
    rounds, warmup, seed, budget_s, device = timing.rounds, timing.warmup, timing.seed, timing.budget_s, timing.device
    rows: list[dict[str, object]] = []
    rng = random.Random(seed)
    for shape in shapes:
        q, k, v, up = inputs(shape, seed, grad=True, scale=1.0, device=device)
        norms = qk_norms(shape[2], shape[3], seed)
        for n in norms:
            n.to(device)
        fns = variants(shape[1], shape[3], norms, device=device)
        params = [q, k, v, *(p for n in norms for p in n.parameters())]
        for mode in MODES:
            if mode == "fwd":
                calls = {name: _fwd(fn, q, k, v) for name, fn in fns.items()}
            else:
                calls = {name: _fwd_bwd(fn, q, k, v, up, params) for name, fn in fns.items()}
            times = time_interleaved(calls, rounds, warmup, rng, budget_s, _sync(device))
            for name in VARIANTS:
                rows.append({"shape": shape_name(shape), "mode": mode, "variant": name,
                             **_stats(times[name], times[PEER])})  # fmt: skip
            if timing.progress:
                print(f"# attention {shape_name(shape)} {mode} done", file=sys.stderr, flush=True)
    return rows


def block_model(placement: str, qk: bool, size: Mapping[str, int], seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=256, d_model=size["d_model"], n_layers=size["n_layers"], n_heads=size["n_heads"],
        d_ff=size["d_ff"], norm=RMSNorm, placement=PLACEMENTS[placement](), qk_norm=QKNormConfig() if qk else None,
    )  # fmt: skip
    return TransformerLM(cfg)


def block_rows(size: Mapping[str, int], timing: Timing) -> list[dict[str, object]]:
    """The block table: one training step of a small LM per placement, with and without QK-norm."""
    seed, device = timing.seed, timing.device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (size["batch"], size["seq"]), generator=g).to(device)
    targets = torch.randint(0, 256, (size["batch"], size["seq"]), generator=g).to(device)
    calls: dict[str, Callable[[], object]] = {}
    keys: dict[str, tuple[str, bool]] = {}
    for placement in PLACEMENTS:
        for qk in (False, True):
            model = block_model(placement, qk, size, seed).to(device)

            def step(model: TransformerLM = model) -> object:
                model.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
                loss.backward()
                return loss

            name = f"{placement}{'+qk' if qk else ''}"
            calls[name], keys[name] = step, (placement, qk)
    times = time_interleaved(calls, timing.rounds, timing.warmup, random.Random(seed), timing.budget_s, _sync(device))
    rows: list[dict[str, object]] = []
    for name, (placement, qk) in keys.items():
        same = statistics.median(times[placement])
        rows.append({"placement": placement, "qk_norm": qk, **_stats(times[name], times["pre_ln"]),
                     "qk_cost": statistics.median(times[name]) / same})  # fmt: skip
    if timing.progress:
        print("# blocks done", file=sys.stderr, flush=True)
    return rows


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _sync(device: torch.device) -> Callable[[], object]:
    return torch.cuda.synchronize if device.type == "cuda" else lambda: None


def run(
    quick: bool = False,
    rounds: int | None = None,
    seed: int = 0,
    progress: bool = False,
    device: str = "cpu",
    *,
    shapes: Sequence[Sequence[int]] | None = None,
    block: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The whole measurement as one result: ``meta``, ``check``, ``attention`` and ``blocks`` rows.

    ``shapes`` (each (B, T, H, Dh)) and ``block`` (the keys of :data:`BLOCK`) replace the default sizes (or, with
    ``quick``, the quick ones); ``meta`` records the sizes it ran at. ``device``: where the timed calls run (``cuda``
    on a GPU; the float64 check always runs on the CPU).
    """
    dev = torch.device(device)
    torch.manual_seed(seed)
    shapes = tuple(tuple(s) for s in shapes) if shapes is not None else (QUICK_SHAPES if quick else SHAPES)
    size = dict(block) if block is not None else dict(QUICK_BLOCK if quick else BLOCK)
    if not shapes or any(len(s) != 4 or min(s) < 1 for s in shapes):
        raise ValueError(f"shapes must be (B, T, H, Dh) tuples of positive ints, got {shapes!r}")
    if set(size) != set(BLOCK) or min(size.values()) < 1 or size["d_model"] % size["n_heads"]:
        raise ValueError(f"block must have the keys {sorted(BLOCK)}, positive, n_heads dividing d_model; got {size}")
    n = rounds if rounds is not None else (3 if quick else 5)
    budget = rounds is None and not quick  # the default run: at least 5 rounds, more where calls are short
    meta: dict[str, Any] = {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_model(),
        "cpu_count": os.cpu_count(), "loadavg_before": _load(), "quick": quick, "min_rounds": n, "seed": seed,
        "softcap": SOFTCAP, "dtype": "float32", "peer": PEER, "shapes": [shape_name(s) for s in shapes],
        "block": size, "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model(),
    }  # fmt: skip
    checks = check(QUICK_SHAPES[-1], seed)
    warm = 1 if quick else 2
    timing = Timing(rounds=n, warmup=warm, seed=seed, progress=progress, device=dev)
    attention = attention_rows(shapes, replace(timing, budget_s=ATTENTION_BUDGET_S if budget else 0.0))
    blocks = block_rows(size, replace(timing, budget_s=BLOCK_BUDGET_S if budget else 0.0))
    meta["loadavg_after"] = _load()
    return {"meta": meta, "check": checks, "attention": attention, "blocks": blocks}
