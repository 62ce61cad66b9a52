"""The package's one atomic writer and one JSON encoding (normatlas._io), and every caller agreeing on them."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from normatlas import _io
from normatlas._io import atomic_write, dumps, jsonable
from normatlas.cli import main
from normatlas.cli._format import Section, emit
from normatlas.diagnostics.sinks import JSONLSink
from normatlas.experiments import Experiment, Outcome, RunContext, Series, runner
from normatlas.experiments.base import estimates
from normatlas.experiments.report import write_report
from normatlas.experiments.runner import load_result, run_experiment, use_agg
from normatlas.experiments.verdict import Clause, Direction, Diverged, VerdictRule
from tests.web_helpers import running

SRC = Path(__file__).resolve().parents[1] / "src"

NON_FINITE = {
    "nan": math.nan, "inf": math.inf, "ninf": -math.inf, "list": [math.nan, 1.5], "nested": {"x": [[math.inf]]},
    "tensor": torch.tensor([math.inf, 2.0]), "scalar": torch.tensor(math.nan),
}  # fmt: skip
AS_JSON = {"nan": None, "inf": None, "ninf": None, "list": [None, 1.5], "nested": {"x": [[None]]},
           "tensor": [None, 2.0], "scalar": None}  # fmt: skip


def strict_loads(text: str | bytes) -> Any:
    """``json.loads`` as a browser's JSON.parse: NaN, Infinity and -Infinity are not JSON."""

    def refuse(token: str) -> Any:
        raise AssertionError(f"{token} in the JSON text: not strict JSON")

    return json.loads(text, parse_constant=refuse)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


# ---------------------------------------------------------------------------------------------- the encoding
def test_non_finite_floats_are_null_and_the_rest_keeps_its_type() -> None:
    assert jsonable(NON_FINITE) == AS_JSON
    assert strict_loads(dumps(NON_FINITE)) == AS_JSON
    assert jsonable({"d": Diverged("loss", 3), "dir": Direction.ABOVE, "p": Path("a/b"), 1: (True, 2, "s")}) == {
        "d": {"diverged": "loss", "step": 3}, "dir": Direction.ABOVE.value, "p": "a/b", "1": [True, 2, "s"],
    }  # fmt: skip


def test_strict_names_a_value_of_no_json_meaning() -> None:
    assert jsonable({"o": object}) == {"o": str(object)}
    with pytest.raises(TypeError, match=r"value <class 'object'> of type type is not a JSON scalar"):
        jsonable({"o": object}, strict=True)


# ---------------------------------------------------------------------------------------------- the writer
def test_writes_bytes_text_and_through_a_callable(tmp_path: Path) -> None:
    assert atomic_write(tmp_path / "new" / "a.bin", b"\x00\x01") == tmp_path / "new" / "a.bin"
    assert (tmp_path / "new" / "a.bin").read_bytes() == b"\x00\x01"
    atomic_write(tmp_path / "b.txt", "é\n")
    assert (tmp_path / "b.txt").read_text(encoding="utf-8") == "é\n"
    seen: list[Path] = []

    def write(p: Path) -> None:
        seen.append(p)
        p.write_text("via callable")

    atomic_write(tmp_path / "fig.png", write)
    assert (tmp_path / "fig.png").read_text() == "via callable"
    assert seen[0].parent == tmp_path and seen[0].name.startswith(".fig.png.") and seen[0].suffix == ".png"
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "b.txt").stat().st_mode & 0o777 == 0o666 & ~umask  # as open() would, not mkstemp's 0o600
    assert leftovers(tmp_path) == [] and leftovers(tmp_path / "new") == []


def test_refuses_data_of_another_type(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"data=int must be bytes, str or a callable"):
        atomic_write(tmp_path / "x", 3)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_the_experiments_write_through_the_same_writer() -> None:
    assert runner.atomic_write is atomic_write  # the depth set imports it from the runner


def test_threads_writing_one_path_never_collide(tmp_path: Path) -> None:
    target = tmp_path / "result.json"
    payloads = [(str(i) * 50_000).encode() for i in range(4)]
    start = threading.Barrier(len(payloads))
    errors: list[BaseException] = []

    def writer(blob: bytes) -> None:
        start.wait()
        try:
            for _ in range(30):
                atomic_write(target, blob)
                assert target.read_bytes() in payloads  # whole, whoever wrote last
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(b,)) for b in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert target.read_bytes() in payloads and leftovers(tmp_path) == []


def test_processes_writing_one_path_never_collide(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    code = (
        "import sys; from normatlas._io import atomic_write, dumps\n"
        "for i in range(200): atomic_write(sys.argv[1], dumps({'writer': sys.argv[2], 'pad': 'x' * 20000}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(target), name], env=env, stderr=subprocess.PIPE)
        for name in ("a", "b")
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    assert strict_loads(target.read_text())["writer"] in {"a", "b"} and leftovers(tmp_path) == []


class Boom(Exception):
    pass


def half_then_fail(p: Path) -> None:
    p.write_text('{"half": ')
    raise Boom("the disk went away")


@pytest.mark.parametrize("where", ["in the callable", "at fsync", "at rename", "on ctrl-c"])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    target = tmp_path / "result.json"
    target.write_text("old")
    data: Any = "new"
    if where == "in the callable":
        data = half_then_fail
    elif where == "at fsync":
        monkeypatch.setattr(_io.os, "fsync", lambda fd: (_ for _ in ()).throw(Boom("fsync")))
    elif where == "at rename":
        monkeypatch.setattr(_io.os, "replace", lambda a, b: (_ for _ in ()).throw(Boom("replace")))
    else:
        monkeypatch.setattr(_io.os, "write", lambda fd, b: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises((Boom, KeyboardInterrupt)):
        atomic_write(target, data)
    assert target.read_text() == "old" and leftovers(tmp_path) == []
    with pytest.raises(Boom):
        atomic_write(tmp_path / "fresh.json", half_then_fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]  # no partial file where none was


# ---------------------------------------------------------------------------------------------- every caller
def non_finite_run(ctx: RunContext) -> Outcome:
    plt = use_agg()
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [0, 1])
    ax.set(title="a claim with non-finite measurements", xlabel="x", ylabel="y")
    return Outcome({"ratio": 2.0}, dict(NON_FINITE), {"s": Series.of(x=[1])}, fig)


NON_FINITE_EXPERIMENT = Experiment(
    name="non-finite", number=98, title="non-finite", claim="a claim", guide_words="words", anchor="none",
    anchor_reports="nothing", rule=VerdictRule((Clause("ratio", Direction.ABOVE, 1.0, "the ratio is above one"),)),
    estimates_s=estimates(default=1, quick=1, paper=1), run=non_finite_run,
)  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("experiments")
    run_experiment(NON_FINITE_EXPERIMENT, out, scale="quick", seeds=(0,))
    return out


def test_result_json_is_strict_and_reads_back(results: Path) -> None:
    folder = results / "non-finite"
    assert strict_loads((folder / "result.json").read_text())["measured"] == AS_JSON
    assert strict_loads((folder / "seeds" / "quick-seed0" / "outcome.json").read_text())["measured"] == AS_JSON
    assert load_result(folder)["measured"] == AS_JSON
    md, _, _, problems = write_report(results)
    assert problems == [] and "| nan | n/a |" in md.read_text()


def test_the_web_api_sends_the_same_json(results: Path, tmp_path: Path) -> None:
    folder = results / "non-finite"
    record = json.loads((folder / "result.json").read_text())
    shutil.copytree(folder, tmp_path / "non-finite")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    plain = {**NON_FINITE, "tensor": [math.inf, 2.0], "scalar": math.nan}
    # NaN and Infinity tokens (json.dumps' default), as another writer or an older normatlas may leave them
    (legacy / "result.json").write_text(json.dumps({**record, "name": "legacy", "measured": plain}))
    (tmp_path / "root").mkdir()
    with running(tmp_path / "root", tmp_path) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
        conn.request("GET", "/api/experiments")
        res = conn.getresponse()
        body = res.read()
        conn.close()
    assert res.status == 200
    doc = strict_loads(body)
    assert doc["errors"] == [] and [r["name"] for r in doc["results"]] == ["legacy", "non-finite"]
    assert [r["measured"] for r in doc["results"]] == [AS_JSON, AS_JSON]


def test_cli_json_output_and_the_jsonl_sink_agree(results: Path, tmp_path: Path) -> None:
    buf = io.StringIO()
    emit([Section("rows", [NON_FINITE])], "json", meta={"worst": math.inf}, stream=buf)
    doc = strict_loads(buf.getvalue())
    assert doc["rows"] == [AS_JSON] and doc["worst"] is None
    sink = JSONLSink(tmp_path / "log.jsonl")
    sink.write({"step": 1, **NON_FINITE})
    sink.close()
    assert strict_loads((tmp_path / "log.jsonl").read_text()) == {"step": 1, **AS_JSON}
    folder = tmp_path / "edited"
    folder.mkdir()
    record = json.loads((results / "non-finite" / "result.json").read_text())
    (folder / "result.json").write_text(json.dumps({**record, "seconds": math.nan}))  # a NaN token on disk
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["experiments", "report", "--out", str(tmp_path), "--json"]) == 0
    rows = strict_loads(out.getvalue())["report"]
    assert [r["seconds"] for r in rows] == [None]


def test_read_json_names_the_file_and_where_it_breaks(tmp_path: Path) -> None:
    good, cut, binary = tmp_path / "good.json", tmp_path / "cut.json", tmp_path / "binary.json"
    good.write_text('{"a": NaN, "b": [1, 2]}')  # NaN tokens read (lenient), though never written
    cut.write_text('{"a": [1, 2')
    binary.write_bytes(b'{"a": "\xff"}')
    doc = _io.read_json(good)
    assert math.isnan(doc["a"]) and doc["b"] == [1, 2]
    with pytest.raises(ValueError, match=r"cut\.json is not valid JSON \(truncated or malformed\? line 1 column 12"):
        _io.read_json(cut)
    with pytest.raises(ValueError, match=r"binary\.json is not valid JSON \(not UTF-8 text: invalid start byte"):
        _io.read_json(binary)
    with pytest.raises(FileNotFoundError):
        _io.read_json(tmp_path / "missing.json")
