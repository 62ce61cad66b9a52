"""``normatlas diagnose``: the real-weights geometry report (residual stream, attention, massive activations)."""

from __future__ import annotations

import argparse

from . import command
from ._format import add_format_option, format_rows


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local transformers checkpoint folder (default: all-MiniLM-L6-v2)")
    p.add_argument("--sentence", action="append", default=None, help="a sentence to run (repeatable)")
    p.add_argument("--groups", action="store_true", help="also print param_groups' role summary for the model")
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
    if args.groups:
        from ..diagnostics.groups import param_roles, summarize_roles

        infos = param_roles(result["module"])  # the roles param_groups(model, weight_decay=0.1) uses
        print(format_rows(summarize_roles(infos), args.format, title="param_groups(model, weight_decay=0.1)"))
    return 0
