"""The record a model converter returns: one row per module it replaced."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

__all__ = ["Change", "ConversionReport", "replace_modules", "set_submodule"]


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


Built = tuple[nn.Module, "list[str] | tuple[str, ...]", str]  # (the replacement, what it kept, a note)


def replace_modules(
    model: nn.Module,
    build: Callable[[str, nn.Module], Built | None],
    include: Callable[[str, nn.Module], bool] | None = None,
) -> ConversionReport:
    """The one converter walk: replace, in place, every submodule (never the root) for which ``build(path, module)``
    returns a replacement, in the module's train / eval mode; one :class:`Change` per replacement."""
    report = ConversionReport()
    for path, module in list(model.named_modules()):
        if not path or (include is not None and not include(path, module)):
            continue
        built = build(path, module)
        if built is None:
            continue
        new, kept, note = built
        new.train(module.training)
        set_submodule(model, path, new)
        report.changes.append(Change(path, type(module).__name__, type(new).__name__, tuple(kept), note))
    return report
