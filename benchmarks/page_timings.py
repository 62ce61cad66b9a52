"""The local page's timings and screenshots, as a user meets them (issue 34): every view at 1440 and 390 px wide.

A fresh ``normatlas serve`` equivalent on a free loopback port (``--experiments DIR`` when given, else none) and a
fresh headless Chromium (Debian's ``/usr/bin/chromium``, the flags the browser tests use, a new profile). Per view
and width: the seconds from navigation to the view marking itself ready (``main[data-ready='1']``), first visit and
a second one (the page's caches warm), and a full-page screenshot. Then an inspection from the page on a fresh
server for each model type given: the seconds until the report is drawn (the job's build, trace and read included).
``os.getloadavg()`` is printed before and after. Command::

    python benchmarks/page_timings.py --out benchmarks/results/page [--experiments DIR] [--inspect qwen3,gpt2,llava]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from normatlas.web.server import Config, make_server

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync"]  # fmt: skip
VIEWS = ("axes", "placements", "matrix", "papers", "inspect", "tools", "experiments", "geometry")
WIDTHS = (1440, 390)


@contextmanager
def serving(experiments: Path | None) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, Config(Path.cwd(), experiments))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextmanager
def browser(width: int) -> Iterator[object]:
    from playwright import sync_api

    with tempfile.TemporaryDirectory() as profile, sync_api.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=ARGS, viewport={"width": width, "height": 900}
        )
        try:
            yield ctx.pages[0] if ctx.pages else ctx.new_page()
        finally:
            ctx.close()


def _ready(page: object, url: str, view: str, query: str = "", timeout_ms: int = 30_000) -> float:
    start = time.perf_counter()
    page.goto(f"{url}#/{view}{'?' + query if query else ''}")  # type: ignore[attr-defined]
    page.wait_for_selector(f"main[data-view='{view}'][data-ready='1']", timeout=timeout_ms)  # type: ignore[attr-defined]
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/page", help="folder for the screenshots")
    ap.add_argument("--experiments", type=Path, default=None, help="an experiments output folder to serve")
    ap.add_argument("--inspect", default="qwen3,gpt2,llava", help="model types to inspect from the page, each fresh")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    print(f"loadavg before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs")
    print("| view | width | first visit (s) | second visit (s) |\n|---|---|---|---|")
    for width in WIDTHS:
        with serving(args.experiments) as url, browser(width) as page:
            for view in VIEWS:
                first = _ready(page, url, view)
                page.goto("about:blank")  # type: ignore[attr-defined]
                second = _ready(page, url, view)
                page.wait_for_load_state("networkidle")  # type: ignore[attr-defined]
                page.screenshot(path=str(out / f"{view}-{width}.png"), full_page=True)  # type: ignore[attr-defined]
                print(f"| {view} | {width} | {first:.2f} | {second:.2f} |", flush=True)
    print("\n| inspect (fresh server) | until the report is drawn (s) |\n|---|---|")
    for model_type in filter(None, args.inspect.split(",")):
        with serving(args.experiments) as url, browser(1440) as page:
            start = time.perf_counter()
            page.goto(f"{url}#/inspect?model_type={model_type}")  # type: ignore[attr-defined]
            page.wait_for_selector("#inspect-out .report", timeout=300_000)  # type: ignore[attr-defined]
            seconds = time.perf_counter() - start
            page.screenshot(path=str(out / f"inspect-{model_type}-1440.png"), full_page=True)  # type: ignore[attr-defined]
            print(f"| {model_type} | {seconds:.1f} |", flush=True)
    load = os.getloadavg()
    print(f"\nloadavg after {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; screenshots in {out}")


if __name__ == "__main__":
    main()
