"""``POST /api/tools``: the practitioner tools (:mod:`normatlas.tools`) on a checkpoint folder under ``--root``, and
the normalization cost measurement (:mod:`normatlas.tools.cost`, no folder), run as jobs of the inspection queue
(:mod:`.inspect_jobs`: one worker, at most a few waiting, polled at ``GET /api/inspect/job/ID``).

A request names a tool from a fixed set, a folder (resolved under the root exactly as the Inspect view resolves one;
none for ``cost``) and the tool's options (:mod:`.tool_options`: typed, bounded, defaults filled), all validated
before any job starts. The page never writes: the pruning tool drops layers in memory and stops there
(``normatlas prune`` writes), the absorb tool proves its absorption in memory (``normatlas absorb`` writes). Each
answer is typed JSON from :mod:`.tools_run`: ``meta``, ``tables`` and ``chart``.
"""

from __future__ import annotations

import json
from typing import Any

from .._io import dumps
from . import tools_run
from .inspect_api import Targets, Unreadable
from .tool_options import COST_LIMITS, MAX_TEXT, OPTIONS, Kind, Tool, parse_options

__all__ = ["MAX_TEXT", "Tool", "ToolTargets", "run_tool", "tools_view"]

_ABOUT = {
    Tool.LENS: "the logit lens through the final norm: per layer, the stream decoded through the model's own final "
    "norm and head (or a refit one: the tuned lens); top-k tokens, KL to the final layer, the final answer's rank "
    "(normatlas lens)",
    Tool.OUTLIERS: "outliers and quantization at every norm site: massive activations and their tokens, int8 / fp8 "
    "errors per tensor / per channel, a SmoothQuant-style migration (and V-scaling) proven in float64, the stream's "
    "matrix entropy by depth (normatlas outliers)",
    Tool.PRUNE: "depth pruning: per layer, the angle between its input and output stream and the update-to-stream "
    "ratio on held-out text; with drop > 0 the lowest layers are dropped in memory, proven and the loss measured "
    "before / after; nothing is written (normatlas prune --dry-run)",
    Tool.EMBEDDINGS: "the embedding-table scan: the norm of every token's row, its outliers and the special tokens "
    "(normatlas embeddings)",
    Tool.ABSORB: "absorbing post-branch RMSNorms (Pangu-style, the statistic frozen on calibration text): what would "
    "change, each norm's frozen rms, the approximation against the original on held-out text and the proof against "
    "the frozen-statistic model; nothing is written (normatlas absorb --dry-run)",
    Tool.COST: "what normalization costs: QK-norm vs tanh soft-capping vs neither around fused attention (sdpa), "
    "and each placement per block with and without QK-norm, as ratios measured in one run on this server's CPU; "
    "no checkpoint (benchmarks/norm_cost.py)",
}
_NO_FOLDER = {Tool.COST}


def _text_use(tool: Tool) -> str:
    opt = next((o for o in OPTIONS[tool] if o.kind is Kind.TEXT), None)
    return "none" if opt is None else "needed" if opt.required else "optional"


class ToolTargets(Targets):
    """The targets of ``POST /api/tools``: ``{"tool": NAME, "folder": PATH, OPTION: VALUE, ...}`` (no folder for
    ``cost``); the options of :data:`.tool_options.OPTIONS`."""

    def target(self, body: Any) -> tuple[str, str, str]:
        if not isinstance(body, dict) or "tool" not in body:
            raise ValueError(f"the body must be {{'tool': NAME, 'folder': PATH, OPTION: VALUE...}}; got {body!r}"[:300])
        allowed = [t.value for t in Tool]
        if not isinstance(body["tool"], str) or body["tool"] not in allowed:
            raise ValueError(f"tool={body['tool']!r} is not one of {allowed}"[:300])
        tool = Tool(body["tool"])
        if tool in _NO_FOLDER:
            if "folder" in body:
                raise ValueError(f"tool={tool.value!r} takes no folder (it times freshly built modules)")
            options = parse_options(tool, body)
            name, path = "this server's CPU", None
        else:
            if "folder" not in body:
                raise ValueError(f"the body must be {{'tool': NAME, 'folder': PATH, ...}}: {tool.value} needs a folder")
            options = parse_options(tool, body)
            resolved = self.resolve_folder(body["folder"])
            name, path = resolved.relative_to(self.root).as_posix(), str(resolved)
        spec = {"tool": tool.value, "path": path, "options": options}
        key = "tool:" + dumps(spec, sort_keys=True)
        changed = [f"{k} {v}" for k, v in options.items() if k != "text" and v != _default(tool, k)]
        label = f"{tool.value} on {name}" + (f" ({', '.join(changed)})" if changed else "")
        return key, dumps(spec), label


def _default(tool: Tool, name: str) -> Any:
    return next(o.default for o in OPTIONS[tool] if o.name == name)


def tools_view() -> dict[str, Any]:
    """``GET /api/tools``: each tool's name, what it shows, whether it needs a folder, whether it takes (or needs) a
    text, and its options (kind, default, bounds or choices); the text's bound and the cost tool's size limits."""
    tools = [
        {
            "tool": t.value,
            "about": _ABOUT[t],
            "folder": t not in _NO_FOLDER,
            "text": _text_use(t),
            "options": [o.view() for o in OPTIONS[t] if o.kind is not Kind.TEXT],
        }
        for t in Tool
    ]
    limits = [{"product": " x ".join(names), "what": what, "max": n} for what, (names, n) in COST_LIMITS.items()]
    return {"tools": tools, "max_text": MAX_TEXT, "cost_limits": limits}


def run_tool(target: str) -> dict[str, Any]:
    """Run a :class:`ToolTargets` target (its JSON spec): the tool's ``meta``, ``tables`` and ``chart``, with
    ``tool``, ``model`` (the class; ``None`` for ``cost``) and ``options`` (as run). A folder the tools cannot read
    (no tokenizer, no head, a model that does not run) raises :class:`.inspect_api.Unreadable`."""
    from ..tools import ToolError, load

    spec = json.loads(target)
    tool, options = Tool(spec["tool"]), spec["options"]
    model = None
    try:
        if tool is Tool.COST:
            doc = tools_run.cost(options)
        else:
            model, tok = load(spec["path"])
            doc = getattr(tools_run, tool.value)(model, tok, options)
    except Unreadable:
        raise
    except (ToolError, ValueError, FileNotFoundError, OSError) as exc:
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")[:300]
        raise Unreadable(f"{tool.value}: {type(exc).__name__}: {first}") from exc
    name = type(model).__name__ if model is not None else None
    return {"tool": tool.value, "model": name, "options": options} | doc
