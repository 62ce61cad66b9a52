"""``normatlas lens``, ``prune``, ``embeddings``, ``outliers`` and ``zoo``: the practitioner tools
(:mod:`normatlas.tools`) on a checkpoint folder (config.json, safetensors, tokenizer files); ``normatlas cost``: what
normalization costs around attention and per block (:mod:`normatlas.tools.cost`), on freshly built modules.

Real text is the Python standard library's own sources: the held-out tail of the zoo corpus
(:func:`normatlas.tools.heldout_bytes`), which no zoo model was trained on. Figures are written with matplotlib's
Agg backend, each beside a CSV of its series.

Exit codes (prune, as the surgery commands): 0 written (or, with --dry-run, verified); 1 the proof failed, nothing
written; 2 refused (an argument, the input or the output location), nothing written; 3 nothing to change (--drop 0).
"""

from __future__ import annotations

import argparse
import csv
import io
import shlex
import sys
from pathlib import Path
from typing import Any

from .._io import atomic_write
from . import CliError, nonnegative_int, one_of, positive_float, positive_int
from . import _progress as progress
from ._format import Section, add_format_option, emit

EXIT_VERIFY_FAILED = 1
EXIT_NOTHING_TO_CHANGE = 3


def _command() -> str:
    return "normatlas " + " ".join(shlex.quote(a) for a in sys.argv[1:]).replace("\n", "\\n")


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    buf = io.StringIO()
    cols = list(dict.fromkeys(k for r in rows for k in r))
    w = csv.DictWriter(buf, cols)
    w.writeheader()
    w.writerows(rows)
    atomic_write(path, buf.getvalue())


def _figure(path: Path, draw: Any) -> Path:
    """Draw to a temporary file beside ``path``, renamed into place."""
    return atomic_write(path, draw)


def _load(path: str) -> tuple[Any, Any]:
    from ..tools import load

    with progress.phase(f"loading {path}"):
        return load(path)


# ----------------------------------------------------------------------------- lens
def configure_lens(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="folder with config.json, *.safetensors and tokenizer files")
    p.add_argument("--text", action="append", required=True, help="a prompt to run (repeatable)")
    p.add_argument("--k", type=positive_int, default=5, help="top-k tokens per layer (default 5)")
    p.add_argument("--tuned", action="store_true", help="also refit the final norm's gain per layer on held-out text")
    p.add_argument("--tuned-steps", type=positive_int, default=200, help="Adam steps of the tuned fit (default 200)")
    p.add_argument("--figures", metavar="DIR", help="write lens_<i>.png and lens_<i>.csv per prompt into DIR")
    p.add_argument("--seed", type=int, default=0, help="seed of the tuned fit")
    add_format_option(p)


def lens(args: argparse.Namespace) -> int:
    from ..tools import NoHead, check_ids, lens_figure, logit_lens, read_model

    for t in args.text:
        if not t.strip():
            raise CliError(f"--text must hold text, got {t!r}")
    model, tok = _load(args.checkpoint)
    prompts = [tok(t, return_tensors="pt")["input_ids"] for t in args.text]
    for t, ids in zip(args.text, prompts, strict=True):
        check_ids(model, ids, f"--text {t!r}")
    with progress.phase("reading the final norm and the head from the dataflow"):
        try:
            reading = read_model(model, prompts[0])
        except NoHead as exc:
            raise CliError(
                f"{args.checkpoint}: {type(model).__name__} has no LM or MLM head: its first output is its residual "
                "stream itself, so there is no head to decode a layer's stream through; use a checkpoint with a head "
                "(*ForCausalLM, *ForMaskedLM)"
            ) from exc
    sections, notes = [], []
    meta: dict[str, Any] = {
        "model": type(model).__name__,
        "checkpoint": args.checkpoint,
        "layers": len(reading.layers),
        "final_norm": reading.tail[reading.norm_at] if reading.norm_at is not None else None,
        "tail": " -> ".join(reading.tail),
        "logit_softcap": reading.softcap,
    }
    gains = None
    if args.tuned:
        from ..tools.lens import fit_on_heldout, tuned_rows, tuned_title

        with progress.phase("fitting one gain per layer on held-out tokens"):
            fit = fit_on_heldout(model, tok, reading, steps=args.tuned_steps, seed=args.seed)
        gains = fit.gains
        sections.append(Section("tuned_fit", tuned_rows(fit), tuned_title(fit)))
    for i, (text, ids) in enumerate(zip(args.text, prompts, strict=True)):
        with progress.phase(f"prompt {i + 1}/{len(prompts)}"):
            res = logit_lens(model, ids, tok, k=args.k, reading=reading, gains=gains, name=type(model).__name__)
        title = f"prompt {i}: {text!r} -> final answer {res.answer!r} (KL in nats; rank 0 = top)"
        sections.append(Section(f"prompt_{i}", res.rows, title))
        if args.figures:
            folder = Path(args.figures)
            caption = f"{_command()}  (seed {args.seed})"
            png = _figure(folder / f"lens_{i}.png", lambda path, res=res, cap=caption: lens_figure(res, path, cap))
            _write_csv(folder / f"lens_{i}.csv", res.rows)
            notes.append(f"wrote {png} and {png.with_suffix('.csv')}")
    emit(sections, args.format, meta=meta, notes=notes)
    return 0


# ----------------------------------------------------------------------------- prune
def configure_prune(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="folder with config.json, *.safetensors and tokenizer files")
    p.add_argument("output", nargs="?", help="new folder to write (omit with --dry-run)")
    p.add_argument("--drop", type=nonnegative_int, required=True, help="how many layers to drop (0: score only)")
    p.add_argument(
        "--by",
        type=one_of(("angle", "ratio", "block")),
        default="angle",
        help="angle / ratio: drop the K lowest layers; block: the K consecutive layers the stream turns least across",
    )
    p.add_argument("--dry-run", action="store_true", help="score, prune and prove in memory; write nothing")
    p.add_argument("--force", action="store_true", help="replace OUTPUT when it holds an earlier normatlas output")
    p.add_argument("--figure", metavar="PNG", help="write the scores-by-depth figure (and a CSV beside it)")
    p.add_argument("--windows", type=positive_int, default=32, help="held-out windows the loss is measured on")
    p.add_argument(
        "--sweep", action="store_true", help="also measure the loss with each layer alone skipped (checks the score)"
    )
    add_format_option(p)
    p.epilog = __doc__.split("\n\n")[-1] if __doc__ else None


def prune(args: argparse.Namespace) -> int:
    from ..surgery import NothingToChange, probe_inputs, save_surgery
    from ..tools import plan_prune, prune_figure, quality, run_prune, skipping
    from .surgery import _prepare

    removed = _prepare(args)
    model, tok = _load(args.checkpoint)
    try:
        plan = plan_prune(model, tok, args.drop, args.by, args.windows, phase=progress.phase)
    except ValueError as exc:  # the library names its parameter (drop=...); the CLI names its flag
        msg = str(exc)
        for flag in ("drop", "by"):
            msg = f"--{flag} {msg.removeprefix(f'{flag}=')}" if msg.startswith(f"{flag}=") else msg
        raise CliError(msg) from exc
    reading, scores, blocks, drop, rows = plan.reading, plan.scores, plan.blocks, plan.drop, plan.rows
    score_ids, eval_ids = plan.score_ids, plan.eval_ids
    meta: dict[str, Any] = {
        "model": type(model).__name__,
        "checkpoint": args.checkpoint,
        "layers": len(scores),
        "by": args.by,
        "drop": drop,
        "score_tokens": score_ids.numel(),
    }
    rule = "the block table below decides" if blocks else f"{args.by} ranks"
    sections = [Section("scores", rows, f"layer scores on {score_ids.numel()} held-out tokens ({rule})")]
    if blocks:
        brows = [{"layers": " ".join(map(str, b["layers"])), "angle": b["angle"]} for b in blocks]
        sections.append(Section("blocks", brows, f"angle across each block of {args.drop} consecutive layers"))
    notes = list(removed)
    done = run_prune(model, plan, probe_inputs(model), phase=progress.phase)
    surgery, before, after = done.surgery, done.before, done.after
    meta.update(measure=before["measure"], before=before["value"], after=after["value"])
    if args.sweep:
        for row in progress.steps(rows, "measuring each layer alone skipped", label=lambda r: f"layer {r['layer']}"):
            remove = skipping(model, reading, [row["layer"]])
            try:
                row["without_it"] = quality(model, reading, eval_ids, reference=before.get("pooled"))["value"]
            finally:
                remove()
    compared = [
        {"model": "original", "value": before["value"]},
        {"model": f"-{len(drop)} layers", "value": after["value"]},
    ]
    sections.append(Section("quality", compared, f"{before['measure']} on {eval_ids.numel()} held-out tokens"))
    if args.figure:
        png = Path(args.figure)
        title = (
            f"{type(model).__name__}: dropping the {len(drop)} {'consecutive ' if blocks else ''}layers that turn "
            "the stream least "
            f"({', '.join(map(str, drop)) or 'none'}) moves the {before['measure'].split(' (')[0]} "
            f"from {before['value']:.4g} to {after['value']:.4g}"
        )
        measured = (before["measure"], before["value"], [r["without_it"] for r in rows]) if args.sweep else None
        _figure(png, lambda path: prune_figure(scores, drop, path, title, _command(), measured))
        _write_csv(png.with_suffix(".csv"), rows)
        notes.append(f"wrote {png} and {png.with_suffix('.csv')}")
    sections.append(Section("changes", surgery.rows(), "prune: what changed"))
    if not surgery.changed:
        notes.append("nothing to change: --drop 0 scores the layers only; nothing written (exit 3)")
        emit(sections, args.format, meta=dict(meta, result="nothing to change", written=False), notes=notes)
        return EXIT_NOTHING_TO_CHANGE
    sections.append(Section("checks", surgery.check_rows(), "proof: pruned vs the original with those layers skipped"))
    notes = [*surgery.notes, *notes]
    if args.dry_run or not surgery.passed:
        if not surgery.passed:
            notes.append("not written: the proof failed")
        emit(sections, args.format, meta=dict(meta, result="verified" if surgery.passed else "failed"), notes=notes)
        return 0 if surgery.passed else EXIT_VERIFY_FAILED
    try:
        with progress.phase(f"writing {args.output} (and reading it back)"):
            path = save_surgery(surgery, args.output, force=args.force, source=args.checkpoint, force_hint="--force")
    except NothingToChange as exc:  # pragma: no cover - changed was checked above
        raise CliError(str(exc)) from exc
    except OSError as exc:
        raise CliError(str(exc)) from exc
    notes.append(f"wrote {path}: safetensors, config.json, the input's other files; read back and compared")
    emit(sections, args.format, meta=dict(meta, result="written", written=True, output=str(path)), notes=notes)
    return 0


# ----------------------------------------------------------------------------- embeddings
def configure_embeddings(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="folder with config.json, *.safetensors and tokenizer files")
    p.add_argument("--z", type=positive_float, default=4.0, help="|robust z| above which a row is flagged (4)")
    p.add_argument("--extremes", type=nonnegative_int, default=5, help="largest and smallest rows listed (5)")
    p.add_argument("--figure", metavar="PNG", help="write the sorted-norms figure (and a CSV beside it)")
    add_format_option(p)


def embeddings(args: argparse.Namespace) -> int:
    from ..tools import embedding_figure, heldout_ids, scan_embeddings

    model, tok = _load(args.checkpoint)
    with progress.phase("finding the token table from the dataflow and scanning it"):
        scan = scan_embeddings(model, tok, heldout_ids(tok), z=args.z, extremes=args.extremes)
    s = scan.summary
    notes = []
    if args.figure:
        png = Path(args.figure)
        title = (
            f"{type(model).__name__}: {s['high_outliers']} rows above and {s['low_outliers']} below the table's "
            f"typical norm (median {s['norm_median']:.3g}, |robust z| > {s['z_threshold']:g}) of {s['vocab']}"
        )
        _figure(png, lambda path: embedding_figure(scan, path, title, _command()))
        _write_csv(png.with_suffix(".csv"), [{"id": i, "norm": float(n)} for i, n in enumerate(scan.norms)])
        notes.append(f"wrote {png} and {png.with_suffix('.csv')}")
    sections = [
        Section("summary", [s], f"token table {scan.name}: {s['vocab']} x {s['width']}"),
        Section("tokens", scan.rows, "the largest and smallest rows, the outliers and the special tokens"),
    ]
    emit(sections, args.format, meta={"model": type(model).__name__, "checkpoint": args.checkpoint}, notes=notes)
    return 0


# ----------------------------------------------------------------------------- zoo
def configure_zoo(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", type=one_of(("byte-llama",)), help="byte-llama: a LlamaForCausalLM over bytes")
    p.add_argument("output", help="new folder to save the checkpoint in")
    p.add_argument("--steps", type=positive_int, default=400, help="training steps (default 400)")
    p.add_argument("--layers", type=positive_int, default=6, help="layers (default 6)")
    p.add_argument("--width", type=positive_int, default=128, help="hidden size (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    add_format_option(p)


def zoo(args: argparse.Namespace) -> int:
    from ..tools.zoo import ByteLlama, train_byte_llama

    spec = ByteLlama(hidden_size=args.width, layers=args.layers, intermediate_size=3 * args.width, steps=args.steps,
                     seed=args.seed)  # fmt: skip
    with progress.phase(f"training a byte Llama ({args.layers} x {args.width}) on standard-library sources") as ph:
        record = train_byte_llama(args.output, spec, progress=ph.update)
    row = {k: v for k, v in record.items() if k != "spec"}
    emit([Section("trained", [row], f"saved {args.output}")], args.format, meta={"spec": record["spec"]})
    return 0


# ----------------------------------------------------------------------------- outliers
def configure_outliers(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="folder with config.json, *.safetensors and tokenizer files")
    p.add_argument("--text", action="append", help="text to run (repeatable; default: one window of held-out text)")
    p.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength in [0, 1] (default 0.5)")
    p.add_argument("--no-entropy", action="store_true", help="skip the matrix entropy of the stream by depth")
    p.add_argument(
        "--rescale",
        type=one_of(("v",)),
        help="v: also rescale the attention value path (the value projection's V rows / s, the output projection's "
        "input columns x s, same --alpha; fused QKV and Conv1D layers included, read by the port) on the float64 copy "
        "and show the int8 errors before / after",
    )
    add_format_option(p)


def outliers(args: argparse.Namespace) -> int:
    import copy

    import torch

    from ..tools import ToolError, check_ids, heldout_ids, window_len
    from ..tools.outliers import max_logit_diff, site_report, smooth, stream_entropy

    if not 0.0 <= args.alpha <= 1.0:
        raise CliError(f"--alpha must be in [0, 1], got {args.alpha}")
    for t in args.text or []:
        if not t.strip():
            raise CliError(f"--text must hold text, got {t!r}")
    model, tok = _load(args.checkpoint)
    if args.text:
        ids = torch.tensor([tok(args.text[0])["input_ids"]])
        for t in args.text[1:]:
            ids = torch.cat([ids, torch.tensor([tok(t)["input_ids"]])], 1)  # joined along the token axis
        ids = ids[:, : window_len(model)]
    else:
        ids = torch.tensor([heldout_ids(tok)[: window_len(model)]])
    check_ids(model, ids, "the text")
    tokens = [tok.decode([i]) for i in ids[0].tolist()]
    with progress.phase(f"norm sites from the dataflow; their inputs and outputs on {ids.numel()} tokens"):
        sites = site_report(model, ids, tokens)
    for r in sites:
        r["token"] = repr(r["token"])
    meta: dict[str, Any] = {"model": type(model).__name__, "checkpoint": args.checkpoint, "tokens": ids.numel()}
    title = (
        "per norm site: the input's largest |x| (channel, token, x median |x|) and the relative quantization error "
        "||q(x) - x|| / ||x|| of input and output (int8 / fp8 e4m3, absmax per tensor / per channel)"
    )
    sections = [Section("sites", sites, title)]
    with progress.phase("SmoothQuant-style migration on a float64 copy, proven against the float64 original"):
        m64 = copy.deepcopy(model).double().eval()
        sm = smooth(m64, ids, args.alpha)
        diff = max_logit_diff(m64, sm.model, ids)
    meta.update(alpha=args.alpha, smoothed=len(sm.rows), refused=len(sm.refusals), max_abs_logit_diff_f64=diff)
    if sm.rows:
        title = (
            f"smoothing (alpha {args.alpha}): per-tensor int8 error of the linear input (the norm output) and "
            f"per-channel int8 error of the weights, before / after; function unchanged: max |logit diff| {diff:.3g} "
            "(float64)"
        )
        sections.append(Section("smoothing", sm.rows, title))
    if sm.refusals:
        sections.append(Section("refusals", sm.refusals, "norms not smoothed, and why"))
    if args.rescale == "v":
        from ..tools.rescale import v_scale

        with progress.phase("V-scale on a float64 copy, each attention module verified, logits against the original"):
            try:
                vs = v_scale(m64, ids, args.alpha, strict=False)
            except ValueError as exc:
                raise CliError(f"--rescale v: {exc}") from exc
        meta.update(v_scaled=len(vs.rows), v_refused=len(vs.refusals), v_max_abs_logit_diff_f64=vs.max_logit_diff)
        if vs.rows:
            title = (
                f"V-scale (alpha {args.alpha}): per-tensor int8 error of the V output and of the output projection's "
                "input, per-output-channel int8 error of the output projection's weight, before / after; function "
                f"unchanged: max |logit diff| {vs.max_logit_diff:.3g} (float64)"
            )
            sections.append(Section("rescale", vs.rows, title))
        if vs.refusals:
            sections.append(Section("rescale_refusals", vs.refusals, "attention modules not rescaled, and why"))
    notes = []
    if not args.no_entropy:
        try:
            with progress.phase("matrix entropy of the stream by depth"):
                ent = stream_entropy(model, ids)
            sections.append(Section("entropy", ent, "matrix entropy of the residual stream (tokens x features)"))
        except ToolError as exc:
            notes.append(f"no entropy by depth: {exc}")
    emit(sections, args.format, meta=meta, notes=notes)
    return 0


# ----------------------------------------------------------------------------- cost
def configure_cost(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny shapes and model: seconds (the tests' sizes)")
    p.add_argument("--rounds", type=positive_int, default=None, help="timed rounds per provider (default: >= 5)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--device", type=one_of(("cpu", "cuda")), default="cpu", help="where the timed calls run (cpu)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the inputs and the timing order (0)")
    add_format_option(p)


def cost_sections(result: dict[str, Any]) -> list[Section]:
    """The cost measurement's tables: the attention core and the blocks as ratios to their peers, and the check."""
    from ..tools.cost import PEER

    att_cols = ("shape", "mode", "variant", "median_ms", "min_ms", "ratio", "ratio_min", "rounds")
    block_cols = ("placement", "qk_norm", "median_ms", "min_ms", "ratio", "ratio_min", "qk_cost", "rounds")
    att_title = f"Attention core, fp32 causal: ratio to fused {PEER} in the same run (medians; ratio_min: best calls)"
    block_title = "Whole model fwd+bwd: ratio to pre_ln without QK-norm; qk_cost = with / without QK-norm there"
    return [
        Section("attention", result["attention"], att_title, columns=att_cols, group="shape"),
        Section("blocks", result["blocks"], block_title, columns=block_cols),
        Section("check", result["check"], "fp32 forward vs float64 reference"),
    ]


def cost(args: argparse.Namespace) -> int:
    import torch

    from ..tools.cost import run

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device here (the timed calls run on the CPU by default)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with progress.phase("timing QK-norm, soft-capping and neither around sdpa, then each placement per block"):
        result = run(quick=args.quick, rounds=args.rounds, seed=args.seed, device=args.device)
    table = args.format == "table"
    notes = [f"{k}: {v}" for k, v in result["meta"].items()] if table else []
    emit(cost_sections(result), args.format, meta=None if table else {"meta": result["meta"]}, notes=notes)
    return 0
