"""The vision classifier's ends, read off the dataflow: a patch convolution, a class token, learned positions, and
a head on the class token (or on [class token, mean of the patch tokens]), for :class:`~normatlas.blocks.ViTEncoder`.

Method: the convolution reading the pixel input is the patch embedding (kernel = stride, no padding); the
parameter concatenated before its tokens is the class token; the parameter added to that concatenation is the
position table; the linear producing the logits is the head, and which tokens it reads is the one candidate pool
(:class:`~normatlas.blocks.ViTPool`) whose value equals its recorded input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..analysis.graph import Graph, Ref
from ..analysis.ops import SHAPE_ONLY
from ..analysis.walk import strip
from ..blocks.model import ViTPool
from .design import Source
from .errors import PortError
from .read import Proj

__all__ = ["is_vision", "pixel_inputs", "vision_ends"]


def is_vision(cfg: Any) -> bool:
    """A config that takes images (``image_size`` and ``num_channels``) and no token vocabulary."""
    return isinstance(getattr(cfg, "image_size", None), int) and getattr(cfg, "vocab_size", None) is None


def pixel_inputs(cfg: Any, batch: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    size = int(cfg.image_size)
    return {"pixel_values": torch.randn(batch, int(getattr(cfg, "num_channels", 3)), size, size, generator=gen)}


def _param(g: Graph, idx: int) -> nn.Parameter | None:
    leaf = g.nodes[strip(g, idx, SHAPE_ONLY)]
    t = g.tensors.get(leaf.idx)
    return t if leaf.op == "param" and isinstance(t, nn.Parameter) else None


def _patch(g: Graph) -> tuple[nn.Conv2d, int]:
    convs = [s for s in g.spans if isinstance(s.module, nn.Conv2d) and s.inputs]
    convs = [s for s in convs if g.nodes[strip(g, s.inputs[0], SHAPE_ONLY)].op == "input"]
    if len(convs) != 1:
        raise PortError([f"{len(convs)} convolutions read the pixels"])
    conv = convs[0].module
    assert isinstance(conv, nn.Conv2d)
    square = conv.kernel_size == conv.stride and conv.kernel_size[0] == conv.kernel_size[1]
    if not square or conv.padding != (0, 0) or conv.groups != 1 or conv.dilation != (1, 1) or conv.bias is None:
        raise PortError(["a patch embedding that is not a square, stride-equals-kernel convolution with bias"])
    return conv, convs[0].outputs[0]


def _tokens(g: Graph, patches: int) -> tuple[nn.Parameter, nn.Parameter]:
    """The class token (concatenated first) and the position table (added to the concatenation)."""
    for n in g.nodes:
        if n.op != "cat" or not n.args or not isinstance(n.args[0], (list, tuple)) or len(n.args[0]) != 2:
            continue
        first, second = n.args[0]
        if not (isinstance(first, Ref) and isinstance(second, Ref)) or not _feeds(g, patches, second.idx):
            continue
        cls = _param(g, first.idx)
        for u in g.users(n.idx):
            pos = next((p for i in u.inputs if i != n.idx and (p := _param(g, i)) is not None), None)
            if u.op == "add" and cls is not None and pos is not None:
                return cls, pos
    raise PortError(["no class token concatenated before the patch tokens with a learned position table added"])


def _feeds(g: Graph, a: int, b: int) -> bool:
    return a == b or g.feeds(a, b)


def _pool(g: Graph, head: Proj, last: int) -> ViTPool:
    x, h = g.tensors[last], g.tensors[head.input]
    cands = {ViTPool.CLS: x[:, 0], ViTPool.CLS_AND_MEAN: torch.cat((x[:, 0], x[:, 1:].mean(dim=1)), dim=-1)}
    for pool, value in cands.items():
        if value.shape == h.shape and torch.allclose(value, h, atol=1e-6):
            return pool
    raise PortError(["a classifier head that reads neither the class token nor [class token, mean of the patches]"])


def vision_ends(g: Graph, projs: list[Proj], last: int, cfg: Any) -> tuple[dict[str, Any], dict[str, Source]]:
    """The ViTConfig fields and our parameter sources of the patch embedding, tokens and head (``last``: the node
    the head's pool reads, the final norm's output or the last stream value)."""
    conv, patches = _patch(g)
    cls, pos = _tokens(g, patches)
    out = g.outputs[0] if g.outputs else -1
    heads = [p for p in projs if p.kind == "linear" and _feeds(g, p.output, out) and _feeds(g, last, p.input)]
    if len(heads) != 1:
        raise PortError(["the logits are not one linear head on the pooled tokens"])
    head = heads[0]
    side = int(cfg.image_size)
    fields = dict(
        image_size=side, patch_size=conv.kernel_size[0], in_chans=conv.in_channels,
        num_classes=head.weight().shape[0], pool=_pool(g, head, last),
    )  # fmt: skip
    if pos.shape[1] != (side // conv.kernel_size[0]) ** 2 + 1:
        raise PortError([f"a position table of {pos.shape[1]} rows for {(side // conv.kernel_size[0]) ** 2} patches"])
    sources = {
        "patch_embed.weight": Source(conv.weight), "patch_embed.bias": Source(conv.bias),  # type: ignore[arg-type]
        "cls_token": Source(cls), "pos_embed": Source(pos), "head.weight": Source(head.weight()),
    }  # fmt: skip
    if head.bias() is None:
        raise PortError(["a classifier head without bias"])
    sources["head.bias"] = Source(head.bias())  # type: ignore[arg-type]
    return fields, sources
