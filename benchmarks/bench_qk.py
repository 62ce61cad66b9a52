"""QK-norm over many short rows, inference: one launch for q and k against two calls and torch's ops.

Claim: for a decode step (one token, 32 query heads and 8 key/value heads of 128) the launch overhead is the
cost, and ``qk_rms_norm`` (one parallel region over the rows of both tensors) beats two fused calls and
``F.rms_norm`` twice; at prefill sizes the three fused variants converge. Command::

    .venv/bin/python benchmarks/bench_qk.py              # ~20 s on 2 cores
    .venv/bin/python benchmarks/bench_qk.py --alloc reuse  # freed outputs kept in the heap (no fresh pages)

Providers are interleaved in a fresh seeded random order every round; medians of all rounds are
reported in microseconds with the ratio to ``qk_rms_norm``. Writes ``results/bench_qk_cpu.csv``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from normatlas._io import atomic_write
from normatlas.cli._format import format_rows
from normatlas.kernels import fused_rms_norm, qk_rms_norm
from normatlas.kernels.bench import reuse_freed_memory

# (batch, tokens) with 32 query heads and 8 key/value heads of 128 (Llama-3-8B / Qwen3-8B-like GQA)
CASES = {"decode": (1, 1), "decode_batch8": (8, 1), "prefill_256": (1, 256)}


def _hf(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def providers(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor) -> dict[str, Callable[[], Any]]:
    d, eps = q.shape[-1], 1e-6
    return {
        "qk_rms_norm": lambda: qk_rms_norm(q, k, wq, wk, eps),
        "two_fused_calls": lambda: (fused_rms_norm(q, d, wq, eps), fused_rms_norm(k, d, wk, eps)),
        "F.rms_norm_x2": lambda: (F.rms_norm(q, (d,), wq, eps), F.rms_norm(k, (d,), wk, eps)),
        "hf_x2": lambda: (_hf(q, wq, eps), _hf(k, wk, eps)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2000, help="interleaved rounds (fewer for prefill, see below)")
    p.add_argument("--out", type=Path, default=Path("results/bench_qk_cpu.csv"))
    p.add_argument("--alloc", choices=("default", "reuse"), default="default",
                   help="reuse: keep freed blocks in the heap (as bench_norms.py --alloc reuse)")  # fmt: skip
    args = p.parse_args(argv)
    alloc = reuse_freed_memory() if args.alloc == "reuse" else "default (glibc)"
    print(f"# torch {torch.__version__}  threads={torch.get_num_threads()}  allocator: {alloc}  "
          f"load: {os.getloadavg()}", file=sys.stderr)  # fmt: skip
    rows: list[dict[str, Any]] = []
    for case, (batch, tokens) in CASES.items():
        for dtype in (torch.bfloat16, torch.float32):
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(batch, 32, tokens, 128, generator=gen).to(dtype)
            k = torch.randn(batch, 8, tokens, 128, generator=gen).to(dtype)
            wq, wk = ((torch.rand(128, generator=gen) + 0.5).to(dtype) for _ in range(2))
            calls = list(providers(q, k, wq, wk).items())
            times: dict[str, list[float]] = {name: [] for name, _ in calls}
            rounds = args.rounds if tokens == 1 else max(50, args.rounds // 20)
            with torch.no_grad():
                for _name, f in calls:  # warm-up (first-call costs, allocator)
                    for _ in range(20):
                        f()
                shuffle = random.Random(0).shuffle
                for _ in range(rounds):
                    shuffle(calls)  # a fresh order every round: no provider keeps the same predecessor
                    for name, f in calls:
                        t0 = time.perf_counter()
                        f()
                        times[name].append(time.perf_counter() - t0)
            ours = statistics.median(times["qk_rms_norm"])
            for name, ts in times.items():
                med = statistics.median(ts)
                rows.append({"case": case, "q": "x".join(map(str, q.shape)), "k": "x".join(map(str, k.shape)),
                             "dtype": str(dtype).removeprefix("torch."), "provider": name,
                             "median_us": round(med * 1e6, 2), "min_us": round(min(ts) * 1e6, 2),
                             "vs_qk_rms_norm": round(med / ours, 2), "rounds": rounds})  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, format_rows(rows, "csv") + "\n")
    print(format_rows(rows, "table", "== QK-norm, inference: median microseconds, ratio to qk_rms_norm =="))
    print(f"\nload average at end: {os.getloadavg()}\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
