"""The page's JSON API against a real server in a thread (standard-library HTTP client only).

Each route answers the library's own values (checked against the library, or a float64 reference),
malformed requests get JSON 4xx answers and leave the server answering, nothing outside ``--root``
is readable, and the budgets hold (page size, /api/normalize latency).
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from normatlas.atlas import DESIGN_FIELDS as TYPED_FIELDS
from normatlas.atlas import models
from normatlas.blocks import PRESETS
from normatlas.experiments.runner import RESULT_FIELDS
from normatlas.spec import Axis, Layout
from normatlas.taxonomy import classify, taxonomy_table
from normatlas.web.axes_api import sample_tensor
from normatlas.web.server import MAX_BODY, static_files
from tests.web_helpers import running, write_experiments


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    base = tmp_path_factory.mktemp("web")
    root, out = base / "root", base / "experiments"
    (root / "ckpt").mkdir(parents=True)
    (root / "ckpt" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (base / "secret").mkdir()
    (base / "secret" / "config.json").write_text("{}")
    write_experiments(out)
    (out / "broken").mkdir()
    (out / "broken" / "result.json").write_text('{"name": "broken"}')  # lacks the runner's fields
    with running(root, out) as srv:
        yield srv


def call(srv: Any, method: str, path: str, body: Any = None, raw: bytes | None = None, headers: Any = None) -> Any:
    """(status, headers, decoded JSON or bytes) of one request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    res = conn.getresponse()
    payload = res.read()
    conn.close()
    ctype = res.getheader("Content-Type", "")
    return res.status, res, json.loads(payload) if ctype.startswith("application/json") else payload


def test_health_and_security_headers(server: Any) -> None:
    status, res, doc = call(server, "GET", "/api/health")
    assert status == 200 and doc["ok"] is True
    csp = res.getheader("Content-Security-Policy")
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe" not in csp
    assert res.getheader("X-Content-Type-Options") == "nosniff"


def test_taxonomy_is_the_librarys_table(server: Any) -> None:
    _, _, doc = call(server, "GET", "/api/taxonomy")
    assert doc["rows"] == taxonomy_table()
    assert [lay["layout"] for lay in doc["layouts"]] == ["NCHW", "BTD"]


@pytest.mark.parametrize(
    ("layout", "reduce", "groups"),
    [("NCHW", ["sample", "position"], 1), ("NCHW", ["feature", "position"], 3), ("BTD", ["feature"], 1),
     ("BTD", ["position"], 1), ("NCHW", ["feature", "position"], 6)],
)  # fmt: skip
def test_normalize_names_and_computes_like_a_float64_reference(
    server: Any, layout: str, reduce: list[str], groups: int
) -> None:
    status, _, doc = call(server, "POST", "/api/normalize", {"layout": layout, "reduce": reduce, "groups": groups})
    assert status == 200, doc
    lay = Layout(layout)
    axes = {Axis(a) for a in reduce}
    x = sample_tensor(lay, tuple(doc["shape"]), 0)
    c = x.shape[-1] if lay.channels_last else x.shape[1]
    assert doc["name"] == classify(lay, axes, groups=groups, num_channels=c).name
    assert doc["batch_dependent"] == (Axis.SAMPLE in axes)
    # the float64 reference: group the channel dim, reduce the reduced dims, normalize, compare the moments
    c_dim = x.dim() - 1 if lay.channels_last else 1
    xs = x.movedim(c_dim, 1).unflatten(1, (groups, c // groups))
    dims = [0] if Axis.SAMPLE in axes else []
    dims += [2] if Axis.FEATURE in axes else []
    dims += list(range(3, xs.dim())) if Axis.POSITION in axes else []
    y = (xs - xs.mean(dims, keepdim=True)) / torch.sqrt(xs.var(dims, unbiased=False, keepdim=True) + 1e-5)
    assert math.isclose(doc["stats"]["after"]["std"], float(y.std(unbiased=False)), rel_tol=1e-9)
    assert math.isclose(doc["stats"]["before"]["mean"], float(x.mean()), rel_tol=1e-9)
    assert doc["statistics"] * doc["per_statistic"] == x.numel() or groups == c
    assert sum(doc["hist"]["before"]["counts"]) == x.numel() == sum(doc["hist"]["after"]["counts"])
    assert [line["step"] for line in doc["arithmetic"]] == ["mean", "variance", "normalise", "affine"]
    assert doc["arithmetic"][0]["shape"] == doc["stat_shape"]
    assert (doc["batch_effect"] or 0.0) > 1e-6 if Axis.SAMPLE in axes else doc["batch_effect"] == 0.0


def test_normalize_gradient_is_orthogonal_to_ones_and_the_output(server: Any) -> None:
    body = {"layout": "BTD", "reduce": ["feature"], "input": [[[3.0, -1.0, 0.5]]], "upstream": [[[0.2, -0.7, 0.4]]]}
    _, _, doc = call(server, "POST", "/api/normalize", body)
    out = torch.tensor(doc["output"][0][0], dtype=torch.float64)
    grad = torch.tensor(doc["input_grad"][0][0], dtype=torch.float64)
    assert abs(float(out.sum())) < 1e-12 and math.isclose(float(out.norm()), math.sqrt(3), rel_tol=1e-5)
    assert abs(float(grad.sum())) < 1e-12 and abs(float(grad @ out)) < 1e-5


@pytest.mark.parametrize(
    ("body", "word"),
    [({"layout": "NCHW"}, "reduce"), ({"layout": "XYZ", "reduce": ["feature"]}, "layout"),
     ({"reduce": ["time"]}, "reduce"), ({"reduce": ["position"], "groups": 2}, "groups"),
     ({"reduce": ["feature"], "groups": 4}, "groups"), ({"reduce": ["feature"], "shape": [999, 999, 9, 9]}, "shape"),
     ({"reduce": ["feature"], "bogus": 1}, "bogus"), ({"reduce": ["feature"], "input": [[1, 2], [3]]}, "input"),
     ([1, 2, 3], "object"), ({"reduce": ["feature"], "center": "yes"}, "center")],
)  # fmt: skip
def test_normalize_refuses_bad_input_naming_the_field(server: Any, body: Any, word: str) -> None:
    status, _, doc = call(server, "POST", "/api/normalize", body)
    assert status == 400 and word in doc["error"], doc


def test_placements_are_the_presets_values(server: Any) -> None:
    _, _, doc = call(server, "GET", "/api/placements")
    assert [p["preset"] for p in doc["placements"]] == list(PRESETS)
    for p in doc["placements"]:
        value = PRESETS[p["preset"]]()
        assert p["equation"] == value.describe() and p["kind"] == value.kind.value
        assert p["attn"]["slots"] == list(value.attn.slots) and p["ffn"]["kind"] == value.ffn.kind.value
        assert p["parallel"] == value.parallel and p["residual_alpha"] == value.residual_alpha
    pre = next(p for p in doc["placements"] if p["preset"] == "pre_ln")
    profile = pre["profiles"]["variance-depth"]
    assert profile["columns"] == ["variance"] and len(profile["points"]) == 6


def test_models_carry_provenance_per_field(server: Any) -> None:
    _, _, doc = call(server, "GET", "/api/models")
    assert [m["name"] for m in doc["models"]] == [m["name"] for m in models()]
    for m in doc["models"]:
        for field, badge in m["provenance"].items():
            assert (badge is None) == (m[field] is None)
            if m[field] == "unclear":
                assert badge == "unclear"
            elif m[field] is not None and m["hf_model_types"] and field in TYPED_FIELDS:  # matrix --check compares it
                assert badge == "code", (m["name"], field)
            elif badge is not None:
                assert (
                    badge == {"code": "code", "essay": "guide", "paper": "paper", "unclear": badge}[m["status"]]
                    or badge == "paper"
                )
    assert any(m["source_link"] for m in doc["models"])


def test_papers_grouped_with_links(server: Any) -> None:
    _, _, doc = call(server, "GET", "/api/papers")
    assert sum(len(g["papers"]) for g in doc["groups"]) == doc["count"] > 100
    p = next(p for g in doc["groups"] for p in g["papers"] if p["arxiv"])
    assert p["link"] == f"https://arxiv.org/abs/{p['arxiv']}" and p["search"].startswith("https://arxiv.org/search/")


def test_experiments_read_the_runners_result_and_serve_its_figures(server: Any) -> None:
    _, _, doc = call(server, "GET", "/api/experiments")
    (result,) = doc["results"]
    assert [e["name"] for e in doc["errors"]] == ["broken"] and "lacks the fields" in doc["errors"][0]["error"]
    assert set(RESULT_FIELDS) <= set(result) and result["name"] == "variance-depth"
    status, res, svg = call(server, "GET", result["figures"]["svg"])
    assert status == 200 and res.getheader("Content-Type") == "image/svg+xml" and svg.startswith(b"<?xml")
    assert call(server, "GET", "/experiments/variance-depth/result.json")[0] == 404
    assert call(server, "GET", "/experiments/nope/figure.png")[0] == 404


def test_inspect_refuses_outside_root_and_module_targets(server: Any) -> None:
    assert call(server, "GET", "/api/inspect")[2]["folders"] == ["ckpt"]
    for folder in ("../secret", "/etc", "ckpt/../../secret", "..%2fsecret"):
        status, _, doc = call(server, "POST", "/api/inspect", {"folder": folder})
        assert status in (403, 404) and "error" in doc, (folder, doc)
    assert call(server, "POST", "/api/inspect", {"folder": "../secret"})[0] == 403
    for body in ({"model_type": "os:system"}, {"model_type": "no_such_type"}, {"target": "llama"}, {}):
        status, _, doc = call(server, "POST", "/api/inspect", body)
        assert status == 400, (body, doc)


def test_inspect_a_model_type_then_from_the_cache(server: Any) -> None:
    status, res, job = call(server, "POST", "/api/inspect", {"model_type": "llama"})
    assert status == 202 and res.getheader("Location") == f"/api/inspect/job/{job['job']}", job
    while job["state"] not in ("done", "failed"):  # the job API itself: tests/test_web_inspect_job.py
        time.sleep(0.05)
        job = call(server, "GET", f"/api/inspect/job/{job['job']}")[2]
    doc = job["result"]
    assert doc["placement"] == "pre" and doc["operator"] == "rmsnorm"
    assert doc["drawing"]["attn"] == {"pre": True, "post": False, "after_add": False, "kind": "pre"}
    t0 = time.perf_counter()
    status, _, again = call(server, "POST", "/api/inspect", {"model_type": "llama"})
    assert status == 200 and again["cached"] is True and again["result"] == doc and time.perf_counter() - t0 < 0.5


def test_malformed_requests_get_json_errors_and_the_server_keeps_answering(server: Any) -> None:
    cases = [
        ("POST", "/api/normalize", b"{not json", 400),
        ("POST", "/api/normalize", b"\xff\xfe", 400),
        ("POST", "/api/normalize", b"x" * (MAX_BODY + 1), 413),
        ("GET", "/api/normalize", None, 405),
        ("POST", "/api/models", b"{}", 405),
        ("DELETE", "/api/models", None, 405),
        ("PUT", "/", b"", 405),
        ("GET", "/api/nothing", None, 404),
        ("GET", "/static/missing.js", None, 404),
        ("GET", "/../../etc/passwd", None, 400),
        ("GET", "/static/%2e%2e/%2e%2e/pyproject.toml", None, 400),
        ("GET", "/static/%252e%252e/server.py", None, 400),
        ("GET", "/static/..%5c..%5cserver.py", None, 400),
        ("GET", "/%00", None, 400),
    ]
    for method, path, raw, want in cases:
        status, _, doc = call(server, method, path, raw=raw)
        assert status == want and isinstance(doc, dict) and doc["status"] == want, (method, path, status, doc)
    # a bounded fuzz: random bytes as paths and bodies
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        junk = bytes(torch.randint(32, 127, (int(torch.randint(1, 60, (1,), generator=gen)),), generator=gen).tolist())
        path = "/" + junk.decode().replace(" ", "%20").replace("#", "%23").replace("?", "%3F")
        status, _, doc = call(server, "GET", path)
        assert 400 <= status < 500 and isinstance(doc, dict), (path, status)
        status, _, doc = call(server, "POST", "/api/normalize", raw=junk)
        assert status == 400 and isinstance(doc, dict), (junk, status)
    assert call(server, "GET", "/api/health")[0] == 200


def test_raw_garbage_on_the_socket_and_a_foreign_host(server: Any) -> None:
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5) as sock:
        sock.sendall(b"\x16\x03\x01 garbage that is not http\r\n\r\n")
        reply = b""
        while chunk := sock.recv(4096):  # the server closes the connection after an error to a garbled request
            reply += chunk
    assert reply.startswith(b"HTTP/1.") and b'"error"' in reply
    status, _, doc = call(server, "GET", "/api/health", headers={"Host": "evil.example:80"})
    assert status == 403 and "Host" in doc["error"]
    assert call(server, "GET", "/api/health")[0] == 200


def test_budgets_page_size_and_normalize_latency(server: Any) -> None:
    files = static_files()
    size = sum(len(v) for k, v in files.items() if k.endswith((".html", ".css", ".js")))
    assert size < 400_000, f"the page is {size} bytes"
    for name in files:
        assert call(server, "GET", f"/static/{name}")[0] == 200
    html = call(server, "GET", "/")[2].decode()
    assert '<script type="module" src="/static/app.js">' in html and "http" not in html.replace("http-equiv", "")
    body = {"layout": "NCHW", "reduce": ["sample", "position"]}
    call(server, "POST", "/api/normalize", body)  # warm
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        assert call(server, "POST", "/api/normalize", body)[0] == 200
        times.append(time.perf_counter() - t0)
    assert sorted(times)[2] < 0.2, f"/api/normalize took {sorted(times)[2] * 1e3:.0f} ms (median of 5)"


def test_no_asset_refers_to_another_origin() -> None:
    for name, data in static_files().items():
        text = data.decode("utf-8", "replace")
        for bad in ("cdn.", "googleapis", "unpkg", "jsdelivr", "<script>", ' style="', "eval("):
            assert bad not in text, f"{name} contains {bad!r}"
    css = static_files()["app.css"].decode()
    assert "@font-face" not in css and "@import" not in css and "url(http" not in css


def test_package_data_ships_the_static_files() -> None:
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"web/static/*"' in text


def test_serve_refuses_a_remote_host_without_allow_remote(capsys: pytest.CaptureFixture[str]) -> None:
    from normatlas.cli import main

    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--allow-remote" in capsys.readouterr().err
    assert main(["serve", "--root", "/no/such/folder", "--port", "0"]) == 2


def test_make_server_binds_ipv6_loopback_and_refuses_bad_ports() -> None:
    from normatlas.web import Config, make_server

    if socket.has_ipv6:
        try:
            srv = make_server("::1", 0, Config(Path.cwd(), None))
        except OSError as exc:  # a machine without IPv6 loopback
            pytest.skip(f"no IPv6 loopback: {exc}")
        assert srv.url.startswith("http://[::1]:")
        srv.server_close()
    for port in (-1, 70000, True, "80"):
        with pytest.raises(ValueError, match="port="):
            make_server("127.0.0.1", port)  # type: ignore[arg-type]


def test_serve_prints_its_url_answers_and_exits_0_on_ctrl_c(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    cmd = [sys.executable, "-m", "normatlas", "serve", "--port", "0", "--root", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        url = next(word for word in line.split() if word.startswith("http://127.0.0.1:"))
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/api/health")
        assert conn.getresponse().status == 200
        conn.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(OSError):  # the port is released
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_depth_profiles_read_both_csv_forms() -> None:
    from normatlas.web.catalog import _add_profile

    out: dict = {}
    long = {"columns": ["label", "placement", "stage", "depth", "variance"],
            "rows": [["Pre-LN", "pre_ln", st, str(d), str(v)] for st, v0 in (("init", 1.0), ("trained", 5.0))
                     for d, v in ((0, v0), (1, v0 + 1))]}  # fmt: skip
    _add_profile(out, "variance-depth", "variance", long, False)
    wide = {"columns": ["layer", "post_ln", "pre_ln"], "rows": [["1", "0.5", "2.0"], ["2", "0.6", "1.0"]]}
    _add_profile(out, "gradient-depth", "per_layer", wide, True)
    v = out["pre_ln"]["variance-depth"]
    assert v["columns"] == ["variance (init)", "variance (trained)"] and v["points"] == [[0, 1.0, 5.0], [1, 2.0, 6.0]]
    assert out["post_ln"]["gradient-depth"]["points"] == [[1, 0.5], [2, 0.6]]
    assert out["pre_ln"]["gradient-depth"]["columns"] == ["per_layer"]


def test_paper_sourced_records_link_their_paper(server: Any) -> None:
    _, _, doc = call(server, "GET", "/api/models")
    cited = [m for m in doc["models"] if m["status"] == "paper"]
    assert cited, "the matrix has records sourced from a paper"
    for m in cited:
        assert m["source_link"] and m["source_link"].startswith("https://"), m["name"]
        assert "paper" in m["provenance"].values()
