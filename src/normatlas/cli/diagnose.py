"""``normatlas diagnose``: the real-weights geometry report (residual stream, attention, massive activations)."""

from __future__ import annotations

import argparse

from . import command
from ._format import add_format_option, format_rows


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local transformers checkpoint folder (default: all-MiniLM-L6-v2)")
    p.add_argument("--sentence", action="append", default=None, help="a sentence to run (repeatable)")
    add_format_option(p)


@command("diagnose", "per-layer residual stats, attention entropy and massive activations on real weights", _configure)
def diagnose(args: argparse.Namespace) -> int:
    from ..diagnostics.report import DEFAULT_SENTENCES, diagnose_hf

    result = diagnose_hf(args.model, args.sentence or DEFAULT_SENTENCES)
    title = (
        f"{result['model']}: {result['sentences']} sentences, one at a time; "
        f"mean last-block output norm {result['output_norm']:.4g}"
    )
    print(format_rows(result["rows"], args.format, title=title))
    return 0
