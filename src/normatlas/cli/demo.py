"""``normatlas demo``: the taxonomy, then every preset checked against its torch / HF peer."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..spec import CastOrder, GainConvention
from . import _progress as progress
from ._format import Section, add_format_option, emit

if TYPE_CHECKING:  # torch comes with the run, not with `normatlas demo --help`
    import torch
    from torch import nn


@dataclass(frozen=True)
class Peer:
    """One preset beside its peer (torch.nn or HF transformers): both built from nothing, run on ``shape``.

    ``gain_convention`` is the peer's, stated here rather than guessed from its name: the random gains start
    around the identity of that convention (1 for ``w``, 0 for Gemma's ``1 + w``).
    """

    name: str
    ours: Callable[[], nn.Module]
    peer: Callable[[], nn.Module]
    shape: tuple[int, ...]
    gain_convention: GainConvention = GainConvention.W

    @property
    def gain_identity(self) -> float:
        return 0.0 if self.gain_convention is GainConvention.ONE_PLUS_W else 1.0


def _peers() -> list[Peer]:
    """Every preset checked against a peer (the HF ones only when transformers is installed)."""
    from torch import nn

    from .. import presets

    d, c = 257, 12
    out = [
        Peer("LayerNorm", lambda: presets.LayerNorm(d), lambda: nn.LayerNorm(d), (4, 33, d)),
        Peer("RMSNorm", lambda: presets.RMSNorm(d), lambda: nn.RMSNorm(d), (4, 33, d)),
        Peer("GroupNorm", lambda: presets.GroupNorm(3, c), lambda: nn.GroupNorm(3, c), (4, c, 9, 11)),
        Peer("InstanceNorm2d", lambda: presets.InstanceNorm2d(c, affine=True),
             lambda: nn.InstanceNorm2d(c, affine=True), (4, c, 9, 11)),
    ]  # fmt: skip
    try:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        return out
    out += [
        Peer("RMSNorm(cast before gain)", lambda: presets.RMSNorm(d, 1e-6, cast_order=CastOrder.BEFORE_GAIN),
             lambda: LlamaRMSNorm(d, 1e-6), (4, 33, d)),
        Peer("GemmaRMSNorm", lambda: presets.GemmaRMSNorm(d), lambda: GemmaRMSNorm(d), (4, 33, d),
             GainConvention.ONE_PLUS_W),
    ]  # fmt: skip
    return out


def check_presets(dtypes: tuple[torch.dtype, ...] | None = None) -> list[dict[str, Any]]:
    """Run each preset and its peer on the same random input and weights; report the max error
    (``dtypes``: float32 and bfloat16 by default)."""
    import torch

    from ..backend import Backend
    from ..modules import Norm

    dtypes = (torch.float32, torch.bfloat16) if dtypes is None else dtypes
    rows = []
    for row in _peers():
        name, ours_fn, peer_fn, shape = row.name, row.ours, row.peer, row.shape
        for dtype in dtypes:
            gen = torch.Generator().manual_seed(0)
            ours, peer, default = ours_fn().to(dtype), peer_fn().to(dtype), ours_fn().to(dtype)
            assert isinstance(ours, Norm) and isinstance(default, Norm)
            ours.backend = Backend.REFERENCE  # the bit-for-bit claims are the reference path's; default: AUTO
            with torch.no_grad():
                for p in peer.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + row.gain_identity)
            ours.load_state_dict(peer.state_dict())
            default.load_state_dict(peer.state_dict())
            x = (torch.randn(shape, generator=gen) * 3 + 1).to(dtype)
            a, b = ours(x), peer(x)
            err = (a.double() - b.double()).abs().max().item()
            err_default = (default(x).double() - b.double()).abs().max().item()
            rows.append({
                "layer": name, "peer": f"{type(peer).__module__.split('.')[0]}.{type(peer).__name__}",
                "dtype": str(dtype).removeprefix("torch."), "reference err": err,
                "bit-exact": torch.equal(a, b),
                "default": default.backend_in_use().split(" (")[0].removeprefix("auto: "),
                "default err": err_default,
            })  # fmt: skip
    return rows


def configure_demo(p: argparse.ArgumentParser) -> None:
    add_format_option(p)


def demo(args: argparse.Namespace) -> int:
    from ..taxonomy import taxonomy_table

    with progress.phase("running every preset against its peer"):
        checks = check_presets()
    emit(
        [
            Section("taxonomy", taxonomy_table(), "== the taxonomy: which axes you reduce names the layer =="),
            Section("presets", checks, "== presets of one core against their peers (same weights) =="),
        ],
        args.format,
    )
    return 0
