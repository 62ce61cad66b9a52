"""The record a model converter returns: one row per module it replaced."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

__all__ = ["Change", "ConversionReport", "set_submodule"]


@dataclass(frozen=True)
class Change:
    """One replaced module: where, from what, to what, and what was carried over."""

    path: str
    old: str
    new: str
    kept: tuple[str, ...] = ()
    note: str = ""


@dataclass
class ConversionReport:
    """What a converter changed, in the order it walked the model."""

    changes: list[Change] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.changes)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.changes)

    def rows(self) -> list[dict[str, str]]:
        """Plain rows for ``normatlas.cli._format.format_rows``."""
        return [
            {"path": c.path, "old": c.old, "new": c.new, "kept": ", ".join(c.kept), "note": c.note}
            for c in self.changes
        ]

    def __str__(self) -> str:
        if not self.changes:
            return "no modules changed"
        lines = [f"{len(self.changes)} module(s) changed:"]
        for c in self.changes:
            kept = f" (kept {', '.join(c.kept)})" if c.kept else ""
            note = f" [{c.note}]" if c.note else ""
            lines.append(f"  {c.path or '<root>'}: {c.old} -> {c.new}{kept}{note}")
        return "\n".join(lines)


def set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    """Replace the submodule at dotted ``path`` (not the root) with ``new``."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, new)
