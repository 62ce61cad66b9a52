"""BatchNorm's output depends on the per-device split of a batch; SyncBatchNorm's does not (essay §04).

Claim: the same global batch of 8 through a BatchNorm model (train mode, float64) in 1, 2 and 4 gloo processes
changes the output by as much as the output itself (max |difference| vs one process ~1 and ~2.6); converted with
``convert_sync_batchnorm`` the difference is float64 rounding (< 1e-15). Command::

    PYTHONPATH=src .venv/bin/python benchmarks/bn_split.py [--out benchmarks/results]

Writes ``bn_split.csv`` (processes, examples each, max |diff| BN, max |diff| SyncBN) and ``bn_split.png``
(matplotlib, Agg). About 80 s on 2 cores (process start-up dominates). Seeded (model seed 0, batch seed 1).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from normatlas.distributed.bnsplit import GLOBAL_BATCH, split_outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for world in (1, 2, 4):
        bn, sync = split_outputs(world), split_outputs(world, sync=True)
        rows.append({"processes": world, "examples_each": GLOBAL_BATCH // world, "bn": bn, "syncbn": sync})
        print(f"{world} processes x {GLOBAL_BATCH // world}: BN {bn:.3g}   SyncBN {sync:.3g}", flush=True)
    with (out / "bn_split.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    xs = [r["processes"] for r in rows]
    floor = 1e-17  # a zero difference drawn on the log axis
    ax.plot(xs, [max(float(r["bn"]), floor) for r in rows], "o-", label="BatchNorm (per-process statistics)")
    ax.plot(xs, [max(float(r["syncbn"]), floor) for r in rows], "s--", label="SyncBatchNorm")
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xlabel("gloo processes (global batch 8, split evenly)")
    ax.set_ylabel("max |output - 1-process output|")
    ax.set_title("BatchNorm's output changes with the split; SyncBN's does not", fontsize=10)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, "seed 0/1, float64, a zero drawn at 1e-17; python benchmarks/bn_split.py", fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bn_split.png", dpi=120)
    print(f"wrote {out / 'bn_split.csv'} and {out / 'bn_split.png'}")


if __name__ == "__main__":
    main()
