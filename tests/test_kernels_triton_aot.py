"""The Triton kernels compiled for a real GPU target (sm_90) without a GPU: they compile, keep to registers, and read
and write rows in 128-bit vectors, with enough warps resident per SM to keep memory busy.

The interpreter tests (test_kernels_triton.py) check the arithmetic; they run the kernels as numpy and cannot see
any of this. The compile runs in a subprocess because this process may have imported triton under
``TRITON_INTERPRET=1`` (test_kernels_triton.py sets it), which turns every kernel into an interpreted function.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# (rows, n, dtype, case index): QK-norm's head dims; hidden 4096 / 8192 (one block both ways); 64 KiB rows (one
# forward block of 32 warps, the backward in column tiles); 262,144 (chunks); RMSNorm, LayerNorm + add + bias, Llama
CONFIGS = [
    (65536, 64, "bfloat16", 0),
    (32768, 128, "float16", 1),
    (4096, 4096, "bfloat16", 0),
    (4096, 4096, "float32", 1),
    (2048, 8192, "bfloat16", 1),
    (512, 32768, "bfloat16", 1),
    (1024, 16384, "float32", 2),
    (256, 262144, "bfloat16", 0),
]

_SCRIPT = """
import json, sys, torch
from normatlas.kernels import triton_aot, triton_kernels
out = []
for rows, n, dtype, case in json.loads(sys.argv[1]):
    for b in triton_aot.compile_norm(rows, n, getattr(torch, dtype), triton_kernels.CASES[case], "sm_90"):
        out.append(b.row())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def builds() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(CONFIGS)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_launch_compiles_for_sm90_without_spills(builds: list[dict]) -> None:
    kinds = {(b["rows"], b["n"], b["dtype"], b["op"]) for b in builds}
    assert {(r, n, d, op) for r, n, d, _ in CONFIGS for op in ("fwd", "bwd")} <= kinds
    assert [b for b in builds if b["local_bytes"]] == []
    assert {b["kernel"] for b in builds} == {"_fwd_kernel", "_bwd_kernel", "_bwd_rowdot_kernel"}


def test_rows_move_in_128_bit_vectors(builds: list[dict]) -> None:
    """Rows whose width is a multiple of 16 start 16-byte aligned, and Triton is told so (its divisibility
    specialisation): every kernel reading or writing row data does it with 128-bit loads / stores, and none with
    loads narrower than 32 bits (which would be a half-precision element at a time)."""
    for b in builds:
        loads = [int(w) for w in b["loads"].split("/")]
        stores = [int(w) for w in b["stores"].split("/")]
        assert 128 in loads and min(loads) >= 32, b
        if b["kernel"] != "_bwd_rowdot_kernel":  # it writes two fp32 scalars per row, no row data
            assert 128 in stores and min(stores) >= 32, b


def test_enough_warps_stay_resident(builds: list[dict]) -> None:
    """A memory-bound kernel needs many loads in flight: at least 16 of an SM's 64 warp slots hold this launch's
    warps, and the grid gives every SM work; the backward's persistent grid is one wave (its programs walk the
    rows; a second wave would leave most SMs idle while it ran)."""
    for b in builds:
        assert b["resident_warps"] >= 16, b
        assert b["programs"] >= 132, b
        if b["kernel"] == "_bwd_kernel":
            assert b["waves"] <= 1.0, b


def test_wide_rows_stay_in_one_block_up_to_the_spill_limit(builds: list[dict]) -> None:
    """The forward keeps rows of up to 64 KiB in registers (one read of x), the backward up to 8192 features."""
    by = {(b["n"], b["op"], b["kernel"]): b for b in builds}
    assert by[(32768, "fwd", "_fwd_kernel")]["block"] == 32768
    assert by[(16384, "fwd", "_fwd_kernel")]["block"] == 16384
    assert (32768, "bwd", "_bwd_rowdot_kernel") in by
    assert by[(8192, "bwd", "_bwd_kernel")]["block"] == 8192
    assert by[(262144, "fwd", "_fwd_kernel")]["block"] == 8192
