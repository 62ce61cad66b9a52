"""What a surgery did: changes, refusals with their reasons, runtime swaps, and the measured proof."""

from __future__ import annotations

import copy
import dataclasses
import enum
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..blocks.model import ModelConfig
from ..longtail import FrozenBatchNorm
from ..modules import Norm
from ..spec import NormSpec, parse_enum

__all__ = [
    "Change",
    "Check",
    "NothingToChange",
    "Refusal",
    "Surgery",
    "Swap",
    "SwapKind",
    "apply_swaps",
]


class NothingToChange(ValueError):
    """A surgery that changes nothing in the model: it is reported, never written as a copy."""


@dataclass
class Change:
    target: str
    action: str
    detail: str = ""


@dataclass
class Refusal:
    target: str
    transform: str
    reason: str


@dataclass
class Check:
    """Before vs after on the probe inputs in one dtype."""

    model: str  # "runtime" (with swaps), "stock" (the saved module structure) or "deferred" (FlashNorm deferral)
    dtype: str
    max_abs: float
    max_rel: float
    top1: float | None
    min_cos: float | None
    passed: bool
    tol: float | None = None  # the max_rel this check had to stay within


class SwapKind(enum.Enum):
    """What a runtime swap puts in a module's place."""

    NORM = "norm"  # a normatlas Norm with the swap's spec and shape
    IDENTITY = "identity"
    FROZEN_BATCHNORM = "frozen_batchnorm"
    BIAS_INTO = "bias_into"  # the module gains a bias copied from ``source`` (a BatchNorm), which becomes identity


@dataclass
class Swap:
    """A runtime module replacement that is exact given the transformed weights.

    ``NORM``: a normatlas :class:`Norm` with ``spec`` and ``shape``, its ``weight`` / ``bias`` taken from the old
    module's parameters named in ``params`` (the probe's measured gain and bias); ``BIAS_INTO``: ``module`` gains a bias
    parameter copied from ``source``'s bias, or minus its running mean when it has no bias, and ``source``
    becomes identity. Stored in a manifest as :meth:`to_dict` (the spec by :meth:`NormSpec.to_dict`).
    """

    module: str
    kind: SwapKind
    spec: NormSpec | None = None
    shape: list[int] | None = None
    source: str | None = None
    params: dict[str, str] | None = None  # NORM: our "weight" / "bias" -> the old module's parameter, as measured

    def __post_init__(self) -> None:
        if not isinstance(self.kind, SwapKind):
            raise TypeError(f"kind={self.kind!r} must be a SwapKind")
        if self.kind is SwapKind.NORM and (self.spec is None or self.shape is None):
            raise ValueError(f"a {self.kind.value} swap of {self.module!r} needs a spec and a shape")
        if self.kind is SwapKind.BIAS_INTO and self.source is None:
            raise ValueError(f"a {self.kind.value} swap of {self.module!r} needs a source")

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "kind": self.kind.value,
            "spec": self.spec.to_dict() if self.spec is not None else None,
            "shape": self.shape,
            "source": self.source,
            "params": self.params,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Swap:
        spec = d.get("spec")
        return cls(
            str(d["module"]),
            parse_enum(SwapKind, d["kind"], name="kind"),
            NormSpec.from_dict(spec) if spec is not None else None,
            list(d["shape"]) if d.get("shape") is not None else None,
            d.get("source"),
            dict(d["params"]) if d.get("params") is not None else None,
        )


@dataclass
class Surgery:
    """The result of one transformation: the module-structure-preserving model (what is saved),
    the runtime swaps, and the proof."""

    transform: str
    stock: nn.Module
    swaps: list[Swap] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    stock_equivalent: bool = True
    config_updates: dict[str, Any] = field(default_factory=dict)
    deferred: list[tuple[str, list[str], Any]] = field(default_factory=list)  # runtime-only FlashNorm deferral

    def mark_untied(self, note: str) -> None:
        """Record that a tied weight was given its own copy: the note, and ``tie_word_embeddings=False`` in the
        saved config and in the live model's config (and its text config, for composite VLM configs)."""
        self.notes.append(note)
        config: Any = getattr(self.stock, "config", None)
        if isinstance(config, ModelConfig):  # ours: a frozen value, replaced (it has no saved config.json)
            self.stock.config = dataclasses.replace(config, tie_embeddings=False)  # type: ignore[assignment]
            return
        self.config_updates["tie_word_embeddings"] = False
        if config is not None:
            config.tie_word_embeddings = False
            text = getattr(config, "get_text_config", None)
            if callable(text):
                text().tie_word_embeddings = False

    @property
    def changed(self) -> bool:
        """Whether the transformation changes anything (a tensor, a runtime swap or the config)."""
        return bool(self.changes or self.swaps or self.config_updates)

    def nothing_reason(self) -> str:
        """Why nothing changed, in words: the refusals, or that the model has nothing this transform applies to."""
        if self.refusals:
            return f"every candidate was refused ({len(self.refusals)}; the reasons are listed)"
        return "the model has nothing this transformation applies to"

    @torch.no_grad()
    def restore_dtypes(self, dtypes: dict[str, torch.dtype]) -> list[str]:
        """Cast the saved model's tensors back to ``dtypes`` (name -> the stored dtype, e.g. from the loaded
        checkpoint's ``state_dict()``), after a transformation computed in a wider dtype: what is written keeps
        every tensor's dtype, and the proof (run after this) measures the rounding. Returns the cast names."""
        cast = []
        tensors = [
            *self.stock.named_parameters(remove_duplicate=False),
            *self.stock.named_buffers(remove_duplicate=False),
        ]
        for name, t in tensors:
            want = dtypes.get(name)
            if want is not None and t.dtype != want:
                t.data = t.data.to(want)
                cast.append(name)
        return cast

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def runtime(self) -> nn.Module:
        """A copy of the transformed model with the runtime swaps applied."""
        return apply_swaps(copy.deepcopy(self.stock), self.swaps)

    def manifest(self) -> dict[str, Any]:
        return {
            "format": "normatlas-surgery/1",
            "transform": self.transform,
            "stock_equivalent": self.stock_equivalent,
            "swaps": [s.to_dict() for s in self.swaps],
            "changes": [asdict(c) for c in self.changes],
            "refusals": [asdict(r) for r in self.refusals],
            "notes": self.notes,
            "checks": [asdict(c) for c in self.checks],
            "config_updates": self.config_updates,
        }

    def rows(self) -> list[dict[str, object]]:
        rows: list[dict[str, object]] = [
            {"target": c.target, "result": c.action, "detail": c.detail} for c in self.changes
        ]
        rows += [{"target": r.target, "result": f"refused ({r.transform})", "detail": r.reason} for r in self.refusals]
        return rows

    def check_rows(self) -> list[dict[str, object]]:
        """One typed row per check (floats, None where a measure does not apply, bool ``passed``)."""
        return [
            {
                "model": c.model,
                "dtype": c.dtype,
                "max_abs": c.max_abs,
                "max_rel": c.max_rel,
                "tol": c.tol,
                "top1": c.top1,
                "min_cos": c.min_cos,
                "passed": c.passed,
            }
            for c in self.checks
        ]


@torch.no_grad()
def apply_swaps(model: nn.Module, swaps: list[Swap]) -> nn.Module:
    """Replace modules in ``model`` as ``swaps`` say, carrying over parameter values."""
    for s in swaps:
        old = model.get_submodule(s.module)
        new: nn.Module
        if s.kind is SwapKind.NORM:
            assert s.spec is not None and s.shape is not None
            spec = s.spec
            ref = next(iter(old.parameters(recurse=False)), None)
            new = Norm(spec, tuple(s.shape), dtype=ref.dtype if ref is not None else None)
            if s.params is not None:  # the parameters the probe measured as the gain and the bias, whatever their names
                state = {ours: getattr(old, theirs) for ours, theirs in s.params.items() if ours in new.state_dict()}
            else:  # a manifest written before swaps carried their parameters
                state = {k: v for k, v in old.state_dict().items() if k in new.state_dict()}
            new.load_state_dict(state)
        elif s.kind is SwapKind.IDENTITY:
            new = nn.Identity()
        elif s.kind is SwapKind.FROZEN_BATCHNORM:
            new = FrozenBatchNorm.from_batchnorm(old)
        elif s.kind is SwapKind.BIAS_INTO:
            assert s.source is not None
            src: Any = model.get_submodule(s.source)
            shift = src.bias if src.bias is not None else -src.running_mean  # a BatchNorm without affine
            old.bias = nn.Parameter(shift.detach().clone().to(old.weight.dtype))
            model.set_submodule(s.source, nn.Identity())
            continue
        else:  # pragma: no cover - SwapKind is exhaustive
            raise AssertionError(s.kind)
        model.set_submodule(s.module, new)
    return model
