"""Outliers and quantization at the norms: the int8 and fp8 quantizers against float64 references written
element by element, the relative error, the SmoothQuant-style migration proven exact in float64 on tiny
transformers models (w and 1 + w gains, Linear and Conv1D consumers), refused where it cannot be exact, the
matrix entropy against its definition, and the CLI as typed on the trained byte Llama."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from normatlas.cli import main
from normatlas.tools import outliers

from .tools_fixtures import IDS, tool_model


def _x(shape: tuple[int, ...] = (2, 5, 7)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x[..., 3] *= 50.0  # an outlier channel
    return x


def _fp8_grid() -> list[float]:
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    return sorted({float(v) for v in vals if math.isfinite(float(v))})


def _ref_quantize(x: torch.Tensor, fmt: str, per_channel: bool) -> torch.Tensor:
    """Element by element in Python floats: absmax scale, round to nearest (int8) or nearest fp8 e4m3 value."""
    rows = x.reshape(-1, x.shape[-1]).tolist()
    d = x.shape[-1]
    amax = (
        [max(abs(r[j]) for r in rows) for j in range(d)] if per_channel else [max(abs(v) for r in rows for v in r)] * d
    )
    qmax = 127.0 if fmt == "int8" else 448.0
    grid = _fp8_grid() if fmt != "int8" else []
    out = []
    for r in rows:
        row = []
        for j, v in enumerate(r):
            s = amax[j] / qmax if amax[j] > 0 else 1.0
            u = v / s
            q = float(max(-127, min(127, round(u)))) if fmt == "int8" else min(grid, key=lambda g: abs(g - u))
            row.append(q * s)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("scale", ["tensor", "channel"])
def test_the_quantizers_match_a_float64_reference(fmt: str, scale: str) -> None:
    x = _x()
    want = _ref_quantize(x, fmt, scale == "channel")
    torch.testing.assert_close(outliers.quantize(x, fmt, scale), want, rtol=0, atol=1e-12)
    err = float((want - x).norm() / x.norm())
    assert outliers.quant_error(x, fmt, scale) == pytest.approx(err, rel=1e-12)


def test_an_outlier_channel_costs_per_tensor_int8_and_not_per_channel() -> None:
    x = _x((1, 64, 32))
    assert outliers.quant_error(x, "int8", "tensor") > 5 * outliers.quant_error(x, "int8", "channel")
    assert outliers.quant_error(torch.zeros(3, 4), "int8", "tensor") == 0.0  # a zero tensor keeps scale 1, no NaN
    with pytest.raises(ValueError, match="fmt"):
        outliers.quantize(x, "int4", "tensor")
    with pytest.raises(ValueError, match="scale"):
        outliers.quantize(x, "int8", "row")


@pytest.mark.parametrize(("model_type", "smoothed"), [("llama", 9), ("gemma2", 8), ("gpt2", 8)])
def test_smoothing_leaves_the_function_unchanged_in_float64(model_type: str, smoothed: int) -> None:
    # llama: w gains, nn.Linear consumers; gemma2: (1 + w) gains, sandwich norms; gpt2: LayerNorm with bias into
    # Conv1D, its final norm refused (the head is tied to the embedding)
    model = tool_model(model_type, dtype=torch.float64)
    sm = outliers.smooth(model, IDS)
    assert len(sm.rows) == smoothed, sm.refusals
    # Gemma2RMSNorm computes in float32 whatever the input dtype (``self._norm(x.float())``, ``1.0 + w.float()``):
    # m / s rounds there, so a float64 run is exact only to float32's eps on its norm outputs
    tol = 1e-5 if model_type == "gemma2" else 1e-12
    assert outliers.max_logit_diff(model, sm.model, IDS) < tol
    assert any(r["s_max"] / r["s_min"] > 1.5 for r in sm.rows)  # a real per-channel scale, not a constant
    assert all(r["act_int8_after"] < r["act_int8_before"] for r in sm.rows if model_type == "llama")
    refused = {r["site"]: r["reason"] for r in sm.refusals}
    if model_type == "gpt2":
        assert "shared with transformer.wte.weight" in refused["transformer.ln_f"]
    assert sum(p.numel() for p in sm.model.parameters()) == sum(p.numel() for p in model.parameters())


def test_smoothing_refuses_a_norm_read_by_a_residual_add() -> None:
    model = tool_model("bert", dtype=torch.float64)
    sm = outliers.smooth(model, IDS)
    assert sm.rows == [] and len(sm.refusals) == 2 * 4 + 1
    assert all("add" in r["reason"] or "model output" in r["reason"] for r in sm.refusals)
    assert outliers.max_logit_diff(model, sm.model, IDS) == 0.0
    with pytest.raises(ValueError, match="alpha"):
        outliers.smooth(model, IDS, alpha=1.5)


def test_the_site_report_reads_each_norm_input_and_output() -> None:
    model = tool_model("llama", dtype=torch.float64)
    captured: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        h = model.model.norm.register_forward_hook(lambda m, a, o: captured.update(x=a[0]))
        model(input_ids=IDS, use_cache=False)
        h.remove()
    rows = outliers.site_report(model, IDS)
    assert len(rows) == 9 and all(r["kind"] == "RMSNorm" for r in rows)
    final = rows[-1]
    x = captured["x"]
    assert final["in_max"] == pytest.approx(float(x.abs().max()), rel=1e-6)
    assert final["in_int8_tensor"] == pytest.approx(outliers.quant_error(x, "int8", "tensor"), rel=1e-12)


def test_matrix_entropy_follows_its_definition() -> None:
    assert outliers.matrix_entropy(torch.outer(torch.arange(1.0, 6.0), torch.ones(4))) == pytest.approx(0.0, abs=1e-12)
    assert outliers.matrix_entropy(torch.eye(6)) == pytest.approx(1.0, rel=1e-12)
    m = torch.randn(9, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sv = torch.linalg.svdvals(m)
    p = sv**2 / (sv**2).sum()
    assert outliers.matrix_entropy(m) == pytest.approx(float(-(p * p.log()).sum() / math.log(5)), rel=1e-12)
    rows = outliers.stream_entropy(tool_model("llama", dtype=torch.float64), IDS)
    assert len(rows) == 5 and all(0 < r["entropy"] <= 1 for r in rows)


def test_the_cli_as_typed(byte_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["outliers", str(byte_llama), "--text", "def f(x):\n    return x", "--format", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["model"] == "LlamaForCausalLM" and doc["tokens"] == 22
    assert len(doc["sites"]) == 2 * 3 + 1 and doc["smoothed"] + doc["refused"] == 7
    assert doc["max_abs_logit_diff_f64"] < 1e-12
    assert len(doc["entropy"]) == 4
    assert main(["outliers", str(byte_llama), "--alpha", "2"]) == 2
    assert main(["outliers", str(byte_llama), "--text", " "]) == 2
    err = capsys.readouterr().err
    assert "--alpha" in err and "Traceback" not in err
