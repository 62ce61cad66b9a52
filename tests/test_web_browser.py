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

from tests.web_helpers import running, write_experiments, write_failing_experiment

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parent / "artifacts" / "web"
VIEWS = ("axes", "placements", "matrix", "papers", "inspect", "tools", "experiments", "geometry")

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is absent (make test installs it)")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server (with one experiment result) and a fresh headless Chromium; records console errors and hosts."""
    from playwright import sync_api

    out = tmp_path_factory.mktemp("experiments")
    write_experiments(out)
    write_failing_experiment(out)
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
        yield {"page": page, "url": server.url, "log": log, "server": server}
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


# --- issue 34: the page people would rather look at --------------------------------------------------------------

VISIBLE_ROWS = "#matrix tbody tr:not(.detail):not([hidden])"


def _rows(page: Any) -> int:
    return int(page.locator(VISIBLE_ROWS).count())


def _column(page: Any, col: str) -> list[str]:
    """The texts of one matrix column (by its field name) in the visible rows, top to bottom."""
    index = page.evaluate(
        "c => [...document.querySelectorAll('#matrix thead th')].findIndex(th => th.dataset.col === c)", col
    )
    return [t.strip() for t in page.locator(f"{VISIBLE_ROWS} > :nth-child({index + 1})").all_inner_texts()]


def test_search_matches_values_never_field_names(site: dict[str, Any]) -> None:
    page = _open(site, "matrix")
    total = _rows(page)
    # field names ("qk_norm", "source", "notes", "provenance") and null must not match every row
    for word in ("qk", "source", "notes", "provenance", "hf_model_types", "status"):
        page.fill("#matrix-search", word)
        assert _rows(page) < total // 2, f"searching {word!r} kept {_rows(page)} of {total} rows"
    page.fill("#matrix-search", "null")
    assert _rows(page) == 0
    page.fill("#matrix-search", "per-head")  # a value does match
    assert 0 < _rows(page) < total
    page = _open(site, "papers")
    papers = page.locator("li.paper").count()
    for word in ("link", "https", "verified", "null"):
        page.fill("#papers-search", word)
        assert page.locator("li.paper:not([hidden])").count() < papers // 4, f"papers: {word!r} matches too many"


def test_facets_are_typed_with_one_spelling_per_value(site: dict[str, Any]) -> None:
    page = _open(site, "matrix")
    selects = page.locator("select[id^='filter-']")
    assert selects.count() >= 10  # family, modality and every typed design field
    for i in range(selects.count()):
        values = [v for v in selects.nth(i).locator("option").evaluate_all("os => os.map(o => o.value)") if v]
        folded = [v.lower().replace("-", "").replace(" ", "") for v in values]
        assert len(set(folded)) == len(folded), f"{selects.nth(i).get_attribute('id')}: duplicate spellings {values}"
    qk = page.locator("#filter-qk_norm option").evaluate_all("os => os.map(o => o.value)")
    assert "yes" not in qk and "per-head" in qk
    page.select_option("#filter-qk_norm", "per-head")
    cells = _column(page, "qk_norm")
    assert cells and all(c == "per-head" for c in cells), cells
    assert "qk_norm=per-head" in page.url
    page.select_option("#filter-qk_norm", "")
    page.click(".more-filters summary")  # the other facets sit under "more filters"
    page.select_option("#filter-attn_softcap", "50.0")  # a number's facet matches its records (50 in JSON)
    assert _rows(page) > 0 and all("50" in t for t in page.locator(VISIBLE_ROWS).all_inner_texts())
    page.select_option("#filter-attn_softcap", "")


def test_columns_sort_both_ways_with_the_state_in_the_hash(site: dict[str, Any]) -> None:
    page = _open(site, "matrix")
    year = "#matrix thead th[data-col='year'] button"

    def years() -> list[int]:
        return [int(t) for t in _column(page, "year") if t.isdigit()]

    page.click(year)
    assert page.get_attribute("#matrix thead th[data-col='year']", "aria-sort") == "ascending"
    up = years()
    assert up == sorted(up) and len(up) > 30 and "sort=year" in page.url
    page.click(year)
    assert page.get_attribute("#matrix thead th[data-col='year']", "aria-sort") == "descending"
    assert years() == sorted(up, reverse=True) and "sort=-year" in page.url
    page.click("#matrix thead th[data-col='operator'] button")
    known = [o for o in _column(page, "operator") if o != "unclear"]
    assert known == sorted(known)
    page = _open(site, "matrix", "sort=-year")  # a linked sort is restored
    assert page.get_attribute("#matrix thead th[data-col='year']", "aria-sort") == "descending"


def test_matrix_rows_are_compact_the_header_sticks_and_badges_are_few(site: dict[str, Any]) -> None:
    page = _open(site, "matrix")
    heights = sorted(page.locator(VISIBLE_ROWS).evaluate_all("rs => rs.map(r => r.getBoundingClientRect().height)"))
    median = heights[len(heights) // 2]
    print(f"matrix row height: median {median:.1f} px, max {heights[-1]:.1f} px")
    assert 24 <= median <= 40, f"rows are {median} px tall"
    rows = _rows(page)
    badges = page.locator("#matrix tbody .badge").count()
    print(f"{badges} provenance badges on {rows} rows")
    assert badges <= rows * 1.5, f"{badges} badges on {rows} rows"
    page.evaluate("document.getElementById('matrix-wrap').scrollTop = 900")
    page.wait_for_timeout(100)
    wrap_top = page.evaluate("document.getElementById('matrix-wrap').getBoundingClientRect().top")
    th_top = page.evaluate("document.querySelector('#matrix thead th').getBoundingClientRect().top")
    assert abs(th_top - wrap_top) <= 2, f"the header sits at {th_top}, its box at {wrap_top}: it did not stick"


def test_a_models_row_links_its_papers_inspection_and_placement(site: dict[str, Any]) -> None:
    page = _open(site, "matrix", "q=gemma 2")
    page.click("#matrix tbody tr[data-name='Gemma 2'] button.model")
    detail = page.locator("#matrix tbody tr.detail:not([hidden])")
    assert detail.count() == 1 and "open=Gemma" in page.url
    assert detail.locator("a[href^='#/papers?q=']").count() >= 1
    assert detail.locator("a[href='#/inspect?model_type=gemma2']").count() == 1
    detail.locator("a[href^='#/placements?kind=']").click()
    page.wait_for_selector("main[data-view='placements'][data-ready='1']")
    cards = page.locator("article.placement")
    assert 0 < cards.count() < 14 and "kind=" in page.url
    page = _open(site, "matrix", "q=gemma 2")
    page.click("#matrix tbody tr[data-name='Gemma 2'] button.model")
    page.locator("#matrix tbody tr.detail:not([hidden]) a[href^='#/papers?q=']").first.click()
    page.wait_for_selector("main[data-view='papers'][data-ready='1']")
    assert page.locator("li.paper:not([hidden])").count() >= 1


PHONE_VIEWS = (*VIEWS, "inspect?model_type=gpt2")


@pytest.mark.parametrize("view", PHONE_VIEWS)
def test_no_view_is_wider_than_a_phone(site: dict[str, Any], view: str) -> None:
    page = site["page"]
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        name, _, query = view.partition("?")
        page = _open(site, name, query)
        if query:
            page.wait_for_selector("#inspect-out .report", timeout=90_000)
        width = page.evaluate("document.scrollingElement.scrollWidth")
        wide = page.evaluate(
            "[...document.querySelectorAll('main *')].filter(e => e.getBoundingClientRect().right > innerWidth + 1"
            " && !e.closest('.table-wrap, .diagram-scroll')).slice(0, 5).map(e => e.tagName + '.' + e.className)"
        )
        page.screenshot(path=str(ARTIFACTS / f"{name}{'-report' if query else ''}-390.png"), full_page=True)
        assert width <= 390, f"{view} is {width} px wide at 390: {wide}"
        if name == "matrix":
            assert page.is_visible("#matrix-hint") and "scroll" in page.inner_text("#matrix-hint")
            shown = page.evaluate(
                "[...document.querySelectorAll('#matrix thead th')].filter(th => {"
                " const r = th.getBoundingClientRect(); return r.width > 0 && r.right <= innerWidth;"
                " }).map(th => th.dataset.col)"
            )
            assert {"name", "operator", "placement"} <= set(shown), shown
    finally:
        page.set_viewport_size({"width": 1360, "height": 900})


# every visible text element's colour against the background it is drawn on (the backgrounds of its ancestors
# composited; an SVG text against its nearest HTML box), its opacity folded in; WCAG 2 relative luminance
CONTRAST_JS = r"""
() => {
  const parse = (c) => {
    const m = /rgba?\(([^)]+)\)/.exec(c || "");
    if (!m) return null;
    const p = m[1].split(/[\s,\/]+/).filter(Boolean).map(Number);
    return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
  };
  const over = (top, under) => [0, 1, 2].map((i) => top[i] * top[3] + under[i] * (1 - top[3])).concat([1]);
  const lum = (c) => {
    const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]);
  };
  const out = [];
  for (const el of document.querySelectorAll("body *")) {
    if (["SCRIPT", "STYLE", "OPTION", "TITLE"].includes(el.tagName)) continue;
    const own = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
    if (!own) continue;
    const r = el.getBoundingClientRect();
    const cs = getComputedStyle(el);
    if (!r.width || !r.height || cs.visibility !== "visible") continue;
    if (el.closest("[hidden], details:not([open]) > :not(summary)")) continue;
    if (r.right < 0 || r.bottom < 0) continue;  // the skip link parked off screen until focused
    const svg = el instanceof SVGElement;
    let fg = parse(svg ? cs.fill : cs.color);
    if (!fg) continue;
    let chain = [], alpha = 1;
    for (let e = el; e; e = e.parentElement) {
      chain.push(e);
      alpha *= Number(getComputedStyle(e).opacity);
    }
    let bg = [255, 255, 255, 1];
    for (const e of chain.reverse()) {
      if (e instanceof SVGElement) continue;
      const b = parse(getComputedStyle(e).backgroundColor);
      if (b && b[3] > 0) bg = over(b, bg);
    }
    fg = over([fg[0], fg[1], fg[2], fg[3] * alpha], bg);
    const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x);
    const ratio = (a + 0.05) / (b + 0.05);
    const size = parseFloat(cs.fontSize), bold = Number(cs.fontWeight) >= 700;
    const large = size >= 24 || (size >= 18.66 && bold);
    const need = large ? 3 : 4.5;
    if (ratio < need) out.push({
      text: el.textContent.trim().slice(0, 40), tag: el.tagName, cls: String(el.className.baseVal ?? el.className),
      ratio: Math.round(ratio * 100) / 100, need, fg: cs.color, bg: `rgb(${bg.slice(0, 3).map(Math.round)})`,
    });
  }
  return out;
}
"""


@pytest.mark.parametrize("view", (*VIEWS, "matrix?open=Gemma%202&q=gemma", "inspect?model_type=gpt2"))
def test_text_contrast_meets_wcag_aa(site: dict[str, Any], view: str) -> None:
    name, _, query = view.partition("?")
    page = _open(site, name, query)
    if name == "inspect" and query:
        page.wait_for_selector("#inspect-out .report", timeout=90_000)
    page.wait_for_load_state("networkidle")
    low = page.evaluate(CONTRAST_JS)
    assert low == [], f"{view}: text under WCAG AA contrast: {low[:8]}"


def test_experiments_say_why_a_claim_fails_and_open_figures_full_size(site: dict[str, Any]) -> None:
    page = _open(site, "experiments")
    failed = page.locator("#exp-variance-flat")
    assert "does not hold" in failed.locator(".panel-head .pill").inner_text()
    why = failed.locator(".why").inner_text()
    assert "Why it does not hold" in why and "stays flat" in why
    assert failed.locator("table.clauses tr.failed").count() == 1  # the failed clause is named, the other is not
    assert "Pre-LN's stream stays flat" in failed.locator("table.clauses tr.failed").inner_text()
    assert page.locator("#exp-variance-depth .why").count() == 0  # a claim that holds needs no reasons
    labels = page.locator("#exp-variance-depth table.measured th").all_inner_texts()
    assert labels and all("_" not in t for t in labels), labels
    link = page.locator("#exp-variance-depth a.figure-link")
    href = link.get_attribute("href")
    assert href == "/experiments/variance-depth/figure.png"
    shown = page.evaluate("document.querySelector('#exp-variance-depth img.figure').getBoundingClientRect().width")
    with page.context.expect_page() as popup:
        link.click()
    full = popup.value
    full.wait_for_load_state()
    natural = full.evaluate("document.querySelector('img').naturalWidth")
    full.close()
    print(f"figure shown {shown:.0f} px wide, full size {natural} px")
    assert natural > shown
    page.screenshot(path=str(ARTIFACTS / "experiments-reasons.png"), full_page=True)


def test_placements_compare_depth_profiles_on_one_y_scale(site: dict[str, Any]) -> None:
    page = _open(site, "placements")
    fig = page.locator("#depth-compare figure[data-exp='variance-depth']")
    assert fig.locator("polyline[data-placement]").count() == 2  # the fixture measured pre_ln and post_ln
    assert set(fig.locator(".legend .key").all_inner_texts()) == {"pre_ln", "post_ln"}
    # every card's chart of one experiment shares the y scale: the same top and bottom tick labels
    ticks = [
        page.locator(f"#placement-{p} svg.chart text.tick.end").all_inner_texts()[:2] for p in ("pre_ln", "post_ln")
    ]
    assert ticks[0] == ticks[1], ticks
    page = _open(site, "placements", "kind=peri")
    assert page.locator("#depth-compare").count() == 0
    kinds = page.locator("article.placement .panel-head .pill").all_inner_texts()
    assert kinds and all("peri" in k for k in kinds)
