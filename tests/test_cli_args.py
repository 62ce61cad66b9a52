"""Nonsense arguments are refused by name, before any work starts (they used to be accepted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from normatlas.cli import main


def _usage_error(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """argparse refuses it: exit 2 through SystemExit, the option named in its one error line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("option", "value", "rule"),
    [
        ("--min-time", "-1", "must be a finite number >= 0, got -1"),
        ("--min-time", "nan", "must be a finite number >= 0, got nan"),
        ("--min-time", "soon", "must be a number, got 'soon'"),
        ("--repeats", "-3", "must be an integer >= 1, got -3"),
        ("--repeats", "2.5", "must be an integer, got '2.5'"),
    ],
)
def test_bench_numbers(option: str, value: str, rule: str, capsys: pytest.CaptureFixture[str]) -> None:
    # --provider nope: were the number accepted, the command would stop there, quickly, without SystemExit
    argv = ["bench", "rms", "--shape", "1x8", "--provider", "nope", option, value]
    _usage_error(capsys, argv, f"argument {option}: {rule}")


@pytest.mark.parametrize("value", ["-1", "0", "inf"])
def test_sweep_timeout_must_be_positive(value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["inspect", "--all-transformers", "--only", "not_a_model_type", "--timeout", value, "--out", str(tmp_path)]
    _usage_error(capsys, argv, f"argument --timeout: must be a finite number > 0, got {value}")


def _cli_error(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_only_refuses_unknown_model_types(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--only bogus`` swept nothing useful and exited 0; now it names the bad entry (and a close match)."""
    argv = ["inspect", "--all-transformers", "--only", "gpt2,bogus", "--out", str(tmp_path)]
    _cli_error(capsys, argv, "--only bogus: not a model type of the installed transformers")
    _cli_error(capsys, [*argv[:3], "lama", *argv[4:]], "did you mean llama")
    _cli_error(capsys, [*argv[:3], "gpt2,", *argv[4:]], "an empty model type")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "llama", "--timeout", "5"], "--timeout: only with --all-transformers"),
        (["inspect", "llama", "--only", "gpt2"], "--only: only with --all-transformers"),
        (["inspect", "--all-transformers", "llama", "--only", "no_such_xyz"], "drop the TARGET(s) llama"),
        (["inspect", "--all-transformers", "--norms", "--only", "no_such_xyz"], "--norms: not with --all-transformers"),
        (["inspect", "llama", "gpt2", "--norms"], "give a single TARGET"),
        (["inspect"], "give a TARGET"),
        (["matrix", "--agreements"], "--agreements needs --check"),
        (["matrix", "--from", "sweep.json"], "--from needs --check"),
        (["matrix", "--check", "--family", "Gemma"], "--family: not with --check"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_combinations_that_mean_nothing(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    _cli_error(capsys, argv, message)


def test_matrix_filters_are_choices(capsys: pytest.CaptureFixture[str]) -> None:
    _usage_error(capsys, ["matrix", "--operator", "bogus"], "argument --operator: 'bogus' is not one of layernorm")
    _usage_error(capsys, ["matrix", "--placement", "middle"], "argument --placement: 'middle' is not one of pre")
    assert main(["matrix", "--operator", "RMSNorm", "--format", "json"]) == 0  # case-insensitive
