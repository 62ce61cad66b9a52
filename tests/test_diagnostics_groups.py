"""param_groups by behaviour: custom norms, DyT, LayerScale, ReZero, (1+w) gains, tied embeddings."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from normatlas.diagnostics import Kind, Role, format_report, gain_convention, module_kind, param_groups
from normatlas.diagnostics.roles import trace_linear_to_norm
from normatlas.diagnostics.tinylm import TinyLM
from normatlas.presets import GemmaRMSNorm


class Stabilizer(nn.Module):
    """A custom RMSNorm whose name and parameter name give nothing away; gain stored as (1, 1, D)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale_vec = nn.Parameter(torch.ones(1, 1, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale_vec


class OffsetGain(nn.Module):
    """Gemma-style (1 + w) RMSNorm written by hand."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.w)


class Squash(nn.Module):
    """DyT-like: tanh(alpha * x) * weight + bias."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(0.5))
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.alpha * x) * self.weight + self.bias


class Gamma(nn.Module):
    """LayerScale with a (1, 1, D) gamma."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.g = nn.Parameter(1e-5 * torch.ones(1, 1, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.pre = Stabilizer(d)
        self.fc = nn.Linear(d, d)
        self.ls = Gamma(d)
        self.mix = Squash(d)
        self.post = OffsetGain(d)
        self.alpha = nn.Parameter(torch.zeros(()))  # ReZero

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(x + self.alpha * self.ls(self.fc(self.mix(self.pre(x)))))


class Model(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 24) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


EXPECTED = {
    "tok.weight": Role.EMBEDDING,
    "pre.scale_vec": Role.NORM_GAIN,
    "fc.weight": Role.WEIGHT,
    "fc.bias": Role.BIAS,
    "ls.g": Role.POINTWISE,
    "mix.alpha": Role.SCALAR,
    "mix.weight": Role.POINTWISE,
    "mix.bias": Role.POINTWISE,
    "post.w": Role.NORM_GAIN_ONE_PLUS_W,
    "alpha": Role.SCALAR,
    "ln.weight": Role.NORM_GAIN,
    "ln.bias": Role.NORM_BIAS,
}


def _expected(name: str) -> Role:
    return EXPECTED[name.split("blocks.")[-1][2:] if name.startswith("blocks.") else name]


def test_every_parameter_lands_in_its_role_and_group() -> None:
    torch.manual_seed(0)
    model = Model()
    groups, infos = param_groups(model, weight_decay=0.1, report=True)
    assert len(infos) == len(list(model.parameters()))  # the tied head weight counted once
    for info in infos:
        assert info.role is _expected(info.name), info
        assert info.decay == (info.role is Role.WEIGHT), info
    tied = next(i for i in infos if i.name == "tok.weight")
    assert tied.aliases == ("head.weight",)
    decay_ids = {id(p) for p in groups[0]["params"]}  # type: ignore[union-attr]
    assert decay_ids == {id(b.fc.weight) for b in model.blocks}
    opt = torch.optim.AdamW(groups, lr=1e-3)  # type: ignore[arg-type]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    rows = format_report(infos)
    assert {r["group"] for r in rows} == {"decay", "no_decay"}


def test_a_name_or_ndim_filter_would_get_it_wrong() -> None:
    """The usual recipe (decay if ndim >= 2 and 'norm' not in name) decays the custom gains."""
    model = Model()
    naive = {n for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n}
    _, infos = param_groups(model, report=True)  # type: ignore[misc]
    ours = {i.name for i in infos if i.decay}
    wrongly_decayed = naive - ours
    assert "blocks.0.pre.scale_vec" in wrongly_decayed and "blocks.0.ls.g" in wrongly_decayed


def test_options_decay_embeddings_and_one_plus_w() -> None:
    model = Model()
    _, infos = param_groups(model, decay_embeddings=True, decay_one_plus_w=True, report=True)  # type: ignore[misc]
    by = {i.name: i.decay for i in infos}
    assert by["tok.weight"] and by["blocks.0.post.w"] and not by["blocks.0.pre.scale_vec"]
    with pytest.raises(ValueError, match="weight_decay=-1"):
        param_groups(model, weight_decay=-1)


def test_module_kinds_and_gain_conventions() -> None:
    assert module_kind(Stabilizer(8)) is Kind.NORM
    assert module_kind(Squash(8)) is Kind.POINTWISE
    assert module_kind(Gamma(8)) is Kind.POINTWISE
    assert module_kind(nn.Linear(8, 8)) is Kind.LINEAR
    assert module_kind(nn.GELU()) is Kind.CONTAINER
    assert gain_convention(OffsetGain(8)) == {"w": "gain_one_plus_w"}
    assert gain_convention(GemmaRMSNorm(8)) == {"weight": "gain_one_plus_w"}
    assert gain_convention(nn.BatchNorm2d(4)) == {"weight": "gain", "bias": "bias"}
    assert gain_convention(Squash(8)) == {"alpha": "scalar", "weight": "gain", "bias": "bias"}


def test_probing_restores_parameters_and_running_stats() -> None:
    bn = nn.BatchNorm1d(6)
    bn.running_mean.fill_(0.3)
    custom = Stabilizer(6)
    before = [t.clone() for t in (bn.running_mean, bn.running_var, bn.weight, custom.scale_vec)]
    module_kind(custom)
    gain_convention(bn)
    gain_convention(custom)
    for b, a in zip(before, (bn.running_mean, bn.running_var, bn.weight, custom.scale_vec), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_scale_invariant_linears_are_found_from_dataflow() -> None:
    ids = torch.randint(64, (2, 8))
    pairs = trace_linear_to_norm(TinyLM(qk_norm=True), ids)
    assert len(pairs) == 4  # q and k of two layers, each feeding its QK-norm through a view
    for lin, norm in pairs:
        assert isinstance(lin, nn.Linear) and module_kind(norm) is Kind.NORM
    assert trace_linear_to_norm(TinyLM(qk_norm=False), ids) == []  # Pre-LN norms read the residual stream


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.LayerNorm(12),
        lambda: nn.RMSNorm(12),
        lambda: nn.GroupNorm(3, 12),
        lambda: nn.BatchNorm1d(12),
        lambda: __import__("normatlas.presets", fromlist=["x"]).RMSNorm(12),
        lambda: __import__("normatlas.presets", fromlist=["x"]).LayerNorm(12),
        lambda: __import__("normatlas.presets", fromlist=["x"]).ScaleNorm(12),
        lambda: GemmaRMSNorm(12),
    ],
)
def test_behavioural_probe_agrees_with_known_norm_types(make) -> None:  # type: ignore[no-untyped-def]
    """The probe alone (no type table) finds every known norm: Norm(a x) == Norm(x) (essay, invariances)."""
    from normatlas.diagnostics.roles import _behaviour, _Probe

    mod = make().train()
    with _Probe(mod):  # width 12, as built: ScaleNorm's one scalar gain does not show it, and no attribute is read
        kind, _, _ = _behaviour(mod, 12)
    assert kind is Kind.NORM


def test_non_norms_are_not_taken_for_norms() -> None:
    from normatlas.diagnostics.roles import _behaviour, _Probe

    class Affine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(12))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x) * self.w + 1.0

    for mod in (Affine(), nn.BatchNorm1d(12).eval()):  # eval-mode BN is an affine map: not scale invariant
        with _Probe(mod):
            assert _behaviour(mod)[0] is not Kind.NORM
