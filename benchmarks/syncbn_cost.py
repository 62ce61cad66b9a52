"""What SyncBatchNorm costs, as a ratio to per-process BatchNorm measured in the same run (essay §04, issue 36).

Claim measured: forward + backward of a small conv net with our SyncBatchNorm (one all-gather per layer forward,
one all-reduce backward) costs a ratio > 1 of the same net with our per-process BatchNorm2d, on 2 and 4 gloo
processes on one CPU. ``torch.nn.SyncBatchNorm`` is tried too; on CPU it refuses (it needs a GPU / XPU /
privateuse1 device), and the refusal is printed. No DDP: the gradient all-reduce would add the same cost to every
variant. Command::

    PYTHONPATH=src .venv/bin/python benchmarks/syncbn_cost.py [--steps 40] [--out benchmarks/results]

Variants are interleaved round by round inside each process (so load drifts hit them alike); a step's time is
the max over ranks of that rank's time between two barriers; the table shows medians over rounds and the ratio
to our BatchNorm2d. ``os.getloadavg()`` is printed before and after: the CPU is shared. About 20-30 s on 2 cores
(process start-up dominates). Seeded (model seed 0, batch seed rank + 1). Writes ``syncbn_cost.csv`` and
``syncbn_cost.png`` (every round's step time per variant and process count, the ratio of medians above each).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from normatlas.distributed.launch import spawn
from normatlas.distributed.syncbn import convert_sync_batchnorm
from normatlas.longtail import BatchNorm2d

PER_RANK_BATCH, CHANNELS, SIZE = 16, 16, 16
VARIANTS = ("ours BatchNorm2d", "ours SyncBatchNorm", "torch.nn.BatchNorm2d", "torch.nn.SyncBatchNorm")


def _net(bn: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, CHANNELS, 3, padding=1), bn(CHANNELS), nn.ReLU(),
        nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), bn(CHANNELS), nn.ReLU(),
        nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), bn(CHANNELS), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(CHANNELS, 10),
    ).train()  # fmt: skip


def _build(name: str) -> nn.Module:
    if name == "ours BatchNorm2d":
        return _net(BatchNorm2d)
    if name == "ours SyncBatchNorm":
        return convert_sync_batchnorm(_net(BatchNorm2d))
    if name == "torch.nn.BatchNorm2d":
        return _net(nn.BatchNorm2d)
    return nn.SyncBatchNorm.convert_sync_batchnorm(_net(nn.BatchNorm2d))


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()


def _worker(rank: int, world: int, steps: int) -> dict[str, Any]:
    x = torch.randn(PER_RANK_BATCH, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(rank + 1))
    models: dict[str, nn.Module] = {}
    refused: dict[str, str] = {}
    for name in VARIANTS:
        model = _build(name)
        try:
            _step(model, x)  # warm-up; torch's SyncBatchNorm refuses CPU input here
            models[name] = model
        except (RuntimeError, ValueError) as exc:
            refused[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    for _ in range(2):  # more warm-up
        for model in models.values():
            _step(model, x)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(steps):
        for name, model in models.items():
            dist.barrier()
            t0 = time.perf_counter()
            _step(model, x)
            times[name].append(time.perf_counter() - t0)
    return {"times": times, "refused": refused}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="timed rounds per variant")
    ap.add_argument("--worlds", default="2,4", help="comma-separated process counts")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load0, t0 = os.getloadavg(), time.perf_counter()
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, loadavg before {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}"
    )
    print(
        f"net: 3 x (Conv2d 3x3 -> BN -> ReLU), {CHANNELS} channels, {PER_RANK_BATCH} x 3 x {SIZE} x {SIZE} per process"
    )
    rows: list[dict[str, Any]] = []
    rounds: dict[int, dict[str, list[float]]] = {}
    refusals: dict[str, str] = {}
    for world in (int(w) for w in args.worlds.split(",")):
        ranks = spawn(_worker, world, args.steps, timeout=300.0)
        refusals.update(ranks[0]["refused"])
        names = list(ranks[0]["times"])
        per_step = {n: [max(r["times"][n][i] for r in ranks) for i in range(args.steps)] for n in names}
        rounds[world] = per_step
        base = statistics.median(per_step["ours BatchNorm2d"])
        for n in names:
            ratios = [a / b for a, b in zip(per_step[n], per_step["ours BatchNorm2d"], strict=True)]
            med = statistics.median(per_step[n])
            rows.append({
                "processes": world, "variant": n, "median_ms": 1e3 * med,
                "ratio_vs_ours_bn": med / base, "median_round_ratio": statistics.median(ratios),
            })  # fmt: skip
    load1 = os.getloadavg()
    print()
    print("| processes | variant | fwd+bwd median (ms) | ratio of medians vs ours BN | median per-round ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['processes']} | {r['variant']} | {r['median_ms']:.2f} | {r['ratio_vs_ours_bn']:.2f} | "
            f"{r['median_round_ratio']:.2f} |"
        )
    for name, why in refusals.items():
        print(f"{name}: refused on CPU/gloo: {why}")
    print(f"loadavg after {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; wall {time.perf_counter() - t0:.0f} s")
    with (out / "syncbn_cost.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    _figure(rounds, rows, out / "syncbn_cost.png", load0[0], load1[0])
    print(f"wrote {out / 'syncbn_cost.csv'} and {out / 'syncbn_cost.png'}")


def _figure(
    rounds: dict[int, dict[str, list[float]]], rows: list[dict[str, Any]], path: Path, load0: float, load1: float
) -> None:
    """One panel per process count: every round's step time (ms, the max over ranks) per variant, the median
    marked, the ratio of medians to our BatchNorm2d written above it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rounds), figsize=(5 * len(rounds), 4.2), squeeze=False)
    ratio = {(r["processes"], r["variant"]): r["ratio_vs_ours_bn"] for r in rows}
    for ax, (world, per_step) in zip(axes[0], rounds.items(), strict=True):
        names = list(per_step)
        ax.boxplot([[1e3 * t for t in per_step[n]] for n in names], showfliers=True)
        ax.set_xticks(range(1, len(names) + 1), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
        top = max(1e3 * max(v) for v in per_step.values())
        for i, n in enumerate(names, 1):
            ax.annotate(f"{ratio[(world, n)]:.2f}x", (i, top * 1.02), ha="center", fontsize=9)
        ax.set(title=f"{world} gloo processes", ylabel="forward + backward per step (ms, max over ranks)")
        ax.set_ylim(0, top * 1.12)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(
        "SyncBatchNorm against per-process BatchNorm, same processes, interleaved rounds "
        "(ratio of medians to ours BatchNorm2d)",
        fontsize=10,
    )
    fig.text(0.5, -0.02, f"python benchmarks/syncbn_cost.py; loadavg {load0:.2f} -> {load1:.2f}; "
             f"torch.nn.SyncBatchNorm refuses CPU", ha="center", fontsize=8, color="0.35")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()
