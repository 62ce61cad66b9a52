"""Port every decoder model type of the installed transformers into our Block, and count what ports exactly.

Each model type with a causal-LM class (the inspector sweep's list, :func:`normatlas.inspect.sweep.decoder_model_types`)
is built tiny from its config class (offline, random weights, as ``normatlas inspect`` builds it), inspected, and
ported with :func:`normatlas.port.port` (which checks the fp32 logits itself); the row records the inspector's
placement, whether it ported, the max abs logit difference, and the refusal's reasons. Each type runs in a forked
child killed after ``--timeout`` seconds. Models are built with transformers' default attention (sdpa where the
model supports it), as ``from_config`` builds them; ``--attn-implementation eager`` sweeps the eager build, and the
row records which implementation ran.

    PYTHONPATH=src HF_HUB_OFFLINE=1 nice python benchmarks/port_sweep.py --out benchmarks/results
    PYTHONPATH=src HF_HUB_OFFLINE=1 nice python benchmarks/port_sweep.py --attn-implementation eager --out /tmp/eager
"""

from __future__ import annotations

import argparse
import csv
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from normatlas._io import atomic_write, dumps
from normatlas.inspect.sweep import run_isolated

COLUMNS = ["model", "status", "attention", "placement", "max_abs_diff", "reason", "seconds"]
ATTENTION: str | None = None  # --attn-implementation (None: transformers' default); set before forking


def one(mt: str) -> dict[str, Any]:
    """Build, inspect and port one model type; the row never raises."""
    import torch

    from normatlas.factory import build_target
    from normatlas.inspect import inspect_model
    from normatlas.port import PortError, port

    torch.set_num_threads(1)
    row: dict[str, Any] = {"model": mt, "status": "", "placement": "", "max_abs_diff": None, "reason": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model, inputs, _ = build_target(mt, attn_implementation=ATTENTION)
            model = model.float()
            row["attention"] = str(getattr(model.config, "_attn_implementation", ""))
        except Exception as exc:  # a per-architecture row, by design
            return row | {"status": "not built", "reason": f"{type(exc).__name__}: {str(exc)[:160]}"}
        try:
            row["placement"] = inspect_model(model, inputs, probe=False).placement.value
        except Exception as exc:
            return row | {"status": "not read", "reason": f"{type(exc).__name__}: {str(exc)[:160]}"}
        try:
            p, _ = port(model)
            row |= {"status": "ported", "max_abs_diff": p.max_abs_diff}
        except PortError as exc:
            row |= {"status": "refused", "reason": "; ".join(exc.missing)[:400]}
        except Exception as exc:
            row |= {"status": "error", "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return row


def isolated(mt: str, timeout: float) -> dict[str, Any]:
    row, why = run_isolated(one, mt, timeout)
    return row or {"model": mt, "status": "error", "reason": why}


def reason_group(reason: str) -> str:
    """A refusal's first reason with layer numbers and module labels dropped, for grouping."""
    import re

    first = reason.split(";")[0]
    first = re.sub(r"layer \d+: ", "", first)
    first = re.sub(r"\(([^()]*)\)", "(...)", first)
    return re.sub(r": [\w.,\s]+$", ": ...", first).strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--timeout", type=float, default=90.0)
    ap.add_argument("--only", nargs="*", help="model types (default: every decoder type)")
    ap.add_argument("--attn-implementation", choices=("eager", "sdpa", "flex_attention"), default=None,
                    help="build with this attention (default: transformers' default)")  # fmt: skip
    args = ap.parse_args()
    global ATTENTION
    ATTENTION = args.attn_implementation
    import transformers  # noqa: F401  (imported once, before forking)

    from normatlas.inspect.sweep import decoder_model_types

    types = args.only or decoder_model_types()
    rows = []
    for i, mt in enumerate(types):
        t0 = time.perf_counter()
        row = isolated(mt, args.timeout)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(f"[{i + 1}/{len(types)}] {mt}: {row['status']} {row.get('max_abs_diff') or ''} {row['reason'][:120]}",
              flush=True)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "port_sweep.json", dumps(rows, indent=1))
    with (out / "port_sweep.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(Counter(r["status"] for r in rows))
    print(Counter(r.get("attention") or "not built" for r in rows))
    for reason, n in Counter(reason_group(r["reason"]) for r in rows if r["status"] == "refused").most_common():
        print(f"{n:4d}  {reason}")


if __name__ == "__main__":
    main()
