"""The essay's one-line taxonomy as code: the reduced axes name the layer.

Say the tensor is ``x[n, c, s]``: sample n, feature/channel c, position s. Which of
those axes the statistics are computed over is the single decision that names a
normalization layer, and whether ``n`` is among them decides whether one example's
output depends on the others in its batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .spec import Axis, Layout, NormSpec

__all__ = ["AXIS_LETTERS", "Taxon", "classify", "taxonomy_table"]

S, C, P = Axis.SAMPLE, Axis.FEATURE, Axis.POSITION

#: how each convention spells the essay's n, c, s
AXIS_LETTERS = {
    "vision": {S: "N", C: "C", P: "H,W"},
    "sequence": {S: "B", C: "D", P: "T"},
}


@dataclass(frozen=True)
class Taxon:
    """What a reduction is called and what it implies."""

    name: str
    reduce: frozenset[Axis]
    groups: str  # "1", "G", or "C" (one group per channel)
    per: str  # the slice one statistic describes, e.g. "(n, c)"
    batch_dependent: bool
    note: str


def classify(
    layout: Layout, reduce: Iterable[Axis], *, groups: int = 1, num_channels: int | None = None, center: bool = True
) -> Taxon:
    """Name the normalization layer that reduces ``reduce`` in ``layout``.

    ``groups`` splits the channel axis; with ``num_channels`` given, ``groups == 1`` and
    ``groups == num_channels`` are recognised as the LayerNorm / InstanceNorm end points
    of GroupNorm. ``center=False`` names the RMS variant (RMSNorm, or "RMS GroupNorm").
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout={layout!r} must be a Layout")
    axes = frozenset(reduce)
    bad = [a for a in axes if not isinstance(a, Axis)]
    if bad or not axes:
        allowed = ", ".join(f"Axis.{a.name}" for a in Axis)
        raise ValueError(f"reduce={set(reduce)!r} must be a non-empty set of {allowed}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups={groups!r} must be an integer >= 1")
    if num_channels is not None and num_channels % groups:
        raise ValueError(f"groups={groups} must divide num_channels={num_channels}")
    if groups > 1 and C not in axes:
        raise ValueError(f"groups={groups} needs Axis.FEATURE among the reduced axes")
    per_channel_groups = num_channels is not None and groups == num_channels and groups > 1
    if per_channel_groups:  # GroupNorm with one channel per group reduces no channel at all
        axes, groups = axes - {C}, 1
        if not axes:
            raise ValueError("groups == num_channels with only Axis.FEATURE reduced leaves nothing to reduce")
    kept = [{S: "n", C: "c", P: "s"}[a] for a in (S, C, P) if a not in axes]
    kept += ["group"] if groups > 1 else []
    per = "(" + ", ".join(kept) + ")" if kept else "(whole batch)"
    vision = not layout.channels_last
    name, note = _name(axes, groups > 1, vision)
    if not center:
        name = name.replace("LayerNorm", "RMSNorm").replace("GroupNorm", "RMS GroupNorm")
        name = name.replace("InstanceNorm", "RMS InstanceNorm").replace("BatchNorm", "RMS BatchNorm")
    return Taxon(
        name=name,
        reduce=axes,
        groups="G" if groups > 1 else ("C" if per_channel_groups else "1"),
        per=per,
        batch_dependent=S in axes,
        note=note,
    )


def _name(axes: frozenset[Axis], grouped: bool, vision: bool) -> tuple[str, str]:
    if grouped:
        if P in axes and S not in axes:
            return "GroupNorm", "batch-independent; small-batch detection and segmentation"
        if S not in axes:
            return "grouped LayerNorm (per position)", "e.g. a group RMSNorm over head groups"
        return "batch-group norm", "groups of channels pooled across the batch"
    table: dict[frozenset[Axis], tuple[str, str]] = {
        frozenset({S, P}): ("BatchNorm", "one statistic per channel, pooled over the batch and positions"),
        frozenset({S}): ("BatchNorm (per position)", "BatchNorm1d on (N, C); per position if positions remain"),
        frozenset({C}): (
            ("LayerNorm2d (channels at each position)", "ConvNeXt / timm LayerNorm2d")
            if vision
            else ("LayerNorm", "per token: the transformer default")
        ),
        frozenset({C, P}): (
            ("LayerNorm (whole sample)", "torch.nn.LayerNorm((C, H, W)); GroupNorm with G = 1")
            if vision
            else ("LayerNorm over the sequence", "normalized_shape = (T, D)")
        ),
        frozenset({P}): ("InstanceNorm", "per sample and channel; style transfer; GroupNorm with G = C"),
        frozenset({S, C}): ("batch-feature norm", "pools features across the batch at each position"),
        frozenset({S, C, P}): ("whole-batch norm", "one statistic for the whole batch"),
    }
    return table[axes]


#: the rows of the taxonomy table: (reduce, groups) as the essay lists them
_ROWS: tuple[tuple[frozenset[Axis], int], ...] = (
    (frozenset({S, P}), 1),
    (frozenset({C, P}), 1),
    (frozenset({C}), 1),
    (frozenset({P}), 1),
    (frozenset({C, P}), 2),
    (frozenset({S}), 1),
)


def taxonomy_table() -> list[dict[str, str]]:
    """One row per reduction, with its name and slice in the vision and sequence conventions."""
    rows = []
    for axes, groups in _ROWS:
        row: dict[str, str] = {"reduce (n, c, s)": _letters(axes, None, groups)}
        for convention, layout in (("vision", Layout.NCHW), ("sequence", Layout.BTD)):
            taxon = classify(layout, axes, groups=groups)
            row[f"{convention} reduces"] = _letters(axes, convention, groups)
            row[f"{convention} name"] = taxon.name
        taxon = classify(Layout.NCHW, axes, groups=groups)
        row["stat per"] = taxon.per
        row["batch-dependent"] = "YES" if taxon.batch_dependent else "no"
        rows.append(row)
    return rows


def _letters(axes: frozenset[Axis], convention: str | None, groups: int) -> str:
    letters = {S: "n", C: "c", P: "s"} if convention is None else AXIS_LETTERS[convention]
    out = []
    for a in (S, C, P):
        if a in axes:
            out.append(f"{letters[a]}/G" if a is C and groups > 1 else letters[a])
    return ",".join(out)


def spec_taxon(spec: NormSpec, num_channels: int | None = None) -> Taxon:
    """The taxon of a spec."""
    return classify(spec.layout, spec.reduce, groups=spec.groups, num_channels=num_channels, center=spec.center)
