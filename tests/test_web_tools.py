"""The Tools view's API (``GET /api/tools``, ``POST /api/tools``, jobs polled at ``GET /api/inspect/job/ID``) and the
view in Chromium, against a server in a thread whose root holds a trained byte Llama (3 layers x 32, the tools
tests' fixture; the zoo default is 6 x 128).

Bad tools, folders and texts are refused before any job (400 / 403 / 404); each tool's job answers the library's
own numbers (the lens's last layer is the model's own logits: KL 0, rank 0; the prune scores equal
``layer_scores``; the embedding summary equals ``scan_embeddings``); nothing is written under the root.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from normatlas.web.tools_api import MAX_TEXT
from tests.test_absorb import _checkpoint, olmo2
from tests.test_web_api import call
from tests.tools_fixtures import byte_llama
from tests.web_helpers import running

__all__ = ["byte_llama"]  # the session's trained checkpoint, a fixture used below

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts" / "web"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, byte_llama: Path) -> Path:
    base = tmp_path_factory.mktemp("tools-web")
    shutil.copytree(byte_llama, base / "root" / "byte")
    _checkpoint(olmo2(), base / "root" / "olmo2")  # post-branch RMSNorms to absorb (2 layers x 32, random weights)
    (base / "root" / "bare").mkdir()
    (base / "root" / "bare" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))  # no weights, no tokenizer
    (base / "secret").mkdir()
    (base / "secret" / "config.json").write_text("{}")
    return base / "root"


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[Any]:
    with running(root) as srv:
        yield srv


def _files(root: Path) -> dict[str, float]:
    return {p.relative_to(root).as_posix(): p.stat().st_mtime for p in root.rglob("*")}


def finish(srv: Any, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """POST the tool, then poll its job until it is done or failed."""
    status, res, doc = call(srv, "POST", "/api/tools", body)
    assert status in (200, 202), doc
    if status == 202:
        assert res.getheader("Location") == f"/api/inspect/job/{doc['job']}"
    end = time.monotonic() + timeout
    while doc["state"] not in ("done", "failed"):
        assert time.monotonic() < end, doc
        time.sleep(0.1)
        status, _, doc = call(srv, "GET", f"/api/inspect/job/{doc['job']}")
        assert status == 200, doc
    return doc


def test_tools_lists_the_fixed_set(server: Any) -> None:
    status, _, doc = call(server, "GET", "/api/tools")
    assert status == 200
    assert [t["tool"] for t in doc["tools"]] == ["lens", "outliers", "prune", "embeddings", "absorb", "cost"]
    assert {t["tool"]: t["text"] for t in doc["tools"]} == {
        "lens": "needed",
        "outliers": "optional",
        "prune": "none",
        "embeddings": "none",
        "absorb": "optional",
        "cost": "none",
    }
    assert {t["tool"]: t["folder"] for t in doc["tools"]} == {t["tool"]: t["tool"] != "cost" for t in doc["tools"]}
    assert doc["max_text"] == MAX_TEXT
    # every option is listed from the server's table, typed, with its default inside its bounds
    for t in doc["tools"]:
        for o in t["options"]:
            assert o["kind"] in ("int", "float", "bool", "choice"), o
            if o["kind"] in ("int", "float"):
                assert o["min"] <= o["default"] <= o["max"], o
            if o["kind"] == "choice":
                assert o["default"] in o["choices"], o
    assert call(server, "GET", "/api/inspect")[2]["folders"] == ["bare", "byte", "olmo2"]


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        ({"tool": "fold", "folder": "byte"}, 400, "not one of"),
        ({"tool": ["lens"], "folder": "byte", "text": "x"}, 400, "not one of"),
        ({"tool": "lens", "folder": "byte"}, 400, "lens needs text"),
        ({"tool": "lens", "folder": "byte", "text": "   "}, 400, "non-empty"),
        ({"tool": "lens", "folder": "byte", "text": "x" * (MAX_TEXT + 1)}, 400, f"at most {MAX_TEXT}"),
        ({"tool": "lens", "folder": "byte", "text": 7}, 400, "non-empty string"),
        ({"tool": "lens", "folder": "byte", "text": "a\x00b"}, 400, "no NUL"),
        ({"tool": "prune", "folder": "byte", "text": "x"}, 400, "unknown field(s) ['text']"),
        ({"tool": "prune", "folder": "byte", "output": "/tmp/x"}, 400, "unknown field(s) ['output']"),
        ({"tool": "prune"}, 400, "the body must be"),
        (["prune", "byte"], 400, "the body must be"),
        ({"tool": "prune", "folder": ""}, 400, "non-empty path"),
        ({"tool": "prune", "folder": "../secret"}, 403, "outside the served root"),
        ({"tool": "prune", "folder": "/etc"}, 403, "outside the served root"),
        ({"tool": "prune", "folder": "nowhere"}, 404, "no config.json"),
    ],
)
def test_bad_requests_are_refused_before_any_job(server: Any, body: Any, code: int, words: str) -> None:
    pending = server.inspector.pending()
    status, _, doc = call(server, "POST", "/api/tools", body)
    assert (status, doc["status"]) == (code, code), doc
    assert words in doc["error"]
    assert server.inspector.pending() == pending


def test_routes_and_methods(server: Any) -> None:
    assert call(server, "POST", "/api/tools", raw=b"{not json")[0] == 400
    assert call(server, "PUT", "/api/tools", {})[0] == 405


def test_lens_answers_the_models_own_logits_at_the_last_layer(server: Any, root: Path) -> None:
    before = _files(root)
    doc = finish(server, {"tool": "lens", "folder": "byte", "text": "import os\nimport sy"})
    assert doc["state"] == "done", doc
    res = doc["result"]
    assert (res["tool"], res["model"]) == ("lens", "LlamaForCausalLM")
    assert res["meta"]["layers"] == 3 and res["meta"]["final_norm"] == "model.norm"
    (table,) = res["tables"]
    rows = table["rows"]
    assert [r["layer"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["kl_mean"] == 0.0 and rows[-1]["answer_rank"] == 0
    assert res["chart"]["series"] == ["kl_mean", "kl_last"]
    assert res["chart"]["points"] == [[r["layer"], r["kl_mean"], r["kl_last"]] for r in rows]
    assert {p["phase"] for p in doc["phases"]} >= {"queued", "building"}
    assert _files(root) == before  # nothing written


def test_a_prompt_longer_than_the_context_is_cut_to_it(server: Any) -> None:
    doc = finish(server, {"tool": "lens", "folder": "byte", "text": "x = 1\n" * 80})  # 480 bytes; context 64
    assert doc["state"] == "done", doc
    assert doc["result"]["meta"]["tokens"] == 64


def test_a_second_request_is_the_cached_job(server: Any) -> None:
    body = {"tool": "lens", "folder": "byte", "text": "import os\nimport sy"}
    first = finish(server, body)
    status, _, again = call(server, "POST", "/api/tools", body)
    assert status == 200 and again["cached"] and again["job"] == first["job"]
    other = finish(server, {"tool": "lens", "folder": "byte", "text": "def f():"})
    assert other["job"] != first["job"]


def test_prune_scores_only_and_they_are_the_librarys(server: Any, root: Path) -> None:
    from normatlas.tools import heldout_ids, layer_scores, load, read_model, window_len, windows

    before = _files(root)
    doc = finish(server, {"tool": "prune", "folder": "byte"})
    assert doc["state"] == "done", doc
    res = doc["result"]
    model, tok = load(root / "byte")
    ids = windows(heldout_ids(tok), window_len(model), 8)
    want = layer_scores(model, read_model(model, ids[:1], head=False), ids)
    assert [{k: v for k, v in r.items() if k != "dropped"} for r in res["tables"][0]["rows"]] == want
    assert not any(r["dropped"] for r in res["tables"][0]["rows"]) and res["meta"]["drop"] == []
    assert res["meta"]["written"] is False
    assert [p[0] for p in res["chart"]["points"]] == [0, 1, 2]
    assert _files(root) == before


def test_embeddings_and_outliers_run(server: Any, root: Path) -> None:
    from normatlas.tools import heldout_ids, load, scan_embeddings

    emb = finish(server, {"tool": "embeddings", "folder": "byte"})["result"]
    model, tok = load(root / "byte")
    want = scan_embeddings(model, tok, heldout_ids(tok))
    assert emb["tables"][0]["rows"] == [want.summary]
    assert emb["tables"][1]["rows"] == want.rows
    points = emb["chart"]["points"]
    assert len(points) == 101 and points[-1][1] == pytest.approx(want.summary["norm_max"])
    out = finish(server, {"tool": "outliers", "folder": "byte", "text": "import os"})["result"]
    names = [t["name"] for t in out["tables"]]
    assert names[0] == "sites" and "entropy" in names
    assert out["meta"]["tokens"] == len(tok("import os")["input_ids"])
    assert out["meta"]["max_abs_logit_diff_f64"] < 1e-10  # the migration is exact in float64


def test_a_folder_the_tools_cannot_read_fails_its_job_with_422(server: Any) -> None:
    doc = finish(server, {"tool": "embeddings", "folder": "bare"})
    assert doc["state"] == "failed" and doc["status"] == 422, doc
    assert doc["error"].startswith("embeddings:")


# ----------------------------------------------------------------------------- in Chromium
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is absent (make test installs it)")
def test_the_view_runs_a_tool_and_shows_its_table_without_overflow_at_390(server: Any) -> None:
    from playwright import sync_api

    from tests.test_web_browser import ARGS

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    hosts: set[str | None] = set()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: hosts.add(urlsplit(r.url).hostname))
        page.goto(f"{server.url}#/tools")
        page.wait_for_selector("main[data-view='tools'][data-ready='1']", timeout=15_000)
        assert page.get_attribute("nav a[data-view='tools']", "aria-current") == "page"
        page.select_option("#tools-tool", "prune")
        assert page.is_hidden("#tools-text")  # the pruning scores take no text
        page.select_option("#tools-tool", "lens")
        page.select_option("#tools-folder", "byte")
        page.fill("#tools-text", "import os\nimport sy")
        page.click("#tools-go")
        page.wait_for_selector("#tools-out .tools-report[data-tool='lens']", timeout=60_000)
        rows = page.locator("#tools-out [data-table='lens'] tbody tr")
        assert rows.count() == 4
        assert page.locator("#tools-out svg.chart polyline").count() == 2
        assert "tool=lens" in page.url and "folder=byte" in page.url
        page.screenshot(path=str(ARTIFACTS / "tools-lens-1440.png"), full_page=True)
        # options come from the server's table; one out of bounds is refused by the server, named
        assert page.input_value("#tools-opt-k") == "5" and not page.is_checked("#tools-opt-tuned")
        page.fill("#tools-opt-k", "0")
        page.click("#tools-go")
        page.wait_for_selector("#tools-retry", timeout=30_000)
        assert "k=0 is not allowed" in page.inner_text("#tools-out .status.error")
        page.fill("#tools-opt-k", "3")
        page.click("#tools-go")
        page.wait_for_selector("#tools-out .tools-report[data-tool='lens']", timeout=60_000)
        assert "k=3" in page.url and "(k 3)" in page.inner_text("#tools-out .pill")
        # absorb, report only: the tables of normatlas absorb --dry-run
        page.select_option("#tools-tool", "absorb")
        page.select_option("#tools-folder", "olmo2")
        page.fill("#tools-opt-windows", "1")
        page.click("#tools-go")
        page.wait_for_selector("#tools-out .tools-report[data-tool='absorb']", timeout=120_000)
        names = page.eval_on_selector_all("#tools-out [data-table]", "els => els.map(e => e.dataset.table)")
        assert names[:4] == ["changes", "calibration", "approximation", "checks"]
        page.screenshot(path=str(ARTIFACTS / "tools-absorb-1440.png"), full_page=True)
        # the cost of normalization: no folder; sizes from the form
        page.select_option("#tools-tool", "cost")
        assert page.is_hidden("#tools-folder") and page.is_hidden("#tools-text")
        sizes = {"seq": "32", "heads": "2", "head_dim": "16", "width": "64", "layers": "1", "block_seq": "32"}
        for name, value in {**sizes, "rounds": "2"}.items():
            page.fill(f"#tools-opt-{name}", value)
        page.click("#tools-go")
        page.wait_for_selector("#tools-out .tools-report[data-tool='cost']", timeout=120_000)
        assert page.locator("#tools-out [data-table='attention'] tbody tr").count() == 8
        assert page.locator("#tools-out [data-table='blocks'] tbody tr").count() == 6
        page.screenshot(path=str(ARTIFACTS / "tools-cost-1440.png"), full_page=True)
        # a folder the tools cannot read: its job fails, named, with a Retry button
        page.select_option("#tools-tool", "embeddings")
        page.select_option("#tools-folder", "bare")
        page.click("#tools-go")
        page.wait_for_selector("#tools-retry", timeout=60_000)
        assert "embeddings:" in page.inner_text("#tools-out .status.error")
        # a linked view runs its tool on load; at 390 px nothing but a table's own scroll box is wider than the screen
        page.set_viewport_size({"width": 390, "height": 844})
        page.goto(f"{server.url}#/tools?tool=prune&folder=byte")
        page.reload()
        page.wait_for_selector("#tools-out .tools-report[data-tool='prune']", timeout=60_000)
        width = page.evaluate("document.scrollingElement.scrollWidth")
        wide = page.evaluate(
            "[...document.querySelectorAll('main *')].filter(e => e.getBoundingClientRect().right > innerWidth + 1"
            " && !e.closest('.table-wrap')).slice(0, 5).map(e => e.tagName + '.' + e.className)"
        )
        page.screenshot(path=str(ARTIFACTS / "tools-prune-390.png"), full_page=True)
        page.goto(f"{server.url}#/tools?tool=cost&seq=32&heads=2&head_dim=16&width=64&layers=1&block_seq=32&rounds=2")
        page.reload()
        page.wait_for_selector("#tools-out .tools-report[data-tool='cost']", timeout=60_000)
        cost_width = page.evaluate("document.scrollingElement.scrollWidth")
        page.screenshot(path=str(ARTIFACTS / "tools-cost-390.png"), full_page=True)
        browser.close()
    assert width <= 390, f"the Tools view is {width} px wide at 390: {wide}"
    assert cost_width <= 390, f"the cost report is {cost_width} px wide at 390"
    refused = [e for e in errors if "status of 400 (Bad Request)" in e]
    assert len(refused) == 1 and len(errors) == 1, errors  # the k=0 request, refused by the server as it should be
    assert hosts <= {"127.0.0.1"}


def test_only_the_last_tool_results_stay_cached(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tool jobs are keyed by a free text: the oldest finished ones are forgotten past ``MAX_DONE_OWN``."""
    from normatlas.web import inspect_jobs
    from normatlas.web.tools_api import ToolTargets

    monkeypatch.setattr(inspect_jobs, "MAX_DONE_OWN", 2)
    inspector = inspect_jobs.Inspector(root, runner=lambda target: {"inspected": target})
    targets = ToolTargets(root)
    try:
        ids = []
        for text in ("a", "b", "c"):
            doc, _ = inspector.start({"tool": "lens", "folder": "byte", "text": text}, targets, json.loads)
            ids.append(doc["job"])
            end = time.monotonic() + 10
            while inspector.pending():
                assert time.monotonic() < end
                time.sleep(0.01)
        with pytest.raises(FileNotFoundError):
            inspector.job(ids[0])
        # the tool's own runner ran, not the inspector's
        assert inspector.job(ids[2])["result"]["options"]["text"] == "c"
        again, finished = inspector.start({"tool": "lens", "folder": "byte", "text": "a"}, targets, json.loads)
        assert not finished and again["job"] != ids[0]  # forgotten: run afresh
    finally:
        inspector.close()
