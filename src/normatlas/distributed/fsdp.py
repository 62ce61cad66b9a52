"""FSDP2 (``fully_shard``) units that keep each block's norm parameters with the block's matrices.

Under FSDP2 every ``fully_shard`` unit all-gathers its parameters before its forward (and again before its backward
when it reshards after the forward) and reduce-scatters their gradients: one collective per unit and phase. A norm
weight is a few hundred bytes, so a unit of its own buys nothing and costs three collectives a step; essay rule 8:
"the norm parameters are tiny DTensors that are cheap to shard but generate a lot of small collectives - one reason
people group them". :func:`shard_model` groups them: one unit per block (its norms, QK-norms and residual gates with
its projections) and the root unit for the embedding, the embedding / final norms and the head.
``group_norms=False`` gives each norm its own unit (the ungrouped layout, for comparison with
:mod:`normatlas.distributed.counting`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

__all__ = ["norm_module_paths", "shard_model"]

_SLOTS = ("attn_pre_norm", "attn_post_norm", "attn_after_norm", "ffn_pre_norm", "ffn_post_norm", "ffn_after_norm")


def norm_module_paths(model: nn.Module) -> list[str]:
    """The paths of a TransformerLM's norm modules, read from its structure (slots, QK / V norms, embed / final)."""
    from ..blocks import TransformerLM

    if not isinstance(model, TransformerLM):
        raise TypeError(f"model={type(model).__name__} must be a TransformerLM; pass norms= for other models")
    path = {id(m): n for n, m in model.named_modules()}
    found = [model.embed_norm]
    for b in model.blocks():
        found += [getattr(b, s) for s in _SLOTS] + [b.attn.q_norm, b.attn.k_norm, b.attn.v_norm]
    found += [model.final_norm, model.head_norm]
    return [path[id(m)] for m in found if m is not None and any(True for _ in m.parameters())]


def _blocks(model: nn.Module, blocks: Sequence[str] | None) -> list[str]:
    if blocks is not None:
        if isinstance(blocks, str) or not all(isinstance(b, str) for b in blocks):
            raise TypeError(f"blocks={blocks!r} must be a sequence of module paths")
        return list(blocks)
    from ..blocks import TransformerLM

    if not isinstance(model, TransformerLM):
        raise TypeError(f"model={type(model).__name__} is not a TransformerLM; pass blocks= (the layer paths)")
    return [f"layers.{i}" for i in range(len(model.layers))]


def shard_model(
    model: nn.Module, mesh: DeviceMesh, *, group_norms: bool = True, blocks: Sequence[str] | None = None,
    norms: Sequence[str] | None = None, **fsdp_kwargs: Any,
) -> nn.Module:  # fmt: skip
    """Apply ``fully_shard`` over the 1-D data-parallel ``mesh``: one unit per block, then the root; return the model.

    ``group_norms=True`` (default): each norm stays in its block's unit (one all-gather per block, not one per norm).
    ``False``: each norm (``norms``, default :func:`norm_module_paths`) gets its own unit first. ``blocks``: the
    block paths (default: a TransformerLM's ``layers.{i}``). ``fsdp_kwargs`` go to every ``fully_shard`` call
    (``reshard_after_forward``, ``mp_policy``, ...). For FSDP x TP, :func:`~normatlas.distributed.parallelize`
    over the TP sub-mesh first, then pass the DP sub-mesh here.
    """
    if not isinstance(group_norms, bool):
        raise TypeError(f"group_norms={group_norms!r} must be a bool")
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"mesh={mesh!r} must be a 1-D DeviceMesh (the data-parallel dim of a 2-D mesh: mesh['dp'])")
    units = _blocks(model, blocks)
    if not group_norms:
        for p in norm_module_paths(model) if norms is None else list(norms):
            fully_shard(model.get_submodule(p), mesh=mesh, **fsdp_kwargs)
    for p in units:
        fully_shard(model.get_submodule(p), mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model
