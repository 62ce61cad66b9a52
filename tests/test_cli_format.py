"""Command output that fits a terminal: widths, wrapped and shortened cells, group headings, typed JSON.

The width comes from ``$COLUMNS`` (set here through the environment, as a terminal would) and is 100 columns
when the output is not a terminal (pytest's captured stdout is not)."""

from __future__ import annotations

import csv
import io
import json
import os
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from normatlas.cli import main
from normatlas.cli._format import Section, format_table, render


def _widest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.mark.parametrize(
    "argv",
    [["matrix"], ["matrix", "--all-fields"], ["matrix", "--family", "Gemma"], ["papers"], ["axes"], ["demo"]],
    ids=" ".join,
)
def test_default_tables_fit_100_columns_when_not_a_terminal(
    argv: list[str], capsys: pytest.CaptureFixture[str], no_columns: None
) -> None:
    """They were 105-1,700 columns wide (matrix 187, --all-fields 1,700, papers 146, axes and demo 149)."""
    code, out, _ = run(capsys, *argv)
    assert code == 0 and out.strip()
    assert _widest(out) <= 100, max(out.splitlines(), key=len)


def test_tables_follow_columns(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for width in ("60", "140"):
        monkeypatch.setenv("COLUMNS", width)
        code, out, _ = run(capsys, "axes")
        assert code == 0 and _widest(out) <= int(width)
        assert "GroupNorm" in out and "LayerNorm2d" in out
    assert _widest(out) > 100  # a wide terminal gets the unbroken table


def test_long_cells_are_wrapped_in_the_table_and_whole_in_json(
    capsys: pytest.CaptureFixture[str], no_columns: None
) -> None:
    code, out, _ = run(capsys, "matrix", "--all-fields", "--family", "OLMo")
    assert code == 0 and _widest(out) <= 100
    assert "None" not in out and "[]" not in out  # missing values read "-"
    code, doc, _ = run(capsys, "matrix", "--all-fields", "--family", "OLMo", "--format", "json")
    models = json.loads(doc)["models"]
    longest = max((m["source"] for m in models), key=len)
    assert len(longest) > 100 and longest not in out  # the table wraps it, JSON keeps it whole
    assert all(isinstance(m["hf_model_types"], list) for m in models)
    assert any(m["essay_differs"] is None for m in models) and all(type(m["year"]) in (int, type(None)) for m in models)


def test_group_column_is_a_heading_once_per_group(capsys: pytest.CaptureFixture[str], no_columns: None) -> None:
    """``papers`` printed its 64-character group on every row."""
    from normatlas import atlas

    code, out, _ = run(capsys, "papers")
    assert code == 0 and _widest(out) <= 100
    groups = [p["group"] for p in atlas.papers()]
    for g in dict.fromkeys(groups):
        assert out.count(g) == 1, g
    assert max(map(len, groups)) >= 60
    code, doc, _ = run(capsys, "papers", "--format", "json")
    papers = json.loads(doc)["papers"]
    assert [p["group"] for p in papers] == groups  # every row keeps its group in JSON


def test_section_group_and_rounding() -> None:
    rows = [
        {"group": "a long group name shared by rows", "item": "x", "seconds": 4.815230647000021, "ok": True},
        {"group": "a long group name shared by rows", "item": "y", "seconds": None, "ok": False},
        {"group": "another", "item": "z", "seconds": 12345.6789, "ok": None},
    ]
    text = format_table(rows, "t", group="group")
    assert text.count("a long group name shared by rows") == 1 and text.count("another") == 1
    assert "4.815" in text and "4.81523" not in text and "12346" in text
    line_y = next(line for line in text.splitlines() if line.strip().startswith("y"))
    assert line_y.split() == ["y", "-", "no"]
    doc = json.loads(render([Section("rows", rows, group="group")], "json"))
    assert doc["rows"][0]["seconds"] == 4.815230647000021 and doc["rows"][0]["ok"] is True
    assert doc["rows"][1]["seconds"] is None and doc["rows"][2]["group"] == "another"


_TEXT = st.text(st.characters(codec="ascii", categories=("L", "N", "P", "Zs")), max_size=90)
_ROWS = st.lists(
    st.fixed_dictionaries(
        {
            "name": _TEXT,
            "a_rather_long_column_name": st.one_of(st.none(), st.integers(), st.floats(allow_nan=True), _TEXT),
            "list": st.lists(_TEXT, max_size=4),
            "flag": st.booleans(),
            "group": st.sampled_from(["first group of rows", "second"]),
        }
    ),
    max_size=15,
)


@given(rows=_ROWS, width=st.integers(20, 160), grouped=st.booleans())
def test_no_line_is_ever_wider_than_the_width(rows: list[dict[str, object]], width: int, grouped: bool) -> None:
    with mock.patch.dict(os.environ, {"COLUMNS": str(width)}):
        title = "a title that is long enough to need wrapping " * 3
        text = format_table(rows, title, group="group" if grouped else None)
    assert _widest(text) <= width, text


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["axes"], "layers"),
        (["matrix", "--family", "Gemma"], "models"),
        (["papers", "--question", "attention"], "papers"),
        (["demo"], "presets"),
        (["inspect", "tests.test_inspect_cli:toy", "tests.test_inspect_cli:toy"], "models"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
def test_json_is_one_typed_document(argv: list[str], key: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--format json`` (and its alias ``--json``) prints one JSON object; a missing value is null, never "-"."""
    for flag in (["--format", "json"], ["--json"]):
        code, out, _ = run(capsys, *argv, *flag)
        assert code == 0
        doc = json.loads(out)
        assert isinstance(doc, dict) and isinstance(doc[key], list) and doc[key]
        values = [v for row in doc[key] for v in row.values()]
        assert "-" not in values


def test_demo_json_has_typed_errors_and_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "demo", "--format", "json")
    presets = json.loads(out)["presets"]
    assert code == 0 and all(isinstance(r["bit-exact"], bool) for r in presets)
    assert all(isinstance(r["reference err"], float) for r in presets)


def test_inspect_takes_format_as_well_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    """``inspect`` alone took ``--json``; now ``--format json|csv|table`` as every command, ``--json`` its alias."""
    code, out, _ = run(capsys, "inspect", "tests.test_inspect_cli:toy", "--format", "json")
    rep = json.loads(out)
    assert code == 0 and rep["placement"] == "post" and isinstance(rep["bias"], bool)
    code, out, _ = run(capsys, "inspect", "tests.test_inspect_cli:toy", "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and {r["section"] for r in rows} >= {"design", "sublayers"}


def test_compare_several_targets_fits_by_turning_the_table(
    capsys: pytest.CaptureFixture[str], no_columns: None
) -> None:
    code, out, _ = run(capsys, "inspect", "tests.test_inspect_cli:toy", "tests.test_inspect_cli:toy", "no_such_xyz")
    assert code == 1 and _widest(out) <= 100
    assert "unknown model type" in out
