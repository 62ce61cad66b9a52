"""The paper-scale results kept in docs/results are complete, readable records that agree with their own rule."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image as mpimg
import pytest

from normatlas.experiments import experiment
from normatlas.experiments.runner import RESULT_FIELDS, load_result

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
KEPT = sorted(p.parents[1].parent.name for p in RESULTS.glob("*/scales/paper/result.json"))


def test_some_results_are_kept() -> None:
    assert len(KEPT) >= 4, KEPT


@pytest.mark.parametrize("name", KEPT)
def test_kept_result_is_complete(name: str) -> None:
    folder = RESULTS / name / "scales" / "paper"
    record = load_result(folder)
    assert [f for f in RESULT_FIELDS if f not in record] == []
    assert record["name"] == name and record["scale"] == "paper" and len(record["seeds"]) >= 3
    assert record["verdict"] in ("holds", "does not hold", "inconclusive")
    assert [c["statistic"] for c in record["clauses"]] == list(experiment(name).rule.statistics)
    assert record["run"]["threads"] >= 1 and record["run"]["cpu"] and record["run"]["peak_rss_mib"] > 0
    image = mpimg.imread(folder / "figure.png")
    assert image.shape[0] >= 300 and image.shape[1] >= 800
    doc = (RESULTS.parents[0] / "experiments.md").read_text(encoding="utf-8")
    assert f"`{name}`" in doc
