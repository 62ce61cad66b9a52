"""MoCo's shuffled BN against the cross-example leak it removes (essay §04): the keys of a query's device mates.

Batch 8 on 4 simulated devices of 2, key encoder ``Linear(6, 16) -> BatchNorm1d -> Tanh -> Linear(16, 4)`` (float64,
train mode). For every example ``j``, ``cross_example_dependence`` (``probes=1``) perturbs key input ``j`` and reads
the change of the keys of the examples that share ``j``'s query device (the other outputs zeroed), relative to the
largest key; the leak is the max over ``j``. Plain per-device BN, then ``--seeds`` random shuffles. Command::

    PYTHONPATH=src .venv/bin/python benchmarks/shuffled_bn_leak.py [--seeds 200]

About 80 s for 200 seeds on 2 cores.
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn

from normatlas.diagnostics.health import cross_example_dependence
from normatlas.longtail import BatchNorm1d
from normatlas.longtail.bn_stats import shuffled_bn_forward

BATCH, GROUPS = 8, 4  # 4 simulated devices of 2 examples each


def _key_encoder() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)).double().train()


class _MatesOfFirst(nn.Module):
    """Keys of the query-device mates of example ``j``, the batch given with ``j`` moved first.

    ``order`` maps the position in the given batch to the original index; the encoder sees the batch
    in the original order (query device d = examples ``d*m .. d*m+m-1``), run plain per device or
    shuffled with the fixed permutation drawn from ``seed``. Keys outside j's query device are zeroed,
    so the dependence check reads only them.
    """

    def __init__(self, encoder: nn.Module, order: Tensor, shuffle: int | None) -> None:
        super().__init__()
        self.encoder, self.order, self.shuffle = encoder, order, shuffle

    def forward(self, y: Tensor) -> Tensor:
        x = torch.empty_like(y)
        x[self.order] = y
        if self.shuffle is None:
            keys = torch.cat([self.encoder(c) for c in x.chunk(GROUPS)])
        else:
            gen = torch.Generator().manual_seed(self.shuffle)
            keys = shuffled_bn_forward(self.encoder, x, GROUPS, generator=gen)
        j, m = int(self.order[0]), BATCH // GROUPS
        keep = torch.zeros(BATCH, 1, dtype=keys.dtype)
        keep[(j // m) * m : (j // m + 1) * m] = 1
        return (keys * keep)[self.order]


def query_mate_leak(shuffle: int | None) -> float:
    """Max over examples j of the relative change of the keys of j's query-device mates when key input j changes.

    Plain per-device BN: those keys were normalized with statistics of a sub-batch holding j, the same
    sub-batch the queries were, so they move. Shuffled: they move only if the shuffle put them with j.
    """
    x = torch.randn(BATCH, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    enc, leak = _key_encoder(), 0.0
    for j in range(BATCH):
        order = torch.tensor([j] + [i for i in range(BATCH) if i != j])
        dep = cross_example_dependence(_MatesOfFirst(enc, order, shuffle), x[order], probes=1, tol=1e-12)
        leak = max(leak, dep.leak)
    return leak


def _separates_mates(seed: int) -> bool:
    perm = torch.randperm(BATCH, generator=torch.Generator().manual_seed(seed))
    key_group = torch.empty(BATCH, dtype=torch.long)
    key_group[perm] = torch.arange(BATCH) // (BATCH // GROUPS)
    m = BATCH // GROUPS
    return all(len(set(key_group[d * m : (d + 1) * m].tolist())) == m for d in range(GROUPS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=200, help="random shuffles to measure (seeds 0 .. N-1)")
    n = ap.parse_args().seeds
    if n < 1:
        raise SystemExit(f"--seeds={n} must be >= 1")
    leaks = [query_mate_leak(s) for s in range(n)]
    clean = sum(v < 1e-12 for v in leaks)
    separated = sum(_separates_mates(s) for s in range(n))
    print(f"plain per-device BN: leak {query_mate_leak(None):.3f}")
    print(f"shuffled: leak < 1e-12 in {clean} of {n} shuffles (shuffles that separate every query pair: {separated});")
    print(f"max leak {max(leaks):.3f}")


if __name__ == "__main__":
    main()
