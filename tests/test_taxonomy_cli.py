"""The taxonomy as code, and the CLI around it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from normatlas import Axis, Layout, classify
from normatlas.cli import main
from normatlas.taxonomy import spec_taxon, taxonomy_table

S, C, P = Axis.SAMPLE, Axis.FEATURE, Axis.POSITION


@pytest.mark.parametrize(
    "layout,reduce,groups,channels,name,batch",
    [
        (Layout.NCHW, {S, P}, 1, None, "BatchNorm", True),
        (Layout.NCHW, {C, P}, 1, None, "LayerNorm (whole sample)", False),
        (Layout.BTD, {C}, 1, None, "LayerNorm", False),
        (Layout.NCHW, {C}, 1, None, "LayerNorm2d (channels at each position)", False),
        (Layout.NCHW, {P}, 1, None, "InstanceNorm", False),
        (Layout.NCHW, {C, P}, 4, 16, "GroupNorm", False),
        (Layout.NCHW, {C, P}, 16, 16, "InstanceNorm", False),  # G = C is InstanceNorm
        (Layout.BTD, {S, P}, 1, None, "BatchNorm", True),
        (Layout.NC, {S}, 1, None, "BatchNorm (per position)", True),
    ],
)
def test_classify_names_the_layer(layout, reduce, groups, channels, name, batch):
    taxon = classify(layout, reduce, groups=groups, num_channels=channels)
    assert taxon.name == name
    assert taxon.batch_dependent is batch


def test_rms_variants_and_spec_taxon():
    import normatlas as na

    assert classify(Layout.BTD, {C}, center=False).name == "RMSNorm"
    assert spec_taxon(na.RMSNorm(8).spec).name == "RMSNorm"
    assert spec_taxon(na.GroupNorm(2, 8).spec, 8).name == "GroupNorm"
    assert spec_taxon(na.InstanceNorm2d(8).spec).name == "InstanceNorm"


def test_classify_rejects_bad_input():
    with pytest.raises(ValueError, match="reduce="):
        classify(Layout.BTD, {"c"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="groups=3 must divide num_channels=8"):
        classify(Layout.NCHW, {C, P}, groups=3, num_channels=8)
    with pytest.raises(TypeError, match="layout='BTD'"):
        classify("BTD", {C})  # type: ignore[arg-type]


def test_only_sample_reductions_are_batch_dependent():
    for row in taxonomy_table():
        assert (row["batch-dependent"] == "YES") == ("n" in row["reduce (n, c, s)"].split(","))


def test_cli_axes_table_and_json(capsys):
    assert main(["axes"]) == 0
    out = capsys.readouterr().out
    assert "vision name" in out and "sequence name" in out and "GroupNorm" in out
    assert main(["axes", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layers"]  # one document: {"layers": [...]}
    assert {r["vision name"] for r in rows} >= {"BatchNorm", "InstanceNorm", "GroupNorm"}


def test_cli_module_entry_point():
    res = subprocess.run([sys.executable, "-m", "normatlas", "axes", "--format", "csv"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0].startswith('"reduce (n, c, s)",vision reduces')


def test_cli_demo_reports_bit_exact_peers(capsys):
    from normatlas.cli.demo import check_presets

    rows = check_presets()
    by = {(r["layer"], r["dtype"]): r for r in rows}
    assert by[("GemmaRMSNorm", "bfloat16")]["bit-exact"] is True  # typed: JSON gets true, the table "yes"
    assert by[("RMSNorm", "float32")]["bit-exact"] is True
    assert all(r["reference err"] < 0.05 for r in rows)
