"""``normatlas matrix --check --from FILE``: a malformed sweep file is one clear error line, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from normatlas.cli import main


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"olmo2": {"operator": "rmsnorm"}}', "holds a JSON object"),
        ('[{"name": "olmo2"}]', "entry 0 has no string 'model'"),
        ('[{"model": "olmo2"}, 3]', "entry 1 is a JSON number"),
        ("not json", "not JSON"),
    ],
)
def test_malformed_sweep_file_is_a_cli_error(
    text: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = tmp_path / "sweep.json"
    sweep.write_text(text)
    assert main(["matrix", "--check", "--from", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"normatlas matrix: error: --from {sweep}: {problem}")
    assert "must be a JSON list of objects" in err and "'model' key" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_missing_sweep_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["matrix", "--check", "--from", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def _papers_json(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict]:
    import json

    assert main(["papers", *argv, "--format", "json"]) == 0
    return list(json.loads(capsys.readouterr().out)["papers"])


def test_papers_table_groups_each_question_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from normatlas.atlas.papers import PAPER_GROUPS, papers

    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["papers"]) == 0
    out = capsys.readouterr().out
    total, verified = len(papers()), sum(r["verified"] is not None for r in papers())
    assert out.startswith(f"{total} papers, {verified} verified")
    for group in PAPER_GROUPS:
        assert out.count(f"group: {group}") == 1, group
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "2502.02732" in out and "Root Mean Square Layer Normalization" in out


def test_papers_filters(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _papers_json(capsys, "--question", "can normalization")
    assert rows and all(r["group"] == "Can normalization be removed?" for r in rows)
    rows = _papers_json(capsys, "--search", "hypersphere")
    assert "ngpt2024" in {r["key"] for r in rows}
    from normatlas.atlas.papers import papers

    unverified = _papers_json(capsys, "--unverified")
    assert all(r["verified"] is None and r["link"] is None for r in unverified)
    verified = _papers_json(capsys, "--verified")
    assert verified and all(r["verified"] and r["link"] for r in verified)
    assert len(verified) + len(unverified) == len(papers())  # every record is in exactly one (today: all confirmed)
    with pytest.raises(SystemExit) as exc:  # mutually exclusive, refused by argparse
        main(["papers", "--verified", "--unverified"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_papers_json_carries_links_search_and_implementers(capsys: pytest.CaptureFixture[str]) -> None:
    rows = {r["key"]: r for r in _papers_json(capsys)}
    rms = rows["rmsnorm2019"]
    assert rms["link"] == "https://arxiv.org/abs/1910.07467"
    assert (
        rms["search"].startswith("https://arxiv.org/search/?query=Root+Mean+Square")
        and "normatlas.presets.RMSNorm" in rms["implemented_by"]
    )
    folding = rows["enjoy_layernorm"]  # confirmed on arXiv's HTML page; the link is the abstract page
    assert folding["link"] == "https://arxiv.org/abs/2605.14521" and "searchtype=title" in folding["search"]


def test_papers_links_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["papers", "--links", "--question", "removed"]) == 0
    out = capsys.readouterr().out
    assert "https://arxiv.org/abs/2503.10622" in out and "https://arxiv.org/abs/1901.09321" in out  # unbroken
    assert "'search' field" in out and max(len(line) for line in out.splitlines()) <= 100
    assert main(["papers", "--links", "--format", "json"]) == 2
    assert "--links only changes the table" in capsys.readouterr().err
