"""Bad input tried as a user would (issue 35, "Reliability"): each case a clear 4xx, ValueError/TypeError or one
line and a non-zero exit, never a traceback, a stall, a crash or a silent fallback."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_web_api import call
from tests.web_helpers import running

# ---------------------------------------------------------------- the web server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running(tmp_path_factory.mktemp("hard-web")) as srv:
        yield srv


def _raw(srv: Any, data: bytes, *, shut: bool = False, timeout: float = 10.0) -> bytes:
    """What the server answers to ``data`` sent on a fresh socket (``shut``: the client then closes its side)."""
    with socket.create_connection(("127.0.0.1", srv.server_address[1]), timeout=timeout) as sock:
        sock.sendall(data)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
    return reply


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.") else 0


@pytest.mark.parametrize(
    "host",
    ["localhost:80@evil.com", "localhost@evil.com", "127.0.0.1:80/evil", "localhost:abc", "localhost:", "::1",
     "[::1", "localhost.evil.com", "evil.com#localhost", "localhost:80:80", "localhost 80", "127.0.0.1:123456", ""],
)  # fmt: skip
def test_a_host_header_that_is_not_exactly_a_loopback_name_and_port_is_refused(server: Any, host: str) -> None:
    status, _, doc = call(server, "GET", "/api/health", headers={"Host": host})
    assert status == 403 and "Host" in doc["error"], (host, status, doc)


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8080", "127.0.0.1", "127.0.0.1:{port}", "[::1]:80", "[::1]"])
def test_a_loopback_host_with_or_without_a_port_is_served(server: Any, host: str) -> None:
    status, _, _ = call(server, "GET", "/api/health", headers={"Host": host.format(port=server.server_address[1])})
    assert status == 200, host


NORMALIZE = {"layout": "BTD", "reduce": ["feature"]}


@pytest.mark.parametrize("value", [1e308, -1e308, 1e200])
def test_normalize_refuses_values_whose_squares_overflow(server: Any, value: float) -> None:
    status, _, doc = call(server, "POST", "/api/normalize", {**NORMALIZE, "input": [[[value, 1.0, 2.0]]]})
    assert status == 400 and "input" in doc["error"] and "1e+150" in doc["error"], doc
    body = {**NORMALIZE, "input": [[[0.0, 1.0, 2.0]]], "upstream": [[[value, 1.0, 2.0]]]}
    status, _, doc = call(server, "POST", "/api/normalize", body)
    assert status == 400 and "upstream" in doc["error"], doc


def test_normalize_answers_large_but_representable_values(server: Any) -> None:
    status, _, doc = call(server, "POST", "/api/normalize", {**NORMALIZE, "input": [[[1e150, -1e150, 3e149]]]})
    assert status == 200 and doc["stats"]["after"]["max"] < 2, doc


@pytest.mark.parametrize("raw", [b"[" * 5000 + b"]" * 5000, b'{"a":' * 5000 + b"1" + b"}" * 5000])
def test_json_nested_thousands_deep_is_a_400(server: Any, raw: bytes) -> None:
    status, _, doc = call(server, "POST", "/api/normalize", raw=raw)
    assert status == 400 and "nested" in doc["error"], doc
    assert call(server, "GET", "/api/health")[0] == 200


def test_a_body_shorter_than_its_content_length_is_answered_at_once_when_the_client_stops(server: Any) -> None:
    head = b"POST /api/normalize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    t0 = time.perf_counter()
    reply = _raw(server, head + b"Content-Length: 100\r\n\r\n" + b'{"layout":', shut=True)
    assert _status(reply) == 400 and b"shorter than its Content-Length" in reply, reply
    assert time.perf_counter() - t0 < 5


def test_a_body_that_stalls_times_out_quickly_with_a_408(server: Any) -> None:
    head = b"POST /api/normalize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    assert server.body_timeout <= 5  # seconds; the default
    was, server.body_timeout = server.body_timeout, 0.5
    try:
        t0 = time.perf_counter()
        reply = _raw(server, head + b"Content-Length: 100\r\n\r\n" + b'{"layout":')
        took = time.perf_counter() - t0
    finally:
        server.body_timeout = was
    assert _status(reply) == 408 and b"100" in reply, reply
    assert took < 3, took


def test_clients_that_hang_up_leave_no_traceback(server: Any, capfd: pytest.CaptureFixture[str]) -> None:
    port = server.server_address[1]
    requests = [
        b"POST /api/normalize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 999999\r\n\r\n",
        b"POST /api/normalize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n\r\n{",
        b"GET /api/taxonomy HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /static/app.js HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"\x16\x03\x01 garbage\r\n\r\n",
    ]
    for _ in range(3):
        for data in requests:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
            sock.sendall(data)
            sock.close()
    time.sleep(0.5)
    assert call(server, "GET", "/api/health")[0] == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err and "ConnectionReset" not in err, err[-2000:]


def _handler_threads() -> int:
    return sum(1 for t in threading.enumerate() if "process_request" in t.name)


def test_idle_sockets_hold_a_bounded_number_of_threads(server: Any) -> None:
    port = server.server_address[1]
    base = _handler_threads()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(server.max_threads + 40)]
    try:
        time.sleep(0.5)
        assert _handler_threads() - base <= server.max_threads
        reply = _raw(server, b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", timeout=5)
        assert reply == b"" or _status(reply) == 503, reply  # refused at once (or closed), never left hanging
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while call(server, "GET", "/api/health")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert call(server, "GET", "/api/health")[0] == 200


# ---------------------------------------------------------------- short, clear errors


def test_param_groups_refuses_a_module_with_nothing_to_optimize() -> None:
    from torch import nn

    from normatlas.diagnostics import param_groups

    with pytest.raises(ValueError, match=r"model=ReLU has nothing to optimize: it has no parameters"):
        param_groups(nn.ReLU())
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match=r"model=Linear .* all 2 of its parameters are frozen"):
        param_groups(frozen)
    with pytest.raises(TypeError, match=r"model must be an nn\.Module"):
        param_groups("not a model")  # type: ignore[arg-type]


def test_inspect_vision_of_an_unknown_type_is_one_short_line(capsys: pytest.CaptureFixture[str]) -> None:
    from normatlas.cli import main

    assert main(["inspect", "--vision", "notavision"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and len(err) < 300, err
    assert "notavision" in err and "CONFIG_MAPPING" in err and "did you mean" in err
    assert main(["inspect", "--vision", "qqqqq"]) == 2  # nothing close: a few examples
    err = capsys.readouterr().err.strip()
    assert len(err) < 300 and "e.g. clip_vision_model" in err, err
    assert main(["inspect", "--vision", "clip_vison_model"]) == 2  # a typo gets the closest types
    err = capsys.readouterr().err.strip()
    assert len(err) < 300 and "did you mean clip_vision_model" in err, err


# ---------------------------------------------------------------- sizes checked before allocating, disks before writing


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint (Llama: 4096 wide, 32 layers, 11,008 intermediate; here a few dozen wide)."""
    from tests.test_surgery_hf import tiny

    model = tiny("llama")
    model.config.architectures = [type(model).__name__]
    path = tmp_path_factory.mktemp("ckpt") / "llama"
    model.save_pretrained(path)
    return path


def _grown(src: Path, dst: Path, **sizes: int) -> Path:
    """A copy of the checkpoint at ``src`` whose config.json claims other sizes than its weights hold."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **sizes}))
    return dst


def _small_memory(monkeypatch: pytest.MonkeyPatch, have: int) -> None:
    import normatlas.capacity

    monkeypatch.setattr(normatlas.capacity, "available_memory", lambda device="cpu": have)


def test_a_config_larger_than_its_weights_is_refused_before_building(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: 64 layers x 65,536 intermediate built for 95 s, then an allocation traceback."""
    import torch

    from normatlas.cli import main

    wide = _grown(llama_dir, tmp_path / "wide", intermediate_size=65536)
    big = _grown(llama_dir, tmp_path / "big", num_hidden_layers=64, intermediate_size=65536)
    built = []
    real_init = torch.nn.Linear.reset_parameters

    def init(self: torch.nn.Linear) -> None:  # a real build (not the meta one) initialises real weights
        if not self.weight.is_meta:
            built.append(self)
        real_init(self)

    monkeypatch.setattr(torch.nn.Linear, "reset_parameters", init)
    t0 = time.perf_counter()
    assert main(["fold", str(wide), str(tmp_path / "out")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "mlp" in line and "65536" in line and "config.json" in line, line
    assert main(["fold", str(big), str(tmp_path / "out")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "is missing tensor(s) ['model.layers.2." in line and "config.json" in line, line
    assert time.perf_counter() - t0 < 30 and not built and not (tmp_path / "out").exists()
    _small_memory(monkeypatch, 10**9)  # this machine's memory should not decide the test
    assert main(["inspect", str(big)]) == 2  # inspect loads what matches; the size is refused
    line = _one_line(capsys.readouterr().err)
    assert "big" in line and "parameters" in line and "1.0 GB is available" in line, line
    assert not built


def test_a_checkpoint_larger_than_the_memory_is_refused_in_one_line(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from normatlas.surgery.io import load_checkpoint

    _small_memory(monkeypatch, 100_000)
    with pytest.raises(ValueError, match=r"llama: building its [\d,]+ parameters and reading .* of weights needs about "
                       r"[\d.]+ [kM]B of memory; 100.0 kB is available"):  # fmt: skip
        load_checkpoint(llama_dir)
    monkeypatch.undo()
    assert load_checkpoint(llama_dir) is not None


def test_bench_refuses_a_shape_that_does_not_fit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from normatlas.cli import main
    from normatlas.kernels.bench import run_bench

    _small_memory(monkeypatch, 8 * 10**9)
    t0 = time.perf_counter()
    assert main(["bench", "rms", "--shape", "1x1000000000", "--no-compile"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "shape=1x1000000000 in float32" in line and "8.0 GB is available" in line, line
    assert time.perf_counter() - t0 < 10
    import torch

    with pytest.raises(ValueError, match="shape=100000x100000 in bfloat16"):
        run_bench("rms", [(100000, 100000)], [torch.bfloat16], ["fwd"], providers=["torch"])


def test_a_full_disk_is_refused_before_writing_naming_the_folder_and_size(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    import safetensors.torch

    from normatlas.cli import main

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=4096))
    wrote = []
    monkeypatch.setattr(safetensors.torch, "save_file", lambda *a, **k: wrote.append(a))
    assert main(["fold", str(llama_dir), str(tmp_path / "out")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"not enough disk space in {tmp_path}" in line and "needs about" in line and "4.1 kB is free" in line
    assert not wrote and list(tmp_path.iterdir()) == []


def test_a_disk_that_fills_during_the_write_is_one_line(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What safetensors raises on a full disk (a SafetensorError, not an OSError) was a traceback."""
    import safetensors.torch
    from safetensors import SafetensorError

    from normatlas.cli import main

    def full(*a: Any, **k: Any) -> None:
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert main(["fold", str(llama_dir), str(tmp_path / "out")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "No space left on device" in line and f"in {tmp_path}" in line and "needs about" in line, line
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the kernel cache: checked before it is loaded


def _extension_file() -> Path:
    """A real Python extension module (torch's small ``_C`` stub): truncated, loading it dies of SIGBUS."""
    import torch

    return next(Path(torch.__file__).parent.glob("_C.*.so"))


def _cache_entry(root: Path, data: bytes, record: bytes | None) -> Path:
    """A cache entry under ``root`` (as NORMATLAS_CACHE) holding ``data`` as the shared object; ``record``: the file
    whose size and sha256 build.json records (None: a build.json from before the record)."""
    import hashlib
    import os

    from normatlas.kernels import cpu

    was = os.environ.get("NORMATLAS_CACHE")
    os.environ["NORMATLAS_CACHE"] = str(root)
    try:
        name, folder = cpu._entry()
    finally:
        if was is None:
            del os.environ["NORMATLAS_CACHE"]
        else:
            os.environ["NORMATLAS_CACHE"] = was
    folder.mkdir(parents=True)
    meta: dict[str, Any] = {"key": cpu._key(), "seconds": 31.0}
    if record is not None:
        meta |= {"size": len(record), "sha256": hashlib.sha256(record).hexdigest()}
    (folder / "build.json").write_text(json.dumps(meta))
    so = folder / f"{name}.so"
    so.write_bytes(data)
    return so


_INFO = "import json, normatlas.kernels.cpu as c; print(json.dumps(c.build_info()))"


def _kernels_info(cache: Path) -> tuple[int, dict[str, Any], str]:
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "NORMATLAS_KERNELS"}
    env |= {"NORMATLAS_CACHE": str(cache), "PYTHONPATH": str(root / "src")}
    out = subprocess.run([sys.executable, "-c", _INFO], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    doc = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
    return out.returncode, doc, out.stderr


@pytest.mark.parametrize("case", ["truncated", "truncated-legacy", "empty", "changed"])
def test_a_damaged_cached_kernel_is_removed_with_one_warning_not_loaded(tmp_path: Path, case: str) -> None:
    """Truncated: loading it killed every later process with SIGBUS (rc -7), ``kernels info`` included. Empty: every
    process silently ran the eager fallback for good (``kernels build`` could not replace it)."""
    whole = _extension_file().read_bytes()
    data = {"truncated": whole[: len(whole) // 2], "truncated-legacy": whole[: len(whole) // 2], "empty": b"",
            "changed": whole[:-1] + bytes([whole[-1] ^ 1])}[case]  # fmt: skip
    so = _cache_entry(tmp_path, data, None if case == "truncated-legacy" else whole)
    rc, info, err = _kernels_info(tmp_path)
    assert rc == 0, (rc, err[-2000:])
    assert info["backend"] == "eager" and "removed the damaged cached C++ kernels" in info["reason"], info
    assert "normatlas kernels build" in info["reason"]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and str(so) in lines[0] and "Traceback" not in err, err
    assert not so.exists() and not (so.parent / "build.json").exists()
    if case == "empty":  # the next process: nothing cached, and it says how to build (no longer eager for good)
        rc, info, err = _kernels_info(tmp_path)
        assert rc == 0 and "not built" in info["reason"] and "removed the damaged" not in err, (info, err)


def test_a_whole_cached_kernel_passes_the_check(tmp_path: Path) -> None:
    from normatlas.kernels.cpu import damage

    whole = _extension_file().read_bytes()
    so = _cache_entry(tmp_path, whole, whole)
    assert damage(so, json.loads((so.parent / "build.json").read_text())) is None
    assert damage(so, {}) is None  # an entry from before the record: its ELF headers fit in the file
    so.write_bytes(whole[: len(whole) - 100])
    assert "cut short" in (damage(so, {}) or "")
    assert "where the build wrote" in (damage(so, {"size": len(whole), "sha256": "0" * 64}) or "")


def test_a_damaged_cached_kernel_is_rebuilt_by_an_explicit_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``backend="fused"`` / ``kernels build``: the damaged entry is removed, rebuilt at once and recorded."""
    import hashlib
    import sys
    import types

    from normatlas.kernels import cpu

    whole = _extension_file().read_bytes()
    so = _cache_entry(tmp_path, b"", whole)
    module = types.SimpleNamespace(vector_kernels=lambda: "none")
    builds = []

    def fake_build(name: str, build_dir: Path, extra_cflags: tuple[str, ...] = ()) -> Any:  # no 30-90 s compile
        builds.append(name)
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / f"{name}.so").write_bytes(whole)
        return module

    monkeypatch.setenv("NORMATLAS_CACHE", str(tmp_path))
    monkeypatch.delenv("NORMATLAS_KERNELS", raising=False)
    monkeypatch.delitem(sys.modules, cpu._entry()[0], raising=False)  # a build an earlier test loaded stays loaded
    monkeypatch.setattr(cpu, "_state", {"module": None, "info": {}, "final": False, "warned": False})
    monkeypatch.setattr(cpu, "build", fake_build)
    with caplog.at_level("WARNING", logger=cpu.__name__):
        assert cpu.extension(build=True) is module
    damaged = [r.getMessage() for r in caplog.records if "removed the damaged" in r.getMessage()]
    assert len(damaged) == 1 and "the file is empty" in damaged[0] and "rebuilding" in damaged[0], damaged
    assert len(builds) == 1 and so.read_bytes() == whole
    meta = json.loads((so.parent / "build.json").read_text())
    assert meta["size"] == len(whole) and meta["sha256"] == hashlib.sha256(whole).hexdigest()
    assert cpu.damage(so, meta) is None


# ---------------------------------------------------------------- experiments report: one bad result.json sinks nothing


def test_report_names_each_unreadable_result_and_shows_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A truncated result.json was already named (tests/test_experiments_verdict.py); one with the right fields of
    the wrong type (a hand edit, another version) still sank the whole report with an AttributeError."""
    from normatlas.cli import main
    from tests.web_helpers import write_experiments

    good = write_experiments(tmp_path)
    text = json.dumps(good)
    bad = {
        "truncated": text[: len(text) // 2],
        "title-null": json.dumps({**good, "title": None}),
        "measured-list": json.dumps({**good, "measured": [1, 2]}),
        "clause-says": json.dumps({**good, "clauses": [{**good["clauses"][0], "says": None}]}),
        "clause-threshold": json.dumps({**good, "clauses": [{**good["clauses"][0], "threshold": "x"}]}),
    }
    for name, body in bad.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "result.json").write_text(body)
    assert main(["experiments", "report", "--out", str(tmp_path), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["report"]
    verdicts = {Path(r["name"]).parent.name if "/" in r["name"] else r["name"]: r["verdict"] for r in rows}
    assert verdicts["variance-depth"] == "holds", rows
    assert "not valid JSON" in verdicts["truncated"]
    assert "title=null must be a string" in verdicts["title-null"]
    assert "measured=[1, 2] must be an object" in verdicts["measured-list"]
    assert "clauses[0].says=null must be a string" in verdicts["clause-says"]
    assert 'clauses[0].threshold="x" must be a number' in verdicts["clause-threshold"]
    md = (tmp_path / "report.md").read_text()
    assert "variance-depth" in md and all(f"{name}/result.json" in md for name in bad)
