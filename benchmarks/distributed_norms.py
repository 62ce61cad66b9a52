"""Norms under tensor, sequence and data parallelism: the figures of docs/distributed.md, on gloo processes.

Claims (essay rules 8 and 9): (1) TP + SP with every norm as a sequence-parallel region reproduces the
single-process model (logits, loss, gradients; replicas identical after AdamW) once the pending norm gradients are
reduced; (2) keeping each block's norms in the block's FSDP2 unit cuts the collectives of a step several-fold at
the same bytes; (3) the selective recompute policy (save matmul / attention outputs, recompute norms) drops
about 40% of a block's activation bytes with bit-identical gradients; (4) SyncBatchNorm under DDP with uneven
batches equals one process on the concatenated batch. Command::

    PYTHONPATH=src .venv/bin/python benchmarks/distributed_norms.py [--four] [--csv DIR]

``--four`` adds the 2 x 2 mesh (4 processes) FSDP x TP run (about a minute more on 2 cores). Sizes: the tests'
tiny models (2 layers, d_model 32; the recompute rows d_model 64, 64 tokens, batch 4), fp32 (the FSDP x TP run
float64). Seeded; counts and bytes are exact and machine-independent, the differences are rounding.
"""

from __future__ import annotations

import argparse
import csv
import time
import warnings
from pathlib import Path
from typing import Any

from normatlas.distributed import figures, spawn


def two_ranks(rank: int, world: int) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    return {
        "tp": figures.tp_check(rank, world, steps=5),
        "llama": figures.tp_check(rank, world, steps=5, hf="llama"),
        "olmo2": figures.tp_check(rank, world, steps=5, hf="olmo2"),
        "loss_parallel": figures.loss_parallel_check(rank, world),
        "reduce": figures.reduce_check(rank, world),
        "collectives": figures.collectives_check(rank, world),
        "syncbn": figures.syncbn_ddp_check(rank, world),
    }


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    return figures.fsdp_tp_check(rank, world, steps=3)


def _table(title: str, rows: list[dict[str, Any]], cols: list[str]) -> None:
    print(f"\n{title}")
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=False)))
    for r in rows:
        print("  ".join(_fmt(r[c]).ljust(w) for c, w in zip(cols, widths, strict=False)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return str(len(v))
    return str(v)


def _write(out: Path | None, name: str, rows: list[dict[str, Any]]) -> None:
    if out is None or not rows:
        return
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({k: _fmt(v) if isinstance(v, list) else v for k, v in r.items()} for r in rows)


def _collective_rows(coll: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for layout, kinds in coll.items():
        for k in kinds:
            rows.append({"layout": layout, **k, "comm_debug_mode": ""})
        rows.append({"layout": layout, "collective": "total", "count": sum(k["count"] for k in kinds),
                     "bytes": sum(k["bytes"] for k in kinds)})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--four", action="store_true", help="also run FSDP x TP on a 2 x 2 mesh (4 processes)")
    ap.add_argument("--csv", type=Path, default=None, help="write each table as DIR/<name>.csv")
    args = ap.parse_args()
    t0 = time.perf_counter()
    r = spawn(two_ranks, 2, timeout=900)[0]
    eq_cols = ["model", "logits", "loss", "grads", "pending", "weights", "findings_after_steps"]
    tp_rows = r["tp"] + r["llama"] + r["olmo2"]
    _table("TP + SP on 2 gloo ranks vs one process (fp32; max |diff|; pending = Partial norm grads before the "
           "reduction; weights after 5 AdamW steps; findings = replicas that differ)", tp_rows, eq_cols)  # fmt: skip
    lp = r["loss_parallel"]
    _table("loss_parallel: logits left vocabulary-sharded, cross-entropy under torch's loss_parallel(), vs one "
           "process (peri_ln / rms / qk)", [lp], ["placements", "local_vocab", "loss", "grads"])  # fmt: skip
    red = [
        {
            "model": f"peri_ln/{k}/qk",
            "pending": v["pending"],
            "collectives": sum(c["count"] for c in v["collectives"]),
            "bytes": sum(c["bytes"] for c in v["collectives"]),
            "grads": v["grads"],
        }
        for k, v in r["reduce"].items()
    ]
    _table("reduce_partial_grads: the pending norm gradients of one step, bucketed (collectives and bytes per rank)",
           red, ["model", "pending", "collectives", "bytes", "grads"])  # fmt: skip
    cdm = r["collectives"].pop("comm_debug_mode")
    coll = _collective_rows(r["collectives"])
    for row in coll:
        if row["collective"] == "total":
            row["comm_debug_mode"] = cdm[row["layout"]]
    _table("Collectives in one training step on 2 ranks (counts, payload bytes per rank)", coll,
           ["layout", "collective", "count", "bytes", "comm_debug_mode"])  # fmt: skip
    sb = {**r["syncbn"], "sizes": "+".join(str(n) for n in r["syncbn"]["sizes"])}
    _table("SyncBatchNorm (converted) under DDP, uneven batches, vs one process", [sb],
           ["sizes", "output", "input_grad", "param_grads", "running_stats", "weights"])  # fmt: skip
    rec = figures.recompute_figures()
    _table("Activation bytes of one block (d_model 64, 64 tokens, batch 4): stored without checkpointing, kept "
           "under the norm-recompute policy", rec, ["model", "stored", "kept", "saved", "saved_fraction",
                                                   "grad_diff"])  # fmt: skip
    tables = (("tp_equality", tp_rows), ("collectives", coll), ("recompute", rec), ("syncbn", [sb]),
              ("loss_parallel", [lp]), ("reduce", red))  # fmt: skip
    for name, rows in tables:
        _write(args.csv, name, rows)
    if args.four:
        f = spawn(four_ranks, 4, timeout=900)
        rows = [{"rank": i, **{k: v for k, v in x.items() if k in eq_cols}} for i, x in enumerate(f)]
        for row in rows:
            row["model"] = "peri_ln/rms/qk (float64)"
        _table("FSDP x TP on a 2 x 2 mesh vs one process (float64; weights after 3 AdamW steps)", rows,
               ["rank", *eq_cols])  # fmt: skip
        _write(args.csv, "fsdp_tp", rows)
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
