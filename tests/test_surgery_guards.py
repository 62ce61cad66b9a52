"""Surgery's guards on plain torch modules: a transformation that would be wrong is refused with its reason
(deferring a non-RMS norm, folding a BatchNorm into a shared conv), a BatchNorm without affine folds exactly,
every deferred runtime is part of the proof, bad arguments raise naming the parameter, and nothing is written
that was not read back bitwise."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("safetensors")

import normatlas.surgery.io as surgery_io
from normatlas.spec import EpsPlacement, GainConvention
from normatlas.surgery import (
    MANIFEST,
    DeferredNormLinear,
    change_eps,
    convert_gain_convention,
    deferred_runtime,
    fold_batchnorm,
    fold_gains,
    model_output,
    run_checks,
    save_surgery,
)


class ScaleNorm(nn.Module):
    """``g * x / max(||x||, eps)``: an L2 norm with a per-feature gain."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.normalize(x, dim=-1, eps=1e-6)


class ClampRMS(nn.Module):
    """``g * x / max(rms(x), eps)``: RMS with the eps as a clamp."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x / x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-2))


class NormLinear(nn.Module):
    def __init__(self, norm: nn.Module, d: int = 16) -> None:
        super().__init__()
        self.n, self.l = norm, nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(self.n(x))


def _x(*shape: int, seed: int = 0) -> tuple[torch.Tensor]:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)),)


def _rms_model() -> nn.Module:
    torch.manual_seed(0)
    m = NormLinear(nn.RMSNorm(16, eps=1e-5)).eval()
    with torch.no_grad():
        m.n.weight.add_(0.3 * torch.randn(16))
    return m


# --- 1: deferral only where DeferredNormLinear computes the same thing --------------------------------------


@pytest.mark.parametrize(("norm", "word"), [(ScaleNorm, "l2"), (ClampRMS, "clamp")])
def test_defer_refuses_l2_scale_and_clamp_placement(norm, word) -> None:
    torch.manual_seed(0)
    model, x = NormLinear(norm(16)).eval(), _x(2, 5, 16)
    s = fold_gains(model, x, defer=True)
    assert s.deferred == []
    (refusal,) = s.refusals
    assert refusal.transform == "defer" and word in refusal.reason, refusal
    run_checks(model, s, x)
    assert s.passed and {c.model for c in s.checks} == {"runtime", "stock"}, s.check_rows()


def test_defer_of_an_rms_norm_is_proven_in_float64_and_working_dtype() -> None:
    model, x = _rms_model(), _x(2, 5, 16)
    s = fold_gains(model, x, defer=True)
    assert [d[0] for d in s.deferred] == ["n"] and not s.refusals
    run_checks(model, s, x)
    deferred = [c for c in s.checks if c.model == "deferred"]
    assert [c.dtype for c in deferred] == ["float64", "float32"] and s.passed, s.check_rows()
    x64 = (x[0].double(),)  # a float64 model keeps float64 statistics (not truncated to float32)
    fast, plain = model_output(deferred_runtime(s).double(), x64)[0], model_output(s.runtime().double(), x64)[0]
    torch.testing.assert_close(fast, plain, rtol=0, atol=1e-12)


def test_deferred_norm_linear_rejects_a_clamp_placement() -> None:
    with pytest.raises(ValueError, match=r"eps_placement=.*CLAMP.*cannot be deferred; allowed"):
        DeferredNormLinear(nn.Linear(4, 4), 1e-6, EpsPlacement.CLAMP)


# --- 2: a broken deferral fails the proof, the exit code and the write -------------------------------------


def _broken_deferral(monkeypatch) -> None:
    orig = DeferredNormLinear.forward
    monkeypatch.setattr(DeferredNormLinear, "forward", lambda self, x: 3.0 * orig(self, x))


def test_run_checks_fails_a_broken_deferred_runtime(monkeypatch) -> None:
    _broken_deferral(monkeypatch)
    model, x = _rms_model(), _x(2, 5, 16)
    s = fold_gains(model, x, defer=True)
    run_checks(model, s, x)
    failed = [(c.model, c.dtype) for c in s.checks if not c.passed]
    assert failed == [("deferred", "float64"), ("deferred", "float32")] and not s.passed


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from .tiny_hf import tiny_model

    path = tmp_path_factory.mktemp("ckpt") / "llama"
    model = tiny_model("llama", seed=0)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return path


def test_cli_fold_defer_refuses_to_write_a_broken_deferral(llama_dir, tmp_path, monkeypatch, capsys) -> None:
    from normatlas.cli import main

    out = tmp_path / "deferred"
    assert main(["fold", str(llama_dir), str(out), "--defer"]) == 0
    checks = json.loads((out / MANIFEST).read_text())["checks"]
    assert {(c["model"], c["dtype"]) for c in checks if c["model"] == "deferred"} == {
        ("deferred", "float64"),
        ("deferred", "float32"),
    }
    capsys.readouterr()
    _broken_deferral(monkeypatch)
    broken = tmp_path / "broken"
    assert main(["fold", str(llama_dir), str(broken), "--defer"]) == 1
    assert main(["fold", str(llama_dir), "--dry-run", "--defer"]) == 1
    captured = capsys.readouterr()
    assert "deferred/float64" in captured.err and "not written" in captured.err
    assert not broken.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["deferred"]


# --- 3, 8: the written file is read back; bad output paths -------------------------------------------------


def test_save_plain_module_reads_back_and_rebuilds(tmp_path) -> None:
    model, x = _rms_model(), _x(2, 5, 16)
    s = fold_gains(model, x)
    run_checks(model, s, x)
    out = save_surgery(s, tmp_path / "plain", inputs=x)
    assert sorted(p.name for p in out.iterdir()) == sorted(["model.safetensors", MANIFEST])
    from safetensors.torch import load_file

    written = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(written[k], v) for k, v in s.stock.state_dict().items())


def test_save_refuses_a_corrupted_write_and_leaves_nothing(tmp_path, monkeypatch) -> None:
    model, x = _rms_model(), _x(2, 5, 16)
    s = fold_gains(model, x)
    run_checks(model, s, x)
    monkeypatch.setattr(surgery_io, "_dedup", lambda st: {k: v.detach().clone() * 0 for k, v in st.items()})
    with pytest.raises(ValueError, match="does not read back equal"):
        save_surgery(s, tmp_path / "plain", inputs=x)
    assert list(tmp_path.iterdir()) == []


def test_save_plain_module_without_inputs_is_refused(tmp_path) -> None:
    model, x = _rms_model(), _x(2, 5, 16)
    s = fold_gains(model, x)
    run_checks(model, s, x)
    with pytest.raises(ValueError, match=r"refusing to write: inputs=None"):
        save_surgery(s, tmp_path / "plain")
    assert list(tmp_path.iterdir()) == []


def test_save_onto_a_file_names_output(tmp_path) -> None:
    model, x = _rms_model(), _x(2, 5, 16)
    s = fold_gains(model, x)
    run_checks(model, s, x)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=r"output=.*afile.* is not a folder"):
        save_surgery(s, afile, inputs=x)
    with pytest.raises(ValueError, match=r"output=.*afile.* is a file, not a folder"):
        save_surgery(s, afile / "sub", inputs=x)
    assert afile.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


# --- 4, 5, 8: BatchNorm folding --------------------------------------------------------------------------------


def _warm(model: nn.Module, shape: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(*shape) * 2 + 1)
    return model.eval()


class SharedConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.n = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.n(self.c(x)) + self.c(x * 2)


def test_bn_fold_refuses_a_conv_applied_twice() -> None:
    model, x = _warm(SharedConv(), (4, 3, 8, 8)), _x(2, 3, 8, 8)
    s = fold_batchnorm(model, x)
    assert s.changes == [] and [r.target for r in s.refusals] == ["n"]
    assert "c is applied 2 times" in s.refusals[0].reason
    assert torch.equal(s.stock.c.weight, model.c.weight)
    run_checks(model, s, x)
    assert s.passed, s.check_rows()


class ConvBN(nn.Module):
    def __init__(self, conv_bias: bool = True, affine: bool = True, eps: float = 1e-5) -> None:
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(3, 4, 3, bias=conv_bias), nn.BatchNorm2d(4, affine=affine, eps=eps)
        self.c2, self.n2 = nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.n2(self.c2(torch.relu(self.n1(self.c1(x)))))


@pytest.mark.parametrize("conv_bias", [True, False])
def test_bn_fold_folds_a_batchnorm_without_affine(conv_bias, tmp_path) -> None:
    model, x = _warm(ConvBN(conv_bias, affine=False), (4, 3, 12, 12)), _x(2, 3, 12, 12)
    s = fold_batchnorm(model, x)
    assert [c.target for c in s.changes] == ["n1", "n2"] and not s.refusals, s.refusals
    assert "without affine" in s.changes[0].detail
    run_checks(model, s, x, working_dtype=torch.float32)
    assert s.passed and {c.model for c in s.checks} == {"runtime", "stock"}, s.check_rows()
    runtime = s.runtime()
    assert not any(isinstance(m, nn.BatchNorm2d) for m in runtime.modules())
    ref = model_output(model, x)[0]
    torch.testing.assert_close(model_output(runtime, x)[0], ref, rtol=0, atol=1e-6 * float(ref.abs().max()))
    save_surgery(s, tmp_path / "bn", inputs=x)


@pytest.mark.parametrize("eps", [1, np.float32(0.5)])
def test_bn_fold_uses_the_batchnorm_eps_whatever_its_number_type(eps) -> None:
    model, x = _warm(ConvBN(), (4, 3, 12, 12)), _x(2, 3, 12, 12)
    model.n1.eps = eps  # an int (nn.BatchNorm2d(4, eps=1) stores one) or a numpy scalar, not a Python float
    s = fold_batchnorm(model, x)
    run_checks(model, s, x)
    assert s.passed and len(s.changes) == 2, s.check_rows()


def test_bn_fold_with_a_missing_bias_folds_it_as_zero() -> None:
    model, x = _warm(ConvBN(), (4, 3, 12, 12)), _x(2, 3, 12, 12)
    model.n1.bias = None  # weight without bias: beta = 0, checked before anything is written
    s = fold_batchnorm(model, x)
    assert [c.target for c in s.changes] == ["n1", "n2"] and not s.refusals
    run_checks(model, s, x)
    assert s.passed, s.check_rows()


def test_bn_fold_refusal_writes_nothing() -> None:
    model, x = _warm(ConvBN(affine=False, eps=1.5), (4, 3, 12, 12)), _x(2, 3, 12, 12)
    s = fold_batchnorm(model, x)  # no weight and eps >= 1: running_var cannot be 1 - eps
    assert [(r.target, r.transform) for r in s.refusals] == [("n1", "bn-fold")]
    assert "eps=1.5 >= 1" in s.refusals[0].reason
    before = {k: v for k, v in model.state_dict().items() if k.startswith(("c1.", "n1."))}
    after = s.stock.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    run_checks(model, s, x)
    assert s.passed, s.check_rows()


class LinearBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l, self.n = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.n(self.l(x))  # (N, 8, 8): BatchNorm1d normalises axis 1, the linear's outputs are axis 2


def test_bn_fold_refuses_a_channel_axis_that_is_not_the_output_features() -> None:
    model, x = _warm(LinearBN(), (4, 8, 8)), _x(2, 8, 8)
    s = fold_batchnorm(model, x)
    assert [r.target for r in s.refusals] == ["n"] and "axis 1" in s.refusals[0].reason
    run_checks(model, s, x)
    assert s.passed, s.check_rows()


# --- 6, 8: argument validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["1-w", 1, None])
def test_convert_gain_convention_rejects_a_bad_target(bad) -> None:
    model, x = _rms_model(), _x(2, 5, 16)
    with pytest.raises(ValueError, match=r"to=.* is not a valid GainConvention; allowed: 'w', '1\+w'"):
        convert_gain_convention(model, x, bad)


def test_convert_gain_convention_accepts_the_string_form() -> None:
    model, x = _rms_model(), _x(2, 5, 16)
    s = convert_gain_convention(model, x, "1+w")
    assert s.transform == "gain-1+w" and [c.action for c in s.changes] == ["w -> 1+w"]
    assert convert_gain_convention(model, x, GainConvention.ONE_PLUS_W).transform == "gain-1+w"


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(eps=0.0), ValueError, r"eps=0.0 must be a finite number > 0"),
        (dict(eps=-1e-5), ValueError, r"eps=-1e-05 must be a finite number > 0"),
        (dict(eps=float("nan")), ValueError, r"eps=nan must be a finite number > 0"),
        (dict(eps=True), TypeError, r"eps=True must be a finite number > 0"),
        (dict(eps="1e-5"), TypeError, r"eps='1e-5' must be a finite number > 0"),
        (dict(eps_placement="outside_sqrt"), TypeError, r"eps_placement='outside_sqrt' must be an EpsPlacement"),
    ],
)
def test_change_eps_rejects_bad_arguments_consistently(kw, exc, match) -> None:
    model, x = _rms_model(), _x(2, 5, 16)
    with pytest.raises(exc, match=match):
        change_eps(model, x, **kw)
