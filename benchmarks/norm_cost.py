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

The measurement itself is :mod:`normatlas.tools.cost` (the page's ``cost`` tool runs it too); this script prints it,
writes it and draws its figure. Every provider is timed in the same process, interleaved in a fresh seeded random
order each round after warm-up rounds; medians (and the best call) in milliseconds, each ratio against its peer from
the same run. The load average before and after, the thread count, the CPU model and the torch version are written
beside the numbers, since the CPU may be shared. Before timing, each variant's forward output is compared with a
float64 reference (``check`` rows). ``--out DIR`` writes ``norm_cost.json`` (the whole result) and ``norm_cost.csv``
(the timing rows); the figure goes to ``--figure`` (default ``docs/figures/norm_cost.png``; ``--figure ''`` for none).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from normatlas._io import atomic_write
from normatlas.cli._format import FORMATS, Section, emit, render
from normatlas.cli.tools_cmd import cost_sections
from normatlas.tools.cost import (
    BLOCK,
    MODES,
    PEER,
    PLACEMENTS,
    QUICK_BLOCK,
    QUICK_SHAPES,
    SHAPES,
    SOFTCAP,
    VARIANTS,
    block_model,
    check,
    inputs,
    qk_norms,
    run,
    shape_name,
    variants,
)

# the measurement lives in the library (normatlas.tools.cost, also the page's cost tool); the names the tests read
__all__ = ["BLOCK", "MODES", "PEER", "PLACEMENTS", "QUICK_BLOCK", "QUICK_SHAPES", "SHAPES", "SOFTCAP", "VARIANTS",
           "block_model", "check", "figure", "inputs", "main", "qk_norms", "run", "sections", "shape_name", "variants",
           "write_outputs"]  # fmt: skip


def sections(result: Mapping[str, Any]) -> list[Section]:
    """The tables ``normatlas cost`` prints (one definition, the CLI's)."""
    return cost_sections(dict(result))


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
