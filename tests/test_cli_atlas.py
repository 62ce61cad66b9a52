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
