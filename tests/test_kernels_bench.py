"""``normatlas bench`` and the benchmark engine: rows for every provider, sane units, clean errors."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from normatlas.cli import main
from normatlas.kernels.bench import _bytes, run_bench

from .scripts import load_benchmark


def test_run_bench_rows_have_consistent_units() -> None:
    rows = run_bench("add_rms", [(8, 64)], [torch.float32], ["fwd", "bwd"], providers=["ours", "torch"], repeats=2)
    assert {(r["mode"], r["provider"]) for r in rows} == {(m, p) for m in ("fwd", "bwd") for p in ("ours", "torch")}
    for r in rows:
        assert r["ms"] > 0 and r["copy_ms"] > 0
        moved = _bytes("add_rms", r["mode"], 8 * 64, 4)
        assert r["GB/s"] == pytest.approx(moved / (r["ms"] / 1e3) / 1e9, rel=0.02, abs=0.01)
    ours = next(r for r in rows if r["provider"] == "ours" and r["mode"] == "fwd")
    assert ours["vs_ours"] == 1.0


def test_cli_bench_writes_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.csv"
    argv = ["bench", "rms", "--shape", "4x96", "--dtype", "bfloat16", "--mode", "fwdbwd", "--no-compile"]
    assert main([*argv, "--repeats", "2", "--csv", str(out)]) == 0
    table = capsys.readouterr().out
    assert "ours" in table and "hf" in table
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert {r["provider"] for r in rows} == {"ours", "module", "ours_llama", "torch", "torch_layer_norm", "hf"}
    assert all(r["shape"] == "4x96" and r["dtype"] == "bfloat16" for r in rows)


def test_cli_bench_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "rms", "--shape", "4by96"])
    assert "ROWSxHIDDEN" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # refused by argparse, by name, before anything is built or timed
        main(["bench", "rms", "--repeats", "0"])
    assert "argument --repeats: must be an integer >= 1, got 0" in capsys.readouterr().err


def test_width_sweep_runs_and_writes_every_cell(tmp_path: Path) -> None:
    """benchmarks/bench_widths.py (the sweep for pathologies) runs end to end on a tiny input."""
    mod = load_benchmark("bench_widths")
    out = tmp_path / "w.csv"
    argv = ["--widths", "12", "80", "--dtypes", "bfloat16", "float32", "--elements", "4096", "--reps", "1"]
    assert mod.main([*argv, "--alloc", "default", "--out", str(out)]) == 0
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["dtype"], r["width"]) for r in rows] == [("bfloat16", "12"), ("bfloat16", "80"), ("float32", "12"),
                                                        ("float32", "80")]  # fmt: skip
    kernels = ("rms_fwd", "ln_fwd", "add_rms_fwd", "rms_bwd", "ln_bwd", "add_rms_bwd")
    assert all(float(r[k]) > 0 for r in rows for k in kernels)


def test_cli_bench_refuses_what_it_cannot_time(capsys) -> None:
    """An unknown provider is named with the choices (it used to print "(no rows)" and exit 0); a shape without
    rows is refused at the argument (it used to divide by zero at the copy's per-byte time)."""
    assert main(["bench", "rms", "--shape", "4x64", "--provider", "Ours"]) != 0
    err = capsys.readouterr().err
    assert "--provider Ours" in err and "ours_llama" in err and "torch_layer_norm" in err
    with pytest.raises(SystemExit):
        main(["bench", "rms", "--shape", "0x64"])
    assert "rows >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="rows >= 1"):
        run_bench("rms", [(0, 64)], [torch.float32], ["fwd"])


@pytest.mark.parametrize("warm", [False, True])
def test_warm_rounds_call_each_provider_once_more_untimed(warm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``warm=True`` (the cache-resident regime) makes one more call of each provider per round, outside the timed
    window: a fake clock that counts events times exactly the one call inside each window."""
    import types

    import normatlas.kernels.bench as bench

    log: list[str] = []

    def provider(name: str):
        return lambda x, r, w, b: log.append(name) or x * 2

    def clock() -> float:  # each reading is an event; a window's length counts the events inside it
        log.append("T")
        return float(len(log))

    monkeypatch.setattr(bench, "_providers", lambda op, device: {n: provider(n) for n in ("a", "b", "c")})
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=clock))
    rows = bench.run_bench("rms", [(4, 8)], [torch.float32], ["fwd"], repeats=5, warm=warm)
    assert {r["state"] for r in rows} == {"warm" if warm else "shared"}
    for r in rows:  # the window: its closing reading and the one call (the copy, x.clone, logs nothing)
        assert r["ms"] == 2e3 and r["min_ms"] == 2e3 and r["copy_ms"] == 1e3, r
    calls = {n: log.count(n) for n in "abc"}
    assert calls == {n: 1 + 5 * (2 if warm else 1) for n in "abc"}  # the probe call, then each round's


def test_cli_bench_warms_cache_sized_shapes_only(tmp_path: Path) -> None:
    """``normatlas bench`` times cache-sized shapes warm by default (as benchmarks/bench_norms.py) and larger ones
    without the extra call; ``--cache shared`` turns it off."""
    out = tmp_path / "r.csv"
    argv = ["bench", "rms", "--shape", "4x96", "--shape", "2049x1024", "--dtype", "float32", "--mode", "fwd",
            "--provider", "ours", "--repeats", "1", "--min-time", "0", "--csv", str(out)]  # fmt: skip
    for cache, want in (([], {"4x96": "warm", "2049x1024": "shared"}), (["--cache", "shared"], {"4x96": "shared"})):
        assert main([*argv, *cache]) == 0
        with out.open() as f:
            states = {r["shape"]: r["state"] for r in csv.DictReader(f)}
        assert {k: states[k] for k in want} == want


def test_ab_builds_takes_the_old_sources_from_git(tmp_path: Path) -> None:
    """benchmarks/ab_builds.py (two builds interleaved) reads a revision's csrc from git byte for byte, and names a
    bad revision; the builds and timing themselves are too slow for the suite (two compiles of ~30 s)."""
    import subprocess

    ab = load_benchmark("ab_builds")
    root = Path(__file__).resolve().parents[1]
    got = ab.sources_at("HEAD", tmp_path / "src")
    names = sorted(p.name for p in got.iterdir())
    assert {"norm_kernels.cpp", "norm_ops.cpp", "norm_bind.cpp", "norm_cpu_vec.h"} <= set(names)
    for name in names:
        want = subprocess.run(["git", "-C", str(root), "show", f"HEAD:src/normatlas/kernels/csrc/{name}"],
                              capture_output=True, check=True).stdout  # fmt: skip
        assert (got / name).read_bytes() == want, name
    with pytest.raises(ValueError, match="--base='no-such-rev'"):
        ab.sources_at("no-such-rev", tmp_path / "bad")
    with pytest.raises(SystemExit):
        ab.main(["--base", "HEAD", "--rounds", "0"])
