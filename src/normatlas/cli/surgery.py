"""``normatlas fold``, ``normatlas convert ...`` and ``normatlas verify``: checkpoint surgery with proof.

Each reads a safetensors checkpoint folder (never a pickle), transforms a copy, verifies
before vs after on probe inputs in float64 and the working dtype, prints what changed
and the measured error, and writes the result atomically only when it passed.
"""

from __future__ import annotations

import argparse
import sys

from . import CliError, command
from ._format import add_format_option, format_rows

CONVERSIONS = ("ln-rms", "gain", "eps", "bn-fold", "bn-frozen")


def _common(p: argparse.ArgumentParser, *, out: bool = True) -> None:
    p.add_argument("checkpoint", help="folder with config.json and *.safetensors")
    if out:
        p.add_argument("output", nargs="?", help="folder to write (omit with --dry-run)")
        p.add_argument("--dry-run", action="store_true", help="analyse and verify, write nothing")
        p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--tol", type=float, default=1e-4, help="max relative error in the working dtype (1e-4)")
    p.add_argument("--tol64", type=float, default=1e-5, help="max relative error in float64 (1e-5)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="working dtype (default: the checkpoint's)",
    )
    p.add_argument("--seed", type=int, default=0, help="probe input seed")
    add_format_option(p)


def _fold_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument(
        "--defer", action="store_true", help="also defer RMS normalisation past the GEMM (verified, runtime only)"
    )
    p.add_argument(
        "--cancel",
        action="store_true",
        help="delete pre-attention norms whose Q, K and V are all normalised afterwards, instead of folding",
    )


def _convert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "what",
        choices=CONVERSIONS,
        help="ln-rms: LayerNorm -> RMSNorm exactly; gain: w <-> 1+w; "
        "eps: eps value/placement; bn-fold / bn-frozen: BatchNorm",
    )
    _common(p)
    p.add_argument("--to", choices=("w", "1+w"), help="gain convention to convert to (gain)")
    p.add_argument("--eps", type=float, help="new eps (eps)")
    p.add_argument("--eps-placement", choices=("inside_sqrt", "outside_sqrt"), help="new eps placement (eps)")


def _verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("original", help="the checkpoint before surgery")
    _common(p, out=False)


def _dtype(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import torch

    return getattr(torch, args.dtype) if args.dtype else None


def _finish(args: argparse.Namespace, model, surgery, inputs) -> int:  # type: ignore[no-untyped-def]
    from normatlas.surgery import Tolerance, run_checks, save_surgery

    run_checks(model, surgery, inputs, tolerance=Tolerance(args.tol64, args.tol), working_dtype=_dtype(args))
    print(format_rows(surgery.rows(), args.format, title=f"{surgery.transform}: what changed"))
    for note in surgery.notes:
        print(f"note: {note}")
    print(format_rows(surgery.check_rows(), args.format, title="verification (before vs after, probe inputs)"))
    if args.dry_run:
        return 0 if surgery.passed else 1
    if not args.output:
        raise CliError("an output folder is required (or pass --dry-run)")
    if not surgery.passed:
        failed = ", ".join(f"{c.model}/{c.dtype}" for c in surgery.checks if not c.passed)
        print(f"not written: verification failed ({failed})", file=sys.stderr)
        return 1
    path = save_surgery(surgery, args.output, force=args.force, inputs=inputs)
    print(f"wrote {path} (model.safetensors, config.json, normatlas_surgery.json; read back and compared)")
    return 0


@command("fold", "fold norm gains into their linear consumers (FlashNorm), proven before writing", _fold_args)
def fold(args: argparse.Namespace) -> int:
    from normatlas.surgery import cancel_pre_attention_norms, fold_gains, load_checkpoint, probe_inputs

    model = load_checkpoint(args.checkpoint)
    inputs = probe_inputs(model, seed=args.seed)
    surgery = cancel_pre_attention_norms(model, inputs) if args.cancel else fold_gains(model, inputs, defer=args.defer)
    return _finish(args, model, surgery, inputs)  # run_checks also proves the deferred runtime (float64, working)


@command(
    "convert", "convert normalization: ln-rms, gain (w <-> 1+w), eps, bn-fold, bn-frozen; proven first", _convert_args
)
def convert(args: argparse.Namespace) -> int:
    from normatlas.spec import EpsPlacement, GainConvention, parse_enum
    from normatlas.surgery import (
        change_eps,
        convert_gain_convention,
        fold_batchnorm,
        freeze_batchnorm,
        ln_to_rms,
        load_checkpoint,
        probe_inputs,
    )

    model = load_checkpoint(args.checkpoint)
    inputs = probe_inputs(model, seed=args.seed)
    if args.what == "ln-rms":
        surgery = ln_to_rms(model, inputs)
    elif args.what == "gain":
        if not args.to:
            raise CliError("convert gain needs --to w or --to 1+w")
        surgery = convert_gain_convention(model, inputs, parse_enum(GainConvention, args.to, name="to"))
    elif args.what == "eps":
        if args.eps is None and args.eps_placement is None:
            raise CliError("convert eps needs --eps and/or --eps-placement")
        placement = parse_enum(EpsPlacement, args.eps_placement, name="eps_placement") if args.eps_placement else None
        surgery = change_eps(model, inputs, eps=args.eps, eps_placement=placement)
    elif args.what == "bn-fold":
        surgery = fold_batchnorm(model, inputs)
    else:
        surgery = freeze_batchnorm(model, inputs)
    return _finish(args, model, surgery, inputs)


@command("verify", "load a surgery output back and compare it with the original on probe inputs", _verify_args)
def verify(args: argparse.Namespace) -> int:
    from normatlas.surgery import Tolerance, compare, load_checkpoint, load_transformed, probe_inputs

    original = load_checkpoint(args.original)
    stock, runtime, manifest = load_transformed(args.checkpoint)
    inputs = probe_inputs(original, seed=args.seed)
    tol = Tolerance(args.tol64, args.tol)
    import torch

    wdtype = _dtype(args) or next(original.parameters()).dtype
    targets = [("runtime", runtime)] + ([("stock", stock)] if manifest.get("stock_equivalent") else [])
    rows = []
    ok = True
    for label, model in targets:
        for dtype, t in ((torch.float64, tol.float64), (wdtype, tol.working)):
            c = compare(original, model, inputs, dtype, label=label, tol=t)
            ok &= c.passed
            rows.append(
                {
                    "model": label,
                    "dtype": c.dtype,
                    "max_abs": f"{c.max_abs:.3g}",
                    "max_rel": f"{c.max_rel:.3g}",
                    "top1": "-" if c.top1 is None else f"{c.top1:.3g}",
                    "passed": "yes" if c.passed else "NO",
                }
            )
    changes = [{"target": c["target"], "result": c["action"], "detail": c["detail"]} for c in manifest["changes"]]
    print(format_rows(changes, args.format, title=f"{manifest['transform']}: recorded changes"))
    print(format_rows(rows, args.format, title="verification after reload"))
    return 0 if ok else 1
