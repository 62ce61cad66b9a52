"""Two builds of the C++ kernels in one process, called in a fresh random order each round: the A/B behind
docs/kernels.md's "new time / old time" figures.

Claim: on this shared 2-core VM, medians of separate runs move more than most kernel changes do; interleaving
the old and the new build call by call makes both meet the same machine state, so their ratio is what changed.
Each build is compiled from its own copy of ``src/normatlas/kernels/csrc`` (``--base``: a git revision, or a
folder; ``--new``: a folder, default the working tree), with the flags of ``normatlas.kernels.cpu``; the outputs of
the two are compared (max abs difference) before timing. Command::

    .venv/bin/python benchmarks/ab_builds.py --base HEAD~1 --op bwd --dtype bfloat16 --shapes 256x4096 1024x1024

prints, per (shape, dtype): both medians in us, new / old for the medians and for the best calls, and the largest
difference between the two builds' outputs (0 when the change was meant to keep the results bit for bit).
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from normatlas.cli.bench import shape_arg

ROOT = Path(__file__).resolve().parents[1]
CSRC = Path("src/normatlas/kernels/csrc")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sources_at(rev: str, dest: Path) -> Path:
    """Write ``src/normatlas/kernels/csrc`` as of git revision ``rev`` into ``dest`` (ValueError for a bad rev)."""
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{CSRC}"], capture_output=True,
                           text=True)  # fmt: skip
    if names.returncode != 0 or not names.stdout.split():
        raise ValueError(f"--base={rev!r}: not a git revision with {CSRC} ({names.stderr.strip() or 'no files'})")
    dest.mkdir(parents=True, exist_ok=True)
    for name in names.stdout.split():
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{CSRC}/{name}"], capture_output=True, check=True)
        (dest / name).write_bytes(blob.stdout)
    return dest


def build(name: str, src: Path, out: Path) -> ModuleType:
    """Compile the three translation units in ``src`` as module ``name`` (the flags of normatlas.kernels.cpu)."""
    from torch.utils.cpp_extension import load

    from normatlas.kernels import cpu

    out.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=[str(src / p.name) for p in cpu.SOURCES], extra_cflags=list(cpu._CFLAGS),
                extra_ldflags=list(cpu._LDFLAGS), extra_include_paths=[str(src)], build_directory=str(out),
                verbose=False)  # fmt: skip


def compare(mods: dict[str, ModuleType], op: str, rows: int, n: int, dtype: torch.dtype, center: bool,
            rounds: int) -> str:  # fmt: skip
    """One (shape, dtype): both builds' outputs compared, then ``rounds`` interleaved rounds; a line of results."""
    gen = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(rows, n, generator=gen).to(dtype) for _ in range(2))
    w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if center else None
    _, _, st = mods["old"].norm_fwd(x, None, w, b, 1e-6, center, 0, False, False, False, n)

    def call(m: ModuleType):
        if op == "fwd":
            return lambda: m.norm_fwd(x, None, w, b, 1e-6, center, 0, False, False, False, n)
        return lambda: m.norm_bwd(dy, x, w, st, None, center, False, False, False, True, center, n)

    calls = {k: call(m) for k, m in mods.items()}
    outs = {k: c() for k, c in calls.items()}
    diff = max(((a.float() - e.float()).abs().max().item() if a.numel() else 0.0)
               for a, e in zip(outs["old"], outs["new"], strict=True))  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in calls}
    order = list(calls.items())
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for k, c in order:
            t0 = time.perf_counter()
            c()
            times[k].append(time.perf_counter() - t0)
    old, new = (statistics.median(times[k]) for k in ("old", "new"))
    best = min(times["new"]) / min(times["old"])
    name = str(dtype).removeprefix("torch.")
    return (f"{rows}x{n} {name} {op}: old {old * 1e6:.1f} us  new {new * 1e6:.1f} us  new/old {new / old:.3f}  "
            f"best calls {best:.3f}  max |new - old| {diff:.3g}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="a git revision, or a folder holding the old csrc sources")
    p.add_argument("--new", type=Path, default=ROOT / CSRC, help="a folder of new sources (default: working tree)")
    p.add_argument("--op", choices=("fwd", "bwd"), default="fwd")
    p.add_argument("--dtype", choices=tuple(DTYPES), nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--shapes", type=shape_arg, nargs="+", default=[(256, 4096), (2048, 4096)])
    p.add_argument("--center", action="store_true", help="LayerNorm (with a bias) instead of RMSNorm")
    p.add_argument("--rounds", type=int, default=400)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="normatlas_ab_") as tmp:
        work = Path(tmp)
        base_src = Path(args.base) if Path(args.base).is_dir() else sources_at(args.base, work / "base_src")
        mods = {"old": build("normatlas_ab_old", base_src, work / "old"),
                "new": build("normatlas_ab_new", args.new, work / "new")}  # fmt: skip
        print(f"# old: {args.base}  new: {args.new}  op={args.op}  center={args.center}  threads="
              f"{torch.get_num_threads()}", file=sys.stderr)  # fmt: skip
        for rows, n in args.shapes:
            for dname in args.dtype:
                print(compare(mods, args.op, rows, n, DTYPES[dname], args.center, args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
