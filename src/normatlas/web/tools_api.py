"""``POST /api/tools``: the practitioner tools (:mod:`normatlas.tools`) on a checkpoint folder under ``--root``, run
as jobs of the inspection queue (:mod:`.inspect_jobs`: one worker, at most a few waiting, polled at
``GET /api/inspect/job/ID``).

A request names a tool from a fixed set, a folder (resolved under the root exactly as the Inspect view resolves one)
and, for the lens and the outliers report, a text of at most :data:`MAX_TEXT` characters. The page never writes:
the pruning tool scores the layers and stops there (``normatlas prune`` writes the checkpoint). Each answer is typed
JSON: ``meta`` (numbers and names), ``tables`` (``{name, title, rows}``, the CLI's sections) and ``chart`` (the
series the CLI draws as a figure), or none.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from .._io import dumps
from .inspect_api import Targets, Unreadable

__all__ = ["MAX_TEXT", "Tool", "ToolTargets", "run_tool", "tools_view"]

MAX_TEXT = 500  # characters of a prompt
_KEYS = frozenset({"tool", "folder", "text"})
_CHART_POINTS = 101  # the embedding norms' chart: quantiles of the sorted norms


class Tool(enum.Enum):
    """The tools the page may run (the CLI commands of the same names)."""

    LENS = "lens"
    OUTLIERS = "outliers"
    PRUNE = "prune"
    EMBEDDINGS = "embeddings"


_ABOUT = {
    Tool.LENS: "the logit lens through the final norm: per layer, the stream decoded through the model's own final "
    "norm and head; top-5 tokens, KL to the final layer, the final answer's rank (normatlas lens)",
    Tool.OUTLIERS: "outliers and quantization at every norm site: massive activations and their tokens, int8 / fp8 "
    "errors, a SmoothQuant-style migration proven in float64, the stream's matrix entropy by depth "
    "(normatlas outliers)",
    Tool.PRUNE: "depth-pruning scores: per layer, the angle between its input and output stream and the "
    "update-to-stream ratio on held-out text; scores only, nothing is written (normatlas prune --drop 0)",
    Tool.EMBEDDINGS: "the embedding-table scan: the norm of every token's row, its outliers and the special tokens "
    "(normatlas embeddings)",
}
_NEEDS_TEXT = {Tool.LENS}
_TAKES_TEXT = {Tool.LENS, Tool.OUTLIERS}


class ToolTargets(Targets):
    """The targets of ``POST /api/tools``: ``{"tool": NAME, "folder": PATH, "text": TEXT}`` (``text`` for the lens,
    optional for the outliers, refused for the others)."""

    def target(self, body: Any) -> tuple[str, str, str]:
        if not isinstance(body, dict) or not {"tool", "folder"} <= set(body) or set(body) - _KEYS:
            raise ValueError(f"the body must be {{'tool': NAME, 'folder': PATH, 'text': TEXT}}; got {body!r}"[:300])
        allowed = [t.value for t in Tool]
        if not isinstance(body["tool"], str) or body["tool"] not in allowed:
            raise ValueError(f"tool={body['tool']!r} is not one of {allowed}"[:300])
        tool = Tool(body["tool"])
        text = body.get("text")
        if text is not None:
            if tool not in _TAKES_TEXT:
                raise ValueError(f"tool={tool.value!r} takes no text")
            if not isinstance(text, str) or not text.strip() or len(text) > MAX_TEXT or "\x00" in text:
                raise ValueError(f"text must be a non-empty string of at most {MAX_TEXT} characters (no NUL)")
        elif tool in _NEEDS_TEXT:
            raise ValueError(f"tool={tool.value!r} needs a text (the prompt)")
        path = self.resolve_folder(body["folder"])
        name = path.relative_to(self.root).as_posix()
        spec = {"tool": tool.value, "path": str(path), "text": text}
        key = "tool:" + dumps(spec, sort_keys=True)
        return key, dumps(spec), f"{tool.value} on {name}"


def _chart(title: str, short: str, x: str, series: list[str], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The page's line chart of ``series`` over ``x``: one point ``[x, *series]`` per row."""
    return {"title": title, "short": short, "x": x, "series": series,
            "points": [[r[x], *(r[k] for k in series)] for r in rows]}  # fmt: skip


def tools_view() -> dict[str, Any]:
    """``GET /api/tools``: each tool's name, what it shows, whether it takes (or needs) a text; the text's bound."""
    tools = [
        {
            "tool": t.value,
            "about": _ABOUT[t],
            "text": "needed" if t in _NEEDS_TEXT else "optional" if t in _TAKES_TEXT else "none",
        }
        for t in Tool
    ]
    return {"tools": tools, "max_text": MAX_TEXT}


def _lens(model: Any, tok: Any, text: str) -> dict[str, Any]:
    from ..tools import NoHead, check_ids, logit_lens, read_model, window_len

    ids = tok(text, return_tensors="pt")["input_ids"][:, : window_len(model, 256)]  # the model's context at most
    check_ids(model, ids, "the text")
    try:
        reading = read_model(model, ids)
    except NoHead as exc:
        raise Unreadable(f"{type(model).__name__} has no LM or MLM head to decode a layer's stream through") from exc
    res = logit_lens(model, ids, tok, k=5, reading=reading)
    meta = {
        "layers": len(reading.layers),
        "final_norm": reading.tail[reading.norm_at] if reading.norm_at is not None else None,
        "tail": " -> ".join(reading.tail),
        "answer": res.answer,
        "tokens": len(res.tokens),
    }
    title = f"{text!r} -> final answer {res.answer!r}: per layer, the stream through the final norm and head"
    chart = _chart("KL(final || layer), nats, mean over positions", "KL to the final layer", "layer",
                   ["kl_mean", "kl_last"], res.rows)  # fmt: skip
    return {"meta": meta, "tables": [{"name": "lens", "title": title, "rows": res.rows}], "chart": chart}


def _outliers(model: Any, tok: Any, text: str | None) -> dict[str, Any]:
    import copy

    import torch

    from ..tools import ToolError, check_ids, heldout_ids, window_len
    from ..tools.outliers import max_logit_diff, site_report, smooth, stream_entropy

    raw = tok(text)["input_ids"] if text is not None else heldout_ids(tok)
    ids = torch.tensor([list(raw)[: window_len(model)]])
    check_ids(model, ids, "the text")
    tokens = [tok.decode([i]) for i in ids[0].tolist()]
    sites = site_report(model, ids, tokens)
    title = (
        "per norm site: the input's largest |x| (channel, token, x median |x|) and the relative quantization error "
        "||q(x) - x|| / ||x|| of input and output (int8 / fp8 e4m3, absmax per tensor / per channel)"
    )
    tables = [{"name": "sites", "title": title, "rows": sites}]
    m64 = copy.deepcopy(model).double().eval()
    sm = smooth(m64, ids, 0.5)
    diff = max_logit_diff(m64, sm.model, ids)
    if sm.rows:
        tables.append(
            {
                "name": "smoothing",
                "title": f"SmoothQuant-style migration (alpha 0.5), max |logit diff| {diff:.3g} in float64",
                "rows": sm.rows,
            }
        )
    if sm.refusals:
        tables.append({"name": "refusals", "title": "norms not smoothed, and why", "rows": sm.refusals})
    meta: dict[str, Any] = {
        "tokens": ids.numel(),
        "sites": len(sites),
        "smoothed": len(sm.rows),
        "max_abs_logit_diff_f64": diff,
    }
    chart = None
    try:
        ent = stream_entropy(model, ids)
        tables.append({"name": "entropy", "title": "matrix entropy of the residual stream by depth", "rows": ent})
        chart = _chart("matrix entropy of the stream by depth (0: entering layer 0)", "matrix entropy", "depth",
                       ["entropy"], ent)  # fmt: skip
    except ToolError as exc:
        meta["entropy"] = f"not measured: {exc}"
    return {"meta": meta, "tables": tables, "chart": chart}


def _prune(model: Any, tok: Any) -> dict[str, Any]:
    from ..tools import check_ids, heldout_ids, layer_scores, read_model, window_len, windows

    ids = heldout_ids(tok)
    check_ids(model, ids, "the held-out text")
    score_ids = windows(ids, window_len(model), 8)
    reading = read_model(model, score_ids[:1], head=False)
    scores = layer_scores(model, reading, score_ids)
    title = f"layer scores on {score_ids.numel()} held-out tokens (low angle / ratio: the layer turns the stream least)"
    chart = _chart("layer scores by depth: angle (arccos of the cosine, / pi) and update-to-stream ratio",
                   "scores by depth", "layer", ["angle", "ratio"], scores)  # fmt: skip
    meta = {"layers": len(scores), "score_tokens": score_ids.numel(), "written": False}
    return {"meta": meta, "tables": [{"name": "scores", "title": title, "rows": scores}], "chart": chart}


def _embeddings(model: Any, tok: Any) -> dict[str, Any]:
    import torch

    from ..tools import heldout_ids, scan_embeddings

    scan = scan_embeddings(model, tok, heldout_ids(tok))
    s = scan.summary
    norms = torch.sort(scan.norms.double()).values
    n = len(norms)
    picks = sorted({round(i * (n - 1) / (_CHART_POINTS - 1)) for i in range(_CHART_POINTS)})
    points = [{"rank": i / max(1, n - 1), "norm": float(norms[i])} for i in picks]
    chart = _chart("token norms, sorted (rank as a fraction of the vocabulary)", "token norms, sorted", "rank",
                   ["norm"], points)  # fmt: skip
    tables = [
        {"name": "summary", "title": f"token table {scan.name}: {s['vocab']} x {s['width']}", "rows": [s]},
        {
            "name": "tokens",
            "title": "the largest and smallest rows, the outliers and the special tokens",
            "rows": scan.rows,
        },
    ]
    return {"meta": {"vocab": s["vocab"], "width": s["width"]}, "tables": tables, "chart": chart}


def run_tool(target: str) -> dict[str, Any]:
    """Run a :class:`ToolTargets` target (its JSON spec): the tool's ``meta``, ``tables`` and ``chart``, with
    ``tool`` and ``model`` (the class). A folder the tools cannot read (no tokenizer, no head, a model that does not
    run) raises :class:`.inspect_api.Unreadable`."""
    from ..tools import ToolError, load

    spec = json.loads(target)
    tool = Tool(spec["tool"])
    try:
        model, tok = load(spec["path"])
        if tool is Tool.LENS:
            doc = _lens(model, tok, spec["text"])
        elif tool is Tool.OUTLIERS:
            doc = _outliers(model, tok, spec["text"])
        elif tool is Tool.PRUNE:
            doc = _prune(model, tok)
        else:
            doc = _embeddings(model, tok)
    except Unreadable:
        raise
    except (ToolError, ValueError, FileNotFoundError, OSError) as exc:
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")[:300]
        raise Unreadable(f"{tool.value}: {type(exc).__name__}: {first}") from exc
    return {"tool": tool.value, "model": type(model).__name__} | doc
