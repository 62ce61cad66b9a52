"""What normalization costs around attention: QK-norm against logit soft-capping (essay §09), and per placement.

Claim (§09): QK-norm and Gemma 2's soft-capping (``scores = cap * tanh(scores / cap)``) both keep attention logits
from growing until the softmax saturates, but the tanh acts on the score matrix, which a fused attention kernel
(``F.scaled_dot_product_attention``) cannot express, so a soft-capped model runs its attention eagerly; QK-norm
acts on q and k before the kernel and keeps it. OLMoE reports QK-norm costing ~10% of throughput. Command::

    PYTHONPATH=src .venv/bin/python benchmarks/norm_cost.py --threads 1 [--format json] [--out DIR]  # ~70 s
    PYTHONPATH=src .venv/bin/python benchmarks/norm_cost.py --quick                                  # a few seconds
    PYTHONPATH=src python benchmarks/norm_cost.py --device cuda                                     # on a GPU

On a shared CPU use ``--threads 1``: a two-thread parallel region waits for whichever thread is descheduled, and
the shortest calls' medians grew 2.7-4x (docs/kernels.md, "What normalization costs", has a run and its reading).

Part 1, the attention core (fp32, causal, q / k / v of shape (B, T, H, Dh) as a projection gives them), four
variants at each shape, forward (no_grad) and forward + backward:

* ``sdpa``: ``F.scaled_dot_product_attention(is_causal=True)``, the fused kernel (the peer every ratio is taken to);
* ``qknorm_sdpa``: normatlas's :class:`~normatlas.blocks.QKNorm` (RMS over the head dim, a shared gain: Qwen 3's)
  on q and k, then the same fused call;
* ``eager``: matmul, causal mask, softmax, matmul, without a soft-cap: what leaving the fused kernel costs;
* ``eager_softcap``: the same with Gemma 2's tanh soft-cap (cap 50): ``eager_softcap / eager`` is the tanh's own cost.

Part 2, whole blocks: a 2-layer :class:`~normatlas.blocks.TransformerLM` (d_model 512, 8 heads of 64, gated SiLU MLP
of 1536, RMSNorm, T 512, batch 1, cross-entropy over 256 tokens) for the library's ``pre_ln``, ``post_ln`` and
``peri_ln`` presets (``sandwich_ln`` is the same layout), each with and without ``QKNormConfig()``, forward + backward,
as a ratio to Pre-LN without QK-norm. The library's ``Attention`` is eager (matmul and softmax), so this is QK-norm's
cost around an eager attention, on a CPU, at a small size: not OLMoE's GPU setting.

Every provider is timed in the same process, interleaved in a fresh seeded random order each round after warm-up
rounds; medians (and the best call) in milliseconds, each ratio against its peer from the same run. The load
average before and after, the thread count, the CPU model and the torch version are written beside the numbers,
since the CPU may be shared. Before timing, each variant's forward output is compared with a float64 reference
(``check`` rows). ``--out DIR`` writes ``norm_cost.json`` (the whole result) and ``norm_cost.csv`` (the timing
rows); the figure goes to ``--figure`` (default ``docs/figures/norm_cost.png``; ``--figure ''`` for none).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from normatlas import RMSNorm
from normatlas._io import atomic_write
from normatlas.blocks import ModelConfig, QKNorm, QKNormConfig, TransformerLM, peri_ln, post_ln, pre_ln
from normatlas.cli._format import FORMATS, Section, emit, render

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


def attention_rows(
    shapes: Sequence[Sequence[int]],
    rounds: int,
    warmup: int,
    seed: int,
    progress: bool,
    budget_s: float = 0.0,
    device: torch.device = CPU,
) -> list[dict[str, object]]:
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
            if progress:
                print(f"# attention {shape_name(shape)} {mode} done", file=sys.stderr, flush=True)
    return rows


def block_model(placement: str, qk: bool, size: Mapping[str, int], seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=256, d_model=size["d_model"], n_layers=size["n_layers"], n_heads=size["n_heads"],
        d_ff=size["d_ff"], norm=RMSNorm, placement=PLACEMENTS[placement](), qk_norm=QKNormConfig() if qk else None,
    )  # fmt: skip
    return TransformerLM(cfg)


def block_rows(
    size: Mapping[str, int],
    rounds: int,
    warmup: int,
    seed: int,
    progress: bool,
    budget_s: float = 0.0,
    device: torch.device = CPU,
) -> list[dict[str, object]]:
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
    times = time_interleaved(calls, rounds, warmup, random.Random(seed), budget_s, _sync(device))
    rows: list[dict[str, object]] = []
    for name, (placement, qk) in keys.items():
        same = statistics.median(times[placement])
        rows.append({"placement": placement, "qk_norm": qk, **_stats(times[name], times["pre_ln"]),
                     "qk_cost": statistics.median(times[name]) / same})  # fmt: skip
    if progress:
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
    quick: bool = False, rounds: int | None = None, seed: int = 0, progress: bool = False, device: str = "cpu"
) -> dict[str, Any]:
    """The whole benchmark as one result: ``meta``, ``check``, ``attention`` and ``blocks`` rows.

    ``device``: where the timed calls run (``cuda`` on a GPU; the float64 check always runs on the CPU).
    """
    dev = torch.device(device)
    torch.manual_seed(seed)
    shapes, size = (QUICK_SHAPES, QUICK_BLOCK) if quick else (SHAPES, BLOCK)
    n = rounds if rounds is not None else (3 if quick else 5)
    budget = rounds is None and not quick  # the default run: at least 5 rounds, more where calls are short
    meta: dict[str, Any] = {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_model(),
        "cpu_count": os.cpu_count(), "loadavg_before": _load(), "quick": quick, "min_rounds": n, "seed": seed,
        "softcap": SOFTCAP, "dtype": "float32", "peer": PEER, "block": dict(size), "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model(),
    }  # fmt: skip
    checks = check(QUICK_SHAPES[-1], seed)
    warm = 1 if quick else 2
    attention = attention_rows(shapes, n, warm, seed, progress, ATTENTION_BUDGET_S if budget else 0.0, dev)
    blocks = block_rows(size, n, warm, seed, progress, BLOCK_BUDGET_S if budget else 0.0, dev)
    meta["loadavg_after"] = _load()
    return {"meta": meta, "check": checks, "attention": attention, "blocks": blocks}


def sections(result: Mapping[str, Any]) -> list[Section]:
    att_cols = ("shape", "mode", "variant", "median_ms", "min_ms", "ratio", "ratio_min", "rounds")
    block_cols = ("placement", "qk_norm", "median_ms", "min_ms", "ratio", "ratio_min", "qk_cost", "rounds")
    att_title = f"Attention core, fp32 causal: ratio to fused {PEER} in the same run (medians; ratio_min: best calls)"
    block_title = "Whole model fwd+bwd: ratio to pre_ln without QK-norm; qk_cost = with / without QK-norm there"
    return [
        Section("attention", result["attention"], att_title, columns=att_cols, group="shape"),
        Section("blocks", result["blocks"], block_title, columns=block_cols),
        Section("check", result["check"], "fp32 forward vs float64 reference"),
    ]


def _median_ratio(rows: Sequence[Mapping[str, Any]], variant: str, mode: str) -> float:
    return statistics.median(float(r["ratio"]) for r in rows if r["variant"] == variant and r["mode"] == mode)


def figure(result: Mapping[str, Any], path: Path, command: str) -> Path:
    """Three panels: the attention core forward and fwd+bwd as ratios to sdpa per shape, and the blocks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    att, blocks, meta = result["attention"], result["blocks"], result["meta"]
    shapes = list(dict.fromkeys(r["shape"] for r in att))
    colors = {"sdpa": "#777777", "qknorm_sdpa": "#1f77b4", "eager": "#ff7f0e", "eager_softcap": "#d62728"}
    labels = {"sdpa": "sdpa (fused)", "qknorm_sdpa": "QK-norm + sdpa", "eager": "eager, no cap",
              "eager_softcap": "eager + tanh soft-cap"}  # fmt: skip
    fig = plt.figure(figsize=(8, 7.4), dpi=100)
    grid = fig.add_gridspec(2, 2, height_ratios=(1.15, 1), hspace=0.5, wspace=0.25, top=0.84, bottom=0.09)
    width = 0.8 / len(VARIANTS)
    for col, mode in enumerate(MODES):
        ax = fig.add_subplot(grid[0, col])
        for i, name in enumerate(VARIANTS):
            ys = [next(float(r["ratio"]) for r in att if r["shape"] == s and r["mode"] == mode and r["variant"] == name)
                  for s in shapes]  # fmt: skip
            xs = [j + (i - (len(VARIANTS) - 1) / 2) * width for j in range(len(shapes))]
            ax.bar(xs, ys, width, color=colors[name], label=labels[name])
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(shapes)), [s.replace("x", "×") for s in shapes], fontsize=8)
        ax.set_xlabel("B × T × H × Dh")
        ax.set_ylabel("time / fused sdpa time")
        ax.set_title(f"attention core, {mode}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        if col == 0:
            fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.915), ncol=len(VARIANTS), fontsize=8, frameon=False)
    ax = fig.add_subplot(grid[1, :])
    names = list(PLACEMENTS)
    for i, qk in enumerate((False, True)):
        ys = [next(float(r["ratio"]) for r in blocks if r["placement"] == p and r["qk_norm"] == qk) for p in names]
        xs = [j + (i - 0.5) * 0.38 for j in range(len(names))]
        bars = ax.bar(xs, ys, 0.38, color="#1f77b4" if qk else "#aec7e8",
                      label="with QK-norm" if qk else "without QK-norm")  # fmt: skip
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("time / pre_ln time")
    ax.set_ylim(0, max(float(r["ratio"]) for r in blocks) * 1.2)
    size = meta["block"]
    ax.set_title(f"whole model fwd+bwd: {size['n_layers']} layers, d_model {size['d_model']}, {size['n_heads']} heads, "
                 f"T {size['seq']} (eager attention)", fontsize=10)  # fmt: skip
    ax.legend(fontsize=8, loc="lower right")
    qk_costs = [float(r["qk_cost"]) for r in blocks if r["qk_norm"]]
    where = "CPU" if meta.get("device", "cpu") == "cpu" else meta["device_name"]
    fig.suptitle(
        f"{where}, fwd+bwd: tanh soft-capping costs {_median_ratio(att, 'eager_softcap', 'fwd+bwd'):.2f}x "
        "fused attention, "
        f"eager alone {_median_ratio(att, 'eager', 'fwd+bwd'):.2f}x;\nQK-norm costs "
        f"{_median_ratio(att, 'qknorm_sdpa', 'fwd+bwd'):.2f}x the core (medians over shapes), "
        f"{min(qk_costs):.2f}-{max(qk_costs):.2f}x a whole small model",
        fontsize=11,
    )
    caption = (
        f"{command}\ntorch {meta['torch']}, {meta['threads']} threads, {meta.get('device_name', meta['cpu'])}, "
        f"load {meta['loadavg_before']}, seed {meta['seed']}, medians of >= {meta['min_rounds']} rounds"
    )
    fig.text(0.01, 0.005, caption, fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_outputs(result: Mapping[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [atomic_write(out / "norm_cost.json", render(sections(result), "json", meta={"meta": result["meta"]}))]
    with (out / "norm_cost.csv").open("w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(("part", "shape_or_placement", "mode", "variant", "median_ms", "min_ms", "ratio"))
        for r in result["attention"]:
            w.writerow(("attention", r["shape"], r["mode"], r["variant"], r["median_ms"], r["min_ms"], r["ratio"]))
        for r in result["blocks"]:
            variant = "qk_norm" if r["qk_norm"] else "none"
            w.writerow(("blocks", r["placement"], "fwd+bwd", variant, r["median_ms"], r["min_ms"], r["ratio"]))
    paths.append(out / "norm_cost.csv")
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes and model, a few seconds (the test's mode)")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds per provider (default: at least 5, more where calls are short; --quick 3)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="where the timed calls run: cpu (default) or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=FORMATS, default="table", help="printed output format (default: table)")
    p.add_argument("--out", type=Path, default=None, help="write norm_cost.json and norm_cost.csv here")
    p.add_argument("--figure", default="docs/figures/norm_cost.png", help="figure path ('' for none)")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = run(quick=args.quick, rounds=args.rounds, seed=args.seed, progress=True, device=args.device)
    notes = [f"{k}: {v}" for k, v in result["meta"].items()] if args.format == "table" else []
    emit(sections(result), args.format, meta=None if args.format == "table" else {"meta": result["meta"]}, notes=notes)
    if args.out is not None:
        for path in write_outputs(result, args.out):
            print(f"# wrote {path}", file=sys.stderr)
    if args.figure:
        shown = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--format", "json", "csv", "table")]
        command = " ".join(["PYTHONPATH=src python benchmarks/norm_cost.py", *shown])
        print(f"# wrote {figure(result, Path(args.figure), command)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
