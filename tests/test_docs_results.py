"""The paper-scale results kept in docs/results are complete, readable records that agree with their own rule."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from normatlas.experiments import experiment
from normatlas.experiments.runner import RESULT_FIELDS, load_result, statistic_from_json
from normatlas.experiments.verdict import decide

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
KEPT = sorted(p.parents[1].parent.name for p in RESULTS.glob("*/scales/paper/result.json"))
# results kept since stop 42 keep their seeds' caches too (outcome.json, figure.png, CSVs: no SVG), so that
# `experiments run NAME --scale paper --out docs/results` reads them back while the experiment's code is unchanged
WITH_SEEDS = sorted(n for n in KEPT if (RESULTS / n / "seeds").is_dir())


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


@pytest.mark.parametrize("name", WITH_SEEDS)
def test_kept_seeds_decide_the_kept_verdict(name: str) -> None:
    record = load_result(RESULTS / name / "scales" / "paper")
    outcomes = []
    for seed in record["seeds"]:
        folder = RESULTS / name / "seeds" / f"paper-seed{seed}"
        outcome = json.loads((folder / "outcome.json").read_text())
        assert outcome["key"]["seed"] == seed and outcome["key"]["scale"] == "paper"
        assert mpimg.imread(folder / "figure.png").shape[1] >= 600
        assert all((folder / f).is_file() for f in outcome["csv"])
        outcomes.append({k: statistic_from_json(v) for k, v in outcome["statistics"].items()})
    verdict, clauses, _ = decide(experiment(name).rule, record["seeds"], outcomes)
    assert verdict.value == record["verdict"]
    assert [c["per_seed"] for c in clauses] == [c["per_seed"] for c in record["clauses"]]


def test_the_page_shows_the_kept_results() -> None:
    # `normatlas serve --experiments docs/results`: every kept result is listed with its figure, nothing unreadable
    from normatlas.web.catalog import experiments_view

    view = experiments_view(RESULTS)
    assert view["errors"] == []
    shown = {r["name"]: r for r in view["results"]}
    assert sorted(shown) == KEPT
    for r in shown.values():
        assert r["scale"] == "paper" and r["figures"]["png"] == f"/experiments/{r['name']}/figure.png"
        assert r["series"], r["name"]


def _standing_table() -> dict[str, str]:
    """docs/experiments.md's "where every claim stands" table: experiment name -> its verdict cell."""
    doc = (RESULTS.parents[0] / "experiments.md").read_text(encoding="utf-8")
    section = doc.split("## Paper scale: where every claim stands", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| ") and "`" in line]
    return {cells[1].strip("` "): cells[4] for cells in rows}


@pytest.mark.parametrize("name", KEPT)
def test_the_docs_table_says_the_kept_verdict(name: str) -> None:
    # the table may name two runs of a claim (an earlier one and the kept one); the kept verdict must be among them
    cell = _standing_table()[name]
    said = re.findall(r"does not hold|holds|inconclusive", cell)
    assert load_result(RESULTS / name / "scales" / "paper")["verdict"] in said, (name, cell)


def test_the_readme_counts_the_kept_verdicts() -> None:
    readme = (RESULTS.parents[1] / "README.md").read_text(encoding="utf-8")
    said = re.search(r"\((\d+) of (\d+) claims hold there, (\d+) do not, (\d+) (?:is|are)\s+inconclusive", readme)
    assert said, "README.md: the sentence counting the kept verdicts"
    verdicts = [load_result(RESULTS / n / "scales" / "paper")["verdict"] for n in KEPT]
    counts = (verdicts.count("holds"), len(verdicts), verdicts.count("does not hold"), verdicts.count("inconclusive"))
    assert tuple(int(g) for g in said.groups()) == counts
