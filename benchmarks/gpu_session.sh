#!/usr/bin/env bash
# The whole GPU check of issue 8 as one device run (at most 100 + 150 + 330 s of steps, under 10 minutes of a
# 15-minute lease; with the kernels compiled ahead, the tests should take well under a minute).
#
#   device run: bash benchmarks/gpu_session.sh          (carry: [".whl"] to include Liger-Kernel)
#
# Steps, each logged under $OUT (results/ when unset): the GPU and library versions; the kernels the next steps
# launch, compiled in parallel (benchmarks/gpu_warm.py); the Triton tests on CUDA (tests/test_kernels_triton.py, the
# int64 test over 2^31 elements included); then benchmarks/gpu_bench.py, whose own correctness step runs before its
# timings. Wheels in .whl/ (e.g. liger_kernel, fetched on a machine with
# PyPI by `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .whl liger-kernel`)
# are installed to /tmp/site first; the package itself runs from src/ (nothing to install).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import liger_kernel; print('liger_kernel', getattr(liger_kernel, '__version__', 'present'))" \
    2>/dev/null || echo "liger_kernel: not installed (carry .whl to include it)"
} 2>&1 | tee "$OUT/gpu_env.txt"
status=0
# the ~600 kernels the next two steps launch, compiled on every CPU at once into Triton's cache (a launch compiles
# one at a time otherwise, ~0.5 s each); what it misses compiles at launch as before, so a failure here is logged only
timeout 100 python3 benchmarks/gpu_warm.py 2>&1 | tee "$OUT/gpu_warm.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py 2>&1 | tee "$OUT/triton_tests.log" \
  || status=1
timeout 330 python3 benchmarks/gpu_bench.py 2>&1 | tee "$OUT/gpu_bench.log" || status=1
exit $status
