"""Which kernel runs for which input, through every way into the kernels: pinned over a grid.

The grid crosses the norm (its spec), the input dtype, the shape, whether the input requires grad and the entry
point (``normalize``, the core module, the fused functions and modules, QK-norm). What ran is observed at the bottom,
not asked of the dispatcher: the C++ extension behind a recording proxy (a cached plan, its QK pair, the checked
``norm`` entry, the op's ``norm_fwd``) and the op's eager transcription; nothing recorded means the reference path.
tests/data/kernel_routes.json holds the table as today's code chose it (regenerate it, after a change that means to
move a case, with ``NORMATLAS_WRITE_ROUTES=1``). CPU only: the C++ extension must be built (``normatlas kernels
build``); without it the test skips.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import normatlas
from normatlas import kernels
from normatlas.backend import reference_only
from normatlas.blocks import QKGain, QKNorm, QKNormConfig
from normatlas.functional import normalize
from normatlas.kernels import cpu, dispatch, ops
from normatlas.kernels.dispatch import Kernel, Mode, Route, qk_route, route
from normatlas.spec import CastOrder, EpsPlacement, Gain, GainConvention, Layout, NormSpec, Scale

TABLE = Path(__file__).parent / "data" / "kernel_routes.json"

SPECS = {
    "layernorm": NormSpec(),
    "rmsnorm": NormSpec(center=False, bias=False, eps=1e-6),
    "rmsnorm_1pw": NormSpec(center=False, bias=False, gain_convention=GainConvention.ONE_PLUS_W),
    "rmsnorm_before_gain": NormSpec(center=False, bias=False, cast_order=CastOrder.BEFORE_GAIN),
    "rmsnorm_input_dtype": NormSpec(center=False, bias=False, cast_order=CastOrder.INPUT_DTYPE),
    "l2_clamp": NormSpec(center=False, scale=Scale.L2, eps_placement=EpsPlacement.CLAMP, gain=Gain.NONE, bias=False),
    "rms_eps_none": NormSpec(center=False, bias=False, eps=None, eps_placement=EpsPlacement.OUTSIDE_SQRT),
    "scalar_gain": NormSpec(gain=Gain.SCALAR, bias=False),
    "channels_first": NormSpec(layout=Layout.NCHW),
    "layernorm_2d": NormSpec(feature_ndim=2),
}
DTYPES = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16, "f16": torch.float16}
SHAPES = {
    "3x8": (3, 8),
    "2x3x64": (2, 3, 64),
    "8": (8,),
    "0x8": (0, 8),
    "4x0": (4, 0),
    "2x4x3x5": (2, 4, 3, 5),
    "8x3.T": (8, 3),
}
GRADS = {"nograd": False, "grad": True}


class _PlanProxy:
    def __init__(self, plan: Any, log: list[str]) -> None:
        self._plan, self._log = plan, log

    def __call__(self, *args: Any) -> Any:
        out = self._plan(*args)
        self._log.append("plan" if out is not None else "plan-declined")
        return out

    def pair(self, *args: Any) -> Any:
        self._log.append("plan.pair")
        return self._plan.pair(*args)


class _ExtProxy:
    """The C++ extension, recording which of its entries ran."""

    def __init__(self, ext: Any, log: list[str]) -> None:
        self._ext, self._log = ext, log

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._ext, name)
        if name == "Plan":
            return lambda *a: _PlanProxy(attr(*a), self._log)
        if name in ("norm", "norm_fwd", "norm_pair"):

            def record(*a: Any, **k: Any) -> Any:
                self._log.append(name)
                return attr(*a, **k)

            return record
        return attr


@pytest.fixture
def observe(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """A log of the kernels each call ran (cleared by the caller); the plan cache emptied before and after."""
    ext = cpu.extension(build=False)
    if ext is None:
        pytest.skip("the C++ kernels are not built (normatlas kernels build)")
    log: list[str] = []
    proxy = _ExtProxy(ext, log)
    built = log  # an empty-string first entry marks "not built yet": loaded() and extension(build=False) say None
    monkeypatch.setattr(cpu, "extension", lambda build=True: proxy if build or not _unbuilt(built) else None)
    monkeypatch.setattr(cpu, "loaded", lambda: None if _unbuilt(built) else proxy)
    eager_fwd = ops.eager_fwd

    def recorded_eager(*a: Any) -> Any:
        log.append("eager")
        return eager_fwd(*a)

    monkeypatch.setattr(ops, "eager_fwd", recorded_eager)
    dispatch._PLANS.clear()
    yield log
    dispatch._PLANS.clear()


def _unbuilt(log: list[str]) -> bool:
    return bool(log) and log[0] == ""


def _params(spec: NormSpec, fshape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor | None, ...]:
    shape = fshape if spec.gain is not Gain.SCALAR else ()
    wdtype = dtype if spec.cast_order is CastOrder.BEFORE_GAIN else torch.float32
    w = torch.ones(shape, dtype=wdtype) if spec.gain is not Gain.NONE else None
    b = torch.zeros(shape, dtype=wdtype) if spec.bias else None
    return w, b


def _entries(spec_name: str) -> dict[str, Callable[[torch.Tensor], Any]]:
    """Every way into the kernels that takes this norm, as a call on one input."""
    spec = SPECS[spec_name]

    def fshape(x: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape[max(0, x.dim() - spec.feature_ndim) :])

    def module(cls: Any, **kw: Any) -> Callable[[torch.Tensor], Any]:
        def call(x: torch.Tensor) -> Any:
            shape = fshape(x) if spec.layout.channels_last else (x.shape[1] if x.dim() > 1 else 1)
            wdtype = x.dtype if spec.cast_order is CastOrder.BEFORE_GAIN else torch.float32
            return cls(spec, shape, dtype=wdtype, **kw)(x)

        return call

    def with_params(fn: Callable[..., Any]) -> Callable[[torch.Tensor], Any]:
        return lambda x: fn(x, *_params(spec, fshape(x), x.dtype))

    out: dict[str, Callable[[torch.Tensor], Any]] = {
        "normalize_auto": with_params(lambda x, w, b: normalize(x, spec, w, b)),
        "normalize_fused": with_params(lambda x, w, b: normalize(x, spec, w, b, backend="fused")),
        "normalize_reference_only": with_params(lambda x, w, b: _in_reference_only(normalize, x, spec, w, b)),
        "Norm_auto": module(normatlas.Norm),
        "FusedNorm": module(kernels.FusedNorm),
        "fused_normalize": with_params(lambda x, w, b: kernels.fused_normalize(x, spec, w, b)),
        "fused_normalize_residual": with_params(
            lambda x, w, b: kernels.fused_normalize(x, spec, w, b, residual=x.detach().clone())
        ),
    }
    if spec_name == "rmsnorm":
        out["fused_rms_norm"] = lambda x: kernels.fused_rms_norm(x, fshape(x), torch.ones(fshape(x)), 1e-6)
        out["fused_add_rms_norm"] = lambda x: kernels.fused_add_rms_norm(x, x.detach().clone(), fshape(x), None, 1e-6)
        out["FusedAddRMSNorm"] = lambda x: kernels.FusedAddRMSNorm(fshape(x), eps=1e-6)(x, x.detach().clone())
        out["qk_rms_norm"] = lambda x: kernels.qk_rms_norm(
            x, x.detach().clone(), torch.ones(fshape(x)), torch.ones(fshape(x))
        )
        out["qk_rms_norm_noweight"] = lambda x: kernels.qk_rms_norm(x, x.detach().clone(), None, None, None)
        out["QKNorm"] = lambda x: QKNorm(QKNormConfig(gain=QKGain.NONE), 1, x.shape[-1])(x)
    if spec_name == "layernorm":
        out["fused_layer_norm"] = lambda x: kernels.fused_layer_norm(
            x, fshape(x), torch.ones(fshape(x)), torch.zeros(fshape(x))
        )
        out["fused_add_layer_norm"] = lambda x: kernels.fused_add_layer_norm(x, x.detach().clone(), fshape(x))
    return out


def _in_reference_only(fn: Callable[..., Any], *args: Any) -> Any:
    with reference_only():
        return fn(*args)


def _cases() -> Iterator[tuple[str, str, Callable[[torch.Tensor], Any], torch.dtype, tuple[int, ...], bool]]:
    for spec_name in SPECS:
        for entry, call in _entries(spec_name).items():
            for dname, dtype in DTYPES.items():
                for sname, shape in SHAPES.items():
                    for gname, grad in GRADS.items():
                        yield f"{entry}/{spec_name}/{dname}/{sname}/{gname}", entry, call, dtype, shape, grad


def routes(log: list[str]) -> dict[str, str]:
    """Each case's observed path: the kernel entries that ran, or ``reference``, or the error it raised."""
    table = {}
    gen = torch.Generator().manual_seed(0)
    for built in ("built", "unbuilt"):
        for case, _entry, call, dtype, shape, grad in _cases():
            x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
            x = (x.t() if case.split("/")[3].endswith(".T") else x).requires_grad_(grad)
            log[:] = [""] if built == "unbuilt" else []
            dispatch._PLANS.clear()
            try:
                call(x)
            except (ValueError, TypeError, RuntimeError) as e:
                log.append(f"error:{type(e).__name__}")
            table[f"{case}/{built}"] = "+".join(v for v in log if v) or "reference"
    return table


def test_every_case_takes_the_pinned_path(observe: list[str]) -> None:
    got = routes(observe)
    if os.environ.get("NORMATLAS_WRITE_ROUTES") == "1":
        TABLE.write_text(json.dumps(got, indent=0, sort_keys=True) + "\n")
    want = json.loads(TABLE.read_text())
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:20]
    moved = {c: (want[c], got[c]) for c in want if want[c] != got[c]}
    assert not moved, f"{len(moved)} cases moved (pinned, now): {dict(list(moved.items())[:20])}"


def test_the_grid_reaches_every_path(observe: list[str]) -> None:
    """The pinned table is not one path everywhere: the grid reaches the plan, its pair, the checked C++ entry, the
    op, the eager transcription, the reference and the refusals."""
    values = set(json.loads(TABLE.read_text()).values())
    for part in ("plan", "plan.pair", "plan-declined", "reference", "error:ValueError"):
        assert any(part in v.split("+") for v in values), part


MODES = {"normalize_auto": Mode.AUTO, "normalize_fused": Mode.FUSED, "fused_normalize": Mode.DIRECT}


def test_the_route_predicts_what_runs(observe: list[str]) -> None:
    """The dispatch point's typed answer, asked before the call, names what the call then runs: ``Kernel.PLAN``
    where the plan ran or declined, ``Kernel.REFERENCE`` where no kernel ran (the reference's own checks may then
    raise), a ValueError where the call raised one; after a declined plan, ``route(..., declined=True)``."""
    want = json.loads(TABLE.read_text())
    gen = torch.Generator().manual_seed(1)
    seen: set[Kernel] = set()
    for case, entry, _call, dtype, shape, grad in _cases():
        if entry not in MODES or case + "/built" not in want:
            continue
        spec = SPECS[case.split("/")[1]]
        x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        x = (x.t() if case.split("/")[3].endswith(".T") else x).requires_grad_(grad)
        w, b = _params(spec, tuple(x.shape[max(0, x.dim() - spec.feature_ndim) :]), dtype)
        ran = want[case + "/built"].split("+")
        try:
            r = route(spec, x, w, b, mode=MODES[entry])
        except ValueError:
            assert ran[-1] == "error:ValueError", case
            continue
        assert isinstance(r, Route) and isinstance(r.kernel, Kernel) and isinstance(r.reason, str), case
        seen.add(r.kernel)
        if r.kernel is Kernel.REFERENCE:
            assert ran in (["reference"], ["error:ValueError"]), (case, r)  # no kernel ran (the reference may refuse)
            continue
        assert r.kernel is Kernel.PLAN and ran[0] in ("plan", "plan-declined"), (case, r, ran)
        if ran[0] == "plan-declined":
            try:
                after = route(spec, x, w, b, mode=MODES[entry], declined=True)
            except ValueError:
                assert ran[-1] == "error:ValueError", case
                continue
            seen.add(after.kernel)
            if after.kernel is Kernel.REFERENCE:
                assert ran in (["plan-declined"], ["plan-declined", "error:ValueError"]), (case, after, ran)
    assert {Kernel.PLAN, Kernel.REFERENCE} <= seen, seen


def test_the_route_under_auto_never_compiles_and_says_why(observe: list[str]) -> None:
    """Without a built extension AUTO routes to the reference (naming why) and builds nothing; FUSED refuses what
    the kernels cannot serve with a ValueError naming the reason and the backends allowed."""
    x = torch.randn(3, 8)
    observe[:] = [""]  # not built
    r = route(SPECS["rmsnorm"], x, torch.ones(8), mode=Mode.AUTO)
    assert r.kernel is Kernel.REFERENCE and "not ready" in r.reason, r
    observe[:] = []
    with pytest.raises(ValueError, match=r"backend='fused' cannot run this norm: gain=Gain.SCALAR .*'auto' or"):
        route(SPECS["scalar_gain"], x, torch.ones(()), mode=Mode.FUSED)
    r = route(SPECS["scalar_gain"], x, torch.ones(()), mode=Mode.DIRECT)
    assert r == Route(Kernel.REFERENCE, "gain=Gain.SCALAR is not served"), r
    with reference_only():
        assert route(SPECS["rmsnorm"], x, torch.ones(8), mode=Mode.AUTO).kernel is Kernel.REFERENCE
        assert route(SPECS["rmsnorm"], x, torch.ones(8), mode=Mode.FUSED).kernel is Kernel.PLAN


def test_qk_route_pairs_only_inference_on_one_head_dim(observe: list[str]) -> None:
    q, k, w = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16), torch.ones(16)
    assert qk_route(q, k, w, w, 1e-6, CastOrder.AFTER_GAIN).kernel is Kernel.PAIR
    r = qk_route(q.requires_grad_(), k, w, w, 1e-6, CastOrder.AFTER_GAIN)
    assert r.kernel is Kernel.SPLIT and "autograd" in r.reason, r
    r = qk_route(q.detach(), torch.randn(2, 3, 2, 8), w, torch.ones(8), 1e-6, CastOrder.AFTER_GAIN)
    assert r.kernel is Kernel.SPLIT and "head dim" in r.reason, r
