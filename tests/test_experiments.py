"""The experiments framework end to end: every experiment's quick run writes a complete, readable result.

Parametrized over :func:`normatlas.experiments.experiments`, so every experiment file added is covered. The
claims' directions are asserted per experiment in ``test_experiments_claims_*.py``; here: the files, the fields,
the anchors, the guide's words, determinism, the CLI (list, run, report) and bad input.
"""

from __future__ import annotations

import csv
import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from normatlas.atlas.papers import paper
from normatlas.cli import main
from normatlas.experiments import base, experiment, experiments
from normatlas.experiments.base import CLAIM_FIELDS, Claim, claim, claims
from normatlas.experiments.report import find_results, render_html, write_report
from normatlas.experiments.runner import RESULT_FIELDS, run_experiment

from .experiment_runs import quick_run

NAMES = [e.name for e in experiments()]
ESSAY = Path("/work/shared/essay/the-geometry-of-normalization.txt")
CHEAP = "scale-invariance"  # the cheapest quick run: the determinism and CLI tests use it


def test_experiments_are_numbered_in_order() -> None:
    numbers = [e.number for e in experiments()]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    assert len(NAMES) >= 7


@pytest.mark.parametrize("name", NAMES)
def test_quick_run_writes_every_field(name: str) -> None:
    run = quick_run(name)
    on_disk = json.loads((run.folder / "result.json").read_text())
    assert [f for f in RESULT_FIELDS if f not in on_disk] == []
    assert on_disk == run.record
    assert on_disk["verdict"] in ("holds", "does not hold", "inconclusive")
    assert on_disk["holds"] is (on_disk["verdict"] == "holds")
    assert on_disk["scale"] == "quick" and on_disk["quick"] is True and on_disk["seeds"] == [0]
    assert on_disk["measured"], "an experiment must measure something"
    assert on_disk["seconds"] > 0 and name in on_disk["command"]
    rule = experiment(name).rule
    assert [c["statistic"] for c in on_disk["clauses"]] == list(rule.statistics)
    for c in on_disk["clauses"]:
        assert set(c["per_seed"]) == {"0"} and c["says"] and c["verdict"] in ("holds", "does not hold", "inconclusive")
    if on_disk["verdict"] != "holds":
        assert on_disk["reasons"], "a verdict other than holds says why"


@pytest.mark.parametrize("name", NAMES)
def test_figure_files_are_valid(name: str) -> None:
    folder = quick_run(name).folder
    png = (folder / "figure.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    image = mpimg.imread(folder / "figure.png")
    assert image.shape[0] >= 300 and image.shape[1] >= 600  # readable at 120 dpi
    root = ET.parse(folder / "figure.svg").getroot()
    assert root.tag.endswith("svg")


@pytest.mark.parametrize("name", NAMES)
def test_csv_match_the_series(name: str) -> None:
    run = quick_run(name)
    assert run.outcome.series, "every experiment writes its raw series"
    for key, series in run.outcome.series.items():
        with (run.folder / f"{key}.csv").open() as f:
            rows = list(csv.reader(f))
        assert tuple(rows[0]) == series.columns
        assert len(rows) - 1 == len(series.rows)
    assert sorted(run.record["files"]) == sorted(
        [f"{k}.csv" for k in run.outcome.series] + ["figure.png", "figure.svg"]
    )
    assert (run.folder / "seeds" / "quick-seed0" / "outcome.json").is_file()


def test_claims_file_and_modules_match() -> None:
    """Every claim in claims.json has its experiment module and every module its claim, with the same words."""
    assert [c.name for c in claims()] == NAMES
    for c in claims():
        exp = experiment(c.name)
        assert isinstance(exp, Claim) and Claim(**{f: getattr(exp, f) for f in CLAIM_FIELDS}) == c


def test_claim_lookup_and_malformed_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"claim='no-such-claim' is not in normatlas/data/claims.json"):
        claim("no-such-claim")
    good = json.loads((Path(base.__file__).parents[1] / "data" / "claims.json").read_text())
    bad_rows = [
        ({"claims": "x"}, "expected an object with a list 'claims'"),
        ({"claims": [{"name": "a"}]}, r"claims\[0\] must have exactly the fields"),
        ({"claims": [{**good["claims"][0], "number": "1"}]}, r"wrong type for \['number'\]"),
        ({"claims": [good["claims"][0], good["claims"][0]]}, "names and numbers must be unique"),
    ]
    for data, message in bad_rows:
        root = tmp_path / str(len(message))
        (root / "data").mkdir(parents=True)
        (root / "data" / "claims.json").write_text(json.dumps(data))
        monkeypatch.setattr(base.resources, "files", lambda _pkg, root=root: root)
        base.claims.cache_clear()
        try:
            with pytest.raises(ValueError, match=message):
                base.claims()
        finally:
            monkeypatch.undo()
            base.claims.cache_clear()
    assert [c.name for c in base.claims()] == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_anchor_and_guide_words(name: str) -> None:
    exp = experiment(name)
    assert paper(exp.anchor)["key"] == exp.anchor
    assert exp.anchor_reports.strip()
    if ESSAY.exists():
        essay = " ".join(ESSAY.read_text(encoding="utf-8").split())
        for fragment in re.split(r"\s*\[\.\.\.\]\s*", exp.guide_words):
            assert " ".join(fragment.split()) in essay, f"{name}: not verbatim in the essay: {fragment[:60]!r}"


@pytest.mark.parametrize("name", NAMES)
def test_measured_numbers_are_finite_or_absent(name: str) -> None:
    def scalars(v: object) -> list[object]:
        if isinstance(v, dict):
            return [x for item in v.values() for x in scalars(item)]
        return [x for item in v for x in scalars(item)] if isinstance(v, list) else [v]

    for key, value in quick_run(name).record["measured"].items():
        for x in scalars(value):
            assert x is None or isinstance(x, (bool, int, str)) or (isinstance(x, float) and math.isfinite(x)), (key, x)


def test_same_seed_same_numbers(tmp_path: Path) -> None:
    again = run_experiment(experiment(CHEAP), tmp_path, scale="quick", seeds=(0,))
    assert again["measured"] == quick_run(CHEAP).record["measured"]
    assert again["clauses"] == quick_run(CHEAP).record["clauses"]


def test_cli_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiments", "list", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["experiments"]
    assert [r["name"] for r in rows] == NAMES
    assert all(r["default_s"] > 0 and r["quick_s"] > 0 and r["paper_s"] > 0 and r["claim"] for r in rows)
    assert all(r["rule"] for r in rows)


def test_cli_run_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiments", "run", CHEAP, "--quick", "--out", str(tmp_path), "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^{CHEAP}: (holds|does not hold|inconclusive) \(", out, re.M) and "of 1 claims" in out
    record = json.loads((tmp_path / CHEAP / "result.json").read_text())
    assert record["command"].startswith(f"normatlas experiments run {CHEAP} --scale quick --seed 0 --seeds 1")
    assert record["seeds"] == [0] and record["scale"] == "quick"
    assert main(["experiments", "report", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    html = (tmp_path / "report.html").read_text()
    assert f"]({CHEAP}/figure.png)" in md and record["claim"] in md
    assert f'src="{CHEAP}/figure.png"' in html and "<script" not in html and "http" not in html


def test_report_of_every_quick_run() -> None:
    folder = quick_run(NAMES[0]).folder.parent
    for name in NAMES:
        quick_run(name)
    records = find_results(folder)
    assert [r["name"] for r in records] == NAMES
    md, _, _, problems = write_report(folder)
    assert problems == []
    text = md.read_text()
    assert text.count("\n## ") == len(NAMES)
    for line in text.splitlines():  # a '|' inside a cell (||W||) is escaped: every table row keeps its columns
        if line.startswith("| "):
            assert len(re.findall(r"(?<!\\)\|", line)) in (3, 5, 6), line
    assert render_html(records).count("<section") == len(NAMES)


def test_unknown_experiment(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["experiments", "run", "no-such-claim", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no-such-claim" in err and CHEAP in err
    with pytest.raises(ValueError, match="no-such-claim"):
        experiment("no-such-claim")


def test_bad_seed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["experiments", "run", CHEAP, "--seed", "-1", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--seed" in capsys.readouterr().err
    with pytest.raises(ValueError, match="seed=-1"):
        run_experiment(experiment(CHEAP), tmp_path, seeds=(-1,))
    with pytest.raises(SystemExit):
        main(["experiments", "run", CHEAP, "--seeds", "0", "--out", str(tmp_path)])
    assert "--seeds" in capsys.readouterr().err


def test_quick_and_scale_disagreeing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["experiments", "run", CHEAP, "--quick", "--scale", "paper", "--out", str(tmp_path)]) == 2
    assert "--quick is --scale quick" in capsys.readouterr().err


def test_all_stands_alone(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["experiments", "run", "all", CHEAP, "--out", str(tmp_path)]) == 2
    assert "'all' stands alone" in capsys.readouterr().err


def test_report_without_results(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["experiments", "report", "--out", str(tmp_path)]) == 2
    assert "no readable */result.json" in capsys.readouterr().err
    assert main(["experiments", "report", "--out", str(tmp_path / "missing")]) == 2
