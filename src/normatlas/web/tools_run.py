"""The page tools' runners: each calls the library functions behind its CLI command (:mod:`normatlas.tools`) with
the request's typed options (:mod:`.tool_options`) and answers ``meta`` (numbers and names), ``tables``
(``{name, title, rows}``, the CLI's sections) and ``chart`` (the series the CLI draws as a figure), or none.

Nothing here writes: the pruning runs in memory and stops before ``save``; the absorption is proven in memory and
never saved (``normatlas absorb`` writes); the cost tool times freshly built modules.
"""

from __future__ import annotations

import copy
from typing import Any

from .inspect_api import Unreadable

__all__ = ["absorb", "cost", "embeddings", "lens", "outliers", "prune"]

_CHART_POINTS = 101  # the embedding norms' chart: quantiles of the sorted norms


def lens(model: Any, tok: Any, o: dict[str, Any]) -> dict[str, Any]:
    from ..tools import NoHead, check_ids, logit_lens, read_model, window_len
    from ..tools.lens import fit_on_heldout, tuned_rows, tuned_title

    text = o["text"]
    ids = tok(text, return_tensors="pt")["input_ids"][:, : window_len(model, 256)]  # the model's context at most
    check_ids(model, ids, "the text")
    try:
        reading = read_model(model, ids)
    except NoHead as exc:
        raise Unreadable(f"{type(model).__name__} has no LM or MLM head to decode a layer's stream through") from exc
    tables = []
    gains = None
    if o["tuned"]:
        fit = fit_on_heldout(model, tok, reading, steps=o["tuned_steps"], seed=o["seed"])
        gains = fit.gains
        tables.append({"name": "tuned_fit", "title": tuned_title(fit), "rows": tuned_rows(fit)})
    res = logit_lens(model, ids, tok, k=o["k"], reading=reading, gains=gains)
    meta = {
        "layers": len(reading.layers),
        "final_norm": reading.tail[reading.norm_at] if reading.norm_at is not None else None,
        "tail": " -> ".join(reading.tail),
        "answer": res.answer,
        "tokens": len(res.tokens),
        "k": o["k"],
        "tuned": o["tuned"],
    }
    through = "the refit (tuned) norm" if gains is not None else "the final norm"
    title = f"{text!r} -> final answer {res.answer!r}: per layer, the stream through {through} and the head"
    tables.insert(0, {"name": "lens", "title": title, "rows": res.rows})
    chart = {
        "title": "KL(final || layer), nats, mean over positions",
        "short": "KL to the final layer",
        "x": "layer",
        "series": ["kl_mean", "kl_last"],
        "points": [[r["layer"], r["kl_mean"], r["kl_last"]] for r in res.rows],
    }
    return {"meta": meta, "tables": tables, "chart": chart}


def _pick(choice: str, every: tuple[str, ...]) -> tuple[str, ...]:
    return every if choice == "both" else (choice,)


def outliers(model: Any, tok: Any, o: dict[str, Any]) -> dict[str, Any]:
    import torch

    from ..tools import ToolError, check_ids, heldout_ids, window_len
    from ..tools.outliers import FORMATS, SCALES, max_logit_diff, site_report, smooth, stream_entropy

    text, alpha = o["text"], o["alpha"]
    raw = tok(text)["input_ids"] if text is not None else heldout_ids(tok)
    ids = torch.tensor([list(raw)[: window_len(model)]])
    check_ids(model, ids, "the text")
    tokens = [tok.decode([i]) for i in ids[0].tolist()]
    formats, scales = _pick(o["format"], FORMATS), _pick(o["scale"], SCALES)
    sites = site_report(model, ids, tokens, formats=formats, scales=scales)
    title = (
        "per norm site: the input's largest |x| (channel, token, x median |x|) and the relative quantization error "
        f"||q(x) - x|| / ||x|| of input and output ({' / '.join(formats)}, absmax per {' / '.join(scales)})"
    )
    tables = [{"name": "sites", "title": title, "rows": sites}]
    m64 = copy.deepcopy(model).double().eval()
    sm = smooth(m64, ids, alpha)
    diff = max_logit_diff(m64, sm.model, ids)
    if sm.rows:
        title = f"SmoothQuant-style migration (alpha {alpha:g}), max |logit diff| {diff:.3g} in float64"
        tables.append({"name": "smoothing", "title": title, "rows": sm.rows})
    if sm.refusals:
        tables.append({"name": "refusals", "title": "norms not smoothed, and why", "rows": sm.refusals})
    meta: dict[str, Any] = {
        "tokens": ids.numel(),
        "sites": len(sites),
        "alpha": alpha,
        "smoothed": len(sm.rows),
        "max_abs_logit_diff_f64": diff,
    }
    if o["rescale"] == "v":
        from ..tools.rescale import v_scale

        vs = v_scale(m64, ids, alpha, strict=False)
        meta.update(v_scaled=len(vs.rows), v_max_abs_logit_diff_f64=vs.max_logit_diff)
        if vs.rows:
            title = f"V-scale (alpha {alpha:g}), max |logit diff| {vs.max_logit_diff:.3g} in float64"
            tables.append({"name": "rescale", "title": title, "rows": vs.rows})
        if vs.refusals:
            tables.append({"name": "rescale_refusals", "title": "attention modules not rescaled", "rows": vs.refusals})
    chart = None
    if o["entropy"]:
        try:
            ent = stream_entropy(model, ids)
            tables.append({"name": "entropy", "title": "matrix entropy of the residual stream by depth", "rows": ent})
            chart = {
                "title": "matrix entropy of the stream by depth (0: entering layer 0)",
                "short": "matrix entropy",
                "x": "depth",
                "series": ["entropy"],
                "points": [[r["depth"], r["entropy"]] for r in ent],
            }
        except ToolError as exc:
            meta["entropy"] = f"not measured: {exc}"
    return {"meta": meta, "tables": tables, "chart": chart}


def prune(model: Any, tok: Any, o: dict[str, Any]) -> dict[str, Any]:
    from ..surgery import probe_inputs
    from ..tools import plan_prune, run_prune

    k = o["drop"]
    plan = plan_prune(model, tok, k, o["by"], o["windows"])
    scores, blocks, rows, score_ids = plan.scores, plan.blocks, plan.rows, plan.score_ids
    title = f"layer scores on {score_ids.numel()} held-out tokens (low angle / ratio: the layer turns the stream least)"
    tables: list[dict[str, Any]] = [{"name": "scores", "title": title, "rows": rows}]
    meta: dict[str, Any] = {"layers": len(scores), "score_tokens": score_ids.numel(), "by": o["by"], "drop": plan.drop}
    if blocks:
        brows = [{"layers": " ".join(map(str, b["layers"])), "angle": b["angle"]} for b in blocks]
        tables.append({"name": "blocks", "title": f"angle across each block of {k} consecutive layers", "rows": brows})
    if k:
        done = run_prune(model, plan, probe_inputs(model))
        surgery, before, after, eval_ids = done.surgery, done.before, done.after, plan.eval_ids
        compared = [{"model": "original", "value": before["value"]}, {"model": f"-{k} layers", "value": after["value"]}]
        title = f"{before['measure']} on {eval_ids.numel()} held-out tokens, in memory (nothing written)"
        tables.append({"name": "quality", "title": title, "rows": compared})
        tables.append({"name": "checks", "title": "proof: pruned vs the original with those layers skipped",
                       "rows": surgery.check_rows()})  # fmt: skip
        meta.update(measure=before["measure"], before=before["value"], after=after["value"], passed=surgery.passed)
    meta["written"] = False
    chart = {
        "title": "layer scores by depth: angle (arccos of the cosine, / pi) and update-to-stream ratio",
        "short": "scores by depth",
        "x": "layer",
        "series": ["angle", "ratio"],
        "points": [[r["layer"], r["angle"], r["ratio"]] for r in scores],
    }
    return {"meta": meta, "tables": tables, "chart": chart}


def embeddings(model: Any, tok: Any, o: dict[str, Any]) -> dict[str, Any]:
    import torch

    from ..tools import heldout_ids, scan_embeddings

    scan = scan_embeddings(model, tok, heldout_ids(tok), z=o["z"], extremes=o["top"])
    s = scan.summary
    norms = torch.sort(scan.norms.double()).values
    n = len(norms)
    picks = sorted({round(i * (n - 1) / (_CHART_POINTS - 1)) for i in range(_CHART_POINTS)})
    chart = {
        "title": "token norms, sorted (rank as a fraction of the vocabulary)",
        "short": "token norms, sorted",
        "x": "rank",
        "series": ["norm"],
        "points": [[i / max(1, n - 1), float(norms[i])] for i in picks],
    }
    tables = [
        {"name": "summary", "title": f"token table {scan.name}: {s['vocab']} x {s['width']}", "rows": [s]},
        {
            "name": "tokens",
            "title": f"the {o['top']} largest and smallest rows, the outliers (|robust z| > {o['z']:g}) and the "
            "special tokens",
            "rows": scan.rows,
        },
    ]
    return {"meta": {"vocab": s["vocab"], "width": s["width"]}, "tables": tables, "chart": chart}


def absorb(model: Any, tok: Any, o: dict[str, Any]) -> dict[str, Any]:
    """``normatlas absorb CKPT --dry-run``'s report: the changes and refusals, each norm's frozen rms, the
    approximation against the original on held-out text and the proof against the frozen-statistic model."""
    from ..surgery import model_dtype
    from ..tools.absorbing import absorb_checkpoint, prove

    texts = [o["text"]] if o["text"] is not None else None
    run = absorb_checkpoint(model, tok, texts=texts, windows=o["windows"], seed=o["seed"], label="the text")
    surgery = run.surgery
    tables: list[dict[str, Any]] = [
        {"name": "changes", "title": f"{surgery.transform}: what would change", "rows": surgery.rows()},
        {"name": "calibration", "title": f"frozen rms per norm ({run.source})", "rows": run.calibration_rows()},
    ]
    dtype = str(model_dtype(model)).replace("torch.", "")
    meta: dict[str, Any] = {"transform": surgery.transform, "dtype": dtype, "absorbed": len(surgery.stats),
                            "refused": len(surgery.refusals), "written": False}  # fmt: skip
    if surgery.changed:
        title = f"approximation: absorbed vs the original on {run.held_tokens} held-out tokens (loss in nats/token)"
        tables.append({"name": "approximation", "title": title, "rows": [surgery.approximation]})
        prove(run)
        proof = "proof: absorbed vs the frozen-statistic model (exact claim), probe inputs"
        tables.append({"name": "checks", "title": proof, "rows": surgery.check_rows()})
        meta["result"] = "verified" if surgery.passed else "verification failed"
    else:
        meta["result"] = f"nothing to change: {surgery.nothing_reason()}"
    if surgery.notes:
        tables.append({"name": "notes", "title": "what the surgery says", "rows": [{"note": n} for n in surgery.notes]})
    return {"meta": meta, "tables": tables, "chart": None}


def cost(o: dict[str, Any]) -> dict[str, Any]:
    """:func:`normatlas.tools.cost.run` at the request's sizes, ``rounds`` timed rounds (no time budget)."""
    from ..tools import cost as nc

    shape = (o["batch"], o["seq"], o["heads"], o["head_dim"])
    width = o["width"]
    block = {"d_model": width, "n_heads": width // 64, "d_ff": 3 * width, "n_layers": o["layers"],
             "seq": o["block_seq"], "batch": 1}  # fmt: skip
    res = nc.run(rounds=o["rounds"], shapes=[shape], block=block)
    meta = {k: v for k, v in res["meta"].items() if k not in ("quick", "device_name")}  # no quick mode; cpu says it
    meta["block"] = " ".join(f"{k} {v}" for k, v in block.items())
    meta["shapes"] = ", ".join(meta["shapes"])
    meta["loadavg_before"] = " ".join(f"{x:g}" for x in meta["loadavg_before"])
    meta["loadavg_after"] = " ".join(f"{x:g}" for x in meta["loadavg_after"])
    att_title = (
        f"attention core {nc.shape_name(shape)} (B x T x H x Dh), fp32 causal: time as a ratio to the fused "
        f"{nc.PEER} in the same run (medians; ratio_min: best calls)"
    )
    block_title = (
        f"whole model fwd+bwd ({o['layers']} layers, d_model {width}, T {o['block_seq']}): ratio to pre_ln without "
        "QK-norm; qk_cost = with / without QK-norm at that placement"
    )
    first = ("shape", "mode", "variant", "placement", "qk_norm", "ratio", "qk_cost")  # the claim before the times

    def ratios_first(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: r[k] for k in first if k in r} | {k: v for k, v in r.items() if k not in first} for r in rows]

    tables = [
        {"name": "attention", "title": att_title, "rows": ratios_first(res["attention"])},
        {"name": "blocks", "title": block_title, "rows": ratios_first(res["blocks"])},
        {"name": "check", "title": "each variant's fp32 forward against a float64 reference", "rows": res["check"]},
    ]
    return {"meta": meta, "tables": tables, "chart": None}
