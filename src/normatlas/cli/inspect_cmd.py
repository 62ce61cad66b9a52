"""``normatlas inspect``: a model's normalization design, read off its dataflow."""

from __future__ import annotations

import argparse
import json
import time

from . import CliError, command
from ._format import format_table


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "target",
        nargs="*",
        help="transformers model type (built tiny, offline), a checkpoint folder "
        "(config.json + *.safetensors), or module.path:factory",
    )
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.add_argument(
        "--vision",
        action="store_true",
        help="TARGET is a vision tower model type (clip_vision_model, siglip_vision_model, vit, dinov2, ...): "
        "built tiny and run on a seeded image",
    )
    p.add_argument("--norms", action="store_true", help="also list every normalization site")
    p.add_argument(
        "--all-transformers",
        action="store_true",
        help="sweep every decoder-only architecture in the installed transformers",
    )
    p.add_argument("--only", default=None, help="with --all-transformers: comma-separated model types")
    p.add_argument("--timeout", type=float, default=60.0, help="with --all-transformers: seconds per architecture")
    p.add_argument("--out", default="inspect-matrix", help="with --all-transformers: output folder (JSON + CSV)")


@command("inspect", "report a model's normalization design, derived from its traced dataflow", _configure)
def inspect_cmd(args: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    from ..inspect import UntraceableModel, inspect_target, inspect_vision_target

    if args.all_transformers:
        return _sweep(args)
    if not args.target:
        raise CliError("give a TARGET or --all-transformers")
    if len(args.target) > 1:
        return _compare(args)
    try:
        rep = (inspect_vision_target if args.vision else inspect_target)(args.target[0])
    except (UntraceableModel, ValueError, TypeError, FileNotFoundError, OSError) as exc:
        raise CliError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    except Exception as exc:  # building a model can fail in many ways; one line, never a traceback
        raise CliError(
            f"cannot build or trace {args.target[0]}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        ) from exc
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2, default=str))
        return 0
    summary = rep.summary_row()
    keep = {k: v for k, v in summary.items() if k not in ("model", "notes")}
    rows = [{"field": k, "value": "-" if v in (None, "") else v} for k, v in keep.items()]
    print(format_table(rows, title=f"{rep.model}: normalization design (from the traced dataflow)"))
    subs = [
        {
            "layer": s.layer,
            "sublayer": s.kind,
            "placement": s.placement.value,
            "pre": len(s.pre),
            "out": len(s.out),
            "post": len(s.post),
            "residual x": s.skip_scale if s.skip_scale is not None else "-",
            "branch x": s.branch_scale or "-",
        }
        for s in rep.sublayers
    ]
    if subs:
        print()
        print(format_table(subs, title="per sublayer"))
    if args.norms:
        print()
        print(
            format_table(
                [
                    {
                        "#": n.index,
                        "role": n.role,
                        "layer": "-" if n.layer is None else n.layer,
                        "operator": n.operator.value,
                        "size": n.size,
                        "eps": n.eps,
                        "gain": n.gain_convention,
                        "bias": n.bias,
                        "cast": n.cast_order or "-",
                        "probe": "-" if not n.probe else ("agrees" if n.probe.get("agrees") else "DISAGREES"),
                        "module (label)": n.module,
                    }
                    for n in rep.norms
                ],
                title="normalization sites",
            )
        )
    for note in rep.notes:
        print(f"note: {note}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from ..inspect.sweep import decoder_model_types, sweep, write_sweep

    types = args.only.split(",") if args.only else decoder_model_types()
    t0 = time.perf_counter()
    rows = sweep(types, timeout=args.timeout)
    jp, cp = write_sweep(rows, args.out)
    ok = sum(1 for r in rows if not r["error"])
    print(f"classified {ok}/{len(rows)} architectures in {time.perf_counter() - t0:.1f} s; wrote {jp} and {cp}")
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


def _compare(args: argparse.Namespace) -> int:
    """Several targets: one summary row each (errors as rows, exit 1 if any failed)."""
    from ..inspect import inspect_target, inspect_vision_target

    inspect_one, columns = (inspect_vision_target, _COMPARE_VISION) if args.vision else (inspect_target, _COMPARE)
    rows, failed = [], 0
    for target in args.target:
        try:
            summ = inspect_one(target).summary_row()
            summ["model"] = target
            rows.append({k: "-" if summ.get(k) in (None, "") else summ.get(k) for k in columns})
        except Exception as exc:  # one failing target must not hide the others
            failed += 1
            rows.append({"model": target, "operator": f"error: {(str(exc).splitlines() or [''])[0][:80]}"})
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print(
            format_table(
                [{k: r.get(k, "") for k in columns} for r in rows],
                title="normalization designs (from the traced dataflow)",
            )
        )
    return 1 if failed else 0
