"""Side-by-side timing of the fused kernels against their peers, in one process.

Providers: ``ours`` (normatlas.kernels), ``module`` (rms and layer: the drop-in ``normatlas.RMSNorm`` /
``normatlas.LayerNorm`` module, default ``backend="auto"``, whose parameters are the benchmark's own weight and
bias tensors), ``ours_llama`` (rms and qk: ours in HF Llama's cast order,
``weight * x_hat.to(dtype)``, the same function as ``hf``), ``torch`` (the native op: ``F.rms_norm`` /
``F.layer_norm``; for the add variants ``x + r`` then that op), ``hf`` (the HF-style eager
reference: ``w * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)``, after ``x + r`` for the add
variants), ``compile`` (``torch.compile(dynamic=True)`` of the HF-style code; for add+RMSNorm
inductor fuses the add into the norm, so it is a fused peer), ``compile_pair`` (add+RMSNorm
only: torch's ``x + r``, then the compiled HF-style RMSNorm: the strongest *unfused* pair),
``liger`` (Liger-Kernel, only where it runs: CUDA), ``floor`` (CPU, forward of rms / layer
only: the output pass alone, ``y = x * s * w`` row by row with our vector code and threading, no
statistics: no norm forward can beat it on this machine), and ``copy`` (``x.clone()`` of the
same tensor, the bandwidth limit). First-call seconds (compile time) are reported. Calls are
interleaved, in a fresh seeded random order every round, and the median of ``repeats`` rounds
is reported (``min_ms`` too), so machine noise and neighbours' cache state hit every provider alike.
With ``warm=True`` (the cache-resident regime) each timed call comes right after an untimed call of the same
provider, so it meets its inputs and buffers as its own steady loop leaves them; otherwise it meets whatever its
predecessor in the round left, and after a peer that writes tens of MiB of temporaries (torch's unfused bf16
RMSNorm forward + backward at 256 x 4096) a cache-sized input comes back from memory.

Reported per row: median ms, GB/s (bytes that must move: one read per input, one write per
output, three for a backward), and ``vs_copy``: the time over the time the copy would need to
move the same bytes (1.0 is the bandwidth limit; the forward of a norm moves exactly a copy's
bytes). ``vs_ours``: the provider's time over ours.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..capacity import check_memory

__all__ = [
    "MODES",
    "OPS",
    "bench_bytes",
    "cache_resident",
    "check_bench_memory",
    "provider_names",
    "reuse_freed_memory",
    "run_bench",
]

OPS = ("rms", "layer", "add_rms", "add_layer", "qk")
MODES = ("fwd", "bwd", "fwdbwd")
FWD_ONLY = frozenset({"floor"})  # providers with no backward
Fn = Callable[..., Any]


CACHE_BYTES = 8 << 20  # the CPU kernels' own limit for a cache-resident input (csrc/norm_rows.h: streams_from_memory)


def cache_resident(shape: tuple[int, int]) -> bool:
    """Whether a (rows, hidden) input of fp32 fits the cache-resident regime (at most 8 MiB): timed warm by default."""
    return shape[0] * shape[1] * 4 <= CACHE_BYTES


def _hf_rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _hf_ln(x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    h = x.float()
    mu = h.mean(-1, keepdim=True)
    var = (h - mu).pow(2).mean(-1, keepdim=True)
    return ((h - mu) * torch.rsqrt(var + eps) * w.float() + b.float()).to(x.dtype)


def _providers(op: str, device: str) -> dict[str, Fn]:
    from ..spec import CastOrder
    from . import fused_add_layer_norm, fused_add_rms_norm, fused_layer_norm, fused_rms_norm

    eps = 1e-6
    # the "bwd" mode replays one graph's backward (retain_graph=True), which donated buffers forbid
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    if op in ("rms", "qk"):
        out: dict[str, Fn] = {
            "ours": lambda x, r, w, b: fused_rms_norm(x, x.shape[-1], w, eps),
            "ours_llama": lambda x, r, w, b: fused_rms_norm(x, x.shape[-1], w, eps, cast_order=CastOrder.BEFORE_GAIN),
            "torch": lambda x, r, w, b: F.rms_norm(x, (x.shape[-1],), w, eps),
            "hf": lambda x, r, w, b: _hf_rms(x, w, eps),
        }
        if op == "rms":  # the RMSNorm-vs-LayerNorm targets, timed in the same interleaved rounds
            out["torch_layer_norm"] = lambda x, r, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps)
        out["compile"] = torch.compile(out["hf"], dynamic=True)
    elif op == "layer":
        out = {
            "ours": lambda x, r, w, b: fused_layer_norm(x, x.shape[-1], w, b, eps),
            "torch": lambda x, r, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps),
            "hf": lambda x, r, w, b: _hf_ln(x, w, b, eps),
        }
        out["compile"] = torch.compile(out["hf"], dynamic=True)
    elif op == "add_rms":
        hf_rms = torch.compile(lambda x, w: _hf_rms(x, w, eps), dynamic=True)
        out = {
            "ours": lambda x, r, w, b: fused_add_rms_norm(x, r, x.shape[-1], w, eps),
            "torch": lambda x, r, w, b: (F.rms_norm(h := x + r, (x.shape[-1],), w, eps), h),
            "hf": lambda x, r, w, b: (_hf_rms(h := x + r, w, eps), h),
            # the strongest unfused pair: torch's add, then an inductor-compiled RMSNorm
            "compile_pair": lambda x, r, w, b: (hf_rms(h := x + r, w), h),
        }
        out["compile"] = torch.compile(out["hf"], dynamic=True)  # add and norm fused by inductor
    elif op == "add_layer":
        out = {
            "ours": lambda x, r, w, b: fused_add_layer_norm(x, r, x.shape[-1], w, b, eps),
            "torch": lambda x, r, w, b: (F.layer_norm(h := x + r, (x.shape[-1],), w, b, eps), h),
            "hf": lambda x, r, w, b: (_hf_ln(h := x + r, w, b, eps), h),
        }
        out["compile"] = torch.compile(out["hf"], dynamic=True)
    else:
        raise ValueError(f"op={op!r} is not one of {OPS}")
    if op in ("rms", "layer"):
        out["module"] = _module_provider(op, eps)
    if device == "cpu" and op in ("rms", "layer"):
        from .dispatch import Impl, implementation

        impl, ext = implementation(torch.device("cpu"))
        if impl is Impl.CPP:
            out["floor"] = lambda x, r, w, b: ext.affine_floor(x, w, 0.5)
    if device == "cuda":
        liger = _liger(op)
        if liger is not None:
            out["liger"] = liger
    return out


def _module_provider(op: str, eps: float) -> Fn:
    """The drop-in module's forward, its ``weight`` / ``bias`` being exactly the tensors the call is given (the
    leaves whose gradients the backward modes ask for), so it does the same work as the functional providers."""
    from ..presets import LayerNorm, RMSNorm

    modules: dict[tuple[int, int], Any] = {}

    def call(x: Tensor, r: Tensor, w: Tensor, b: Tensor) -> Tensor:
        key = (id(w), id(b))
        m: Any = modules.get(key)
        if m is None:
            n = x.shape[-1]
            m = RMSNorm(n, eps=eps, device=x.device) if op == "rms" else LayerNorm(n, eps=eps, device=x.device)
            m._parameters["weight"] = w  # the caller's tensors, not copies
            if op == "layer":
                m._parameters["bias"] = b
            m._refs = (w, b)  # keep the ids unique while cached
            modules[key] = m
        return m(x)

    return call


def provider_names(op: str, device: str) -> list[str]:
    """The providers :func:`run_bench` times for ``op`` on ``device`` (Liger where it is importable)."""
    return list(_providers(op, device))


def _liger(op: str) -> Fn | None:
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    if op in ("rms", "qk"):
        return lambda x, r, w, b: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)
    if op == "layer":
        return lambda x, r, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-6)
    return None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _outputs(res: Any) -> list[Tensor]:
    return list(res) if isinstance(res, tuple) else [res]


def _make_call(fn: Fn, mode: str, x: Tensor, r: Tensor, w: Tensor, b: Tensor) -> Callable[[], Any]:
    """The timed call of ``fn`` in ``mode``. The upstream gradients (ones) are made once, outside it: in training
    they arrive from the layer above, so their allocation and fill are not the norm's cost (timed inside, they took
    a third of RMSNorm's backward at 256 x 4096 fp32)."""
    if mode == "fwd":
        return lambda: fn(x, r, w, b)
    leaves = [t.detach().requires_grad_(True) for t in (x, r, w, b)]
    probe = _outputs(fn(*leaves))
    gys = [torch.ones_like(o) for o in probe]

    def grads(outs: list[Tensor]) -> Any:
        return torch.autograd.grad(outs, leaves, gys, retain_graph=mode == "bwd", allow_unused=True)

    if mode == "fwdbwd":
        del probe  # its graph is never run backward; each timed call builds its own
        return lambda: grads(_outputs(fn(*leaves)))
    return lambda: grads(probe)


def _bytes(op: str, mode: str, numel: int, itemsize: int) -> int:
    add = op.startswith("add")
    fwd = (4 if add else 2) * numel * itemsize  # read x (and r); write y (and h)
    bwd = (4 if add else 3) * numel * itemsize  # read x, dy (and dh); write dx
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode]


def bench_bytes(shape: tuple[int, int], dtype: torch.dtype, modes: list[str], providers: int) -> int:
    """About the peak memory of timing one (shape, dtype): the float32 draw, x, r and the copy baseline; the
    outputs, saved tensors and upstream gradients each backward provider keeps between rounds; one call's own."""
    n, size = shape[0] * shape[1], torch.empty((), dtype=dtype).element_size()
    kept = 5 * n * size * providers if any(m != "fwd" for m in modes) else 0
    return 4 * n + 3 * n * size + kept + 4 * n * size


def check_bench_memory(
    shapes: list[tuple[int, int]], dtypes: list[torch.dtype], modes: list[str], providers: int, device: str = "cpu"
) -> None:
    """A ValueError of one line naming the first shape whose benchmark needs more memory than is available."""
    for shape in shapes:
        for dtype in dtypes:
            what = f"shape={shape[0]}x{shape[1]} in {str(dtype).removeprefix('torch.')} with {providers} provider(s)"
            check_memory(bench_bytes(shape, dtype, modes, providers), what, device)


def reuse_freed_memory() -> str:
    """Keep freed blocks of any size in the heap (glibc ``mallopt``): no page faults on reused outputs.

    The steady state of a loop that reuses its buffers; without it, glibc hands large freed blocks back to the
    system and a later output arrives as freshly faulted pages. Returns a description of the regime for the
    benchmark's header.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return "default (no libc found)"
    libc = ctypes.CDLL(name)
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = libc.mallopt(m_mmap_threshold, 1 << 30) == 1 and libc.mallopt(m_trim_threshold, 1 << 31) == 1
    return "reuse (mallopt: mmap threshold 1 GiB, trim threshold 2 GiB)" if ok else "default (mallopt refused)"


def run_bench(
    op: str,
    shapes: list[tuple[int, int]],
    dtypes: list[torch.dtype],
    modes: list[str],
    *,
    providers: list[str] | None = None,
    repeats: int = 15,
    min_time: float = 0.0,
    device: str = "cpu",
    warm: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Time every provider for each (shape, dtype, mode); one row per provider.

    At least ``repeats`` interleaved rounds, more (up to 10x) until ``min_time`` seconds have
    passed, so fast cache-resident cases get many samples for their median. ``warm``: each timed call
    follows an untimed one of the same provider (see the module docstring); rows say which in ``state``.
    """
    bad = [s for s in shapes if len(s) != 2 or min(s) < 1]
    if bad:
        raise ValueError(f"shapes={bad} must be (rows, hidden) pairs with rows >= 1 and hidden >= 1")
    rows: list[dict[str, Any]] = []
    all_fns = _providers(op, device)
    names = [p for p in (providers or list(all_fns)) if p in all_fns]
    check_bench_memory(shapes, dtypes, modes, len(names), device)
    for shape in shapes:
        for dtype in dtypes:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
            r = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
            w = (torch.rand(shape[-1], generator=gen) + 0.5).to(device=device, dtype=dtype)
            b = torch.randn(shape[-1], generator=gen).to(device=device, dtype=dtype)
            for mode in modes:
                if progress:
                    progress(f"{op} {mode} {tuple(shape)} {dtype}")
                first: dict[str, float] = {}
                calls: dict[str, Callable[[], Any]] = {"copy": x.clone}
                here = [n for n in names if mode == "fwd" or n not in FWD_ONLY]
                for name in here:
                    t0 = time.perf_counter()
                    call = _make_call(all_fns[name], mode, x, r, w, b)
                    call()
                    _sync(device)
                    first[name] = time.perf_counter() - t0
                    calls[name] = call
                times: dict[str, list[float]] = {k: [] for k in calls}
                t_start, rounds = time.perf_counter(), 0
                order = list(calls.items())
                shuffle = random.Random(0).shuffle
                while rounds < repeats or (time.perf_counter() - t_start < min_time and rounds < 10 * repeats):
                    # a fresh (seeded) order every round, so no provider keeps inheriting the cache and allocator
                    # state of one neighbour (a rotated fixed order would: each keeps the same predecessor)
                    shuffle(order)
                    rounds += 1
                    for name, call in order:
                        if warm:
                            call()
                        _sync(device)
                        t0 = time.perf_counter()
                        call()
                        _sync(device)
                        times[name].append(time.perf_counter() - t0)
                med = {k: statistics.median(v) for k, v in times.items()}
                numel, itemsize = x.numel(), x.element_size()
                moved = _bytes(op, mode, numel, itemsize)
                copy_per_byte = med["copy"] / (2 * numel * itemsize)
                for name in here:
                    rows.append({
                        "op": op, "mode": mode, "shape": "x".join(map(str, shape)),
                        "dtype": str(dtype).removeprefix("torch."), "provider": name,
                        "ms": round(med[name] * 1e3, 4), "min_ms": round(min(times[name]) * 1e3, 4),
                        "GB/s": round(moved / med[name] / 1e9, 2),
                        "copy_ms": round(med["copy"] * 1e3, 4), "copy_min_ms": round(min(times["copy"]) * 1e3, 4),
                        "vs_copy": round(med[name] / (copy_per_byte * moved), 3),
                        "vs_ours": round(med[name] / med["ours"], 3) if "ours" in med else "",
                        "first_call_s": round(first[name], 3), "rounds": rounds,
                        "state": "warm" if warm else "shared",
                    })  # fmt: skip
    return rows
