"""The CPU benchmark suite of the fused norms: every op, fwd / bwd / both, fp32 and bf16, two sizes.

Claim (issue 8): on a 2-core CPU the fused RMSNorm forward runs at the speed of a copy and
2.5x (fp32) / 10x (bf16) faster than ``F.rms_norm``; the fused backward and the fused add+norm
beat every torch peer. Command::

    .venv/bin/python benchmarks/bench_norms.py            # ~5-10 min on 2 shared cores
    .venv/bin/python benchmarks/bench_norms.py --quick    # rms and add_rms only, no torch.compile

Writes ``results/bench_norms_cpu.csv`` (``results/`` is gitignored) and prints a summary of the
issue's targets, each with the two figures it compares, measured in this run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from normatlas.cli._format import format_rows
from normatlas.kernels import build_info
from normatlas.kernels.bench import run_bench

SIZES = {"cache": (256, 4096), "dram": (2048, 4096)}  # 4 MiB fp32 sits in L3; 32 MiB does not


def _ms(rows: list[dict], op: str, mode: str, shape: tuple[int, int], dtype: str, provider: str) -> float:
    key = "x".join(map(str, shape))
    for r in rows:
        if (r["op"], r["mode"], r["shape"], r["dtype"], r["provider"]) == (op, mode, key, dtype, provider):
            return float(r["ms"])
    return float("nan")


def targets(rows: list[dict]) -> list[dict]:
    """The issue's ratio targets, each computed from this run's medians."""
    out = []

    def add(what: str, num: float, den: float, want: str, ok: bool) -> None:
        out.append({"target": what, "ratio": f"{num / den:.2f}" if den == den and den else "n/a",
                    "want": want, "met": "yes" if ok else "NO"})  # fmt: skip

    for size, shape in SIZES.items():
        for dt, need in (("float32", 2.5), ("bfloat16", 10.0)):
            ours = _ms(rows, "rms", "fwd", shape, dt, "ours")
            rms, ln = _ms(rows, "rms", "fwd", shape, dt, "torch"), _ms(rows, "layer", "fwd", shape, dt, "torch")
            add(f"rms fwd {size} {dt}: F.rms_norm / ours", rms, ours, f">= {need}", rms / ours >= need)
            if ln == ln:
                add(f"rms fwd {size} {dt}: F.layer_norm / ours", ln, ours, ">= 1.0", ln / ours >= 1.0)
            if dt == "float32":
                copy = next(float(r["copy_ms"]) for r in rows if r["op"] == "rms" and r["mode"] == "fwd"
                            and r["shape"] == "x".join(map(str, shape)) and r["dtype"] == dt)  # fmt: skip
                add(f"rms fwd {size} {dt}: ours / x.clone()", ours, copy, "<= 1.15", ours / copy <= 1.15)
            ours_fb = _ms(rows, "rms", "fwdbwd", shape, dt, "ours")
            rms_fb = _ms(rows, "rms", "fwdbwd", shape, dt, "torch")
            ln_fb = _ms(rows, "layer", "fwdbwd", shape, dt, "torch")
            need_fb = 3.0 if dt == "float32" else 6.0
            add(
                f"rms fwd+bwd {size} {dt}: F.rms_norm / ours",
                rms_fb,
                ours_fb,
                f">= {need_fb}",
                rms_fb / ours_fb >= need_fb,
            )
            if ln_fb == ln_fb:
                add(f"rms fwd+bwd {size} {dt}: ours / F.layer_norm", ours_fb, ln_fb, "<= 1.3", ours_fb / ln_fb <= 1.3)
            for mode in ("fwd", "bwd"):
                o, t = _ms(rows, "layer", mode, shape, dt, "ours"), _ms(rows, "layer", mode, shape, dt, "torch")
                if o == o:
                    add(f"layer {mode} {size} {dt}: F.layer_norm / ours", t, o, ">= 1.0", t / o >= 1.0)
            o = _ms(rows, "add_rms", "fwd", shape, dt, "ours")
            best = min(_ms(rows, "add_rms", "fwd", shape, dt, p) for p in ("torch", "hf", "torch_ln_pair"))
            add(f"add+rms fwd {size} {dt}: best unfused torch pair / ours", best, o, ">= 1.3", best / o >= 1.3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="rms, layer and add_rms only; no torch.compile")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", type=Path, default=Path("results/bench_norms_cpu.csv"))
    args = p.parse_args(argv)
    print(f"# kernels: {build_info()}  torch {torch.__version__}  threads={torch.get_num_threads()}", file=sys.stderr)
    ops = ["rms", "layer", "add_rms"] if args.quick else ["rms", "layer", "add_rms", "add_layer", "qk"]
    rows: list[dict] = []
    for op in ops:
        shapes = [(16384, 128)] if op == "qk" else list(SIZES.values())
        providers = ["ours", "torch", "hf", "torch_ln_pair"] if args.quick else None
        rows += run_bench(op, shapes, [torch.float32, torch.bfloat16], ["fwd", "bwd", "fwdbwd"],
                          providers=providers, repeats=args.repeats,
                          progress=lambda s: print(f"# {s}", file=sys.stderr))  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(format_rows(rows, "csv") + "\n")
    print(
        format_rows(rows, "table", "== fused norms vs peers (median ms, GB/s, time over a copy of the same bytes) ==")
    )
    print()
    print(format_rows(targets(rows), "table", "== issue 8 targets, this run =="))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
