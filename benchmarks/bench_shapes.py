"""Where the fused kernels stand against torch's own op across row widths and dtypes (forward, CPU).

Claim (README, Kernels): the library's fast path is at least as fast as ``F.layer_norm`` / ``F.rms_norm``
for the shapes a model meets (many rows of 64 to 16,384 features), in every dtype, and the table names the
shapes where it is not (a few very wide rows in half precision, fp64 LayerNorm at some widths). Each row of
the output is one (op, shape, dtype): ours and torch's op interleaved in a fresh order every round with a copy
of the input (``normatlas.kernels.bench.run_bench``), medians. Command::

    .venv/bin/python benchmarks/bench_shapes.py            # ~2 min on 2 cores
    .venv/bin/python benchmarks/bench_shapes.py --dtypes float32 bfloat16

Writes ``results/bench_shapes_cpu.csv``; prints torch's median over ours (above 1: ours is faster).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from normatlas._io import atomic_write
from normatlas.cli._format import format_rows
from normatlas.kernels import build_info
from normatlas.kernels.bench import run_bench

# many short rows (QK-norm, small models), the common widths, a few very wide rows, odd widths, and short rows from
# memory whose bf16 / fp16 rows (160 B) do not fill whole 64-byte lines (streaming stores once mixed with plain ones
# in a line there, at 6-20x the time)
SHAPES = [(65536, 16), (16384, 64), (4096, 256), (1024, 1024), (256, 4096), (64, 16384), (4, 65536), (1, 262144),
          (512, 4100), (131072, 80), (3, 5)]  # fmt: skip
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--min-time", type=float, default=0.3, help="more rounds (up to 10x) until this many seconds")
    p.add_argument("--out", type=Path, default=Path("results/bench_shapes_cpu.csv"))
    args = p.parse_args(argv)
    print(f"# kernels: {build_info()}  torch {torch.__version__}  threads={torch.get_num_threads()}")
    rows, table = [], []
    for op in ("layer", "rms"):
        out = run_bench(op, SHAPES, [DTYPES[d] for d in args.dtypes], ["fwd"], providers=["ours", "torch"],
                        repeats=args.repeats, min_time=args.min_time)  # fmt: skip
        rows += out
        med = {(r["shape"], r["dtype"], r["provider"]): r["ms"] for r in out}
        for shape, dtype, provider in med:
            if provider == "ours":
                ours, peer = med[(shape, dtype, "ours")], med[(shape, dtype, "torch")]
                faster = "yes" if peer >= ours else "NO"
                table.append({"op": op, "shape": shape, "dtype": dtype, "ours_ms": ours, "torch_ms": peer,
                              "torch/ours": round(peer / ours, 2), "ours_faster": faster})  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, format_rows(rows, "csv") + "\n")
    title = "== fused forward vs torch's op (F.layer_norm / F.rms_norm), medians of interleaved calls =="
    print(format_rows(table, "table", title))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
