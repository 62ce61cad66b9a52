"""Absorbing post-branch RMSNorms on a checkpoint with its tokenizer (:mod:`normatlas.surgery.absorb` on real text):
what ``normatlas absorb`` and the page's ``absorb`` tool both run before anything is written.

Calibration: the given texts, else the first :data:`CALIBRATION_WINDOWS` windows of the held-out standard-library
text (:func:`.heldout_ids`); the approximation against the original is measured on ``windows`` windows after those,
which the calibration did not see. The probe inputs of the proof are seeded (:func:`normatlas.surgery.probe_inputs`).
Nothing here writes: :func:`absorb_checkpoint` returns the surgery, :func:`prove` attaches its proof.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["CALIBRATION_WINDOWS", "AbsorbRun", "absorb_checkpoint", "calibration_inputs", "prove"]

CALIBRATION_WINDOWS = 8


@dataclass
class AbsorbRun:
    """One absorption, not written: the loaded ``model``, the ``surgery`` (its tensors back in their stored
    ``dtypes`` when it changed anything), the seeded probe ``inputs``, what it was calibrated on (``source``) and the
    held-out tokens its approximation was measured on (``held_tokens``: 0 when nothing changed)."""

    model: nn.Module
    surgery: Any  # normatlas.surgery.absorb.Absorption
    dtypes: dict[str, torch.dtype]
    inputs: Any
    source: str
    held_tokens: int

    def calibration_rows(self) -> list[dict[str, Any]]:
        """One row per absorbed norm: the frozen rms (mean over calibration tokens), its spread and range."""
        return [asdict(s) for s in self.surgery.stats]


def calibration_inputs(
    model: nn.Module, tok: Any, texts: Sequence[str], seq: int, label: str = "calibration text"
) -> tuple[list[dict[str, Tensor]], str]:
    """Each text as one model input (its first ``seq`` tokens, no special tokens), and a description; a text with no
    tokens, or with ids the model does not have, raises ``ValueError`` naming it as ``label``."""
    from . import check_ids

    out = []
    for text in texts:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{label} must hold text, got {text!r}")
        t = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, :seq]
        if t.numel() == 0:
            raise ValueError(f"{label} {text!r} has no tokens")
        check_ids(model, t, f"{label} {text!r}")
        out.append({"input_ids": t})
    return out, f"{sum(x['input_ids'].numel() for x in out)} tokens of {label}"


def absorb_checkpoint(
    model: nn.Module,
    tok: Any,
    *,
    texts: Sequence[str] | None = None,
    windows: int = 8,
    seed: int = 0,
    label: str = "calibration text",
) -> AbsorbRun:
    """Absorb every post-branch RMSNorm of a copy of ``model`` (refusing the others, with reasons), calibrated on
    ``texts`` (else held-out text), and measure the approximation on ``windows`` held-out windows the calibration did
    not see. ``ValueError`` when the held-out text is too short for ``windows`` (the message says so)."""
    from ..surgery import absorb_post_norms, analysis_copy, approximation, probe_inputs
    from . import check_ids, heldout_ids, window_len
    from .lens import windows as cut

    if not isinstance(windows, int) or isinstance(windows, bool) or windows < 1:
        raise ValueError(f"windows={windows!r} must be a positive int")
    work, dtypes = analysis_copy(model)
    inputs = probe_inputs(model, seed=seed)
    ids = heldout_ids(tok)
    check_ids(model, ids, "the held-out text")
    seq = window_len(model)
    if texts:
        calibration, source = calibration_inputs(model, tok, texts, seq, label)
    else:
        cal = cut(ids, seq, CALIBRATION_WINDOWS)
        calibration, source = [{"input_ids": cal}], f"{cal.numel()} tokens of held-out stdlib source"
    try:
        held = cut(ids, seq, windows, offset=CALIBRATION_WINDOWS * seq)
    except ValueError as exc:
        raise ValueError(f"the held-out text is too short for {windows} windows: {exc}") from exc
    surgery = absorb_post_norms(work, inputs, calibration, strict=False)
    held_tokens = 0
    if surgery.changed:
        surgery.restore_dtypes(dtypes)  # measured as it would be written
        surgery.approximation = approximation(model, surgery.runtime(), held)
        held_tokens = held.numel()
    return AbsorbRun(model, surgery, dtypes, inputs, source, held_tokens)


def prove(run: AbsorbRun, tolerance: Any = None, working_dtype: torch.dtype | None = None) -> Any:
    """Attach the proof to ``run.surgery``: the absorbed model against the frozen-statistic model (exact, to
    rounding) on the probe inputs, float64 and the working dtype (default: the stored one), default tolerances."""
    from ..surgery import Tolerance, model_dtype, run_checks

    stored = model_dtype(run.model)
    working = working_dtype or stored
    tol = tolerance or Tolerance.default(stored, working)
    return run_checks(run.surgery.reference(run.model), run.surgery, run.inputs, tolerance=tol, working_dtype=working)
