"""``POST /api/inspect``: a model's normalization design read off its dataflow, as the CLI's ``inspect`` does.

A target is a transformers model type (built tiny, random weights, offline) or a checkpoint folder
inside the server's ``--root``; a folder that resolves outside it is refused (:class:`Forbidden`, 403),
and ``module:factory`` targets (which import code) are not accepted from the page at all. A target is
checked at once; its inspection then runs as a job (:mod:`.inspect_jobs`: one at a time, on one worker
thread, the phases timed by the server) whose report is cached per target.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..vocabulary import PlacementKind, SublayerKind, branch_scale_word
from .sites import site_views

__all__ = ["Busy", "Forbidden", "Targets", "Unreadable", "drawing", "report_view", "run_target"]

_MODEL_TYPE = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
_KEYS = frozenset({"model_type", "folder"})
MAX_FOLDERS = 200


class Forbidden(PermissionError):
    """A path outside ``--root``."""


class Busy(RuntimeError):
    """The inspection queue is full (503, with ``Retry-After``)."""


class Unreadable(ValueError):
    """A valid target whose model could not be built or read (a config that does not build, a model that does not
    run): the request was understood and cannot be answered (422), with the failure named; never a 500."""


def _slots(sub: Any) -> dict[str, bool]:
    """An inspected sublayer as the drawing's slots: norms on the branch input, on its output, after the add."""
    return {"pre": bool(sub.pre), "post": bool(sub.out), "after_add": bool(sub.post)}


def drawing(report: Any) -> dict[str, Any] | None:
    """The first layer's sublayers in the placement drawing's shape (``attn`` / ``ffn`` slots), from the report."""
    first = [s for s in report.sublayers if s.layer == report.sublayers[0].layer] if report.sublayers else []
    if not first:
        return None
    parallel = report.placement is PlacementKind.PARALLEL or first[0].kind is SublayerKind.PARALLEL
    attn = first[0]
    ffn = first[1] if len(first) > 1 else first[0]
    return {
        "attn": _slots(attn) | {"kind": attn.placement.value},
        "ffn": _slots(ffn) | {"kind": ffn.placement.value},
        "parallel": parallel,
        "shared_pre_norm": True,
        "qkv_norm": False,
        "residual_alpha": attn.skip_scale if attn.skip_scale is not None else 1.0,
        "branch_scale": 1.0,
        "gate": "none",
        "branch_label": branch_scale_word(attn.branch_scale)
        or branch_scale_word(report.branch_scale),  # the inspector's words: a constant, "learned scalar", "per-channel"
        "pre_norm_scale": "none",
        "name": report.model,
        "kind": report.placement.value,
    }


class Targets:
    """The targets the page may inspect: transformers model types, and checkpoint folders under a root."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def folders(self) -> list[str]:
        """Checkpoint folders (with a config.json) under the root, two levels deep, relative to it."""
        found = []
        for depth in ("*/config.json", "*/*/config.json"):
            for cfg in sorted(self.root.glob(depth)):
                if cfg.resolve().is_relative_to(self.root):
                    found.append(cfg.parent.relative_to(self.root).as_posix())
        return found[:MAX_FOLDERS]

    def resolve_folder(self, folder: str) -> Path:
        """``folder`` (relative to the root) as a path inside the root, or :class:`Forbidden`."""
        if not isinstance(folder, str) or not folder or "\x00" in folder:
            raise ValueError(f"folder={folder!r} must be a non-empty path relative to the root")
        path = (self.root / folder).resolve()
        if not path.is_relative_to(self.root):
            raise Forbidden(f"folder={folder!r} is outside the served root; only folders under it can be inspected")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"folder={folder!r} has no config.json under the served root")
        return path

    def target(self, body: Any) -> tuple[str, str, str]:
        """(cache key, CLI target, the target as the page names it) of a body ``{"model_type": ...}`` or
        ``{"folder": ...}``."""
        if not isinstance(body, dict) or len(set(body) & _KEYS) != 1 or set(body) - _KEYS:
            raise ValueError(
                f"the body must be one of {{'model_type': TYPE}} or {{'folder': PATH}}; got {body!r}"[:300]
            )
        if "folder" in body:
            path = self.resolve_folder(body["folder"])
            return f"folder:{path}", str(path), path.relative_to(self.root).as_posix()
        mt = body["model_type"]
        if not isinstance(mt, str) or not _MODEL_TYPE.fullmatch(mt):
            raise ValueError(f"model_type={mt!r} must be a transformers model type such as 'llama' or 'gpt2'"[:300])
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if mt not in CONFIG_MAPPING:
            raise ValueError(f"model_type={mt!r} is not a model type of the installed transformers")
        return f"type:{mt}", mt, mt


def report_view(report: Any) -> dict[str, Any]:
    """The page's report: ``InspectionReport.to_dict()`` with the placement ``drawing`` and every norm ``sites``
    of the first layer (with their arithmetic), ``seconds`` rounded (the inspector's own trace-and-read time)."""
    doc = report.to_dict() | {"drawing": drawing(report), "sites": site_views(report)}
    doc["seconds"] = round(float(doc.get("seconds") or 0.0), 3)
    return doc


def run_target(target: str) -> dict[str, Any]:
    """Build and inspect a CLI target (a model type or a folder path), as :func:`report_view`; a target that does
    not build or run raises :class:`Unreadable`."""
    from ..inspect import inspect_target

    try:
        report = inspect_target(target)
    except Exception as exc:  # building or tracing a model fails in many ways: one named line
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")[:300]
        raise Unreadable(f"cannot build or inspect {target}: {type(exc).__name__}: {first}") from exc
    return report_view(report)
