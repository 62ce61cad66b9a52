"""Every fused kernel over odd row widths from memory, as multiples of a copy: a sweep for pathologies.

Claim (docs/kernels.md): no width makes a kernel fall off a cliff. Two did until this sweep found them: rows that do
not fill whole 64-byte lines mixed streaming and plain stores in a line (bf16 rows of 16-80 features at 10-20x the
time), and the backward's per-thread partial sums shared a cache line (fp32 16 / 24 features at 10-12x). For each
(dtype, width) at ~8 M elements with freed buffers kept in the heap (no page faults), it times RMSNorm and LayerNorm
forward, add + RMSNorm forward, and the three backwards through autograd (gradients for x and the gain, LayerNorm's
bias, add + RMSNorm's residual), medians, each over ``x.clone()`` measured alongside; a cell over ``--flag`` (6x)
is marked. Command::

    .venv/bin/python benchmarks/bench_widths.py               # ~15 s on 2 cores
    .venv/bin/python benchmarks/bench_widths.py --widths 16 80 1000 --dtypes bfloat16

Writes ``results/bench_widths_cpu.csv``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from normatlas._io import atomic_write
from normatlas.cli._format import format_rows
from normatlas.kernels import build_info, fused_add_rms_norm, fused_layer_norm, fused_rms_norm
from normatlas.kernels.bench import reuse_freed_memory

WIDTHS = [12, 16, 20, 24, 40, 48, 72, 80, 96, 112, 200, 500, 1000, 2050, 4100]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _median_ms(f: Callable[[], Any], reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _cells(x: torch.Tensor, reps: int) -> dict[str, float]:
    n = x.shape[-1]
    r, gy = torch.randn_like(x), torch.randn_like(x)
    w, b = (torch.rand(n) + 0.5).to(x.dtype), torch.randn(n).to(x.dtype)
    xs, rs, ws, bs = (t.clone().requires_grad_(True) for t in (x, r, w, b))
    with torch.no_grad():
        fwd = {
            "rms_fwd": lambda: fused_rms_norm(x, n, w, 1e-6),
            "ln_fwd": lambda: fused_layer_norm(x, n, w, b),
            "add_rms_fwd": lambda: fused_add_rms_norm(x, r, n, w, 1e-6),
        }
        out = {name: _median_ms(f, reps) for name, f in fwd.items()}
    y_rms, y_ln = fused_rms_norm(xs, n, ws, 1e-6), fused_layer_norm(xs, n, ws, bs)
    y_add, _ = fused_add_rms_norm(xs, rs, n, ws, 1e-6)
    bwd = {
        "rms_bwd": lambda: torch.autograd.grad(y_rms, [xs, ws], gy, retain_graph=True),
        "ln_bwd": lambda: torch.autograd.grad(y_ln, [xs, ws, bs], gy, retain_graph=True),
        "add_rms_bwd": lambda: torch.autograd.grad(y_add, [xs, rs, ws], gy, retain_graph=True),
    }
    out.update({name: _median_ms(f, reps) for name, f in bwd.items()})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", type=int, nargs="+", default=WIDTHS)
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--elements", type=int, default=8 << 20, help="elements per input (8 M: from memory)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--flag", type=float, default=6.0, help="mark cells over this many copies' time")
    p.add_argument("--alloc", choices=("reuse", "default"), default="reuse",
                   help="reuse: keep freed blocks in the heap (no page faults); default: glibc as it is")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("results/bench_widths_cpu.csv"))
    args = p.parse_args(argv)
    alloc = reuse_freed_memory() if args.alloc == "reuse" else "default (glibc)"
    print(f"# kernels: {build_info()}  torch {torch.__version__}  threads={torch.get_num_threads()}  "
          f"allocator: {alloc}")  # fmt: skip
    rows = []
    for dname in args.dtypes:
        for n in args.widths:
            x = torch.randn(max(1, args.elements // n), n).to(DTYPES[dname])
            copy_ms = _median_ms(lambda x=x: x.clone(), args.reps)
            cells = _cells(x, args.reps)
            worst = max(cells.values()) / copy_ms
            row: dict[str, Any] = {"dtype": dname, "width": n, "copy_ms": round(copy_ms, 3)}
            row.update({name: round(ms / copy_ms, 2) for name, ms in cells.items()})
            row["flag"] = "<<<" if worst > args.flag else ""
            rows.append(row)
            print(f"# {dname} {n}: worst {worst:.2f}x a copy", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, format_rows(rows, "csv") + "\n")
    title = f"== time over x.clone() from memory ({args.elements:,} elements), medians; <<< over {args.flag}x =="
    print(format_rows(rows, "table", title))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
