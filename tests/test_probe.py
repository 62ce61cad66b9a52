"""The shared behavioural probe (normatlas.analysis.probe): norms found and measured without names, non-norms
rejected, eps and its placement measured, and every parameter, buffer and flag restored."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm as HFLlamaRMSNorm

from normatlas import presets
from normatlas.analysis.probe import NormFacts, ParamRole, probe, restoring
from normatlas.modules import Norm
from normatlas.spec import CastOrder, EpsPlacement, GainConvention, NormSpec, Scale

W, OPW = GainConvention.W, GainConvention.ONE_PLUS_W
IN = "inside_sqrt"


class Hidden(nn.Module):
    """A custom (1 + w) RMSNorm whose class and parameter names give nothing away."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x.pow(2).mean(-1, keepdim=True) + 3e-4).sqrt() * (1 + self.p)


class DyT(nn.Module):
    """Dynamic Tanh (Zhu et al., 2025): ``tanh(alpha x) * w + b``, a pointwise map, not a norm."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(0.5))
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.alpha * x) * self.weight + self.bias


D = 37
NORMS = {
    # name: (factory, center, gain param, bias param, convention, eps, placement, scale, feature axis)
    "ours-layernorm": (lambda: presets.LayerNorm(D, eps=1e-5), True, "weight", "bias", W, 1e-5, IN, "rms", -1),
    "ours-rmsnorm": (lambda: presets.RMSNorm(D, eps=1e-6), False, "weight", None, W, 1e-6, IN, "rms", -1),
    "ours-gemma": (lambda: presets.GemmaRMSNorm(D, eps=1e-6), False, "weight", None, OPW, 1e-6, IN, "rms", -1),
    "ours-scalenorm": (lambda: presets.ScaleNorm(D, eps=1e-5), False, "weight", None, W, 1e-5, "clamp", "l2", -1),
    "torch-layernorm": (lambda: nn.LayerNorm(D, eps=1e-5), True, "weight", "bias", W, 1e-5, IN, "rms", -1),
    "torch-rmsnorm": (lambda: nn.RMSNorm(D, eps=1e-6), False, "weight", None, W, 1e-6, IN, "rms", -1),
    "torch-groupnorm": (lambda: nn.GroupNorm(3, 12), True, "weight", "bias", W, None, IN, "rms", 1),
    "hf-llama": (lambda: HFLlamaRMSNorm(D, eps=1e-6), False, "weight", None, W, 1e-6, IN, "rms", -1),
    "hf-gemma": (lambda: HFGemmaRMSNorm(D, eps=1e-6), False, "weight", None, OPW, 1e-6, IN, "rms", -1),
    "custom": (lambda: Hidden(D), False, "p", None, OPW, 3e-4, IN, "rms", -1),
}  # fmt: skip


def _snapshot(mod: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in list(mod.parameters()) + list(mod.buffers())]


def _assert_restored(mod: nn.Module, before: list[torch.Tensor], training: bool) -> None:
    for a, b in zip(list(mod.parameters()) + list(mod.buffers()), before, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert mod.training is training


@pytest.mark.parametrize("name", sorted(NORMS))
def test_probe_measures_known_norms(name: str) -> None:
    make, center, gain, bias, conv, eps, placement, scale, axis = NORMS[name]
    torch.manual_seed(0)
    mod = make()
    with torch.no_grad():
        for p in mod.parameters():  # trained-looking weights, not the init
            p.add_(0.3 * torch.randn_like(p))
    before = _snapshot(mod)
    # a module whose parameters are all scalars shows no width: the caller that saw it run passes it (no
    # attribute such as normalized_shape is read for one)
    dim = D if all(p.dim() == 0 or p.numel() == 1 for p in mod.parameters()) else None
    facts = probe(mod, dim, name=name)
    assert isinstance(facts, NormFacts) and facts.name == name and facts.structured
    assert (facts.measured.center, facts.gain_param, facts.bias_param, facts.measured.gain_convention) == (
        center,
        gain,
        bias,
        conv,
    )
    assert facts.feature_axis == axis
    if eps is None:  # features-first: eps is not measured, only the attribute is reported
        assert facts.eps_measured is None and facts.eps == facts.eps_attr
    else:
        assert facts.eps_measured is not None and math.isclose(facts.eps_measured, eps, rel_tol=1e-2)
        assert (facts.measured.eps_placement.value, facts.measured.scale.value) == (placement, scale)
    _assert_restored(mod, before, True)


def test_cast_orders_of_llama_gemma_and_torch_are_measured_in_bf16() -> None:
    llama, gemma, rms = (probe(m) for m in (HFLlamaRMSNorm(D), HFGemmaRMSNorm(D), nn.RMSNorm(D, eps=1e-6)))
    assert llama is not None and gemma is not None and rms is not None
    assert llama.cast_measured and gemma.cast_measured and rms.cast_measured
    assert llama.measured.cast_order is CastOrder.BEFORE_GAIN  # weight * x_hat.to(bf16)
    assert gemma.measured.cast_order is CastOrder.AFTER_GAIN and rms.measured.cast_order is CastOrder.AFTER_GAIN


@pytest.mark.parametrize("cast", [CastOrder.AFTER_GAIN, CastOrder.BEFORE_GAIN])
def test_cast_order_of_our_norm_is_recovered(cast: CastOrder) -> None:
    facts = probe(presets.RMSNorm(64, eps=1e-6, cast_order=cast))
    assert facts is not None and facts.measured.cast_order is cast


@pytest.mark.parametrize(
    "make",
    [
        lambda: DyT(D),
        lambda: nn.Linear(D, D),
        lambda: nn.BatchNorm1d(12).eval(),  # eval mode: an affine map of x, not scale invariant
        lambda: nn.GELU(),
        lambda: nn.Tanh(),
    ],
    ids=["dyt", "linear", "batchnorm-eval", "gelu", "tanh"],
)
def test_non_norms_are_rejected_and_restored(make) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    mod = make()
    before, training = _snapshot(mod), mod.training
    assert probe(mod) is None
    _assert_restored(mod, before, training)


def test_training_batchnorm_is_a_channels_first_norm_and_its_running_stats_survive() -> None:
    bn = nn.BatchNorm1d(12)
    bn.running_mean.fill_(0.3)
    before = _snapshot(bn)
    facts = probe(bn)
    assert facts is not None and facts.measured.center and facts.feature_axis == 1
    assert facts.roles == {"weight": ParamRole.GAIN, "bias": ParamRole.BIAS}
    _assert_restored(bn, before, True)
    assert int(bn.num_batches_tracked) == 0


@settings(max_examples=20, deadline=None)
@given(
    center=st.booleans(),
    log_eps=st.floats(-12, -2),
    placement=st.sampled_from(list(EpsPlacement)),
    dim=st.integers(3, 70),
)
def test_eps_and_placement_are_measured(center: bool, log_eps: float, placement: EpsPlacement, dim: int) -> None:
    """Inside, outside and clamp are told apart and eps measured within 2% (``eps_measured`` is the raw
    measurement, never the module's attribute)."""
    eps = 10.0**log_eps
    spec = NormSpec(center=center, eps=eps, eps_placement=placement, bias=center)
    facts = probe(Norm(spec, dim))
    assert facts is not None and facts.measured.eps_placement is placement
    assert facts.eps_measured is not None and math.isclose(facts.eps_measured, eps, rel_tol=2e-2)
    assert facts.measured.scale is Scale.RMS and facts.measured.center is center


def test_l2_norm_without_parameters_needs_dim() -> None:
    facts = probe(presets.L2Norm(), 19)
    assert facts is not None and facts.gain_param is None and facts.dim == 19
    assert facts.measured.scale is Scale.L2 and facts.measured.eps_placement is EpsPlacement.CLAMP
    assert facts.eps_measured is not None and math.isclose(facts.eps_measured, 1e-12, rel_tol=2e-2)


def test_accepted_shapes_and_dim() -> None:
    facts = probe(nn.GroupNorm(2, 6))
    assert facts is not None and facts.dim == 6 and facts.accepted_shapes == ((2, 6, 5), (2, 6, 3, 3))
    ln = probe(nn.LayerNorm(6))
    assert ln is not None and ln.accepted_shapes[0] == (2, 5, 6)


def test_restoring_survives_an_exception() -> None:
    mod = nn.BatchNorm1d(4)
    before = _snapshot(mod)
    with pytest.raises(RuntimeError, match="boom"), restoring(mod):
        mod.eval()
        with torch.no_grad():
            mod.weight.fill_(7.0)
        raise RuntimeError("boom")
    _assert_restored(mod, before, True)


def test_bad_arguments_name_the_parameter() -> None:
    with pytest.raises(TypeError, match=r"module must be an nn\.Module, got int"):
        probe(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dim must be a positive int or None, got 0"):
        probe(nn.LayerNorm(4), 0)


@pytest.mark.parametrize(
    ("make", "machine"),
    [
        (lambda: __import__("normatlas").RMSNorm(32), True),  # eps=None: finfo(compute dtype).eps
        (lambda: nn.RMSNorm(32), True),
        (lambda: nn.RMSNorm(32, eps=torch.finfo(torch.float32).eps), False),  # the same number, fixed
        (lambda: nn.LayerNorm(32, eps=1e-5), False),
    ],
)
def test_machine_eps_is_told_from_a_fixed_eps_by_measuring_in_two_dtypes(make, machine: bool) -> None:  # type: ignore[no-untyped-def]
    facts = probe(make(), 32)
    assert facts is not None and facts.machine_eps is machine
    assert (facts.spec().eps is None) is machine
