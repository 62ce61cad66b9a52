"""Inspect a vision encoder's (or a VLM vision tower's) normalization design from its dataflow.

Method: one eager forward of the tower on an image tensor is recorded with the shared
recorder (:func:`normatlas.analysis.record`); the token-model analysis
(:func:`.analyze.analyze`) reads the blocks exactly as for a language model (the residual
stream is the patch-token tensor, found as the input of the most frequent norm shape), so
the operator, eps, block placement, LayerScale branch scales, the norm on the patch
embeddings before the first block (``embedding`` role, e.g. CLIP's ``pre_layrnorm``) and
the norm on the whole last stream value (``final``) come out unchanged. What a vision tower
adds after its blocks is then read off the same graph:

* ``pooled``: a norm whose input is a token subset of the last stream value, reached from it
  only through selections and reshapes (CLIP normalizes the CLS row: ``post_layernorm``);
* ``merger``: a norm on the last stream whose output rows are regrouped into wider rows
  (``view(-1, k*D)``) before anything else reads them (Qwen2-VL's PatchMerger ``ln_q``);
* ``head``: any other norm downstream of the last block (SigLIP's attention-pooling head).

Guaranteed property: every field is a fact about the executed computation (which ops ran,
on which tensors), never read from parameter or class names; module paths appear in the
report as labels only.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..analysis.graph import Graph, record
from ..analysis.ops import CASTS, SHAPE_ONLY
from ..analysis.walk import strip
from ..vocabulary import Operator, SiteRole
from .norms import Site, find_sites
from .report import InspectionReport, NormInfo

__all__ = ["VisionReport", "default_pixel_values", "inspect_vision", "vision_report"]

_SELECT = frozenset({"getitem", "select", "narrow", "index_select", "squeeze", "unsqueeze"})
_BLOCK_ROLES = frozenset({SiteRole.PRE, SiteRole.OUT, SiteRole.POST})
_BATCH_STAT = frozenset({"batch_norm", "instance_norm"})  # fused calls whose statistics span the batch / a sample


@dataclass
class VisionReport(InspectionReport):
    """:class:`InspectionReport` of a vision tower plus what follows its blocks.

    ``embedding_norm`` is the norm on the patch(+position) embeddings before the first
    block; ``final_norm`` the norm on every token of the last stream value.
    """

    tokens: int | None = None  # tokens in the residual stream (patches, plus CLS/registers)
    pooled_norm: Operator = Operator.NONE  # norm on a token subset (CLS) of the last stream
    merger_norm: Operator = Operator.NONE  # norm whose output rows are merged (k tokens -> one row)
    head_norm: Operator = Operator.NONE  # norm inside a pooling head / connector after the blocks
    batch_stat_norms: int = 0  # BatchNorm / InstanceNorm calls (conv stems, ResNets): statistics over the batch


def default_pixel_values(model: nn.Module, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """A seeded ``(batch, num_channels, image_size, image_size)`` image for a transformers vision config."""
    cfg = getattr(model, "config", None)
    size = getattr(cfg, "image_size", None)
    if isinstance(size, (list, tuple)):
        size = size[0]
    if size is None and isinstance(getattr(cfg, "num_channels", None), int):
        size = 64  # a convolutional net without a fixed input size (ResNet, RegNet) reads any image
    if not isinstance(size, int):
        raise ValueError(
            f"pixel_values is required: {type(model).__name__} has no config.image_size (got {size!r}); "
            "pass an image tensor"
        )
    channels = int(getattr(cfg, "num_channels", 3))
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, channels, size, size, generator=gen).to(dtype)


def _merges_rows(g: Graph, site: Site) -> bool:
    """The normalized rows (size D) are regrouped into rows of k*D, k > 1, before anything else reads them."""
    stack, seen = [site.output], set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        for u in g.users(i):
            if u.op in ("view", "reshape", "flatten") and u.shape and u.shape[-1] > site.size:
                if u.shape[-1] % site.size == 0:
                    return True
            elif u.op in CASTS:
                stack.append(u.idx)
    return False


def _selects_tokens(g: Graph, site: Site, stream: tuple[int, ...], last: int) -> bool:
    """The site reads fewer rows than the stream, taken from a stream value fed by ``last``
    through selections / reshapes / casts only."""
    shape = g.nodes[site.input].shape
    if shape is None or math.prod(shape) >= math.prod(stream):
        return False
    cur, picked = site.input, False
    while True:
        n = g.nodes[cur]
        if n.op in _SELECT | SHAPE_ONLY and n.inputs:
            picked |= n.op in _SELECT
            cur = strip(g, cur, SHAPE_ONLY | _SELECT)
            continue
        return picked and n.shape == stream and (cur == last or g.feeds(last, cur))


def _vision_roles(g: Graph, report: InspectionReport) -> tuple[dict[int, SiteRole], int | None, list[str]]:
    """New roles for the norms after the blocks, the stream token count, and notes."""
    sites = {s.node: s for s in find_sites(g)}
    block = [n for n in report.norms if n.role in _BLOCK_ROLES and n.index in sites]
    if not block:
        return {}, None, ["no residual blocks with norms found: nothing after the blocks classified"]
    first = min(block, key=lambda n: n.index)
    stream = g.nodes[sites[first.index].input].shape
    if stream is None or len(stream) < 2:
        return {}, None, [f"stream shape {stream} has no token axis"]
    last_out = sites[max(n.index for n in block)].output
    roles: dict[int, SiteRole] = {}
    for info in report.norms:
        site = sites.get(info.index)
        if site is None or info.index <= last_out or not g.feeds(last_out, site.input):
            continue
        if info.role not in (SiteRole.FINAL, SiteRole.OTHER):
            continue
        if _merges_rows(g, site):
            roles[info.index] = SiteRole.MERGER
        elif info.role is SiteRole.OTHER:
            roles[info.index] = SiteRole.POOLED if _selects_tokens(g, site, stream, last_out) else SiteRole.HEAD
    return roles, stream[-2], []


def _first(norms: list[NormInfo], role: SiteRole) -> Operator:
    return next((n.operator for n in norms if n.role is role), Operator.NONE)


def inspect_vision(
    model: nn.Module,
    pixel_values: torch.Tensor | None = None,
    *,
    name: str | None = None,
    probe: bool = True,
    **inputs: Any,
) -> VisionReport:
    """Report a vision tower's normalization design from one recorded forward on an image.

    ``pixel_values`` is passed as the first positional argument (for a transformers vision
    model it defaults to a seeded image of ``config.image_size``); ``inputs`` go in as
    keyword arguments (e.g. ``grid_thw`` for Qwen2-VL's tower, whose first argument is the
    flattened patch tensor). Raises :class:`~normatlas.inspect.UntraceableModel` when the
    model does not run on these inputs.
    """
    from . import UntraceableModel

    t0 = time.perf_counter()
    if pixel_values is None:
        pixel_values = default_pixel_values(model)
    if not isinstance(pixel_values, torch.Tensor):
        raise TypeError(f"pixel_values must be a torch.Tensor, got {type(pixel_values).__name__}")
    if not pixel_values.is_floating_point():
        raise ValueError(f"pixel_values must be a floating-point tensor, got dtype {pixel_values.dtype}")
    label = name or type(model).__name__
    model = model.eval()
    try:
        graph = record(model, (pixel_values,), inputs)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise UntraceableModel(f"cannot run {label} on pixel_values: {type(exc).__name__}: {first}") from exc
    report = vision_report(model, graph, label, probe=probe)
    report.seconds = time.perf_counter() - t0
    return report


def vision_report(model: nn.Module, graph: Graph, label: str, *, probe: bool = True) -> VisionReport:
    """The :class:`VisionReport` of a recorded tower run (the whole graph, or a VLM's tower part of one)."""
    from .analyze import analyze
    from .probe import check_sites

    base = analyze(graph, label)
    if probe:
        check_sites(model, graph, base)
    roles, tokens, notes = _vision_roles(graph, base)
    norms = [dataclasses.replace(n, role=roles[n.index]) if n.index in roles else n for n in base.norms]
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(InspectionReport)}
    fields.update(norms=norms, notes=[*base.notes, *notes])
    if base.final_norm is not Operator.NONE and _first(norms, SiteRole.FINAL) is Operator.NONE:
        fields["final_norm"] = Operator.NONE  # the only norm on the last stream merges rows: not a final norm
    return VisionReport(
        **fields,
        tokens=tokens,
        pooled_norm=_first(norms, SiteRole.POOLED),
        merger_norm=_first(norms, SiteRole.MERGER),
        head_norm=_first(norms, SiteRole.HEAD),
        batch_stat_norms=sum(1 for n in graph.nodes if n.op in _BATCH_STAT),
    )
