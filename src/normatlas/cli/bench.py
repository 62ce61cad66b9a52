"""``normatlas bench OP``: the fused kernels side by side with torch, HF-style eager and torch.compile."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import CliError, command
from ._format import add_format_option, format_rows

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


def _configure(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--repeats", type=int, default=15, help="interleaved rounds; the median is reported")
    p.add_argument("--min-time", type=float, default=0.5, help="more rounds (up to 10x) until this many seconds")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--cache", choices=("warm", "shared"), default="warm",
                   help="shapes of at most 8 MiB in fp32 (cache-resident): warm (default) times each call right after "
                   "an untimed call of the same provider; shared times it after whichever provider ran before it. "
                   "Larger shapes are always timed without the extra call")  # fmt: skip
    p.add_argument("--csv", type=Path, help="also write the rows to this CSV file")
    add_format_option(p)


@command("bench", "time the fused norm kernels against torch, HF-style eager and torch.compile", _configure)
def bench(args: argparse.Namespace) -> int:
    import torch

    from ..kernels import build_info
    from ..kernels.bench import cache_resident, provider_names, run_bench

    if args.repeats < 1:
        raise CliError(f"--repeats={args.repeats} must be >= 1")
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
    info = build_info() if args.device == "cpu" else {}
    print(f"# kernels: {info}  threads={torch.get_num_threads()}", file=sys.stderr)
    rows = []
    for shape in shapes:  # as benchmarks/bench_norms.py: warm rounds where the data can stay in cache
        warm = args.cache == "warm" and cache_resident(shape)
        rows += run_bench(
            args.op, [shape], dtypes, args.mode or ["fwd", "bwd", "fwdbwd"], providers=providers,
            repeats=args.repeats, min_time=args.min_time, device=args.device, warm=warm,
            progress=lambda s: print(f"# {s}", file=sys.stderr),
        )  # fmt: skip
    print(
        format_rows(
            rows, args.format, f"== normatlas bench {args.op} (median of >= {args.repeats} interleaved rounds) =="
        )
    )
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        args.csv.write_text(format_rows(rows, "csv") + "\n")
    return 0
