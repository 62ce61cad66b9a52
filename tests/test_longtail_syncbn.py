"""SyncBatchNorm: a real 2-process gloo run on CPU equals single-process BatchNorm on the concatenated batch."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from normatlas.longtail import BatchNorm, SyncBatchNorm, merge_moments
from normatlas.longtail.syncbn import _SyncBNFunction

C = 3
STEPS = 2


def _data(sizes, step):
    g = torch.Generator().manual_seed(100 + step)
    n = sum(sizes)
    x = torch.randn(n, C, 5, generator=g, dtype=torch.float64) * 3 + 1
    up = torch.randn(n, C, 5, generator=g, dtype=torch.float64)
    return x, up


def _worker(rank, world, port, sizes, outdir, backend="gloo"):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    calls = {"all_gather": 0, "all_reduce": 0}
    for name in calls:  # count the collectives (this spawned process only)
        original = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        torch.manual_seed(0)
        bn = SyncBatchNorm(C, momentum=0.3, dtype=torch.float64, device=device)
        with torch.no_grad():
            bn.weight.copy_(torch.tensor([0.5, 2.0, -1.0]))
            bn.bias.copy_(torch.tensor([0.1, 0.0, -0.3]))
        lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
        record = {}
        for step in range(STEPS):
            x, up = _data(sizes, step)
            xs = x[lo:hi].clone().to(device).requires_grad_(True)
            bn.zero_grad()
            y = bn(xs)
            forward_calls = dict(calls)
            (y * up[lo:hi].to(device)).sum().backward()
            record[step] = {"y": y.detach().cpu(), "gx": xs.grad.cpu(), "gw": bn.weight.grad.cpu(),
                            "gb": bn.bias.grad.cpu(), "forward_calls": forward_calls, "calls": dict(calls)}  # fmt: skip
            calls.update(all_gather=0, all_reduce=0)
        record["running"] = (bn.running_mean.cpu(), bn.running_var.cpu(), int(bn.num_batches_tracked))
        torch.save(record, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _needs_two_gpus():
    return pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl with 2 ranks needs 2 GPUs")


@pytest.mark.parametrize(
    ("backend", "sizes"),
    [
        ("gloo", (4, 3)),
        ("gloo", (6, 0)),
        pytest.param("nccl", (4, 3), marks=[pytest.mark.gpu, _needs_two_gpus()]),
        pytest.param("nccl", (6, 0), marks=[pytest.mark.gpu, _needs_two_gpus()]),
    ],
    ids=["gloo-uneven", "gloo-zero-sample-rank", "nccl-uneven", "nccl-zero-sample-rank"],
)
def test_two_ranks_match_single_process_on_concatenated_batch(tmp_path, backend, sizes):
    mp.start_processes(_worker, args=(2, _free_port(), sizes, str(tmp_path), backend), nprocs=2, join=True,
                       start_method="spawn")  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref = BatchNorm(C, momentum=0.3, dtype=torch.float64)  # itself checked against torch.nn in test_longtail_batch
    with torch.no_grad():
        ref.weight.copy_(torch.tensor([0.5, 2.0, -1.0]))
        ref.bias.copy_(torch.tensor([0.1, 0.0, -0.3]))
    for step in range(STEPS):
        x, up = _data(sizes, step)
        x.requires_grad_(True)
        ref.zero_grad()
        y = ref(x)
        (y * up).sum().backward()
        assert_close(torch.cat([r[step]["y"] for r in ranks]), y.detach(), atol=1e-12, rtol=1e-12)
        assert_close(torch.cat([r[step]["gx"] for r in ranks]), x.grad, atol=1e-12, rtol=1e-12)
        assert_close(ranks[0][step]["gw"] + ranks[1][step]["gw"], ref.weight.grad, atol=1e-12, rtol=1e-12)
        assert_close(ranks[0][step]["gb"] + ranks[1][step]["gb"], ref.bias.grad, atol=1e-12, rtol=1e-12)
        for r in ranks:  # one collective in the forward (count, mean, M2 together), one in the backward
            assert r[step]["forward_calls"] == {"all_gather": 1, "all_reduce": 0}
            assert r[step]["calls"] == {"all_gather": 1, "all_reduce": 1}
    for r in ranks:
        rm, rv, nbt = r["running"]
        assert nbt == STEPS
        assert_close(rm, ref.running_mean, atol=1e-7, rtol=1e-6)  # running stats are stored in fp32
        assert_close(rv, ref.running_var, atol=1e-7, rtol=1e-6)


def test_merge_moments_is_stable_and_skips_empty_parts():
    torch.manual_seed(0)
    x = torch.randn(50, 4, dtype=torch.float64) * 1e-3 + 1e4  # large mean, tiny spread: sum/sumsq would cancel
    parts = [x[:20], x[20:20], x[20:]]
    counts = torch.tensor([float(len(p)) for p in parts], dtype=torch.float64)
    means = torch.stack([p.mean(0) if len(p) else torch.zeros(4, dtype=torch.float64) for p in parts])
    m2 = torch.stack([((p - p.mean(0)) ** 2).sum(0) if len(p) else torch.zeros(4, dtype=torch.float64)
                      for p in parts])  # fmt: skip
    total, mean, merged = merge_moments(counts, means, m2)
    assert total.item() == 50
    assert_close(mean, x.mean(0))
    assert_close(merged / 50, x.var(0, unbiased=False), rtol=1e-9, atol=0)


def test_single_process_equals_torch_batchnorm_and_gradcheck():
    torch.manual_seed(1)
    x = torch.randn(7, C, 4, dtype=torch.float64, requires_grad=True)
    ours, theirs = SyncBatchNorm(C, dtype=torch.float64), torch.nn.BatchNorm1d(C, dtype=torch.float64)
    up = torch.randn(7, C, 4, dtype=torch.float64)
    (gx,) = torch.autograd.grad((ours(x) * up).sum(), x)
    (gt,) = torch.autograd.grad((theirs(x) * up).sum(), x)
    assert_close(gx, gt)
    w = torch.randn(C, dtype=torch.float64, requires_grad=True)
    b = torch.randn(C, dtype=torch.float64, requires_grad=True)
    fn = lambda x, w, b: _SyncBNFunction.apply(x, w, b, 1e-5, None, (0, 2), (C, 1), 1, [])
    assert torch.autograd.gradcheck(fn, (x, w, b))


def test_mask_is_rejected():
    with pytest.raises(ValueError, match="mask is not supported"):
        SyncBatchNorm(C)(torch.randn(4, C), mask=torch.ones(4, C, dtype=torch.bool))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_single_process_matches_torch_batchnorm(dtype):
    torch.manual_seed(2)
    x = torch.randn(16, C, 33, device="cuda")
    ours = SyncBatchNorm(C, device="cuda", dtype=dtype)
    theirs = torch.nn.BatchNorm1d(C, device="cuda")
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    assert_close(ours(x.to(dtype)).float(), theirs(x), **tol)
    assert_close(ours.running_var, theirs.running_var, **tol)


def test_single_process_one_value_per_channel_raises_as_batchnorm_and_keeps_its_estimates():
    # torch.nn.BatchNorm1d / our BatchNorm raise here; the batch variance 0 would otherwise zero the output
    # and drag running_var toward 0
    bn = SyncBatchNorm(C)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        bn(torch.randn(1, C))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        BatchNorm(C)(torch.randn(1, C))
    assert_close(bn.running_var, torch.ones(C))
    assert int(bn.num_batches_tracked) == 0


def test_single_process_empty_batch_is_torch_batchnorm():
    ours, theirs = SyncBatchNorm(C), torch.nn.BatchNorm1d(C)
    x = torch.randn(0, C, 5, requires_grad=True)
    y = ours(x)
    assert y.shape == x.shape and y.shape == theirs(x).shape
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert_close(ours.running_mean, theirs.running_mean)
    assert_close(ours.running_var, theirs.running_var)
    assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == 1
    x = torch.randn(6, C, 5)
    assert_close(ours(x), theirs(x))  # the empty step left nothing behind
    assert_close(ours.running_var, theirs.running_var)
