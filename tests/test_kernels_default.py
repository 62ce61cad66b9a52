"""The kernels are built once and used by default: the build cache, and ``backend=`` on the core's modules.

Each test here failed on the code before the drop-in modules took the fused path (commit 1336658): the cache was
keyed and rebuilt through a build file holding one checkout's absolute paths, the modules called ``F.rms_norm``,
and there was no ``backend=``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import normatlas as na
from normatlas import Backend, NormSpec
from normatlas.kernels import FusedLayerNorm, FusedRMSNorm, api, cpu, dispatch

TOL = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}
ROOT = Path(__file__).resolve().parents[1]

needs_cpp = pytest.mark.skipif(cpu.extension() is None, reason="no C++ toolchain")


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"fused": 0}
    real = api._run

    def run(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["fused"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "_run", run)
    monkeypatch.setattr(dispatch, "_PLANS", {})  # no C++ plan: every fused forward goes through _run
    monkeypatch.setattr(dispatch, "plan", lambda spec, dtype, build=True: None)
    return calls


@needs_cpp
@pytest.mark.parametrize(
    "make",
    [
        lambda: na.RMSNorm(64, eps=1e-6),
        lambda: na.LayerNorm(64),
        lambda: na.GemmaRMSNorm(64),
        lambda: na.Norm(NormSpec(center=False, eps=1e-6), 64),
    ],
    ids=["RMSNorm", "LayerNorm", "GemmaRMSNorm", "Norm"],
)
def test_drop_in_modules_take_the_fused_path_by_default(make, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_calls(monkeypatch)
    m = make()
    assert m.backend is Backend.AUTO
    x = torch.randn(3, 7, 64)
    y = m(x)
    assert calls["fused"] == 1
    ref = make()
    ref.backend = "reference"
    ref.load_state_dict(m.state_dict())
    torch.testing.assert_close(y, ref(x), **TOL[torch.float32])
    assert calls["fused"] == 1  # the reference backend never runs the kernels
    assert "backend=auto: fused (cpp" in repr(m)


@needs_cpp
def test_functional_normalize_takes_the_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_calls(monkeypatch)
    spec = NormSpec(center=False, eps=1e-6)
    x, w = torch.randn(5, 33), torch.rand(33) + 0.5
    y = na.normalize(x, spec, w)
    assert calls["fused"] == 1
    torch.testing.assert_close(y, na.normalize(x, spec, w, backend="reference"), **TOL[torch.float32])
    assert calls["fused"] == 1


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", [na.RMSNorm, na.LayerNorm])
def test_auto_equals_reference_forward_and_backward(cls, dtype: torch.dtype) -> None:
    """The two backends compute one function: forward, input and parameter gradients, odd shapes."""
    gen = torch.Generator().manual_seed(3)
    for shape in [(5, 123, 123), (1, 1, 1023), (0, 7, 123)]:
        n = shape[-1]
        auto, ref = cls(n, eps=1e-5, dtype=dtype), cls(n, eps=1e-5, dtype=dtype, backend="reference")
        with torch.no_grad():
            auto.weight.copy_(torch.rand(n, generator=gen) + 0.5)
        ref.load_state_dict(auto.state_dict())
        x = (torch.randn(shape, generator=gen) * 3 + 1).to(dtype)
        xa, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yr = auto(xa), ref(xr)
        torch.testing.assert_close(ya, yr, **TOL[dtype])
        g = torch.randn(shape, generator=gen).to(dtype)
        ya.backward(g)
        yr.backward(g)
        assert xa.grad is not None and xr.grad is not None
        torch.testing.assert_close(xa.grad, xr.grad, **TOL[dtype])
        if dtype in (torch.float64, torch.float32):  # in half precision the two gain gradients round differently
            torch.testing.assert_close(auto.weight.grad, ref.weight.grad, **TOL[dtype])  # (float64: the test below)


def test_backend_is_validated_by_name() -> None:
    with pytest.raises(ValueError, match=r"backend='fast' is not a valid Backend; allowed: 'auto', 'reference'"):
        na.RMSNorm(8, backend="fast")
    with pytest.raises(TypeError, match="backend=1 must be a Backend"):
        na.LayerNorm(8, backend=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend='fast'"):
        na.normalize(torch.randn(2, 8), NormSpec(), backend="fast")
    with pytest.raises(ValueError, match="backend='fused' cannot run this norm: running statistics"):
        na.InstanceNorm1d(4, track_running_stats=True).backend = "fused"
    with pytest.raises(ValueError, match="backend='fused' cannot run this norm"):
        na.GroupNorm(2, 8).backend = Backend.FUSED
    with pytest.raises(ValueError, match="backend='fused' cannot run a norm with a mask"):
        na.normalize(torch.randn(2, 8), NormSpec(), mask=torch.ones(2, 8, dtype=torch.bool), backend="fused")


def test_masks_and_batch_statistics_stay_on_the_reference_path() -> None:
    x = torch.randn(4, 6, 16)
    mask = torch.rand(4, 6, 16) > 0.3
    auto, ref = na.RMSNorm(16), na.RMSNorm(16, backend="reference")
    torch.testing.assert_close(auto(x, mask), ref(x, mask), rtol=0, atol=0)
    inorm = na.InstanceNorm1d(6, track_running_stats=True)
    assert inorm.backend_in_use() == "auto: reference (running statistics)"


@needs_cpp
def test_fused_aliases_are_the_core_classes() -> None:
    assert issubclass(FusedRMSNorm, na.RMSNorm) and issubclass(FusedLayerNorm, na.LayerNorm)
    assert FusedRMSNorm(8).backend is Backend.FUSED
    peer = torch.nn.LayerNorm(8)
    ours = FusedLayerNorm(8)
    ours.load_state_dict(peer.state_dict())
    x = torch.randn(3, 8)
    torch.testing.assert_close(ours(x), peer(x), **TOL[torch.float32])


@needs_cpp
def test_auto_under_torch_compile_traces_the_reference_path() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    m = na.RMSNorm(32, eps=1e-6)
    fn = torch.compile(m, fullgraph=True, dynamic=True, backend=counter)
    for rows in (3, 7, 11):
        x = torch.randn(rows, 32, requires_grad=True)
        y = fn(x)
        y.sum().backward()
        torch.testing.assert_close(y, F.rms_norm(x, (32,), m.weight, 1e-6), **TOL[torch.float32])
    assert counter.frame_count == 1


# --- the build cache ---------------------------------------------------------------------------------------------

_PROBE = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.perf_counter()
    import torch, normatlas
    m = normatlas.RMSNorm(4096)
    y = m(torch.randn(8, 4096))
    info = normatlas.kernels.build_info()
    print(json.dumps({"seconds": time.perf_counter() - t0, "info": info, "repr": repr(m)}))
    """
)


def _probe(env: dict[str, str], cwd: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=cwd, capture_output=True, text=True, check=True,
                         timeout=600)  # fmt: skip
    return {"stderr": out.stderr, **json.loads(out.stdout.strip().splitlines()[-1])}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NORMATLAS_KERNELS", "NORMATLAS_CACHE")}
    env.update(extra)
    return env


def test_auto_never_compiles_and_says_how_to_build(tmp_path: Path) -> None:
    """An empty cache: the first forward runs the reference path at once and warns how to build, once."""
    got = _probe(_env(NORMATLAS_CACHE=str(tmp_path)), ROOT)
    assert got["info"]["backend"] == "eager"
    assert "normatlas kernels build" in got["info"]["reason"]
    assert got["stderr"].count("normatlas kernels build") == 1, got["stderr"]
    assert "backend=auto: reference (the C++ kernels are not built" in got["repr"]
    assert not list((tmp_path / "kernels").glob("*/*.so"))  # nothing was compiled
    assert got["seconds"] < 30  # (a build takes 30-90 s here; this run must not have started one)


@needs_cpp
def test_a_new_process_loads_the_cached_build_and_says_so() -> None:
    got = _probe(_env(), ROOT)
    info = got["info"]
    assert info["backend"] == "cpp" and info["source"] == "cache", info
    assert info["seconds"] < 1.0 and isinstance(info["build_seconds"], float)
    assert "backend=auto: fused (cpp, from cache)" in got["repr"]
    assert "compil" not in got["stderr"], got["stderr"]


@needs_cpp
def test_the_cache_key_holds_no_checkout_path(tmp_path: Path) -> None:
    """A second checkout of the same sources (another folder, same bytes) finds the same cache entry."""
    import shutil

    copy = tmp_path / "checkout"
    shutil.copytree(ROOT / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    env = _env(PYTHONPATH=str(copy / "src"))
    code = "import normatlas.kernels.cpu as c, json; print(json.dumps([c.__file__, str(c._entry()[1])]))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True, timeout=120)  # fmt: skip
    where, entry = json.loads(out.stdout)
    assert where.startswith(str(copy))
    assert entry == str(cpu._entry()[1])
    got = _probe(env, tmp_path)
    assert got["info"]["source"] == "cache", got


def test_the_key_changes_with_the_sources_and_the_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    base = cpu._key()
    cpu._key.cache_clear()
    try:
        monkeypatch.setattr(cpu, "_CFLAGS", (*cpu._CFLAGS, "-DNORMATLAS_TEST_FLAG"))
        assert cpu._key() != base
        cpu._key.cache_clear()
        monkeypatch.undo()
        src = tmp_path / "csrc"
        shutil_copy(cpu._CSRC, src)
        (src / "norm_rows.h").write_text((src / "norm_rows.h").read_text() + "\n// edited\n")
        monkeypatch.setattr(cpu, "_CSRC", src)
        assert cpu._key() != base
    finally:
        cpu._key.cache_clear()


def shutil_copy(src: Path, dst: Path) -> None:
    import shutil

    shutil.copytree(src, dst)


_BUILD_ONE = textwrap.dedent(
    """
    import json, sys
    from normatlas.kernels import cpu
    info = cpu.ensure_built()
    print(json.dumps(info))
    """
)


@pytest.mark.slow
def test_two_processes_building_at_once_build_once(tmp_path: Path) -> None:
    """The lock: two processes on an empty cache, started together; one compiles, the other loads its build."""
    env = _env(NORMATLAS_CACHE=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD_ONE], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    sources = sorted(json.loads(o[0].strip().splitlines()[-1])["source"] for o in outs)
    assert sources == ["built", "cache"], outs
    assert len(list((tmp_path / "kernels").glob("*/*.so"))) == 1
    assert not list((tmp_path / "kernels").glob(".build-*"))  # the temporary build folder is gone


def _peers():  # (name, ours, peer) factories for a width d
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemma
    from transformers.models.llama.modeling_llama import LlamaRMSNorm as HFLlama

    return [
        ("layernorm", lambda d: na.LayerNorm(d), lambda d: torch.nn.LayerNorm(d)),
        ("rmsnorm", lambda d: na.RMSNorm(d, eps=1e-6), lambda d: torch.nn.RMSNorm(d, eps=1e-6)),
        ("llama", lambda d: na.RMSNorm(d, eps=1e-6, cast_order=na.CastOrder.BEFORE_GAIN), lambda d: HFLlama(d, 1e-6)),
        ("gemma", lambda d: na.GemmaRMSNorm(d, eps=1e-6), lambda d: HFGemma(d, eps=1e-6)),
    ]


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 123, 123), (1, 1, 1023), (64, 4096)])
@pytest.mark.parametrize("which", ["layernorm", "rmsnorm", "llama", "gemma"])
def test_the_default_path_is_as_accurate_as_the_peer(which: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Against float64, the default (fused) module's output and gradients (input, gain, bias) are within 4x of the
    torch / HF peer's error in the same dtype, plus one rounding of the largest value (the two round differently)."""
    _, make_ours, make_peer = next(p for p in _peers() if p[0] == which)
    gen = torch.Generator().manual_seed(5)
    d = shape[-1]
    peer = make_peer(d).to(dtype)
    with torch.no_grad():
        for p in peer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (0.0 if which == "gemma" else 1.0))
    ours, f64 = make_ours(d).to(dtype), make_ours(d).double()
    ours.load_state_dict(peer.state_dict())
    f64.load_state_dict(peer.state_dict())
    f64.backend = "reference"
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 1
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    results = {}
    for name, m in (("ours", ours), ("peer", peer), ("f64", f64)):
        low = name != "f64"
        xi = (x.to(dtype) if low else x).requires_grad_()
        y = m(xi)
        grads = torch.autograd.grad(y, [xi, *m.parameters()], g.to(y.dtype))
        results[name] = [t.double() for t in (y, *grads)]
    for what, o, p, r in zip(["y", "dx", "dw", "db"], results["ours"], results["peer"], results["f64"], strict=False):
        floor = torch.finfo(dtype).eps * r.abs().max().item()
        err_ours, err_peer = (o - r).abs().max().item(), (p - r).abs().max().item()
        assert err_ours <= 4 * err_peer + floor, f"{which} {what}: ours {err_ours:.3g}, peer {err_peer:.3g}"


@needs_cpp
def test_auto_under_torch_func_transforms_runs_the_reference_ops() -> None:
    """vmap / jacrev / grad have no rule for a C++ autograd Function: AUTO takes the reference path under them."""
    from torch.func import functional_call, grad, jacrev, vmap

    m, ref = na.RMSNorm(8), na.RMSNorm(8, backend="reference")
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(vmap(m)(x), ref(x), rtol=0, atol=0)
    v = torch.randn(8)
    torch.testing.assert_close(jacrev(m)(v), jacrev(ref)(v), rtol=0, atol=0)
    w = m.weight.detach()
    g = grad(lambda w: functional_call(m, {"weight": w}, (x,)).pow(2).sum())(w)
    torch.testing.assert_close(g, grad(lambda w: functional_call(ref, {"weight": w}, (x,)).pow(2).sum())(w))
