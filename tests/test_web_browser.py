"""The atlas page in a real browser: Debian's Chromium driven by Playwright, against a server in a thread.

Every view renders with no console error and no request leaving 127.0.0.1; the Axes view names the
layer of a reduction the way the library does, in both conventions; the matrix filter and search
narrow the rows; the axis toggles work from the keyboard alone. Each view's screenshot is written to
``tests/artifacts/web/`` (ignored by git).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.web_helpers import running, write_experiments

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts" / "web"
VIEWS = ("axes", "placements", "matrix", "papers", "inspect", "experiments", "geometry")

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is absent (make test installs it)")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server (with one experiment result) and a fresh headless Chromium; records console errors and hosts."""
    from playwright import sync_api

    out = tmp_path_factory.mktemp("experiments")
    write_experiments(out)
    profile = tmp_path_factory.mktemp("chromium-profile")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with running(Path(__file__).resolve().parents[1], out) as server, sync_api.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=ARGS, viewport={"width": 1360, "height": 900}
        )
        log: dict[str, Any] = {"errors": [], "hosts": set(), "failed": []}
        page = ctx.pages[0] if ctx.pages else ctx.new_page()
        page.on("console", lambda m: m.type == "error" and log["errors"].append(m.text))
        page.on("pageerror", lambda e: log["errors"].append(str(e)))
        ctx.on("request", lambda r: log["hosts"].add(urlsplit(r.url).hostname))
        # belt and braces: anything not addressed to the server is aborted (and still recorded above)
        ctx.route(lambda url: urlsplit(url).hostname != "127.0.0.1", lambda route: route.abort())
        ctx.on(
            "response", lambda r: r.status >= 400 and log["failed"].append(f"{r.status} {r.url} {r.request.post_data}")
        )
        yield {"page": page, "url": server.url, "log": log}
        ctx.close()


def _open(site: dict[str, Any], view: str, query: str = "") -> Any:
    page = site["page"]
    page.goto(f"{site['url']}#/{view}{'?' + query if query else ''}")
    page.wait_for_selector(f"main[data-view='{view}'][data-ready='1']", timeout=15_000)
    return page


@pytest.mark.parametrize("view", VIEWS)
def test_each_view_renders_without_errors_or_remote_requests(site: dict[str, Any], view: str) -> None:
    site["log"]["errors"].clear()
    page = _open(site, view)
    assert page.locator("main h1").count() == 1, f"{view} has no heading"
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(ARTIFACTS / f"{view}.png"), full_page=True)
    assert site["log"]["errors"] == [], f"{view}: console errors {site['log']['errors']} from {site['log']['failed']}"
    assert site["log"]["hosts"] <= {"127.0.0.1"}, f"requests left loopback: {site['log']['hosts']}"


def test_first_render_within_two_seconds(site: dict[str, Any]) -> None:
    page = site["page"]
    page.goto("about:blank")
    t0 = time.perf_counter()
    _open(site, "axes")
    page.wait_for_selector("#name-NCHW")
    seconds = time.perf_counter() - t0
    print(f"first render of the Axes view: {seconds:.2f} s")
    assert seconds < 2.0, f"the Axes view took {seconds:.2f} s to render"


def _names(page: Any) -> tuple[str, str]:
    page.wait_for_selector("main[data-ready='1']")
    return page.inner_text("#name-NCHW"), page.inner_text("#name-BTD")


def _select(page: Any, want: set[str]) -> None:
    """Press the axis toggles until exactly ``want`` is pressed (adding first: one axis stays pressed)."""
    for role in ("sample", "feature", "position"):
        if role in want and page.get_attribute(f"#axis-{role}", "aria-pressed") == "false":
            page.click(f"#axis-{role}")
    for role in ("sample", "feature", "position"):
        if role not in want and page.get_attribute(f"#axis-{role}", "aria-pressed") == "true":
            page.click(f"#axis-{role}")
    for role in ("sample", "feature", "position"):
        expected = "true" if role in want else "false"
        page.wait_for_selector(f"#axis-{role}[aria-pressed='{expected}']")


def _wait_name(page: Any, nchw: str) -> tuple[str, str]:
    page.wait_for_function("n => document.querySelector('#name-NCHW')?.textContent === n", arg=nchw, timeout=5000)
    return _names(page)


def test_axes_name_batchnorm_and_layernorm_in_both_conventions(site: dict[str, Any]) -> None:
    page = _open(site, "axes")
    _select(page, {"sample", "position"})
    vision, sequence = _wait_name(page, "BatchNorm")
    assert (vision, sequence) == ("BatchNorm", "BatchNorm")
    assert "depends on the batch" in page.inner_text("#panel-NCHW")
    assert "reduce=position%2Csample" in page.url or "reduce=sample%2Cposition" in page.url
    _select(page, {"feature", "position"})
    vision, sequence = _wait_name(page, "LayerNorm (whole sample)")
    assert sequence == "LayerNorm over the sequence"
    assert "batch-independent" in page.inner_text("#panel-BTD")
    _select(page, {"feature"})
    assert _wait_name(page, "LayerNorm2d (channels at each position)")[1] == "LayerNorm"


def test_axes_group_control_names_groupnorm(site: dict[str, Any]) -> None:
    page = _open(site, "axes", "reduce=feature,position")
    page.select_option("#groups", "2")
    assert _wait_name(page, "GroupNorm")[0] == "GroupNorm"
    page.select_option("#groups", "6")  # one channel per group: InstanceNorm
    assert _wait_name(page, "InstanceNorm")[0] == "InstanceNorm"


def test_axis_toggles_work_from_the_keyboard_alone(site: dict[str, Any]) -> None:
    page = _open(site, "axes")
    page.focus("#axis-sample")
    page.keyboard.press("Enter")  # sample on
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "axis-feature"
    page.keyboard.press("Space")  # feature off
    page.keyboard.press("Tab")
    page.keyboard.press("Enter")  # position on
    assert _wait_name(page, "BatchNorm")[1] == "BatchNorm"
    outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline != "none", "the focused toggle shows no focus ring"


def test_matrix_filter_and_search_narrow_the_rows(site: dict[str, Any]) -> None:
    page = _open(site, "matrix")
    visible = "#matrix tbody tr:not([hidden])"
    total = page.locator(visible).count()
    assert total >= 60
    page.select_option("#filter-family", "Gemma")
    gemma = page.locator(visible).count()
    assert 0 < gemma < total
    assert all("Gemma" in t for t in page.locator(f"{visible} td:nth-child(2)").all_inner_texts())
    assert "family=Gemma" in page.url
    page.fill("#matrix-search", "gemma 2")
    narrowed = page.locator(visible).count()
    assert 0 < narrowed < gemma
    page.select_option("#filter-family", "")
    page.fill("#matrix-search", "no such model anywhere")
    assert page.locator(visible).count() == 0
    assert page.inner_text("#matrix-count").startswith("0 of")


def test_papers_search_and_links(site: dict[str, Any]) -> None:
    page = _open(site, "papers")
    assert page.locator(".paper-title a[href^='https://arxiv.org/abs/']").count() > 20
    page.fill("#papers-search", "rmsnorm")
    shown = page.locator("li.paper:not([hidden])").count()
    assert 0 < shown < page.locator("li.paper").count()


def test_placements_and_experiments_draw_the_measured_profile(site: dict[str, Any]) -> None:
    page = _open(site, "placements")
    assert page.locator("article.placement svg.diagram").count() >= 14
    assert page.locator("#placement-pre_ln svg.chart").count() == 1  # the fixture's variance-depth series
    page = _open(site, "experiments")
    page.wait_for_function("() => document.querySelector('img.figure')?.complete", timeout=5000)
    assert page.evaluate("document.querySelector('img.figure').naturalWidth") > 0
    assert site["log"]["failed"] == []


def test_geometry_shows_the_librarys_gradient_orthogonal_to_ones_and_x_hat(site: dict[str, Any]) -> None:
    page = _open(site, "geometry")
    for key in ("∂L/∂x · 1", "∂L/∂x · x̂"):
        value = float(page.inner_text(f"#geometry-readout dd[data-k='{key}']"))
        assert abs(value) < 1e-5, f"{key} = {value}"  # exact but for eps = 1e-5 (x / sqrt(var + eps))
    box = page.locator("#geometry-canvas").bounding_box()
    page.mouse.move(box["x"] + 100, box["y"] + 100)
    page.mouse.down()
    page.mouse.move(box["x"] + 220, box["y"] + 160)
    page.mouse.up()
    page.focus("#geometry-canvas")
    page.keyboard.press("ArrowLeft")
    page.screenshot(path=str(ARTIFACTS / "geometry-rotated.png"))
    assert site["log"]["errors"] == []


def test_inspect_draws_a_models_placement(site: dict[str, Any]) -> None:
    page = _open(site, "inspect", "model_type=gpt2")
    page.wait_for_selector("#inspect-out .report svg.diagram", timeout=30_000)
    assert "layernorm" in page.inner_text("#inspect-out")
    page.screenshot(path=str(ARTIFACTS / "inspect-gpt2.png"), full_page=True)
    assert site["log"]["errors"] == [] and site["log"]["failed"] == []
