"""Triton kernels for the fused norm on CUDA (tested on CPU under ``TRITON_INTERPRET=1``; compiled for sm_80 / sm_90
without a GPU by :mod:`normatlas.kernels.triton_aot`).

Forward: each program normalizes ``ROWS`` rows (up to 16 short rows such as QK-norm's head dim); a row of up to 64
KiB (32,768 half-precision or 16,384 fp32 features) stays in registers between the statistics and the output (32
warps above 8192 features), a longer one (hidden sizes up to 262,144 and beyond) is streamed in chunks, twice
(statistics, output; LayerNorm merges each chunk's mean and centred sum of squares, Chan et al.). Statistics are fp32
and every row offset is int64, so tensors over 2^31 elements index correctly. Backward: rows of up to 8192 features
in tiles as the forward's (several short rows per tile), one pass over x and dy computing dx; a grid of one wave (as
many programs as the SMs hold at once, from the compiled kernel's registers and shared memory), each walking
consecutive tiles through a software pipeline (``tl.range(num_stages=...)``: loads of the next tiles in flight into
shared memory) and accumulating its gain / bias gradients in fp32 registers, written once as a partial row. Wider
rows take two kernels: one program per row computes the row's two backward scalars, then (column block x program)
tiles write dx and the partial rows. The partial rows are capped near 1/16 of the tensors' traffic; a final sum over
them gives dgain and dbias; no atomics. Weights and biases are read in their own dtype inside the kernels (``1 + w``
too), so a call launches no conversion kernel besides the norm, and the partial rows need no memset (every program
writes its whole row). The arithmetic is the eager reference's (:func:`normatlas.kernels.ops.eager_fwd` /
``eager_bwd``). Not yet measured on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Protocol

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised where triton is absent
    HAS_TRITON = False

__all__ = ["CASES", "available", "interpreted", "norm_bwd", "norm_fwd"]

# The widest rows kept in registers in one block. Forward: rows of up to 64 KiB (32,768 half-precision or 16,384
# fp32 features), the widest that ptxas fits in a 32-warp block's registers without spilling for every case
# (`python -m normatlas.kernels.triton_aot`: 32,768 fp32 features spill in Llama's order with a residual, 65,536
# half-precision ones 160-300 bytes a thread). Backward: 8192 features (at 16,384 it spills 70-210 bytes a thread).
# Wider rows stream in chunks of MAX_FUSED.
MAX_FUSED_FWD_BYTES = 64 * 1024
MAX_FUSED = 8192

# The flag combinations the kernels are checked on against the eager reference, by the test suite (interpreter)
# and by benchmarks/gpu_bench.py (GPU): (center, eps_mode, before_gain, one_plus_w, l2, residual, bias).
# RMSNorm; LayerNorm + add + bias; Llama cast order + (1 + w) + add, eps outside the root; clamp eps; L2.
CASES: tuple[tuple[bool, int, bool, bool, bool, bool, bool], ...] = (
    (False, 0, False, False, False, False, False),
    (True, 0, False, False, False, True, True),
    (False, 1, True, True, False, True, False),
    (True, 2, False, False, False, False, True),
    (False, 0, False, False, True, False, False),
)


def interpreted() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return HAS_TRITON and type(globals().get("_fwd_kernel")).__name__ == "InterpretedFunction"


@functools.cache
def available() -> bool:
    """True when Triton can run the kernels on a CUDA device here."""
    return HAS_TRITON and torch.cuda.is_available()


def _blocks(n: int, widest: int) -> tuple[int, int, bool]:
    """(columns per block, rows per block, whether a row fits one block): rows up to ``widest`` in one block, several
    short rows per block (up to 16, 4096 elements); wider rows in chunks of MAX_FUSED."""
    block = triton.next_power_of_2(max(n, 1))
    if block > widest:
        return MAX_FUSED, 1, False
    return block, max(1, min(16, 4096 // block)), True


if HAS_TRITON:

    @triton.jit
    def _rstd(ms, eps, EPS_MODE: tl.constexpr):
        if EPS_MODE == 0:
            r = 1.0 / tl.sqrt(ms + eps)
            d = -0.5 * r * r * r
        elif EPS_MODE == 1:
            s = tl.sqrt(ms)
            r = 1.0 / (s + eps)
            d = tl.where(s > 0, -0.5 * r * r / tl.where(s > 0, s, 1.0), 0.0)
        else:
            s = tl.sqrt(ms)
            r = 1.0 / tl.maximum(s, eps)
            safe = tl.where(s > 0, s, 1.0)
            d = tl.where((s >= eps) & (s > 0), -0.5 / (safe * safe * safe), 0.0)
        return r, d

    @triton.jit
    def _gain_at(G, c, cmask, HAS_G: tl.constexpr, ONE_PLUS_W: tl.constexpr, BEFORE: tl.constexpr):
        """The fp32 multiplier of columns ``c``, read in the weight's own dtype (no conversion kernel per call): 1
        without a weight; ``1 + w`` with ONE_PLUS_W, rounded to the weight's dtype first in Llama's order (as the
        eager reference's ``(1 + w).to(float32)``)."""
        if HAS_G:
            g = tl.load(G + c, mask=cmask, other=0.0).to(tl.float32)
            if ONE_PLUS_W:
                g = 1.0 + g
                if BEFORE:
                    g = g.to(G.dtype.element_ty).to(tl.float32)
        else:
            g = tl.zeros_like(c).to(tl.float32) + 1.0
        return g

    @triton.jit
    def _affine(xh, x, G, B, c, cmask, BEFORE: tl.constexpr, HAS_B: tl.constexpr, HAS_G: tl.constexpr,
                ONE_PLUS_W: tl.constexpr):  # fmt: skip
        """Gain and bias on the fp32 x_hat of columns ``c``; ``BEFORE``: Llama's order, x_hat rounded to x's dtype."""
        g = _gain_at(G, c, cmask, HAS_G, ONE_PLUS_W, BEFORE)
        if BEFORE:
            y = (xh.to(x.dtype).to(tl.float32) * g[None, :]).to(x.dtype)
            if HAS_B:
                b = tl.load(B + c, mask=cmask, other=0.0).to(tl.float32)
                y = (y.to(tl.float32) + b[None, :]).to(x.dtype)
        else:
            y = xh * g[None, :]
            if HAS_B:
                y = y + tl.load(B + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
        return y

    @triton.jit
    def _fwd_kernel(X, RES, H, Y, G, B, STATS, rows, n, div, eps,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr, SINGLE: tl.constexpr, CENTER: tl.constexpr,
                    EPS_MODE: tl.constexpr, BEFORE: tl.constexpr, HAS_RES: tl.constexpr,
                    HAS_B: tl.constexpr, HAS_G: tl.constexpr, ONE_PLUS_W: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0).to(tl.int64)
        row = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
        rmask = row < rows
        base = row[:, None] * n
        cols = tl.arange(0, BLOCK)
        if SINGLE:
            cmask = cols < n
            m = rmask[:, None] & cmask[None, :]
            x = tl.load(X + base + cols[None, :], mask=m, other=0.0)
            if HAS_RES:
                r_ = tl.load(RES + base + cols[None, :], mask=m, other=0.0)
                x = (x.to(tl.float32) + r_.to(tl.float32)).to(X.dtype.element_ty)  # torch's add: fp32, rounded
                tl.store(H + base + cols[None, :], x, mask=m)
            xf = x.to(tl.float32)
            mean = tl.sum(xf, axis=1) / n if CENTER else tl.zeros([ROWS], dtype=tl.float32)
            xc = tl.where(m, xf - mean[:, None], 0.0)
            r, d = _rstd(tl.sum(xc * xc, axis=1) / div, eps, EPS_MODE)
            y = _affine(xc * r[:, None], x, G, B, cols, cmask, BEFORE, HAS_B, HAS_G, ONE_PLUS_W)
            tl.store(Y + base + cols[None, :], y.to(Y.dtype.element_ty), mask=m)
        else:  # ROWS == 1: stream the row in chunks, twice (statistics, output)
            src = H if HAS_RES else X
            acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)  # RMS: the squares' lane sums
            mean = tl.zeros([ROWS], dtype=tl.float32)  # LayerNorm: the running mean and centred sum of squares,
            m2 = tl.zeros([ROWS], dtype=tl.float32)  # each chunk's own (two-pass in registers) merged in (Chan et al.)
            for off in range(0, n, BLOCK):
                c = off + cols
                m = rmask[:, None] & (c < n)[None, :]
                x = tl.load(X + base + c[None, :], mask=m, other=0.0)
                if HAS_RES:
                    r_ = tl.load(RES + base + c[None, :], mask=m, other=0.0)
                    x = (x.to(tl.float32) + r_.to(tl.float32)).to(X.dtype.element_ty)
                    tl.store(H + base + c[None, :], x, mask=m)
                xf = x.to(tl.float32)
                if CENTER:
                    seen = off * 1.0  # (an int under the interpreter, a scalar tensor compiled)
                    k = tl.minimum(n - off, BLOCK) * 1.0
                    cmean = tl.sum(xf, axis=1) / k
                    dc = tl.where(m, xf - cmean[:, None], 0.0)
                    delta = cmean - mean
                    mean += delta * (k / (seen + k))
                    m2 += tl.sum(dc * dc, axis=1) + delta * delta * (seen * k / (seen + k))
                else:
                    acc += xf * xf
            ss = m2 if CENTER else tl.sum(acc, axis=1)
            r, d = _rstd(ss / div, eps, EPS_MODE)
            for off in range(0, n, BLOCK):
                c = off + cols
                cmask = c < n
                m = rmask[:, None] & cmask[None, :]
                x = tl.load(src + base + c[None, :], mask=m, other=0.0)
                xh = (x.to(tl.float32) - mean[:, None]) * r[:, None]
                y = _affine(xh, x, G, B, c, cmask, BEFORE, HAS_B, HAS_G, ONE_PLUS_W)
                tl.store(Y + base + c[None, :], y.to(Y.dtype.element_ty), mask=m)
        tl.store(STATS + row * 3, mean, mask=rmask)
        tl.store(STATS + row * 3 + 1, r, mask=rmask)
        tl.store(STATS + row * 3 + 2, d, mask=rmask)

    @triton.jit(do_not_specialize=["per_prog"])
    def _bwd_kernel(DY, X, DRES, DX, G, STATS, ROWK, PG, PB, rows, n, div, per_prog,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr, G_ONCE: tl.constexpr,
                    WIDE: tl.constexpr, CENTER: tl.constexpr, BEFORE: tl.constexpr, HAS_DRES: tl.constexpr,
                    NEED_DG: tl.constexpr, NEED_DB: tl.constexpr, HAS_G: tl.constexpr,
                    ONE_PLUS_W: tl.constexpr):  # fmt: skip
        """dx for ``per_prog`` consecutive tiles of ``ROWS`` rows, and the program's partial row of dgain / dbias.

        ``WIDE=False`` (rows that fit one block): a 1-D grid of programs, each tile ``ROWS x BLOCK`` (several short
        rows at once, as the forward), each row's two backward scalars from the same pass over x and dy. ``WIDE=True``
        (step 2 of wide rows): a (column block, program) grid of one-row tiles; the scalars were written to ``ROWK`` by
        :func:`_bwd_rowdot_kernel`. The tile loop is software-pipelined (``STAGES`` tiles of x and dy in flight through
        shared memory); the partial sums stay in fp32 registers until the program's one write. ``G_ONCE``: the gain is
        read once per program into registers, else once per tile (from cache), which keeps 8192-wide fp32 tiles out of
        local memory.
        """
        if WIDE:
            prog = tl.program_id(1).to(tl.int64)
            cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        else:
            prog = tl.program_id(0).to(tl.int64)
            cols = tl.arange(0, BLOCK)
        cm = cols < n
        if G_ONCE:
            g = _gain_at(G, cols, cm, HAS_G, ONE_PLUS_W, BEFORE)
        pg = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        pb = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        first = prog * per_prog
        last = tl.minimum(first + per_prog, tl.cdiv(rows, ROWS))
        for t in tl.range(first, last, num_stages=STAGES):
            row = t * ROWS + tl.arange(0, ROWS).to(tl.int64)
            rm = row < rows
            m = rm[:, None] & cm[None, :]
            at = row[:, None] * n + cols[None, :]
            mean = tl.load(STATS + row * 3, mask=rm, other=0.0)
            r = tl.load(STATS + row * 3 + 1, mask=rm, other=0.0)
            x = tl.load(X + at, mask=m, other=0.0)
            xc = tl.where(m, x.to(tl.float32) - mean[:, None], 0.0)
            dy = tl.load(DY + at, mask=m, other=0.0).to(tl.float32)
            if not G_ONCE:
                g = _gain_at(G, cols, cm, HAS_G, ONE_PLUS_W, BEFORE)
            dxh = dy * g[None, :]
            if WIDE:
                k = tl.load(ROWK + row * 2, mask=rm, other=0.0)
                off = tl.load(ROWK + row * 2 + 1, mask=rm, other=0.0)
            else:
                d = tl.load(STATS + row * 3 + 2, mask=rm, other=0.0)
                k = d * 2.0 / div * tl.sum(dxh * xc, axis=1)
                if CENTER:
                    off = (r * tl.sum(dxh, axis=1) + k * tl.sum(xc, axis=1)) / n
                else:
                    off = tl.zeros([ROWS], dtype=tl.float32)
            dx = r[:, None] * dxh + k[:, None] * xc - off[:, None]
            if HAS_DRES:
                dx += tl.load(DRES + at, mask=m, other=0.0).to(tl.float32)
            tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=m)
            if NEED_DG:
                xh = xc * r[:, None]
                if BEFORE:
                    xh = xh.to(x.dtype).to(tl.float32)
                pg += dy * xh
            if NEED_DB:
                pb += dy
        if NEED_DG:
            tl.store(PG + prog * n + cols, tl.sum(pg, axis=0), mask=cm)
        if NEED_DB:
            tl.store(PB + prog * n + cols, tl.sum(pb, axis=0), mask=cm)

    @triton.jit
    def _bwd_rowdot_kernel(DY, X, G, STATS, ROWK, n, div, BLOCK: tl.constexpr, CENTER: tl.constexpr,
                           BEFORE: tl.constexpr, HAS_G: tl.constexpr, ONE_PLUS_W: tl.constexpr):  # fmt: skip
        """Wide rows, step 1: one program per row streams x and dy once for the row's two backward scalars."""
        row = tl.program_id(0).to(tl.int64)
        base = row * n
        cols = tl.arange(0, BLOCK)
        mean = tl.load(STATS + row * 3)
        r = tl.load(STATS + row * 3 + 1)
        d = tl.load(STATS + row * 3 + 2)
        s1 = tl.zeros([BLOCK], dtype=tl.float32)
        s2 = tl.zeros([BLOCK], dtype=tl.float32)
        s3 = tl.zeros([BLOCK], dtype=tl.float32)
        for o in range(0, n, BLOCK):
            c = o + cols
            cm = c < n
            xc = tl.where(cm, tl.load(X + base + c, mask=cm, other=0.0).to(tl.float32) - mean, 0.0)
            dxh = tl.load(DY + base + c, mask=cm, other=0.0).to(tl.float32) * _gain_at(G, c, cm, HAS_G, ONE_PLUS_W,
                                                                                          BEFORE)  # fmt: skip
            s1 += dxh
            s2 += dxh * xc
            s3 += xc
        k = d * 2.0 / div * tl.sum(s2, axis=0)
        off = (r * tl.sum(s1, axis=0) + k * tl.sum(s3, axis=0)) / n if CENTER else 0.0
        tl.store(ROWK + row * 2, k)
        tl.store(ROWK + row * 2 + 1, off)


def occupancy(
    warps: int,
    registers: int,
    shared: int,
    *,
    sm_registers: int = 65536,
    sm_warps: int = 64,
    sm_blocks: int = 32,
    sm_shared: int = 228 * 1024,
    reg_unit: int = 256,
    block_shared: int = 1024,
) -> int:
    """Blocks of ``warps`` warps, ``registers`` per thread and ``shared`` bytes of shared memory one SM holds at once
    (registers allocated per warp in units of ``reg_unit``; ``block_shared``: what the hardware reserves per block)."""
    per_warp = -(-max(registers, 1) * 32 // reg_unit) * reg_unit
    by_regs = sm_registers // (per_warp * warps)
    return max(0, min(sm_blocks, by_regs, sm_warps // warps, sm_shared // (shared + block_shared)))


class Launcher(Protocol):
    """What :func:`norm_fwd` / :func:`norm_bwd` launch through: :class:`Device` runs the kernels;
    :mod:`normatlas.kernels.triton_aot` compiles each launch for a GPU target without a GPU instead (the same
    kernels, arguments and constexprs)."""

    def __call__(self, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None: ...

    def blocks_per_sm(self, kernel: Any, *args: Any, **kwargs: Any) -> int:
        """How many programs of this launch one SM keeps resident (its compiled registers and shared memory)."""
        ...


class Device:
    """Launches on the current CUDA device (or runs under the interpreter)."""

    def __init__(self) -> None:
        self._resident: dict[Any, int] = {}

    def __call__(self, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        kernel[grid](*args, **kwargs)

    def blocks_per_sm(self, kernel: Any, *args: Any, **kwargs: Any) -> int:
        if interpreted():
            return 2
        dev = torch.cuda.current_device()
        key = (kernel.__name__, dev, tuple(sorted(kwargs.items())), tuple(_spec_key(a) for a in args))
        got = self._resident.get(key)
        if got is None:
            try:  # compiles (or finds) the very kernel the launch runs; n_regs is set once it is loaded
                compiled = kernel.warmup(*args, grid=(1,), **kwargs)
                compiled._init_handles()
                regs, shared = int(compiled.n_regs), int(compiled.metadata.shared)
            except (AttributeError, TypeError) as exc:  # a Triton without these (private) attributes: one per SM
                warnings.warn(f"normatlas: could not read the compiled kernel's registers ({exc}); the backward's "
                              "grid falls back to one program per SM", RuntimeWarning, stacklevel=3)  # fmt: skip
                self._resident[key] = 1
                return 1
            props = torch.cuda.get_device_properties(dev)
            got = max(1, occupancy(
                int(kwargs.get("num_warps", 4)), regs, shared,
                sm_registers=int(getattr(props, "regs_per_multiprocessor", 65536)),
                sm_warps=int(getattr(props, "max_threads_per_multi_processor", 2048)) // 32,
                sm_shared=int(getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)),
            ))  # fmt: skip
            self._resident[key] = got
        return got


DEVICE = Device()


def _spec_key(a: Any) -> Any:
    """What Triton's specialisation sees of an argument: a tensor's dtype and 16-byte alignment, an int's value
    class (1, a multiple of 16, beyond 32 bits)."""
    if isinstance(a, Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, int) and not isinstance(a, bool):
        return int, a == 1, a % 16 == 0, abs(a) >= 2**31
    return type(a)


def _param(t: Tensor | None, like: Tensor) -> Tensor:
    """A weight or bias as the kernels read it: flat and contiguous in its own dtype (``like`` stands in for none)."""
    return t.reshape(-1).contiguous() if t is not None else like


def norm_fwd(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, bias: Tensor | None, eps: float,
    center: bool, eps_mode: int, before_gain: bool, one_plus_w: bool, l2: bool, *, launch: Launcher = DEVICE,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The forward of ``normatlas::fused_norm_fwd`` on Triton (float32 statistics, int64 offsets)."""
    if x.dtype == torch.float64:
        raise TypeError("the Triton kernels take float32 / float16 / bfloat16 inputs, got float64")
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    rows = x2.shape[0]
    y = torch.empty_like(x2)
    res = residual.reshape(-1, n).contiguous() if residual is not None else None
    h = torch.empty_like(x2) if res is not None else x.new_empty(0)
    stats = torch.empty((rows, 3), dtype=torch.float32, device=x.device)
    g, b = _param(weight, x2), _param(bias, x2)
    if rows:
        block, rpp, single = _blocks(n, MAX_FUSED_FWD_BYTES // x.element_size())
        grid = (triton.cdiv(rows, rpp),)
        launch(
            _fwd_kernel, grid, x2, res if res is not None else x2, h if res is not None else x2, y, g, b, stats, rows,
            n, 1.0 if l2 else float(n), float(eps), BLOCK=block, ROWS=rpp, SINGLE=single, CENTER=center,
            EPS_MODE=eps_mode, BEFORE=before_gain, HAS_RES=res is not None, HAS_B=bias is not None,
            HAS_G=weight is not None, ONE_PLUS_W=one_plus_w, num_warps=_warps(block * rpp),
        )  # fmt: skip
    return y.reshape(x.shape), (h.reshape(x.shape) if res is not None else h), stats


def norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor | None, stats: Tensor, dres: Tensor | None,
    center: bool, before_gain: bool, one_plus_w: bool, l2: bool, need_dg: bool, need_db: bool, *,
    launch: Launcher = DEVICE, sm_count: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The backward of ``normatlas::fused_norm_bwd`` on Triton: dx plus per-program dgain/dbias partials.

    ``sm_count`` (default: the device's; 4 under the interpreter) sizes the grid (:func:`_bwd_plan`).
    """
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    dy2 = dy.reshape(-1, n).contiguous()
    dr = dres.reshape(-1, n).contiguous() if dres is not None else None
    rows = x2.shape[0]
    dx = torch.empty_like(x2)
    g = _param(weight, x2)
    div = 1.0 if l2 else float(n)
    gain = {"BEFORE": before_gain, "HAS_G": weight is not None, "ONE_PLUS_W": one_plus_w}
    flags = {**gain, "HAS_DRES": dr is not None, "NEED_DG": need_dg, "NEED_DB": need_db}
    sms = sm_count if sm_count is not None else _sm_count(x.device)
    plan = _bwd_plan(n, rows, x.element_size(), dr is not None, int(need_dg) + int(need_db))
    pg = pb = torch.empty((1, 1), dtype=torch.float32, device=x.device)  # stand-ins where not needed
    if rows:
        consts = {"BLOCK": plan.block, "ROWS": plan.rows, "STAGES": plan.stages, "G_ONCE": plan.gain_once,
                  "WIDE": plan.wide, "CENTER": center, **flags, "num_warps": plan.warps}  # fmt: skip
        rowk = torch.empty((rows, 2), dtype=torch.float32, device=x.device) if plan.wide else stats
        head = (dy2, x2, dr if dr is not None else dy2, dx, g, stats, rowk)
        programs = plan.programs(sms, launch.blocks_per_sm(_bwd_kernel, *head, stats, stats, rows, n, div, 1,
                                                           **consts))  # fmt: skip
        # every program writes its whole partial row (zeros when it has no rows), so no memset is needed
        if need_dg:
            pg = torch.empty((programs, n), dtype=torch.float32, device=x.device)
        if need_db:
            pb = torch.empty((programs, n), dtype=torch.float32, device=x.device)
        if plan.wide:
            launch(_bwd_rowdot_kernel, (rows,), dy2, x2, g, stats, rowk, n, div, BLOCK=MAX_FUSED, CENTER=center,
                   **gain, num_warps=16)  # fmt: skip
        grid = (plan.columns, programs) if plan.wide else (programs,)
        launch(_bwd_kernel, grid, *head, pg, pb, rows, n, div, triton.cdiv(plan.tiles, programs), **consts)
    elif need_dg or need_db:
        pg, pb = torch.zeros((1, n), device=x.device), torch.zeros((1, n), device=x.device)
    dg = pg.sum(0) if need_dg else pg.new_empty(0)
    db = pb.sum(0) if need_db else pb.new_empty(0)
    return dx.reshape(x.shape), dg, db


@dataclasses.dataclass(frozen=True)
class _BwdPlan:
    """How the backward tiles its rows (:func:`_bwd_plan`)."""

    wide: bool  # rows wider than one block: per-row scalars first, then (column block x program) tiles
    block: int  # columns per tile
    rows: int  # rows per tile
    warps: int
    stages: int  # tiles in flight per program (software pipelining through shared memory)
    tiles: int  # tiles down the rows (per column block)
    columns: int  # column blocks (1 but for wide rows)
    cap: int  # programs (per column block) whose partial rows stay within 1/16 of the tensors' traffic

    @property
    def gain_once(self) -> bool:
        """The gain stays in registers for the whole program where a tile is at most 8 elements per thread."""
        return self.block * self.rows <= 8 * 32 * self.warps

    def programs(self, sms: int, resident: int) -> int:
        """Programs per column block: one wave (``resident`` programs on each of ``sms`` SMs, all at once, each
        walking its share of the tiles), fewer where the partial rows would pass ``cap``, never under one per SM."""
        slots = max(1, sms * resident // self.columns)
        return max(1, min(self.tiles, slots, max(self.cap, sms // self.columns)))


def _bwd_plan(n: int, rows: int, esize: int, has_dres: bool, partials: int) -> _BwdPlan:
    """Tiles as the forward's (up to 16 short rows, 4096 elements); rows wider than a block in 2048-column tiles.

    The grid (:meth:`_BwdPlan.programs`) fills the device once, each program's partial gain / bias rows (fp32,
    written once and read once by the final sum) kept under 1/16 of the tensors' own traffic where the rows allow.
    Pipeline depth: three tiles where their x, dy (and the residual's gradient) take at most 48 KiB of shared memory,
    two where 96 KiB, else none.
    """
    block, rows_per_tile, single = _blocks(n, MAX_FUSED)
    wide = not single
    if wide:
        block, rows_per_tile = 2048, 1
    tiles = triton.cdiv(rows, rows_per_tile) if rows else 0
    traffic = rows * n * esize * (4 if has_dres else 3)
    cap = traffic // (16 * 8 * n * max(partials, 1))  # 8 bytes per partial element: fp32, written and read
    stage = block * rows_per_tile * esize * (3 if has_dres else 2)
    stages = 3 if 3 * stage <= 48 * 1024 else 2 if 2 * stage <= 96 * 1024 else 1
    columns = triton.cdiv(n, block) if wide else 1
    return _BwdPlan(wide, block, rows_per_tile, _warps(block * rows_per_tile), stages, tiles, columns, cap)


def _warps(elements: int) -> int:
    """Warps per block: 8 elements a thread up to 16 warps (4096 elements); 8192-element blocks take 16 warps, wider
    ones (single-block forward rows of 16,384 and 32,768) 32, so a thread holds at most 32 elements."""
    return 32 if elements > 8192 else max(1, min(16, elements // 256))


def _sm_count(device: Any) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, enough to exercise the partial sums
    return torch.cuda.get_device_properties(device).multi_processor_count
