"""The options each page tool takes, as data: a typed :class:`Option` per field (kind, default, bounds or choices),
validated on the server before any job and listed by ``GET /api/tools`` so the page draws its form from them.

Every bound is a cap on the work one request may start: the page is a view of the library, and a request must not
hold the (shared) machine for minutes. A refused field answers 400 naming the tool, the field, the value and what is
allowed. Inside, the parsed options are plain typed values (ints, floats, bools, one of the named strings).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["COST_LIMITS", "MAX_TEXT", "OPTIONS", "Kind", "Option", "Tool", "parse_options"]

MAX_TEXT = 500  # characters of a prompt or a calibration text
_MAX_SEED = 2**31 - 1


class Tool(enum.Enum):
    """The tools the page may run (the CLI commands of the same names; ``cost`` is ``benchmarks/norm_cost.py``)."""

    LENS = "lens"
    OUTLIERS = "outliers"
    PRUNE = "prune"
    EMBEDDINGS = "embeddings"
    ABSORB = "absorb"
    COST = "cost"


class Kind(enum.Enum):
    INT = "int"
    FLOAT = "float"
    BOOL = "bool"
    CHOICE = "choice"
    TEXT = "text"


@dataclass(frozen=True)
class Option:
    """One field of a tool's request: its kind, default (``None``: absent unless given), bounds (``lo`` / ``hi``,
    inclusive; ``step``: an int must be a multiple of it) or choices, and what it does."""

    name: str
    kind: Kind
    default: Any
    about: str
    lo: float | None = None
    hi: float | None = None
    step: int = 1
    choices: tuple[str, ...] = ()
    required: bool = False

    def allowed(self) -> str:
        if self.kind is Kind.INT:
            every = f", a multiple of {self.step}" if self.step > 1 else ""
            return f"an integer in [{self.lo:g}, {self.hi:g}]{every}"
        if self.kind is Kind.FLOAT:
            return f"a number in [{self.lo:g}, {self.hi:g}]"
        if self.kind is Kind.BOOL:
            return "true or false"
        if self.kind is Kind.CHOICE:
            return f"one of {list(self.choices)}"
        return f"a non-empty string of at most {MAX_TEXT} characters (no NUL)"

    def parse(self, tool: Tool, value: Any) -> Any:
        """``value`` as this option's typed value, else ``ValueError`` naming the tool, field, value and bounds."""
        ok: bool
        if self.kind is Kind.INT:
            ok = isinstance(value, int) and not isinstance(value, bool)
            ok = ok and self.lo is not None and self.hi is not None and self.lo <= value <= self.hi
            ok = ok and value % self.step == 0
        elif self.kind is Kind.FLOAT:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            ok = ok and self.lo is not None and self.hi is not None and self.lo <= value <= self.hi
            value = float(value) if ok else value
        elif self.kind is Kind.BOOL:
            ok = isinstance(value, bool)
        elif self.kind is Kind.CHOICE:
            ok = isinstance(value, str) and value in self.choices
        else:
            ok = isinstance(value, str) and bool(value.strip()) and len(value) <= MAX_TEXT and "\x00" not in value
        if not ok:
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise ValueError(f"{tool.value}: {self.name}={shown} is not allowed; it must be {self.allowed()}")
        return value

    def view(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name, "kind": self.kind.value, "default": self.default, "about": self.about}
        if self.kind in (Kind.INT, Kind.FLOAT):
            doc |= {"min": self.lo, "max": self.hi, "step": self.step if self.kind is Kind.INT else None}
        if self.choices:
            doc["choices"] = list(self.choices)
        if self.kind is Kind.TEXT:
            doc |= {"required": self.required, "max": MAX_TEXT}
        return doc


def _seed(about: str = "seed") -> Option:
    return Option("seed", Kind.INT, 0, about, 0, _MAX_SEED)


OPTIONS: dict[Tool, tuple[Option, ...]] = {
    Tool.LENS: (
        Option("text", Kind.TEXT, None, "the prompt", required=True),
        Option("k", Kind.INT, 5, "top-k tokens per layer", 1, 20),
        Option("tuned", Kind.BOOL, False, "also refit the final norm's gain per layer on held-out text (tuned lens)"),
        Option("tuned_steps", Kind.INT, 200, "Adam steps of the tuned fit", 1, 400),
        _seed("seed of the tuned fit"),
    ),
    Tool.OUTLIERS: (
        Option("text", Kind.TEXT, None, "text to run (else one window of held-out text)"),
        Option("alpha", Kind.FLOAT, 0.5, "SmoothQuant migration strength", 0.0, 1.0),
        Option(
            "format",
            Kind.CHOICE,
            "both",
            "quantization format of the error columns",
            choices=("both", "int8", "fp8_e4m3"),
        ),
        Option(
            "scale",
            Kind.CHOICE,
            "both",
            "absmax scale of the error columns: per tensor or per channel",
            choices=("both", "tensor", "channel"),
        ),
        Option(
            "rescale",
            Kind.CHOICE,
            "none",
            "v: also rescale the attention value path (V-scaling, same alpha)",
            choices=("none", "v"),
        ),
        Option("entropy", Kind.BOOL, True, "the matrix entropy of the stream by depth"),
    ),
    Tool.PRUNE: (
        Option("drop", Kind.INT, 0, "layers to drop in memory and measure (0: scores only); never written", 0, 32),
        Option(
            "by",
            Kind.CHOICE,
            "angle",
            "angle / ratio: the k lowest layers; block: the k consecutive layers",
            choices=("angle", "ratio", "block"),
        ),
        Option("windows", Kind.INT, 8, "held-out windows the loss is measured on (with drop > 0)", 1, 32),
    ),
    Tool.EMBEDDINGS: (
        Option("top", Kind.INT, 5, "largest and smallest rows listed", 0, 50),
        Option("z", Kind.FLOAT, 4.0, "|robust z| above which a row is flagged", 0.5, 100.0),
    ),
    Tool.ABSORB: (
        Option("text", Kind.TEXT, None, "calibration text (else 8 windows of held-out text)"),
        Option("windows", Kind.INT, 8, "held-out windows the approximation is measured on", 1, 16),
        _seed("seed of the probe inputs of the proof"),
    ),
    Tool.COST: (
        Option("batch", Kind.INT, 1, "attention core: batch B", 1, 8),
        Option("seq", Kind.INT, 256, "attention core: tokens T", 1, 1024),
        Option("heads", Kind.INT, 8, "attention core: heads H", 1, 16),
        Option("head_dim", Kind.INT, 64, "attention core: head size Dh", 8, 128, step=8),
        Option("width", Kind.INT, 256, "blocks: d_model (heads of 64, MLP 3 x d_model)", 64, 512, step=64),
        Option("layers", Kind.INT, 2, "blocks: layers", 1, 4),
        Option("block_seq", Kind.INT, 256, "blocks: tokens", 8, 512),
        Option("rounds", Kind.INT, 5, "timed rounds per provider (after 2 warm-up rounds)", 1, 10),
    ),
}

# products of the cost tool's sizes, each capped (the attention core's largest default shape, 1 x 1024 x 16 x 64)
COST_LIMITS: dict[str, tuple[tuple[str, ...], int]] = {
    "q / k / v elements": (("batch", "seq", "heads", "head_dim"), 2**20),
    "score-matrix elements": (("batch", "heads", "seq", "seq"), 2**24),
}


def parse_options(tool: Tool, body: dict[str, Any]) -> dict[str, Any]:
    """``tool``'s options from a request ``body`` (its other keys: ``tool``, ``folder``): every field typed, bounded,
    defaults filled; ``ValueError`` for an unknown field, a missing required one or one out of bounds."""
    spec = {o.name: o for o in OPTIONS[tool]}
    extra = sorted(set(body) - set(spec) - {"tool", "folder"})
    if extra:
        raise ValueError(f"{tool.value}: unknown field(s) {extra}; it takes {sorted(spec)}"[:400])
    out: dict[str, Any] = {}
    for name, opt in spec.items():
        if name not in body:
            if opt.required:
                raise ValueError(f"{tool.value} needs {name} ({opt.about}): {opt.allowed()}")
            out[name] = opt.default
        else:
            out[name] = opt.parse(tool, body[name])
    if tool is Tool.COST:
        for what, (names, limit) in COST_LIMITS.items():
            n = math.prod(out[k] for k in names)
            if n > limit:
                product = " x ".join(names)
                raise ValueError(f"cost: {product} = {n} {what}, over the limit of {limit}; make them smaller")
    return out
