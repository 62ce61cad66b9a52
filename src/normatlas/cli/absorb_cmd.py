"""``normatlas absorb``: fold each post-branch RMSNorm into the linear layer before it, its statistic frozen on
calibration text (Pangu's inference trick; :mod:`normatlas.surgery.absorb`).

Follows ``normatlas fold``: a safetensors checkpoint folder (with its tokenizer: calibration and the held-out measure
run real text), arguments and the output location checked before loading, the input never touched, the output
written atomically and only after the proof passed. The proof compares the absorbed model with the
*frozen-statistic* model (each norm dividing by its calibration mean rms): that is exact, to rounding. Against the
original it is an approximation, and the command says how far: the max logit difference and the next-token loss on
held-out text the calibration did not see.

Calibration: the texts given with ``--calibration-text`` (repeatable), else the first 8 windows of the held-out
standard-library text; the measure: ``--windows`` windows after those 8.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from . import CliError, positive_int
from . import _progress as progress
from ._format import Section
from .surgery import _common, _finish, _prepare

CALIBRATION_WINDOWS = 8


def configure_absorb(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument(
        "--calibration-text",
        action="append",
        metavar="TEXT",
        help="text to measure each norm's rms on (repeatable; default: 8 windows of held-out stdlib source)",
    )
    p.add_argument(
        "--windows", type=positive_int, default=8, help="held-out windows the approximation is measured on (8)"
    )


def _calibration(args: argparse.Namespace, model: Any, tok: Any, ids: list[int], seq: int) -> tuple[list[Any], str]:
    from ..tools import check_ids, windows

    if not args.calibration_text:
        cal = windows(ids, seq, CALIBRATION_WINDOWS)
        return [{"input_ids": cal}], f"{cal.numel()} tokens of held-out stdlib source"
    out = []
    for text in args.calibration_text:
        if not text.strip():
            raise CliError(f"--calibration-text must hold text, got {text!r}")
        t = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :seq]
        if t.numel() == 0:
            raise CliError(f"--calibration-text {text!r} has no tokens")
        check_ids(model, t, f"--calibration-text {text!r}")
        out.append({"input_ids": t})
    return out, f"{sum(x['input_ids'].numel() for x in out)} tokens of --calibration-text"


def absorb(args: argparse.Namespace) -> int:
    from ..surgery import absorb_post_norms, analysis_copy, approximation, probe_inputs
    from ..tools import check_ids, heldout_ids, load, windows
    from .tools_cmd import _window_len

    notes = _prepare(args)
    with progress.phase(f"loading {args.checkpoint}"):
        model, tok = load(args.checkpoint)
        work, dtypes = analysis_copy(model)
        inputs = probe_inputs(model, seed=args.seed)
    ids = heldout_ids(tok)
    check_ids(model, ids, "the held-out text")
    seq = _window_len(model)
    calibration, source = _calibration(args, model, tok, ids, seq)
    try:
        held = windows(ids, seq, args.windows, offset=CALIBRATION_WINDOWS * seq)
    except ValueError as exc:
        raise CliError(f"the held-out text is too short for --windows {args.windows}: {exc}") from exc
    with progress.phase("inspecting, calibrating each post-branch norm and absorbing it"):
        surgery = absorb_post_norms(work, inputs, calibration, strict=False)
    extra = [Section("calibration", [asdict(s) for s in surgery.stats], f"frozen rms per norm ({source})")]
    if surgery.changed:
        surgery.restore_dtypes(dtypes)  # measured as it will be written
        with progress.phase(f"measuring the approximation on {held.numel()} held-out tokens"):
            surgery.approximation = approximation(model, surgery.runtime(), held)
        title = f"approximation: absorbed vs the original on {held.numel()} held-out tokens (loss in nats/token)"
        extra.append(Section("approximation", [surgery.approximation], title))
    reference = surgery.reference(model)
    proof = "proof: absorbed vs the frozen-statistic model (exact claim), probe inputs"
    return _finish(args, model, surgery, dtypes, inputs, notes, reference=reference, extra=extra, proof=proof)
