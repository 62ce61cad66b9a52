"""``normatlas fold``, ``normatlas convert ...``, ``normatlas absorb`` and ``normatlas verify``: checkpoint surgery
with proof.

Each reads a safetensors checkpoint folder (never a pickle: :mod:`normatlas.checkpoint`), transforms a copy,
verifies before vs after on probe inputs in float64 and the working dtype, prints what changed and the measured
error, and writes the result atomically only when it passed (:func:`normatlas.surgery.save_surgery`). Every
argument, the checkpoint folder (config.json, safetensors) and the output location are checked before the
model is loaded.

Dtypes: every tensor is written in the dtype it was stored in (a bfloat16 checkpoint stays bfloat16, an int32
buffer int32) and config.json says so. A 16-bit checkpoint is analysed and transformed in float32, then each
tensor is rounded back to its stored dtype before the proof, so the proof measures what is written.
``--dtype`` chooses only the working dtype of the second check (default: the checkpoint's); it never changes
what is stored. Default tolerances follow the dtypes (:data:`normatlas.surgery.DEFAULT_TOLERANCE`).

Exit codes: 0 written (or, with ``--dry-run`` / ``verify``, verified); 1 the verification failed, nothing
written; 2 refused (an argument, the input or the output location), nothing written; 3 nothing to change (the
transformation does not apply to this model), nothing written.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._io import read_json
from . import CliError, HelpFormatter, positive_int
from . import _progress as progress
from ._format import Section, add_format_option, emit

CONVERSIONS = ("ln-rms", "gain", "eps", "bn-fold", "bn-frozen")
EXIT_VERIFY_FAILED = 1
EXIT_NOTHING_TO_CHANGE = 3
EXIT_CODES = """exit codes:
  0 written (dry run / verify: verified)
  1 verification failed, nothing written
  2 refused (argument, input or output location), nothing written
  3 nothing to change, nothing written"""
DTYPE_NOTE = (
    "Every tensor keeps its stored dtype (config.json says it); --dtype chooses only the working dtype of the "
    "verification, never what is stored."
)


def positive_finite(flag: str) -> Callable[[str], float]:
    """An argparse ``type`` accepting only a positive finite number, refused by the flag's name."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive finite number, got {text!r}") from None
        if not (0 < value < math.inf):
            raise argparse.ArgumentTypeError(f"{flag} must be a positive finite number, got {text!r}")
        return value

    return parse


def _epilog(p: argparse.ArgumentParser) -> None:
    p.epilog = f"{DTYPE_NOTE}\n\n{EXIT_CODES}"
    p.formatter_class = HelpFormatter  # wrapped to the terminal, the exit codes one a line


def _common(p: argparse.ArgumentParser, *, out: bool = True) -> None:
    p.add_argument("checkpoint", help="folder with config.json and *.safetensors")
    if out:
        p.add_argument("output", nargs="?", help="new folder to write (omit with --dry-run)")
        p.add_argument("--dry-run", action="store_true", help="analyse and verify, write nothing (no OUTPUT)")
        p.add_argument(
            "--force", action="store_true", help="replace OUTPUT when it holds an earlier normatlas output (only then)"
        )
    p.add_argument(
        "--tol",
        type=positive_finite("--tol"),
        default=None,
        help="max relative error in the working dtype (default by dtype: float32 1e-4, bfloat16 5e-2, float16 5e-3)",
    )
    p.add_argument(
        "--tol64",
        type=positive_finite("--tol64"),
        default=None,
        help="max relative error in float64 (default by the stored dtype: float32 1e-5, bfloat16 2e-2, float16 2.5e-3)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="working dtype of the verification (default: the checkpoint's); never the stored dtype",
    )
    p.add_argument("--seed", type=int, default=0, help="probe input seed")
    add_format_option(p)
    _epilog(p)


def configure_fold(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument(
        "--defer", action="store_true", help="also defer RMS normalisation past the GEMM (verified, runtime only)"
    )
    p.add_argument(
        "--cancel",
        action="store_true",
        help="delete pre-attention norms whose Q, K and V are all normalised afterwards, instead of folding",
    )


def configure_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "what",
        choices=CONVERSIONS,
        help="ln-rms: LayerNorm -> RMSNorm exactly; gain: w <-> 1+w; "
        "eps: eps value/placement; bn-fold / bn-frozen: BatchNorm",
    )
    _common(p)
    p.add_argument("--to", choices=("w", "1+w"), help="gain convention to convert to (gain)")
    p.add_argument("--eps", type=positive_finite("--eps"), help="new eps, a positive finite number (eps)")
    p.add_argument("--eps-placement", choices=("inside_sqrt", "outside_sqrt"), help="new eps placement (eps)")


def configure_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("original", help="the checkpoint before surgery")
    _common(p, out=False)


def _manifest() -> str:
    from normatlas.surgery import MANIFEST

    return MANIFEST


def _dtype(args: argparse.Namespace) -> Any:
    import torch

    return getattr(torch, args.dtype) if args.dtype else None


def _name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _located(path: str, what: str = "checkpoint") -> Any:
    from normatlas.checkpoint import locate

    try:
        return locate(path)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise CliError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def _refuse_swapped_input(root: Path) -> None:
    """An earlier output that is not stock-equivalent (gain, eps) computes its function only with the manifest's
    swaps; transforming its stock structure would start from a different model."""
    from normatlas.surgery import MANIFEST

    try:
        manifest = read_json(root / MANIFEST)
    except (OSError, ValueError):
        return
    if isinstance(manifest, dict) and manifest.get("swaps") and manifest.get("stock_equivalent") is False:
        raise CliError(
            f"{root} is a {manifest.get('transform')} output that computes its function only with the runtime swaps "
            f"in {MANIFEST}; transform the original checkpoint instead"
        )


def _prepare(args: argparse.Namespace) -> list[str]:
    """Everything cheap, before loading: --dry-run vs OUTPUT, the checkpoint folder, the output location.
    Returns the notes of stale temporary folders removed from the output's place."""
    from normatlas.surgery import check_output

    if args.dry_run and args.output:
        raise CliError(f"--dry-run writes nothing, so it takes no OUTPUT (got {args.output!r}); drop one of them")
    if not args.dry_run and not args.output:
        raise CliError("an OUTPUT folder is required (or pass --dry-run)")
    _located(args.checkpoint)
    _refuse_swapped_input(Path(args.checkpoint))
    if args.dry_run:
        return []
    try:
        plan = check_output(args.output, source=args.checkpoint, force=args.force, force_hint="--force")
    except OSError as exc:
        raise CliError(str(exc)) from exc
    return plan.removed


def _load(path: str) -> Any:
    from normatlas.surgery import analysis_copy, load_checkpoint, probe_inputs

    with progress.phase(f"loading {path}"):
        model = load_checkpoint(path)
        work, dtypes = analysis_copy(model)
        return model, work, dtypes, probe_inputs(model)


def _tolerance(args: argparse.Namespace, model: Any) -> tuple[Any, Any, Any]:
    from normatlas.surgery import Tolerance, model_dtype

    stored = model_dtype(model)
    working = _dtype(args) or stored
    return stored, working, Tolerance.default(stored, working, float64=args.tol64, working_tol=args.tol)


def _finish(
    args: argparse.Namespace,
    model: Any,
    surgery: Any,
    dtypes: Any,
    inputs: Any,
    notes: list[str],
    *,
    reference: Any = None,
    extra: list[Section] | None = None,
    proof: str = "verification (before vs after, probe inputs)",
) -> int:
    """Prove ``surgery`` against ``reference`` (default: ``model``, the loaded checkpoint), print the changes, the
    ``extra`` sections and the checks (titled ``proof``), and write it when it passed (not with --dry-run)."""
    from normatlas.surgery import run_checks, save_surgery

    stored, working, tol = _tolerance(args, model)
    meta: dict[str, object] = {
        "transform": surgery.transform,
        "checkpoint": args.checkpoint,
        "dtype": _name(stored),
        "working_dtype": _name(working),
        "output": args.output,
    }
    changes = Section("changes", surgery.rows(), f"{surgery.transform}: what changed")
    head = [changes, *(extra or [])]
    if not surgery.changed:
        meta.update(result="nothing to change", written=False)
        notes = [*notes, f"nothing to change: {surgery.nothing_reason()}; nothing written (exit 3)"]
        emit(head, args.format, meta=meta, notes=[*surgery.notes, *notes])
        return EXIT_NOTHING_TO_CHANGE
    surgery.restore_dtypes(dtypes)  # what is proven is what is written: every tensor in its stored dtype
    with progress.phase("verifying (before vs after, float64 and the working dtype)"):
        run_checks(model if reference is None else reference, surgery, inputs, tolerance=tol, working_dtype=working)
    checks = Section("checks", surgery.check_rows(), proof)
    notes = [*surgery.notes, *notes]
    if args.dry_run or not surgery.passed:
        meta.update(result=("verified" if surgery.passed else "verification failed"), written=False)
        if not surgery.passed:
            failed = ", ".join(f"{c.model}/{c.dtype}" for c in surgery.checks if not c.passed)
            notes.append(f"not written: verification failed ({failed})")
            print(f"not written: verification failed ({failed})", file=sys.stderr)
        emit([*head, checks], args.format, meta=meta, notes=notes)
        return 0 if surgery.passed else EXIT_VERIFY_FAILED
    try:
        with progress.phase(f"writing {args.output} (and reading it back)"):
            path = save_surgery(
                surgery, args.output, force=args.force, inputs=inputs, source=args.checkpoint, force_hint="--force"
            )
    except OSError as exc:  # a full disk, a folder made read-only meanwhile: one line, nothing left behind
        raise CliError(str(exc)) from exc
    meta.update(result="written", written=True, output=str(path))
    notes.append(
        f"wrote {path}: weights in their stored dtypes, config.json, the input's other files and {_manifest()}; "
        "read back and compared"
    )
    emit([*head, checks], args.format, meta=meta, notes=notes)
    return 0


def fold(args: argparse.Namespace) -> int:
    from normatlas.surgery import cancel_pre_attention_norms, fold_gains

    notes = _prepare(args)
    model, work, dtypes, inputs = _load(args.checkpoint)
    with progress.phase("analysing the dataflow and folding"):
        surgery = (
            cancel_pre_attention_norms(work, inputs) if args.cancel else fold_gains(work, inputs, defer=args.defer)
        )
    return _finish(args, model, surgery, dtypes, inputs, notes)  # run_checks also proves the deferred runtime


def _convert_options(args: argparse.Namespace) -> None:
    if args.what == "gain" and not args.to:
        raise CliError("convert gain needs --to w or --to 1+w")
    if args.what == "eps" and args.eps is None and args.eps_placement is None:
        raise CliError("convert eps needs --eps and/or --eps-placement")
    if args.to and args.what != "gain":
        raise CliError(f"--to applies to convert gain only, not convert {args.what}")
    if (args.eps is not None or args.eps_placement) and args.what != "eps":
        raise CliError(f"--eps / --eps-placement apply to convert eps only, not convert {args.what}")


def convert(args: argparse.Namespace) -> int:
    _convert_options(args)
    notes = _prepare(args)
    model, work, dtypes, inputs = _load(args.checkpoint)
    with progress.phase(f"analysing the dataflow and converting ({args.what})"):
        surgery = _converted(args, work, inputs)
    return _finish(args, model, surgery, dtypes, inputs, notes)


def _converted(args: argparse.Namespace, work: Any, inputs: Any) -> Any:
    from normatlas.spec import EpsPlacement, GainConvention, parse_enum
    from normatlas.surgery import change_eps, convert_gain_convention, fold_batchnorm, freeze_batchnorm, ln_to_rms

    if args.what == "ln-rms":
        surgery = ln_to_rms(work, inputs)
    elif args.what == "gain":
        surgery = convert_gain_convention(work, inputs, parse_enum(GainConvention, args.to, name="to"))
    elif args.what == "eps":
        placement = parse_enum(EpsPlacement, args.eps_placement, name="eps_placement") if args.eps_placement else None
        surgery = change_eps(work, inputs, eps=args.eps, eps_placement=placement)
    elif args.what == "bn-fold":
        surgery = fold_batchnorm(work, inputs)
    else:
        surgery = freeze_batchnorm(work, inputs)
    return surgery


def verify(args: argparse.Namespace) -> int:
    import torch

    from normatlas.surgery import compare, load_checkpoint, load_transformed, probe_inputs
    from normatlas.surgery.output import MANIFEST, is_normatlas_output

    _located(args.original, "original")
    _located(args.checkpoint)
    if not is_normatlas_output(Path(args.checkpoint)):
        raise CliError(f"{args.checkpoint} has no valid {MANIFEST}; it was not written by normatlas surgery")
    with progress.phase("loading both checkpoints"):
        original = load_checkpoint(args.original)
        stock, runtime, manifest = load_transformed(args.checkpoint)
        inputs = probe_inputs(original, seed=args.seed)
    stored, working, tol = _tolerance(args, original)
    targets = [("runtime", runtime)] + ([("stock", stock)] if manifest.get("stock_equivalent") else [])
    rows: list[dict[str, object]] = []
    ok = True
    for label, model in targets:
        for dtype, t in ((torch.float64, tol.float64), (working, tol.working)):
            c = compare(original, model, inputs, dtype, label=label, tol=t)
            ok &= c.passed
            rows.append(
                {
                    "model": label,
                    "dtype": c.dtype,
                    "max_abs": c.max_abs,
                    "max_rel": c.max_rel,
                    "tol": t,
                    "top1": c.top1,
                    "passed": c.passed,
                }
            )
    changes = [
        {"target": c.get("target"), "result": c.get("action"), "detail": c.get("detail")}
        for c in manifest.get("changes", [])
    ]
    meta: dict[str, object] = {
        "transform": manifest.get("transform"),
        "original": args.original,
        "checkpoint": args.checkpoint,
        "dtype": _name(stored),
        "working_dtype": _name(working),
        "passed": ok,
    }
    emit(
        [
            Section("changes", changes, f"{manifest.get('transform')}: recorded changes"),
            Section("checks", rows, "verification after reload"),
        ],
        args.format,
        meta=meta,
    )
    return 0 if ok else EXIT_VERIFY_FAILED


# ----------------------------------------------------------------------------- absorb
# ``normatlas absorb``: fold each post-branch RMSNorm into the linear layer before it, its statistic frozen on
# calibration text (:mod:`normatlas.surgery.absorb`). As ``fold``, but the checkpoint folder needs its tokenizer
# (calibration and the held-out measure run real text), and the proof compares the absorbed model with the
# *frozen-statistic* model (each norm dividing by its calibration mean rms): exact, to rounding. Against the original
# it is an approximation, and the command says how far: the max logit difference and the next-token loss on held-out
# text the calibration did not see. Calibration: ``--calibration-text`` (repeatable), else the first 8 windows of the
# held-out standard-library text; the measure: ``--windows`` windows after those 8 (:mod:`normatlas.tools.absorbing`,
# which the page's absorb tool runs too).
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


def absorb(args: argparse.Namespace) -> int:
    from normatlas.tools import load
    from normatlas.tools.absorbing import absorb_checkpoint

    notes = _prepare(args)
    for text in args.calibration_text or []:
        if not text.strip():
            raise CliError(f"--calibration-text must hold text, got {text!r}")
    with progress.phase(f"loading {args.checkpoint}"):
        model, tok = load(args.checkpoint)
    phase = "inspecting, calibrating each post-branch norm, absorbing it and measuring the approximation"
    with progress.phase(phase):
        try:
            run = absorb_checkpoint(
                model, tok, texts=args.calibration_text, windows=args.windows, seed=args.seed,
                label="--calibration-text",
            )  # fmt: skip
        except ValueError as exc:
            raise CliError(str(exc).replace(f"for {args.windows} windows", f"for --windows {args.windows}")) from exc
    surgery = run.surgery
    extra = [Section("calibration", run.calibration_rows(), f"frozen rms per norm ({run.source})")]
    if surgery.changed:
        title = f"approximation: absorbed vs the original on {run.held_tokens} held-out tokens (loss in nats/token)"
        extra.append(Section("approximation", [surgery.approximation], title))
    reference = surgery.reference(model)
    proof = "proof: absorbed vs the frozen-statistic model (exact claim), probe inputs"
    return _finish(args, model, surgery, run.dtypes, run.inputs, notes, reference=reference, extra=extra, proof=proof)
