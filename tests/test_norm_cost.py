"""benchmarks/norm_cost.py (essay §09: QK-norm vs tanh soft-capping around fused attention, and per placement).

The benchmark runs end to end at its ``--quick`` size; no timing claim is tested, only that the result is
well-formed, that every ratio is taken to its peer from the same run, and that each variant computes what it names
(fp32 output and gradients against an independent float64 formula).
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

from tests.scripts import load_benchmark

nc = load_benchmark("norm_cost")

# (B, T, H, Dh): the quick shapes, a single token, an odd length at the benchmark's head size of 64
SHAPES = [*nc.QUICK_SHAPES, (1, 1, 1, 8), (1, 37, 2, 64)]
TOL = {"fwd": {"atol": 5e-5, "rtol": 1e-5}, "bwd": {"atol": 2e-4, "rtol": 1e-4}}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("norm_cost")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert nc.main(["--quick", "--format", "json", "--out", str(out), "--figure", str(out / "fig.png")]) == 0
    doc = json.loads(buf.getvalue())
    doc["_out"] = out
    return doc


def test_writes_json_csv_and_figure(result: dict) -> None:
    out = result["_out"]
    saved = json.loads((out / "norm_cost.json").read_text())
    assert set(saved) >= {"meta", "attention", "blocks", "check"}
    lines = (out / "norm_cost.csv").read_text().splitlines()
    assert lines[0].startswith("part,") and len(lines) == 1 + len(saved["attention"]) + len(saved["blocks"])
    assert (out / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_meta_records_the_machine(result: dict) -> None:
    meta = result["meta"]
    assert meta["torch"] == torch.__version__ and meta["threads"] >= 1 and meta["cpu"]
    assert len(meta["loadavg_before"]) == 3 and len(meta["loadavg_after"]) == 3
    assert meta["quick"] is True and meta["peer"] == "sdpa"


def test_attention_rows_cover_every_cell_with_same_run_ratios(result: dict) -> None:
    rows = result["attention"]
    cells = {(r["shape"], r["mode"], r["variant"]) for r in rows}
    shapes = [nc.shape_name(s) for s in nc.QUICK_SHAPES]
    assert cells == {(s, m, v) for s in shapes for m in nc.MODES for v in nc.VARIANTS} and len(rows) == len(cells)
    for r in rows:
        assert 0 < r["min_ms"] <= r["median_ms"] and math.isfinite(r["median_ms"]) and r["rounds"] >= 3
        peer = next(p for p in rows if (p["shape"], p["mode"], p["variant"]) == (r["shape"], r["mode"], "sdpa"))
        assert r["ratio"] == pytest.approx(r["median_ms"] / peer["median_ms"], rel=1e-9)
        assert r["ratio_min"] == pytest.approx(r["min_ms"] / peer["min_ms"], rel=1e-9)
    assert all(r["ratio"] == 1.0 and r["ratio_min"] == 1.0 for r in rows if r["variant"] == "sdpa")


def test_block_rows_are_ratios_to_pre_ln_of_the_same_run(result: dict) -> None:
    rows = result["blocks"]
    assert {(r["placement"], r["qk_norm"]) for r in rows} == {(p, q) for p in nc.PLACEMENTS for q in (False, True)}
    base = next(r for r in rows if r["placement"] == "pre_ln" and not r["qk_norm"])
    assert base["ratio"] == 1.0
    for r in rows:
        same = next(s for s in rows if s["placement"] == r["placement"] and not s["qk_norm"])
        assert r["ratio"] == pytest.approx(r["median_ms"] / base["median_ms"], rel=1e-9)
        assert r["ratio_min"] == pytest.approx(r["min_ms"] / base["min_ms"], rel=1e-9)
        assert r["qk_cost"] == pytest.approx(r["median_ms"] / same["median_ms"], rel=1e-9)


def test_blocks_use_the_library_placements() -> None:
    for name, preset in nc.PLACEMENTS.items():
        for qk in (False, True):
            model = nc.block_model(name, qk, nc.QUICK_BLOCK)
            block = model.blocks()[0]
            assert block.placement == preset()
            assert (block.attn.q_norm is not None) is qk


def test_self_check_rows_are_small(result: dict) -> None:
    assert {r["variant"] for r in result["check"]} == set(nc.VARIANTS)
    for r in result["check"]:
        assert r["max_abs_err"] <= 5e-5 + 1e-5 * r["max_abs_ref"]


def _ref64(q, k, v, cap, weights):
    """float64 causal attention written out; ``weights`` (wq, wk) adds RMS QK-norm over the head dim."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if weights is not None:
        q, k = (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w for x, w in zip((q, k), weights, strict=True))
    s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    t = s.shape[-1]
    s = torch.where(torch.ones(t, t, dtype=torch.bool).tril(), s, torch.tensor(-math.inf, dtype=s.dtype))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return torch.einsum("bhij,bhjd->bhid", p / p.sum(-1, keepdim=True), v)


@pytest.mark.parametrize("shape", SHAPES, ids=nc.shape_name)
@pytest.mark.parametrize("variant", nc.VARIANTS)
def test_variant_matches_float64_reference_forward_and_backward(shape: tuple[int, ...], variant: str) -> None:
    q, k, v, _ = nc.inputs(shape, seed=1, grad=True)  # logits of std 9: the cap bends them
    norms = nc.qk_norms(shape[2], shape[3], seed=1)
    up = torch.randn(shape[0], shape[2], shape[1], shape[3], generator=torch.Generator().manual_seed(2))
    out = nc.variants(shape[1], shape[3], norms)[variant](q, k, v)
    out.backward(up)

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    w64 = [n.weight.detach().double().requires_grad_() for n in norms]
    cap = nc.SOFTCAP if variant == "eager_softcap" else None
    ref = _ref64(q64, k64, v64, cap, w64 if variant == "qknorm_sdpa" else None)
    ref.backward(up.double())

    torch.testing.assert_close(out.double(), ref, **TOL["fwd"])
    for got, want in [(q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)]:
        torch.testing.assert_close(got.double(), want, **TOL["bwd"])
    if variant == "qknorm_sdpa":
        for n, w in zip(norms, w64, strict=True):
            torch.testing.assert_close(n.weight.grad.double(), w.grad, **TOL["bwd"])


def test_the_variants_differ_where_they_should() -> None:
    """The soft-cap and the QK-norm change the output at the check's logit scale (so the comparisons above bite)."""
    shape = nc.QUICK_SHAPES[-1]
    q, k, v, _ = nc.inputs(shape, seed=0)
    fns = nc.variants(shape[1], shape[3], nc.qk_norms(shape[2], shape[3]))
    with torch.no_grad():
        out = {name: fn(q, k, v) for name, fn in fns.items()}
    assert (out["eager_softcap"] - out["eager"]).abs().max() > 1e-2
    assert (out["qknorm_sdpa"] - out["sdpa"]).abs().max() > 1e-2
    torch.testing.assert_close(out["eager"], out["sdpa"], atol=5e-5, rtol=1e-5)


def test_the_cli_command_prints_the_same_tables(capsys: pytest.CaptureFixture[str]) -> None:
    """``normatlas cost`` (listed in ``normatlas --help``) runs the library's measurement and prints the benchmark's
    tables: every variant's ratio to sdpa from its own run (sdpa's own is 1), the blocks, the float64 check."""
    from normatlas.cli import main

    assert main(["cost", "--quick", "--rounds", "1", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"meta", "attention", "blocks", "check"} <= set(doc)
    assert doc["attention"] and all(r["ratio"] == 1 for r in doc["attention"] if r["variant"] == "sdpa")
    assert {r["placement"] for r in doc["blocks"]} == {"pre_ln", "post_ln", "peri_ln"}
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "cost" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        main(["cost", "--rounds", "0"])
    assert bad.value.code == 2 and "--rounds" in capsys.readouterr().err
