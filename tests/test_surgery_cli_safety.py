"""The surgery commands at the CLI: nothing lost, nothing silently changed (issue 18, part 1).

Where the output may go (never the input, inside it or around it; ``--force`` replaces only an earlier
normatlas output), every argument and the output location refused before loading, "nothing to change" as
exit 3, one JSON document per command, one load policy for fold / convert / verify / diagnose / inspect, and
interrupted writes that leave nothing behind. Checkpoints are the tiny configs of tests/tiny_hf.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import normatlas  # noqa: E402
import normatlas.surgery  # noqa: E402
from normatlas.cli import main  # noqa: E402
from normatlas.surgery import MANIFEST  # noqa: E402

from .test_surgery_hf import tiny  # noqa: E402


def run(argv: list[str]) -> int:
    """``main(argv)``'s exit code; an argparse refusal (SystemExit) counts as its code."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def _save(model: torch.nn.Module, path: Path, **kw: object) -> Path:
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path, **kw)
    return path


def make_gpt2_dir(path: Path) -> Path:
    """Tiny GPT-2 (GPT-2 small: 768 wide, 12 layers), with the files a real checkpoint carries beside the weights."""
    _save(tiny("gpt2"), path)
    (path / "README.md").write_text("# tiny gpt2\n")
    (path / "chat_template.jinja").write_text("{{ messages }}")
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 32}))
    (path / "extra").mkdir()
    (path / "extra" / "notes.json").write_text("{}")
    return path


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gpt2_dir(tmp_path_factory.mktemp("ckpt") / "gpt2")


@pytest.fixture()
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a checkpoint fails the test: the refusal must come before any heavy work."""

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("the checkpoint was loaded before the refusal")

    monkeypatch.setattr(normatlas.surgery, "load_checkpoint", refuse)
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --- where the output may go ------------------------------------------------------------------------------


def test_force_onto_the_inputs_parent_is_refused_and_deletes_nothing(gpt2_dir, tmp_path, capsys) -> None:
    parent = tmp_path / "parent"
    ckpt = parent / "ckpt"
    shutil.copytree(gpt2_dir, ckpt)
    (parent / "unrelated.txt").write_text("keep me")
    before = sorted(p.name for p in ckpt.iterdir())
    assert run(["fold", "--force", str(ckpt), str(parent)]) == 2
    assert "contains the input" in _one_line(capsys.readouterr().err)
    assert (parent / "unrelated.txt").read_text() == "keep me" and sorted(p.name for p in ckpt.iterdir()) == before


def test_force_onto_the_input_itself_is_refused_and_deletes_nothing(gpt2_dir, tmp_path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(gpt2_dir, ckpt)
    before = sorted(p.name for p in ckpt.iterdir())
    assert run(["fold", "--force", str(ckpt), str(ckpt)]) == 2
    assert "is the input checkpoint itself" in _one_line(capsys.readouterr().err)
    assert sorted(p.name for p in ckpt.iterdir()) == before and (ckpt / "generation_config.json").is_file()


def test_output_inside_the_input_or_through_a_symlink_is_refused(gpt2_dir, tmp_path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(gpt2_dir, ckpt)
    link = tmp_path / "link"
    link.symlink_to(ckpt)
    assert run(["fold", str(ckpt), str(ckpt / "sub")]) == 2
    assert "inside the input" in _one_line(capsys.readouterr().err)
    assert run(["fold", "--force", str(ckpt), str(link)]) == 2  # the symlink is the input itself
    assert "input checkpoint itself" in _one_line(capsys.readouterr().err)
    assert not (ckpt / "sub").exists() and (ckpt / "generation_config.json").is_file()


def test_force_replaces_an_earlier_output_but_never_an_arbitrary_folder(gpt2_dir, tmp_path, capsys) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    assert run(["fold", "--force", str(gpt2_dir), str(mine)]) == 2
    assert "was not written by normatlas" in _one_line(capsys.readouterr().err)
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.tex"]
    out = tmp_path / "out"
    assert run(["fold", str(gpt2_dir), str(out)]) == 0
    assert run(["fold", str(gpt2_dir), str(out)]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "--force" in err and "force=True" not in err  # the CLI's switch, not the Python argument
    assert run(["fold", "--force", str(gpt2_dir), str(out)]) == 0
    assert (out / MANIFEST).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]  # nothing set aside is left


# --- cheap checks first -----------------------------------------------------------------------------------


def test_dry_run_with_an_output_is_refused_before_loading(gpt2_dir, tmp_path, no_load, capsys) -> None:
    assert run(["fold", "--dry-run", str(gpt2_dir), str(tmp_path / "out")]) == 2
    assert "--dry-run" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_a_missing_output_is_refused_before_loading(gpt2_dir, no_load, capsys) -> None:
    assert run(["fold", str(gpt2_dir)]) == 2
    assert "OUTPUT" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("flag", "value", "argv"),
    [
        ("--tol", "nan", ["fold"]),
        ("--tol", "-1", ["fold"]),
        ("--tol", "0", ["convert", "ln-rms"]),
        ("--tol64", "inf", ["fold"]),
        ("--tol64", "abc", ["verify"]),
        ("--eps", "0", ["convert", "eps"]),
        ("--eps", "-1e-6", ["convert", "eps"]),
        ("--eps", "nan", ["convert", "eps"]),
    ],
)
def test_numbers_must_be_positive_finite_refused_by_name_before_loading(
    gpt2_dir, tmp_path, no_load, capsys, flag, value, argv
) -> None:
    paths = [str(gpt2_dir), str(gpt2_dir)] if argv == ["verify"] else [str(gpt2_dir), str(tmp_path / "out")]
    assert run([*argv, *paths, f"{flag}={value}"]) == 2
    err = capsys.readouterr().err
    assert flag in err and "positive finite" in err
    assert not (tmp_path / "out").exists()


def test_convert_gain_without_to_is_refused_before_loading(gpt2_dir, tmp_path, no_load, capsys) -> None:
    assert run(["convert", "gain", str(gpt2_dir), str(tmp_path / "out")]) == 2
    assert "--to" in _one_line(capsys.readouterr().err)


def test_a_read_only_output_location_is_one_line_before_loading(gpt2_dir, tmp_path, no_load, monkeypatch, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path, *a, **k):  # the tests may run as root, where chmod 0o555 does not stop a write
        if Path(path).parent == ro or Path(path) == ro / "out":
            raise PermissionError(13, "Permission denied", str(path))
        return real_mkdir(path, *a, **k)

    monkeypatch.setattr(os, "mkdir", mkdir)
    assert run(["fold", str(gpt2_dir), str(ro / "out")]) == 2
    assert "Permission denied" in _one_line(capsys.readouterr().err)
    assert list(ro.iterdir()) == []


def test_a_full_disk_is_one_line_and_leaves_nothing(gpt2_dir, tmp_path, monkeypatch, capsys) -> None:
    import safetensors.torch

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert run(["fold", str(gpt2_dir), str(tmp_path / "out")]) == 2
    assert "No space left on device" in _one_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_a_config_that_is_not_json_is_one_line(gpt2_dir, tmp_path, capsys) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(gpt2_dir, bad)
    (bad / "config.json").write_text("{'model_type': 'gpt2',")  # Python, not JSON
    for argv in (["fold", str(bad), str(tmp_path / "out")], ["verify", str(gpt2_dir), str(bad)]):
        assert run(argv) == 2
        assert "config.json is not valid JSON" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


# --- nothing to change --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "what"), [("llama", "ln-rms"), ("gpt2", "bn-fold"), ("gpt2", "bn-frozen")])
def test_a_conversion_that_changes_nothing_says_so_writes_nothing_exit_3(family, what, tmp_path, capsys) -> None:
    ckpt = _save(tiny(family), tmp_path / "ckpt")
    out = tmp_path / "out"
    assert run(["convert", what, str(ckpt), str(out)]) == 3
    assert "nothing to change" in capsys.readouterr().out
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert run(["convert", what, str(ckpt), str(out), "--format", "json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert doc["result"] == "nothing to change" and doc["written"] is False


def test_exit_codes_are_documented_in_the_help(capsys) -> None:
    for cmd in (["fold"], ["convert"], ["verify"]):
        assert run([*cmd, "--help"]) == 0
        assert "3 nothing to change" in capsys.readouterr().out


# --- one JSON document ---------------------------------------------------------------------------------------


def test_fold_convert_verify_print_one_json_document(gpt2_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert run(["fold", str(gpt2_dir), str(out), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["written"] is True and doc["changes"] and doc["checks"]
    assert all(isinstance(c["max_rel"], float) and isinstance(c["passed"], bool) for c in doc["checks"])
    assert run(["verify", str(gpt2_dir), str(out), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] is True and all(c["passed"] is True for c in doc["checks"])
    assert run(["convert", "ln-rms", str(gpt2_dir), "--dry-run", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["result"] == "verified" and doc["written"] is False


# --- one load policy -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_pickle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BERT folder whose weights are only a pickle (BERT-base: 768 wide, 12 layers; here 32 wide, 2 layers)."""
    from .tiny_hf import tiny_model

    path = tmp_path_factory.mktemp("pickled") / "bert"
    model = tiny_model("bert", "BertModel", vocab_size=64)
    model.config.architectures = ["BertModel"]
    model.config.save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat"]))
    return path


def test_diagnose_and_inspect_refuse_a_pickle_as_fold_does(bert_pickle_dir, tmp_path, capsys) -> None:
    for argv in (
        ["fold", str(bert_pickle_dir), str(tmp_path / "out")],
        ["diagnose", "--model", str(bert_pickle_dir)],
        ["inspect", str(bert_pickle_dir)],
    ):
        assert run(argv) == 2, argv
        err = _one_line(capsys.readouterr().err)
        assert "pytorch_model.bin" in err and "safetensors only" in err, err


def test_diagnose_without_a_tokenizer_says_so(tmp_path, capsys) -> None:
    from .tiny_hf import tiny_model

    path = tmp_path / "bert"
    model = tiny_model("bert", "BertModel")
    model.config.architectures = ["BertModel"]
    model.save_pretrained(path)
    capsys.readouterr()
    assert run(["diagnose", "--model", str(path)]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "has no tokenizer" in err and "install" not in err  # not "install sentencepiece"


def test_diagnose_refuses_an_empty_sentence_before_loading(no_load, capsys) -> None:
    assert run(["diagnose", "--sentence", ""]) == 2
    assert "--sentence" in capsys.readouterr().err


def test_diagnose_a_config_that_is_not_json_is_one_line(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text("not json")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert run(["diagnose", "--model", str(tmp_path)]) == 2
    assert "config.json is not valid JSON" in _one_line(capsys.readouterr().err)


# --- interrupted writes -------------------------------------------------------------------------------------

_KILL_MID_WRITE = """
import os, signal, sys
import normatlas.surgery.io as sio
from normatlas.cli import main
def die(*a, **k):
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
sio._check_written = die  # the temporary folder holds the written files by now
sys.exit(main(["fold", sys.argv[2], sys.argv[3]]))
"""


def _kill_mid_write(sig: str, ckpt: Path, out: Path) -> subprocess.CompletedProcess[str]:
    src = Path(normatlas.__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), str(Path(__file__).resolve().parents[1])]))
    return subprocess.run(
        [sys.executable, "-c", _KILL_MID_WRITE, sig, str(ckpt), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_sigterm_during_a_write_leaves_nothing_behind(gpt2_dir, tmp_path) -> None:
    proc = _kill_mid_write("SIGTERM", gpt2_dir, tmp_path / "out")
    assert proc.returncode in (128 + signal.SIGTERM, -signal.SIGTERM), proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_after_a_sigkill_the_next_write_removes_the_leftover_and_says_so(gpt2_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    proc = _kill_mid_write("SIGKILL", gpt2_dir, out)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(leftovers) == 1 and not out.exists()
    assert run(["fold", str(gpt2_dir), str(out)]) == 0
    assert f"removed {leftovers[0]}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_ctrl_c_during_a_write_leaves_nothing_behind(gpt2_dir, tmp_path, monkeypatch) -> None:
    import normatlas.surgery.io as sio

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sio, "_check_written", interrupt)
    try:
        code = run(["fold", str(gpt2_dir), str(tmp_path / "out")])
    except KeyboardInterrupt:
        code = 130
    assert code == 130 and list(tmp_path.iterdir()) == []


def test_an_output_that_needs_its_swaps_is_refused_as_input(gpt2_dir, tmp_path, capsys) -> None:
    gain = tmp_path / "gain"
    assert run(["convert", "gain", str(gpt2_dir), str(gain), "--to", "1+w"]) == 0
    capsys.readouterr()
    assert run(["fold", str(gain), str(tmp_path / "folded")]) == 2  # its stock structure is another model
    assert "runtime swaps" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "folded").exists()


def test_the_slow_steps_declare_their_phases(gpt2_dir, monkeypatch, capsys) -> None:
    """Loading, analysing and verifying each run inside a progress phase (drawn: tests/test_cli_core.py)."""
    import contextlib

    from normatlas.cli import surgery as cli_surgery

    seen: list[str] = []

    @contextlib.contextmanager
    def phase(message: str, **kw: object):  # type: ignore[no-untyped-def]
        seen.append(message)
        yield None

    monkeypatch.setattr(cli_surgery.progress, "phase", phase)
    assert run(["convert", "ln-rms", str(gpt2_dir), "--dry-run"]) == 0
    assert [m.split(" ")[0] for m in seen] == ["loading", "analysing", "verifying"], seen
