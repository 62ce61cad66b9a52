"""The Tools view's options beyond the CLI defaults, its absorb report and its cost measurement (issue 33), against a
server in a thread whose root holds the tools tests' trained byte Llama (3 layers x 32; the zoo default is 6 x 128)
and an OLMo 2 shrunk to 2 layers x 32 (OLMo-2-1B: 16 x 2048), random weights, with post-branch RMSNorms to absorb.

Every option is refused out of its bounds before any job (400 naming the field, the value and what is allowed); a
non-default option of each tool answers what the library answers with that option; the absorb report is
``normatlas absorb --dry-run``'s; the cost job's ratios are taken to its own same-run peer at the sizes asked for,
and its float64 check is the library's; nothing is written under the root.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_web_api import call
from tests.test_web_tools import _files, finish, root, server
from tests.tools_fixtures import byte_llama

__all__ = ["byte_llama", "root", "server"]  # fixtures used below

TINY_COST = {"batch": 1, "seq": 16, "heads": 2, "head_dim": 8, "width": 64, "layers": 1, "block_seq": 16, "rounds": 1}


LENS = {"tool": "lens", "folder": "byte", "text": "x"}
OUT = {"tool": "outliers", "folder": "byte"}
PRUNE = {"tool": "prune", "folder": "byte"}
EMB = {"tool": "embeddings", "folder": "byte"}
ABS = {"tool": "absorb", "folder": "olmo2"}
COST = {"tool": "cost"}
INT = "is not allowed; it must be an integer in"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({**LENS, "k": 0}, f"lens: k=0 {INT} [1, 20]"),
        ({**LENS, "k": 21}, "k=21 is not allowed"),
        ({**LENS, "k": "5"}, "k='5' is not allowed"),
        ({**LENS, "k": 2.0}, "k=2.0 is not allowed"),
        ({**LENS, "k": True}, "k=True is not allowed"),
        ({**LENS, "tuned": "yes"}, "tuned='yes' is not allowed; it must be true or false"),
        ({**LENS, "tuned_steps": 401}, f"tuned_steps=401 {INT} [1, 400]"),
        ({**OUT, "format": "int4"}, "format='int4' is not allowed; it must be one of ['both', 'int8', 'fp8_e4m3']"),
        ({**OUT, "scale": "row"}, "scale='row' is not allowed; it must be one of ['both', 'tensor', 'channel']"),
        ({**OUT, "alpha": 1.5}, "alpha=1.5 is not allowed; it must be a number in [0, 1]"),
        ({**OUT, "alpha": math.nan}, "alpha=nan is not allowed"),
        ({**OUT, "rescale": "qk"}, "one of ['none', 'v']"),
        ({**PRUNE, "drop": -1}, f"prune: drop=-1 {INT} [0, 32]"),
        ({**PRUNE, "drop": 33}, "drop=33"),
        ({**PRUNE, "by": "random"}, "by='random' is not allowed; it must be one of ['angle', 'ratio', 'block']"),
        ({**PRUNE, "windows": 0}, f"windows=0 {INT} [1, 32]"),
        ({**EMB, "top": 51}, f"embeddings: top=51 {INT} [0, 50]"),
        ({**EMB, "z": 0}, "z=0 is not allowed; it must be a number in [0.5, 100]"),
        ({**EMB, "k": 3}, "unknown field(s) ['k']"),
        ({**ABS, "windows": 0}, f"absorb: windows=0 {INT} [1, 16]"),
        ({**ABS, "windows": 17}, "windows=17"),
        ({**ABS, "seed": -1}, "seed=-1"),
        ({**ABS, "text": " "}, "text=' ' is not allowed; it must be a non-empty string"),
        ({**ABS, "output": "x"}, "unknown field(s) ['output']"),
        ({**ABS, "dry_run": False}, "unknown field(s) ['dry_run']"),
        ({"tool": "absorb"}, "absorb needs a folder"),
        ({**COST, "folder": "byte"}, "takes no folder"),
        ({**COST, "seq": 2048}, f"cost: seq=2048 {INT} [1, 1024]"),
        ({**COST, "width": 100}, f"width=100 {INT} [64, 512], a multiple of 64"),
        ({**COST, "layers": 5}, "layers=5"),
        ({**COST, "rounds": 11}, "rounds=11"),
        ({**COST, "block_seq": 4096}, "block_seq=4096"),
        (
            {**COST, "batch": 2, "seq": 1024, "heads": 16, "head_dim": 64},
            "batch x seq x heads x head_dim = 2097152 q / k / v elements, over the limit of 1048576",
        ),
        (
            {**COST, "batch": 2, "seq": 1024, "heads": 16, "head_dim": 8},
            "batch x heads x seq x seq = 33554432 score-matrix elements, over the limit of 16777216",
        ),
    ],
)
def test_options_out_of_bounds_are_refused_before_any_job(server: Any, body: dict[str, Any], words: str) -> None:
    pending = server.inspector.pending()
    status, _, doc = call(server, "POST", "/api/tools", body)
    assert (status, doc["status"]) == (400, 400), doc
    assert words in doc["error"], doc["error"]
    assert server.inspector.pending() == pending


# ----------------------------------------------------------------------------- absorb
def _cli_absorb(path: Path, *extra: str) -> dict[str, Any]:
    from normatlas.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["absorb", str(path), "--dry-run", "--format", "json", *extra]) == 0
    return json.loads(buf.getvalue())


@pytest.mark.parametrize(
    ("options", "argv"),
    [({"windows": 2}, ["--windows", "2"]), ({"windows": 1, "text": "def f(x):\n    return x\n", "seed": 3},
     ["--windows", "1", "--calibration-text", "def f(x):\n    return x\n", "--seed", "3"])],
    ids=["held-out", "calibration-text"],
)  # fmt: skip
def test_absorb_is_the_clis_dry_run_report_and_writes_nothing(
    server: Any, root: Path, options: dict[str, Any], argv: list[str]
) -> None:
    before = _files(root)
    doc = finish(server, {"tool": "absorb", "folder": "olmo2", **options})
    assert doc["state"] == "done", doc
    res = doc["result"]
    tables = {t["name"]: t["rows"] for t in res["tables"]}
    cli = _cli_absorb(root / "olmo2", *argv)
    assert cli["result"] == "verified" and res["meta"]["result"] == "verified"
    for name in ("changes", "calibration", "approximation", "checks"):
        assert tables[name] == cli[name], name
    assert len(tables["calibration"]) == 4 and all(c["passed"] for c in tables["checks"])
    assert res["meta"]["written"] is False and res["meta"]["absorbed"] == 4
    assert res["options"] == {"text": None, "seed": 0} | options
    assert _files(root) == before  # nothing written under the root


def test_absorb_on_a_model_without_post_norms_changes_nothing(server: Any) -> None:
    res = finish(server, {"tool": "absorb", "folder": "byte", "windows": 1})["result"]
    assert res["meta"]["result"].startswith("nothing to change") and res["meta"]["absorbed"] == 0
    assert "checks" not in {t["name"] for t in res["tables"]}


# ----------------------------------------------------------------------------- each tool's options
def test_lens_top_k_and_tuned_norm_are_the_librarys(server: Any, root: Path) -> None:
    from normatlas.tools import load, logit_lens, read_model
    from normatlas.tools.lens import fit_on_heldout, tuned_rows

    text = "import os\nimport sy"
    doc = finish(server, {"tool": "lens", "folder": "byte", "text": text, "k": 3, "tuned": True, "tuned_steps": 5})
    assert doc["state"] == "done", doc
    tables = {t["name"]: t["rows"] for t in doc["result"]["tables"]}
    model, tok = load(root / "byte")
    ids = tok(text, return_tensors="pt")["input_ids"]
    reading = read_model(model, ids)
    fit = fit_on_heldout(model, tok, reading, steps=5, seed=0)
    want = logit_lens(model, ids, tok, k=3, reading=reading, gains=fit.gains)
    assert tables["lens"] == want.rows
    assert tables["tuned_fit"] == tuned_rows(fit)
    assert "kl_mean_tuned" in tables["lens"][0] and doc["result"]["meta"]["k"] == 3


def test_outliers_int8_per_channel_only_is_the_librarys(server: Any, root: Path) -> None:
    from normatlas.tools import load, site_report

    doc = finish(server, {"tool": "outliers", "folder": "byte", "text": "import os", "format": "int8",
                          "scale": "channel", "alpha": 0.25, "entropy": False})  # fmt: skip
    assert doc["state"] == "done", doc
    res = doc["result"]
    model, tok = load(root / "byte")
    ids = torch.tensor([tok("import os")["input_ids"]])
    tokens = [tok.decode([i]) for i in ids[0].tolist()]
    want = site_report(model, ids, tokens, formats=("int8",), scales=("channel",))
    sites = res["tables"][0]["rows"]
    assert sites == want
    errors = {k for k in sites[0] if k.startswith(("in_", "out_")) and k not in ("in_max", "out_x_median")}
    assert errors == {"in_int8_channel", "out_int8_channel"}
    assert "entropy" not in {t["name"] for t in res["tables"]} and res["meta"]["alpha"] == 0.25


def test_prune_drop_k_in_memory_is_the_librarys_and_writes_nothing(server: Any, root: Path) -> None:
    from normatlas.tools import choose, heldout_ids, layer_scores, load, quality, read_model, window_len, windows

    before = _files(root)
    doc = finish(server, {"tool": "prune", "folder": "byte", "drop": 1, "by": "ratio", "windows": 2})
    assert doc["state"] == "done", doc
    res = doc["result"]
    model, tok = load(root / "byte")
    ids = heldout_ids(tok)
    seq = window_len(model)
    score_ids = windows(ids, seq, 8)
    reading = read_model(model, score_ids[:1], head=False)
    scores = layer_scores(model, reading, score_ids)
    drop = choose(scores, 1, "ratio")
    assert res["meta"]["drop"] == drop and res["meta"]["written"] is False and res["meta"]["passed"] is True
    tables = {t["name"]: t["rows"] for t in res["tables"]}
    assert [r["dropped"] for r in tables["scores"]] == [r["layer"] in drop for r in scores]
    base = quality(model, reading, windows(ids, seq, 2, offset=8 * seq))
    assert tables["quality"][0] == {"model": "original", "value": base["value"]}
    assert tables["quality"][1]["value"] != base["value"]
    assert _files(root) == before
    # a drop the model cannot take fails its job (the layers are known once it is loaded)
    failed = finish(server, {"tool": "prune", "folder": "byte", "drop": 3})
    assert failed["state"] == "failed" and failed["status"] == 422 and "would leave no layer" in failed["error"]


def test_embeddings_top_n_and_z_are_the_librarys(server: Any, root: Path) -> None:
    from normatlas.tools import heldout_ids, load, scan_embeddings

    res = finish(server, {"tool": "embeddings", "folder": "byte", "top": 2, "z": 2.0})["result"]
    model, tok = load(root / "byte")
    want = scan_embeddings(model, tok, heldout_ids(tok), z=2.0, extremes=2)
    assert res["tables"][0]["rows"] == [want.summary] and want.summary["z_threshold"] == 2.0
    assert res["tables"][1]["rows"] == want.rows


# ----------------------------------------------------------------------------- cost
def test_cost_runs_at_the_sizes_asked_with_same_run_ratios(server: Any, root: Path) -> None:
    from normatlas.tools import cost as nc

    before = _files(root)
    doc = finish(server, {"tool": "cost", **TINY_COST})
    assert doc["state"] == "done", doc
    res = doc["result"]
    assert res["model"] is None and res["options"] == TINY_COST
    meta = res["meta"]
    assert meta["shapes"] == "1x16x2x8" and meta["min_rounds"] == 1
    assert meta["block"] == "d_model 64 n_heads 1 d_ff 192 n_layers 1 seq 16 batch 1"
    tables = {t["name"]: t["rows"] for t in res["tables"]}
    att = tables["attention"]
    assert {(r["mode"], r["variant"]) for r in att} == {(m, v) for m in nc.MODES for v in nc.VARIANTS}
    for r in att:
        peer = next(p for p in att if p["mode"] == r["mode"] and p["variant"] == nc.PEER)
        assert r["ratio"] == pytest.approx(r["median_ms"] / peer["median_ms"], rel=1e-9) and r["rounds"] == 1
    blocks = tables["blocks"]
    assert {(r["placement"], r["qk_norm"]) for r in blocks} == {(p, q) for p in nc.PLACEMENTS for q in (False, True)}
    pre = next(r for r in blocks if r["placement"] == "pre_ln" and not r["qk_norm"])
    for r in blocks:
        assert r["ratio"] == pytest.approx(r["median_ms"] / pre["median_ms"], rel=1e-9)
    assert tables["check"] == nc.check(nc.QUICK_SHAPES[-1], 0)  # the float64 check, as the library computes it
    assert all(r["max_abs_err"] < 1e-4 for r in tables["check"])
    assert _files(root) == before


def test_the_timing_scripts_jobs_are_valid_requests(root: Path) -> None:
    """benchmarks/tools_timings.py POSTs these bodies; each must pass the server's checks (else it times a 400)."""
    from normatlas.web.tools_api import ToolTargets
    from tests.scripts import load_benchmark

    bench = load_benchmark("tools_timings")
    targets = ToolTargets(root)
    tools = set()
    for folder, body in bench.JOBS:
        full = body if folder is None else {**body, "folder": "byte"}  # a folder under this test's root
        _, spec, _ = targets.target(full)
        tools.add(json.loads(spec)["tool"])
    assert tools == {"lens", "outliers", "prune", "embeddings", "absorb", "cost"}
