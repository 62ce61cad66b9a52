"""``normatlas bench OP``: the fused kernels side by side with torch, HF-style eager and torch.compile."""

from __future__ import annotations

import argparse
from pathlib import Path

from .._io import atomic_write
from . import CliError, nonnegative_float, positive_int
from . import _progress as progress
from ._format import Section, add_format_option, emit, render

_OPS = ("rms", "layer", "add_rms", "add_layer", "qk")
_DTYPES = ("float32", "bfloat16", "float16")


def shape_arg(text: str) -> tuple[int, int]:
    """argparse type for ROWSxHIDDEN (also used by benchmarks/ab_builds.py)."""
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape={text!r} must look like ROWSxHIDDEN, e.g. 2048x4096") from None
    if rows < 1 or cols < 1:
        raise argparse.ArgumentTypeError(f"shape={text!r} needs rows >= 1 and hidden >= 1")
    return rows, cols


def configure_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("op", choices=_OPS, help="rms, layer, add_rms, add_layer, or qk (many short rows)")
    p.add_argument("--shape", type=shape_arg, action="append", help="ROWSxHIDDEN (repeatable); default: "
                   "256x4096 (cache-resident) and 2048x4096 (DRAM-resident); qk: 16384x128")  # fmt: skip
    p.add_argument("--dtype", choices=_DTYPES, action="append", help="repeatable; default float32 and bfloat16")
    p.add_argument("--mode", choices=("fwd", "bwd", "fwdbwd"), action="append", help="repeatable; default all")
    p.add_argument(
        "--provider",
        action="append",
        help="ours, ours_llama (rms, qk: HF Llama's cast order), torch, torch_layer_norm (rms: F.layer_norm on the "
        "same input), hf, compile, compile_pair (add_rms), liger (CUDA), floor (CPU fwd: the output pass alone) "
        "(default: all that run)",
    )
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile providers (saves ~20 s each)")
    p.add_argument("--repeats", type=positive_int, default=15, help="interleaved rounds; the median is reported")
    p.add_argument(
        "--min-time", type=nonnegative_float, default=0.5, help="more rounds (up to 10x) until this many seconds"
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--cache", choices=("warm", "shared"), default="warm",
                   help="shapes of at most 8 MiB in fp32 (cache-resident): warm (default) times each call right after "
                   "an untimed call of the same provider; shared times it after whichever provider ran before it. "
                   "Larger shapes are always timed without the extra call")  # fmt: skip
    p.add_argument("--csv", type=Path, help="also write the rows to this CSV file")
    add_format_option(p)


_TABLE = ("case", "provider", "ms", "GB/s", "vs_copy", "vs_ours", "rounds")


def bench(args: argparse.Namespace) -> int:
    import torch

    from ..kernels.bench import cache_resident, check_bench_memory, provider_names, run_bench
    from ..kernels.dispatch import build_info

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device=cuda but CUDA is not available here")
    shapes = args.shape or ([(16384, 128)] if args.op == "qk" else [(256, 4096), (2048, 4096)])
    dtypes = [getattr(torch, d) for d in (args.dtype or ["float32", "bfloat16"])]
    known = provider_names(args.op, args.device)
    unknown = [p for p in args.provider or [] if p not in known]
    if unknown:
        raise CliError(f"--provider {', '.join(unknown)}: not a provider of {args.op} on {args.device}; "
                       f"choose from {', '.join(known)}")  # fmt: skip
    providers = args.provider or known
    if args.no_compile:
        providers = [p for p in providers if not p.startswith("compile")]
    if not providers:
        raise CliError("--no-compile leaves no provider to time (the given ones are all torch.compile)")
    modes = args.mode or ["fwd", "bwd", "fwdbwd"]
    check_bench_memory(shapes, dtypes, modes, len(providers), args.device)  # every shape, before timing any
    with progress.phase("building the C++ kernels (first use only)"):
        info = build_info() if args.device == "cpu" else {}
    rows = []
    with progress.phase(f"timing {args.op}") as ph:
        for shape in shapes:  # as benchmarks/bench_norms.py: warm rounds where the data can stay in cache
            warm = args.cache == "warm" and cache_resident(shape)
            rows += run_bench(
                args.op, [shape], dtypes, modes, providers=providers,
                repeats=args.repeats, min_time=args.min_time, device=args.device, warm=warm, progress=ph.update,
            )  # fmt: skip
    rows = [{k: (None if v == "" else v) for k, v in r.items()} for r in rows]  # no "ours" to compare: null
    meta = {"op": args.op, "device": args.device, "threads": torch.get_num_threads(), "kernels": info}
    title = f"normatlas bench {args.op}: median ms of >= {args.repeats} interleaved rounds"
    section = Section("results", rows, title)
    if args.format == "table":
        table = [{"case": f"{r['shape']} {r['dtype']} {r['mode']} ({r['state']})", **r} for r in rows]
        section = Section("results", table, title, _TABLE, group="case")
    if args.csv:
        atomic_write(args.csv, render([Section("results", rows)], "csv") + "\n")
    emit([section], args.format, meta=meta)
    return 0
