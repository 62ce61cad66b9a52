"""Inspection as a job (issue 34): the API's states, joining and retry, and the Inspect view in Chromium.

Plain HTTP tests drive ``POST /api/inspect`` and ``GET /api/inspect/job/ID`` with a runner held at each phase by
events (a real torch forward under a ``TorchFunctionMode`` marks ``tracing``, as the dataflow recorder's does), and
with real model types. The browser tests reuse :mod:`tests.test_web_browser`'s ``site`` fixture (Debian's
Chromium, headless): the page shows the phase and the seconds, then the report with the server's measured total;
a 503 during a build is retried; a failure offers a retry; a QK-norm model draws its QK-norm sites and a click
(or Enter) opens a site's arithmetic; nothing is wider than a phone. Screenshots go to ``tests/artifacts/web/``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from normatlas.web.inspect_api import Unreadable, run_target
from normatlas.web.inspect_jobs import MAX_QUEUED
from tests import test_web_browser as web
from tests.test_web_api import call
from tests.test_web_browser import ARTIFACTS, CHROMIUM, CONTRAST_JS, _open
from tests.web_helpers import running

FINISHED = ("done", "failed")
site = web.site  # the browser tests' fixture (a server and a headless Chromium), one per module


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running(tmp_path_factory.mktemp("root")) as srv:
        yield srv


def wait_for(srv: Any, job: str, states: tuple[str, ...], timeout: float = 120.0) -> dict[str, Any]:
    """Poll a job until its state is one of ``states``."""
    deadline = time.monotonic() + timeout
    while True:
        status, _, doc = call(srv, "GET", f"/api/inspect/job/{job}")
        assert status == 200, doc
        if doc["state"] in states:
            return doc
        assert doc["state"] not in FINISHED, doc
        assert time.monotonic() < deadline, f"job {job} still {doc['state']} after {timeout} s"
        time.sleep(0.02)


class _Passthrough(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def held_runner(gates: dict[str, threading.Event]) -> Callable[[str], dict[str, Any]]:
    """A runner that stays in each phase until its gate opens: building, then a forward under a TorchFunctionMode
    (tracing), then reading."""

    class Held(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert gates["trace"].wait(30)
            return self.inner(x)

    def run(target: str) -> dict[str, Any]:
        assert gates["build"].wait(30)
        with torch.no_grad(), _Passthrough():
            Held()(torch.ones(2, 3))
        assert gates["read"].wait(30)
        return {"model": target, "sites": []}

    return run


@pytest.fixture
def gates(server: Any) -> Iterator[dict[str, threading.Event]]:
    """Events holding a job in each phase; the server runs the held runner until the test ends (gates opened)."""
    events = {k: threading.Event() for k in ("build", "trace", "read")}
    server.inspector.runner = held_runner(events)
    try:
        yield events
    finally:
        for e in events.values():
            e.set()
        deadline = time.monotonic() + 30  # the held jobs drain with the held runner, never as real builds
        while server.inspector.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
        server.inspector.runner = run_target


def test_a_job_passes_each_phase_and_a_second_request_joins_it(server: Any, gates: dict[str, threading.Event]) -> None:
    status, res, doc = call(server, "POST", "/api/inspect", {"model_type": "llama"})
    assert status == 202 and res.getheader("Location") == f"/api/inspect/job/{doc['job']}"
    assert doc["state"] in ("queued", "building") and doc["joined"] is False and doc["cached"] is False
    job = doc["job"]
    assert wait_for(server, job, ("building",))["target"] == "llama"
    status, _, again = call(server, "POST", "/api/inspect", {"model_type": "llama"})
    assert status == 202 and again["job"] == job and again["joined"] is True and again["state"] == "building"
    gates["build"].set()
    wait_for(server, job, ("tracing",))
    gates["trace"].set()
    wait_for(server, job, ("reading",))
    gates["read"].set()
    done = wait_for(server, job, ("done",))
    assert done["result"] == {"model": "llama", "sites": []}
    assert [p["phase"] for p in done["phases"]] == ["queued", "building", "tracing", "reading"]
    assert done["elapsed"] >= sum(p["seconds"] for p in done["phases"]) - 0.005
    t0 = time.perf_counter()
    status, _, cached = call(server, "POST", "/api/inspect", {"model_type": "llama"})
    assert status == 200 and cached["job"] == job and cached["cached"] is True and cached["state"] == "done"
    assert cached["elapsed"] == done["elapsed"] and time.perf_counter() - t0 < 0.5  # the measured cost, kept


def test_a_failed_job_says_why_and_a_new_request_retries(server: Any) -> None:
    def broken(target: str) -> dict[str, Any]:
        raise Unreadable(f"cannot build or inspect {target}: ValueError: no such layer")

    server.inspector.runner = broken
    try:
        status, _, doc = call(server, "POST", "/api/inspect", {"model_type": "mistral"})
        failed = wait_for(server, doc["job"], ("failed",))
    finally:
        server.inspector.runner = run_target
    assert failed["status"] == 422 and "no such layer" in failed["error"] and "result" not in failed
    status, _, retry = call(server, "POST", "/api/inspect", {"model_type": "mistral"})
    assert status == 202 and retry["job"] != doc["job"]  # a fresh job, not the failed one
    assert call(server, "GET", f"/api/inspect/job/{doc['job']}")[2]["state"] == "failed"  # still readable
    assert wait_for(server, retry["job"], FINISHED)["state"] == "done"


def test_the_queue_is_bounded_and_job_ids_are_validated(server: Any, gates: dict[str, threading.Event]) -> None:
    types = ["bert", "gpt_neox", "phi", "falcon", "opt", "bloom"][: MAX_QUEUED + 1]
    jobs = [call(server, "POST", "/api/inspect", {"model_type": types[0]})[2]]
    wait_for(server, jobs[0]["job"], ("building",))  # the first runs: MAX_QUEUED more may wait
    jobs += [call(server, "POST", "/api/inspect", {"model_type": t})[2] for t in types[1:]]
    assert all(j["state"] == "queued" for j in jobs[1:]), jobs
    assert server.inspector.pending() == MAX_QUEUED + 1
    status, res, doc = call(server, "POST", "/api/inspect", {"model_type": "gptj"})
    assert status == 503 and res.getheader("Retry-After") == "2" and "waiting" in doc["error"]
    queued = call(server, "GET", f"/api/inspect/job/{jobs[-1]['job']}")[2]
    assert queued["state"] == "queued" and queued["ahead"] == MAX_QUEUED
    for bad, want in (("nope", 400), ("0123456789ABCDEF", 400), ("0" * 16, 404), ("0" * 17, 400)):
        assert call(server, "GET", f"/api/inspect/job/{bad}")[0] == want, bad
    assert call(server, "POST", f"/api/inspect/job/{jobs[0]['job']}", {})[0] == 405
    assert call(server, "POST", "/api/inspect", {"model_type": "os:system"})[0] == 400  # checked before any job
    for g in gates.values():
        g.set()
    for j in jobs:
        assert wait_for(server, j["job"], FINISHED)["state"] == "done"


@pytest.mark.parametrize("model_type", ["gpt2", "qwen3"])
def test_a_real_inspection_reports_its_sites_and_measured_phases(server: Any, model_type: str) -> None:
    t0 = time.perf_counter()
    status, _, doc = call(server, "POST", "/api/inspect", {"model_type": model_type})
    assert status in (200, 202), doc
    done = wait_for(server, doc["job"], FINISHED)
    wall = time.perf_counter() - t0
    assert done["state"] == "done", done
    print(f"{model_type}: {done['elapsed']:.2f} s measured by the server, {wall:.2f} s here; {done['phases']}")
    rep = done["result"]
    assert rep["model"] == model_type and rep["drawing"] is not None
    assert done["elapsed"] <= wall + 0.05
    slots = [(s["branch"], s["slot"]) for s in rep["sites"]]
    assert ("attn", "pre") in slots and ("ffn", "pre") in slots and ("stream", "final") in slots
    if model_type == "qwen3":  # QK-norm: two sites (queries, keys) inside the attention, RMSNorm at eps 1e-6
        qk = [s for s in rep["sites"] if s["slot"] == "qk"]
        assert len(qk) == 2 and rep["qk_norm"] == "per-head"
        assert qk[0]["size"] == rep["hidden_size"] // 4  # per head: head_dim of the tiny build
        lines = {line["step"]: line["expr"] for line in qk[0]["arithmetic"]}
        assert lines["normalize"] == "x̂ = x / sqrt(mean(x²) + 1e-06)"
        assert lines["in all"] == "y = w ⊙ (x / sqrt(mean(x²) + 1e-06)).to(dtype)"  # cast before the gain
    else:  # GPT-2: LayerNorm with a bias, no QK-norm
        assert not any(s["slot"] in ("qk", "v") for s in rep["sites"])
        assert "+ b" in rep["sites"][0]["arithmetic"][-1]["expr"]


def test_v_norm_and_side_path_sites_of_the_first_layer(server: Any) -> None:
    doc = call(server, "POST", "/api/inspect", {"model_type": "gemma3n_text"})[2]
    rep = wait_for(server, doc["job"], FINISHED)["result"]
    assert rep["v_norm"] is True and rep["qk_norm"] == "per-head"
    slots = [s["slot"] for s in rep["sites"]]
    # Peri-LN's four, queries' and keys' norms and the gain-less V-norm (by dataflow order, whatever the layer
    # field says), and the side paths' norms (AltUp, LAuReL, per-layer inputs) up to the second layer
    assert slots.count("qk") == 2 and slots.count("v") == 1 and slots.count("out") == 2 and "final" in slots
    v = next(s for s in rep["sites"] if s["slot"] == "v")
    lines = {line["step"]: line["expr"] for line in v["arithmetic"]}
    assert v["gain_convention"] == "none" and lines["gain"] == "none" and "w" not in lines["in all"]
    others = [s for s in rep["sites"] if s["branch"] == "other"]
    assert len(others) >= 3 and all(s["slot"] == "other" for s in others)


# --- the page ----------------------------------------------------------------------------------------------------

browser = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is absent (make test installs it)")


def _slow(seconds: float) -> Callable[[str], dict[str, Any]]:
    def run(target: str) -> dict[str, Any]:
        time.sleep(seconds)  # building, as a first import of transformers' model code is
        return run_target(target)

    return run


@browser
def test_inspect_shows_progress_then_the_report(site: dict[str, Any]) -> None:
    srv = site["server"]
    srv.inspector.runner = _slow(6.0)  # long enough to look at twice and to reload in, on a loaded machine
    try:
        page = _open(site, "inspect", "model_type=gpt2")
        page.wait_for_selector("#inspect-job[data-state='building']", timeout=30_000)
        assert "building the model" in page.inner_text("#inspect-job")
        assert page.locator("#inspect-job ol.phases li.current").inner_text().startswith("building")
        first = float(page.inner_text("#inspect-job .elapsed").split()[0])
        page.wait_for_timeout(600)
        later = float(page.inner_text("#inspect-job .elapsed").split()[0])
        assert later > first, (first, later)  # the seconds run
        page.screenshot(path=str(ARTIFACTS / "inspect-progress.png"))
        page.reload()  # a reload during the build joins the running job: its seconds go on, no 503
        page.wait_for_selector("#inspect-job[data-state='building']", timeout=30_000)
        assert float(page.inner_text("#inspect-job .elapsed").split()[0]) >= later
        page.wait_for_selector("#inspect-out .report svg.diagram", timeout=60_000)
    finally:
        srv.inspector.runner = run_target
    timing = page.inner_text("#inspect-timing")
    assert timing.startswith("measured by the server: ") and "building" in timing, timing
    total = float(timing.split(": ")[1].split()[0])
    assert total >= 6.0, timing  # the server's own clock, the held build included
    assert not any(" 503 " in f for f in site["log"]["failed"]), site["log"]["failed"]
    assert site["log"]["errors"] == [], site["log"]["errors"]


@browser
def test_a_503_during_a_build_is_retried(site: dict[str, Any]) -> None:
    srv = site["server"]
    srv.inspector.runner = _slow(1.5)
    page = site["page"]
    refused: list[str] = []

    def busy_once(route: Any) -> None:
        if len(refused) < 2:  # the first start and the first poll: the server is busy
            refused.append(route.request.url)
            route.fulfill(status=503, headers={"Retry-After": "1"}, json={"error": "busy", "status": 503})
        else:
            route.continue_()

    page.route("**/api/inspect", busy_once)
    page.route("**/api/inspect/job/*", busy_once)
    try:
        page = _open(site, "inspect", "model_type=opt")
        page.wait_for_selector(".retry-note:not([hidden])", timeout=30_000)
        assert "busy" in page.inner_text(".retry-note") and "retrying in 1 s" in page.inner_text(".retry-note")
        page.wait_for_selector("#inspect-out .report svg.diagram", timeout=60_000)
    finally:
        page.unroute("**/api/inspect")
        page.unroute("**/api/inspect/job/*")
        srv.inspector.runner = run_target
    assert len(refused) == 2 and page.locator("#inspect-retry").count() == 0
    site["log"]["errors"].clear()  # the browser logs each refused request


@browser
def test_a_failure_offers_a_retry_that_works(site: dict[str, Any]) -> None:
    srv = site["server"]

    def broken(target: str) -> dict[str, Any]:
        raise Unreadable(f"cannot build or inspect {target}: RuntimeError: out of memory")

    srv.inspector.runner = broken
    page = site["page"]
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        page = _open(site, "inspect", "model_type=phi")
        page.wait_for_selector("#inspect-retry", timeout=30_000)
        assert "out of memory" in page.inner_text("#inspect-out [role='alert']")
        page.screenshot(path=str(ARTIFACTS / "inspect-failed-390.png"), full_page=True)
        assert page.evaluate("document.scrollingElement.scrollWidth") <= 390
    finally:
        srv.inspector.runner = run_target
        page.set_viewport_size({"width": 1360, "height": 900})
    page.click("#inspect-retry")
    page.wait_for_selector("#inspect-out .report svg.diagram", timeout=60_000)
    assert "phi" in page.inner_text("#inspect-out h2")


@browser
def test_a_qk_norm_model_draws_its_qk_sites_and_a_click_opens_their_arithmetic(site: dict[str, Any]) -> None:
    page = _open(site, "inspect", "model_type=qwen3")
    page.wait_for_selector("#inspect-out .report svg.diagram", timeout=90_000)
    qk = page.locator("svg.diagram .site[data-slot='qk']")
    assert qk.count() == 2
    assert page.locator("svg.diagram .site").count() == 5  # two pre-norms, two QK-norms, the final norm
    qk.first.click()
    panel = page.locator("#site-panel")
    assert "QK-norm" in panel.inner_text() and "1.00e-6" in panel.inner_text()
    assert panel.locator("code.formula").inner_text() == "y = w ⊙ (x / sqrt(mean(x²) + 1e-06)).to(dtype)"
    assert qk.first.get_attribute("aria-pressed") == "true"
    # the keyboard: Tab reaches a site, Enter opens it
    page.locator("svg.diagram .site[data-slot='final']").focus()
    page.keyboard.press("Enter")
    assert "final norm" in panel.inner_text() and qk.first.get_attribute("aria-pressed") == "false"
    page.keyboard.press("Shift+Tab")
    assert page.evaluate("document.activeElement.dataset.slot") in ("pre", "qk")
    page.keyboard.press("Enter")
    assert "final norm" not in panel.inner_text()
    page.set_viewport_size({"width": 1440, "height": 900})
    try:
        qk.first.click()
        page.screenshot(path=str(ARTIFACTS / "inspect-qwen3-1440.png"), full_page=True)
    finally:
        page.set_viewport_size({"width": 1360, "height": 900})


@browser
@pytest.mark.parametrize("model_type", ["qwen3", "olmo2"])
def test_the_inspect_view_is_no_wider_than_a_phone(site: dict[str, Any], model_type: str) -> None:
    page = site["page"]
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        page = _open(site, "inspect", f"model_type={model_type}")
        page.wait_for_selector("#inspect-out .report svg.diagram", timeout=90_000)
        page.locator("svg.diagram .site[data-slot='qk']").first.click()
        page.wait_for_timeout(100)
        width = page.evaluate("document.scrollingElement.scrollWidth")
        wide = page.evaluate(
            "[...document.querySelectorAll('main *')].filter(e => e.getBoundingClientRect().right > innerWidth + 1"
            " && !e.closest('.table-wrap, .diagram-scroll')).slice(0, 5).map(e => e.tagName + '.' + e.className)"
        )
        page.screenshot(path=str(ARTIFACTS / f"inspect-{model_type}-390.png"), full_page=True)
        assert width <= 390 and wide == [], f"{width} px wide at 390: {wide}"
        # the diagram keeps its size in its own scroll box: a site stays at least 40 x 24 px, big enough to tap
        box = page.locator("svg.diagram .site[data-slot='qk'] rect").first.bounding_box()
        assert box["width"] >= 40 and box["height"] >= 24, box
        scroll = page.locator(".diagram-scroll").bounding_box()
        assert scroll["x"] >= 0 and scroll["x"] + scroll["width"] <= 390
        assert page.is_visible(".diagram-hint")
    finally:
        page.set_viewport_size({"width": 1360, "height": 900})


@browser
def test_the_report_with_a_site_open_meets_wcag_aa(site: dict[str, Any]) -> None:
    page = _open(site, "inspect", "model_type=qwen3")
    page.wait_for_selector("#inspect-out .report svg.diagram", timeout=90_000)
    page.locator("svg.diagram .site[data-slot='qk']").first.click()
    low = page.evaluate(CONTRAST_JS)
    assert low == [], f"text under WCAG AA contrast: {low[:8]}"


@browser
def test_a_v_norm_is_drawn_and_side_path_norms_open_too(site: dict[str, Any]) -> None:
    page = _open(site, "inspect", "model_type=gemma3n_text")
    page.wait_for_selector("#inspect-out .report svg.diagram", timeout=90_000)
    v = page.locator("svg.diagram .site[data-slot='v']")
    assert v.count() == 1 and page.locator("svg.diagram .site[data-slot='qk']").count() == 2
    v.focus()
    page.keyboard.press("Enter")
    panel = page.locator("#site-panel")
    assert "V-norm" in panel.inner_text() and v.get_attribute("aria-pressed") == "true"
    chip = page.locator(".other-sites button.site-chip").first
    chip.click()
    assert "side path" in panel.inner_text() and chip.get_attribute("aria-pressed") == "true"
    assert v.get_attribute("aria-pressed") == "false"
    page.screenshot(path=str(ARTIFACTS / "inspect-gemma3n_text.png"), full_page=True)
