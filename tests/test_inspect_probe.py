"""The name-free perturbation probe and the graph pattern matcher, checked against each
other and against the essay's invariances on our presets and torch.nn peers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from normatlas import presets
from normatlas.analysis import record
from normatlas.inspect import inspect_model
from normatlas.inspect.norms import find_sites
from normatlas.inspect.probe import probe_module
from normatlas.vocabulary import Operator
from normatlas.vocabulary import PlacementKind as Placement

KINDS = {
    # name: (factory(size, eps), operator, gain convention, bias)
    "ours-layernorm": (lambda d, e: presets.LayerNorm(d, eps=e), "layernorm", "w", True),
    "ours-rmsnorm": (lambda d, e: presets.RMSNorm(d, eps=e), "rmsnorm", "w", False),
    "ours-gemma": (lambda d, e: presets.GemmaRMSNorm(d, eps=e), "rmsnorm", "1+w", False),
    "torch-layernorm": (lambda d, e: nn.LayerNorm(d, eps=e), "layernorm", "w", True),
    "torch-rmsnorm": (lambda d, e: nn.RMSNorm(d, eps=e), "rmsnorm", "w", False),
    "torch-ln-noaffine": (lambda d, e: nn.LayerNorm(d, eps=e, elementwise_affine=False), "layernorm-nonparam", "none",
                          False),
}  # fmt: skip


def build(kind: str, size: int, eps: float, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    mod = KINDS[kind][0](size, eps)
    with torch.no_grad():
        for p in mod.parameters():  # trained-looking weights, not the init
            p.add_(0.3 * torch.randn_like(p))
    return mod


@given(
    kind=st.sampled_from(sorted(KINDS)),
    size=st.integers(8, 300),
    eps=st.sampled_from([1e-12, 1e-8, 1e-6, 1e-5, 1e-3]),
    seed=st.integers(0, 2**16),
)
def test_probe_recovers_operator_gain_bias_and_eps(kind: str, size: int, eps: float, seed: int) -> None:
    mod = build(kind, size, eps, seed)
    res = probe_module(mod, size, seed=seed)
    assert res is not None
    _, op, conv, bias = KINDS[kind]
    assert (res.as_dict()["operator"], res.as_dict()["gain_convention"], res.as_dict()["bias"]) == (op, conv, bias)
    assert res.as_dict()["eps"] == pytest.approx(eps, rel=0.05)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("shape", [(5, 123, 123), (1, 1, 1023)])
def test_graph_reads_the_same_design_as_the_probe(kind: str, shape: tuple[int, ...]) -> None:
    size = shape[-1]
    mod = build(kind, size, 1e-6, 0)
    sites = find_sites(record(mod, (torch.randn(*shape),)))
    assert len(sites) == 1
    site, probe = sites[0], probe_module(mod, size)
    assert probe is not None
    assert site.operator is probe.operator
    assert (site.gain_convention if site.gain else None) is probe.gain_convention
    assert site.bias == probe.bias and site.size == size
    assert site.eps == pytest.approx(1e-6, rel=1e-12)  # the graph's constant is exact


@pytest.mark.parametrize("mod", [nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.0), nn.Tanh()], ids=repr)
def test_probe_rejects_non_norms(mod: nn.Module) -> None:
    assert probe_module(mod, 16) is None


@given(a=st.floats(0.05, 50.0), c=st.floats(-20.0, 20.0))
def test_invariances_the_probe_relies_on(a: float, c: float) -> None:
    """Norm(a x) == Norm(x) for LN and RMSNorm; LN(x + c) == LN(x); RMSNorm not (essay §02)."""
    torch.manual_seed(0)
    x = torch.randn(4, 64, dtype=torch.float64) * 3 + 1
    ln = nn.LayerNorm(64, eps=1e-12, dtype=torch.float64)
    rms = nn.RMSNorm(64, eps=1e-12, dtype=torch.float64)
    tol = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ln(a * x), ln(x), **tol)
    torch.testing.assert_close(rms(a * x), rms(x), **tol)
    torch.testing.assert_close(ln(x + c), ln(x), **tol)
    if abs(c) > 0.5:
        assert not torch.allclose(rms(x + c), rms(x), **tol)


class RefusesToBeTraced(nn.Module):
    """Runs eagerly, but raises under a torch-function mode: the recorder cannot see it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(20, 24), nn.LayerNorm(24, eps=1e-7), nn.Linear(24, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if torch._C._is_torch_function_mode_enabled():
            raise RuntimeError("no tracing here")
        h = self.emb(ids)
        return self.head(h + self.norm(h))


def test_hook_fallback_when_recording_fails() -> None:
    rep = inspect_model(RefusesToBeTraced(), (torch.randint(0, 20, (2, 5)),))
    assert rep.tracer == "hooks" and rep.placement is Placement.UNKNOWN
    assert rep.operator is Operator.LAYERNORM and any("probe-only" in n for n in rep.notes)
    (norm,) = rep.norms
    assert norm.eps == pytest.approx(1e-7, rel=0.05) and norm.bias and not math.isnan(norm.eps)


class _Normalize(nn.Module):
    def __init__(self, **kwargs: object) -> None:
        super().__init__()
        self.kwargs = kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(x, **self.kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("shape", "kwargs", "found"),
    [
        ((2, 6, 10), dict(dim=-1), True),
        ((2, 6, 10), dict(dim=2), True),
        ((2, 6, 10), dict(p=2.0, dim=-1, eps=1e-6), True),
        ((3, 10), dict(), True),  # the default dim=1 is the last axis of a 2-D input
        ((2, 6, 10), dict(dim=1), False),  # over the channels of (B, C, T), not the last axis
        ((2, 6, 10), dict(), False),  # the default dim=1 again, now not the last axis
        ((2, 6, 10), dict(p=1, dim=-1), False),  # L1, not L2
        ((2, 6, 10), dict(p=float("inf"), dim=-1), False),
    ],
)
def test_fused_normalize_is_l2_over_the_last_axis_only(shape, kwargs, found) -> None:
    sites = find_sites(record(_Normalize(**kwargs), (torch.randn(*shape),)))
    if found:
        assert [(s.operator, s.size, s.fused) for s in sites] == [(Operator.L2, shape[-1], True)]
        assert sites[0].eps == pytest.approx(kwargs.get("eps", 1e-12))
    else:
        assert sites == []
