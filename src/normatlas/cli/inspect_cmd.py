"""``normatlas inspect``: a model's normalization design, read off its dataflow."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .._io import dumps
from . import CliError, add_attention_option, positive_float
from . import _progress as progress
from ._format import Section, add_format_option, emit

DEFAULT_TIMEOUT = 60.0
DEFAULT_OUT = "inspect-matrix"


def configure_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "target",
        nargs="*",
        help="transformers model type (built tiny, offline), a checkpoint folder "
        "(config.json + *.safetensors), or module.path:factory",
    )
    add_format_option(p)  # --format table|json|csv, and --json (json: the full report)
    add_attention_option(p)
    p.add_argument(
        "--vision",
        action="store_true",
        help="TARGET is a vision tower model type (clip_vision_model, siglip_vision_model, vit, dinov2, ...): "
        "built tiny and run on a seeded image",
    )
    p.add_argument("--norms", action="store_true", help="also list every normalization site (one TARGET)")
    p.add_argument(
        "--all-transformers",
        action="store_true",
        help="sweep every decoder-only architecture in the installed transformers",
    )
    p.add_argument(
        "--encoder-decoder",
        action="store_true",
        help="with --all-transformers: sweep every encoder-decoder type instead (both stacks, cross-attention)",
    )
    p.add_argument("--only", default=None, help="with --all-transformers: comma-separated model types")
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        help=f"with --all-transformers: seconds per architecture (default {DEFAULT_TIMEOUT:g})",
    )
    p.add_argument("--out", default=None, help=f"with --all-transformers: output folder (default {DEFAULT_OUT})")


def _refuse_nonsense(args: argparse.Namespace) -> None:
    encdec = True if getattr(args, "encoder_decoder", False) else None
    sweep_args = (
        ("--only", args.only),
        ("--timeout", args.timeout),
        ("--out", args.out),
        ("--encoder-decoder", encdec),
    )
    sweep_only = [flag for flag, value in sweep_args if value is not None]
    if args.all_transformers:
        if args.target:
            raise CliError(f"--all-transformers sweeps every architecture; drop the TARGET(s) {' '.join(args.target)}")
        for flag, on in (("--vision", args.vision), ("--norms", args.norms)):
            if on:
                raise CliError(f"{flag}: not with --all-transformers")
        return
    if sweep_only:
        raise CliError(f"{', '.join(sweep_only)}: only with --all-transformers")
    if not args.target:
        raise CliError("give a TARGET (a model type, a checkpoint folder or module:factory) or --all-transformers")
    if args.norms and len(args.target) > 1:
        raise CliError("--norms lists one model's normalization sites; give a single TARGET")


def inspect_cmd(args: argparse.Namespace) -> int:
    import warnings

    _refuse_nonsense(args)
    warnings.filterwarnings("ignore")
    with progress.phase("loading the inspector"):
        from ..inspect import UntraceableModel, inspect_target, inspect_vision_target

    if args.all_transformers:
        return _sweep(args)
    from ..factory import is_vlm_type

    vlms = not args.vision and not args.norms and all(is_vlm_type(t) for t in args.target)
    if len(args.target) > 1:
        return _compare_vlms(args) if vlms else _compare(args)
    target = args.target[0]
    if vlms:
        return _one_vlm(args, target)
    try:
        with progress.phase(f"building and tracing {target}"):
            rep = (inspect_vision_target if args.vision else inspect_target)(target)
    except (UntraceableModel, ValueError, TypeError, FileNotFoundError, OSError) as exc:
        raise CliError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    except Exception as exc:  # building a model can fail in many ways; one line, never a traceback
        raise CliError(
            f"cannot build or trace {target}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        ) from exc
    if args.format == "json":  # the whole report, typed
        doc = rep.to_dict()
        doc["seconds"] = round(float(doc.get("seconds") or 0.0), 3)
        print(dumps(doc, indent=2))
        return 0
    summary = rep.summary_row()
    skip = ("model", "notes", "stack")
    if rep.encoder is None:
        design = [{"field": k, "value": v} for k, v in summary.items() if k not in skip]
    else:  # an encoder-decoder: one column per stack
        enc = rep.encoder.summary_row()
        design = [
            {
                "field": k,
                "decoder": v,
                "encoder": enc.get(k) if k not in ("placement_cross_attention", "seconds") else "n/a",
            }
            for k, v in summary.items()
            if k not in skip and not k.startswith("encoder_")
        ]
    from ..vocabulary import branch_scale_word

    stacks = [rep] if rep.encoder is None else [rep.encoder, rep]
    subs = [
        {
            **({"stack": r.stack} if r.stack else {}),
            "layer": s.layer,
            "sublayer": s.kind,
            "placement": s.placement.value,
            "pre": len(s.pre),
            "out": len(s.out),
            "post": len(s.post),
            "residual x": s.skip_scale,
            "branch x": branch_scale_word(s.branch_scale),
        }
        for r in stacks
        for s in r.sublayers
    ]
    title = f"{rep.model}: normalization design (from the traced dataflow)"
    if rep.encoder is not None:
        title = f"{rep.model}: normalization design of the encoder and decoder stacks (from the traced dataflow)"
    sections = [Section("design", design, title), *([Section("sublayers", subs, "per sublayer")] if subs else [])]
    if args.norms:
        from ..inspect.report import gain_word

        sites = [
            {
                "#": n.index,
                "role": n.role,
                "layer": n.layer,
                "operator": n.operator.value,
                "size": n.size,
                "eps": n.eps,
                "gain": gain_word(n.gain_convention),
                "bias": n.bias,
                "cast": n.cast_order,
                "probe": None if not n.probe else ("agrees" if n.probe.get("agrees") else "DISAGREES"),
                "module (label)": n.module,
            }
            for n in rep.norms
        ]
        sections.append(Section("norms", sites, "normalization sites"))
    emit(sections, args.format, notes=rep.notes)
    return 0


def _model_types(only: str) -> list[str]:
    """``--only`` as a list of model types, each known to the installed transformers (else a CliError)."""
    import difflib

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    types = [t.strip() for t in only.split(",")]
    if not all(types):
        raise CliError(f"--only {only!r}: an empty model type; give comma-separated names like llama,gpt2")
    known = set(CONFIG_MAPPING.keys())
    for t in types:
        if t not in known:
            near = difflib.get_close_matches(t, sorted(known), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else "; e.g. llama, gpt2, qwen3"
            version = transformers.__version__
            raise CliError(f"--only {t}: not a model type of the installed transformers {version}{hint}")
    return list(dict.fromkeys(types))


_CHILDREN_IGNORE_SIGINT = False


def _children_ignore_sigint() -> None:
    """Forked sweep workers ignore Ctrl-C: the parent alone reports it (once, no worker tracebacks) and
    multiprocessing terminates its daemonic workers as it exits."""
    global _CHILDREN_IGNORE_SIGINT
    if not _CHILDREN_IGNORE_SIGINT and hasattr(os, "register_at_fork"):
        import signal

        os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        _CHILDREN_IGNORE_SIGINT = True


def _sweep(args: argparse.Namespace) -> int:
    from ..inspect.sweep import (
        COLUMNS,
        ENCODER_DECODER_COLUMNS,
        decoder_model_types,
        encoder_decoder_counts,
        encoder_decoder_model_types,
        sweep,
        write_sweep,
    )

    encdec = bool(getattr(args, "encoder_decoder", False))
    every = encoder_decoder_model_types if encdec else decoder_model_types
    columns = ENCODER_DECODER_COLUMNS if encdec else COLUMNS
    types = _model_types(args.only) if args.only is not None else every()
    timeout = DEFAULT_TIMEOUT if args.timeout is None else args.timeout
    out = Path(DEFAULT_OUT if args.out is None else args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a folder")
    _children_ignore_sigint()
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for mt in progress.steps(types, "inspecting architectures"):
        rows += sweep([mt], progress=False, timeout=timeout, columns=columns)
    seconds = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".partial-{os.getpid()}"
    try:  # both files appear together or not at all
        written = write_sweep(rows, tmp, columns)
        jp, cp = (out / p.name for p in written)
        for src, dst in zip(written, (jp, cp), strict=True):
            os.replace(src, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ok = sum(1 for r in rows if not r["error"])
    failed = [{"model": r["model"], "error": r["error"]} for r in rows if r["error"]]
    counts = encoder_decoder_counts(rows) if encdec else None
    if args.format == "table":
        print(f"classified {ok}/{len(rows)} architectures in {seconds:.1f} s; wrote {jp} and {cp}")
        if counts is not None:
            print("encoder-decoders: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        if failed:
            print()
            emit([Section("failed", failed, "not classified")], "table")
        return 0
    meta = {"classified": ok, "architectures": len(rows), "seconds": round(seconds, 1), "json": str(jp), "csv": str(cp)}
    if counts is not None:
        meta["encoder_decoder"] = counts
    emit([Section("architectures", rows)], args.format, meta=meta)
    return 0


_COMPARE = (
    "model",
    "operator",
    "eps",
    "gain_convention",
    "bias",
    "placement",
    "residual_scale",
    "branch_scale",
    "qk_norm",
    "qk_norm_rope",
    "attn_softcap",
    "final_norm",
    "final_logit_softcap",
    "embedding_scale",
)


_COMPARE_VISION = (
    "model",
    "operator",
    "eps",
    "bias",
    "placement",
    "branch_scale",
    "tokens",
    "embedding_norm",
    "final_norm",
    "pooled_norm",
    "merger_norm",
    "head_norm",
)


_COMPARE_ENCODER_DECODER = (
    "embedding_norm",
    "stack",
    "placement_cross_attention",
    *(f"encoder_{k}" for k in ("placement", "operator", "final_norm", "embedding_norm")),
)
"""The columns a comparison adds when an encoder-decoder is among its targets."""


def _compare(args: argparse.Namespace) -> int:
    """Several targets: one summary row each (errors as rows, exit 1 if any failed)."""
    from ..inspect import inspect_target, inspect_vision_target

    inspect_one, columns = (inspect_vision_target, _COMPARE_VISION) if args.vision else (inspect_target, _COMPARE)
    summaries: list[dict[str, Any]] = []
    failed = 0
    for target in progress.steps(args.target, "building and tracing"):
        try:
            summ = inspect_one(target).summary_row()
            summaries.append(summ | {"model": target, "error": None})
        except Exception as exc:  # one failing target must not hide the others
            failed += 1
            error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            summaries.append({"model": target, "error": error})
    if any(r.get("stack") for r in summaries):  # an encoder-decoder among them: its cross-attention and encoder stack
        columns = (*columns, *_COMPARE_ENCODER_DECODER)
    rows = [{k: r.get(k) for k in columns} | {"error": r["error"]} for r in summaries]
    cols = [*columns, "error"] if failed or args.format != "table" else list(columns)
    emit([Section("models", rows, "normalization designs (from the traced dataflow)", cols)], args.format)
    return 1 if failed else 0


def _one_vlm(args: argparse.Namespace, target: str) -> int:
    """An image-text model type: its vision tower, connector and language model, from one image + text run."""
    from ..inspect import UntraceableModel
    from ..inspect.vlm import inspect_vlm_target

    try:
        with progress.phase(f"building and tracing {target} on an image + text"):
            rep = inspect_vlm_target(target)
    except (UntraceableModel, ValueError, TypeError) as exc:
        raise CliError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    except Exception as exc:  # building a model can fail in many ways; one line, never a traceback
        raise CliError(
            f"cannot build or trace {target}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        ) from exc
    if args.format == "json":
        print(dumps(rep.to_dict(detail=True), indent=2))
        return 0
    parts = rep.part_rows()
    title = f"{rep.model}: %s (one image + text run, {rep.image_tokens} image tokens)"
    emit([Section(k.replace(" ", "_"), rows, title % k) for k, rows in parts.items()], args.format, notes=rep.notes)
    return 0


def _compare_vlms(args: argparse.Namespace) -> int:
    """Several image-text model types: one three-part row each (errors as rows, exit 1 if any failed)."""
    from ..inspect.vlm import inspect_vlm_target

    rows: list[dict[str, Any]] = []
    failed = 0
    for target in progress.steps(args.target, "building and tracing"):
        try:
            rows.append({**inspect_vlm_target(target).summary_row(), "model": target, "error": None})
        except Exception as exc:  # one failing target must not hide the others
            failed += 1
            rows.append({"model": target, "error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"})
    cols = list(dict.fromkeys(k for r in rows for k in r if k != "error" or failed or args.format != "table"))
    emit(
        [Section("models", rows, "image-text models: tower, connector, language model (one run each)", cols)],
        args.format,
    )
    return 1 if failed else 0
