"""``normatlas diagnose``: the real-weights geometry report (residual stream, attention, massive activations).

The model folder is read under the one load policy (:mod:`normatlas.checkpoint`: config.json as JSON, weights
from safetensors only, never a pickle) and must hold its tokenizer files.
"""

from __future__ import annotations

import argparse

from . import _progress as progress
from ._format import Section, add_format_option, emit


def _sentence(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"--sentence must hold words, got {text!r}")
    return text


def configure_diagnose(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="local checkpoint folder: config.json, *.safetensors and tokenizer files (default: all-MiniLM-L6-v2)",
    )
    p.add_argument("--sentence", type=_sentence, action="append", default=None, help="a sentence to run (repeatable)")
    p.add_argument("--groups", action="store_true", help="also print param_groups' role summary for the model")
    add_format_option(p)


def diagnose(args: argparse.Namespace) -> int:
    from ..diagnostics.report import DEFAULT_SENTENCES, diagnose_hf

    with progress.phase("loading the model and running the sentences"):
        result = diagnose_hf(args.model, args.sentence or DEFAULT_SENTENCES)
    title = (
        f"{result['model']}: {result['sentences']} sentences, one at a time; "
        f"mean last-block output norm {result['output_norm']:.4g}"
    )
    sections = [Section("layers", result["rows"], title)]
    if args.groups:
        from ..diagnostics.groups import param_roles, summarize_roles

        with progress.phase("reading the parameters' roles from the dataflow"):
            infos = param_roles(result["module"])  # the roles param_groups(model, weight_decay=0.1) uses
        sections.append(Section("param_groups", summarize_roles(infos), "param_groups(model, weight_decay=0.1)"))
    meta = {"model": result["model"], "sentences": result["sentences"], "output_norm": result["output_norm"]}
    emit(sections, args.format, meta=meta if args.format == "json" else None)
    return 0
